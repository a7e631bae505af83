//! The bindings of the few-row GEMMs on quantized safetensors weights
//! (`hybridserve_cpu_kernels::quant_fp8`): FP8 block-scaled and int4 (AWQ, repacked
//! into rows at load). `x` and `out` are float32, or bfloat16 bits (uint16 views) for
//! both; the weight bytes are uint8, the scales (and int4 zero points) float32.

use super::*;
use hybridserve_cpu_kernels::quant_fp8 as q;
use numpy::PyReadonlyArray2;

fn c_slice<'a, T: numpy::Element>(
    name: &str,
    a: &'a PyReadonlyArray2<'_, T>,
    what: &str,
) -> PyResult<&'a [T]> {
    a.as_slice()
        .ok()
        .filter(|_| a.is_c_contiguous())
        .ok_or_else(|| PyValueError::new_err(format!("{name} must be a C-contiguous {what} array")))
}

/// Runs `f` on (`x` rows, `out`) as float32 or as bfloat16 bits, whichever `x` is; the
/// GIL released.
fn with_rows<F32, B16>(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    f32f: F32,
    b16f: B16,
) -> PyResult<()>
where
    F32: FnOnce(Rows<'_, f32>, &mut [f32]) -> Result<(), KernelError> + Send,
    B16: FnOnce(Rows<'_, u16>, &mut [u16]) -> Result<(), KernelError> + Send,
{
    if let Ok(xa) = x.extract::<PyReadonlyArray2<'_, f32>>() {
        let xr = rows("x", &xa)?;
        let mut o = out.extract::<PyReadwriteArrayDyn<'_, f32>>().map_err(|_| {
            PyValueError::new_err("out must be a writable float32 array when x is float32")
        })?;
        let o = contiguous_mut("out", &mut o)?;
        return py.detach(|| f32f(xr, o)).map_err(err);
    }
    let xa = x.extract::<PyReadonlyArray2<'_, u16>>().map_err(|_| {
        PyValueError::new_err("x must be a 2-D float32 array or bfloat16 bits (uint16 view)")
    })?;
    let xr = rows("x", &xa)?;
    let mut o = out.extract::<PyReadwriteArrayDyn<'_, u16>>().map_err(|_| {
        PyValueError::new_err(
            "out must be a writable uint16 (bfloat16 bits) array when x is bfloat16",
        )
    })?;
    let o = o
        .as_slice_mut()
        .map_err(|_| PyValueError::new_err("out must be C-contiguous"))?;
    py.detach(|| b16f(xr, o)).map_err(err)
}

/// `out = x @ W.T` for an FP8 block-scaled `W` (see `quant_fp8::fp8_matmul`): `w`
/// uint8 `[N, K]` (e4m3 bits), `scale` float32 `[ceil((row_offset + N)/128),
/// ceil(K/128)]`; `x` `[M, K]` and `out` `[M, N]` float32 or bfloat16 bits.
#[pyfunction]
fn fp8_matmul(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    w: PyReadonlyArray2<'_, u8>,
    scale: PyReadonlyArray2<'_, f32>,
    row_offset: usize,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let n = w.shape()[0];
    let wv = c_slice("w", &w, "uint8 [N, K]")?;
    let sv = c_slice("scale", &scale, "float32")?;
    if w.shape()[1] != x.getattr("shape")?.get_item(1)?.extract::<usize>()? {
        return Err(PyValueError::new_err(format!(
            "w must be [N, K] with K of x; got {:?}",
            w.shape()
        )));
    }
    with_rows(
        py,
        x,
        out,
        |x, o| q::fp8_matmul(x, wv, n, sv, row_offset, o),
        |x, o| q::fp8_matmul(x, wv, n, sv, row_offset, o),
    )
}

/// `out = x @ W.T` for an int4 `W` in rows (see `quant_fp8::int4_matmul`): `w` uint8
/// `[N, K/2]`, `scales` / `zeros` float32 `[N, K/group]`; `x` `[M, K]` and `out`
/// `[M, N]` float32 or bfloat16 bits.
#[pyfunction]
fn awq_matmul(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    w: PyReadonlyArray2<'_, u8>,
    scales: PyReadonlyArray2<'_, f32>,
    zeros: PyReadonlyArray2<'_, f32>,
    group: usize,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let n = w.shape()[0];
    let wv = c_slice("w", &w, "uint8 [N, K/2]")?;
    let sv = c_slice("scales", &scales, "float32 [N, K/group]")?;
    let zv = c_slice("zeros", &zeros, "float32 [N, K/group]")?;
    with_rows(
        py,
        x,
        out,
        |x, o| q::int4_matmul(x, wv, n, sv, zv, group, o),
        |x, o| q::int4_matmul(x, wv, n, sv, zv, group, o),
    )
}

/// What the FP8 / int4 kernels run on here: `"avx512"`, `"avx2"` or `"scalar"`.
#[pyfunction]
fn fp8_awq_isa() -> &'static str {
    q::quant_isa()
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(fp8_matmul, m)?)?;
    m.add_function(wrap_pyfunction!(awq_matmul, m)?)?;
    m.add_function(wrap_pyfunction!(fp8_awq_isa, m)?)?;
    Ok(())
}
