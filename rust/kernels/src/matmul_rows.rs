//! `y = x W^T` in float32 for few rows, the weight stored as checkpoints have it:
//! `[N, K]` row-major (output-major, each output's keys contiguous), read as dot
//! products.
//!
//! A decode step of one sequence reads every weight once and does one multiply-add per
//! element loaded: it is bound by how fast the weight streams from memory. The
//! column-major kernel ([`crate::matmul`]) walks 16-column strips down the keys of a
//! `[K, N]` weight, one 64-byte line per key, each a row stride apart: at one row there
//! is no reuse to hide that, and for the LM head (a 607 KB stride at 151,936 outputs)
//! every line is on a new 4 KiB page. Here each of `C` weight rows is a contiguous run
//! of `K` values, the `C` runs are adjacent, and a tile's loads sweep `C K` contiguous
//! floats; the next tile's lines are prefetched into L2 at the rate this one's are
//! consumed, so the memory system always has the next 24-32 KiB on the way. Measured at
//! one row and 2 threads (benches/gemv.py): about 2x the column-major kernel's GB/s,
//! at the rate of a plain streaming sum.
//!
//! With AVX-512, one or two rows whose `x` fits a quarter of L1 read the weight rows
//! one after another instead ([`IN_ORDER_MAX_X`]): a single sequential read, which the
//! core's stream prefetcher follows better than 8 interleaved ones (the bfloat16
//! kernel's finding, `crate::matmul_bf16`).
//!
//! Each output is its own accumulator (lanes summed once at the end, in a fixed
//! order), so a row's results do not depend on how many rows share the call.

use crate::pool::for_each_task;
use crate::{KernelError, Rows, SharedMut};
#[cfg(target_arch = "x86_64")]
use crate::row_tiles::x86::avx2_tile;

/// Rows of `x` per register block.
const MR: usize = 6;
/// Weight rows per register block for one or two rows of `x` (memory-bound: 8
/// independent loads and FMA chains in flight; 4 measured 20-40 % slower at 1 row).
const NR_FEW: usize = 8;
/// Weight rows per register block for more rows (`MR x NR` accumulators, plus `NR`
/// weight vectors and one `x` vector, fit in AVX-512's 32 registers: 10 loads per 24
/// FMAs).
const NR: usize = 4;
/// One or two rows of `x` read the weight rows one after another (memory order, which
/// the hardware prefetcher follows) while the `x` rows take at most this many floats
/// (8 KiB, a quarter of L1): each `x` element is then loaded once per weight row
/// instead of once per 8, and longer rows fall out of L1 under the weight's stream.
/// Measured at one thread (benches/gemv.py against the side-by-side tile): `K = 768`
/// 1.1-1.3x, `K = 1,024` 1.0-1.2x, `K = 2,048` at one row 0.95-1.05x, but two rows
/// at `K = 2,048` 0.8-0.85x and `K = 3,584` 0.5-0.85x.
const IN_ORDER_MAX_X: usize = 2048;
/// Weight rows per task: balances 2+ threads on the narrowest projection of a model
/// while keeping the per-task cost small.
const ROWS_PER_TASK: usize = 64;
/// Weight rows per task for one or two rows of `x`: a task's first block has no
/// prefetch of its own (the block before it went to whichever thread claimed it), so
/// tasks span more blocks; 6 tasks still split the narrowest projection (768 outputs).
const ROWS_PER_TASK_FEW: usize = 128;

/// The instruction set the kernel runs with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Simd {
    /// AVX-512F (16 floats per register).
    Avx512,
    /// AVX2 + FMA (8 floats per register).
    Avx2,
    /// Plain Rust (any CPU).
    Scalar,
}

impl Simd {
    /// The best this CPU supports; `HYBRIDSERVE_NO_AVX512=1` keeps AVX2 (as for
    /// [`crate::matmul`]).
    pub fn detect() -> Simd {
        #[cfg(target_arch = "x86_64")]
        {
            if crate::matmul::has_avx512() {
                return Simd::Avx512;
            }
            if crate::math::has_avx2() {
                return Simd::Avx2;
            }
        }
        Simd::Scalar
    }

