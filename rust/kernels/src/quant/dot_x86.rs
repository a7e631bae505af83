//! The dot products on x86: one weight row against `R` quantized activation rows, the
//! weight's blocks unpacked once into bytes and reused for every row. All formats come
//! down to unsigned weight bytes times signed int8 activations, 32 at a time:
//!
//! * AVX2: `vpmaddubsw` (pairs into int16; no saturation: at most 2 x 127 x 127) and
//!   `vpmaddwd` (pairs into int32, times a sub-block's integer scale on the k-quants);
//! * AVX-512 VNNI: `vpdpbusd` (four products into int32 in one instruction) on 256-bit
//!   registers, whose width this AMD core runs at full rate (it splits 512-bit ones),
//!   then the integer scale by `vpmulld`.
//!
//! Q8_0 and Q4_0 weights are signed: llama.cpp's sign trick (`|w|` times `x` with
//! `w`'s sign) makes them unsigned. Q4_K / Q5_K store `q >= 0` with a min, Q6_K `q + 32`:
//! their mins and offsets are taken from the activation's 16-sums ([`super::act`]).
//! The k-quants' integer sum of a super-block is exact and its float steps those of
//! [`super::dot_scalar`], so the three paths agree bit for bit there; Q8_0 / Q4_0
//! accumulate per block in float32 lanes (rounding order differs from the scalar sum).

use super::act::ActRow;

