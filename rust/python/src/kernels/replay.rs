//! The speculative commit's replay in one call: a plan that binds, once per cache and
//! verify row count, every DeltaNet layer's ring buffer (the verify step's in_proj
//! output), conv weight, gate parameters and state pools, and a per-commit call that
//! runs the conv and the delta rule of every layer over the accepted rows.
//!
//! Why: at batch 1 the replay is twelve small kernel calls (a conv and a delta rule per
//! layer), each with a dozen keyword arguments and numpy arrays to check; that fixed
//! cost, not the arithmetic, was most of the commit. The plan calls the same kernel
//! functions on the same inputs as the per-layer bindings, so the state pages end
//! bit-identical to theirs. The output of the delta rule is not needed (only the state
//! is), so the plan asks for no output norm.

use super::*;
use hybridserve_cpu_kernels::conv1d::{causal_conv1d, causal_conv1d_bf16};
use hybridserve_cpu_kernels::delta_rule::{gated_delta_rule, gated_delta_rule_bf16};
use hybridserve_cpu_kernels::mtp::Buf;
use super::mtp::{buf, paged};
use numpy::{PyArrayDyn, PyUntypedArrayMethods};
use pyo3::types::{PyDict, PyList};

/// A paged state pool view: its memory, `(num_pages, per_page, page_stride, item_len)`,
/// and its item's trailing shape (conv: `[C, W-1]`; recurrent: `[K, V]`).
#[derive(Clone, Copy)]
struct Pool<T> {
    mem: Buf<T>,
    layout: (usize, usize, usize, usize),
    item_shape: (usize, usize),
}

struct Layer<T> {
    /// `[rows, ring_width]`: the verify step's in_proj output of this layer.
    ring: Buf<T>,
    mixed_col: usize,
    ba_col: usize,
    conv_w: Buf<T>,
    conv_pool: Pool<T>,
    conv_base: usize,
    rec_pool: Pool<f32>,
    rec_base: usize,
    a_log: Buf<T>,
    dt_bias: Buf<T>,
    heads: Heads,
    scale: f32,
}

struct Inner<T> {
    layers: Vec<Layer<T>>,
    rows: usize,
    ring_width: usize,
    conv_dim: usize,
    /// `[rows, conv_dim]` and `[rows, H * V]` scratch.
    conv: Buf<T>,
    out: Buf<T>,
    conv_k: ConvKernel<T>,
    rule_k: DeltaRuleKernel<T>,
}

enum Typed {
    F32(Inner<f32>),
    Bf16(Inner<u16>),
}

/// Every DeltaNet layer's replay of a speculative commit over one cache, for the ring
/// of one verify row count: `ReplayPlan(layers, conv_scratch, out_scratch, bf16)`.
/// `layers` is a list of dicts, one per DeltaNet layer in model order, each with
/// `ring` (`[R, X]` C-contiguous, the layer's in_proj output), `mixed_col` and `ba_col`
/// (where the conv input and the `b`, `a` gate inputs start in a ring row), `conv_w`
/// `[C, W]`, `conv_pool` and `rec_pool` (the cache's paged state views), `conv_base`,
/// `rec_base`, `a_log`, `dt_bias` `[H]`, `key_heads`, `value_heads`, `scale`. Arrays are
/// float32, or bfloat16 bits (uint16) with `bf16`; the recurrent pool is float32. The
/// arrays stay bound (and alive) while the plan lives; during a call nothing else may
/// touch them.
#[pyclass(name = "ReplayPlan", module = "hybridserve._core")]
pub(super) struct ReplayPlan {
    typed: Typed,
    _keep: Vec<Py<PyAny>>,
}

fn dict_item<'py>(d: &Bound<'py, PyDict>, name: &str) -> PyResult<Bound<'py, PyAny>> {
    d.get_item(name)?
        .ok_or_else(|| PyValueError::new_err(format!("a layer of the replay plan lacks {name:?}")))
}

/// A C-contiguous array of `T` (see `mtp::buf`) and its shape.
fn shaped<T: numpy::Element>(
    name: &str,
    a: &Bound<'_, PyAny>,
    keep: &mut Vec<Py<PyAny>>,
) -> PyResult<(Buf<T>, Vec<usize>)> {
    let b = buf::<T>(name, a, keep)?;
    Ok((b, a.cast::<PyArrayDyn<T>>()?.shape().to_vec()))
}

