//! llama.cpp's block layouts (`ggml-common.h`) and their scalar dequantization, the
//! reference every faster path here is checked against (and, from Python, against the
//! `gguf` package's reader).
//!
//! * Q8_0 (34 bytes / 32 weights): `d: f16`, `qs: [i8; 32]`; `w = d q`.
//! * Q4_0 (18 / 32): `d: f16`, `qs: [u8; 16]`; weight `i < 16` is the low nibble of
//!   `qs[i]`, `i >= 16` the high nibble of `qs[i - 16]`; `w = d (q - 8)`.
//! * Q5_0 (22 / 32): `d: f16`, `qh: [u8; 4]` (a little-endian u32: bit `i` is weight
//!   `i`'s fifth bit), `qs: [u8; 16]` nibbles as Q4_0; `w = d (q - 16)`.
//! * Q5_1 (24 / 32): `d, m: f16`, then `qh` and `qs` as Q5_0; `w = d q + m`.
//! * Q4_K (144 / 256): `d, dmin: f16`, `scales: [u8; 12]` (eight 6-bit scales and
//!   mins, [`scale_min_k4`]), `qs: [u8; 128]`: four runs of 32 bytes, run `j` holding
//!   sub-block `2j` in its low nibbles and `2j + 1` in its high; `w = d sc q - dmin m`.
//! * Q5_K (176 / 256): Q4_K's fields with `qh: [u8; 32]` before `qs`: bit `j` of
//!   `qh[l]` is the fifth bit of element `l` of sub-block `j`.
//! * Q6_K (210 / 256): `ql: [u8; 128]`, `qh: [u8; 64]`, `scales: [i8; 16]` (one per
//!   16 weights), `d: f16`; in half `h` of the block, group `k` (32 weights) takes its
//!   low 4 bits from `ql[64 h + 32 (k % 2) + l]` (low nibble for `k < 2`, high else)
//!   and its top 2 from bits `2k..2k+2` of `qh[32 h + l]`; `w = d sc (q - 32)`.

/// A GGML block type served here; the discriminant is `ggml_type`'s value (what GGUF
/// files store and `gguf.GGMLQuantizationType` numbers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgmlType {
    Q4_0 = 2,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q4K = 12,
    Q5K = 13,
    Q6K = 14,
}

pub const QK_K: usize = 256;

impl GgmlType {
    pub fn from_id(id: u32) -> Option<GgmlType> {
        Some(match id {
            2 => GgmlType::Q4_0,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            12 => GgmlType::Q4K,
            13 => GgmlType::Q5K,
            14 => GgmlType::Q6K,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            GgmlType::Q4_0 => "q4_0",
            GgmlType::Q5_0 => "q5_0",
            GgmlType::Q5_1 => "q5_1",
            GgmlType::Q8_0 => "q8_0",
            GgmlType::Q4K => "q4_k",
            GgmlType::Q5K => "q5_k",
            GgmlType::Q6K => "q6_k",
        }
    }

    /// Weights per block.
    pub fn block_size(self) -> usize {
        match self {
            GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 => 32,
            _ => QK_K,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::Q4_0 => 18,
            GgmlType::Q5_0 => 22,
            GgmlType::Q5_1 => 24,
            GgmlType::Q8_0 => 34,
            GgmlType::Q4K => 144,
            GgmlType::Q5K => 176,
            GgmlType::Q6K => 210,
        }
    }

    /// Bytes of a row of `k` weights (`k` a multiple of the block size).
    pub fn row_bytes(self, k: usize) -> usize {
        k / self.block_size() * self.block_bytes()
    }

    /// True for the k-quants, whose activations are quantized as Q8_K.
    pub fn is_k(self) -> bool {
        matches!(self, GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K)
    }
}

/// IEEE half-precision bits to `f32` (exact), subnormals and specials included.
#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = if exp == 0 {
        if man == 0 {
            sign
        } else {
            // Subnormal: man * 2^-24, exact in f32.
            let v = man as f32 * (1.0 / 16_777_216.0);
            return if sign != 0 { -v } else { v };
        }
    } else if exp == 0x1f {
        sign | 0x7f80_0000 | (man << 13)
    } else {
        sign | ((exp + 112) << 23) | (man << 13)
    };
    f32::from_bits(bits)
}

