//! The bfloat16 sparse MoE block binding (`hybridserve_cpu_kernels::moe_bf16`): every
//! weight as the checkpoint stores it (`[N, K]` row-major per expert), bfloat16 bits
//! in uint16 views; the routing comes back as int64 ids and float32 weights.

use super::*;

/// A C-contiguous bfloat16 array of exactly `shape` (C order checked: `as_slice` also
/// takes a Fortran-ordered array, which the kernel would read wrongly).
fn weight<'a>(
    name: &str,
    a: &'a PyReadonlyArrayDyn<'_, u16>,
    shape: &[usize],
    layout: &str,
) -> PyResult<&'a [u16]> {
    if a.shape() != shape {
        return Err(PyValueError::new_err(format!(
            "{name} must be {layout} = {shape:?}, got {:?}",
            a.shape()
        )));
    }
    a.as_slice()
        .ok()
        .filter(|_| a.is_c_contiguous())
        .ok_or_else(|| {
            PyValueError::new_err(format!(
                "{name} must be a C-contiguous {layout} array of bfloat16 bits (uint16 view)"
            ))
        })
}

/// A whole bfloat16 sparse MoE block (see `hybridserve_cpu_kernels::moe_bf16`): `x`
/// `[T, H]`, `router` `[E, H]`, `gate_up` `[E, 2I, H]`, `down` `[E, H, I]`, the
/// optional shared expert `shared_gate_up` `[2Is, H]`, `shared_down` `[H, Is]`,
/// `shared_gate` `[1, H]`, all bfloat16 bits; writes `out` `[T, H]` (bfloat16 bits),
/// `topk_ids` (int64) and `topk_weights` (float32) `[T, top_k]`. Returns the most rows
/// any one expert received. `packed`: `gate_up` and `down` are in the panel layout
/// [`pack_experts_bf16`] makes (same shapes); `shared_packed`: the shared expert's
/// `shared_gate_up` / `shared_down` too (packed as one expert, `E = 1`).
#[pyfunction]
#[pyo3(signature = (x, router, gate_up, down, top_k, out, topk_ids, topk_weights,
                    shared_gate_up=None, shared_down=None, shared_gate=None, packed=false,
                    shared_packed=false))]
#[allow(clippy::too_many_arguments)]
fn moe_block_bf16(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, u16>,
    router: PyReadonlyArrayDyn<'_, u16>,
    gate_up: PyReadonlyArrayDyn<'_, u16>,
    down: PyReadonlyArrayDyn<'_, u16>,
    top_k: usize,
    mut out: PyReadwriteArrayDyn<'_, u16>,
    mut topk_ids: PyReadwriteArrayDyn<'_, i64>,
    mut topk_weights: PyReadwriteArrayDyn<'_, f32>,
    shared_gate_up: Option<PyReadonlyArrayDyn<'_, u16>>,
    shared_down: Option<PyReadonlyArrayDyn<'_, u16>>,
    shared_gate: Option<PyReadonlyArrayDyn<'_, u16>>,
    packed: bool,
    shared_packed: bool,
) -> PyResult<usize> {
    use hybridserve_cpu_kernels::moe::Routing;
    use hybridserve_cpu_kernels::moe_bf16::{
        moe_block_bf16 as block, Experts, Router, SharedExpert,
    };
    let x = rows("x", &x)?;
    let h = x.width;
    let (e, inter) = match (router.shape(), down.shape()) {
        ([e, _], [_, _, i]) => (*e, *i),
        (r, d) => {
            return Err(PyValueError::new_err(format!(
                "router must be [E, H] and down [E, H, I]; got shapes {r:?} and {d:?}"
            )))
        }
    };
    let router = weight("router", &router, &[e, h], "[E, H]")?;
    let gate_up = weight("gate_up", &gate_up, &[e, 2 * inter, h], "[E, 2I, H]")?;
    let down = weight("down", &down, &[e, h, inter], "[E, H, I]")?;
    let shared = match (&shared_gate_up, &shared_down, &shared_gate) {
        (Some(a), Some(b), Some(g)) => {
            let si = match b.shape() {
                [_, si] => *si,
                s => {
                    return Err(PyValueError::new_err(format!(
                        "shared_down must be [H, Is], got shape {s:?}"
                    )))
                }
            };
            Some(SharedExpert {
                gate_up: weight("shared_gate_up", a, &[2 * si, h], "[2Is, H]")?,
                down: weight("shared_down", b, &[h, si], "[H, Is]")?,
                gate: weight("shared_gate", g, &[1, h], "[1, H]")?,
                inter: si,
                packed: shared_packed,
            })
        }
        (None, None, None) => None,
        _ => {
            return Err(PyValueError::new_err(
                "give all of shared_gate_up, shared_down and shared_gate, or none",
            ))
        }
    };
    let out = contiguous_mut_of("out", &mut out)?;
    let ids = topk_ids
        .as_slice_mut()
        .map_err(|_| PyValueError::new_err("topk_ids must be C-contiguous int64"))?;
    let weights = contiguous_mut("topk_weights", &mut topk_weights)?;
    py.detach(|| {
        block(
            x,
            Router {
                weight: router,
                num_experts: e,
                top_k,
            },
            Experts {
                gate_up,
                down,
                inter,
                packed,
            },
            shared,
            out,
            Routing { ids, weights },
        )
    })
    .map_err(err)
}

/// Rearranges HF's expert tensors `gate_up` `[E, 2I, H]` and `down` `[E, H, I]`
/// (bfloat16 bits, C-contiguous) in place into the panel layout `moe_block_bf16(...,
/// packed=True)` reads, or back (`unpack`); one expert matrix of scratch at a time.
#[pyfunction]
#[pyo3(signature = (gate_up, down, unpack=false))]
fn pack_experts_bf16(
    py: Python<'_>,
    mut gate_up: PyReadwriteArrayDyn<'_, u16>,
    mut down: PyReadwriteArrayDyn<'_, u16>,
    unpack: bool,
) -> PyResult<()> {
    let (e, h, inter) = match (gate_up.shape(), down.shape()) {
        ([e, i2, h], [e2, h2, i]) if e == e2 && h == h2 && *i2 == 2 * *i => (*e, *h, *i),
        (g, d) => {
            return Err(PyValueError::new_err(format!(
                "gate_up must be [E, 2I, H] and down [E, H, I]; got shapes {g:?} and {d:?}"
            )))
        }
    };
    if !gate_up.is_c_contiguous() || !down.is_c_contiguous() {
        return Err(PyValueError::new_err(
            "gate_up and down must be C-contiguous bfloat16 bits (uint16 views)",
        ));
    }
    let gu = contiguous_mut_of("gate_up", &mut gate_up)?;
    let dn = contiguous_mut_of("down", &mut down)?;
    py.detach(|| hybridserve_cpu_kernels::moe_bf16::pack_experts(gu, dn, e, h, inter, unpack))
        .map_err(err)
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(moe_block_bf16, m)?)?;
    m.add_function(wrap_pyfunction!(pack_experts_bf16, m)?)
}
