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
