//! The argument checks the float32 and bfloat16 bindings share: each `*_with` takes
//! the numpy arrays one binding received (element type `T`: `f32`, or `u16` holding
//! bfloat16 bits), checks shapes and layouts, builds the kernel's views and runs the
//! kernel it is given with the GIL released. The `#[pyfunction]`s (`mod.rs`,
//! `bf16.rs`) only name their arguments and pick the kernel.

use super::*;

/// An element type the bindings take: float32, or bfloat16 bits in a uint16 view.
pub(super) trait Dtype: numpy::Element + Copy {
    /// How an error message names it.
    const NAME: &'static str;
}

impl Dtype for f32 {
    const NAME: &'static str = "float32";
}

impl Dtype for u16 {
    const NAME: &'static str = "bfloat16 bits (a uint16 view)";
}

pub(super) fn contiguous_of<'a, T: Dtype>(name: &str, a: &'a PyReadonlyArrayDyn<'_, T>) -> PyResult<&'a [T]> {
    a.as_slice()
        .map_err(|_| PyValueError::new_err(format!("{name} must be C-contiguous {}", T::NAME)))
}

pub(super) fn contiguous_mut_of<'a, T: Dtype>(
    name: &str,
    a: &'a mut PyReadwriteArrayDyn<'_, T>,
) -> PyResult<&'a mut [T]> {
    a.as_slice_mut()
        .map_err(|_| PyValueError::new_err(format!("{name} must be C-contiguous {}", T::NAME)))
}

/// A weight `w` stored `[N, K]` as checkpoints store it, `K` the width of `x`: its
/// values and `N`. `as_slice` also takes a Fortran-ordered array (a transposed
/// weight), which these kernels would read wrongly: refused.
pub(super) fn weight_rows<'a, T: Dtype>(w: &'a PyReadonlyArray2<'_, T>, k: usize) -> PyResult<(&'a [T], usize)> {
    if w.shape()[1] != k {
        return Err(PyValueError::new_err(format!("w must be [N, K={k}] (K of x); got {:?}", w.shape())));
    }
    let values = w.as_slice().ok().filter(|_| w.is_c_contiguous()).ok_or_else(|| {
        PyValueError::new_err(format!("w must be a C-contiguous [N, K] {} array", T::NAME))
    })?;
    Ok((values, w.shape()[0]))
}

/// The delta rule's arrays as one binding received them (float32 or bfloat16 `T`;
/// the state is float32 either way).
pub(super) struct DeltaRuleArrays<'py, T: Dtype> {
    pub(super) q: PyReadonlyArray2<'py, T>,
    pub(super) k: PyReadonlyArray2<'py, T>,
    pub(super) v: PyReadonlyArray2<'py, T>,
    pub(super) state: PyReadwriteArrayDyn<'py, f32>,
    pub(super) query_start_loc: PyReadonlyArray1<'py, i64>,
    pub(super) state_pages: PyReadonlyArray2<'py, i64>,
    pub(super) has_initial_state: PyReadonlyArray1<'py, bool>,
    pub(super) out: PyReadwriteArrayDyn<'py, T>,
    pub(super) g: Option<PyReadonlyArray2<'py, T>>,
    pub(super) beta: Option<PyReadonlyArray2<'py, T>>,
    pub(super) a: Option<PyReadonlyArray2<'py, T>>,
    pub(super) b: Option<PyReadonlyArray2<'py, T>>,
    pub(super) a_log: Option<PyReadonlyArrayDyn<'py, T>>,
    pub(super) dt_bias: Option<PyReadonlyArrayDyn<'py, T>>,
    pub(super) z: Option<PyReadonlyArray2<'py, T>>,
    pub(super) norm_weight: Option<PyReadonlyArrayDyn<'py, T>>,
    pub(super) checkpoint_positions: Option<PyReadonlyArray1<'py, i64>>,
    pub(super) checkpoint_pages: Option<PyReadonlyArray2<'py, i64>>,
    pub(super) read_only: Option<PyReadonlyArray1<'py, bool>>,
}

pub(super) type DeltaRuleKernel<T> = fn(
    Rows<'_, T>,
    Rows<'_, T>,
    Rows<'_, T>,
    Gates<'_, T>,
    Option<OutputNorm<'_, T>>,
    Heads,
    f32,
    bool,
    &mut [f32],
    PagedState<'_>,
    Varlen<'_>,
    &mut [T],
) -> Result<(), KernelError>;

