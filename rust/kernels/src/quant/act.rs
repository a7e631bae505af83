//! Activations quantized the way llama.cpp's `vec_dot` takes them, so that products
//! track llama.cpp's: Q8_0 blocks (32 values, `d = amax / 127` kept as float16,
//! `q = round(x / d)`) against Q8_0 and Q4_0 weights; Q8_K blocks (256 values, float32
//! `d`, the value of largest magnitude mapped to -127, sums of each 16 `q` kept for the
//! k-quants' min and offset terms) against the k-quants (`quantize_row_q8_0_ref`,
//! `quantize_row_q8_K_ref` in `ggml-quants.c`).

use super::blocks::{f16_to_f32, QK_K};

/// `x` as float16 bits, to nearest even (what `GGML_FP32_TO_FP16` does), finite input.
pub fn f32_to_f16(x: f32) -> u16 {
    let bits = x.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let a = f32::from_bits(bits & 0x7fff_ffff);
    if a.is_nan() {
        return sign | 0x7e00;
    }
    if a >= 65520.0 {
        return sign | 0x7c00;
    }
    if a < 6.103_515_6e-5 {
        // Subnormal range: a multiple of 2^-24, rounded to nearest even.
        let m = (a * 16_777_216.0).round_ties_even() as u16;
        return sign | m;
    }
    let b = a.to_bits();
    let exp = (b >> 23) as i32 - 127 + 15;
    let man = b & 0x7f_ffff;
    let mut h = ((exp as u32) << 10) | (man >> 13);
    let rest = man & 0x1fff;
    if rest > 0x1000 || (rest == 0x1000 && (h & 1) == 1) {
        h += 1; // carries into the exponent correctly
    }
    sign | h as u16
}

/// Quantized activation rows: `qs` `[rows, k]`, `d` one scale per block, `sums`
/// the sum of each 16 consecutive `qs` (Q8_K: the k-quants' mins and offsets) or of
/// each block (Q8_0: Q5_1's min; llama.cpp's Q8_1 keeps it as `s`).
pub struct QAct {
    pub k: usize,
    pub block: usize,
    pub qs: Vec<i8>,
    pub d: Vec<f32>,
    pub sums: Vec<i32>,
}

impl QAct {
    pub fn new(rows: usize, k: usize, block: usize) -> QAct {
        QAct {
            k,
            block,
            qs: vec![0; rows * k],
            d: vec![0.0; rows * k / block],
            sums: vec![0; rows * k / Self::sum_group(block)],
        }
    }

    /// Values per entry of `sums`.
    fn sum_group(block: usize) -> usize {
        if block == QK_K {
            16
        } else {
            block
        }
    }

    #[inline(always)]
    pub fn row(&self, t: usize) -> ActRow<'_> {
        let nb = self.k / self.block;
        let ns = self.k / Self::sum_group(self.block);
        ActRow {
            qs: &self.qs[t * self.k..(t + 1) * self.k],
            d: &self.d[t * nb..(t + 1) * nb],
            sums: &self.sums[t * ns..(t + 1) * ns],
        }
    }

    /// Quantizes row `t` from `x` (`k` floats).
    pub fn set_row(&mut self, t: usize, x: &[f32]) {
        let k = self.k;
        let nb = k / self.block;
        let qs = &mut self.qs[t * k..(t + 1) * k];
        let d = &mut self.d[t * nb..(t + 1) * nb];
        #[cfg(target_arch = "x86_64")]
        if super::QIsa::detect() != super::QIsa::Scalar {
            // SAFETY: AVX2 (and the F16C this path does not need) were detected.
            unsafe {
                if self.block == 32 {
                    x86::quantize_q8_0(x, qs, d, &mut self.sums[t * nb..(t + 1) * nb]);
                } else {
                    x86::quantize_q8_k(x, qs, d, &mut self.sums[t * k / 16..(t + 1) * k / 16]);
                }
            }
            return;
        }
        if self.block == 32 {
            quantize_q8_0(x, qs, d);
            for (s, b) in self.sums[t * nb..(t + 1) * nb].iter_mut().zip(qs.chunks_exact(32)) {
                *s = b.iter().map(|&q| q as i32).sum();
            }
        } else {
            quantize_q8_k(x, qs, d, &mut self.sums[t * k / 16..(t + 1) * k / 16]);
        }
    }
}

