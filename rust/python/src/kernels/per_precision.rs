//! One definition per kernel binding, stamped out once per precision.
//!
//! A `#[pyfunction]` cannot be generic, yet the float32 (`mod.rs`) and bfloat16
//! (`bf16.rs`, uint16 views of the bits) bindings of a kernel differ only in the
//! element type of the model's arrays and the kernel they call. Each macro here
//! takes the function's name, that element type and the kernel, so the Python
//! signature, its defaults and the argument plumbing exist once; the checks
//! themselves live in `checks.rs`.

/// The gated delta rule: `q`, `k`, `v`, gates, `z`, `norm_weight` and `out` in the
/// model's element type; the state pool is always float32.
macro_rules! delta_rule_binding {
    ($(#[$doc:meta])* $name:ident, $t:ty, $kernel:expr) => {
        $(#[$doc])*
        #[pyfunction]
        #[pyo3(signature = (q, k, v, state, query_start_loc, state_pages, has_initial_state, out, *,
                            item_base, key_heads, value_heads, scale, l2norm=true, g=None, beta=None,
                            a=None, b=None, a_log=None, dt_bias=None, z=None, norm_weight=None,
                            norm_eps=1e-6, checkpoint_positions=None, checkpoint_pages=None,
                            read_only=None))]
        #[allow(clippy::too_many_arguments)]
        pub(super) fn $name(
            py: Python<'_>,
            q: PyReadonlyArray2<'_, $t>,
            k: PyReadonlyArray2<'_, $t>,
            v: PyReadonlyArray2<'_, $t>,
            state: PyReadwriteArrayDyn<'_, f32>,
            query_start_loc: PyReadonlyArray1<'_, i64>,
            state_pages: PyReadonlyArray2<'_, i64>,
            has_initial_state: PyReadonlyArray1<'_, bool>,
            out: PyReadwriteArrayDyn<'_, $t>,
            item_base: usize,
            key_heads: usize,
            value_heads: usize,
            scale: f32,
            l2norm: bool,
            g: Option<PyReadonlyArray2<'_, $t>>,
            beta: Option<PyReadonlyArray2<'_, $t>>,
            a: Option<PyReadonlyArray2<'_, $t>>,
            b: Option<PyReadonlyArray2<'_, $t>>,
            a_log: Option<PyReadonlyArrayDyn<'_, $t>>,
            dt_bias: Option<PyReadonlyArrayDyn<'_, $t>>,
            z: Option<PyReadonlyArray2<'_, $t>>,
            norm_weight: Option<PyReadonlyArrayDyn<'_, $t>>,
            norm_eps: f32,
            checkpoint_positions: Option<PyReadonlyArray1<'_, i64>>,
            checkpoint_pages: Option<PyReadonlyArray2<'_, i64>>,
            read_only: Option<PyReadonlyArray1<'_, bool>>,
        ) -> PyResult<()> {
            let arrays = DeltaRuleArrays {
                q, k, v, state, query_start_loc, state_pages, has_initial_state, out, g, beta, a, b,
                a_log, dt_bias, z, norm_weight, checkpoint_positions, checkpoint_pages, read_only,
            };
            delta_rule_with(py, arrays, item_base, key_heads, value_heads, scale, l2norm, norm_eps, $kernel)
        }
    };
}

/// The causal depthwise conv1d with its paged state, all in one element type.
macro_rules! conv1d_binding {
    ($(#[$doc:meta])* $name:ident, $t:ty, $kernel:expr) => {
        $(#[$doc])*
        #[pyfunction]
        #[pyo3(signature = (x, weight, bias, state, query_start_loc, state_pages, has_initial_state, out, *,
                            item_base, silu=true, checkpoint_positions=None, checkpoint_pages=None,
                            read_only=None))]
        #[allow(clippy::too_many_arguments)]
        pub(super) fn $name(
            py: Python<'_>,
            x: PyReadonlyArray2<'_, $t>,
            weight: PyReadonlyArrayDyn<'_, $t>,
            bias: Option<PyReadonlyArrayDyn<'_, $t>>,
            state: PyReadwriteArrayDyn<'_, $t>,
            query_start_loc: PyReadonlyArray1<'_, i64>,
            state_pages: PyReadonlyArray2<'_, i64>,
            has_initial_state: PyReadonlyArray1<'_, bool>,
            out: PyReadwriteArrayDyn<'_, $t>,
            item_base: usize,
            silu: bool,
            checkpoint_positions: Option<PyReadonlyArray1<'_, i64>>,
            checkpoint_pages: Option<PyReadonlyArray2<'_, i64>>,
            read_only: Option<PyReadonlyArray1<'_, bool>>,
        ) -> PyResult<()> {
            conv1d_with(
                py, x, weight, bias, state, query_start_loc, state_pages, has_initial_state, out,
                (item_base, silu), (checkpoint_positions, checkpoint_pages, read_only), $kernel,
            )
        }
    };
}

/// Decode attention over the paged KV pool: `q`, the caches and `out` in one
/// element type.
macro_rules! decode_attention_binding {
    ($(#[$doc:meta])* $name:ident, $t:ty, $kernel:expr) => {
        $(#[$doc])*
        #[pyfunction]
        #[allow(clippy::too_many_arguments)]
        pub(super) fn $name(
            py: Python<'_>,
            q: PyReadonlyArray2<'_, $t>,
            k_cache: PyReadonlyArrayDyn<'_, $t>,
            v_cache: PyReadonlyArrayDyn<'_, $t>,
            rows_: PyReadonlyArray1<'_, i64>,
            seq_lens: PyReadonlyArray1<'_, i64>,
            block_tables: PyReadonlyArray2<'_, i32>,
            scale: f32,
            out: PyReadwriteArrayDyn<'_, $t>,
        ) -> PyResult<()> {
            decode_with(py, q, k_cache, v_cache, rows_, seq_lens, block_tables, scale, out, $kernel)
        }
    };
}

/// RMSNorm with an optional fused residual add, every array in one element type.
macro_rules! rms_norm_binding {
    ($(#[$doc:meta])* $name:ident, $t:ty, $kernel:expr) => {
        $(#[$doc])*
        #[pyfunction]
        #[pyo3(signature = (x, weight, eps, out, residual=None, centered=true))]
        pub(super) fn $name(
            py: Python<'_>,
            x: PyReadonlyArrayDyn<'_, $t>,
            weight: PyReadonlyArrayDyn<'_, $t>,
            eps: f32,
            out: PyReadwriteArrayDyn<'_, $t>,
            residual: Option<PyReadwriteArrayDyn<'_, $t>>,
            centered: bool,
        ) -> PyResult<()> {
            rms_norm_with(py, x, weight, eps, out, residual, centered, $kernel)
        }
    };
}

/// Per-head RMSNorm then rotary embedding of q or k, every array in one element type.
macro_rules! qk_norm_rope_binding {
    ($(#[$doc:meta])* $name:ident, $t:ty, $kernel:expr) => {
        $(#[$doc])*
        #[pyfunction]
        #[allow(clippy::too_many_arguments)]
        pub(super) fn $name(
            py: Python<'_>,
            x: PyReadonlyArray2<'_, $t>,
            heads: usize,
            head_stride: usize,
            weight: PyReadonlyArrayDyn<'_, $t>,
            eps: f32,
            cos: PyReadonlyArray2<'_, $t>,
            sin: PyReadonlyArray2<'_, $t>,
            out: PyReadwriteArrayDyn<'_, $t>,
        ) -> PyResult<()> {
            qk_norm_rope_with(py, x, (heads, head_stride), weight, eps, cos, sin, out, $kernel)
        }
    };
}
