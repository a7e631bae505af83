//! The bindings of the kernels on llama.cpp's quantized blocks
//! (`hybridserve_cpu_kernels::quant`): weights as `uint8 [rows, row_bytes]` views of
//! the blocks, the block type by its GGML id (`gguf.GGMLQuantizationType`), outputs
//! float32 or bfloat16 bits (uint16) written in place. The GIL is released.

use super::*;
use hybridserve_cpu_kernels::matmul_bf16::Out;
use hybridserve_cpu_kernels::quant::{self as q, GgmlType, QIsa};

pub(super) fn ggml_type(id: u32) -> PyResult<GgmlType> {
    GgmlType::from_id(id).ok_or_else(|| {
        PyValueError::new_err(format!(
            "GGML type id {id} has no native kernel; supported: 2 (q4_0), 6 (q5_0), 7 (q5_1), 8 (q8_0), 12 (q4_k), 13 (q5_k), 14 (q6_k)"
        ))
    })
}

pub(super) fn isa_of(isa: Option<&str>) -> PyResult<QIsa> {
    match isa {
        None => Ok(QIsa::detect()),
        Some(s) => QIsa::from_name(s).ok_or_else(|| {
            PyValueError::new_err(format!("isa must be 'avx512_vnni', 'avx2' or 'scalar', got {s:?}"))
        }),
    }
}

/// `w` as C-contiguous bytes `[R, row_bytes]`.
fn blocks<'a>(w: &'a PyReadonlyArray2<'_, u8>) -> PyResult<&'a [u8]> {
    w.as_slice().ok().filter(|_| w.is_c_contiguous()).ok_or_else(|| {
        PyValueError::new_err("w must be a C-contiguous uint8 [rows, row_bytes] array of GGML blocks")
    })
}

/// Runs `f` with `out` as float32 or bfloat16 bits, the GIL released.
pub(super) fn with_out<'py>(
    py: Python<'py>,
    out: &Bound<'py, PyAny>,
    f: impl for<'o> FnOnce(Out<'o>) -> Result<(), KernelError> + Send,
) -> PyResult<()> {
    if let Ok(mut o) = out.extract::<PyReadwriteArrayDyn<'_, u16>>() {
        let o = o.as_slice_mut().map_err(|_| PyValueError::new_err("out must be C-contiguous"))?;
        return py.detach(|| f(Out::Bf16(o))).map_err(err);
    }
    let mut o = out.extract::<PyReadwriteArrayDyn<'_, f32>>().map_err(|_| {
        PyValueError::new_err("out must be a writable float32 or uint16 (bfloat16 bits) array")
    })?;
    let o = contiguous_mut("out", &mut o)?;
    py.detach(|| f(Out::F32(o))).map_err(err)
}

/// `out = x @ W.T` on GGML blocks: `x` `[T, K]` float32 or uint16 (bfloat16 bits),
/// rows contiguous; `w` `uint8 [N, row_bytes]`; `out` `[T, N]` C-contiguous, float32 or
/// uint16. Activations are quantized as llama.cpp does (Q8_0 / Q8_K). `isa` (tests and
/// benches) forces `"avx512_vnni"`, `"avx2"` or `"scalar"`.
#[pyfunction]
#[pyo3(signature = (x, w, ggml_type_id, out, isa = None))]
pub(super) fn quant_matmul(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    w: PyReadonlyArray2<'_, u8>,
    ggml_type_id: u32,
    out: &Bound<'_, PyAny>,
    isa: Option<&str>,
) -> PyResult<()> {
    let ty = ggml_type(ggml_type_id)?;
    let isa = isa_of(isa)?;
    let wb = blocks(&w)?;
    if let Ok(xa) = x.extract::<PyReadonlyArray2<'_, u16>>() {
        let xr = rows("x", &xa)?;
        return with_out(py, out, |o| q::quant_matmul_with(isa, xr, wb, ty, o));
    }
    let xa = x.extract::<PyReadonlyArray2<'_, f32>>().map_err(|_| {
        PyValueError::new_err("x must be a 2-D float32 or uint16 (bfloat16 bits) array")
    })?;
    let xr = rows("x", &xa)?;
    with_out(py, out, |o| q::quant_matmul_with(isa, xr, wb, ty, o))
}

/// [`quant_matmul`] for many rows (prefill): the same arguments and results (equal to
/// the scalar few-row kernel bit for bit), weight tiles unpacked once to bytes and run
/// against every activation row with AVX-512 VNNI (the few-row GEMM without it).
#[pyfunction]
#[pyo3(signature = (x, w, ggml_type_id, out, isa = None))]
pub(super) fn quant_matmul_prefill(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    w: PyReadonlyArray2<'_, u8>,
    ggml_type_id: u32,
    out: &Bound<'_, PyAny>,
    isa: Option<&str>,
) -> PyResult<()> {
    let ty = ggml_type(ggml_type_id)?;
    let isa = isa_of(isa)?;
    let wb = blocks(&w)?;
    if let Ok(xa) = x.extract::<PyReadonlyArray2<'_, u16>>() {
        let xr = rows("x", &xa)?;
        return with_out(py, out, |o| q::quant_matmul_prefill_with(isa, xr, wb, ty, o));
    }
    let xa = x.extract::<PyReadonlyArray2<'_, f32>>().map_err(|_| {
        PyValueError::new_err("x must be a 2-D float32 or uint16 (bfloat16 bits) array")
    })?;
    let xr = rows("x", &xa)?;
    with_out(py, out, |o| q::quant_matmul_prefill_with(isa, xr, wb, ty, o))
}

/// `out` = the rows of `w` (`uint8 [R, row_bytes]`) dequantized, `[R, K]` float32 or
/// uint16 (bfloat16 bits, rounded to nearest even), C-contiguous.
#[pyfunction]
pub(super) fn quant_dequantize(
    py: Python<'_>,
    w: PyReadonlyArray2<'_, u8>,
    ggml_type_id: u32,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let ty = ggml_type(ggml_type_id)?;
    let wb = blocks(&w)?;
    let rows = w.shape()[0];
    let shape: Vec<usize> = out
        .getattr("shape")?
        .extract()
        .map_err(|_| PyValueError::new_err("out must be a numpy array"))?;
    if shape.len() != 2 || shape[0] != rows {
        return Err(PyValueError::new_err(format!("out must be [R={rows}, K], got {shape:?}")));
    }
    let k = shape[1];
    if rows > 0 && ty.row_bytes(k) != w.shape()[1] {
        return Err(PyValueError::new_err(format!(
            "w rows of {} bytes are not {} rows of K={k} ({} bytes)",
            w.shape()[1],
            ty.name(),
            ty.row_bytes(k)
        )));
    }
    with_out(py, out, |o| q::dequantize_rows(wb, ty, k, o))
}

/// The instruction set the quantized kernels use on this CPU: `"avx512_vnni"`,
/// `"avx2"` or `"scalar"`.
#[pyfunction]
pub(super) fn quant_isa() -> &'static str {
    QIsa::detect().name()
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(quant_matmul, m)?)?;
    m.add_function(wrap_pyfunction!(quant_matmul_prefill, m)?)?;
    m.add_function(wrap_pyfunction!(quant_dequantize, m)?)?;
    m.add_function(wrap_pyfunction!(quant_isa, m)?)
}