/// The argument checks of both delta rule bindings, then the kernel.
#[allow(clippy::too_many_arguments)]
pub(super) fn delta_rule_with<T: Dtype>(
    py: Python<'_>,
    mut arr: DeltaRuleArrays<'_, T>,
    item_base: usize,
    key_heads: usize,
    value_heads: usize,
    scale: f32,
    l2norm: bool,
    norm_eps: f32,
    kernel: DeltaRuleKernel<T>,
) -> PyResult<()> {
    let (q, k, v) = (rows("q", &arr.q)?, rows("k", &arr.k)?, rows("v", &arr.v)?);
    if key_heads == 0 || value_heads == 0 || q.width % key_heads != 0 || v.width % value_heads != 0
    {
        return Err(PyValueError::new_err(format!(
            "q/k width {} must be key_heads ({key_heads}) x K and v width {} value_heads ({value_heads}) x V",
            q.width, v.width
        )));
    }
    let heads = Heads {
        key_heads,
        value_heads,
        key_dim: q.width / key_heads,
        value_dim: v.width / value_heads,
    };
    let shape = arr.state.shape();
    if shape.len() != 4 || shape[2..] != [heads.key_dim, heads.value_dim] {
        return Err(PyValueError::new_err(format!(
            "state must be a pool [num_pages, per_page, K={}, V={}] of float32 (from q/k/v widths and head counts), got {shape:?}",
            heads.key_dim, heads.value_dim
        )));
    }
    let gates = match (&arr.g, &arr.beta, &arr.a, &arr.b, &arr.a_log, &arr.dt_bias) {
        (Some(g), Some(beta), None, None, None, None) => Gates::Direct {
            g: rows("g", g)?,
            beta: rows("beta", beta)?,
        },
        (None, None, Some(a), Some(b), Some(al), Some(dt)) => Gates::Raw {
            a: rows("a", a)?,
            b: rows("b", b)?,
            a_log: contiguous_of("a_log", al)?,
            dt_bias: contiguous_of("dt_bias", dt)?,
        },
        _ => {
            return Err(PyValueError::new_err(
                "give either g and beta, or a, b, a_log and dt_bias",
            ))
        }
    };
    let norm = match (&arr.z, &arr.norm_weight) {
        (Some(z), Some(w)) => Some(OutputNorm {
            z: rows("z", z)?,
            weight: contiguous_of("norm_weight", w)?,
            eps: norm_eps,
        }),
        (None, None) => None,
        _ => {
            return Err(PyValueError::new_err(
                "give both z and norm_weight for the output norm, or neither",
            ))
        }
    };
    let varlen = varlen(&arr.query_start_loc, &arr.has_initial_state)?;
    let (state, pages, per_page, stride, item) = state_pool("state", &mut arr.state)?;
    let paged = paged_state(
        &arr.state_pages,
        item_base,
        (pages, per_page, stride, item),
        &arr.checkpoint_positions,
        &arr.checkpoint_pages,
        &arr.read_only,
    )?;
    let out = contiguous_mut_of("out", &mut arr.out)?;
    py.detach(|| {
        kernel(
            q, k, v, gates, norm, heads, scale, l2norm, state, paged, varlen, out,
        )
    })
    .map_err(err)
}

pub(super) type ConvKernel<T> = fn(
    Rows<'_, T>,
    &[T],
    Option<&[T]>,
    bool,
    &mut [T],
    PagedState<'_>,
    Varlen<'_>,
    &mut [T],
) -> Result<(), KernelError>;

