//! `y = x W^T` for few rows on weights kept in a checkpoint's quantized form: FP8
//! e4m3 with one float32 scale per 128 x 128 block (Qwen's and DeepSeek's official FP8
//! checkpoints), and 4-bit integers with a float32 scale and zero point per group of
//! inputs (AWQ's int4, repacked at load into rows; see [`int4_matmul`]).
//!
//! A decode step's GEMMs are bound by reading the weight, and these read 1 byte (FP8)
//! or half a byte (int4) per weight instead of bfloat16's 2. Each output is a dot
//! product of an `x` row with one weight row (stored `[N, K]`, contiguous along `K`):
//! a block (FP8: 128 inputs, int4: one group) of the weight row is widened once into
//! a float32 buffer in L1, then every row of `x` takes its dot product with it, in
//! 16 float32 lanes, scaled per block into 16 lane totals that are summed once per
//! output. The widening is plain Rust that the compiler vectorises, built for AVX-512
//! and for AVX2 + FMA (chosen at run time), plain Rust elsewhere.
//!
//! FP8 widening: an e4m3 byte's bits `s eeee mmm` placed at a float32's sign and
//! exponent / mantissa top (`s << 24 | (eeee mmm) << 20`) are the float32 whose value
//! is the e4m3 value times `2^-120` (exponent bias 127 vs 7; e4m3's subnormals land
//! on float32 subnormals of the same mantissa), so one multiply by `2^120` gives the
//! exact value. e4m3's NaN (`0x7f` / `0xff`) is not expected in weights and reads as
//! 480.

use crate::bf16::Elem;
use crate::pool::for_each_task;
use crate::{KernelError, Rows};

/// FP8 block edge (rows and inputs per scale).
pub const FP8_BLOCK: usize = 128;
/// Inputs per packed int4 run: 32 bytes, input `i` in byte `i`'s low nibble and input
/// `32 + i` in its high nibble.
pub const INT4_RUN: usize = 64;
/// Rows of `x` per pass over the weight (larger inputs are split).
const MAX_M: usize = 16;
/// Weight rows per task.
const ROWS_PER_TASK: usize = 64;
const LANES: usize = 16;

#[derive(Clone, Copy)]
struct SendPtr<T>(*mut T);
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}

/// `sum_i a[i] b[i]` into 16 lanes `acc` (`a`, `b` the same length).
#[inline(always)]
fn dot_lanes<const FMA: bool>(a: &[f32], b: &[f32], acc: &mut [f32; LANES]) {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut ca = a.chunks_exact(LANES);
    let mut cb = b.chunks_exact(LANES);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for i in 0..LANES {
            acc[i] = if FMA {
                x[i].mul_add(y[i], acc[i])
            } else {
                acc[i] + x[i] * y[i]
            };
        }
    }
    for (i, (x, y)) in ca.remainder().iter().zip(cb.remainder()).enumerate() {
        acc[i] += x * y;
    }
}

#[inline(always)]
fn decode_fp8(src: &[u8], dst: &mut [f32]) {
    const TWO_120: f32 = 1.329_228e36; // 2^120
    for (d, &b) in dst.iter_mut().zip(src) {
        let b = b as u32;
        *d = f32::from_bits(((b & 0x80) << 24) | ((b & 0x7f) << 20)) * TWO_120;
    }
}

#[inline(always)]
fn decode_int4(src: &[u8], dst: &mut [f32]) {
    // src: whole runs of 32 bytes; dst: 64 values per run.
    for (s, d) in src
        .chunks_exact(INT4_RUN / 2)
        .zip(dst.chunks_exact_mut(INT4_RUN))
    {
        let (lo, hi) = d.split_at_mut(INT4_RUN / 2);
        for i in 0..INT4_RUN / 2 {
            lo[i] = (s[i] & 0xf) as f32;
            hi[i] = (s[i] >> 4) as f32;
        }
    }
}

/// What differs between the formats: how a block of a weight row widens, and its
/// scale (and, for int4, the zero point's correction).
#[derive(Clone, Copy)]
enum Format<'a> {
    Fp8 {
        w: &'a [u8],
        scale: &'a [f32],
        scale_cols: usize,
        row_offset: usize,
    },
    Int4 {
        w: &'a [u8],
        scales: &'a [f32],
        zeros: &'a [f32],
        group: usize,
    },
}

