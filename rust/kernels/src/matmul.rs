//! `y = x W^T` for few rows (decode steps), reading the weight where it lies.
//!
//! BLAS sgemm packs the whole weight into its panel format on every call. For a
//! 2,048-row chunk that is noise; for a decode step of 8-64 rows it costs about as
//! much as the arithmetic, and a CPU step is all GEMMs of that size once the prompts
//! are in. Here the weight is read once per call, in place: it must be stored
//! transposed (`[K, N]` row-major, i.e. `W` with strides `(1, N)`, the layout the
//! CPU path keeps its projections in). Columns are cut into strips of 16 (two AVX
//! registers), rows into blocks of up to 6; a strip's `[K, 16]` slice of the weight
//! stays in L1/L2 while every row block passes over it.

use crate::pool::for_each_task;
use crate::{KernelError, Rows, SharedMut};

const STRIP: usize = 16;

/// One GEMM's operands: `out[r * ldo + oc] = sum_k x[r, k] * wt[k * ldw + c]` for the
/// output column `oc` a strip maps weight column `c` to. Shared with the MoE kernel,
/// which runs strips of many experts' GEMMs as the tasks of one parallel region.
pub(crate) struct Ctx<'a> {
    pub(crate) x: Rows<'a>,
    pub(crate) wt: &'a [f32],
    /// Row stride of `wt` (its `N`).
    pub(crate) n: usize,
    pub(crate) out: SharedMut,
    /// Row stride of `out`.
    pub(crate) ldo: usize,
}

/// `out[m, j] = sum_k x[m, k] * wt[k, j]`: `x` `[M, K]` (row-strided view allowed),
/// `wt` `[K, N]` row-major, `out` `[M, N]` row-major.
pub fn matmul(x: Rows<'_>, wt: &[f32], n: usize, out: &mut [f32]) -> Result<(), KernelError> {
    let (m, k) = (x.rows, x.width);
    if n == 0 || wt.len() != k * n || out.len() != m * n {
        return Err(KernelError::new(format!(
            "wt must be [K={k}, N={n}] and out [M={m}, N={n}]; got {} and {} elements",
            wt.len(),
            out.len()
        )));
    }
    let ctx = Ctx {
        x,
        wt,
        n,
        out: SharedMut::new(out),
        ldo: n,
    };
    let strips = n.div_ceil(STRIP);
    // Tasks of about 4 strips: few enough to keep the scheduling cheap, enough to
    // balance two or more threads on every projection of the model.
    let per_task = 4usize;
    // AVX-512 where a row block of the AVX2 path (6 rows) would not hold every row:
    // up to 6 rows the AVX2 path reads each weight line once too, and for one row it
    // measured faster (the 0.1b LM head, 1 row, 1 thread: 54-59 vs 75-77 ms).
    #[cfg(target_arch = "x86_64")]
    let wide = m > 6 && has_avx512();
    #[cfg(not(target_arch = "x86_64"))]
    let wide = false;
    for_each_task(strips.div_ceil(per_task), m * n * k, |t| {
        let (s0, s1) = (t * per_task, ((t + 1) * per_task).min(strips));
        #[cfg(target_arch = "x86_64")]
        if wide {
            let whole = s1.min(n / STRIP);
            // SAFETY: the CPU has AVX-512F; strips s0..s1 belong to this task alone.
            unsafe { avx512::strips(&ctx, s0, whole.max(s0), 0, m) };
            for s in whole.max(s0)..s1 {
                // SAFETY: as above (the last, partial strip).
                unsafe { strip_portable(&ctx, s * STRIP, 0, m, s * STRIP) };
            }
            return;
        }
        for s in s0..s1 {
            // SAFETY: strip s's columns of every row belong to this task alone.
            unsafe { run_strip(&ctx, s * STRIP, 0, m, s * STRIP) };
        }
    });
    Ok(())
}

/// True when the AVX-512F path may run (checked once); `HYBRIDSERVE_NO_AVX512=1`
/// keeps the AVX2 path (A/B measurements, tests of both paths).
#[cfg(target_arch = "x86_64")]
pub fn has_avx512() -> bool {
    use std::sync::OnceLock;
    static YES: OnceLock<bool> = OnceLock::new();
    *YES.get_or_init(|| {
        std::is_x86_feature_detected!("avx512f")
            && !matches!(
                std::env::var("HYBRIDSERVE_NO_AVX512").as_deref(),
                Ok("1") | Ok("true") | Ok("yes")
            )
    })
}

