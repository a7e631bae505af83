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
                let v =
                    _mm512_loadu_si512(w.as_ptr().add(j * k / 2 + b * FP8_BLOCK / 2) as *const _);
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
