//! The CPU kernels (`hybridserve-cpu-kernels`) over numpy views of torch tensors.
//!
//! Python passes `tensor.numpy()` views (no copy): inputs may be row-strided column
//! ranges of a wider buffer (`[T, X]` with unit column stride), outputs and pools
//! must be C-contiguous. The GIL is released around the work. Shape errors are
//! `ValueError`s naming the argument.

use hybridserve_cpu_kernels::{
    attention::{paged_attention_decode as attn_decode, DecodeSeqs, PagedKv},
    conv1d::causal_conv1d as conv,
    delta_rule::{gated_delta_rule as gdr, Gates, Heads, OutputNorm},
    KernelError, PagedState, Rows, Varlen,
};
use numpy::{
    PyReadonlyArray1, PyReadonlyArray2, PyReadonlyArrayDyn, PyReadwriteArrayDyn,
    PyUntypedArrayMethods,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

#[macro_use]
mod per_precision;
mod activation;
mod bf16;
mod cache_write;
mod checks;
mod moe_bf16;
mod mtp;
mod quant;
mod quant_moe;
mod quant_fp8;
mod replay;
mod sample;
use bf16::*;
use checks::*;

fn err(e: KernelError) -> PyErr {
    PyValueError::new_err(e.0)
}

/// A `[T, X]` view with unit column stride as [`Rows`] (borrowing the array's memory).
fn rows<'a, T: numpy::Element>(
    name: &str,
    a: &'a PyReadonlyArray2<'_, T>,
) -> PyResult<Rows<'a, T>> {
    let v = a.as_array();
    let (t, w) = v.dim();
    let s = v.strides();
    if t > 0 && w > 0 && (s[1] != 1 || (t > 1 && s[0] < w as isize)) {
        return Err(PyValueError::new_err(format!(
            "{name} must be [T, X] with contiguous rows (column stride 1), got strides {s:?}; pass .contiguous()"
        )));
    }
    // A single row's outer stride is meaningless (torch may report anything there).
    let stride = if t <= 1 { w } else { s[0] as usize };
    let len = if t == 0 || w == 0 {
        0
    } else {
        (t - 1) * stride + w
    };
    // SAFETY: the view's rows lie in the array's buffer (numpy guarantees its strided
    // extent is allocated), and the borrow `a` outlives the returned slice.
    let data = unsafe { std::slice::from_raw_parts(v.as_ptr(), len) };
    Rows::new(data, t, w, stride.max(w)).map_err(err)
}

fn contiguous<'a>(name: &str, a: &'a PyReadonlyArrayDyn<'_, f32>) -> PyResult<&'a [f32]> {
    a.as_slice()
        .map_err(|_| PyValueError::new_err(format!("{name} must be C-contiguous float32")))
}

fn contiguous_mut<'a>(
    name: &str,
    a: &'a mut PyReadwriteArrayDyn<'_, f32>,
) -> PyResult<&'a mut [f32]> {
    a.as_slice_mut()
        .map_err(|_| PyValueError::new_err(format!("{name} must be C-contiguous float32")))
}

fn ints<'a>(name: &str, a: &'a PyReadonlyArray1<'_, i64>) -> PyResult<&'a [i64]> {
    a.as_slice()
        .map_err(|_| PyValueError::new_err(format!("{name} must be a contiguous int64 array")))
}

/// The varlen layout arrays (`query_start_loc` int64; `has_initial_state` bool).
fn varlen<'a>(
    query_start_loc: &'a PyReadonlyArray1<'_, i64>,
    has_initial_state: &'a PyReadonlyArray1<'_, bool>,
) -> PyResult<Varlen<'a>> {
    Ok(Varlen {
        query_start_loc: ints("query_start_loc", query_start_loc)?,
        has_initial_state: has_initial_state.as_slice().map_err(|_| {
            PyValueError::new_err("has_initial_state must be a contiguous bool array")
        })?,
    })
}