/// AVX-512: one strip of 16 columns is one register, so up to 16 rows share one load
/// of each weight line (`R x S <= 16` accumulators). The AVX2 path's blocks of 6 rows
/// re-read a strip's `[KB, 16]` slice per block, expecting it in L1; but the slice's
/// lines lie a weight row (`4 N` bytes) apart, and at the model's widths they fall in
/// one or a few L1 sets (`N = 6,144`: every line in the same set), so at 16 rows each
/// weight line came from L2/L3 three times. Here a key block of the rows of `x`
/// (16 x 256 floats, 16 KiB) stays in L1 while the task's strips stream past it, and
/// at up to 16 rows every weight element is read once. Sums run over the keys in
/// order, as on the AVX2 path: the same float32 results bit for bit.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::Ctx;
    use std::arch::x86_64::*;

    const KB: usize = 256;
    const PREFETCH_KEYS: usize = 64;
    /// Rows per register block.
    const MAX_R: usize = 16;

    /// Whole strips `s0..s1`, rows `r0..r1`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn strips(ctx: &Ctx<'_>, s0: usize, s1: usize, r0: usize, r1: usize) {
        let k = ctx.x.width;
        let mut k0 = 0;
        while k0 < k || k0 == 0 {
            let k1 = (k0 + KB).min(k);
            let mut r = r0;
            while r < r1 {
                let rb = (r1 - r).min(MAX_R);
                rows(ctx, rb, s0, s1, r, k0, k1);
                r += rb;
            }
            if k1 == k {
                break;
            }
            k0 = k1;
        }
    }

    /// `rb` rows from `r`: strips several at a time when there are few rows, so that
    /// enough independent FMA chains are in flight (one row alone would wait on the
    /// FMA latency at every key).
    #[target_feature(enable = "avx512f")]
    // `s + $s <= s1` is the strip-group bound for every group width; clippy flags
    // only the width-1 instances.
    #[allow(clippy::int_plus_one)]
    unsafe fn rows(ctx: &Ctx<'_>, rb: usize, s0: usize, s1: usize, r: usize, k0: usize, k1: usize) {
        macro_rules! go {
            ($r:literal, $s:literal) => {{
                let mut s = s0;
                while s + $s <= s1 {
                    block::<$r, $s>(ctx, s * 16, s * 16, r, k0, k1);
                    s += $s;
                }
                while s < s1 {
                    block::<$r, 1>(ctx, s * 16, s * 16, r, k0, k1);
                    s += 1;
                }
            }};
        }
        match rb {
            1 => go!(1, 4),
            2 => go!(2, 4),
            3 => go!(3, 4),
            4 => go!(4, 4),
            5 => go!(5, 2),
            6 => go!(6, 2),
            7 => go!(7, 2),
            8 => go!(8, 2),
            9 => go!(9, 1),
            10 => go!(10, 1),
            11 => go!(11, 1),
            12 => go!(12, 1),
            13 => go!(13, 1),
            14 => go!(14, 1),
            15 => go!(15, 1),
            _ => go!(16, 1),
        }
    }

    /// One strip (weight columns `c0 .. c0 + 16`, written to output columns from `oc`),
    /// rows `r0..r1`, in register blocks of up to 16 rows: the MoE kernel's expert
    /// groups of more than 6 rows, whose outputs land at their own columns.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn strip(ctx: &Ctx<'_>, c0: usize, r0: usize, r1: usize, oc: usize) {
        let k = ctx.x.width;
        let mut k0 = 0;
        while k0 < k || k0 == 0 {
            let k1 = (k0 + KB).min(k);
            let mut r = r0;
            while r < r1 {
                let rb = (r1 - r).min(MAX_R);
                macro_rules! go {
                    ($($n:literal)*) => {
                        match rb {
                            $($n => block::<$n, 1>(ctx, c0, oc, r, k0, k1),)*
                            _ => unreachable!("a block holds 1 to 16 rows"),
                        }
                    };
                }
                go!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16);
                r += rb;
            }
            if k1 == k {
                break;
            }
            k0 = k1;
        }
    }

    /// Rows `r0 .. r0 + R`, `S` strips of weight columns from `c0` written to output
    /// columns from `oc`, keys `k0 .. k1`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    // Register tiles indexed by row and strip together: index loops read plainer
    // than zipped iterators over three arrays.
    #[allow(clippy::needless_range_loop)]
    unsafe fn block<const R: usize, const S: usize>(
        ctx: &Ctx<'_>,
        c0: usize,
        oc: usize,
        r0: usize,
        k0: usize,
        k1: usize,
    ) {
        let n = ctx.n;
        let mut acc = [[_mm512_setzero_ps(); S]; R];
        let mut xs = [std::ptr::null::<f32>(); R];
        let mut dst = [std::ptr::null_mut::<f32>(); R];
        for i in 0..R {
            xs[i] = ctx.x.row(r0 + i).as_ptr();
            // SAFETY: these strips' output columns of these rows belong to this task.
            dst[i] = ctx.out.slice((r0 + i) * ctx.ldo + oc, 16 * S).as_mut_ptr();
            if k0 > 0 {
                for j in 0..S {
                    acc[i][j] = _mm512_loadu_ps(dst[i].add(16 * j));
                }
            }
        }
        let w = ctx.wt.as_ptr().add(c0);
        for kk in k0..k1 {
            let wp = w.add(kk * n);
            let mut wv = [_mm512_setzero_ps(); S];
            for j in 0..S {
                _mm_prefetch::<_MM_HINT_T0>(wp.wrapping_add(PREFETCH_KEYS * n + 16 * j) as *const i8);
                wv[j] = _mm512_loadu_ps(wp.add(16 * j));
            }
            for i in 0..R {
                let xb = _mm512_set1_ps(*xs[i].add(kk));
                for j in 0..S {
                    acc[i][j] = _mm512_fmadd_ps(xb, wv[j], acc[i][j]);
                }
            }
        }
        for i in 0..R {
            for j in 0..S {
                _mm512_storeu_ps(dst[i].add(16 * j), acc[i][j]);
            }
        }
    }
}

