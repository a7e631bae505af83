//! The bfloat16 bindings: the same kernels as the float32 ones in `mod.rs`, for a
//! bfloat16 model. numpy has no bfloat16, so Python passes `tensor.view(torch.uint16)`
//! views of the bits; the DeltaNet state stays float32.

use super::*;

/// [`paged_attention_decode`] for a bfloat16 model: `q`, the caches and `out` bfloat16
/// bits (uint16 views).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub(super) fn paged_attention_decode_bf16(
    py: Python<'_>,
    q: PyReadonlyArray2<'_, u16>,
    k_cache: PyReadonlyArrayDyn<'_, u16>,
    v_cache: PyReadonlyArrayDyn<'_, u16>,
    rows_: PyReadonlyArray1<'_, i64>,
    seq_lens: PyReadonlyArray1<'_, i64>,
    block_tables: PyReadonlyArray2<'_, i32>,
    scale: f32,
    out: PyReadwriteArrayDyn<'_, u16>,
) -> PyResult<()> {
    let kernel = hybridserve_cpu_kernels::attention::paged_attention_decode_bf16;
    decode_with(py, q, k_cache, v_cache, rows_, seq_lens, block_tables, scale, out, kernel)
}

/// [`rms_norm`] for a bfloat16 model: every array bfloat16 bits (uint16 views).
#[pyfunction]
#[pyo3(signature = (x, weight, eps, out, residual=None, centered=true))]
pub(super) fn rms_norm_bf16(
    py: Python<'_>,
    x: PyReadonlyArrayDyn<'_, u16>,
    weight: PyReadonlyArrayDyn<'_, u16>,
    eps: f32,
    out: PyReadwriteArrayDyn<'_, u16>,
    residual: Option<PyReadwriteArrayDyn<'_, u16>>,
    centered: bool,
) -> PyResult<()> {
    let kernel = hybridserve_cpu_kernels::norm::rms_norm_bf16;
    rms_norm_with(py, x, weight, eps, out, residual, centered, kernel)
}

/// [`causal_conv1d`] for a bfloat16 model: every array bfloat16 bits (uint16 views).
#[pyfunction]
#[pyo3(signature = (x, weight, bias, state, query_start_loc, state_pages, has_initial_state, out, *,
                    item_base, silu=true, checkpoint_positions=None, checkpoint_pages=None))]
#[allow(clippy::too_many_arguments)]
pub(super) fn causal_conv1d_bf16(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, u16>,
    weight: PyReadonlyArrayDyn<'_, u16>,
    bias: Option<PyReadonlyArrayDyn<'_, u16>>,
    state: PyReadwriteArrayDyn<'_, u16>,
    query_start_loc: PyReadonlyArray1<'_, i64>,
    state_pages: PyReadonlyArray2<'_, i64>,
    has_initial_state: PyReadonlyArray1<'_, bool>,
    out: PyReadwriteArrayDyn<'_, u16>,
    item_base: usize,
    silu: bool,
    checkpoint_positions: Option<PyReadonlyArray1<'_, i64>>,
    checkpoint_pages: Option<PyReadonlyArray2<'_, i64>>,
) -> PyResult<()> {
    conv1d_with(
        py, x, weight, bias, state, query_start_loc, state_pages, has_initial_state, out,
        (item_base, silu), checkpoint_positions, checkpoint_pages,
        hybridserve_cpu_kernels::conv1d::causal_conv1d_bf16,
    )
}

/// `out = x @ w.T` in bfloat16 (see `hybridserve_cpu_kernels::matmul_bf16`): `x`
/// `[M, K]` (row-strided allowed) and `w` `[N, K]` C-contiguous, both bfloat16 bits
/// (`tensor.view(torch.uint16)`); `out` `[M, N]` C-contiguous, float32, or uint16 for
/// bfloat16 rounded to nearest even.
#[pyfunction]
pub(super) fn matmul_bf16(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, u16>,
    w: PyReadonlyArray2<'_, u16>,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    use hybridserve_cpu_kernels::matmul_bf16::{matmul_bf16 as mm, Out};
    let x = rows("x", &x)?;
    let n = w.shape()[0];
    if w.shape()[1] != x.width {
        return Err(PyValueError::new_err(format!(
            "w must be [N, K={}] (K of x); got {:?}",
            x.width,
            w.shape()
        )));
    }
    // `as_slice` also takes a Fortran-ordered array (the transposed weight): refuse it.
    let w = w.as_slice().ok().filter(|_| w.is_c_contiguous()).ok_or_else(|| {
        PyValueError::new_err("w must be a C-contiguous [N, K] bfloat16 (uint16 view) array")
    })?;
    if let Ok(mut o) = out.extract::<PyReadwriteArrayDyn<'_, u16>>() {
        let o = o
            .as_slice_mut()
            .map_err(|_| PyValueError::new_err("out must be C-contiguous"))?;
        return py.detach(|| mm(x, w, n, Out::Bf16(o))).map_err(err);
    }
    let mut o = out.extract::<PyReadwriteArrayDyn<'_, f32>>().map_err(|_| {
        PyValueError::new_err("out must be a writable float32 or uint16 (bfloat16 bits) array")
    })?;
    let o = contiguous_mut("out", &mut o)?;
    py.detach(|| mm(x, w, n, Out::F32(o))).map_err(err)
}

