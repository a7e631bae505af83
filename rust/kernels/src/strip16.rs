//! The strip kernel of [`crate::matmul`] with 16-row register blocks, on AVX-512.
//!
//! The AVX2 kernel holds 6 rows x 16 columns in 12 of its 16 registers, so a group of
//! 16 rows (the shared expert at 16 tokens, a routed expert at 256) passes over each
//! `[K, 16]` weight strip three times. When the weight's row stride is a multiple of
//! 1 KiB the strip's keys fall into a few cache sets and it does not stay in L1
//! between those passes. AVX-512's 32 registers hold 16 rows x 16 columns (one
//! register a row), so 16 rows read the strip once; the arithmetic per weight load
//! triples. Used by the MoE kernel for its groups of more than 6 rows: measured in one
//! process against the AVX2 kernel (MoE layer, thread CPU time, `moe-bench` shape),
//! 256 tokens 10.17 -> 8.85 ms, 2,048 tokens 65.0 -> 59.7, 32 tokens 2.75 -> 2.52, 16
//! tokens 1.56 -> 1.51.

use crate::matmul::{run_strip, Ctx};

/// Rows `r0..r1` x weight columns `c0..c0 + 16` into output columns from `oc`: the
/// 16-row kernel where the CPU has AVX-512 and the strip is whole, else
/// [`run_strip`].
///
/// # Safety
/// As [`run_strip`].
pub(crate) unsafe fn run_strip16(ctx: &Ctx<'_>, c0: usize, r0: usize, r1: usize, oc: usize) {
    #[cfg(target_arch = "x86_64")]
    if has_avx512() && c0 + 16 <= ctx.n && r1 - r0 > 6 {
        // SAFETY: the CPU has AVX-512F; the strip is whole.
        avx512::strip(ctx, c0, r0, r1, oc);
        return;
    }
    run_strip(ctx, c0, r0, r1, oc);
}

#[cfg(target_arch = "x86_64")]
fn has_avx512() -> bool {
    use std::sync::OnceLock;
    static YES: OnceLock<bool> = OnceLock::new();
    *YES.get_or_init(|| std::is_x86_feature_detected!("avx512f"))
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use crate::matmul::Ctx;
    use std::arch::x86_64::*;

    /// Keys per pass, as the AVX2 kernel's.
    const KB: usize = 256;
    /// Keys ahead to prefetch the weight strip.
    const PREFETCH_KEYS: usize = 64;

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn strip(ctx: &Ctx<'_>, c0: usize, r0: usize, r1: usize, oc: usize) {
        let k = ctx.x.width;
        let mut k0 = 0;
        while k0 < k || k0 == 0 {
            let k1 = (k0 + KB).min(k);
            let mut r = r0;
            while r < r1 {
                let m = (r1 - r).min(16);
                block_of(ctx, c0, r, m, k0, k1, oc);
                r += m;
            }
            if k1 == k {
                break;
            }
            k0 = k1;
        }
    }

    /// Dispatch on the block's row count (a const generic per count).
    #[target_feature(enable = "avx512f")]
    unsafe fn block_of(
        ctx: &Ctx<'_>,
        c0: usize,
        r: usize,
        m: usize,
        k0: usize,
        k1: usize,
        oc: usize,
    ) {
        macro_rules! go {
            ($($n:literal)*) => {
                match m {
                    $($n => block::<$n>(ctx, c0, r, k0, k1, oc),)*
                    _ => unreachable!("a block holds 1 to 16 rows"),
                }
            };
        }
        go!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16)
    }

    /// Rows `r0 .. r0 + R`, 16 columns from `c0`, keys `k0 .. k1`: R accumulators in
    /// registers, added to what earlier key passes left in `out`.
    #[target_feature(enable = "avx512f")]
    unsafe fn block<const R: usize>(
        ctx: &Ctx<'_>,
        c0: usize,
        r0: usize,
        k0: usize,
        k1: usize,
        oc: usize,
    ) {
        let n = ctx.n;
        let mut acc = [_mm512_setzero_ps(); R];
        let mut dst = [std::ptr::null_mut::<f32>(); R];
        let mut xs = [std::ptr::null::<f32>(); R];
        for i in 0..R {
            xs[i] = ctx.x.row(r0 + i).as_ptr();
            // SAFETY: these 16 output columns of these rows belong to this task.
            dst[i] = ctx.out.slice((r0 + i) * ctx.ldo + oc, 16).as_mut_ptr();
            if k0 > 0 {
                acc[i] = _mm512_loadu_ps(dst[i]);
            }
        }
        let w = ctx.wt.as_ptr().add(c0);
        for kk in k0..k1 {
            let wp = w.add(kk * n);
            _mm_prefetch::<_MM_HINT_T0>(wp.wrapping_add(PREFETCH_KEYS * n) as *const i8);
            let wv = _mm512_loadu_ps(wp);
            for i in 0..R {
                let xb = _mm512_set1_ps(*xs[i].add(kk));
                acc[i] = _mm512_fmadd_ps(xb, wv, acc[i]);
            }
        }
        for i in 0..R {
            _mm512_storeu_ps(dst[i], acc[i]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Rows, SharedMut};

    /// Every row count the blocks take (7 to 40: blocks of 16 plus each remainder), more
    /// keys than one pass holds, a row-strided `x` and an output wider than the strips.
    #[test]
    fn matches_the_sum() {
        let (k, n, ldx, ldo) = (300usize, 48usize, 303usize, 50usize);
        for m in 7..=40usize {
            let x: Vec<f32> = (0..m * ldx)
                .map(|i| ((i * 7 % 29) as f32 - 14.0) / 9.0)
                .collect();
            let wt: Vec<f32> = (0..k * n)
                .map(|i| ((i * 11 % 31) as f32 - 15.0) / 13.0)
                .collect();
            let mut out = vec![f32::NAN; m * ldo];
            let ctx = Ctx {
                x: Rows::new(&x, m, k, ldx).unwrap(),
                wt: &wt,
                n,
                out: SharedMut::new(&mut out),
                ldo,
            };
            for s in 0..n / 16 {
                // SAFETY: one thread; the strips' columns lie in `out`.
                unsafe { run_strip16(&ctx, s * 16, 0, m, s * 16) };
            }
            for r in 0..m {
                for c in 0..n {
                    let want: f64 = (0..k)
                        .map(|kk| x[r * ldx + kk] as f64 * wt[kk * n + c] as f64)
                        .sum();
                    assert!(
                        (out[r * ldo + c] as f64 - want).abs() < 1e-3,
                        "m={m} at {r},{c}: {} vs {want}",
                        out[r * ldo + c]
                    );
                }
            }
        }
    }
}
