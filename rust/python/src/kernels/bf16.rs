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
    mut out: PyReadwriteArrayDyn<'_, u16>,
) -> PyResult<()> {
    let shape = k_cache.shape().to_vec();
    if shape.len() != 4 || v_cache.shape() != shape.as_slice() {
        return Err(PyValueError::new_err(
            "k_cache and v_cache must be [num_blocks, block_size, Hkv, D] alike",
        ));
    }
    let q = rows("q", &q)?;
    let (heads, d) = (q.width / shape[3].max(1), shape[3]);
    let (kview, vview) = (k_cache.as_array(), v_cache.as_array());
    let (extent, num_blocks, _, block_stride, _) = paged_view("k_cache", &shape, kview.strides())?;
    if kview.strides() != vview.strides() {
        return Err(PyValueError::new_err(
            "k_cache and v_cache must have the same strides",
        ));
    }
    // SAFETY: each view's blocks lie in its array's buffer (numpy guarantees the
    // strided extent is allocated); the borrows outlive the slices.
    let kv = PagedKv {
        k_cache: unsafe { std::slice::from_raw_parts(kview.as_ptr(), extent) },
        v_cache: unsafe { std::slice::from_raw_parts(vview.as_ptr(), extent) },
        block_size: shape[1],
        kv_heads: shape[2],
        head_dim: d,
        num_blocks,
        block_stride,
    };
    let width = block_tables.shape()[1];
    let seqs = DecodeSeqs {
        rows: ints("rows", &rows_)?,
        seq_lens: ints("seq_lens", &seq_lens)?,
        block_tables: block_tables.as_slice().map_err(|_| {
            PyValueError::new_err("block_tables must be a C-contiguous int32 array")
        })?,
        width,
    };
    let out = out
        .as_slice_mut()
        .map_err(|_| PyValueError::new_err("out must be C-contiguous bfloat16 bits"))?;
    py.detach(|| {
        hybridserve_cpu_kernels::attention::paged_attention_decode_bf16(
            q, kv, seqs, heads, scale, out,
        )
    })
    .map_err(err)
}

/// [`rms_norm`] for a bfloat16 model: every array bfloat16 bits (uint16 views).
#[pyfunction]
#[pyo3(signature = (x, weight, eps, out, residual=None, centered=true))]
pub(super) fn rms_norm_bf16(
    py: Python<'_>,
    x: PyReadonlyArrayDyn<'_, u16>,
    weight: PyReadonlyArrayDyn<'_, u16>,
    eps: f32,
    mut out: PyReadwriteArrayDyn<'_, u16>,
    residual: Option<PyReadwriteArrayDyn<'_, u16>>,
    centered: bool,
) -> PyResult<()> {
    let c16 = |name: &str| PyValueError::new_err(format!("{name} must be C-contiguous bfloat16 bits"));
    let x = x.as_slice().map_err(|_| c16("x"))?;
    let weight = weight.as_slice().map_err(|_| c16("weight"))?;
    let out = out.as_slice_mut().map_err(|_| c16("out"))?;
    let mut residual = residual;
    let residual = match residual.as_mut() {
        Some(r) => Some(r.as_slice_mut().map_err(|_| c16("residual"))?),
        None => None,
    };
    py.detach(|| {
        hybridserve_cpu_kernels::norm_bf16::rms_norm_bf16(x, residual, weight, eps, centered, out)
    })
    .map_err(err)
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
    mut state: PyReadwriteArrayDyn<'_, u16>,
    query_start_loc: PyReadonlyArray1<'_, i64>,
    state_pages: PyReadonlyArray2<'_, i64>,
    has_initial_state: PyReadonlyArray1<'_, bool>,
    mut out: PyReadwriteArrayDyn<'_, u16>,
    item_base: usize,
    silu: bool,
    checkpoint_positions: Option<PyReadonlyArray1<'_, i64>>,
    checkpoint_pages: Option<PyReadonlyArray2<'_, i64>>,
) -> PyResult<()> {
    let x = rows("x", &x)?;
    let (wshape, sshape) = (weight.shape().to_vec(), state.shape().to_vec());
    if wshape.len() != 2
        || wshape[0] != x.width
        || sshape.len() != 4
        || sshape[2..] != [x.width, wshape[1].saturating_sub(1)]
    {
        return Err(PyValueError::new_err(format!(
            "weight must be [C={}, W] and state a pool [num_pages, per_page, C, W-1]; got {wshape:?} and {sshape:?}",
            x.width
        )));
    }
    let c16 = |name: &str| PyValueError::new_err(format!("{name} must be C-contiguous bfloat16 bits"));
    let weight = weight.as_slice().map_err(|_| c16("weight"))?;
    let bias = match &bias {
        Some(b) => Some(b.as_slice().map_err(|_| c16("bias"))?),
        None => None,
    };
    let varlen = varlen(&query_start_loc, &has_initial_state)?;
    let (state, pages, per_page, stride, item) = state_pool("state", &mut state)?;
    let paged = paged_state(
        &state_pages,
        item_base,
        (pages, per_page, stride, item),
        &checkpoint_positions,
        &checkpoint_pages,
    )?;
    let out = out.as_slice_mut().map_err(|_| c16("out"))?;
    py.detach(|| {
        hybridserve_cpu_kernels::conv1d_bf16::causal_conv1d_bf16(
            x, weight, bias, silu, state, paged, varlen, out,
        )
    })
    .map_err(err)
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
    let w = w.as_slice().map_err(|_| {
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
    mut out: PyReadwriteArrayDyn<'_, u16>,
) -> PyResult<()> {
    let (x, cos, sin) = (rows("x", &x)?, rows("cos", &cos)?, rows("sin", &sin)?);
    let c16 = |name: &str| PyValueError::new_err(format!("{name} must be C-contiguous bfloat16 bits"));
    let weight = weight.as_slice().map_err(|_| c16("weight"))?;
    let out = out.as_slice_mut().map_err(|_| c16("out"))?;
    py.detach(|| {
        hybridserve_cpu_kernels::rope::qk_norm_rope_bf16(
            x,
            heads,
            head_stride,
            weight,
            eps,
            cos,
            sin,
            out,
        )
    })
    .map_err(err)
}
