//! The MTP draft passes in one call (`hybridserve_cpu_kernels::mtp`): a plan that
//! binds the MTP layer's weights, the MTP KV views and the activation buffers once
//! (numpy views of torch tensors, kept alive by the plan), and a per-step call.

use super::*;
use hybridserve_cpu_kernels::mtp::{self, Buf, Dims, Kv, MtpElem, Scratch, Step, Weights};
use numpy::{PyArrayDyn, PyArrayMethods, PyReadwriteArray2};
use pyo3::types::PyDict;

const WEIGHTS: [&str; 14] = [
    "embed", "norm_e", "norm_h", "fc", "in_norm", "post_norm", "out_norm", "qkv", "q_norm", "k_norm", "o",
    "gate_up", "down", "head",
];
const SCRATCH: [&str; 18] = [
    "emb", "e_norm", "h_norm", "hid", "cat", "residual", "normed", "qkv", "rq", "rk", "attn", "gated",
    "mixer_out", "gate_up", "mlp_out", "cos", "sin", "logits",
];

struct Inner<T> {
    dims: Dims,
    w: Weights<T>,
    kv: Kv<T>,
    s: Scratch<T>,
}

enum Typed {
    F32(Inner<f32>),
    Bf16(Inner<u16>),
}

/// The MTP draft passes of a model over one cache (see `hybridserve_cpu_kernels::mtp`):
/// `MtpDraftPlan(weights, scratch, k_cache, v_cache, dims, gate)` with `weights` and
/// `scratch` dicts of C-contiguous arrays (float32, or bfloat16 bits as uint16; the
/// names `hybridserve_cpu_kernels::mtp::{Weights, Scratch}` use, each scratch array
/// `[rows, width]`), the MTP layer's paged K/V views, `dims` a dict of the layer's
/// shapes and constants, and `gate(t)` a callable that sets `gated[:t]` from the
/// attention output and the projection's gate columns. The arrays stay bound (and
/// alive) while the plan lives.
#[pyclass(name = "MtpDraftPlan", module = "hybridserve._core")]
pub(super) struct MtpDraftPlan {
    typed: Typed,
    gate: Py<PyAny>,
    _keep: Vec<Py<PyAny>>,
}

/// A C-contiguous array of `T` as a [`Buf`]; the array is kept in `keep`.
pub(super) fn buf<T: numpy::Element>(name: &str, a: &Bound<'_, PyAny>, keep: &mut Vec<Py<PyAny>>) -> PyResult<Buf<T>> {
    let arr = a.cast::<PyArrayDyn<T>>().map_err(|_| {
        PyValueError::new_err(format!("{name} must be a numpy array of the model's dtype (uint16 for bfloat16)"))
    })?;
    if !arr.is_c_contiguous() {
        return Err(PyValueError::new_err(format!("{name} must be a C-contiguous array")));
    }
    keep.push(a.clone().unbind());
    // SAFETY: the array's memory stays allocated while `keep` holds it (the plan's
    // life); the caller's contract (module docstring) keeps other writers off it
    // during a call.
    Ok(unsafe { Buf::new(arr.data(), arr.len()) })
}

fn item<'py>(d: &Bound<'py, PyDict>, name: &str, what: &str) -> PyResult<Bound<'py, PyAny>> {
    d.get_item(name)?.ok_or_else(|| PyValueError::new_err(format!("{what} lacks {name:?}")))
}