impl Format<'_> {
    fn block(&self) -> usize {
        match self {
            Format::Fp8 { .. } => FP8_BLOCK,
            Format::Int4 { group, .. } => *group,
        }
    }
}

/// Output columns `j0..j1` of rows `m0..m0 + mm` of `out` (`[M, N]`), `xf` the
/// widened `x` (`[M, K]` float32), `xsum` (int4 only) each row's sum per group.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn columns<T: Elem, const FMA: bool>(
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
    let block = f.block();
    let nblocks = k.div_ceil(block);
    let mut buf = vec![0f32; block];
    let mut tot = [[0f32; LANES]; MAX_M];
    let mut corr = [0f32; MAX_M];
    for j in j0..j1 {
        for m in 0..mm {
            tot[m] = [0.0; LANES];
            corr[m] = 0.0;
        }
        for b in 0..nblocks {
            let (c0, c1) = (b * block, ((b + 1) * block).min(k));
            let len = c1 - c0;
            let s = match f {
                Format::Fp8 {
                    w,
                    scale,
                    scale_cols,
                    row_offset,
                } => {
                    decode_fp8(&w[j * k + c0..j * k + c1], &mut buf[..len]);
                    scale[(row_offset + j) / FP8_BLOCK * scale_cols + b]
                }
                Format::Int4 {
                    w,
                    scales,
                    zeros,
                    group,
                } => {
                    let half = k / 2;
                    decode_int4(&w[j * half + c0 / 2..j * half + c1 / 2], &mut buf[..len]);
                    let g = k / group;
                    let (s, z) = (scales[j * g + b], zeros[j * g + b]);
                    for m in 0..mm {
                        corr[m] += s * z * xsum[(m0 + m) * g + b];
                    }
                    s
                }
            };
            for m in 0..mm {
                let row = &xf[(m0 + m) * k + c0..(m0 + m) * k + c1];
                let mut acc = [0f32; LANES];
                dot_lanes::<FMA>(row, &buf[..len], &mut acc);
                let t = &mut tot[m];
                for i in 0..LANES {
                    t[i] = if FMA {
                        s.mul_add(acc[i], t[i])
                    } else {
                        t[i] + s * acc[i]
                    };
                }
            }
        }
        for m in 0..mm {
            let v = tot[m].iter().sum::<f32>() - corr[m];
            // SAFETY: column j of rows m0..m0 + mm belongs to this task alone (the
            // caller's contract), and lies inside the [M, N] output.
            unsafe { *out.0.add((m0 + m) * n + j) = T::narrow(v) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
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
                            acc1 = _mm512_fmadd_ps(
                                _mm512_loadu_ps(row.add(16 * c + 16)),
                                wv[c + 1],
                                acc1,
                            );
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
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn columns_avx2<T: Elem>(
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
    columns::<T, true>(f, xf, xsum, k, n, m0, mm, j0, j1, out)
}

#[cfg(target_arch = "x86_64")]
mod vbmi {
    //! FP8 with bfloat16 activations on AVX-512 VBMI + BF16: 64 e4m3 bytes become 64
    //! exact bfloat16 weights with two 128-entry byte lookups (`vpermi2b`: the high and
    //! low bytes of each magnitude's bfloat16), the sign OR'd in, and two byte
    //! interleaves; `vdpbf16ps` then takes 32 products per instruction. The interleave
    //! leaves the weights of a 64-input run in the order [`RUN_ORDER`]; `x` is permuted
    //! the same way once per call, so each product pairs the right input.
    use super::{SendPtr, FP8_BLOCK, MAX_M};
    use crate::bf16::Elem;
    use std::arch::x86_64::*;

    /// Input `RUN_ORDER[i]` of a 64-input run is the `i`-th weight the decode yields.
    pub(super) fn run_order() -> [usize; 64] {
        let mut o = [0usize; 64];
        for i in 0..64 {
            // First register: bytes 0..7 of each 16-byte lane; second: bytes 8..15.
            let (reg, e) = (i / 32, i % 32);
            let (lane, b) = (e / 8, e % 8);
            o[i] = lane * 16 + reg * 8 + b;
        }
        o
    }

    /// The bfloat16 bits of each e4m3 magnitude 0..127 (exact: 3 mantissa bits),
    /// split into high and low bytes.
    fn tables() -> ([u8; 128], [u8; 128]) {
        let (mut hi, mut lo) = ([0u8; 128], [0u8; 128]);
        for m in 0..128u32 {
            let v = f32::from_bits(m << 20) * 1.329_228e36;
            let b = (v.to_bits() >> 16) as u16;
            hi[m as usize] = (b >> 8) as u8;
            lo[m as usize] = b as u8;
        }
        (hi, lo)
    }

    #[inline(always)]
    unsafe fn decode64(p: *const u8, t: &[__m512i; 4], sign: __m512i) -> (__m512bh, __m512bh) {
        let b = _mm512_loadu_si512(p as *const _);
        let hi = _mm512_permutex2var_epi8(t[0], b, t[1]);
        let lo = _mm512_permutex2var_epi8(t[2], b, t[3]);
        let hi = _mm512_or_si512(hi, _mm512_and_si512(b, sign));
        (
            std::mem::transmute::<__m512i, __m512bh>(_mm512_unpacklo_epi8(lo, hi)),
            std::mem::transmute::<__m512i, __m512bh>(_mm512_unpackhi_epi8(lo, hi)),
        )
    }

    /// Output columns `j0..j1` of rows `m0..m0 + mm`; `xp` is `x` as bfloat16 bits with
    /// every 64-input run in [`run_order`].
    ///
    /// # Safety
    /// The CPU has AVX-512F/BW/VBMI/BF16; `K % 128 == 0`; the columns are the caller's.
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512bf16")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn columns<T: Elem>(
        w: &[u8],
        scale: &[f32],
        scale_cols: usize,
        row_offset: usize,
        xp: &[u16],
        k: usize,
        n: usize,
        m0: usize,
        mm: usize,
        j0: usize,
        j1: usize,
        out: SendPtr<T>,
    ) {
        let (th, tl) = tables();
        let t = [
            _mm512_loadu_si512(th.as_ptr() as *const _),
            _mm512_loadu_si512(th.as_ptr().add(64) as *const _),
            _mm512_loadu_si512(tl.as_ptr() as *const _),
            _mm512_loadu_si512(tl.as_ptr().add(64) as *const _),
        ];
        let sign = _mm512_set1_epi8(0x80u8 as i8);
        let nblocks = k / FP8_BLOCK;
        let xb = xp.as_ptr().add(m0 * k);
        const TR: usize = 8;
        let mut tot = [[_mm512_setzero_ps(); MAX_M]; TR];
        let mut jt = j0;
        while jt < j1 {
            let tr = (j1 - jt).min(TR);
            for row in tot.iter_mut().take(tr) {
                for v in row.iter_mut().take(mm) {
                    *v = _mm512_setzero_ps();
                }
            }
            for b in 0..nblocks {
                for r in 0..tr {
                    let j = jt + r;
                    let p = w.as_ptr().add(j * k + b * FP8_BLOCK);
                    let (w0, w1) = decode64(p, &t, sign);
                    let (w2, w3) = decode64(p.add(64), &t, sign);
                    let sv = _mm512_set1_ps(
                        *scale.get_unchecked((row_offset + j) / FP8_BLOCK * scale_cols + b),
                    );
                    for m in 0..mm {
                        let x = xb.add(m * k + b * FP8_BLOCK);
                        let ld = |o: usize| {
                            std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                                x.add(o) as *const _
                            ))
                        };
                        let mut acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), ld(0), w0);
                        acc = _mm512_dpbf16_ps(acc, ld(32), w1);
                        acc = _mm512_dpbf16_ps(acc, ld(64), w2);
                        acc = _mm512_dpbf16_ps(acc, ld(96), w3);
                        tot[r][m] = _mm512_fmadd_ps(sv, acc, tot[r][m]);
                    }
                }
            }
            for r in 0..tr {
                for m in 0..mm {
                    *out.0.add((m0 + m) * n + jt + r) = T::narrow(_mm512_reduce_add_ps(tot[r][m]));
                }
            }
            jt += tr;
        }
    }

    /// The bfloat16 bits of 0..15, split into high and low bytes (first 16 entries).
    fn int_tables() -> ([u8; 64], [u8; 64]) {
        let (mut hi, mut lo) = ([0u8; 64], [0u8; 64]);
        for q in 0..16usize {
            let b = ((q as f32).to_bits() >> 16) as u16;
            hi[q] = (b >> 8) as u8;
            lo[q] = b as u8;
        }
        (hi, lo)
    }

    /// Input of a 128-input group (two 64-input runs) at position `i` of the order the
    /// int4 decode yields: the low nibbles of the group's 64 bytes, then the high ones,
    /// each interleaved as [`run_order`].
    pub(super) fn int4_order() -> [usize; 128] {
        let ro = run_order();
        let mut o = [0usize; 128];
        for i in 0..128 {
            let (half, p) = (i / 64, ro[i % 64]);
            // Byte p: run p / 32, input p % 32 of it (low nibble) or 32 + p % 32 (high).
            o[i] = (p / 32) * 64 + half * 32 + p % 32;
        }
        o
    }

    /// int4 (group 128) with bfloat16 activations: each 64 bytes of a weight row (one
    /// group) become 128 exact bfloat16 integers with four 16-entry byte lookups
    /// (`vpermb`) and four interleaves; `vdpbf16ps` takes the dot with `xp` (`x` as
    /// bfloat16 bits, every group in [`int4_order`]); the zero point is taken off as
    /// `scale * zero * sum(x over the group)` (`xsum`).
    ///
    /// # Safety
    /// As [`columns`], with `K % 128 == 0` and group 128.
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512bf16")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn columns_int4<T: Elem>(
        w: &[u8],
        scales: &[f32],
        zeros: &[f32],
        xp: &[u16],
        xsum: &[f32],
        k: usize,
        n: usize,
        m0: usize,
        mm: usize,
        j0: usize,
        j1: usize,
        out: SendPtr<T>,
    ) {
        let (th, tl) = int_tables();
        let thv = _mm512_loadu_si512(th.as_ptr() as *const _);
        let tlv = _mm512_loadu_si512(tl.as_ptr() as *const _);
        let nib = _mm512_set1_epi8(0x0f);
        let g = k / FP8_BLOCK;
        let xb = xp.as_ptr().add(m0 * k);
        const TR: usize = 8;
        let mut tot = [[_mm512_setzero_ps(); MAX_M]; TR];
        let mut corr = [[0f32; MAX_M]; TR];
        let bh = |v: __m512i| std::mem::transmute::<__m512i, __m512bh>(v);
        let mut jt = j0;
        while jt < j1 {
            let tr = (j1 - jt).min(TR);
            for r in 0..tr {
                for m in 0..mm {
                    tot[r][m] = _mm512_setzero_ps();
                    corr[r][m] = 0.0;
                }
            }
            for b in 0..g {
                for r in 0..tr {
                    let j = jt + r;
                    let v = _mm512_loadu_si512(
                        w.as_ptr().add(j * k / 2 + b * FP8_BLOCK / 2) as *const _
                    );
                    let lo_n = _mm512_and_si512(v, nib);
                    let hi_n = _mm512_and_si512(_mm512_srli_epi16::<4>(v), nib);
                    let (a_hi, a_lo) = (
                        _mm512_permutexvar_epi8(lo_n, thv),
                        _mm512_permutexvar_epi8(lo_n, tlv),
                    );
                    let (b_hi, b_lo) = (
                        _mm512_permutexvar_epi8(hi_n, thv),
                        _mm512_permutexvar_epi8(hi_n, tlv),
                    );
                    let w0 = bh(_mm512_unpacklo_epi8(a_lo, a_hi));
                    let w1 = bh(_mm512_unpackhi_epi8(a_lo, a_hi));
                    let w2 = bh(_mm512_unpacklo_epi8(b_lo, b_hi));
                    let w3 = bh(_mm512_unpackhi_epi8(b_lo, b_hi));
                    let (s, z) = (
                        *scales.get_unchecked(j * g + b),
                        *zeros.get_unchecked(j * g + b),
                    );
                    let sv = _mm512_set1_ps(s);
                    for m in 0..mm {
                        corr[r][m] += s * z * *xsum.get_unchecked((m0 + m) * g + b);
                        let x = xb.add(m * k + b * FP8_BLOCK);
                        let ld = |o: usize| bh(_mm512_loadu_si512(x.add(o) as *const _));
                        let mut acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), ld(0), w0);
                        acc = _mm512_dpbf16_ps(acc, ld(32), w1);
                        acc = _mm512_dpbf16_ps(acc, ld(64), w2);
                        acc = _mm512_dpbf16_ps(acc, ld(96), w3);
                        tot[r][m] = _mm512_fmadd_ps(sv, acc, tot[r][m]);
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
}

/// The instruction set the quantized kernels run on here: `"avx512"`, `"avx2"` or
/// `"scalar"` (AVX-512 takes whole 128-input blocks; other shapes the AVX2 loop).
pub fn quant_isa() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512bw")
            && std::is_x86_feature_detected!("avx512vl")
            && std::is_x86_feature_detected!("fma")
        {
            return "avx512";
        }
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            return "avx2";
        }
    }
    "scalar"
}