/// [`run_strip`] with 16-row register blocks where the CPU has AVX-512 (and the
/// path is not switched off) and the strip is whole: the MoE kernel's expert groups of
/// more than 6 rows, which the AVX2 kernel's 6-row blocks would pass over each strip
/// three times. Measured in one process against the AVX2 kernel (MoE layer, thread CPU
/// time, `moe-bench` shape): 256 tokens 10.17 -> 8.85 ms, 2,048 tokens 65.0 -> 59.7,
/// 32 tokens 2.75 -> 2.52, 16 tokens 1.56 -> 1.51.
///
/// # Safety
/// As [`run_strip`].
pub(crate) unsafe fn run_strip16(ctx: &Ctx<'_>, c0: usize, r0: usize, r1: usize, oc: usize) {
    #[cfg(target_arch = "x86_64")]
    if has_avx512() && c0 + STRIP <= ctx.n && r1 - r0 > 6 {
        // SAFETY: the CPU has AVX-512F; the strip is whole.
        avx512::strip(ctx, c0, r0, r1, oc);
        return;
    }
    run_strip(ctx, c0, r0, r1, oc);
}

/// Rows `r0..r1`, weight columns `c0..min(c0 + 16, n)`, written to output columns from
/// `oc` on.
///
/// # Safety
/// Those output elements must lie in `out` and belong to the calling task alone.
pub(crate) unsafe fn run_strip(ctx: &Ctx<'_>, c0: usize, r0: usize, r1: usize, oc: usize) {
    #[cfg(target_arch = "x86_64")]
    if crate::math::has_avx2() && c0 + STRIP <= ctx.n {
        // SAFETY: the CPU has AVX2 and FMA; the strip is whole.
        avx2::strip(ctx, c0, r0, r1, oc);
        return;
    }
    strip_portable(ctx, c0, r0, r1, oc);
}

