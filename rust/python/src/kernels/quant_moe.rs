//! The binding of an MoE layer's routed experts on GGML blocks
//! (`hybridserve_cpu_kernels::quant::experts`): the GGUF's 3-D expert tensors as
//! `uint8 [E, rows, row_bytes]` views, each with its GGML type id. The GIL is released.

use super::quant::{ggml_type, isa_of, with_out};
use super::*;
use hybridserve_cpu_kernels::quant::{self as q, ExpertBlocks, QuantExperts, Route};

/// `w` as C-contiguous bytes `[E, rows, row_bytes]`, with its shape.
fn expert_blocks<'a>(name: &str, w: &'a PyReadonlyArrayDyn<'_, u8>) -> PyResult<(&'a [u8], [usize; 3])> {
    let s = w.shape();
    if s.len() != 3 {
        return Err(PyValueError::new_err(format!(
            "{name} must be uint8 [E, rows, row_bytes] (the file's 3-D expert tensor), got shape {s:?}"
        )));
    }
    let data = w.as_slice().map_err(|_| PyValueError::new_err(format!("{name} must be C-contiguous")))?;
    Ok((data, [s[0], s[1], s[2]]))
}

/// `out = sum_j weights[t, j] * expert_{ids[t, j]}(x[t])` for every token, the experts
/// SwiGLU MLPs on blocks: `x` `[T, H]` float32 or uint16 (bfloat16 bits), rows
/// contiguous; `ids` int64 and `weights` float32 `[T, k]`, C-contiguous; `gate` /
/// `up` `[E, I, row_bytes(H)]` (`up` None: `gate` is gate and up stacked,
/// `[E, 2I, row_bytes(H)]`); `down` `[E, H, row_bytes(I)]`; each with its GGML type id;
/// `out` `[T, H]` C-contiguous, float32 or uint16. Returns the most pairs any expert
/// received.
#[pyfunction]
#[pyo3(signature = (x, ids, weights, gate, gate_type, up, up_type, down, down_type, out, isa = None))]
#[allow(clippy::too_many_arguments)]
pub(super) fn quant_experts(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    ids: PyReadonlyArray2<'_, i64>,
    weights: PyReadonlyArray2<'_, f32>,
    gate: PyReadonlyArrayDyn<'_, u8>,
    gate_type: u32,
    up: Option<PyReadonlyArrayDyn<'_, u8>>,
    up_type: Option<u32>,
    down: PyReadonlyArrayDyn<'_, u8>,
    down_type: u32,
    out: &Bound<'_, PyAny>,
    isa: Option<&str>,
) -> PyResult<usize> {
    let isa = isa_of(isa)?;
    let (gd, gs) = expert_blocks("gate", &gate)?;
    let (dd, ds) = expert_blocks("down", &down)?;
    let up_blocks = match (&up, up_type) {
        (Some(u), Some(ty)) => Some(ExpertBlocks { data: expert_blocks("up", u)?.0, ty: ggml_type(ty)? }),
        (None, None) => None,
        _ => return Err(PyValueError::new_err("pass up and up_type together (or neither: gate is gate_up)")),
    };
    let inter = if up_blocks.is_some() { gs[1] } else { gs[1] / 2 };
    if up_blocks.is_none() && gs[1] % 2 != 0 {
        return Err(PyValueError::new_err(format!("a fused gate_up needs an even row count, got {}", gs[1])));
    }
    if ds[0] != gs[0] {
        return Err(PyValueError::new_err(format!("gate has {} experts, down {}", gs[0], ds[0])));
    }
    let ex = QuantExperts {
        gate: ExpertBlocks { data: gd, ty: ggml_type(gate_type)? },
        up: up_blocks,
        down: ExpertBlocks { data: dd, ty: ggml_type(down_type)? },
        num: gs[0],
        inter,
    };
    let top_k = ids.shape()[1];
    if weights.shape() != ids.shape() {
        return Err(PyValueError::new_err(format!(
            "weights {:?} and ids {:?} must both be [T, k]",
            weights.shape(),
            ids.shape()
        )));
    }
    let ids_s = ids.as_slice().map_err(|_| PyValueError::new_err("ids must be C-contiguous int64 [T, k]"))?;
    let w_s = weights.as_slice().map_err(|_| PyValueError::new_err("weights must be C-contiguous float32 [T, k]"))?;
    let route = Route { ids: ids_s, weights: w_s, top_k };
    let mut load = 0usize;
    if let Ok(xa) = x.extract::<PyReadonlyArray2<'_, u16>>() {
        let xr = rows("x", &xa)?;
        with_out(py, out, |o| {
            load = q::quant_experts_with(isa, xr, route, &ex, o)?;
            Ok(())
        })?;
        return Ok(load);
    }
    let xa = x.extract::<PyReadonlyArray2<'_, f32>>().map_err(|_| {
        PyValueError::new_err("x must be a 2-D float32 or uint16 (bfloat16 bits) array")
    })?;
    let xr = rows("x", &xa)?;
    with_out(py, out, |o| {
        load = q::quant_experts_with(isa, xr, route, &ex, o)?;
        Ok(())
    })?;
    Ok(load)
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(quant_experts, m)?)
}