#[derive(Clone, Copy)]
pub struct ActRow<'a> {
    pub qs: &'a [i8],
    pub d: &'a [f32],
    pub sums: &'a [i32],
}

/// `quantize_row_q8_0_ref`: `d` the float16-rounded scale as float32.
#[inline]
pub fn quantize_q8_0(x: &[f32], qs: &mut [i8], d: &mut [f32]) {
    for ((xb, qb), db) in x.chunks_exact(32).zip(qs.chunks_exact_mut(32)).zip(d.iter_mut()) {
        let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let s = amax / 127.0;
        let id = if s != 0.0 { 1.0 / s } else { 0.0 };
        for (q, &v) in qb.iter_mut().zip(xb) {
            *q = (v * id).round() as i8; // roundf: half away from zero
        }
        *db = f16_to_f32(f32_to_f16(s));
    }
}

/// `quantize_row_q8_K_ref`. (`#[inline]`: inlined into a caller compiled for SSE4.1,
/// the roundings are one instruction each instead of a libm call.)
#[inline]
pub fn quantize_q8_k(x: &[f32], qs: &mut [i8], d: &mut [f32], sums: &mut [i32]) {
    for (((xb, qb), db), sb) in x
        .chunks_exact(QK_K)
        .zip(qs.chunks_exact_mut(QK_K))
        .zip(d.iter_mut())
        .zip(sums.chunks_exact_mut(QK_K / 16))
    {
        let (mut amax, mut max) = (0.0f32, 0.0f32);
        for &v in xb {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            *db = 0.0;
            qb.fill(0);
            sb.fill(0);
            continue;
        }
        let iscale = -127.0 / max;
        for (q, &v) in qb.iter_mut().zip(xb) {
            *q = ((iscale * v).round_ties_even() as i32).min(127) as i8;
        }
        for (s, g) in sb.iter_mut().zip(qb.chunks_exact(16)) {
            *s = g.iter().map(|&q| q as i32).sum();
        }
        *db = 1.0 / iscale;
    }
}