/// A paged view `[num_pages, per_page, X, Y]` (a HybridCache state pool; see `mtp::paged`).
fn pool<T: numpy::Element>(name: &str, a: &Bound<'_, PyAny>, keep: &mut Vec<Py<PyAny>>) -> PyResult<Pool<T>> {
    let shape = a
        .cast::<PyArrayDyn<T>>()
        .map_err(|_| PyValueError::new_err(format!("{name} must be a paged state view of the pool's dtype")))?
        .shape()
        .to_vec();
    if shape.len() != 4 {
        return Err(PyValueError::new_err(format!("{name} must be [num_pages, per_page, X, Y], got {shape:?}")));
    }
    let (mem, pages, per_page, stride, item) = paged::<T>(name, a, keep)?;
    Ok(Pool { mem, layout: (pages, per_page, stride, item), item_shape: (shape[2], shape[3]) })
}

fn layer<T: numpy::Element>(
    d: &Bound<'_, PyDict>,
    rows: usize,
    conv_dim: usize,
    keep: &mut Vec<Py<PyAny>>,
) -> PyResult<(Layer<T>, usize)> {
    let us = |n: &str| -> PyResult<usize> { dict_item(d, n)?.extract() };
    let (ring, rshape) = shaped::<T>("ring", &dict_item(d, "ring")?, keep)?;
    let (conv_w, wshape) = shaped::<T>("conv_w", &dict_item(d, "conv_w")?, keep)?;
    let (a_log, ashape) = shaped::<T>("a_log", &dict_item(d, "a_log")?, keep)?;
    let (dt_bias, dshape) = shaped::<T>("dt_bias", &dict_item(d, "dt_bias")?, keep)?;
    let conv_pool = pool::<T>("conv_pool", &dict_item(d, "conv_pool")?, keep)?;
    let rec_pool = pool::<f32>("rec_pool", &dict_item(d, "rec_pool")?, keep)?;
    let (hk, hv) = (us("key_heads")?, us("value_heads")?);
    let (mixed_col, ba_col) = (us("mixed_col")?, us("ba_col")?);
    let (kd, vd) = rec_pool.item_shape;
    let bad = |what: String| Err(PyValueError::new_err(format!("replay plan: {what}")));
    if rshape.len() != 2 || rshape[0] != rows {
        return bad(format!("ring must be [rows={rows}, X], got {rshape:?}"));
    }
    let width = rshape[1];
    if hk == 0 || hv == 0 || conv_dim != 2 * hk * kd + hv * vd {
        return bad(format!(
            "the conv width {conv_dim} must be 2 x key_heads ({hk}) x K ({kd}) + value_heads ({hv}) x V ({vd})"
        ));
    }
    if mixed_col + conv_dim > width || ba_col + 2 * hv > width {
        return bad(format!("a ring row of {width} holds no conv input at {mixed_col} or gates at {ba_col}"));
    }
    if wshape.len() != 2 || wshape[0] != conv_dim || wshape[1] < 1 || conv_pool.item_shape != (conv_dim, wshape[1] - 1)
    {
        return bad(format!(
            "conv_w must be [C={conv_dim}, W] and conv_pool items [C, W-1]; got {wshape:?} and {:?}",
            conv_pool.item_shape
        ));
    }
    if ashape != [hv] || dshape != [hv] {
        return bad(format!("a_log and dt_bias must be [value_heads={hv}]"));
    }
    let l = Layer {
        ring,
        mixed_col,
        ba_col,
        conv_w,
        conv_pool,
        conv_base: us("conv_base")?,
        rec_pool,
        rec_base: us("rec_base")?,
        a_log,
        dt_bias,
        heads: Heads { key_heads: hk, value_heads: hv, key_dim: kd, value_dim: vd },
        scale: dict_item(d, "scale")?.extract()?,
    };
    Ok((l, width))
}

#[allow(clippy::too_many_arguments)]
fn inner<T: numpy::Element>(
    layers: &Bound<'_, PyList>,
    conv: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    kernels: (ConvKernel<T>, DeltaRuleKernel<T>),
    keep: &mut Vec<Py<PyAny>>,
) -> PyResult<Inner<T>> {
    let (conv, cshape) = shaped::<T>("conv_scratch", conv, keep)?;
    let (out, oshape) = shaped::<T>("out_scratch", out, keep)?;
    if cshape.len() != 2 || oshape.len() != 2 || cshape[0] != oshape[0] {
        return Err(PyValueError::new_err("conv_scratch and out_scratch must be [R, C] and [R, H * V]"));
    }
    let (rows, conv_dim) = (cshape[0], cshape[1]);
    let mut ls = Vec::new();
    let mut ring_width = None;
    for d in layers.iter() {
        let d = d.cast::<PyDict>().map_err(|_| PyValueError::new_err("layers must be dicts"))?;
        let (l, w) = layer::<T>(d, rows, conv_dim, keep)?;
        if *ring_width.get_or_insert(w) != w {
            return Err(PyValueError::new_err("every layer's ring must have the same width"));
        }
        if l.heads.value_heads * l.heads.value_dim != oshape[1] {
            return Err(PyValueError::new_err(format!(
                "out_scratch must be [R, H * V = {}]",
                l.heads.value_heads * l.heads.value_dim
            )));
        }
        ls.push(l);
    }
    Ok(Inner {
        layers: ls,
        rows,
        ring_width: ring_width.unwrap_or(0),
        conv_dim,
        conv,
        out,
        conv_k: kernels.0,
        rule_k: kernels.1,
    })
}