/// The instruction set the bfloat16 kernels use on this CPU: `"avx512_bf16"`,
/// `"avx2"` or `"scalar"`.
#[pyfunction]
pub(super) fn bf16_isa() -> &'static str {
    hybridserve_cpu_kernels::bf16::Isa::detect().name()
}

/// [`qk_norm_rope`] for a bfloat16 model: every array bfloat16 bits (uint16 views).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub(super) fn qk_norm_rope_bf16(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, u16>,
    heads: usize,
    head_stride: usize,
    weight: PyReadonlyArrayDyn<'_, u16>,
    eps: f32,
    cos: PyReadonlyArray2<'_, u16>,
    sin: PyReadonlyArray2<'_, u16>,
    out: PyReadwriteArrayDyn<'_, u16>,
) -> PyResult<()> {
    let kernel = hybridserve_cpu_kernels::rope::qk_norm_rope_bf16;
    qk_norm_rope_with(py, x, (heads, head_stride), weight, eps, cos, sin, out, kernel)
}

/// [`gated_delta_rule`] for a bfloat16 model: `q`, `k`, `v`, the gates' inputs and
/// parameters, `z`, `norm_weight` and `out` bfloat16 bits (uint16 views); the state
/// pool float32.
#[pyfunction]
#[pyo3(signature = (q, k, v, state, query_start_loc, state_pages, has_initial_state, out, *,
                    item_base, key_heads, value_heads, scale, l2norm=true, g=None, beta=None, a=None,
                    b=None, a_log=None, dt_bias=None, z=None, norm_weight=None, norm_eps=1e-6,
                    checkpoint_positions=None, checkpoint_pages=None))]
#[allow(clippy::too_many_arguments)]
pub(super) fn gated_delta_rule_bf16(
    py: Python<'_>,
    q: PyReadonlyArray2<'_, u16>,
    k: PyReadonlyArray2<'_, u16>,
    v: PyReadonlyArray2<'_, u16>,
    state: PyReadwriteArrayDyn<'_, f32>,
    query_start_loc: PyReadonlyArray1<'_, i64>,
    state_pages: PyReadonlyArray2<'_, i64>,
    has_initial_state: PyReadonlyArray1<'_, bool>,
    out: PyReadwriteArrayDyn<'_, u16>,
    item_base: usize,
    key_heads: usize,
    value_heads: usize,
    scale: f32,
    l2norm: bool,
    g: Option<PyReadonlyArray2<'_, u16>>,
    beta: Option<PyReadonlyArray2<'_, u16>>,
    a: Option<PyReadonlyArray2<'_, u16>>,
    b: Option<PyReadonlyArray2<'_, u16>>,
    a_log: Option<PyReadonlyArrayDyn<'_, u16>>,
    dt_bias: Option<PyReadonlyArrayDyn<'_, u16>>,
    z: Option<PyReadonlyArray2<'_, u16>>,
    norm_weight: Option<PyReadonlyArrayDyn<'_, u16>>,
    norm_eps: f32,
    checkpoint_positions: Option<PyReadonlyArray1<'_, i64>>,
    checkpoint_pages: Option<PyReadonlyArray2<'_, i64>>,
) -> PyResult<()> {
    let arrays = DeltaRuleArrays {
        q, k, v, state, query_start_loc, state_pages, has_initial_state, out, g, beta, a, b, a_log,
        dt_bias, z, norm_weight, checkpoint_positions, checkpoint_pages,
    };
    let kernel = hybridserve_cpu_kernels::delta_rule::gated_delta_rule_bf16;
    delta_rule_with(py, arrays, item_base, key_heads, value_heads, scale, l2norm, norm_eps, kernel)
}
