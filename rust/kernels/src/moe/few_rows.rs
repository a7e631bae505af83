//! The MoE kernel's few-row GEMM: `out[r, oc..oc + w] = x[r] wt[:, c0..c0 + w]` for
//! up to [`FEW_ROWS`] rows of `x` and a weight `[K, N]` row-major (the dense path's
//! layout) read from memory once, as a routed expert of a few rows (or the shared
//! expert, 16 rows at a time) needs it.
//!
//! Two walks, by row count (with AVX-512):
//!
//! - **1-3 rows: [`avx512::stream`]**, the weight key by key as contiguous runs of `w`
//!   floats, the key range cut in [`STREAMS`] parts read in lock-step (one sequential
//!   stream each, which the hardware prefetcher follows), accumulators in L1. Bound by
//!   the memory: 27-28 GB/s at 1-2 rows on `moe-bench` experts from DRAM, the rate of a
//!   plain streaming sum. Every FMA group pays an accumulator load and store per row,
//!   so from 4 rows on it is bound by those instead (4 rows 14-21 GB/s, 8 rows 7-8).
//!   One row whose output fits in 24 registers (an expert's gate+up or down up to 384
//!   columns) takes [`avx512::one_row`]: the same loads and fused multiply-adds in the
//!   same order, accumulators in registers (1-7 % off the MoE layer at 8-32 tokens).
//! - **4-16 rows: [`avx512::blocked`]**, accumulators of `M` rows x `C` vectors in
//!   registers over blocks of [`KEY_BLOCK`] keys (a load and store per row and vector
//!   per 16 keys instead of per 4), the columns walked a register block at a time
//!   within each key block, and every weight piece requested into L2
//!   [`PREFETCH_KEYS`] keys ahead, since within a key block the weight is read in
//!   pieces a row apart, which the hardware prefetcher does not follow (without the
//!   prefetch: 4-10 GB/s). 8 rows: 62-79 GFLOP/s (the old walk 26-30), 16 rows 76-82
//!   (the FMA rate of one core), 4 rows 33-46.
//!
//! The blocked walk sums each output over the keys in order with one FMA per key,
//! as the strip kernels (`crate::matmul`) do, so a row gets the same bits there as on
//! the strip kernel. Without AVX-512 the compiler vectorises the streaming walk
//! ([`portable_rows`]).

use crate::matmul::Ctx;

/// Rows per call (the blocked walk's register blocks hold up to 16 rows).
pub(super) const FEW_ROWS: usize = 16;
/// Columns per call: an expert's whole gate+up row up to an intermediate size of 512
/// (35B-A3B's), its whole down row up to 1,024.
pub(super) const WIDE_COLS: usize = 1024;
/// Rows from which the blocked walk runs (see the module docs: at 4 rows it measured
/// 26-34 us per `moe-bench` expert against 28-42 for the streaming walk, at 2-3 rows
/// it lost: 34-42 against 21-25).
const BLOCKED_MIN_ROWS: usize = 4;
/// Keys per register pass of the blocked walk: at 8 rows 16 keys measured 30 us per
/// expert, 8 keys 32-38, 4 keys 35-38, 2 keys 42 (each pass pays an accumulator load
/// and store per row and vector); 2 keys was best at 4 rows (26 against 30-34).
const KEY_BLOCK: usize = 16;
/// How far ahead (in keys) the blocked walk requests each weight piece: 32-64 measured
/// alike, 128 slower, none 1.5-2x slower.
const PREFETCH_KEYS: usize = 32;

