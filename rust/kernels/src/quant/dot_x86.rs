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
//! Q8_0, Q4_0 and Q5_0 weights are signed: llama.cpp's sign trick (`|w|` times `x` with
//! `w`'s sign) makes them unsigned; Q5_1 is unsigned with a min. Q4_K / Q5_K store `q >= 0` with a min, Q6_K `q + 32`:
//! their mins and offsets are taken from the activation's 16-sums ([`super::act`]).
//! The k-quants' integer sum of a super-block is exact and its float steps those of
//! [`super::dot_scalar`], so the three paths agree bit for bit there; the 32-weight blocks
//! accumulate per block in float32 lanes (rounding order differs from the scalar sum).

use super::act::ActRow;

/// `KIND`s of the 32-weight block kernel `q32`.
pub const Q8_0: u8 = 0;
pub const Q4_0: u8 = 1;
pub const Q5_0: u8 = 2;
pub const Q5_1: u8 = 3;

use std::sync::atomic::{AtomicUsize, Ordering};

/// Bytes ahead of the weight being read that the one-row kernels prefetch, and ahead
/// in each of the eight weight rows the many-row kernels read at once (atomics only
/// so that the timing harness can compare distances in one process).
static PF_DIST: AtomicUsize = AtomicUsize::new(2048);
static PF_ROWS_DIST: AtomicUsize = AtomicUsize::new(512);

#[inline(always)]
fn pf_dist() -> usize {
    PF_DIST.load(Ordering::Relaxed)
}

#[inline(always)]
fn pf_rows() -> usize {
    PF_ROWS_DIST.load(Ordering::Relaxed)
}

/// Sets the prefetch distances (one-row, many-row; the timing harness's variants). A
/// many-row distance of 0 turns its prefetch off; a one-row 0 asks for the line being read.
#[cfg(test)]
pub(crate) fn set_prefetch(one: usize, rows: usize) {
    PF_DIST.store(one, Ordering::Relaxed);
    PF_ROWS_DIST.store(rows, Ordering::Relaxed);
}