/// A paged view `[num_pages, per_page, *item]` of the arena (torch `as_strided`):
/// pages `strides[0]` elements apart, the rest C-contiguous. Returns the memory from
/// the first page to the end of the last one, and the layout.
fn paged_view(
    name: &str,
    shape: &[usize],
    strides: &[isize],
) -> PyResult<(usize, usize, usize, usize, usize)> {
    let bad = || {
        PyValueError::new_err(format!(
            "{name} must be a paged view [num_pages, per_page, ...] with C-contiguous items (a HybridCache view); \
             got shape {shape:?}, strides {strides:?}"
        ))
    };
    if shape.len() < 2 || shape[0] == 0 || shape[1] == 0 {
        return Err(bad());
    }
    let item_len: usize = shape[2..].iter().product();
    let mut want = 1usize;
    for i in (2..shape.len()).rev() {
        if shape[i] > 1 && strides[i] != want as isize {
            return Err(bad());
        }
        want *= shape[i];
    }
    if (shape[1] > 1 && strides[1] != item_len as isize)
        || (shape[0] > 1 && strides[0] < (shape[1] * item_len) as isize)
    {
        return Err(bad());
    }
    let page_stride = if shape[0] > 1 {
        strides[0] as usize
    } else {
        shape[1] * item_len
    };
    let extent = (shape[0] - 1) * page_stride + shape[1] * item_len;
    Ok((extent, shape[0], shape[1], page_stride, item_len))
}

/// The state pool as a mutable slice plus its page layout.
fn state_pool<'a, T: numpy::Element>(
    name: &str,
    a: &'a mut PyReadwriteArrayDyn<'_, T>,
) -> PyResult<(&'a mut [T], usize, usize, usize, usize)> {
    let mut v = a.as_array_mut();
    let (extent, pages, per_page, stride, item) = paged_view(name, v.shape(), v.strides())?;
    // SAFETY: the view's pages lie in the array's buffer (numpy guarantees its strided
    // extent is allocated) and the borrow `a` outlives the slice.
    let data = unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr(), extent) };
    Ok((data, pages, per_page, stride, item))
}

fn table<'a>(name: &str, a: &'a PyReadonlyArray2<'_, i64>) -> PyResult<(&'a [i64], usize)> {
    let cols = a.shape()[1];
    let data = a.as_slice().map_err(|_| {
        PyValueError::new_err(format!(
            "{name} must be a C-contiguous int64 [B, cols] array"
        ))
    })?;
    Ok((data, cols))
}

/// The state addressing of one call: the table rows, the layer's first item, the pool
/// layout and the checkpoint requests.
#[allow(clippy::too_many_arguments)]
fn paged_state<'a>(
    state_pages: &'a PyReadonlyArray2<'_, i64>,
    item_base: usize,
    layout: (usize, usize, usize, usize),
    checkpoint_positions: &'a Option<PyReadonlyArray1<'_, i64>>,
    checkpoint_pages: &'a Option<PyReadonlyArray2<'_, i64>>,
    read_only: &'a Option<PyReadonlyArray1<'_, bool>>,
) -> PyResult<PagedState<'a>> {
    let read_only: &[bool] = match read_only {
        Some(r) => r.as_slice().map_err(|_| {
            PyValueError::new_err("read_only must be a C-contiguous bool [B] array")
        })?,
        None => &[],
    };
    let (tab, cols) = table("state_pages", state_pages)?;
    let (ck, ck_tab) = match (checkpoint_positions, checkpoint_pages) {
        (Some(p), Some(t)) => {
            let (t, c) = table("checkpoint_pages", t)?;
            if c != cols {
                return Err(PyValueError::new_err(format!(
                    "checkpoint_pages must have as many columns as state_pages ({cols}), got {c}"
                )));
            }
            (ints("checkpoint_positions", p)?, t)
        }
        (None, None) => (&[][..], &[][..]),
        _ => {
            return Err(PyValueError::new_err(
                "give both checkpoint_positions and checkpoint_pages, or neither",
            ))
        }
    };
    Ok(PagedState {
        checkpoint_positions: ck,
        checkpoint_table: ck_tab,
        read_only,
        ..PagedState::plain(tab, cols, item_base, layout)
    })
}

delta_rule_binding!(
    /// Gated delta rule over a varlen batch, in place on `state`; see the Rust docs of
    /// `hybridserve_cpu_kernels::delta_rule`. Gates: `g` + `beta`, or `a` + `b` + `a_log`
    /// + `dt_bias`. Output norm when `z` and `norm_weight` are given.
    gated_delta_rule,
    f32,
    gdr
);

conv1d_binding!(
    /// Depthwise causal conv1d over a varlen batch with the conv state in paged items (in place).
    causal_conv1d,
    f32,
    conv
);

decode_attention_binding!(
    /// Decode attention (one query per listed sequence) over the paged KV pool.
    paged_attention_decode,
    f32,
    attn_decode
);

rms_norm_binding!(
    /// RMSNorm of `x` (`[T, D]`) into `out`; with `residual`, first `residual += x` and
    /// normalise the sum. `centered`: scale by `1 + weight` (Qwen3.5) instead of `weight`.
    rms_norm,
    f32,
    hybridserve_cpu_kernels::norm::rms_norm
);