macro_rules! kernels {
    ($name:ident, $feat:literal, $vnni:literal) => {
        pub mod $name {
            use super::ActRow;
            use crate::quant::blocks::{rd_f16, scale_min_k4};
            use std::arch::x86_64::*;

            /// Unsigned bytes `u` times signed bytes `x`, four neighbours summed into
            /// each int32 lane.
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn idot(u: __m256i, x: __m256i) -> __m256i {
                if $vnni {
                    _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x)
                } else {
                    _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1))
                }
            }

            /// [`idot`] with elements 0..16 times `s.0`, 16..32 times `s.1` (integer
            /// scales, as the register [`scales`] builds).
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn sdot(u: __m256i, x: __m256i, s: __m256i) -> __m256i {
                if $vnni {
                    _mm256_mullo_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x), s)
                } else {
                    _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), s)
                }
            }

            /// The scale register [`sdot`] takes: `lo` for elements 0..16, `hi` after.
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn scales(lo: i32, hi: i32) -> __m256i {
                if $vnni {
                    _mm256_set_m128i(_mm_set1_epi32(hi), _mm_set1_epi32(lo))
                } else {
                    _mm256_set_m128i(_mm_set1_epi16(hi as i16), _mm_set1_epi16(lo as i16))
                }
            }

            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn hsum_i32(v: __m256i) -> i32 {
                let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
                let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
                let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
                _mm_cvtsi128_si32(s)
            }

            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn hsum_ps(v: __m256) -> f32 {
                let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
                let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
                let s = _mm_add_ss(s, _mm_movehdup_ps(s));
                _mm_cvtss_f32(s)
            }

            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn ld(p: *const u8) -> __m256i {
                _mm256_loadu_si256(p as *const __m256i)
            }

            /// Q8_0 (`FOUR = false`) or Q4_0 weights: blocks of 32 signed values.
            #[target_feature(enable = $feat)]
            pub unsafe fn q8_0_q4_0<const R: usize, const FOUR: bool>(
                w: *const u8,
                nb: usize,
                xs: &[ActRow<'_>; R],
            ) -> [f32; R] {
                let bb = if FOUR { 18 } else { 34 };
                let mut acc = [_mm256_setzero_ps(); R];
                let m4 = _mm256_set1_epi8(0x0F);
                for b in 0..nb {
                    let blk = w.add(b * bb);
                    let dw = rd_f16(std::slice::from_raw_parts(blk, 2), 0);
                    let wq = if FOUR {
                        let q = _mm_loadu_si128(blk.add(2) as *const __m128i);
                        let v = _mm256_set_m128i(_mm_srli_epi16::<4>(q), q);
                        _mm256_sub_epi8(_mm256_and_si256(v, m4), _mm256_set1_epi8(8))
                    } else {
                        ld(blk.add(2))
                    };
                    let u = _mm256_abs_epi8(wq);
                    for r in 0..R {
                        let x = ld(xs[r].qs.as_ptr().add(32 * b) as *const u8);
                        let p = idot(u, _mm256_sign_epi8(x, wq));
                        let d = _mm256_set1_ps(dw * *xs[r].d.get_unchecked(b));
                        acc[r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(p), acc[r]);
                    }
                }
                std::array::from_fn(|r| hsum_ps(acc[r]))
            }

            /// Q4_K (`FIVE = false`) or Q5_K weights.
            #[target_feature(enable = $feat)]
            pub unsafe fn q4k_q5k<const R: usize, const FIVE: bool>(
                w: *const u8,
                nb: usize,
                xs: &[ActRow<'_>; R],
            ) -> [f32; R] {
                let bb = if FIVE { 176 } else { 144 };
                let qs_at = if FIVE { 48 } else { 16 };
                let m4 = _mm256_set1_epi8(0x0F);
                let h5 = _mm256_set1_epi8(0x10);
                let mut acc = [0.0f32; R];
                for b in 0..nb {
                    let blk = w.add(b * bb);
                    let head = std::slice::from_raw_parts(blk, 16);
                    let (d, dmin) = (rd_f16(head, 0), rd_f16(head, 2));
                    let sm: [(u8, u8); 8] = std::array::from_fn(|j| scale_min_k4(j, &head[4..16]));
                    let qh = if FIVE { ld(blk.add(16)) } else { _mm256_setzero_si256() };
                    let mut isum = [_mm256_setzero_si256(); R];
                    for j in 0..4 {
                        let q = ld(blk.add(qs_at + 32 * j));
                        let mut lo = _mm256_and_si256(q, m4);
                        let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4);
                        if FIVE {
                            let bl = _mm256_set1_epi8((1u8 << (2 * j)) as i8);
                            let bh = _mm256_set1_epi8((1u8 << (2 * j + 1)) as i8);
                            lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bl), bl), h5));
                            hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bh), bh), h5));
                        }
                        let (s0, s1) = (sm[2 * j].0 as i32, sm[2 * j + 1].0 as i32);
                        let (sl, sh) = (scales(s0, s0), scales(s1, s1));
                        for r in 0..R {
                            let x = xs[r].qs.as_ptr().add(256 * b + 64 * j) as *const u8;
                            isum[r] = _mm256_add_epi32(isum[r], sdot(lo, ld(x), sl));
                            isum[r] = _mm256_add_epi32(isum[r], sdot(hi, ld(x.add(32)), sh));
                        }
                    }
                    for r in 0..R {
                        let s = &xs[r].sums[16 * b..16 * b + 16];
                        let mut mins = 0i32;
                        for j in 0..8 {
                            mins += sm[j].1 as i32 * (s[2 * j] + s[2 * j + 1]);
                        }
                        let dx = *xs[r].d.get_unchecked(b);
                        acc[r] += d * dx * hsum_i32(isum[r]) as f32 - dmin * dx * mins as f32;
                    }
                }
                acc
            }

            /// Q6_K weights.
            #[target_feature(enable = $feat)]
            pub unsafe fn q6k<const R: usize>(w: *const u8, nb: usize, xs: &[ActRow<'_>; R]) -> [f32; R] {
                let m4 = _mm256_set1_epi8(0x0F);
                let m2 = _mm256_set1_epi8(0x30);
                let mut acc = [0.0f32; R];
                for b in 0..nb {
                    let blk = w.add(b * 210);
                    let sc = std::slice::from_raw_parts(blk.add(192), 16);
                    let d = rd_f16(std::slice::from_raw_parts(blk.add(208), 2), 0);
                    let mut isum = [_mm256_setzero_si256(); R];
                    for h in 0..2 {
                        let a = ld(blk.add(64 * h));
                        let bq = ld(blk.add(64 * h + 32));
                        let qh = ld(blk.add(128 + 32 * h));
                        let groups = [
                            _mm256_or_si256(_mm256_and_si256(a, m4), _mm256_and_si256(_mm256_slli_epi16::<4>(qh), m2)),
                            _mm256_or_si256(_mm256_and_si256(bq, m4), _mm256_and_si256(_mm256_slli_epi16::<2>(qh), m2)),
                            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(a), m4), _mm256_and_si256(qh, m2)),
                            _mm256_or_si256(
                                _mm256_and_si256(_mm256_srli_epi16::<4>(bq), m4),
                                _mm256_and_si256(_mm256_srli_epi16::<2>(qh), m2),
                            ),
                        ];
                        for (k, &u) in groups.iter().enumerate() {
                            let g = 4 * h + k;
                            let s = scales(sc[2 * g] as i8 as i32, sc[2 * g + 1] as i8 as i32);
                            for r in 0..R {
                                let x = ld(xs[r].qs.as_ptr().add(256 * b + 32 * g) as *const u8);
                                isum[r] = _mm256_add_epi32(isum[r], sdot(u, x, s));
                            }
                        }
                    }
                    for r in 0..R {
                        let s = &xs[r].sums[16 * b..16 * b + 16];
                        let mut off = 0i32;
                        for (gi, &v) in s.iter().enumerate() {
                            off += sc[gi] as i8 as i32 * v;
                        }
                        acc[r] += d * *xs[r].d.get_unchecked(b) * (hsum_i32(isum[r]) - 32 * off) as f32;
                    }
                }
                acc
            }
        }
    };
}

kernels!(avx2, "avx2,fma", false);
kernels!(vnni, "avx2,fma,avx512f,avx512vl,avx512vnni", true);
