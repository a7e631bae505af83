//! The bfloat16 bindings: the same kernels as the float32 ones in `mod.rs`, for a
//! bfloat16 model. numpy has no bfloat16, so Python passes `tensor.view(torch.uint16)`
//! views of the bits; the DeltaNet state stays float32.

use super::*;

decode_attention_binding!(
    /// [`paged_attention_decode`] for a bfloat16 model: `q`, the caches and `out` bfloat16
    /// bits (uint16 views).
    paged_attention_decode_bf16,
    u16,
    hybridserve_cpu_kernels::attention::paged_attention_decode_bf16
);

rms_norm_binding!(
    /// [`rms_norm`] for a bfloat16 model: every array bfloat16 bits (uint16 views).
    rms_norm_bf16,
    u16,
    hybridserve_cpu_kernels::norm::rms_norm_bf16
);

conv1d_binding!(
    /// [`causal_conv1d`] for a bfloat16 model: every array bfloat16 bits (uint16 views).
    causal_conv1d_bf16,
    u16,
    hybridserve_cpu_kernels::conv1d::causal_conv1d_bf16
);

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
    let (w, n) = weight_rows(&w, x.width)?;
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

qk_norm_rope_binding!(
    /// [`qk_norm_rope`] for a bfloat16 model: every array bfloat16 bits (uint16 views).
    qk_norm_rope_bf16,
    u16,
    hybridserve_cpu_kernels::rope::qk_norm_rope_bf16
);

delta_rule_binding!(
    /// [`gated_delta_rule`] for a bfloat16 model: `q`, `k`, `v`, the gates' inputs and
    /// parameters, `z`, `norm_weight` and `out` bfloat16 bits (uint16 views); the state
    /// pool float32.
    gated_delta_rule_bf16,
    u16,
    hybridserve_cpu_kernels::delta_rule::gated_delta_rule_bf16
);