/// `out = x @ wt` for `x` `[M, K]` (row-strided allowed), `wt` `[K, N]` row-major
/// (a projection weight stored transposed), `out` `[M, N]`.
#[pyfunction]
fn matmul(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, f32>,
    wt: PyReadonlyArray2<'_, f32>,
    mut out: PyReadwriteArrayDyn<'_, f32>,
) -> PyResult<()> {
    let x = rows("x", &x)?;
    let n = wt.shape()[1];
    let wt = wt.as_slice().map_err(|_| {
        PyValueError::new_err(
            "wt must be a C-contiguous [K, N] float32 array (the weight transposed)",
        )
    })?;
    let out = contiguous_mut("out", &mut out)?;
    py.detach(|| hybridserve_cpu_kernels::matmul::matmul(x, wt, n, out))
        .map_err(err)
}

/// `out = x @ w.T` for `x` `[M, K]` (row-strided allowed), `w` `[N, K]` C-contiguous
/// (a projection weight as checkpoints store it), `out` `[M, N]`: dot products over
/// contiguous weight rows (see `hybridserve_cpu_kernels::matmul_rows`).
#[pyfunction]
fn matmul_rows(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, f32>,
    w: PyReadonlyArray2<'_, f32>,
    mut out: PyReadwriteArrayDyn<'_, f32>,
) -> PyResult<()> {
    let x = rows("x", &x)?;
    let (w, n) = weight_rows(&w, x.width)?;
    let out = contiguous_mut("out", &mut out)?;
    py.detach(|| hybridserve_cpu_kernels::matmul_rows::matmul_rows(x, w, n, out))
        .map_err(err)
}

/// A whole sparse MoE block (see `hybridserve_cpu_kernels::moe`): `x` `[T, H]`,
/// `router_wt` `[H, E]`, `w13` `[E, H, 2I]`, `w2` `[E, I, H]`, the optional shared
/// expert `shared_w13` `[H, 2Is]`, `shared_w2` `[Is, H]`, `shared_gate` `[H]`; writes
/// `out` `[T, H]`, `topk_ids` (int64) and `topk_weights` `[T, top_k]`. Returns the
/// most rows any one expert received.
#[pyfunction]
#[pyo3(signature = (x, router_wt, w13, w2, top_k, out, topk_ids, topk_weights,
                    shared_w13=None, shared_w2=None, shared_gate=None))]
#[allow(clippy::too_many_arguments)]
fn moe_block(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, f32>,
    router_wt: PyReadonlyArray2<'_, f32>,
    w13: PyReadonlyArrayDyn<'_, f32>,
    w2: PyReadonlyArrayDyn<'_, f32>,
    top_k: usize,
    mut out: PyReadwriteArrayDyn<'_, f32>,
    mut topk_ids: PyReadwriteArrayDyn<'_, i64>,
    mut topk_weights: PyReadwriteArrayDyn<'_, f32>,
    shared_w13: Option<PyReadonlyArray2<'_, f32>>,
    shared_w2: Option<PyReadonlyArray2<'_, f32>>,
    shared_gate: Option<PyReadonlyArrayDyn<'_, f32>>,
) -> PyResult<usize> {
    use hybridserve_cpu_kernels::moe::{Experts, Router, Routing, SharedExpert};
    let x = rows("x", &x)?;
    let num_experts = router_wt.shape()[1];
    let router_wt = router_wt.as_slice().map_err(|_| {
        PyValueError::new_err(
            "router_wt must be a C-contiguous [H, E] float32 array (the router weight transposed)",
        )
    })?;
    let wshape = w2.shape().to_vec();
    if wshape.len() != 3 {
        return Err(PyValueError::new_err(format!(
            "w2 must be [E, I, H], got shape {wshape:?}"
        )));
    }
    let inter = wshape[1];
    let w13 = contiguous("w13", &w13)?;
    let w2 = contiguous("w2", &w2)?;
    let shared = match (&shared_w13, &shared_w2, &shared_gate) {
        (Some(a), Some(b), Some(g)) => Some(SharedExpert {
            inter: b.shape()[0],
            w13: a
                .as_slice()
                .map_err(|_| PyValueError::new_err("shared_w13 must be C-contiguous [H, 2Is]"))?,
            w2: b
                .as_slice()
                .map_err(|_| PyValueError::new_err("shared_w2 must be C-contiguous [Is, H]"))?,
            gate: contiguous("shared_gate", g)?,
        }),
        (None, None, None) => None,
        _ => {
            return Err(PyValueError::new_err(
                "give all of shared_w13, shared_w2 and shared_gate, or none",
            ))
        }
    };
    let out = contiguous_mut("out", &mut out)?;
    let ids = topk_ids
        .as_slice_mut()
        .map_err(|_| PyValueError::new_err("topk_ids must be C-contiguous int64"))?;
    let weights = contiguous_mut("topk_weights", &mut topk_weights)?;
    py.detach(|| {
        hybridserve_cpu_kernels::moe::moe_block(
            x,
            Router {
                weight_t: router_wt,
                num_experts,
                top_k,
            },
            Experts { w13, w2, inter },
            shared,
            out,
            Routing { ids, weights },
        )
    })
    .map_err(err)
}

