//! Kernels on llama.cpp's quantized blocks (GGUF's Q8_0, Q4_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), the
//! weights kept in their blocks as the file stores them:
//!
//! * [`blocks`]: the layouts and a scalar dequantizer (the reference);
//! * [`act`]: activations quantized as llama.cpp's `vec_dot` takes them (Q8_0 / Q8_K);
//! * [`dot_scalar`], [`dot_x86`]: one weight row against a few activation rows;
//! * [`gemm`]: the few-row GEMM `x W^T` (decode steps, MoE experts, the LM head) and
//!   the row dequantizer (embedding lookups, prefill tiles), split over output rows on
//!   the crate's pool;
//! * [`prefill`]: the many-row GEMM (prefill), weight tiles unpacked once to bytes and
//!   run against many activation rows, with the same activation rounding;
//! * [`experts`]: an MoE layer's routed experts in one call on the file's 3-D expert
//!   tensors (each token quantized once, pairs grouped by expert, `gemm`'s row kernels
//!   on (expert, row tile) tasks, the weighted sum in a fixed order).
//!
//! Decode reads every weight byte once per step, so the bytes are the cost: a Q4_K
//! row is 0.56 bytes per weight against bfloat16's 2.

pub mod act;
pub mod blocks;
pub mod dot_scalar;
#[cfg(target_arch = "x86_64")]
pub mod dot_x86;
pub mod experts;
pub mod gemm;
pub mod prefill;
#[cfg(test)]
mod test_util;
#[cfg(test)]
mod timing;

pub use blocks::GgmlType;
pub use experts::{quant_experts, quant_experts_with, ExpertBlocks, QuantExperts, Route};
pub use gemm::{dequantize_rows, dequantize_rows_with, quant_matmul, quant_matmul_with};
pub use prefill::{quant_matmul_prefill, quant_matmul_prefill_with};

/// The instruction set the quantized kernels run with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QIsa {
    /// AVX2 with AVX-512 VNNI's `vpdpbusd` on 256-bit registers (needs AVX-512VL).
    Avx512Vnni,
    /// AVX2 (`vpmaddubsw` + `vpmaddwd`), FMA and F16C.
    Avx2,
    /// Plain Rust.
    Scalar,
}

impl QIsa {
    /// The best this CPU supports (checked once per process).
    pub fn detect() -> QIsa {
        use std::sync::OnceLock;
        static ISA: OnceLock<QIsa> = OnceLock::new();
        *ISA.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                let avx2 = std::is_x86_feature_detected!("avx2")
                    && std::is_x86_feature_detected!("fma")
                    && std::is_x86_feature_detected!("f16c");
                if avx2
                    && std::is_x86_feature_detected!("avx512f")
                    && std::is_x86_feature_detected!("avx512vl")
                    && std::is_x86_feature_detected!("avx512vnni")
                {
                    return QIsa::Avx512Vnni;
                }
                if avx2 {
                    return QIsa::Avx2;
                }
            }
            QIsa::Scalar
        })
    }

    /// True when this CPU can run kernels compiled for `self`.
    pub fn supported(self) -> bool {
        match self {
            QIsa::Scalar => true,
            QIsa::Avx2 => QIsa::detect() != QIsa::Scalar,
            QIsa::Avx512Vnni => QIsa::detect() == QIsa::Avx512Vnni,
        }
    }

    /// `"avx512_vnni"`, `"avx2"` or `"scalar"`.
    pub fn name(self) -> &'static str {
        match self {
            QIsa::Avx512Vnni => "avx512_vnni",
            QIsa::Avx2 => "avx2",
            QIsa::Scalar => "scalar",
        }
    }

    pub fn from_name(s: &str) -> Option<QIsa> {
        Some(match s {
            "avx512_vnni" => QIsa::Avx512Vnni,
            "avx2" => QIsa::Avx2,
            "scalar" => QIsa::Scalar,
            _ => return None,
        })
    }
}