#[inline(always)]
pub(crate) fn rd_f16(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// Sub-block `j`'s 6-bit scale and min from `block_q4_K.scales` (`get_scale_min_k4`).
#[inline(always)]
pub fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// One block's weights as `f32` (`out.len() == ty.block_size()`).
pub fn dequantize_block(ty: GgmlType, b: &[u8], out: &mut [f32]) {
    match ty {
        GgmlType::Q8_0 => {
            let d = rd_f16(b, 0);
            for (o, &q) in out.iter_mut().zip(&b[2..34]) {
                *o = d * (q as i8) as f32;
            }
        }
        GgmlType::Q4_0 => {
            let d = rd_f16(b, 0);
            for i in 0..16 {
                out[i] = d * ((b[2 + i] & 0xF) as i32 - 8) as f32;
                out[i + 16] = d * ((b[2 + i] >> 4) as i32 - 8) as f32;
            }
        }
        GgmlType::Q5_0 | GgmlType::Q5_1 => {
            let d = rd_f16(b, 0);
            let one = ty == GgmlType::Q5_1;
            let at = if one { 4 } else { 2 };
            let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
            let qs = &b[at + 4..at + 20];
            for i in 0..16 {
                let lo = ((qs[i] & 0xF) as u32 | (((qh >> i) & 1) << 4)) as i32;
                let hi = ((qs[i] >> 4) as u32 | (((qh >> (i + 16)) & 1) << 4)) as i32;
                if one {
                    let m = rd_f16(b, 2);
                    out[i] = d * lo as f32 + m;
                    out[i + 16] = d * hi as f32 + m;
                } else {
                    out[i] = d * (lo - 16) as f32;
                    out[i + 16] = d * (hi - 16) as f32;
                }
            }
        }
        GgmlType::Q4K | GgmlType::Q5K => {
            let (d, dmin) = (rd_f16(b, 0), rd_f16(b, 2));
            let scales = &b[4..16];
            let five = ty == GgmlType::Q5K;
            let (qh, qs): (&[u8; 32], &[u8; 128]) = if five {
                (b[16..48].try_into().unwrap(), b[48..176].try_into().unwrap())
            } else {
                (&[0u8; 32], b[16..144].try_into().unwrap())
            };
            // Branch-free inner loops over fixed-size arrays (the compiler vectorizes
            // them): the prefill path dequantizes whole weights through here.
            for j in 0..8 {
                let (sc, m) = scale_min_k4(j, scales);
                let (ds, dm) = (d * sc as f32, dmin * m as f32);
                let run: &[u8; 32] = qs[32 * (j / 2)..32 * (j / 2) + 32].try_into().unwrap();
                let shift = 4 * (j % 2) as u32;
                let o: &mut [f32] = &mut out[32 * j..32 * j + 32];
                for l in 0..32 {
                    let q = ((run[l] >> shift) & 0xF) | (((qh[l] >> j) & 1) << 4);
                    o[l] = ds * q as f32 - dm;
                }
            }
        }
        GgmlType::Q6K => {
            let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
            let d = rd_f16(b, 208);
            for h in 0..2 {
                let qhh: &[u8; 32] = qh[32 * h..32 * h + 32].try_into().unwrap();
                for k in 0..4 {
                    let g = 4 * h + k;
                    let lo: &[u8; 32] = ql[64 * h + 32 * (k % 2)..64 * h + 32 * (k % 2) + 32].try_into().unwrap();
                    let shift = 4 * (k / 2) as u32;
                    let (d0, d1) = (d * (sc[2 * g] as i8) as f32, d * (sc[2 * g + 1] as i8) as f32);
                    let o: &mut [f32] = &mut out[32 * g..32 * g + 32];
                    for l in 0..32 {
                        let q = (((lo[l] >> shift) & 0xF) | (((qhh[l] >> (2 * k)) & 3) << 4)) as i32 - 32;
                        o[l] = if l < 16 { d0 } else { d1 } * q as f32;
                    }
                }
            }
        }
    }
}

/// A whole row (`k` weights) as `f32`.
pub fn dequantize_row(ty: GgmlType, row: &[u8], out: &mut [f32]) {
    let (bs, bb) = (ty.block_size(), ty.block_bytes());
    for (o, b) in out.chunks_exact_mut(bs).zip(row.chunks_exact(bb)) {
        dequantize_block(ty, b, o);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_conversion_matches_known_values() {
        assert_eq!(f16_to_f32(0x3c00), 1.0);
        assert_eq!(f16_to_f32(0xc000), -2.0);
        assert_eq!(f16_to_f32(0x7bff), 65504.0);
        assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
        assert_eq!(f16_to_f32(0x8001), -(2f32.powi(-24)));
        assert_eq!(f16_to_f32(0x0400), 2f32.powi(-14));
        assert_eq!(f16_to_f32(0x3555), 0.333_251_95);
        assert!(f16_to_f32(0x7e00).is_nan());
        assert_eq!(f16_to_f32(0xfc00), f32::NEG_INFINITY);
    }

    #[test]
    fn scale_min_k4_unpacks_the_packed_bits() {
        // Pack known 6-bit values the way llama.cpp does and read them back.
        let sc: [u8; 8] = [1, 63, 17, 42, 5, 60, 33, 12];
        let mn: [u8; 8] = [0, 7, 63, 21, 48, 3, 9, 31];
        let mut q = [0u8; 12];
        for j in 0..4 {
            q[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
            q[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
            q[j + 8] = (sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4);
        }
        for j in 0..8 {
            assert_eq!(scale_min_k4(j, &q), (sc[j], mn[j]));
        }
    }
}
