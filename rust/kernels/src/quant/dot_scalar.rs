//! The dot products in plain Rust: the reference the SIMD paths are tested against,
//! and what runs on CPUs without AVX2. Integer sums are exact; the float steps are the
//! ones llama.cpp's `vec_dot_*` take (per block for Q8_0 / Q4_0, per 256-weight
//! super-block for the k-quants, whose SIMD paths here take the same float steps and
//! so agree with this bit for bit).

use super::act::ActRow;
use super::blocks::{rd_f16, scale_min_k4, GgmlType, QK_K};

/// `w_row . x` for one weight row (`nb` blocks) and one quantized activation row.
pub fn dot(ty: GgmlType, w: &[u8], nb: usize, x: ActRow<'_>) -> f32 {
    match ty {
        GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q5_1 => {
            // Per block the exact integer sum `s` and `f = (d xd) s` (Q5_1, whose
            // `sum (d q + m) xd x = d xd sum q x + m xd sum x` takes the block's
            // activation sum from [`super::act`]: `+ (m xd) sum x`); block `b` into
            // accumulator `b % 8`, the eight summed pairwise at the end. The SIMD paths
            // keep the eight in lanes and take these steps exactly.
            let bb = ty.block_bytes();
            let one = ty == GgmlType::Q5_1;
            let at = if one { 4 } else { 2 };
            let mut lanes = [0.0f32; 8];
            for b in 0..nb.next_multiple_of(8) {
                if b >= nb {
                    // The vector paths add zeros in the last group's empty lanes.
                    lanes[b % 8] += 0.0;
                    continue;
                }
                let blk = &w[b * bb..(b + 1) * bb];
                let xq = &x.qs[32 * b..32 * b + 32];
                let mut s = 0i32;
                for l in 0..32 {
                    let q = match ty {
                        GgmlType::Q8_0 => blk[2 + l] as i8 as i32,
                        GgmlType::Q4_0 => (if l < 16 { blk[2 + l] & 0xF } else { blk[2 + l - 16] >> 4 }) as i32 - 8,
                        _ => {
                            let qh = u32::from_le_bytes([blk[at], blk[at + 1], blk[at + 2], blk[at + 3]]);
                            let nib = if l < 16 { blk[at + 4 + l] & 0xF } else { blk[at + 4 + l - 16] >> 4 };
                            let q = (nib as u32 | (((qh >> l) & 1) << 4)) as i32;
                            if one { q } else { q - 16 }
                        }
                    };
                    s += q * xq[l] as i32;
                }
                let dx = x.d[b];
                let mut f = rd_f16(blk, 0) * dx * s as f32;
                if one {
                    f += rd_f16(blk, 2) * dx * x.sums[b] as f32;
                }
                lanes[b % 8] += f;
            }
            let l = lanes;
            ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))
        }
        GgmlType::Q4K | GgmlType::Q5K => {
            let five = ty == GgmlType::Q5K;
            let bb = ty.block_bytes();
            let mut acc = 0.0f32;
            for b in 0..nb {
                let blk = &w[b * bb..(b + 1) * bb];
                let (qh, qs) = if five { (&blk[16..48], &blk[48..176]) } else { (&blk[0..0], &blk[16..144]) };
                let xq = &x.qs[QK_K * b..QK_K * (b + 1)];
                let (mut is, mut mins) = (0i32, 0i32);
                for j in 0..8 {
                    let (sc, m) = scale_min_k4(j, &blk[4..16]);
                    let mut s = 0i32;
                    for l in 0..32 {
                        let byte = qs[32 * (j / 2) + l];
                        let mut q = if j % 2 == 0 { byte & 0xF } else { byte >> 4 } as i32;
                        if five {
                            q |= (((qh[l] >> j) & 1) as i32) << 4;
                        }
                        s += q * xq[32 * j + l] as i32;
                    }
                    is += sc as i32 * s;
                    mins += m as i32 * (x.sums[16 * b + 2 * j] + x.sums[16 * b + 2 * j + 1]);
                }
                let dx = x.d[b];
                acc += rd_f16(blk, 0) * dx * is as f32 - rd_f16(blk, 2) * dx * mins as f32;
            }
            acc
        }
        GgmlType::Q6K => {
            let mut acc = 0.0f32;
            for b in 0..nb {
                let blk = &w[b * 210..(b + 1) * 210];
                let (ql, qh, sc) = (&blk[0..128], &blk[128..192], &blk[192..208]);
                let xq = &x.qs[QK_K * b..QK_K * (b + 1)];
                let mut is = 0i32;
                for g in 0..8 {
                    let (h, k) = (g / 4, g % 4);
                    for half in 0..2 {
                        let mut s = 0i32;
                        for l in 16 * half..16 * half + 16 {
                            let lo = ql[64 * h + 32 * (k % 2) + l];
                            let lo = if k < 2 { lo & 0xF } else { lo >> 4 };
                            let q = (lo | (((qh[32 * h + l] >> (2 * k)) & 3) << 4)) as i32;
                            s += q * xq[32 * g + l] as i32;
                        }
                        let gi = 2 * g + half;
                        is += sc[gi] as i8 as i32 * (s - 32 * x.sums[16 * b + gi]);
                    }
                }
                acc += rd_f16(blk, 208) * x.d[b] * is as f32;
            }
            acc
        }
    }
}