/// Any strip width (the last, partial one) and CPUs without AVX2.
unsafe fn strip_portable(ctx: &Ctx<'_>, c0: usize, r0: usize, r1: usize, oc: usize) {
    let (k, n) = (ctx.x.width, ctx.n);
    let c1 = (c0 + STRIP).min(n);
    for r in r0..r1 {
        let xr = ctx.x.row(r);
        let mut acc = [0.0f32; STRIP];
        for (kk, &xv) in xr.iter().enumerate().take(k) {
            let w = &ctx.wt[kk * n + c0..kk * n + c1];
            for (a, &wv) in acc.iter_mut().zip(w) {
                *a += xv * wv;
            }
        }
        let dst = ctx.out.slice(r * ctx.ldo + oc, c1 - c0);
        dst.copy_from_slice(&acc[..c1 - c0]);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::Ctx;
    use std::arch::x86_64::*;

    /// Keys per pass: a strip's `[KB, 16]` slice of the weight (16 KiB) and a row
    /// block's `[6, KB]` slice of `x` stay in L1 while the block's rows pass over it.
    const KB: usize = 256;
    /// Keys ahead to prefetch the weight strip (measured: see benches/moe_layer.py).
    const PREFETCH_KEYS: usize = 64;

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn strip(ctx: &Ctx<'_>, c0: usize, r0: usize, r1: usize, oc: usize) {
        let k = ctx.x.width;
        let mut k0 = 0;
        while k0 < k || k0 == 0 {
            let k1 = (k0 + KB).min(k);
            let mut r = r0;
            while r < r1 {
                match r1 - r {
                    1 => block::<1>(ctx, c0, r, k0, k1, oc),
                    2 => block::<2>(ctx, c0, r, k0, k1, oc),
                    3 => block::<3>(ctx, c0, r, k0, k1, oc),
                    4 => block::<4>(ctx, c0, r, k0, k1, oc),
                    5 => block::<5>(ctx, c0, r, k0, k1, oc),
                    _ => block::<6>(ctx, c0, r, k0, k1, oc),
                }
                r += (r1 - r).min(6);
            }
            if k1 == k {
                break;
            }
            k0 = k1;
        }
    }

    /// Rows `r0 .. r0 + R`, columns `c0 .. c0 + 16`, keys `k0 .. k1`: 2R accumulators
    /// in registers, added to what earlier key passes left in `out`.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn block<const R: usize>(
        ctx: &Ctx<'_>,
        c0: usize,
        r0: usize,
        k0: usize,
        k1: usize,
        oc: usize,
    ) {
        let n = ctx.n;
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        let mut dst = [std::ptr::null_mut::<f32>(); R];
        let mut xs = [std::ptr::null::<f32>(); R];
        for i in 0..R {
            xs[i] = ctx.x.row(r0 + i).as_ptr();
            // SAFETY: these 16 output columns of these rows belong to this task.
            dst[i] = ctx.out.slice((r0 + i) * ctx.ldo + oc, 16).as_mut_ptr();
            if k0 > 0 {
                acc[i] = [_mm256_loadu_ps(dst[i]), _mm256_loadu_ps(dst[i].add(8))];
            }
        }
        let w = ctx.wt.as_ptr().add(c0);
        for kk in k0..k1 {
            let wp = w.add(kk * n);
            // The strip's rows lie a row stride apart: a stride the hardware prefetcher
            // follows poorly when the weight is not in cache (an MoE expert's, read once
            // per step for its one or two rows). Ask for the line a few keys ahead.
            _mm_prefetch::<_MM_HINT_T0>(wp.wrapping_add(PREFETCH_KEYS * n) as *const i8);
            let (w0, w1) = (_mm256_loadu_ps(wp), _mm256_loadu_ps(wp.add(8)));
            for i in 0..R {
                let xb = _mm256_broadcast_ss(&*xs[i].add(kk));
                acc[i][0] = _mm256_fmadd_ps(xb, w0, acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(xb, w1, acc[i][1]);
            }
        }
        for i in 0..R {
            _mm256_storeu_ps(dst[i], acc[i][0]);
            _mm256_storeu_ps(dst[i].add(8), acc[i][1]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_sum_for_every_row_count_and_a_partial_strip() {
        for (m, k, n) in [
            (1usize, 7usize, 16usize),
            (5, 33, 40),
            (13, 64, 35),
            (64, 256, 272),
            (16, 300, 6144),
            (3, 520, 200),
            (9, 260, 96),
            (37, 70, 130),
        ] {
            let x: Vec<f32> = (0..m * (k + 3))
                .map(|i| ((i * 7 % 29) as f32 - 14.0) / 9.0)
                .collect();
            let wt: Vec<f32> = (0..k * n)
                .map(|i| ((i * 11 % 31) as f32 - 15.0) / 13.0)
                .collect();
            let mut out = vec![0.0f32; m * n];
            matmul(Rows::new(&x, m, k, k + 3).unwrap(), &wt, n, &mut out).unwrap();
            for r in 0..m {
                for c in 0..n {
                    let want: f64 = (0..k)
                        .map(|kk| x[r * (k + 3) + kk] as f64 * wt[kk * n + c] as f64)
                        .sum();
                    assert!(
                        (out[r * n + c] as f64 - want).abs() < 1e-4,
                        "m={m} k={k} n={n} at {r},{c}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_row_gets_the_same_bits_alone_in_a_pair_or_in_a_block() {
        // One or two rows take the AVX2 path, 16 the AVX-512 one (where the CPU has it):
        // a sequence's products must not depend on what it is batched with.
        let (k, n) = (300usize, 2_100usize);
        let x: Vec<f32> = (0..16 * k).map(|i| ((i * 7 % 29) as f32 - 14.0) / 9.0).collect();
        let wt: Vec<f32> = (0..k * n).map(|i| ((i * 11 % 31) as f32 - 15.0) / 13.0).collect();
        let mut all = vec![0.0f32; 16 * n];
        matmul(Rows::dense(&x, k).unwrap(), &wt, n, &mut all).unwrap();
        for m in [1usize, 2] {
            let mut few = vec![0.0f32; m * n];
            matmul(Rows::dense(&x[..m * k], k).unwrap(), &wt, n, &mut few).unwrap();
            assert_eq!(few, all[..m * n], "{m} rows");
        }
    }

    /// Every row count the blocks take (7 to 40: blocks of 16 plus each remainder), more
    /// keys than one pass holds, a row-strided `x` and an output wider than the strips.
    #[test]
    fn strip16_matches_the_sum() {
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