    /// True when this CPU can run kernels compiled for `self`.
    pub fn supported(self) -> bool {
        match self {
            Simd::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Simd::Avx2 => crate::math::has_avx2(),
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512 => std::is_x86_feature_detected!("avx512f"),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }
}

/// `out[m, j] = sum_k x[m, k] * w[j, k]`: `x` `[M, K]` (row-strided view allowed), `w`
/// `[N, K]` row-major, `out` `[M, N]` row-major.
pub fn matmul_rows(x: Rows<'_>, w: &[f32], n: usize, out: &mut [f32]) -> Result<(), KernelError> {
    matmul_rows_with(Simd::detect(), x, w, n, out)
}

/// [`matmul_rows`] with the instruction set chosen by the caller (tests run every path
/// this CPU supports); `KernelError` if the CPU lacks it.
pub fn matmul_rows_with(
    simd: Simd,
    x: Rows<'_>,
    w: &[f32],
    n: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let (m, k) = (x.rows, x.width);
    if n == 0 || k == 0 || w.len() != n * k || out.len() != m * n {
        return Err(KernelError::new(format!(
            "w must be [N={n}, K={k}] and out [M={m}, N={n}]; got {} and {} elements",
            w.len(),
            out.len()
        )));
    }
    if !simd.supported() {
        return Err(KernelError::new(format!(
            "this CPU cannot run the {simd:?} kernels"
        )));
    }
    let dst = SharedMut::new(out);
    let per_task = if m <= 2 {
        ROWS_PER_TASK_FEW
    } else {
        ROWS_PER_TASK
    };
    for_each_task(n.div_ceil(per_task), m * n * k, |t| {
        let (j0, j1) = (t * per_task, ((t + 1) * per_task).min(n));
        // SAFETY: output columns j0..j1 of every row belong to this task alone; the
        // instruction set was checked above.
        unsafe {
            if m <= 2 {
                columns::<NR_FEW>(simd, &x, w, j0, j1, dst, n)
            } else {
                columns::<NR>(simd, &x, w, j0, j1, dst, n)
            }
        }
    });
    Ok(())
}

type Tile<const C: usize> = [[f32; C]; MR];

/// Output columns `j0..j1` of every row, in blocks of `C` weight rows x [`MR`] rows.
///
/// # Safety
/// Those output columns must belong to the calling task alone; `simd` supported.
unsafe fn columns<const C: usize>(
    simd: Simd,
    x: &Rows<'_>,
    w: &[f32],
    j0: usize,
    j1: usize,
    out: SharedMut,
    ldo: usize,
) {
    let k = x.width;
    let mut j = j0;
    while j < j1 {
        let nc = (j1 - j).min(C);
        // A partial block repeats its last weight row (computed, not stored).
        let ws: [*const f32; C] = std::array::from_fn(|c| w.as_ptr().add((j + c.min(nc - 1)) * k));
        // The next block's `C K` floats follow this block's in memory: the first row
        // block prefetches them (the later ones find this block in L1/L2).
        let mut next = w.as_ptr().wrapping_add((j + C) * k);
        let mut r = 0;
        while r < x.rows {
            let mr = (x.rows - r).min(MR);
            let xs: [*const f32; MR] = std::array::from_fn(|i| x.row(r + i.min(mr - 1)).as_ptr());
            let tile: Tile<C> = match simd {
                #[cfg(target_arch = "x86_64")]
                Simd::Avx512 if x.rows <= 2 && x.rows * k <= IN_ORDER_MAX_X => match mr {
                    1 => avx512::in_order::<1, C>(&xs, &ws, k),
                    _ => avx512::in_order::<2, C>(&xs, &ws, k),
                },
                #[cfg(target_arch = "x86_64")]
                Simd::Avx512 => match mr {
                    1 => avx512::tile::<1, C>(&xs, &ws, k, next),
                    2 => avx512::tile::<2, C>(&xs, &ws, k, next),
                    3 => avx512::tile::<3, C>(&xs, &ws, k, next),
                    4 => avx512::tile::<4, C>(&xs, &ws, k, next),
                    5 => avx512::tile::<5, C>(&xs, &ws, k, next),
                    _ => avx512::tile::<6, C>(&xs, &ws, k, next),
                },
                #[cfg(target_arch = "x86_64")]
                Simd::Avx2 => match mr {
                    1 => avx2_tile::<f32, MR, 1, C>(&xs, &ws, k, next),
                    2 => avx2_tile::<f32, MR, 2, C>(&xs, &ws, k, next),
                    3 => avx2_tile::<f32, MR, 3, C>(&xs, &ws, k, next),
                    4 => avx2_tile::<f32, MR, 4, C>(&xs, &ws, k, next),
                    5 => avx2_tile::<f32, MR, 5, C>(&xs, &ws, k, next),
                    _ => avx2_tile::<f32, MR, 6, C>(&xs, &ws, k, next),
                },
                _ => scalar_tile::<C>(&xs, mr, &ws, k),
            };
            next = std::ptr::null();
            for (i, row) in tile.iter().enumerate().take(mr) {
                let dst = out.slice((r + i) * ldo + j, nc);
                dst.copy_from_slice(&row[..nc]);
            }
            r += mr;
        }
        j += nc;
    }
}

/// The sums in plain Rust (any CPU): per output, 16 partial sums over the keys in
/// order (the AVX-512 path's lanes), added up at the end.
unsafe fn scalar_tile<const C: usize>(
    xs: &[*const f32; MR],
    mr: usize,
    ws: &[*const f32; C],
    k: usize,
) -> Tile<C> {
    let mut tile = [[0.0f32; C]; MR];
    for (i, row) in tile.iter_mut().enumerate().take(mr) {
        let xr = std::slice::from_raw_parts(xs[i], k);
        for (c, v) in row.iter_mut().enumerate() {
            let wr = std::slice::from_raw_parts(ws[c], k);
            let mut acc = [0.0f32; 16];
            for (t, (a, b)) in xr.iter().zip(wr).enumerate() {
                acc[t % 16] += a * b;
            }
            *v = acc.iter().sum();
        }
    }
    tile
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{Tile, MR};
    use crate::row_tiles::x86::lane_sums;
    use std::arch::x86_64::*;

    /// `R` rows of `x` against the `C` weight rows over all `k`: 16 keys per step,
    /// the last partial step masked. `next` (unless null): the start of the `C k`
    /// floats to prefetch into L2, `C` lines per step, so that they are all asked for
    /// by the end of the tile.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn tile<const R: usize, const C: usize>(
        xs: &[*const f32; MR],
        ws: &[*const f32; C],
        k: usize,
        next: *const f32,
    ) -> Tile<C> {
        let mut acc = [[_mm512_setzero_ps(); C]; R];
        let mut kk = 0;
        while kk + 16 <= k {
            if !next.is_null() {
                for c in 0..C {
                    _mm_prefetch::<_MM_HINT_T1>(next.wrapping_add(C * kk + 16 * c) as *const i8);
                }
            }
            let wv: [__m512; C] = std::array::from_fn(|c| _mm512_loadu_ps(ws[c].add(kk)));
            for i in 0..R {
                let xv = _mm512_loadu_ps(xs[i].add(kk));
                for c in 0..C {
                    acc[i][c] = _mm512_fmadd_ps(xv, wv[c], acc[i][c]);
                }
            }
            kk += 16;
        }
        if kk < k {
            let mask: __mmask16 = (1u32 << (k - kk)) as u16 - 1;
            let wv: [__m512; C] =
                std::array::from_fn(|c| _mm512_maskz_loadu_ps(mask, ws[c].add(kk)));
            for i in 0..R {
                let xv = _mm512_maskz_loadu_ps(mask, xs[i].add(kk));
                for c in 0..C {
                    acc[i][c] = _mm512_fmadd_ps(xv, wv[c], acc[i][c]);
                }
            }
        }
        lane_sums(&acc)
    }