#[cfg(target_arch = "x86_64")]
fn has_vbmi_bf16() -> bool {
    std::is_x86_feature_detected!("avx512f")
        && std::is_x86_feature_detected!("avx512bw")
        && std::is_x86_feature_detected!("avx512vbmi")
        && std::is_x86_feature_detected!("avx512bf16")
}

fn run<T: Elem>(f: Format<'_>, x: Rows<'_, T>, n: usize, out: &mut [T]) -> Result<(), KernelError> {
    let (m, k) = (x.rows, x.width);
    if out.len() != m * n {
        return Err(KernelError::new(format!(
            "out must be [M={m}, N={n}]; got {} elements",
            out.len()
        )));
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    // x widened to float32 once (a few rows: small next to the weight).
    let mut xf = vec![0f32; m * k];
    for r in 0..m {
        let src = &x.data[r * x.stride..r * x.stride + k];
        for (d, s) in xf[r * k..(r + 1) * k].iter_mut().zip(src) {
            *d = s.get();
        }
    }
    let xsum = match f {
        Format::Int4 { group, .. } => {
            let g = k / group;
            let mut s = vec![0f32; m * g];
            for r in 0..m {
                for b in 0..g {
                    s[r * g + b] = xf[r * k + b * group..r * k + (b + 1) * group].iter().sum();
                }
            }
            s
        }
        Format::Fp8 { .. } => Vec::new(),
    };
    let isa = quant_isa();
    let ptr = SendPtr(out.as_mut_ptr());
    // bfloat16 activations on FP8 blocks: the VBMI + BF16 path (exact bfloat16 weights,
    // `vdpbf16ps`); float32 activations keep float32 arithmetic.
    #[cfg(target_arch = "x86_64")]
    if let Format::Fp8 {
        w,
        scale,
        scale_cols,
        row_offset,
    } = f
    {
        if std::mem::size_of::<T>() == 2 && k % FP8_BLOCK == 0 && has_vbmi_bf16() {
            let order = vbmi::run_order();
            let mut xp = vec![0u16; m * k];
            for r in 0..m {
                for c in (0..k).step_by(64) {
                    for (i, &o) in order.iter().enumerate() {
                        xp[r * k + c + i] = crate::bf16::from_f32(xf[r * k + c + o]);
                    }
                }
            }
            let tasks = n.div_ceil(ROWS_PER_TASK);
            for m0 in (0..m).step_by(MAX_M) {
                let mm = (m - m0).min(MAX_M);
                for_each_task(tasks, mm * n * k, |t| {
                    let (j0, j1) = (t * ROWS_PER_TASK, ((t + 1) * ROWS_PER_TASK).min(n));
                    let ptr = ptr;
                    // SAFETY: features detected above; columns j0..j1 are this task's.
                    unsafe {
                        vbmi::columns(
                            w, scale, scale_cols, row_offset, &xp, k, n, m0, mm, j0, j1, ptr,
                        )
                    };
                });
            }
            return Ok(());
        }
    }
    #[cfg(target_arch = "x86_64")]
    if let Format::Int4 {
        w,
        scales,
        zeros,
        group,
    } = f
    {
        if std::mem::size_of::<T>() == 2 && group == FP8_BLOCK && has_vbmi_bf16() {
            let order = vbmi::int4_order();
            let mut xp = vec![0u16; m * k];
            for r in 0..m {
                for c in (0..k).step_by(FP8_BLOCK) {
                    for (i, &o) in order.iter().enumerate() {
                        xp[r * k + c + i] = crate::bf16::from_f32(xf[r * k + c + o]);
                    }
                }
            }
            let tasks = n.div_ceil(ROWS_PER_TASK);
            for m0 in (0..m).step_by(MAX_M) {
                let mm = (m - m0).min(MAX_M);
                for_each_task(tasks, mm * n * k, |t| {
                    let (j0, j1) = (t * ROWS_PER_TASK, ((t + 1) * ROWS_PER_TASK).min(n));
                    let ptr = ptr;
                    // SAFETY: features detected above; columns j0..j1 are this task's.
                    unsafe {
                        vbmi::columns_int4(w, scales, zeros, &xp, &xsum, k, n, m0, mm, j0, j1, ptr)
                    };
                });
            }
            return Ok(());
        }
    }
    let tasks = n.div_ceil(ROWS_PER_TASK);
    for m0 in (0..m).step_by(MAX_M) {
        let mm = (m - m0).min(MAX_M);
        for_each_task(tasks, mm * n * k, |t| {
            let (j0, j1) = (t * ROWS_PER_TASK, ((t + 1) * ROWS_PER_TASK).min(n));
            let ptr = ptr;
            #[cfg(target_arch = "x86_64")]
            {
                // SAFETY: the ISA was detected on this CPU; columns j0..j1 are this task's.
                if isa == "avx512" && k % FP8_BLOCK == 0 && f.block() == FP8_BLOCK {
                    return unsafe { avx512::columns(f, &xf, &xsum, k, n, m0, mm, j0, j1, ptr) };
                }
                if isa == "avx2" || isa == "avx512" {
                    return unsafe { columns_avx2(f, &xf, &xsum, k, n, m0, mm, j0, j1, ptr) };
                }
            }
            let _ = isa;
            columns::<T, false>(f, &xf, &xsum, k, n, m0, mm, j0, j1, ptr)
        });
    }
    Ok(())
}

/// `out[m, j] = sum_k x[m, k] W[j, k]` for an FP8 block-scaled `W`: `w` `[N, K]` e4m3
/// bytes row-major, `scale` float32 `[ceil((row_offset + N) / 128), ceil(K / 128)]`
/// row-major, `W[j, c] = e4m3(w[j, c]) * scale[(row_offset + j) / 128, c / 128]`
/// (`row_offset` < 128: where row 0 sits in its scale block, for a row range of a
/// larger weight). `x` `[M, K]` and `out` `[M, N]` float32 or bfloat16 bits.
pub fn fp8_matmul<T: Elem>(
    x: Rows<'_, T>,
    w: &[u8],
    n: usize,
    scale: &[f32],
    row_offset: usize,
    out: &mut [T],
) -> Result<(), KernelError> {
    let k = x.width;
    let (sr, sc) = ((row_offset + n).div_ceil(FP8_BLOCK), k.div_ceil(FP8_BLOCK));
    if row_offset >= FP8_BLOCK || w.len() != n * k || scale.len() != sr * sc {
        return Err(KernelError::new(format!(
            "FP8 weight must be [N={n}, K={k}] bytes with scales [{sr}, {sc}] (row_offset {row_offset} < 128); \
             got {} bytes and {} scales",
            w.len(),
            scale.len()
        )));
    }
    run(
        Format::Fp8 {
            w,
            scale,
            scale_cols: sc,
            row_offset,
        },
        x,
        n,
        out,
    )
}

/// `out[m, j] = sum_k x[m, k] W[j, k]` for an int4 `W` with a scale and zero point
/// per group of `group` inputs: `w` `[N, K / 2]` bytes, each run of 64 inputs in 32
/// bytes (input `i` of the run in byte `i`'s low nibble, input `32 + i` in its high
/// one), `scales` / `zeros` float32 `[N, K / group]`, `W[j, c] = (q[j, c] - zeros[j,
/// c / group]) * scales[j, c / group]`. `group` a multiple of 64 dividing `K`.
pub fn int4_matmul<T: Elem>(
    x: Rows<'_, T>,
    w: &[u8],
    n: usize,
    scales: &[f32],
    zeros: &[f32],
    group: usize,
    out: &mut [T],
) -> Result<(), KernelError> {
    let k = x.width;
    if group == 0 || group % INT4_RUN != 0 || k % group != 0 {
        return Err(KernelError::new(format!(
            "int4 group size must be a multiple of {INT4_RUN} dividing K={k}; got {group}"
        )));
    }
    let g = k / group;
    if w.len() != n * k / 2 || scales.len() != n * g || zeros.len() != n * g {
        return Err(KernelError::new(format!(
            "int4 weight must be [N={n}, K/2={}] bytes with scales and zeros [{n}, {g}]; got {}, {} and {}",
            k / 2,
            w.len(),
            scales.len(),
            zeros.len()
        )));
    }
    run(
        Format::Int4 {
            w,
            scales,
            zeros,
            group,
        },
        x,
        n,
        out,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e4m3_value(b: u8) -> f32 {
        // The format's definition: sign, 4-bit exponent (bias 7), 3-bit mantissa.
        let s = if b & 0x80 != 0 { -1.0 } else { 1.0 };
        let e = ((b >> 3) & 0xf) as i32;
        let m = (b & 7) as f32;
        if e == 0 {
            s * m / 8.0 * 2f32.powi(-6)
        } else {
            s * (1.0 + m / 8.0) * 2f32.powi(e - 7)
        }
    }

    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self) -> u32 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (self.0 >> 33) as u32
        }
        fn f(&mut self) -> f32 {
            self.next() as f32 / (1u64 << 31) as f32 - 0.5
        }
    }

    #[test]
    fn fp8_decode_is_the_format_definition() {
        let all: Vec<u8> = (0..=255u8).filter(|b| b & 0x7f != 0x7f).collect();
        let mut got = vec![0f32; all.len()];
        decode_fp8(&all, &mut got);
        for (b, g) in all.iter().zip(&got) {
            assert_eq!(*g, e4m3_value(*b), "byte {b:#x}");
        }
    }

    #[test]
    fn fp8_matches_scalar_reference() {
        let mut r = Lcg(1);
        for &(m, n, k, off) in &[
            (1usize, 130usize, 200usize, 0usize),
            (5, 64, 256, 3),
            (17, 257, 128, 127),
            (3, 1, 7, 0),
        ] {
            // Every byte but e4m3's NaN (0x7f / 0xff).
            let w: Vec<u8> = (0..n * k)
                .map(|_| (r.next() & 0xff) as u8)
                .map(|b| if b & 0x7f == 0x7f { b - 1 } else { b })
                .collect();
            let (sr, sc) = ((off + n).div_ceil(128), k.div_ceil(128));
            let scale: Vec<f32> = (0..sr * sc).map(|_| r.f() + 1.0).collect();
            let x: Vec<f32> = (0..m * k).map(|_| r.f()).collect();
            let mut out = vec![0f32; m * n];
            fp8_matmul(Rows::dense(&x, k).unwrap(), &w, n, &scale, off, &mut out).unwrap();
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = (0..k)
                        .map(|c| {
                            x[i * k + c] as f64
                                * e4m3_value(w[j * k + c]) as f64
                                * scale[(off + j) / 128 * sc + c / 128] as f64
                        })
                        .sum();
                    assert!(
                        (out[i * n + j] as f64 - want).abs() < 1e-3 * (1.0 + want.abs()),
                        "{m} {n} {k}"
                    );
                }
            }
        }
    }

    #[test]
    fn int4_matches_scalar_reference() {
        let mut r = Lcg(2);
        for &(m, n, k, g) in &[
            (1usize, 33usize, 256usize, 128usize),
            (16, 8, 128, 64),
            (18, 70, 384, 128),
        ] {
            let q: Vec<u8> = (0..n * k).map(|_| (r.next() & 0xf) as u8).collect();
            let mut w = vec![0u8; n * k / 2];
            for j in 0..n {
                for run in 0..k / 64 {
                    for i in 0..32 {
                        let lo = q[j * k + run * 64 + i];
                        let hi = q[j * k + run * 64 + 32 + i];
                        w[j * k / 2 + run * 32 + i] = lo | (hi << 4);
                    }
                }
            }
            let scales: Vec<f32> = (0..n * k / g).map(|_| r.f() + 1.0).collect();
            let zeros: Vec<f32> = (0..n * k / g).map(|_| (r.next() & 0xf) as f32).collect();
            let x: Vec<f32> = (0..m * k).map(|_| r.f()).collect();
            let mut out = vec![0f32; m * n];
            int4_matmul(
                Rows::dense(&x, k).unwrap(),
                &w,
                n,
                &scales,
                &zeros,
                g,
                &mut out,
            )
            .unwrap();
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = (0..k)
                        .map(|c| {
                            let gi = j * (k / g) + c / g;
                            x[i * k + c] as f64
                                * (q[j * k + c] as f64 - zeros[gi] as f64)
                                * scales[gi] as f64
                        })
                        .sum();
                    assert!((out[i * n + j] as f64 - want).abs() < 1e-3 * (1.0 + want.abs()));
                }
            }
        }
    }

    #[test]
    fn fp8_bf16_activations_match_scalar_reference() {
        let mut r = Lcg(3);
        for &(m, n, k, off) in &[
            (1usize, 70usize, 256usize, 0usize),
            (16, 33, 128, 5),
            (18, 9, 384, 127),
        ] {
            let w: Vec<u8> = (0..n * k)
                .map(|_| (r.next() & 0xff) as u8)
                .map(|b| if b & 0x7f == 0x7f { b - 1 } else { b })
                .collect();
            let (sr, sc) = ((off + n).div_ceil(128), k.div_ceil(128));
            let scale: Vec<f32> = (0..sr * sc).map(|_| r.f() + 1.0).collect();
            let x: Vec<u16> = (0..m * k).map(|_| crate::bf16::from_f32(r.f())).collect();
            let mut out = vec![0u16; m * n];
            fp8_matmul(Rows::dense(&x, k).unwrap(), &w, n, &scale, off, &mut out).unwrap();
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = (0..k)
                        .map(|c| {
                            crate::bf16::to_f32(x[i * k + c]) as f64
                                * e4m3_value(w[j * k + c]) as f64
                                * scale[(off + j) / 128 * sc + c / 128] as f64
                        })
                        .sum();
                    let got = crate::bf16::to_f32(out[i * n + j]) as f64;
                    assert!(
                        (got - want).abs() < 1e-2 * (1.0 + want.abs()),
                        "{m} {n} {k}: {got} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn int4_bf16_activations_match_scalar_reference() {
        let mut r = Lcg(4);
        for &(m, n, k) in &[(1usize, 20usize, 256usize), (16, 9, 128), (17, 33, 384)] {
            let g = 128;
            let q: Vec<u8> = (0..n * k).map(|_| (r.next() & 0xf) as u8).collect();
            let mut w = vec![0u8; n * k / 2];
            for j in 0..n {
                for run in 0..k / 64 {
                    for i in 0..32 {
                        w[j * k / 2 + run * 32 + i] =
                            q[j * k + run * 64 + i] | (q[j * k + run * 64 + 32 + i] << 4);
                    }
                }
            }
            let scales: Vec<f32> = (0..n * k / g).map(|_| r.f() + 1.0).collect();
            let zeros: Vec<f32> = (0..n * k / g).map(|_| (r.next() & 0xf) as f32).collect();
            let x: Vec<u16> = (0..m * k).map(|_| crate::bf16::from_f32(r.f())).collect();
            let mut out = vec![0u16; m * n];
            int4_matmul(
                Rows::dense(&x, k).unwrap(),
                &w,
                n,
                &scales,
                &zeros,
                g,
                &mut out,
            )
            .unwrap();
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = (0..k)
                        .map(|c| {
                            let gi = j * (k / g) + c / g;
                            crate::bf16::to_f32(x[i * k + c]) as f64
                                * (q[j * k + c] as f64 - zeros[gi] as f64)
                                * scales[gi] as f64
                        })
                        .sum();
                    let got = crate::bf16::to_f32(out[i * n + j]) as f64;
                    assert!(
                        (got - want).abs() < 1e-2 * (1.0 + want.abs()),
                        "{m} {n} {k}: {got} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn shapes_are_checked() {
        let x = vec![0f32; 128];
        let mut out = vec![0f32; 2];
        let e = fp8_matmul(
            Rows::dense(&x, 128).unwrap(),
            &[0u8; 100],
            2,
            &[1.0],
            0,
            &mut out,
        )
        .unwrap_err();
        assert!(e.0.contains("FP8 weight"));
        let e = int4_matmul(
            Rows::dense(&x, 128).unwrap(),
            &[0u8; 128],
            2,
            &[1.0; 2],
            &[0.0; 2],
            96,
            &mut out,
        )
        .unwrap_err();
        assert!(e.0.contains("group size"));
    }
}