qk_norm_rope_binding!(
    /// Per-head zero-centred RMSNorm then rotary embedding (half-split) of `x` rows
    /// holding `heads` heads `head_stride` apart; `out` `[T, heads, head_dim]`.
    qk_norm_rope,
    f32,
    hybridserve_cpu_kernels::rope::qk_norm_rope
);

/// Threads the kernels use from now on (the engine's `cpu_threads`).
#[pyfunction]
fn set_kernel_threads(n: usize) {
    hybridserve_cpu_kernels::set_num_threads(n)
}

#[pyfunction]
fn kernel_threads() -> usize {
    hybridserve_cpu_kernels::num_threads()
}

/// Run the kernels' tasks on the process's libgomp workers (torch's OpenMP pool):
/// the addresses of its `GOMP_parallel` and `omp_get_thread_num`. The caller
/// (`hybridserve.kernels.native`) finds the libgomp torch loaded; wrong addresses
/// would crash the process, hence the leading underscore.
#[pyfunction]
fn _use_openmp(gomp_parallel: usize, omp_get_thread_num: usize) -> PyResult<()> {
    if gomp_parallel == 0 || omp_get_thread_num == 0 {
        return Err(PyValueError::new_err("null OpenMP entry point"));
    }
    // SAFETY: documented contract above; the Python caller resolves both symbols in
    // the libgomp mapped into this process.
    unsafe { hybridserve_cpu_kernels::use_openmp(gomp_parallel, omp_get_thread_num) };
    Ok(())
}

/// Test hook: runs `n` tasks on the kernels' pool, task `bad` panicking; the
/// panic must come back as a Python exception after the parallel region (on
/// rayon and on the OpenMP pool alike), never abort the process.
#[pyfunction]
fn _panic_in_task(py: Python<'_>, n: usize, bad: usize) -> usize {
    py.detach(|| hybridserve_cpu_kernels::pool_panic_in_task(n, bad))
}

#[pyfunction]
fn uses_openmp() -> bool {
    hybridserve_cpu_kernels::uses_openmp()
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(gated_delta_rule, m)?)?;
    m.add_function(wrap_pyfunction!(gated_delta_rule_bf16, m)?)?;
    m.add_function(wrap_pyfunction!(causal_conv1d, m)?)?;
    m.add_function(wrap_pyfunction!(causal_conv1d_bf16, m)?)?;
    m.add_function(wrap_pyfunction!(paged_attention_decode, m)?)?;
    m.add_function(wrap_pyfunction!(paged_attention_decode_bf16, m)?)?;
    m.add_function(wrap_pyfunction!(rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(rms_norm_bf16, m)?)?;
    m.add_function(wrap_pyfunction!(qk_norm_rope, m)?)?;
    m.add_function(wrap_pyfunction!(qk_norm_rope_bf16, m)?)?;
    m.add_function(wrap_pyfunction!(matmul, m)?)?;
    m.add_function(wrap_pyfunction!(matmul_rows, m)?)?;
    m.add_function(wrap_pyfunction!(matmul_bf16, m)?)?;
    m.add_function(wrap_pyfunction!(bf16_isa, m)?)?;
    m.add_function(wrap_pyfunction!(moe_block, m)?)?;
    m.add_function(wrap_pyfunction!(set_kernel_threads, m)?)?;
    m.add_function(wrap_pyfunction!(kernel_threads, m)?)?;
    m.add_function(wrap_pyfunction!(_use_openmp, m)?)?;
    m.add_function(wrap_pyfunction!(_panic_in_task, m)?)?;
    m.add_function(wrap_pyfunction!(uses_openmp, m)?)?;
    activation::register(m)?;
    cache_write::register(m)?;
    moe_bf16::register(m)?;
    quant::register(m)?;
    quant_moe::register(m)?;
    quant_fp8::register(m)?;
    sample::register(m)?;
    mtp::register(m)?;
    replay::register(m)?;
    Ok(())
}