crate::math::dispatch!(pub(super) fn wide_rows(ctx: &Ctx<'_>, m: usize, c0: usize, w: usize, oc: usize) => wide_rows_body);

/// `m <= FEW_ROWS` rows, `w <= WIDE_COLS` columns (see the module docs).
#[inline(always)]
fn wide_rows_body(ctx: &Ctx<'_>, m: usize, c0: usize, w: usize, oc: usize) {
    #[cfg(target_arch = "x86_64")]
    if crate::matmul::has_avx512() {
        // SAFETY: AVX-512F is present; the caller's task owns these output columns.
        unsafe {
            if m >= BLOCKED_MIN_ROWS {
                avx512::blocked_rows(ctx, m, c0, w, oc)
            } else {
                avx512::stream_rows(ctx, m, c0, w, oc)
            }
        };
        return;
    }
    portable_rows(ctx, m, c0, w, oc);
}

/// [`wide_rows_body`] without AVX-512: the compiler vectorises [`wide_rows_m`].
#[inline(always)]
pub(super) fn portable_rows(ctx: &Ctx<'_>, m: usize, c0: usize, w: usize, oc: usize) {
    macro_rules! go {
        ($($n:literal)*) => {
            match m {
                $($n => wide_rows_m::<$n, STREAMS>(ctx, c0, w, oc),)*
                _ => wide_rows_m::<FEW_ROWS, STREAMS>(ctx, c0, w, oc),
            }
        };
    }
    go!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15)
}

/// Weight streams of the streaming walk: the key range cut in this many parts walked
/// in lockstep, so more memory requests are in flight than one sequential stream's
/// hardware prefetcher keeps (measured at 16 tokens x 64 experts, thread CPU time, one
/// process: the MoE layer 1.71 ms with one stream, 1.65 with two, 1.62 with four; at 4
/// tokens 0.66 -> 0.56 ms).
const STREAMS: usize = 4;

/// The streaming walk for `M` rows and `S` weight streams ([`STREAMS`]): each weight
/// element is loaded once for all `M` rows (a row-at-a-time pass would load it `M`
/// times from L1).
#[inline(always)]
fn wide_rows_m<const M: usize, const S: usize>(ctx: &Ctx<'_>, c0: usize, w: usize, oc: usize) {
    let mut acc = [[0.0f32; WIDE_COLS]; M];
    let w = w.min(WIDE_COLS);
    let k = ctx.x.width;
    let part = k / S;
    let step = |acc: &mut [[f32; WIDE_COLS]; M], kk: usize| {
        let wr = &ctx.wt[kk * ctx.n + c0..][..w];
        let xv: [f32; M] = std::array::from_fn(|r| ctx.x.row(r)[kk]);
        let rows = acc.each_mut().map(|a| &mut a[..w]);
        for (c, &wv) in wr.iter().enumerate() {
            for r in 0..M {
                // SAFETY: c < w, the length of every row slice.
                unsafe {
                    let a = rows[r].get_unchecked_mut(c);
                    *a += xv[r] * wv;
                }
            }
        }
    };
    for kk in 0..part {
        let wr: [&[f32]; S] = std::array::from_fn(|s| &ctx.wt[(kk + s * part) * ctx.n + c0..][..w]);
        let xv: [[f32; M]; S] =
            std::array::from_fn(|s| std::array::from_fn(|r| ctx.x.row(r)[kk + s * part]));
        let rows = acc.each_mut().map(|a| &mut a[..w]);
        for c in 0..w {
            for r in 0..M {
                // SAFETY: c < w, the length of every row and weight slice.
                unsafe {
                    let a = rows[r].get_unchecked_mut(c);
                    let mut v = *a;
                    for s in 0..S {
                        v += xv[s][r] * *wr[s].get_unchecked(c);
                    }
                    *a = v;
                }
            }
        }
    }
    for kk in S * part..k {
        step(&mut acc, kk);
    }
    for (r, a) in acc.iter().enumerate() {
        // SAFETY: the caller's task owns these output columns of these rows.
        unsafe { ctx.out.slice(r * ctx.ldo + oc, w) }.copy_from_slice(&a[..w]);
    }
}

/// Both walks with explicit AVX-512 fused multiply-adds (Rust never contracts
/// `a += x * w` into an FMA, so the portable body pays a multiply and an add per
/// element and row).
#[cfg(target_arch = "x86_64")]
pub(super) mod avx512 {
    use super::{Ctx, FEW_ROWS, KEY_BLOCK, PREFETCH_KEYS};
    use std::arch::x86_64::*;

    /// The streaming walk, `m` rows.
    ///
    /// # Safety
    /// AVX-512F must be present; the caller owns the output columns `oc..oc + w` of
    /// every row.
    #[target_feature(enable = "avx512f")]
    pub(in crate::moe) unsafe fn stream_rows(
        ctx: &Ctx<'_>,
        m: usize,
        c0: usize,
        w: usize,
        oc: usize,
    ) {
        if m == 1 && w % 16 == 0 && w / 16 <= ONE_ROW_VECS {
            macro_rules! one {
                ($($v:literal)*) => {
                    match w / 16 {
                        $($v => return one_row::<$v>(ctx, c0, oc),)*
                        _ => {}
                    }
                };
            }
            one!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24);
        }
        macro_rules! go {
            ($($n:literal)*) => {
                match m {
                    $($n => stream::<$n>(ctx, c0, w, oc),)*
                    _ => stream::<FEW_ROWS>(ctx, c0, w, oc),
                }
            };
        }
        go!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15)
    }

    /// Widest output (in vectors) [`one_row`] holds in registers: 24 accumulators, the
    /// 4 streams' broadcasts and a weight vector in the 32 registers.
    const ONE_ROW_VECS: usize = 24;

    /// The streaming walk for one row whose `NV` output vectors fit in registers (an
    /// expert's gate+up of up to 384 columns, its down of up to 384): the same loads
    /// and the same fused multiply-adds in the same order as [`stream`]`::<1>` (so the
    /// same bits), without [`stream`]'s accumulator load and store per vector and key
    /// group. One row is the most common routed group at decode sizes (at 8-16 tokens
    /// of `moe-bench`, 60-80 % of the active experts).
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::needless_range_loop)]
    unsafe fn one_row<const NV: usize>(ctx: &Ctx<'_>, c0: usize, oc: usize) {
        const S: usize = super::STREAMS;
        let k = ctx.x.width;
        let part = k / S;
        let x = ctx.x.row(0).as_ptr();
        let wt = ctx.wt.as_ptr().add(c0);
        let n = ctx.n;
        let mut acc = [_mm512_setzero_ps(); NV];
        for kk in 0..part {
            let xb: [__m512; S] = std::array::from_fn(|s| _mm512_set1_ps(*x.add(kk + s * part)));
            let ws: [*const f32; S] = std::array::from_fn(|s| wt.add((kk + s * part) * n));
            for v in 0..NV {
                let mut t = acc[v];
                for s in 0..S {
                    t = _mm512_fmadd_ps(xb[s], _mm512_loadu_ps(ws[s].add(16 * v)), t);
                }
                acc[v] = t;
            }
        }
        for kk in S * part..k {
            let xb = _mm512_set1_ps(*x.add(kk));
            let wp = wt.add(kk * n);
            for v in 0..NV {
                acc[v] = _mm512_fmadd_ps(xb, _mm512_loadu_ps(wp.add(16 * v)), acc[v]);
            }
        }
        let out = ctx.out.slice(oc, 16 * NV).as_mut_ptr();
        for v in 0..NV {
            _mm512_storeu_ps(out.add(16 * v), acc[v]);
        }
    }

    /// The blocked walk, `m` rows, in register blocks of `m` rows x `C` vectors with
    /// `m C + C + 1 <= 32` registers.
    ///
    /// # Safety
    /// As [`stream_rows`].
    #[target_feature(enable = "avx512f")]
    pub(in crate::moe) unsafe fn blocked_rows(
        ctx: &Ctx<'_>,
        m: usize,
        c0: usize,
        w: usize,
        oc: usize,
    ) {
        match m {
            1 => blocked::<1, 8>(ctx, c0, w, oc),
            2 => blocked::<2, 8>(ctx, c0, w, oc),
            3 => blocked::<3, 4>(ctx, c0, w, oc),
            4 => blocked::<4, 4>(ctx, c0, w, oc),
            5 => blocked::<5, 4>(ctx, c0, w, oc),
            6 => blocked::<6, 4>(ctx, c0, w, oc),
            7 => blocked::<7, 2>(ctx, c0, w, oc),
            8 => blocked::<8, 2>(ctx, c0, w, oc),
            9 => blocked::<9, 2>(ctx, c0, w, oc),
            10 => blocked::<10, 2>(ctx, c0, w, oc),
            11 => blocked::<11, 2>(ctx, c0, w, oc),
            12 => blocked::<12, 2>(ctx, c0, w, oc),
            13 => blocked::<13, 2>(ctx, c0, w, oc),
            14 => blocked::<14, 2>(ctx, c0, w, oc),
            15 => blocked::<15, 1>(ctx, c0, w, oc),
            _ => blocked::<FEW_ROWS, 1>(ctx, c0, w, oc),
        }
    }

    /// Per block of [`KEY_BLOCK`] keys, every column block of `C` vectors (then single
    /// vectors, then the masked tail); the partial sums live in `out` between key
    /// blocks (exact: float32 stored and reloaded).
    #[target_feature(enable = "avx512f")]
    unsafe fn blocked<const M: usize, const C: usize>(
        ctx: &Ctx<'_>,
        c0: usize,
        w: usize,
        oc: usize,
    ) {
        let k = ctx.x.width;
        let full = w / 16;
        let tail = w % 16;
        let mt: __mmask16 = ((1u32 << tail) - 1) as u16;
        let mut k0 = 0;
        while k0 < k {
            let k1 = (k0 + KEY_BLOCK).min(k);
            let mut v = 0;
            while v + C <= full {
                block::<M, C>(ctx, c0, oc, v, k0, k1, 0xffff);
                v += C;
            }
            while v < full {
                block::<M, 1>(ctx, c0, oc, v, k0, k1, 0xffff);
                v += 1;
            }
            if tail > 0 {
                block::<M, 1>(ctx, c0, oc, v, k0, k1, mt);
            }
            k0 = k1;
        }
    }

    /// Rows `0..M`, vectors `v .. v + C` of the columns (from weight column `c0`,
    /// output column `oc`), keys `k0..k1`; the last vector under `mask`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    // Register tiles indexed by row and vector together.
    #[allow(clippy::needless_range_loop)]
    unsafe fn block<const M: usize, const C: usize>(
        ctx: &Ctx<'_>,
        c0: usize,
        oc: usize,
        v: usize,
        k0: usize,
        k1: usize,
        mask: __mmask16,
    ) {
        let n = ctx.n;
        let mut acc = [[_mm512_setzero_ps(); C]; M];
        let mut dst = [std::ptr::null_mut::<f32>(); M];
        let mut xs = [std::ptr::null::<f32>(); M];
        let mk = |j: usize| if j + 1 == C { mask } else { 0xffff };
        for r in 0..M {
            xs[r] = ctx.x.row(r).as_ptr();
            // SAFETY: these columns of these rows belong to the caller's task.
            dst[r] = ctx.out.slice(r * ctx.ldo + oc + 16 * v, 0).as_mut_ptr();
            if k0 > 0 {
                for j in 0..C {
                    acc[r][j] = _mm512_maskz_loadu_ps(mk(j), dst[r].add(16 * j));
                }
            }
        }
        let w = ctx.wt.as_ptr().add(c0 + 16 * v);
        for kk in k0..k1 {
            let wp = w.add(kk * n);
            let mut wv = [_mm512_setzero_ps(); C];
            for j in 0..C {
                // Past the weight's end this names memory that is never read: a
                // prefetch does not fault.
                _mm_prefetch::<_MM_HINT_T1>(
                    wp.wrapping_add(PREFETCH_KEYS * n + 16 * j) as *const i8
                );
                wv[j] = _mm512_maskz_loadu_ps(mk(j), wp.add(16 * j));
            }
            for r in 0..M {
                let xb = _mm512_set1_ps(*xs[r].add(kk));
                for j in 0..C {
                    acc[r][j] = _mm512_fmadd_ps(xb, wv[j], acc[r][j]);
                }
            }
        }
        for r in 0..M {
            for j in 0..C {
                _mm512_mask_storeu_ps(dst[r].add(16 * j), mk(j), acc[r][j]);
            }
        }
    }

    /// The streaming walk for `M` rows: the key range in [`super::STREAMS`] parts read
    /// in lock-step, accumulators in L1.
    #[target_feature(enable = "avx512f")]
    pub(in crate::moe) unsafe fn stream<const M: usize>(
        ctx: &Ctx<'_>,
        c0: usize,
        w: usize,
        oc: usize,
    ) {
        const S: usize = super::STREAMS;
        let w = w.min(super::WIDE_COLS);
        let k = ctx.x.width;
        let part = k / S;
        let xs: [*const f32; M] = std::array::from_fn(|r| ctx.x.row(r).as_ptr());
        let wt = ctx.wt.as_ptr();
        let mut acc = [[0.0f32; super::WIDE_COLS]; M];
        let vecs = w / 16;
        let tail = w % 16;
        let mt: __mmask16 = ((1u32 << tail) - 1) as u16;
        // One pass over the columns per group of S keys (the S key ranges walked in
        // lock-step, one sequential stream each), accumulators in L1.
        let pass = |acc: &mut [[f32; super::WIDE_COLS]; M], keys: [usize; S], ns: usize| {
            let ws: [*const f32; S] = std::array::from_fn(|s| wt.add(keys[s] * ctx.n + c0));
            let xv: [[__m512; M]; S] = std::array::from_fn(|s| {
                std::array::from_fn(|r| _mm512_set1_ps(*xs[r].add(keys[s])))
            });
            for v in 0..vecs + (tail > 0) as usize {
                let mask = if v < vecs { 0xffff } else { mt };
                let wv: [__m512; S] = std::array::from_fn(|s| {
                    if s < ns {
                        _mm512_maskz_loadu_ps(mask, ws[s].add(v * 16))
                    } else {
                        _mm512_setzero_ps()
                    }
                });
                for r in 0..M {
                    let a = acc[r].as_mut_ptr().add(v * 16);
                    let mut t = _mm512_loadu_ps(a);
                    for s in 0..ns {
                        t = _mm512_fmadd_ps(xv[s][r], wv[s], t);
                    }
                    _mm512_storeu_ps(a, t);
                }
            }
        };
        for kk in 0..part {
            pass(&mut acc, std::array::from_fn(|s| kk + s * part), S);
        }
        for kk in S * part..k {
            pass(&mut acc, [kk; S], 1);
        }
        for (r, a) in acc.iter().enumerate() {
            ctx.out.slice(r * ctx.ldo + oc, w).copy_from_slice(&a[..w]);
        }
    }
}
