//! Scalar helpers written so that LLVM vectorises the loops that call them, and the
//! AVX2 dispatch.
//!
//! Rust keeps IEEE semantics (no reassociation), so a plain `sum += a[i] * b[i]` stays
//! scalar; [`dot`] keeps 8 independent partial sums instead. `f32::exp` is a libm call
//! that blocks vectorisation; [`exp`] is the Cephes single-precision polynomial (about
//! 1 ulp), made of arithmetic and bit casts only.

/// `e^x` for finite `x` (clamped to the normal range of f32); about 1 ulp.
///
/// Rounds `x / ln 2` to an integer by adding 1.5 * 2^23 (no `floor`, no float-to-int
/// cast: both would keep the loop scalar), whose low mantissa bits then hold it.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23
    let x = x.clamp(-87.0, 88.0);
    let t = x * LOG2E + MAGIC;
    let n = t - MAGIC;
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    let ni = (t.to_bits() as i32).wrapping_sub(MAGIC.to_bits() as i32);
    y * f32::from_bits(((ni + 127) as u32) << 23)
}

/// `x * sigmoid(x)`.
#[inline(always)]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

/// torch's `softplus` (beta 1, threshold 20).
#[inline(always)]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Dot product with 8 partial sums (one AVX register).
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut tail = 0.0;
    for (x, y) in ra.iter().zip(rb) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// Sum of squares, same lane layout as [`dot`].
#[inline(always)]
pub fn sum_sq(a: &[f32]) -> f32 {
    dot(a, a)
}

/// `1 / sqrt(mean(x^2) + eps)`: the scale of an RMSNorm (one place for its formula).
#[inline(always)]
pub fn inv_rms(x: &[f32], eps: f32) -> f32 {
    1.0 / (sum_sq(x) / x.len() as f32 + eps).sqrt()
}

/// True when the AVX2 copies of the kernels may run on this CPU (checked once).
#[cfg(target_arch = "x86_64")]
pub fn has_avx2() -> bool {
    use std::sync::OnceLock;
    static YES: OnceLock<bool> = OnceLock::new();
    *YES.get_or_init(|| {
        std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
    })
}

/// True when AVX-512F copies of the kernels may run on this CPU (checked once).
#[cfg(target_arch = "x86_64")]
pub fn has_avx512f() -> bool {
    use std::sync::OnceLock;
    static YES: OnceLock<bool> = OnceLock::new();
    *YES.get_or_init(|| std::is_x86_feature_detected!("avx512f"))
}

/// Defines `$name` calling `$body` through an AVX2-compiled copy when the CPU has it.
/// The body is `#[inline(always)]`, so each copy is vectorised for its own target.
macro_rules! dispatch {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)? => $body:ident) => {
        $(#[$m])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                    $body($($arg),*)
                }
                if crate::math::has_avx2() {
                    // SAFETY: the CPU supports the features the copy was compiled for.
                    return unsafe { avx2($($arg),*) };
                }
            }
            $body($($arg),*)
        }
    };
}
pub(crate) use dispatch;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_libm_within_2_ulp() {
        let mut x = -87.0f32;
        while x < 88.0 {
            let (got, want) = (exp(x), x.exp());
            let ulp = (want.to_bits() as i64 - got.to_bits() as i64).abs();
            assert!(ulp <= 2, "exp({x}) = {got}, libm {want} ({ulp} ulp)");
            x += 0.0137;
        }
        assert_eq!(exp(0.0), 1.0);
    }

    #[test]
    fn dot_matches_f64_sum() {
        for n in [0usize, 1, 7, 8, 9, 31, 64, 100] {
            let a: Vec<f32> = (0..n).map(|i| ((i * 7 % 13) as f32 - 6.0) / 5.0).collect();
            let b: Vec<f32> = (0..n).map(|i| ((i * 5 % 11) as f32 - 5.0) / 3.0).collect();
            let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            assert!((dot(&a, &b) as f64 - want).abs() < 1e-4, "n={n}");
        }
    }
}