/// The argument checks of both conv1d bindings (float32 or bfloat16 `T`, the state
/// pool in the same type), then the kernel.
#[allow(clippy::too_many_arguments)]
pub(super) fn conv1d_with<T: Dtype>(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, T>,
    weight: PyReadonlyArrayDyn<'_, T>,
    bias: Option<PyReadonlyArrayDyn<'_, T>>,
    mut state: PyReadwriteArrayDyn<'_, T>,
    query_start_loc: PyReadonlyArray1<'_, i64>,
    state_pages: PyReadonlyArray2<'_, i64>,
    has_initial_state: PyReadonlyArray1<'_, bool>,
    mut out: PyReadwriteArrayDyn<'_, T>,
    (item_base, silu): (usize, bool),
    (checkpoint_positions, checkpoint_pages, read_only): (
        Option<PyReadonlyArray1<'_, i64>>,
        Option<PyReadonlyArray2<'_, i64>>,
        Option<PyReadonlyArray1<'_, bool>>,
    ),
    kernel: ConvKernel<T>,
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
    let weight = contiguous_of("weight", &weight)?;
    let bias = match &bias {
        Some(b) => Some(contiguous_of("bias", b)?),
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
        &read_only,
    )?;
    let out = contiguous_mut_of("out", &mut out)?;
    py.detach(|| kernel(x, weight, bias, silu, state, paged, varlen, out))
        .map_err(err)
}

pub(super) type DecodeKernel<T> =
    fn(Rows<'_, T>, PagedKv<'_, T>, DecodeSeqs<'_>, usize, f32, &mut [T]) -> Result<(), KernelError>;

/// The argument checks of both decode attention bindings, then the kernel.
#[allow(clippy::too_many_arguments)]
pub(super) fn decode_with<T: Dtype>(
    py: Python<'_>,
    q: PyReadonlyArray2<'_, T>,
    k_cache: PyReadonlyArrayDyn<'_, T>,
    v_cache: PyReadonlyArrayDyn<'_, T>,
    rows_: PyReadonlyArray1<'_, i64>,
    seq_lens: PyReadonlyArray1<'_, i64>,
    block_tables: PyReadonlyArray2<'_, i32>,
    scale: f32,
    mut out: PyReadwriteArrayDyn<'_, T>,
    kernel: DecodeKernel<T>,
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
    let out = contiguous_mut_of("out", &mut out)?;
    py.detach(|| kernel(q, kv, seqs, heads, scale, out))
        .map_err(err)
}

pub(super) type NormKernel<T> = fn(&[T], Option<&mut [T]>, &[T], f32, bool, &mut [T]) -> Result<(), KernelError>;

/// The argument checks of both RMSNorm bindings, then the kernel.
#[allow(clippy::too_many_arguments)]
pub(super) fn rms_norm_with<T: Dtype>(
    py: Python<'_>,
    x: PyReadonlyArrayDyn<'_, T>,
    weight: PyReadonlyArrayDyn<'_, T>,
    eps: f32,
    mut out: PyReadwriteArrayDyn<'_, T>,
    mut residual: Option<PyReadwriteArrayDyn<'_, T>>,
    centered: bool,
    kernel: NormKernel<T>,
) -> PyResult<()> {
    let x = contiguous_of("x", &x)?;
    let weight = contiguous_of("weight", &weight)?;
    let out = contiguous_mut_of("out", &mut out)?;
    let residual = match residual.as_mut() {
        Some(r) => Some(contiguous_mut_of("residual", r)?),
        None => None,
    };
    py.detach(|| kernel(x, residual, weight, eps, centered, out))
        .map_err(err)
}

pub(super) type RopeKernel<T> = fn(
    Rows<'_, T>,
    usize,
    usize,
    &[T],
    f32,
    Rows<'_, T>,
    Rows<'_, T>,
    &mut [T],
) -> Result<(), KernelError>;

/// The argument checks of both q/k norm+rope bindings, then the kernel.
#[allow(clippy::too_many_arguments)]
pub(super) fn qk_norm_rope_with<T: Dtype>(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, T>,
    (heads, head_stride): (usize, usize),
    weight: PyReadonlyArrayDyn<'_, T>,
    eps: f32,
    cos: PyReadonlyArray2<'_, T>,
    sin: PyReadonlyArray2<'_, T>,
    mut out: PyReadwriteArrayDyn<'_, T>,
    kernel: RopeKernel<T>,
) -> PyResult<()> {
    let (x, cos, sin) = (rows("x", &x)?, rows("cos", &cos)?, rows("sin", &sin)?);
    let weight = contiguous_of("weight", &weight)?;
    let out = contiguous_mut_of("out", &mut out)?;
    py.detach(|| kernel(x, heads, head_stride, weight, eps, cos, sin, out))
        .map_err(err)
}