macro_rules! kernels {
    ($name:ident, $feat:literal, $vnni:literal) => {
        pub mod $name {
            use super::{ActRow, Q4_0, Q5_0, Q5_1, Q8_0};
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

            /// The float16 at `p` (F16C's conversion, exact like `blocks::rd_f16`).
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn h2f(p: *const u8) -> f32 {
                let h = (p as *const u16).read_unaligned();
                _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
            }

            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn ld(p: *const u8) -> __m256i {
                _mm256_loadu_si256(p as *const __m256i)
            }

            /// 32 bits as 32 bytes: `0xFF` where bit `i` is set (llama.cpp's
            /// `bytes_from_bits_32`): each byte picks its bit's byte, ORs in every other
            /// bit and tests for all ones.
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn bits_to_bytes(bits: u32) -> __m256i {
                let v = _mm256_shuffle_epi8(
                    _mm256_set1_epi32(bits as i32),
                    _mm256_setr_epi64x(0, 0x0101_0101_0101_0101, 0x0202_0202_0202_0202, 0x0303_0303_0303_0303),
                );
                let v = _mm256_or_si256(v, _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe));
                _mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1))
            }

            /// A 32-weight block at `blk` as unsigned bytes in weight order, the weight
            /// being `u - off32::<KIND>()` times the block's scale: Q8_0 on VNNI flips
            /// the sign bit (`w + 128`), Q4_0 / Q5_0 keep their stored `q`; Q5_1 is
            /// unsigned already. On AVX2, Q8_0 stays signed (`vpmaddubsw` would saturate
            /// on `w + 128`): [`bdot`] takes the sign trick there.
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn unpack32<const KIND: u8>(blk: *const u8) -> __m256i {
                let m4 = _mm256_set1_epi8(0x0F);
                // The nibbles of the 16 bytes at `p`: low ones first, then high.
                macro_rules! nib {
                    ($p:expr) => {{
                        let q = _mm_loadu_si128($p as *const __m128i);
                        _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(q), q), m4)
                    }};
                }
                // The fifth bits (a u32 at `p`) as 0x10 bytes.
                macro_rules! fifth {
                    ($p:expr) => {
                        _mm256_and_si256(bits_to_bytes(($p as *const u32).read_unaligned()), _mm256_set1_epi8(0x10))
                    };
                }
                match KIND {
                    Q8_0 if $vnni => _mm256_xor_si256(ld(blk.add(2)), _mm256_set1_epi8(-128)),
                    Q8_0 => ld(blk.add(2)),
                    Q4_0 => nib!(blk.add(2)),
                    Q5_0 => _mm256_or_si256(nib!(blk.add(6)), fifth!(blk.add(2))),
                    _ => _mm256_or_si256(nib!(blk.add(8)), fifth!(blk.add(4))),
                }
            }

            /// The offset [`unpack32`]'s bytes carry (`OFF` times the activation block's
            /// sum comes off the integer dot product).
            const fn off32<const KIND: u8>() -> i32 {
                match KIND {
                    Q8_0 if $vnni => 128,
                    Q4_0 => 8,
                    Q5_0 => 16,
                    _ => 0,
                }
            }

            /// [`idot`] of unpacked weight bytes `u` ([`unpack32`]) and activation bytes.
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn bdot<const KIND: u8>(u: __m256i, x: __m256i) -> __m256i {
                if KIND == Q8_0 && !$vnni {
                    idot(_mm256_abs_epi8(u), _mm256_sign_epi8(x, u))
                } else {
                    idot(u, x)
                }
            }

            /// Eight float16 bit patterns in a register, built in registers: a 128-bit
            /// load over eight 16-bit stores would wait for them (no store forwarding).
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn halves(h: &[u16; 8]) -> __m128i {
                let w = |i: usize| h[i] as i64 | (h[i + 1] as i64) << 16 | (h[i + 2] as i64) << 32 | (h[i + 3] as i64) << 48;
                let (lo, hi) = (w(0), w(4));
                _mm_set_epi64x(hi, lo)
            }

            /// Asks for the cache lines of `len` bytes from `p` (may lie past the weight:
            /// a prefetch does not fault). One weight row streams from memory: the
            /// hardware prefetcher alone keeps too few lines in flight for a kernel
            /// that spends tens of cycles on each.
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn prefetch(p: *const u8, len: usize) {
                let mut o = 0;
                while o < len {
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(o) as *const i8);
                    o += 64;
                }
            }

            /// Lane `i`: the sum of `p[i]`'s eight lanes (integers: exact in any order).
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn sum8(p: &[__m256i; 8]) -> __m256i {
                macro_rules! pair {
                    ($a:expr, $b:expr) => {
                        _mm256_add_epi32(_mm256_unpacklo_epi32($a, $b), _mm256_unpackhi_epi32($a, $b))
                    };
                }
                macro_rules! quad {
                    ($a:expr, $b:expr) => {
                        _mm256_add_epi32(_mm256_unpacklo_epi64($a, $b), _mm256_unpackhi_epi64($a, $b))
                    };
                }
                let r0 = quad!(pair!(p[0], p[1]), pair!(p[2], p[3]));
                let r1 = quad!(pair!(p[4], p[5]), pair!(p[6], p[7]));
                _mm256_add_epi32(_mm256_permute2x128_si256::<0x20>(r0, r1), _mm256_permute2x128_si256::<0x31>(r0, r1))
            }

            /// Blocks of 32 weights (`KIND` [`Q8_0`], [`Q4_0`], [`Q5_0`], [`Q5_1`]), one
            /// weight row against `R` activation rows. The float order is the one
            /// [`super::super::dot_scalar`] and [`q32_x8`] take: each block's exact
            /// integer sum `s` gives `f = (d_w d_x) s` (Q5_1: `+ (m d_x) sum_x`), block
            /// `b` goes to accumulator `b % 8` (a lane here), and the eight are summed as
            /// [`hsum_ps`] does; so any path gives a row the same bits.
            #[target_feature(enable = $feat)]
            pub unsafe fn q32<const R: usize, const KIND: u8>(
                w: *const u8,
                nb: usize,
                xs: &[ActRow<'_>; R],
            ) -> [f32; R] {
                let bb = match KIND {
                    Q8_0 => 34,
                    Q4_0 => 18,
                    Q5_0 => 22,
                    _ => 24,
                };
                let off = off32::<KIND>();
                let pf = super::pf_dist();
                let mut acc = [_mm256_setzero_ps(); R];
                let mut b0 = 0;
                while b0 < nb {
                    let nblk = (nb - b0).min(8);
                    prefetch(w.wrapping_add(b0 * bb + pf), 8 * bb);
                    let mut p = [[_mm256_setzero_si256(); 8]; R];
                    let (mut dh, mut mh) = ([0u16; 8], [0u16; 8]);
                    macro_rules! block {
                        ($i:expr) => {{
                            let i: usize = $i;
                            let blk = w.add((b0 + i) * bb);
                            dh[i] = (blk as *const u16).read_unaligned();
                            if KIND == Q5_1 {
                                mh[i] = (blk.add(2) as *const u16).read_unaligned();
                            }
                            let u = unpack32::<KIND>(blk);
                            for r in 0..R {
                                p[r][i] = bdot::<KIND>(u, ld(xs[r].qs.as_ptr().add(32 * (b0 + i)) as *const u8));
                            }
                        }};
                    }
                    if nblk == 8 {
                        for i in 0..8 {
                            block!(i);
                        }
                    } else {
                        for i in 0..nblk {
                            block!(i);
                        }
                    }
                    let dw = _mm256_cvtph_ps(halves(&dh));
                    let mw = if KIND == Q5_1 { _mm256_cvtph_ps(halves(&mh)) } else { _mm256_setzero_ps() };
                    for r in 0..R {
                        let (dx, xsum) = if nblk == 8 {
                            (
                                _mm256_loadu_ps(xs[r].d.as_ptr().add(b0)),
                                _mm256_loadu_si256(xs[r].sums.as_ptr().add(b0) as *const __m256i),
                            )
                        } else {
                            let (mut d, mut s) = ([0.0f32; 8], [0i32; 8]);
                            d[..nblk].copy_from_slice(&xs[r].d[b0..b0 + nblk]);
                            s[..nblk].copy_from_slice(&xs[r].sums[b0..b0 + nblk]);
                            (_mm256_loadu_ps(d.as_ptr()), _mm256_loadu_si256(s.as_ptr() as *const __m256i))
                        };
                        let mut s = sum8(&p[r]);
                        if off != 0 {
                            s = _mm256_sub_epi32(s, _mm256_mullo_epi32(xsum, _mm256_set1_epi32(off)));
                        }
                        let mut f = _mm256_mul_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(s));
                        if KIND == Q5_1 {
                            f = _mm256_add_ps(f, _mm256_mul_ps(_mm256_mul_ps(mw, dx), _mm256_cvtepi32_ps(xsum)));
                        }
                        acc[r] = _mm256_add_ps(acc[r], f);
                    }
                    b0 += 8;
                }
                std::array::from_fn(|r| hsum_ps(acc[r]))
            }

            /// Eight weight rows of 32-weight blocks (`rb` bytes apart) against any
            /// number of activation rows, as [`q4k_q5k_x8`] lays them out (each block of
            /// the eight rows unpacked once, transposed so lane `i` is weight row `i`);
            /// the float steps of [`q32`] lane-wise: `acc[r]` is row `r`'s eight
            /// accumulators (block `b` into `8 (b % 8)..`), zeroed here, and on return
            /// `acc[r][..8]` holds the eight outputs. Equal to [`q32`] bit for bit.
            #[target_feature(enable = $feat)]
            pub unsafe fn q32_x8<const KIND: u8>(
                w: *const u8,
                rb: usize,
                nb: usize,
                xs: &[ActRow<'_>],
                acc: &mut [[f32; 64]],
            ) {
                let bb = match KIND {
                    Q8_0 => 34,
                    Q4_0 => 18,
                    Q5_0 => 22,
                    _ => 24,
                };
                let off = off32::<KIND>();
                let signed = KIND == Q8_0 && !$vnni;
                for a in acc.iter_mut() {
                    a.fill(0.0);
                }
                // The eight rows are one run of `8 rb` bytes, read a block of each row at a
                // time: too many short streams for the hardware prefetcher. The next pass's
                // run is asked for a slice per block instead.
                let pf_on = super::pf_rows() != 0;
                let slice = (8 * rb).div_ceil(nb);
                for b in 0..nb {
                    if pf_on {
                        prefetch(w.wrapping_add(8 * rb + b * slice), slice);
                    }
                    let mut v = [_mm256_setzero_si256(); 8];
                    let (mut dh, mut mh) = ([0u16; 8], [0u16; 8]);
                    for i in 0..8 {
                        let blk = w.add(i * rb + b * bb);
                        dh[i] = (blk as *const u16).read_unaligned();
                        if KIND == Q5_1 {
                            mh[i] = (blk.add(2) as *const u16).read_unaligned();
                        }
                        v[i] = unpack32::<KIND>(blk);
                    }
                    // Signed Q8_0 on AVX2: magnitudes to multiply, the weights for the signs.
                    let vs = transpose8(&v);
                    let vu = if signed { transpose8(&v.map(|r| _mm256_abs_epi8(r))) } else { vs };
                    let dw = _mm256_cvtph_ps(halves(&dh));
                    let mw = if KIND == Q5_1 { _mm256_cvtph_ps(halves(&mh)) } else { _mm256_setzero_ps() };
                    let l = 8 * (b % 8);
                    for (r, x) in xs.iter().enumerate() {
                        let xp = x.qs.as_ptr().add(32 * b) as *const i32;
                        let (mut p0, mut p1) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                        for q in 0..4 {
                            let mut x0 = _mm256_set1_epi32(xp.add(2 * q).read_unaligned());
                            let mut x1 = _mm256_set1_epi32(xp.add(2 * q + 1).read_unaligned());
                            if signed {
                                x0 = _mm256_sign_epi8(x0, vs[2 * q]);
                                x1 = _mm256_sign_epi8(x1, vs[2 * q + 1]);
                            }
                            p0 = idot_acc(p0, vu[2 * q], x0);
                            p1 = idot_acc(p1, vu[2 * q + 1], x1);
                        }
                        let xsum = *x.sums.get_unchecked(b);
                        let mut s = _mm256_add_epi32(p0, p1);
                        if off != 0 {
                            s = _mm256_sub_epi32(s, _mm256_set1_epi32(off * xsum));
                        }
                        let dx = _mm256_set1_ps(*x.d.get_unchecked(b));
                        let mut f = _mm256_mul_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(s));
                        if KIND == Q5_1 {
                            f = _mm256_add_ps(f, _mm256_mul_ps(_mm256_mul_ps(mw, dx), _mm256_set1_ps(xsum as f32)));
                        }
                        let a = acc.get_unchecked_mut(r).as_mut_ptr().add(l);
                        _mm256_storeu_ps(a, _mm256_add_ps(_mm256_loadu_ps(a), f));
                    }
                }
                // The eight accumulators summed in `hsum_ps`'s order, lane-wise.
                for a in acc.iter_mut().take(xs.len()) {
                    let v: [__m256; 8] = std::array::from_fn(|l| _mm256_loadu_ps(a.as_ptr().add(8 * l)));
                    let t = _mm256_add_ps(
                        _mm256_add_ps(_mm256_add_ps(v[0], v[4]), _mm256_add_ps(v[2], v[6])),
                        _mm256_add_ps(_mm256_add_ps(v[1], v[5]), _mm256_add_ps(v[3], v[7])),
                    );
                    _mm256_storeu_ps(a.as_mut_ptr(), t);
                }
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
                let pf = super::pf_dist();
                for b in 0..nb {
                    let blk = w.add(b * bb);
                    prefetch(blk.wrapping_add(pf), bb);
                    let (d, dmin) = (h2f(blk), h2f(blk.add(2)));
                    // Unpacked in straight code: a closure here stays an out-of-line call.
                    let q = &*(blk.add(4) as *const [u8; 12]);
                    let mut sm = [(0u8, 0u8); 8];
                    for j in 0..4 {
                        sm[j] = (q[j] & 63, q[j + 4] & 63);
                        sm[j + 4] = ((q[j + 8] & 0xF) | ((q[j] >> 6) << 4), (q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4));
                    }
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
                    // The min term sum_j m_j (sums_2j + sums_2j+1), in lanes: each 16-sum
                    // times its sub-block's min.
                    let m = |j: usize| sm[j].1 as i32;
                    let m_lo = _mm256_setr_epi32(m(0), m(0), m(1), m(1), m(2), m(2), m(3), m(3));
                    let m_hi = _mm256_setr_epi32(m(4), m(4), m(5), m(5), m(6), m(6), m(7), m(7));
                    for r in 0..R {
                        let s = xs[r].sums.as_ptr().add(16 * b);
                        let mins = hsum_i32(_mm256_add_epi32(
                            _mm256_mullo_epi32(m_lo, _mm256_loadu_si256(s as *const __m256i)),
                            _mm256_mullo_epi32(m_hi, _mm256_loadu_si256(s.add(8) as *const __m256i)),
                        ));
                        let dx = *xs[r].d.get_unchecked(b);
                        acc[r] += d * dx * hsum_i32(isum[r]) as f32 - dmin * dx * mins as f32;
                    }
                }
                acc
            }

            /// [`q4k_q5k`] for any number of activation rows: each super-block is
            /// unpacked once (bytes and scale registers) and every row runs against it,
            /// so a row costs its dot products alone. The same integer sums and float
            /// steps per row as [`q4k_q5k`]: equal bit for bit. `acc[r] +=` row `r`'s
            /// products.
            #[target_feature(enable = $feat)]
            pub unsafe fn q4k_q5k_many<const FIVE: bool>(w: *const u8, nb: usize, xs: &[ActRow<'_>], acc: &mut [f32]) {
                let bb = if FIVE { 176 } else { 144 };
                let qs_at = if FIVE { 48 } else { 16 };
                let m4 = _mm256_set1_epi8(0x0F);
                let h5 = _mm256_set1_epi8(0x10);
                for b in 0..nb {
                    let blk = w.add(b * bb);
                    let (d, dmin) = (h2f(blk), h2f(blk.add(2)));
                    let q = &*(blk.add(4) as *const [u8; 12]);
                    let mut sm = [(0u8, 0u8); 8];
                    for j in 0..4 {
                        sm[j] = (q[j] & 63, q[j + 4] & 63);
                        sm[j + 4] = ((q[j + 8] & 0xF) | ((q[j] >> 6) << 4), (q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4));
                    }
                    let qh = if FIVE { ld(blk.add(16)) } else { _mm256_setzero_si256() };
                    let mut u = [_mm256_setzero_si256(); 8];
                    let mut sc = [_mm256_setzero_si256(); 8];
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
                        u[2 * j] = lo;
                        u[2 * j + 1] = hi;
                        let (s0, s1) = (sm[2 * j].0 as i32, sm[2 * j + 1].0 as i32);
                        sc[2 * j] = scales(s0, s0);
                        sc[2 * j + 1] = scales(s1, s1);
                    }
                    let m = |j: usize| sm[j].1 as i32;
                    let m_lo = _mm256_setr_epi32(m(0), m(0), m(1), m(1), m(2), m(2), m(3), m(3));
                    let m_hi = _mm256_setr_epi32(m(4), m(4), m(5), m(5), m(6), m(6), m(7), m(7));
                    for (r, x) in xs.iter().enumerate() {
                        let xp = x.qs.as_ptr().add(256 * b) as *const u8;
                        let mut i0 = sdot(u[0], ld(xp), sc[0]);
                        let mut i1 = sdot(u[1], ld(xp.add(32)), sc[1]);
                        for j in 1..4 {
                            i0 = _mm256_add_epi32(i0, sdot(u[2 * j], ld(xp.add(64 * j)), sc[2 * j]));
                            i1 = _mm256_add_epi32(i1, sdot(u[2 * j + 1], ld(xp.add(64 * j + 32)), sc[2 * j + 1]));
                        }
                        let s = x.sums.as_ptr().add(16 * b);
                        let mins = hsum_i32(_mm256_add_epi32(
                            _mm256_mullo_epi32(m_lo, _mm256_loadu_si256(s as *const __m256i)),
                            _mm256_mullo_epi32(m_hi, _mm256_loadu_si256(s.add(8) as *const __m256i)),
                        ));
                        let dx = *x.d.get_unchecked(b);
                        let a = acc.get_unchecked_mut(r);
                        *a += d * dx * hsum_i32(_mm256_add_epi32(i0, i1)) as f32 - dmin * dx * mins as f32;
                    }
                }
            }

            /// `acc + ` [`idot`]`(u, x)`.
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn idot_acc(acc: __m256i, u: __m256i, x: __m256i) -> __m256i {
                if $vnni {
                    _mm256_dpbusd_epi32(acc, u, x)
                } else {
                    _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)))
                }
            }

            /// An 8 x 8 transpose of 32-bit lanes: `out[q]` lane `i` is `r[i]` lane `q`.
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn transpose8(r: &[__m256i; 8]) -> [__m256i; 8] {
                let t0 = _mm256_unpacklo_epi32(r[0], r[1]);
                let t1 = _mm256_unpackhi_epi32(r[0], r[1]);
                let t2 = _mm256_unpacklo_epi32(r[2], r[3]);
                let t3 = _mm256_unpackhi_epi32(r[2], r[3]);
                let t4 = _mm256_unpacklo_epi32(r[4], r[5]);
                let t5 = _mm256_unpackhi_epi32(r[4], r[5]);
                let t6 = _mm256_unpacklo_epi32(r[6], r[7]);
                let t7 = _mm256_unpackhi_epi32(r[6], r[7]);
                let u0 = _mm256_unpacklo_epi64(t0, t2);
                let u1 = _mm256_unpackhi_epi64(t0, t2);
                let u2 = _mm256_unpacklo_epi64(t1, t3);
                let u3 = _mm256_unpackhi_epi64(t1, t3);
                let u4 = _mm256_unpacklo_epi64(t4, t6);
                let u5 = _mm256_unpackhi_epi64(t4, t6);
                let u6 = _mm256_unpacklo_epi64(t5, t7);
                let u7 = _mm256_unpackhi_epi64(t5, t7);
                [
                    _mm256_permute2x128_si256::<0x20>(u0, u4),
                    _mm256_permute2x128_si256::<0x20>(u1, u5),
                    _mm256_permute2x128_si256::<0x20>(u2, u6),
                    _mm256_permute2x128_si256::<0x20>(u3, u7),
                    _mm256_permute2x128_si256::<0x31>(u0, u4),
                    _mm256_permute2x128_si256::<0x31>(u1, u5),
                    _mm256_permute2x128_si256::<0x31>(u2, u6),
                    _mm256_permute2x128_si256::<0x31>(u3, u7),
                ]
            }

            /// Eight Q4_K / Q5_K weight rows (`rb` bytes apart) against any number of
            /// activation rows: `acc[r][i] +=` activation row `r` times weight row `i`.
            /// Each super-block of the eight rows is unpacked once and transposed so a
            /// register's lane `i` holds four bytes of weight row `i`: one instruction
            /// then takes four products for each of eight outputs (four activation bytes
            /// broadcast), with no horizontal sums, and each sub-block's scale is one
            /// lane-wise multiply per activation row. Integer sums are exact and the
            /// float steps per output those of [`super::super::dot_scalar`] (lane-wise,
            /// no fused multiply-add): equal bit for bit.
            #[target_feature(enable = $feat)]
            pub unsafe fn q4k_q5k_x8<const FIVE: bool>(
                w: *const u8,
                rb: usize,
                nb: usize,
                xs: &[ActRow<'_>],
                acc: &mut [[f32; 8]],
            ) {
                let bb = if FIVE { 176 } else { 144 };
                let qs_at = if FIVE { 48 } else { 16 };
                let m4 = _mm256_set1_epi8(0x0F);
                let h5 = _mm256_set1_epi8(0x10);
                let mut isum = vec![_mm256_setzero_si256(); xs.len()];
                // The eight rows are one run of `8 rb` bytes, read a block of each row at a
                // time: too many short streams for the hardware prefetcher. The next pass's
                // run is asked for a slice per block instead.
                let pf_on = super::pf_rows() != 0;
                let slice = (8 * rb).div_ceil(nb);
                for b in 0..nb {
                    if pf_on {
                        prefetch(w.wrapping_add(8 * rb + b * slice), slice);
                    }
                    // v[j][i]: sub-block j of weight row i (32 bytes), then transposed.
                    let mut v = [[_mm256_setzero_si256(); 8]; 8];
                    let mut sc = [[0i32; 8]; 8];
                    let mut mn = [[0i32; 8]; 8];
                    let (mut dv, mut dmv) = ([0.0f32; 8], [0.0f32; 8]);
                    for i in 0..8 {
                        let blk = w.add(i * rb + b * bb);
                        dv[i] = h2f(blk);
                        dmv[i] = h2f(blk.add(2));
                        let q = &*(blk.add(4) as *const [u8; 12]);
                        for j in 0..4 {
                            sc[j][i] = (q[j] & 63) as i32;
                            mn[j][i] = (q[j + 4] & 63) as i32;
                            sc[j + 4][i] = ((q[j + 8] & 0xF) | ((q[j] >> 6) << 4)) as i32;
                            mn[j + 4][i] = ((q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4)) as i32;
                        }
                        let qh = if FIVE { ld(blk.add(16)) } else { _mm256_setzero_si256() };
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
                            v[2 * j][i] = lo;
                            v[2 * j + 1][i] = hi;
                        }
                    }
                    for vj in v.iter_mut() {
                        *vj = transpose8(vj);
                    }
                    for s in isum.iter_mut() {
                        *s = _mm256_setzero_si256();
                    }
                    for j in 0..8 {
                        let vj = &v[j];
                        let scj = _mm256_loadu_si256(sc[j].as_ptr() as *const __m256i);
                        for (r, x) in xs.iter().enumerate() {
                            let xp = x.qs.as_ptr().add(256 * b + 32 * j) as *const i32;
                            // Two chains: each waits on its own accumulator only.
                            let (mut p, mut p1) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                            for q in 0..4 {
                                p = idot_acc(p, vj[2 * q], _mm256_set1_epi32(xp.add(2 * q).read_unaligned()));
                                p1 = idot_acc(p1, vj[2 * q + 1], _mm256_set1_epi32(xp.add(2 * q + 1).read_unaligned()));
                            }
                            let p = _mm256_add_epi32(p, p1);
                            let s = isum.get_unchecked_mut(r);
                            *s = _mm256_add_epi32(*s, _mm256_mullo_epi32(p, scj));
                        }
                    }
                    let d = _mm256_loadu_ps(dv.as_ptr());
                    let dmin = _mm256_loadu_ps(dmv.as_ptr());
                    // The min term by pairs of sub-blocks in int16 (`vpmaddwd`): a min is at
                    // most 63 and a sub-block's activation sum at most 32 x 127 in size.
                    let mv: [__m256i; 4] = std::array::from_fn(|jp| {
                        let pair: [i32; 8] =
                            std::array::from_fn(|i| (mn[2 * jp][i] & 0xFFFF) | (mn[2 * jp + 1][i] << 16));
                        _mm256_loadu_si256(pair.as_ptr() as *const __m256i)
                    });
                    for (r, x) in xs.iter().enumerate() {
                        let s = x.sums.as_ptr().add(16 * b);
                        let mut mins = _mm256_setzero_si256();
                        for jp in 0..4 {
                            let b0 = *s.add(4 * jp) + *s.add(4 * jp + 1);
                            let b1 = *s.add(4 * jp + 2) + *s.add(4 * jp + 3);
                            let bs = _mm256_set1_epi32((b0 & 0xFFFF) | (b1 << 16));
                            mins = _mm256_add_epi32(mins, _mm256_madd_epi16(mv[jp], bs));
                        }
                        let dx = _mm256_set1_ps(*x.d.get_unchecked(b));
                        let t1 = _mm256_mul_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(*isum.get_unchecked(r)));
                        let t2 = _mm256_mul_ps(_mm256_mul_ps(dmin, dx), _mm256_cvtepi32_ps(mins));
                        let a = acc.get_unchecked_mut(r).as_mut_ptr();
                        _mm256_storeu_ps(a, _mm256_add_ps(_mm256_loadu_ps(a), _mm256_sub_ps(t1, t2)));
                    }
                }
            }

            /// Eight Q6_K weight rows against any number of activation rows, laid out
            /// as [`q4k_q5k_x8`]; the offset term by int16 pairs (`vpmaddwd`). Equal to
            /// [`q6k`] bit for bit.
            #[target_feature(enable = $feat)]
            pub unsafe fn q6k_x8(w: *const u8, rb: usize, nb: usize, xs: &[ActRow<'_>], acc: &mut [[f32; 8]]) {
                let m4 = _mm256_set1_epi8(0x0F);
                let m2 = _mm256_set1_epi8(0x30);
                let mut isum = vec![_mm256_setzero_si256(); xs.len()];
                // The eight rows are one run of `8 rb` bytes, read a block of each row at a
                // time: too many short streams for the hardware prefetcher. The next pass's
                // run is asked for a slice per block instead.
                let pf_on = super::pf_rows() != 0;
                let slice = (8 * rb).div_ceil(nb);
                for b in 0..nb {
                    if pf_on {
                        prefetch(w.wrapping_add(8 * rb + b * slice), slice);
                    }
                    let mut v = [[_mm256_setzero_si256(); 8]; 8];
                    // Scales widened per row (row i: scales 0..8, 8..16), then transposed:
                    // `sc[gi]` lane i is row i's scale gi.
                    let (mut slo, mut shi) = ([_mm256_setzero_si256(); 8], [_mm256_setzero_si256(); 8]);
                    let mut dh = [0u16; 8];
                    for i in 0..8 {
                        let blk = w.add(i * rb + b * 210);
                        dh[i] = (blk.add(208) as *const u16).read_unaligned();
                        let s16 = _mm_loadu_si128(blk.add(192) as *const __m128i);
                        slo[i] = _mm256_cvtepi8_epi32(s16);
                        shi[i] = _mm256_cvtepi8_epi32(_mm_srli_si128::<8>(s16));
                        for h in 0..2 {
                            let a = ld(blk.add(64 * h));
                            let bq = ld(blk.add(64 * h + 32));
                            let qh = ld(blk.add(128 + 32 * h));
                            v[4 * h][i] =
                                _mm256_or_si256(_mm256_and_si256(a, m4), _mm256_and_si256(_mm256_slli_epi16::<4>(qh), m2));
                            v[4 * h + 1][i] =
                                _mm256_or_si256(_mm256_and_si256(bq, m4), _mm256_and_si256(_mm256_slli_epi16::<2>(qh), m2));
                            v[4 * h + 2][i] = _mm256_or_si256(
                                _mm256_and_si256(_mm256_srli_epi16::<4>(a), m4),
                                _mm256_and_si256(qh, m2),
                            );
                            v[4 * h + 3][i] = _mm256_or_si256(
                                _mm256_and_si256(_mm256_srli_epi16::<4>(bq), m4),
                                _mm256_and_si256(_mm256_srli_epi16::<2>(qh), m2),
                            );
                        }
                    }
                    for vg in v.iter_mut() {
                        *vg = transpose8(vg);
                    }
                    let (tlo, thi) = (transpose8(&slo), transpose8(&shi));
                    macro_rules! sc {
                        ($gi:expr) => {{
                            let gi: usize = $gi;
                            if gi < 8 {
                                tlo[gi]
                            } else {
                                thi[gi - 8]
                            }
                        }};
                    }
                    for s in isum.iter_mut() {
                        *s = _mm256_setzero_si256();
                    }
                    for g in 0..8 {
                        let vg = &v[g];
                        let (s0, s1) = (sc!(2 * g), sc!(2 * g + 1));
                        for (r, x) in xs.iter().enumerate() {
                            let xp = x.qs.as_ptr().add(256 * b + 32 * g) as *const i32;
                            let (mut p0, mut p1) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                            for q in 0..4 {
                                p0 = idot_acc(p0, vg[q], _mm256_set1_epi32(xp.add(q).read_unaligned()));
                                p1 = idot_acc(p1, vg[q + 4], _mm256_set1_epi32(xp.add(q + 4).read_unaligned()));
                            }
                            let s = isum.get_unchecked_mut(r);
                            *s = _mm256_add_epi32(*s, _mm256_add_epi32(_mm256_mullo_epi32(p0, s0), _mm256_mullo_epi32(p1, s1)));
                        }
                    }
                    let d = _mm256_cvtph_ps(halves(&dh));
                    // Scales (int8) and 16-sums (at most 16 x 127 in size) fit int16: pairs
                    // (2k, 2k + 1) in one int32 lane each, for `vpmaddwd`.
                    let lo16 = _mm256_set1_epi32(0xFFFF);
                    let mut sp = [_mm256_setzero_si256(); 8];
                    for (k, spk) in sp.iter_mut().enumerate() {
                        *spk = _mm256_or_si256(_mm256_and_si256(sc!(2 * k), lo16), _mm256_slli_epi32::<16>(sc!(2 * k + 1)));
                    }
                    for (r, x) in xs.iter().enumerate() {
                        let s = x.sums.as_ptr().add(16 * b);
                        // The sixteen sums as int16 pairs: `vpackssdw` packs within 128-bit
                        // halves, the permute puts the pairs back in order.
                        let pk = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi32(
                            _mm256_loadu_si256(s as *const __m256i),
                            _mm256_loadu_si256(s.add(8) as *const __m256i),
                        ));
                        let mut off = _mm256_setzero_si256();
                        for (k, spk) in sp.iter().enumerate() {
                            let bs = _mm256_permutevar8x32_epi32(pk, _mm256_set1_epi32(k as i32));
                            off = _mm256_add_epi32(off, _mm256_madd_epi16(*spk, bs));
                        }
                        let v = _mm256_sub_epi32(*isum.get_unchecked(r), _mm256_slli_epi32::<5>(off));
                        let dx = _mm256_set1_ps(*x.d.get_unchecked(b));
                        let t = _mm256_mul_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(v));
                        let a = acc.get_unchecked_mut(r).as_mut_ptr();
                        _mm256_storeu_ps(a, _mm256_add_ps(_mm256_loadu_ps(a), t));
                    }
                }
            }

            /// [`q6k`] for any number of activation rows, each super-block unpacked
            /// once (as [`q4k_q5k_many`]); equal to [`q6k`] bit for bit.
            #[target_feature(enable = $feat)]
            pub unsafe fn q6k_many(w: *const u8, nb: usize, xs: &[ActRow<'_>], acc: &mut [f32]) {
                let m4 = _mm256_set1_epi8(0x0F);
                let m2 = _mm256_set1_epi8(0x30);
                for b in 0..nb {
                    let blk = w.add(b * 210);
                    let sc = std::slice::from_raw_parts(blk.add(192), 16);
                    let d = h2f(blk.add(208));
                    let mut u = [_mm256_setzero_si256(); 8];
                    let mut s = [_mm256_setzero_si256(); 8];
                    for h in 0..2 {
                        let a = ld(blk.add(64 * h));
                        let bq = ld(blk.add(64 * h + 32));
                        let qh = ld(blk.add(128 + 32 * h));
                        u[4 * h] = _mm256_or_si256(_mm256_and_si256(a, m4), _mm256_and_si256(_mm256_slli_epi16::<4>(qh), m2));
                        u[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(bq, m4), _mm256_and_si256(_mm256_slli_epi16::<2>(qh), m2));
                        u[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(a), m4), _mm256_and_si256(qh, m2));
                        u[4 * h + 3] = _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16::<4>(bq), m4),
                            _mm256_and_si256(_mm256_srli_epi16::<2>(qh), m2),
                        );
                    }
                    for g in 0..8 {
                        s[g] = scales(sc[2 * g] as i8 as i32, sc[2 * g + 1] as i8 as i32);
                    }
                    let sc_lo = _mm256_cvtepi8_epi32(_mm_loadl_epi64(sc.as_ptr() as *const __m128i));
                    let sc_hi = _mm256_cvtepi8_epi32(_mm_loadl_epi64(sc.as_ptr().add(8) as *const __m128i));
                    for (r, x) in xs.iter().enumerate() {
                        let xp = x.qs.as_ptr().add(256 * b) as *const u8;
                        let mut i0 = sdot(u[0], ld(xp), s[0]);
                        let mut i1 = sdot(u[1], ld(xp.add(32)), s[1]);
                        for g in (2..8).step_by(2) {
                            i0 = _mm256_add_epi32(i0, sdot(u[g], ld(xp.add(32 * g)), s[g]));
                            i1 = _mm256_add_epi32(i1, sdot(u[g + 1], ld(xp.add(32 * g + 32)), s[g + 1]));
                        }
                        let sp = x.sums.as_ptr().add(16 * b);
                        let off = _mm256_add_epi32(
                            _mm256_mullo_epi32(sc_lo, _mm256_loadu_si256(sp as *const __m256i)),
                            _mm256_mullo_epi32(sc_hi, _mm256_loadu_si256(sp.add(8) as *const __m256i)),
                        );
                        let v = _mm256_sub_epi32(_mm256_add_epi32(i0, i1), _mm256_slli_epi32::<5>(off));
                        let a = acc.get_unchecked_mut(r);
                        *a += d * *x.d.get_unchecked(b) * hsum_i32(v) as f32;
                    }
                }
            }

            /// Int32 scales in lanes as [`sdot`] takes them: as they are for VNNI's
            /// `vpmulld`, each repeated in both 16-bit halves for `vpmaddwd`.
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn scale_lanes(s: __m256i) -> __m256i {
                if $vnni {
                    s
                } else {
                    _mm256_or_si256(_mm256_and_si256(s, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32::<16>(s))
                }
            }

            /// A Q6_K half's four groups of 32 six-bit values from its 32 + 32 low-nibble
            /// bytes `a`, `bq` and 32 high-bit bytes `qh`. With AVX-512VL one ternary-logic
            /// instruction takes "low nibble of one, bits 4..6 of the other, zero above".
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn q6_groups(a: __m256i, bq: __m256i, qh: __m256i) -> [__m256i; 4] {
                let m4 = _mm256_set1_epi8(0x0F);
                let m2 = _mm256_set1_epi8(0x30);
                if $vnni {
                    // `m4 ? lo : hi` bitwise (truth table 0xD8 on (hi, lo, m4)), then the
                    // two bits above the six cleared.
                    let m6 = _mm256_set1_epi8(0x3F);
                    macro_rules! sel {
                        ($lo:expr, $hi:expr) => {
                            _mm256_and_si256(_mm256_ternarylogic_epi32::<0xD8>($hi, $lo, m4), m6)
                        };
                    }
                    let _ = m2;
                    [
                        sel!(a, _mm256_slli_epi16::<4>(qh)),
                        sel!(bq, _mm256_slli_epi16::<2>(qh)),
                        sel!(_mm256_srli_epi16::<4>(a), qh),
                        sel!(_mm256_srli_epi16::<4>(bq), _mm256_srli_epi16::<2>(qh)),
                    ]
                } else {
                    [
                        _mm256_or_si256(_mm256_and_si256(a, m4), _mm256_and_si256(_mm256_slli_epi16::<4>(qh), m2)),
                        _mm256_or_si256(_mm256_and_si256(bq, m4), _mm256_and_si256(_mm256_slli_epi16::<2>(qh), m2)),
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(a), m4), _mm256_and_si256(qh, m2)),
                        _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16::<4>(bq), m4),
                            _mm256_and_si256(_mm256_srli_epi16::<2>(qh), m2),
                        ),
                    ]
                }
            }

            /// Q6_K weights.
            #[target_feature(enable = $feat)]
            pub unsafe fn q6k<const R: usize>(w: *const u8, nb: usize, xs: &[ActRow<'_>; R]) -> [f32; R] {
                let mut acc = [0.0f32; R];
                // Lanes 0..4 take scale 2k of a half's eight, 4..8 scale 2k + 1.
                let pick = [
                    _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1),
                    _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3),
                    _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5),
                    _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7),
                ];
                let pf = super::pf_dist();
                for b in 0..nb {
                    let blk = w.add(b * 210);
                    prefetch(blk.wrapping_add(pf), 210);
                    let sc = std::slice::from_raw_parts(blk.add(192), 16);
                    let d = h2f(blk.add(208));
                    // The sixteen scales widened once (lane j: scale j, and 8 + j); each
                    // group's scale register is then one lane permute.
                    let sc_lo = _mm256_cvtepi8_epi32(_mm_loadl_epi64(sc.as_ptr() as *const __m128i));
                    let sc_hi = _mm256_cvtepi8_epi32(_mm_loadl_epi64(sc.as_ptr().add(8) as *const __m128i));
                    let (sp_lo, sp_hi) = (scale_lanes(sc_lo), scale_lanes(sc_hi));
                    let mut isum = [_mm256_setzero_si256(); R];
                    for h in 0..2 {
                        let a = ld(blk.add(64 * h));
                        let bq = ld(blk.add(64 * h + 32));
                        let qh = ld(blk.add(128 + 32 * h));
                        let groups = q6_groups(a, bq, qh);
                        for (k, &u) in groups.iter().enumerate() {
                            let g = 4 * h + k;
                            let s = _mm256_permutevar8x32_epi32(if h == 0 { sp_lo } else { sp_hi }, pick[k]);
                            for r in 0..R {
                                let x = ld(xs[r].qs.as_ptr().add(256 * b + 32 * g) as *const u8);
                                isum[r] = _mm256_add_epi32(isum[r], sdot(u, x, s));
                            }
                        }
                    }
                    // The offset 32 sum_g sc_g sums_g, in lanes.
                    for r in 0..R {
                        let s = xs[r].sums.as_ptr().add(16 * b);
                        let off = _mm256_add_epi32(
                            _mm256_mullo_epi32(sc_lo, _mm256_loadu_si256(s as *const __m256i)),
                            _mm256_mullo_epi32(sc_hi, _mm256_loadu_si256(s.add(8) as *const __m256i)),
                        );
                        let v = _mm256_sub_epi32(isum[r], _mm256_slli_epi32::<5>(off));
                        acc[r] += d * *xs[r].d.get_unchecked(b) * hsum_i32(v) as f32;
                    }
                }
                acc
            }
        }
    };
}

kernels!(avx2, "avx2,fma,f16c", false);
kernels!(vnni, "avx2,fma,f16c,avx512f,avx512vl,avx512vnni", true);