    /// What [`tile`] computes, for `R` (1 or 2) rows of `x`, reading the `C` weight
    /// rows one after another (memory order): the same accumulators and additions,
    /// one sequential read of the block that the hardware prefetcher follows without
    /// software prefetch (see `crate::matmul_bf16`).
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn in_order<const R: usize, const C: usize>(
        xs: &[*const f32; MR],
        ws: &[*const f32; C],
        k: usize,
    ) -> Tile<C> {
        let mut acc = [[_mm512_setzero_ps(); C]; R];
        for c in 0..C {
            let w = ws[c];
            let mut a = [_mm512_setzero_ps(); R];
            let mut kk = 0;
            while kk + 16 <= k {
                let wv = _mm512_loadu_ps(w.add(kk));
                for i in 0..R {
                    a[i] = _mm512_fmadd_ps(_mm512_loadu_ps(xs[i].add(kk)), wv, a[i]);
                }
                kk += 16;
            }
            if kk < k {
                let mask: __mmask16 = (1u32 << (k - kk)) as u16 - 1;
                let wv = _mm512_maskz_loadu_ps(mask, w.add(kk));
                for i in 0..R {
                    a[i] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, xs[i].add(kk)), wv, a[i]);
                }
            }
            for i in 0..R {
                acc[i][c] = a[i];
            }
        }
        lane_sums(&acc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every path this CPU runs against the float64 sum, for row counts around the
    /// register blocks, partial weight blocks and tasks, `K` with and without a
    /// partial 16-key (and 8-key) step, and a row-strided `x`.
    #[test]
    fn every_path_matches_the_f64_sum() {
        for (m, k, n) in [
            (1usize, 7usize, 1usize),
            (1, 64, 16),
            (1, 768, 200),
            (2, 70, 19),
            (2, 1100, 50),
            (3, 33, 5),
            (5, 100, 37),
            (9, 512, 70),
            (4, 1031, 133),
            (17, 300, 65),
        ] {
            let ld = k + 5;
            let x: Vec<f32> = (0..m * ld)
                .map(|i| ((i * 7 % 29) as f32 - 14.0) / 9.0)
                .collect();
            let w: Vec<f32> = (0..n * k)
                .map(|i| ((i * 11 % 31) as f32 - 15.0) / 13.0)
                .collect();
            let xr = Rows::new(&x, m, k, ld).unwrap();
            for simd in [Simd::Scalar, Simd::Avx2, Simd::Avx512] {
                if !simd.supported() {
                    continue;
                }
                let mut out = vec![f32::NAN; m * n];
                matmul_rows_with(simd, xr, &w, n, &mut out).unwrap();
                for r in 0..m {
                    for c in 0..n {
                        let want: f64 = (0..k)
                            .map(|kk| x[r * ld + kk] as f64 * w[c * k + kk] as f64)
                            .sum();
                        let got = out[r * n + c] as f64;
                        assert!(
                            (got - want).abs() <= 1e-5 * (k as f64).sqrt() * (1.0 + want.abs()),
                            "{simd:?} m={m} k={k} n={n} at {r},{c}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_row_gets_the_same_bits_alone_in_a_pair_or_in_a_block() {
        // A sequence's products must not depend on what it is batched with.
        let (k, n) = (300usize, 2_100usize);
        let x: Vec<f32> = (0..16 * k)
            .map(|i| ((i * 7 % 29) as f32 - 14.0) / 9.0)
            .collect();
        let w: Vec<f32> = (0..k * n)
            .map(|i| ((i * 11 % 31) as f32 - 15.0) / 13.0)
            .collect();
        let mut all = vec![0.0f32; 16 * n];
        matmul_rows(Rows::dense(&x, k).unwrap(), &w, n, &mut all).unwrap();
        for m in [1usize, 2, 3, 5] {
            let mut few = vec![0.0f32; m * n];
            matmul_rows(Rows::dense(&x[..m * k], k).unwrap(), &w, n, &mut few).unwrap();
            assert_eq!(few, all[..m * n], "{m} rows");
        }
    }

    #[test]
    fn wrong_shapes_are_errors() {
        let x = vec![0.0f32; 6];
        let xr = Rows::dense(&x, 3).unwrap();
        let mut o = vec![0.0f32; 2 * 4];
        assert!(matmul_rows(xr, &[0.0; 11], 4, &mut o).is_err());
        let mut o = vec![0.0f32; 7];
        assert!(matmul_rows(xr, &[0.0; 12], 4, &mut o).is_err());
    }
}
