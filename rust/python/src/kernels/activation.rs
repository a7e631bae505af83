//! The fused SwiGLU activation binding (`hybridserve_cpu_kernels::activation`), for
//! float32 and bfloat16 (uint16 bits) alike.

use super::*;

/// `gu[:, :inter] = silu(gu[:, :inter]) * gu[:, inter:]` in place: `gu` a C-contiguous
/// `[T, X]` (`X >= 2 * inter`) float32 array or bfloat16 bits (uint16 view).
#[pyfunction]
fn silu_mul(py: Python<'_>, gu: &Bound<'_, PyAny>, inter: usize) -> PyResult<()> {
    use hybridserve_cpu_kernels::activation::silu_mul as act;
    fn dims(shape: &[usize]) -> PyResult<(usize, usize)> {
        match shape {
            [t, x] => Ok((*t, *x)),
            _ => Err(PyValueError::new_err(format!(
                "gu must be [T, 2 * inter]; got shape {shape:?}"
            ))),
        }
    }
    let contiguous_err = || PyValueError::new_err("gu must be C-contiguous; pass .contiguous()");
    if let Ok(mut a) = gu.extract::<PyReadwriteArrayDyn<'_, u16>>() {
        let (t, x) = dims(a.shape())?;
        let s = a.as_slice_mut().map_err(|_| contiguous_err())?;
        return py.detach(|| act(s, t, inter, x)).map_err(err);
    }
    let mut a = gu.extract::<PyReadwriteArrayDyn<'_, f32>>().map_err(|_| {
        PyValueError::new_err("gu must be a float32 array or bfloat16 bits (uint16 view)")
    })?;
    let (t, x) = dims(a.shape())?;
    let s = a.as_slice_mut().map_err(|_| contiguous_err())?;
    py.detach(|| act(s, t, inter, x)).map_err(err)
}

/// Constrained decoding's mask: `logits[r, t] = -inf` for each listed row `r` and each
/// token `t < vocab` whose bit is clear in `bitmask[r]` (`[R, words]` int32, xgrammar's
/// layout). `logits` a C-contiguous `[R, X]` float32 array.
#[pyfunction]
fn apply_token_bitmask(
    py: Python<'_>,
    logits: &Bound<'_, PyAny>,
    bitmask: PyReadonlyArray2<'_, i32>,
    rows: Vec<usize>,
    vocab: usize,
) -> PyResult<()> {
    use hybridserve_cpu_kernels::token_bitmask::apply_token_bitmask as apply;
    let mut a = logits
        .extract::<PyReadwriteArrayDyn<'_, f32>>()
        .map_err(|_| PyValueError::new_err("logits must be a float32 array"))?;
    let stride = match a.shape() {
        [_, x] => *x,
        s => {
            return Err(PyValueError::new_err(format!(
                "logits must be [R, V]; got shape {s:?}"
            )))
        }
    };
    let words = bitmask.shape()[1];
    let mask = bitmask
        .as_slice()
        .map_err(|_| PyValueError::new_err("bitmask must be C-contiguous"))?;
    let s = a
        .as_slice_mut()
        .map_err(|_| PyValueError::new_err("logits must be C-contiguous; pass .contiguous()"))?;
    py.detach(|| apply(s, stride, vocab, mask, words, &rows))
        .map_err(err)
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(silu_mul, m)?)?;
    m.add_function(wrap_pyfunction!(apply_token_bitmask, m)?)
}