/// [`quantize_q8_0`] and [`quantize_q8_k`] (with their sums) in AVX2: the same float
/// operations per value, so the same bytes, scales and sums; a decode step quantizes its
/// activation once per projection, and the scalar loops (a libm rounding call per value
/// on the baseline target) cost a tenth of a small projection. A block holding a NaN or
/// an infinity takes the scalar code (the vector maximum drops NaNs, and the vector
/// conversion of a NaN product is not the scalar cast's 0).
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::blocks::QK_K;
    use std::arch::x86_64::*;

    /// Largest |v| of the `8 n` floats at `x`, or NaN when one is NaN.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn amax(x: *const f32, n: usize) -> f32 {
        let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        let (mut m, mut nan) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for i in 0..n {
            let v = _mm256_loadu_ps(x.add(8 * i));
            m = _mm256_max_ps(m, _mm256_and_ps(v, abs));
            nan = _mm256_or_ps(nan, _mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
        }
        if _mm256_movemask_ps(nan) != 0 {
            return f32::NAN;
        }
        let h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        let h = _mm_max_ss(h, _mm_movehdup_ps(h));
        _mm_cvtss_f32(h)
    }

    /// 32 int32 lanes (four registers in value order) as int8 bytes in order.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn pack32(q: [__m256i; 4], out: *mut i8) {
        let ab = _mm256_packs_epi32(q[0], q[1]);
        let cd = _mm256_packs_epi32(q[2], q[3]);
        let b = _mm256_packs_epi16(ab, cd);
        let b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(out as *mut __m256i, b);
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn quantize_q8_0(x: &[f32], qs: &mut [i8], d: &mut [f32], sums: &mut [i32]) {
        let nb = x.len() / 32;
        assert!(qs.len() == 32 * nb && d.len() == nb && sums.len() == nb);
        let sign = _mm256_castsi256_ps(_mm256_set1_epi32(i32::MIN));
        let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        let (half, one) = (_mm256_set1_ps(0.5), _mm256_set1_ps(1.0));
        for b in 0..nb {
            let xb = x.as_ptr().add(32 * b);
            let a = amax(xb, 4);
            if !a.is_finite() {
                super::quantize_q8_0(&x[32 * b..32 * b + 32], &mut qs[32 * b..32 * b + 32], &mut d[b..b + 1]);
                sums[b] = qs[32 * b..32 * b + 32].iter().map(|&q| q as i32).sum();
                continue;
            }
            let s = a / 127.0;
            let id = _mm256_set1_ps(if s != 0.0 { 1.0 / s } else { 0.0 });
            let q: [__m256i; 4] = std::array::from_fn(|i| {
                let p = _mm256_mul_ps(_mm256_loadu_ps(xb.add(8 * i)), id);
                // `roundf`, half away from zero: the truncation, plus one away from zero
                // where the dropped fraction is at least a half (exact: `p - t` is).
                let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(p);
                let up = _mm256_cmp_ps::<_CMP_GE_OQ>(_mm256_and_ps(_mm256_sub_ps(p, t), abs), half);
                let r = _mm256_add_ps(t, _mm256_and_ps(up, _mm256_or_ps(one, _mm256_and_ps(p, sign))));
                _mm256_cvttps_epi32(r)
            });
            pack32(q, qs.as_mut_ptr().add(32 * b));
            let t = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            let h = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256::<1>(t));
            let h = _mm_hadd_epi32(h, h);
            sums[b] = _mm_cvtsi128_si32(_mm_hadd_epi32(h, h));
            d[b] = super::f16_to_f32(super::f32_to_f16(s));
        }
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn quantize_q8_k(x: &[f32], qs: &mut [i8], d: &mut [f32], sums: &mut [i32]) {
        let nb = x.len() / QK_K;
        assert!(qs.len() == QK_K * nb && d.len() == nb && sums.len() == 16 * nb);
        let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        for b in 0..nb {
            let xb = x.as_ptr().add(QK_K * b);
            let a = amax(xb, 32);
            if !a.is_finite() {
                let r = QK_K * b..QK_K * (b + 1);
                super::quantize_q8_k(&x[r.clone()], &mut qs[r], &mut d[b..b + 1], &mut sums[16 * b..16 * b + 16]);
                continue;
            }
            if a == 0.0 {
                d[b] = 0.0;
                qs[QK_K * b..QK_K * (b + 1)].fill(0);
                sums[16 * b..16 * b + 16].fill(0);
                continue;
            }
            // The first value of largest magnitude, with its sign (the scalar scan's).
            let av = _mm256_set1_ps(a);
            let mut max = 0.0f32;
            for i in 0..32 {
                let v = _mm256_loadu_ps(xb.add(8 * i));
                let hit = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(_mm256_and_ps(v, abs), av));
                if hit != 0 {
                    max = *xb.add(8 * i + hit.trailing_zeros() as usize);
                    break;
                }
            }
            let iscale = -127.0 / max;
            let is = _mm256_set1_ps(iscale);
            let top = _mm256_set1_epi32(127);
            for c in 0..8 {
                let q: [__m256i; 4] = std::array::from_fn(|i| {
                    let p = _mm256_mul_ps(is, _mm256_loadu_ps(xb.add(32 * c + 8 * i)));
                    let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(p);
                    _mm256_min_epi32(_mm256_cvtps_epi32(r), top)
                });
                pack32(q, qs.as_mut_ptr().add(QK_K * b + 32 * c));
                // The two 16-sums of these 32 values.
                let h = _mm256_hadd_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
                let h = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
                let h = _mm_hadd_epi32(h, h);
                sums[16 * b + 2 * c] = _mm_cvtsi128_si32(h);
                sums[16 * b + 2 * c + 1] = _mm_extract_epi32::<1>(h);
            }
            d[b] = 1.0 / iscale;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_rounding_is_to_nearest_even() {
        for &(x, h) in &[
            (1.0f32, 0x3c00u16),
            (-2.0, 0xc000),
            (65504.0, 0x7bff),
            (1.0 + 2f32.powi(-11), 0x3c00),          // tie -> even
            (1.0 + 3.0 * 2f32.powi(-11), 0x3c02),    // tie -> even (up)
            (2f32.powi(-24), 0x0001),
            (2f32.powi(-14), 0x0400),
            (0.0, 0),
        ] {
            assert_eq!(f32_to_f16(x), h, "{x}");
        }
        // Round trip of every finite half.
        for h in 0u16..0x7c00 {
            assert_eq!(f32_to_f16(f16_to_f32(h)), h);
        }
    }

    /// The AVX2 quantizers give the scalar ones' bytes, scales and sums: random rows,
    /// rows of exact ties (`k + 0.5` after scaling), zero blocks, a largest magnitude held
    /// by both signs, and blocks with a NaN or an infinity.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_avx2_quantizers_equal_the_scalar_ones() {
        if crate::quant::QIsa::detect() == crate::quant::QIsa::Scalar {
            return;
        }
        let mut g = crate::quant::test_util::Lcg(11);
        let k = 1024;
        let mut rows: Vec<Vec<f32>> = (0..20).map(|i| (0..k).map(|_| g.f() * (1.0 + i as f32)).collect()).collect();
        // Ties: multiples of 0.5 with the block maximum 127 (so q = v exactly scaled).
        rows.push((0..k).map(|i| if i % 32 == 0 { 127.0 } else { ((i * 37 % 255) as f32 - 127.0) * 0.5 }).collect());
        rows.push((0..k).map(|i| if i % 256 == 3 { -127.0 } else { ((i * 41 % 255) as f32 - 127.0) * 0.5 }).collect());
        let mut r: Vec<f32> = (0..k).map(|_| g.f()).collect();
        r[..256].fill(0.0);
        r[256 + 7] = 3.0;
        r[256 + 100] = -3.0;
        r[600] = f32::NAN;
        r[900] = f32::INFINITY;
        r[40] = -0.0;
        rows.push(r);
        for (i, x) in rows.iter().enumerate() {
            for block in [32usize, 256] {
                let nb = k / block;
                let sum_n = if block == 256 { k / 16 } else { nb };
                let (mut q0, mut d0, mut s0) = (vec![0i8; k], vec![0.0f32; nb], vec![0i32; sum_n]);
                let (mut q1, mut d1, mut s1) = (vec![0i8; k], vec![0.0f32; nb], vec![0i32; sum_n]);
                if block == 32 {
                    quantize_q8_0(x, &mut q0, &mut d0);
                    for (s, b) in s0.iter_mut().zip(q0.chunks_exact(32)) {
                        *s = b.iter().map(|&q| q as i32).sum();
                    }
                    unsafe { x86::quantize_q8_0(x, &mut q1, &mut d1, &mut s1) };
                } else {
                    quantize_q8_k(x, &mut q0, &mut d0, &mut s0);
                    unsafe { x86::quantize_q8_k(x, &mut q1, &mut d1, &mut s1) };
                }
                assert_eq!(q0, q1, "row {i} block {block}: quants");
                let bits = |d: &[f32]| d.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&d0), bits(&d1), "row {i} block {block}: scales");
                assert_eq!(s0, s1, "row {i} block {block}: sums");
            }
        }
    }

    #[test]
    fn q8_k_maps_the_largest_magnitude_to_minus_127() {
        let mut x = vec![0.0f32; 256];
        for (i, v) in x.iter_mut().enumerate() {
            *v = (i as f32 - 100.0) * 0.01;
        }
        let (mut qs, mut d, mut s) = (vec![0i8; 256], [0.0f32], vec![0i32; 16]);
        quantize_q8_k(&x, &mut qs, &mut d, &mut s);
        assert_eq!(qs[255], -127);
        for (i, &q) in qs.iter().enumerate() {
            assert!((q as f32 * d[0] - x[i]).abs() <= d[0].abs() * 0.5 + 1e-6);
        }
        assert_eq!(s[3], qs[48..64].iter().map(|&q| q as i32).sum::<i32>());
    }
}