pub(super) fn paged<T: numpy::Element>(name: &str, a: &Bound<'_, PyAny>, keep: &mut Vec<Py<PyAny>>)
    -> PyResult<(Buf<T>, usize, usize, usize, usize)> {
    let arr = a.cast::<PyArrayDyn<T>>().map_err(|_| PyValueError::new_err(format!("{name}: the model's dtype")))?;
    let strides: Vec<isize> = arr.strides().iter().map(|s| s / std::mem::size_of::<T>() as isize).collect();
    let (extent, blocks, block_size, stride, item) = paged_view(name, arr.shape(), &strides)?;
    keep.push(a.clone().unbind());
    // SAFETY: the view's pages lie in the arena's buffer (numpy guarantees its strided
    // extent), kept alive by `keep`.
    Ok((unsafe { Buf::new(arr.data(), extent) }, blocks, block_size, stride, item))
}

fn inner<T: numpy::Element>(
    weights: &Bound<'_, PyDict>,
    scratch: &Bound<'_, PyDict>,
    k_cache: &Bound<'_, PyAny>,
    v_cache: &Bound<'_, PyAny>,
    dims: Dims,
    rows: usize,
    keep: &mut Vec<Py<PyAny>>,
) -> PyResult<Inner<T>> {
    let mut wb = Vec::new();
    for n in WEIGHTS {
        wb.push(buf::<T>(n, &item(weights, n, "weights")?, keep)?);
    }
    let mut sb = Vec::new();
    for n in SCRATCH {
        sb.push(buf::<T>(n, &item(scratch, n, "scratch")?, keep)?);
    }
    let w = Weights {
        embed: wb[0], norm_e: wb[1], norm_h: wb[2], fc: wb[3], in_norm: wb[4], post_norm: wb[5],
        out_norm: wb[6], qkv: wb[7], q_norm: wb[8], k_norm: wb[9], o: wb[10], gate_up: wb[11], down: wb[12],
        head: wb[13],
    };
    let s = Scratch {
        rows, emb: sb[0], e_norm: sb[1], h_norm: sb[2], hid: sb[3], cat: sb[4], residual: sb[5], normed: sb[6],
        qkv: sb[7], rq: sb[8], rk: sb[9], attn: sb[10], gated: sb[11], mixer_out: sb[12], gate_up: sb[13],
        mlp_out: sb[14], cos: sb[15], sin: sb[16], logits: sb[17],
    };
    let (k, kb, ks, kst, ki) = paged::<T>("k_cache", k_cache, keep)?;
    let (v, vb, vs, vst, vi) = paged::<T>("v_cache", v_cache, keep)?;
    if (kb, ks, kst, ki) != (vb, vs, vst, vi) || ki != dims.kv_heads * dims.head_dim {
        return Err(PyValueError::new_err(
            "k_cache and v_cache must be alike, [num_blocks, block_size, kv_heads, head_dim]",
        ));
    }
    let kv = Kv { k, v, num_blocks: kb, block_size: ks, block_stride: kst };
    mtp::validate(&dims, &w, &kv, &s).map_err(err)?;
    Ok(Inner { dims, w, kv, s })
}

#[allow(clippy::too_many_arguments)]
fn run<T: MtpElem + numpy::Element>(
    py: Python<'_>,
    p: &Inner<T>,
    gate: &Py<PyAny>,
    a: (&Bound<'_, PyAny>, &Bound<'_, PyAny>, &Bound<'_, PyAny>),
    ints: (&[i64], &[i64], &[i64], &[i64]),
    tables: &PyReadonlyArray2<'_, i32>,
    (steps, vocab): (usize, usize),
    out: &mut [i64],
) -> PyResult<()> {
    let (hidden, cos, sin) = a;
    let (hidden, cos, sin): (PyReadonlyArray2<'_, T>, PyReadonlyArray2<'_, T>, PyReadonlyArray2<'_, T>) = (
        hidden.extract().map_err(|_| PyValueError::new_err("hidden must be a [R, hidden] array of the model's dtype"))?,
        cos.extract().map_err(|_| PyValueError::new_err("cos must be a [N, rot] array of the model's dtype"))?,
        sin.extract().map_err(|_| PyValueError::new_err("sin must be a [N, rot] array of the model's dtype"))?,
    );
    let c = |name: &str| PyValueError::new_err(format!("{name} must be C-contiguous"));
    let (ids, positions, slots, last) = ints;
    let step = Step {
        hidden: hidden.as_slice().map_err(|_| c("hidden"))?,
        ids,
        positions,
        slots,
        tables: tables.as_slice().map_err(|_| c("tables"))?,
        width: tables.shape()[1],
        last,
        steps,
        vocab,
        cos: cos.as_slice().map_err(|_| c("cos"))?,
        sin: sin.as_slice().map_err(|_| c("sin"))?,
    };
    if cos.shape()[1] != p.dims.rot {
        return Err(PyValueError::new_err(format!("cos must be [N, {}]", p.dims.rot)));
    }
    let mut failed: Option<PyErr> = None;
    let res = py.detach(|| {
        let mut g = |t: usize| {
            Python::attach(|py| gate.call1(py, (t,)).map(|_| ())).map_err(|e| {
                failed = Some(e);
                KernelError::new("the gate callback raised")
            })
        };
        mtp::draft(&p.dims, &p.w, &p.kv, &p.s, &step, out, &mut g)
    });
    if let Some(e) = failed {
        return Err(e);
    }
    res.map_err(err)
}

#[pymethods]
impl MtpDraftPlan {
    #[new]
    #[pyo3(signature = (weights, scratch, k_cache, v_cache, dims, gate, bf16))]
    fn new(
        weights: &Bound<'_, PyDict>,
        scratch: &Bound<'_, PyDict>,
        k_cache: &Bound<'_, PyAny>,
        v_cache: &Bound<'_, PyAny>,
        dims: &Bound<'_, PyDict>,
        gate: Py<PyAny>,
        bf16: bool,
    ) -> PyResult<Self> {
        let u = |n: &str| -> PyResult<usize> { item(dims, n, "dims")?.extract() };
        let f = |n: &str| -> PyResult<f32> { item(dims, n, "dims")?.extract() };
        let d = Dims {
            hidden: u("hidden")?, heads: u("heads")?, kv_heads: u("kv_heads")?, head_dim: u("head_dim")?,
            inter: u("inter")?, vocab: u("vocab")?, rot: u("rot")?, eps: f("eps")?, q_eps: f("q_eps")?,
            k_eps: f("k_eps")?, scale: f("scale")?,
        };
        let rows = u("rows")?;
        let mut keep = Vec::new();
        let typed = if bf16 {
            Typed::Bf16(inner::<u16>(weights, scratch, k_cache, v_cache, d, rows, &mut keep)?)
        } else {
            Typed::F32(inner::<f32>(weights, scratch, k_cache, v_cache, d, rows, &mut keep)?)
        };
        Ok(MtpDraftPlan { typed, gate, _keep: keep })
    }

    /// Every draft pass of one step (pass 0 over the `R` committed rows, then `steps - 1`
    /// chained passes of the rows `last`); writes the drafts to `out` `[steps, len(last)]`
    /// (int64). `hidden` `[R, hidden]`, `ids`/`positions`/`slots` `[R]` int64, `tables`
    /// `[R, W]` int32, `cos`/`sin` rope's `[N, rot]` tables over positions `0 .. N - 1`;
    /// drafts are the argmax over ids below `vocab`.
    #[allow(clippy::too_many_arguments)]
    fn draft(
        &self,
        py: Python<'_>,
        hidden: &Bound<'_, PyAny>,
        ids: PyReadonlyArray1<'_, i64>,
        positions: PyReadonlyArray1<'_, i64>,
        slots: PyReadonlyArray1<'_, i64>,
        tables: PyReadonlyArray2<'_, i32>,
        last: PyReadonlyArray1<'_, i64>,
        steps: usize,
        vocab: usize,
        cos: &Bound<'_, PyAny>,
        sin: &Bound<'_, PyAny>,
        mut out: PyReadwriteArray2<'_, i64>,
    ) -> PyResult<()> {
        let ints = (ints("ids", &ids)?, ints("positions", &positions)?, ints("slots", &slots)?, ints("last", &last)?);
        let out = out.as_slice_mut().map_err(|_| PyValueError::new_err("out must be C-contiguous int64"))?;
        match &self.typed {
            Typed::F32(p) => run(py, p, &self.gate, (hidden, cos, sin), ints, &tables, (steps, vocab), out),
            Typed::Bf16(p) => run(py, p, &self.gate, (hidden, cos, sin), ints, &tables, (steps, vocab), out),
        }
    }
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<MtpDraftPlan>()
}
