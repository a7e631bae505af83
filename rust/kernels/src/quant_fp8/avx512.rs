//! The same columns with AVX-512 intrinsics: a 128-input block of a weight row is
//! widened into 8 registers (FP8: sign-extend, shift, mask, one multiply; int4: two
//! nibble masks and a widening convert per 16) and every row of `x` takes its dot
//! product with them in one 16-lane accumulator, added to the row's lane totals
//! times the block's scale.
use super::{Format, SendPtr, FP8_BLOCK, MAX_M};
use crate::bf16::Elem;
use std::arch::x86_64::*;

#[inline(always)]
unsafe fn fp8x16(p: *const u8) -> __m512 {
    // Sign-extended, shifted by 20: the sign lands on bit 31 (and 27..30, masked
    // off), exponent and mantissa on bits 20..26; times 2^120 (see the module doc).
    let v = _mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const __m128i));
    let bits = _mm512_and_si512(
        _mm512_slli_epi32::<20>(v),
        _mm512_set1_epi32(0x87f0_0000u32 as i32),
    );
    _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(1.329_228e36))
}

#[inline(always)]
unsafe fn int4x64(p: *const u8, out: &mut [__m512; 4]) {
    let v = _mm256_loadu_si256(p as *const __m256i);
    let m = _mm256_set1_epi8(0x0f);
    let lo = _mm256_and_si256(v, m);
    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m);
    out[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(lo)));
    out[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256::<1>(lo)));
    out[2] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(hi)));
    out[3] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256::<1>(hi)));
}

/// [`super::columns`] where every block is a whole 128 inputs (FP8: `K % 128 == 0`;
/// int4: group 128); anything else takes the portable loop.
///
/// # Safety
/// The CPU has AVX-512F/BW/VL; the caller's contract of [`super::columns`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn columns<T: Elem>(
    f: Format<'_>,
    xf: &[f32],
    xsum: &[f32],
    k: usize,
    n: usize,
    m0: usize,
    mm: usize,
    j0: usize,
    j1: usize,
    out: SendPtr<T>,
) {
    let nblocks = k / FP8_BLOCK;
    let xp = xf.as_ptr().add(m0 * k);
    // TR weight rows at a time, block by block: a block of x (mm rows x 128
    // inputs, 8 KiB at 16 rows) is read from L1 by all TR rows instead of the whole
    // of x streaming from L2 once per weight row.
    const TR: usize = 8;
    let mut tot = [[_mm512_setzero_ps(); MAX_M]; TR];
    let mut corr = [[0f32; MAX_M]; TR];
    let mut wv = [_mm512_setzero_ps(); 8];
    let mut jt = j0;
    while jt < j1 {
        let tr = (j1 - jt).min(TR);
        for r in 0..tr {
            for m in 0..mm {
                tot[r][m] = _mm512_setzero_ps();
                corr[r][m] = 0.0;
            }
        }
        for b in 0..nblocks {
            for r in 0..tr {
                let j = jt + r;
                let s = match f {
                    Format::Fp8 {
                        w,
                        scale,
                        scale_cols,
                        row_offset,
                    } => {
                        let p = w.as_ptr().add(j * k + b * FP8_BLOCK);
                        for (c, v) in wv.iter_mut().enumerate() {
                            *v = fp8x16(p.add(16 * c));
                        }
                        *scale.get_unchecked((row_offset + j) / FP8_BLOCK * scale_cols + b)
                    }
                    Format::Int4 {
                        w, scales, zeros, ..
                    } => {
                        let p = w.as_ptr().add(j * k / 2 + b * FP8_BLOCK / 2);
                        let (a, rest) = wv.split_at_mut(4);
                        int4x64(p, a.try_into().unwrap());
                        int4x64(p.add(32), rest.try_into().unwrap());
                        let g = nblocks;
                        let (s, z) = (
                            *scales.get_unchecked(j * g + b),
                            *zeros.get_unchecked(j * g + b),
                        );
                        for m in 0..mm {
                            corr[r][m] += s * z * *xsum.get_unchecked((m0 + m) * g + b);
                        }
                        s
                    }
                };
                let sv = _mm512_set1_ps(s);
                for m in 0..mm {
                    let row = xp.add(m * k + b * FP8_BLOCK);
                    let mut acc0 = _mm512_mul_ps(_mm512_loadu_ps(row), wv[0]);
                    let mut acc1 = _mm512_mul_ps(_mm512_loadu_ps(row.add(16)), wv[1]);
                    for c in (2..8).step_by(2) {
                        acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(row.add(16 * c)), wv[c], acc0);
                        acc1 =
                            _mm512_fmadd_ps(_mm512_loadu_ps(row.add(16 * c + 16)), wv[c + 1], acc1);
                    }
                    tot[r][m] = _mm512_fmadd_ps(sv, _mm512_add_ps(acc0, acc1), tot[r][m]);
                }
            }
        }
        for r in 0..tr {
            for m in 0..mm {
                let v = _mm512_reduce_add_ps(tot[r][m]) - corr[r][m];
                *out.0.add((m0 + m) * n + jt + r) = T::narrow(v);
            }
        }
        jt += tr;
    }
}