/// Every layer's conv then delta rule over rows `0 .. n` of its ring.
fn replay<T>(p: &Inner<T>, n: usize, varlen: Varlen<'_>, table: &[i64], cols: usize) -> Result<(), KernelError> {
    if n > p.rows {
        return Err(KernelError::new(format!("{n} rows to replay, the plan's ring holds {}", p.rows)));
    }
    let c = p.conv_dim;
    for l in &p.layers {
        let Heads { key_heads: hk, value_heads: hv, key_dim: kd, value_dim: vd } = l.heads;
        // (Every slice below: the plan's arrays are alive and only this call touches
        // them, the class contract; each mutable slice is the only slice of its memory
        // while it lives.)
        let ring = l.ring.s(l.ring.len());
        let x = Rows::new(&ring[l.mixed_col..], n, c, p.ring_width)?;
        let conv_out = p.conv.m(n * c);
        let conv_state = l.conv_pool.mem.m(l.conv_pool.mem.len());
        let paged = PagedState::plain(table, cols, l.conv_base, l.conv_pool.layout);
        (p.conv_k)(x, l.conv_w.s(l.conv_w.len()), None, true, conv_state, paged, varlen, conv_out)?;
        let co = p.conv.s(n * c);
        let (q, k) = (Rows::new(co, n, hk * kd, c)?, Rows::new(&co[hk * kd..], n, hk * kd, c)?);
        let v = Rows::new(&co[2 * hk * kd..], n, hv * vd, c)?;
        let ba = &ring[l.ba_col..];
        let gates = Gates::Raw {
            a: Rows::new(&ba[hv..], n, hv, p.ring_width)?,
            b: Rows::new(ba, n, hv, p.ring_width)?,
            a_log: l.a_log.s(l.a_log.len()),
            dt_bias: l.dt_bias.s(l.dt_bias.len()),
        };
        let state = l.rec_pool.mem.m(l.rec_pool.mem.len());
        let paged = PagedState::plain(table, cols, l.rec_base, l.rec_pool.layout);
        let out = p.out.m(n * hv * vd);
        (p.rule_k)(q, k, v, gates, None, l.heads, l.scale, true, state, paged, varlen, out)?;
    }
    Ok(())
}

#[pymethods]
impl ReplayPlan {
    #[new]
    #[pyo3(signature = (layers, conv_scratch, out_scratch, bf16))]
    fn new(
        layers: &Bound<'_, PyList>,
        conv_scratch: &Bound<'_, PyAny>,
        out_scratch: &Bound<'_, PyAny>,
        bf16: bool,
    ) -> PyResult<Self> {
        let mut keep = Vec::new();
        let typed = if bf16 {
            let k: (ConvKernel<u16>, DeltaRuleKernel<u16>) = (causal_conv1d_bf16, gated_delta_rule_bf16);
            Typed::Bf16(inner::<u16>(layers, conv_scratch, out_scratch, k, &mut keep)?)
        } else {
            let k: (ConvKernel<f32>, DeltaRuleKernel<f32>) = (causal_conv1d, gated_delta_rule);
            Typed::F32(inner::<f32>(layers, conv_scratch, out_scratch, k, &mut keep)?)
        };
        Ok(ReplayPlan { typed, _keep: keep })
    }

    /// Advance every layer's conv and recurrent state over the rings' rows `0 .. n`,
    /// runs by `query_start_loc` (int64 `[B + 1]`, ending at `n`) over the state page
    /// table rows `state_pages` (int64 `[B, cols]`), from the pages' state where
    /// `has_initial_state` (bool `[B]`), else from zeros.
    fn run(
        &self,
        py: Python<'_>,
        n: usize,
        query_start_loc: PyReadonlyArray1<'_, i64>,
        state_pages: PyReadonlyArray2<'_, i64>,
        has_initial_state: PyReadonlyArray1<'_, bool>,
    ) -> PyResult<()> {
        let v = varlen(&query_start_loc, &has_initial_state)?;
        let (tab, cols) = table("state_pages", &state_pages)?;
        if tab.len() != v.num_seqs() * cols {
            return Err(PyValueError::new_err("state_pages must have a row per sequence of has_initial_state"));
        }
        match &self.typed {
            Typed::F32(p) => py.detach(|| replay(p, n, v, tab, cols)),
            Typed::Bf16(p) => py.detach(|| replay(p, n, v, tab, cols)),
        }
        .map_err(err)
    }
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<ReplayPlan>()
}
