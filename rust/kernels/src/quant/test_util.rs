//! What the quantized kernels' tests share: the seven block types, a seeded generator,
//! random valid weights and the instruction sets this CPU runs.

use super::act::f32_to_f16;
use super::blocks::GgmlType;
use super::QIsa;

pub(crate) const TYPES: [GgmlType; 7] = [
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];

/// A linear congruential generator: the same values on every run and platform.
pub(crate) struct Lcg(pub(crate) u64);

impl Lcg {
    pub(crate) fn next(&mut self) -> u32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 33) as u32
    }
    /// Uniform in [-0.5, 0.5).
    pub(crate) fn f(&mut self) -> f32 {
        self.next() as f32 / (1u64 << 31) as f32 - 0.5
    }
}

/// `n` rows of `k` weights in random blocks of `ty`: random quant bytes (every bit
/// pattern is a valid block), the float16 scales set to small finite values.
pub(crate) fn random_weight(ty: GgmlType, n: usize, k: usize, g: &mut Lcg) -> Vec<u8> {
    let mut w: Vec<u8> = (0..n * ty.row_bytes(k)).map(|_| g.next() as u8).collect();
    for b in w.chunks_exact_mut(ty.block_bytes()) {
        let mut put = |at: usize, v: f32| b[at..at + 2].copy_from_slice(&f32_to_f16(v).to_le_bytes());
        match ty {
            GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q5_0 => put(0, 0.01 + 0.02 * g.f().abs()),
            GgmlType::Q5_1 => {
                put(0, 0.01 + 0.02 * g.f().abs());
                put(2, 0.05 * g.f());
            }
            GgmlType::Q4K | GgmlType::Q5K => {
                put(0, 0.001 + 0.002 * g.f().abs());
                put(2, 0.001 + 0.002 * g.f().abs());
            }
            GgmlType::Q6K => put(208, 0.0005 + 0.001 * g.f().abs()),
        }
        if ty == GgmlType::Q8_0 {
            // -128 is not a value llama.cpp writes (|q| <= 127): the sign trick relies on it.
            for q in &mut b[2..34] {
                if *q == 0x80 {
                    *q = 0x81;
                }
            }
        }
    }
    w
}

/// The instruction sets this CPU runs, scalar first.
pub(crate) fn isas() -> Vec<QIsa> {
    [QIsa::Scalar, QIsa::Avx2, QIsa::Avx512Vnni].into_iter().filter(|i| i.supported()).collect()
}
