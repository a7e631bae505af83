//! `y = x W^T` in bfloat16 for few rows (decode steps): bfloat16 activations times a
//! bfloat16 weight stored as checkpoints have it (`[N, K]` row-major, HF's layout),
//! summed in float32, written as float32 or rounded once to bfloat16.
//!
//! A decode step's GEMMs are bound by reading the weight, so halving its bytes is
//! most of the gain; the arithmetic uses `vdpbf16ps` where the CPU has AVX-512 BF16
//! (two products per float32 lane per instruction, no conversions), AVX2 FMAs on
//! widened values otherwise ([`Isa`]). Each output is a dot product of an `x` row and
//! a weight row, both contiguous along `K`: blocks of up to 4 rows x 4 weight rows
//! keep 16 vector accumulators in registers, the 4 weight rows (`4 K` values, 8 KiB at
//! `K = 1,024`) stay in L1 while every row block of `x` passes over them, and each
//! accumulator is summed across its lanes once at the end. No repacking of the
//! weight, so the same tensor serves torch's GEMM for prefill-sized chunks.
//!
//! One or two rows (a lone sequence's decode) only stream the weight, and there the
//! order of the loads decides the rate: with `vdpbf16ps` the kernel reads the weight
//! rows one after another, in memory order ([`avx512::in_order`]), so that the core's
//! own stream prefetcher runs ahead of a single sequential read. Reading 8 or 16 rows
//! side by side (as the float32 kernel does) leaves 8-16 interleaved streams that the
//! hardware does not follow; software prefetch of the next block recovers only part of
//! it (measured on this AMD EPYC, one thread, the 0.1B LM head: 19-20 GB/s side by
//! side, 26-28 GB/s in order, a plain sequential read 27-31 GB/s; benches/RESULTS.md,
//! "Issue 22: bfloat16 GEMV bandwidth"). Either way each output is one accumulator
//! over the keys in the same order, summed across lanes the same way, so a row's
//! result does not depend on how many rows share the call.

use crate::bf16::{from_f32, to_f32, Isa};
use crate::pool::for_each_task;
use crate::{KernelError, Rows};
#[cfg(target_arch = "x86_64")]
use crate::row_tiles::x86::avx2_tile;

/// Rows of `x` per register block: at most [`MR`] (the tile's size), on AVX2 and the
/// scalar path at most [`MR_AVX2`] (AVX2 has 16 vector registers, no room for
/// `5 x 4` accumulators). With AVX-512 a block of 5 rows keeps 20 accumulators, 4
/// weight vectors and one row vector in the 32 registers, so a speculative verify step
/// of 5 rows reads each weight block once instead of once for 4 rows and again for
/// the fifth (which then pays a whole tile's loads and lane sums for 4 outputs).
const MR: usize = 5;
const MR_AVX2: usize = 4;
/// Weight rows per register block.
const NR: usize = 4;
/// Weight rows per task: enough work to pay for claiming a task, small enough to
/// balance two or more threads on the narrowest projection of a model.
const ROWS_PER_TASK: usize = 32;
/// Weight rows per task for one or two rows of `x`: long sequential runs for the
/// stream prefetcher (and, on AVX2, a task's first block has no prefetch of its own),
/// while 6 tasks still split the narrowest projection (768 outputs). 256 and 512
/// measured no better at one thread.
const ROWS_PER_TASK_FEW: usize = 128;
/// How many blocks of weight rows ahead a block prefetches (into L2) where the weight
/// rows are read side by side (AVX2).
const PREFETCH_BLOCKS: usize = 1;
/// The same for the AVX-512 tiles of 3-5 rows (a speculative verify step). Between two
/// engine steps the weights leave the cache, so a step streams them from memory, and
/// one block ahead (4 rows of `K` values) hides too little of that latency
/// (benches/RESULTS.md, "The verify GEMM's prefetch distance").
const PREFETCH_BLOCKS_AVX512: usize = 4;
/// How many 32-key steps ahead, in the weight rows it is reading, an AVX-512 tile of
/// 3-5 rows also prefetches into L1 while it streams a block. The far prefetch above
/// brings the lines to L2; loads that still wait on L2 stall the tile's `vdpbf16ps`
/// (a 4-5-row step is as much arithmetic as memory time), and lines already in L1
/// let that arithmetic run under the stream (benches/RESULTS.md, "the near
/// prefetch").
const PREFETCH_NEAR_STEPS: usize = 8;

/// Where the products go: float32, or bfloat16 bits rounded to nearest even.
pub enum Out<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [u16]),
}

impl Out<'_> {
    fn len(&self) -> usize {
        match self {
            Out::F32(o) => o.len(),
            Out::Bf16(o) => o.len(),
        }
    }
}

/// The output as a raw pointer that tasks share to write disjoint columns (also the
/// fused MoE block's, [`crate::moe_bf16`], which runs [`columns`] per expert).
#[derive(Clone, Copy)]
pub(crate) enum OutPtr {
    F32(*mut f32),
    Bf16(*mut u16),
}
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// # Safety
    /// `at` must lie in the output, written by this task alone.
    #[inline(always)]
    pub(crate) unsafe fn put(self, at: usize, v: f32) {
        match self {
            OutPtr::F32(p) => *p.add(at) = v,
            OutPtr::Bf16(p) => *p.add(at) = from_f32(v),
        }
    }
}

/// `out[m, j] = sum_k x[m, k] * w[j, k]`: `x` `[M, K]` bfloat16 (row-strided view
/// allowed), `w` `[N, K]` bfloat16 row-major, `out` `[M, N]` row-major.
pub fn matmul_bf16(x: Rows<'_, u16>, w: &[u16], n: usize, out: Out<'_>) -> Result<(), KernelError> {
    matmul_bf16_with(Isa::detect(), x, w, n, out)
}

/// [`matmul_bf16`] with the instruction set chosen by the caller (tests and benches
/// run every path this CPU supports); `KernelError` if the CPU lacks it.
pub fn matmul_bf16_with(
    isa: Isa,
    x: Rows<'_, u16>,
    w: &[u16],
    n: usize,
    mut out: Out<'_>,
) -> Result<(), KernelError> {
    let (m, k) = (x.rows, x.width);
    if n == 0 || k == 0 || w.len() != n * k || out.len() != m * n {
        return Err(KernelError::new(format!(
            "w must be [N={n}, K={k}] and out [M={m}, N={n}]; got {} and {} elements",
            w.len(),
            out.len()
        )));
    }
    if !isa.supported() {
        return Err(KernelError::new(format!(
            "this CPU cannot run the {} kernels",
            isa.name()
        )));
    }
    let ptr = match &mut out {
        Out::F32(o) => OutPtr::F32(o.as_mut_ptr()),
        Out::Bf16(o) => OutPtr::Bf16(o.as_mut_ptr()),
    };
    let per_task = if m <= 2 { ROWS_PER_TASK_FEW } else { ROWS_PER_TASK };
    let tasks = n.div_ceil(per_task);
    for_each_task(tasks, m * n * k, |t| {
        let (j0, j1) = (t * per_task, ((t + 1) * per_task).min(n));
        // SAFETY: output columns j0..j1 of every row belong to this task alone; the
        // ISA was checked above.
        unsafe { columns(isa, &x, w, j0, j1, ptr, n, j0) };
    });
    Ok(())
}

/// Output columns `j0..j1` of every row: blocks of [`NR`] weight rows x [`MR`] rows,
/// or, for one or two rows (a lone sequence's decode, memory-bound), of `2 NR` weight
/// rows: with AVX-512 BF16 read in order (the block only sets how many lane sums are
/// done together; 16 measured no faster and spills at two rows), on AVX2 side by side
/// with the next block prefetched (8 loads and accumulators in flight per step; AVX2's
/// 16 registers hold no more).
///
/// # Safety
/// `isa` must be supported; `w` must hold rows `j0..j1` of `x.width` values; `out` must
/// hold `x.rows` rows of `ldo` values, of which columns `oc..oc + j1 - j0` (where
/// weight rows `j0..j1` go: `oc = j0` for a full output) are this caller's alone.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn columns(
    isa: Isa,
    x: &Rows<'_, u16>,
    w: &[u16],
    j0: usize,
    j1: usize,
    out: OutPtr,
    ldo: usize,
    oc: usize,
) {
    match x.rows {
        1 | 2 => columns_of::<{ 2 * NR }>(isa, x, w, j0, j1, out, ldo, oc),
        _ => columns_of::<NR>(isa, x, w, j0, j1, out, ldo, oc),
    }
}

#[allow(clippy::too_many_arguments)]
unsafe fn columns_of<const C: usize>(
    isa: Isa,
    x: &Rows<'_, u16>,
    w: &[u16],
    j0: usize,
    j1: usize,
    out: OutPtr,
    ldo: usize,
    oc: usize,
) {
    let k = x.width;
    let mut j = j0;
    while j < j1 {
        let nc = (j1 - j).min(C);
        // A partial block repeats its last weight row (computed, not stored).
        let ws: [*const u16; C] = std::array::from_fn(|c| w.as_ptr().add((j + c.min(nc - 1)) * k));
        // The next block's `C K` values follow this block's in memory: a tile that
        // reads the weight rows side by side prefetches them into L2 as it goes, from
        // its first row block (see `crate::matmul_rows`).
        let ahead = if matches!(isa, Isa::Avx512Bf16) { PREFETCH_BLOCKS_AVX512 } else { PREFETCH_BLOCKS };
        let mut next = w.as_ptr().wrapping_add((j + ahead * C) * k);
        let block = if matches!(isa, Isa::Avx512Bf16) { MR } else { MR_AVX2 };
        let mut r = 0;
        while r < x.rows {
            let mr = (x.rows - r).min(block);
            let xs: [*const u16; MR] = std::array::from_fn(|i| x.row(r + i.min(mr - 1)).as_ptr());
            let tile: Tile<C> = match isa {
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512Bf16 if x.rows <= 2 => match mr {
                    1 => avx512::in_order::<1, C>(&xs, &ws, k),
                    _ => avx512::in_order::<2, C>(&xs, &ws, k),
                },
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512Bf16 => match mr {
                    1 => avx512::tile::<1, C>(&xs, &ws, k, next),
                    2 => avx512::tile::<2, C>(&xs, &ws, k, next),
                    3 => avx512::tile::<3, C>(&xs, &ws, k, next),
                    4 => avx512::tile::<4, C>(&xs, &ws, k, next),
                    _ => avx512::tile::<5, C>(&xs, &ws, k, next),
                },
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => match mr {
                    1 => avx2_tile::<u16, MR, 1, C>(&xs, &ws, k, next),
                    2 => avx2_tile::<u16, MR, 2, C>(&xs, &ws, k, next),
                    3 => avx2_tile::<u16, MR, 3, C>(&xs, &ws, k, next),
                    _ => avx2_tile::<u16, MR, 4, C>(&xs, &ws, k, next),
                },
                _ => scalar_tile::<C>(&xs, mr, &ws, k),
            };
            next = std::ptr::null();
            let at = (r * ldo + oc + (j - j0), ldo);
            match isa {
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512Bf16 => avx512::put(out, &tile, mr, nc, at),
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => put_avx2(out, &tile, mr, nc, at),
                _ => put_tile(out, &tile, mr, nc, at),
            }
            r += mr;
        }
        j += nc;
    }
}

type Tile<const C: usize> = [[f32; C]; MR];

/// Rows `0..mr`, columns `0..nc` of `tile` to the output from element `at`, rows `ldo`
/// apart. The element type is matched once per tile, and a full row of the tile is a
/// fixed-length loop the compiler turns into vector stores (and, for bfloat16, vector
/// rounding): the same [`from_f32`] per value as element by element. Compiled into the
/// caller, so the vector rounding needs a caller built for the CPU's vector features
/// (`avx512::put`, [`put_avx2`]): in baseline x86-64 code the rounding of a tile row
/// runs value by value, a cost of the order of the tile's own arithmetic at 3-5 rows
/// and small `K` (benches/RESULTS.md, "The bfloat16 GEMM's output rounding").
///
/// # Safety
/// As for [`OutPtr::put`], for every element written.
#[inline(always)]
unsafe fn put_tile<const C: usize>(out: OutPtr, tile: &Tile<C>, mr: usize, nc: usize, (at, ldo): (usize, usize)) {
    match out {
        OutPtr::F32(p) => {
            for (i, row) in tile.iter().enumerate().take(mr) {
                let d = p.add(at + i * ldo);
                if nc == C {
                    for (c, &v) in row.iter().enumerate() {
                        *d.add(c) = v;
                    }
                } else {
                    for (c, &v) in row.iter().enumerate().take(nc) {
                        *d.add(c) = v;
                    }
                }
            }
        }
        OutPtr::Bf16(p) => {
            for (i, row) in tile.iter().enumerate().take(mr) {
                let d = p.add(at + i * ldo);
                if nc == C {
                    let mut bits = [0u16; C];
                    for (b, &v) in bits.iter_mut().zip(row) {
                        *b = from_f32(v);
                    }
                    std::ptr::copy_nonoverlapping(bits.as_ptr(), d, C);
                } else {
                    for (c, &v) in row.iter().enumerate().take(nc) {
                        *d.add(c) = from_f32(v);
                    }
                }
            }
        }
    }
}

/// [`put_tile`] compiled for AVX2 (the tile it writes came from the AVX2 path).
///
/// # Safety
/// As for [`put_tile`]; the CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn put_avx2<const C: usize>(out: OutPtr, tile: &Tile<C>, mr: usize, nc: usize, at: (usize, usize)) {
    put_tile(out, tile, mr, nc, at)
}

/// The sums in plain Rust (any CPU; the reference order of the other paths' lanes
/// does not matter: float32 sums of at most `K` products).
unsafe fn scalar_tile<const C: usize>(
    xs: &[*const u16; MR],
    mr: usize,
    ws: &[*const u16; C],
    k: usize,
) -> Tile<C> {
    let mut tile = [[0.0f32; C]; MR];
    for (i, row) in tile.iter_mut().enumerate().take(mr) {
        let xr = std::slice::from_raw_parts(xs[i], k);
        for (c, v) in row.iter_mut().enumerate() {
            let wr = std::slice::from_raw_parts(ws[c], k);
            let mut acc = [0.0f32; 8];
            let (cx, cw) = (xr.chunks_exact(8), wr.chunks_exact(8));
            let mut tail = 0.0f32;
            for (a, b) in cx.remainder().iter().zip(cw.remainder()) {
                tail += to_f32(*a) * to_f32(*b);
            }
            for (a, b) in cx.zip(cw) {
                for l in 0..8 {
                    acc[l] += to_f32(a[l]) * to_f32(b[l]);
                }
            }
            *v = acc.iter().sum::<f32>() + tail;
        }
    }
    tile
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{put_tile, OutPtr, Tile, MR, PREFETCH_NEAR_STEPS};
    use crate::row_tiles::x86::lane_sums;
    use std::arch::x86_64::*;

    /// [`super::put_tile`] compiled for AVX-512 (the tile came from this module).
    ///
    /// # Safety
    /// As for [`super::put_tile`]; the CPU must have AVX-512 BF16.
    /// A whole tile's bfloat16 rows are rounded four values per instruction
    /// ([`round4`]: [`super::from_f32`]'s arithmetic, lane by lane).
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn put<const C: usize>(
        out: OutPtr,
        tile: &Tile<C>,
        mr: usize,
        nc: usize,
        (at, ldo): (usize, usize),
    ) {
        match out {
            OutPtr::Bf16(p) if nc == C && C % 4 == 0 => {
                for (i, row) in tile.iter().enumerate().take(mr) {
                    let d = p.add(at + i * ldo);
                    for c in (0..C).step_by(4) {
                        let r = round4(_mm_loadu_ps(row.as_ptr().add(c)));
                        _mm_storel_epi64(d.add(c) as *mut __m128i, _mm_packus_epi32(r, r));
                    }
                }
            }
            _ => put_tile(out, tile, mr, nc, (at, ldo)),
        }
    }

    /// Four float32 to bfloat16 bits (in the low halves of the 32-bit lanes), rounded to
    /// nearest even, NaN to 0x7fc0: [`super::from_f32`] lane by lane.
    #[inline(always)]
    pub(super) unsafe fn round4(v: __m128) -> __m128i {
        let bits = _mm_castps_si128(v);
        let lsb = _mm_and_si128(_mm_srli_epi32::<16>(bits), _mm_set1_epi32(1));
        let bias = _mm_add_epi32(lsb, _mm_set1_epi32(0x7fff));
        let rounded = _mm_srli_epi32::<16>(_mm_add_epi32(bits, bias));
        let nan = _mm_castps_si128(_mm_cmpunord_ps(v, v));
        _mm_blendv_epi8(rounded, _mm_set1_epi32(0x7fc0), nan)
    }

    #[inline(always)]
    unsafe fn load(p: *const u16) -> __m512bh {
        std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(p as *const _))
    }

    #[inline(always)]
    unsafe fn load_tail(p: *const u16, mask: __mmask32) -> __m512bh {
        std::mem::transmute::<__m512i, __m512bh>(_mm512_maskz_loadu_epi16(mask, p as *const i16))
    }

    /// `R` rows of `x` against the `C` weight rows over all `k`: 32 keys per step
    /// (`vdpbf16ps` adds 16 pairs of products), the last partial step masked. `next`
    /// (unless null: the block is streamed, not already cached): the `C k` values to
    /// prefetch into L2, one line (32 values) per weight row per step, and the block's
    /// own lines [`PREFETCH_NEAR_STEPS`] steps ahead into L1.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn tile<const R: usize, const C: usize>(
        xs: &[*const u16; MR],
        ws: &[*const u16; C],
        k: usize,
        next: *const u16,
    ) -> Tile<C> {
        let mut acc = [[_mm512_setzero_ps(); C]; R];
        let mut kk = 0;
        while kk + 32 <= k {
            if !next.is_null() {
                for (c, w) in ws.iter().enumerate() {
                    _mm_prefetch::<_MM_HINT_T1>(next.wrapping_add(C * kk + 32 * c) as *const i8);
                    // (Past a row's end this reads ahead into the next row: harmless.)
                    _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add(kk + 32 * PREFETCH_NEAR_STEPS) as *const i8);
                }
            }
            let wv: [__m512bh; C] = std::array::from_fn(|c| load(ws[c].add(kk)));
            for i in 0..R {
                let xv = load(xs[i].add(kk));
                for c in 0..C {
                    acc[i][c] = _mm512_dpbf16_ps(acc[i][c], xv, wv[c]);
                }
            }
            kk += 32;
        }
        if kk < k {
            let mask: __mmask32 = (1u32 << (k - kk)) - 1;
            let wv: [__m512bh; C] = std::array::from_fn(|c| load_tail(ws[c].add(kk), mask));
            for i in 0..R {
                let xv = load_tail(xs[i].add(kk), mask);
                for c in 0..C {
                    acc[i][c] = _mm512_dpbf16_ps(acc[i][c], xv, wv[c]);
                }
            }
        }
        lane_sums(&acc)
    }

    /// What [`tile`] computes, for `R` (1 or 2) rows of `x`, reading the `C` weight
    /// rows one after another: each weight row's keys in order, 32 per step, the
    /// last partial step masked, into `R` accumulators that then wait in registers
    /// for the lane sums. The same accumulators and additions as [`tile`] (so the
    /// same bits); only the order of the loads differs: one sequential read of the
    /// block instead of `C` interleaved ones, which the hardware prefetcher follows
    /// without software prefetch (the out-of-order core overlaps one row's chain of
    /// `K / 32` dependent `vdpbf16ps` with the next row's).
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn in_order<const R: usize, const C: usize>(
        xs: &[*const u16; MR],
        ws: &[*const u16; C],
        k: usize,
    ) -> Tile<C> {
        let mut acc = [[_mm512_setzero_ps(); C]; R];
        for c in 0..C {
            let w = ws[c];
            let mut a = [_mm512_setzero_ps(); R];
            let mut kk = 0;
            while kk + 32 <= k {
                let wv = load(w.add(kk));
                for i in 0..R {
                    a[i] = _mm512_dpbf16_ps(a[i], load(xs[i].add(kk)), wv);
                }
                kk += 32;
            }
            if kk < k {
                let mask: __mmask32 = (1u32 << (k - kk)) - 1;
                let wv = load_tail(w.add(kk), mask);
                for i in 0..R {
                    a[i] = _mm512_dpbf16_ps(a[i], load_tail(xs[i].add(kk), mask), wv);
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

    fn bf(v: f32) -> u16 {
        from_f32(v)
    }

    /// Every path this CPU runs, against the float64 sum of the same bfloat16 values,
    /// for row counts around the register block, partial weight blocks and tasks,
    /// and `K` with and without a partial 32-key (and 8-key) step.
    #[test]
    fn every_path_matches_the_f64_sum_of_the_bf16_values() {
        let isas = [Isa::Scalar, Isa::Avx2, Isa::Avx512Bf16];
        for (m, k, n) in [
            (1usize, 7usize, 1usize),
            (1, 64, 16),
            (1, 768, 299),
            (2, 70, 19),
            (2, 1031, 133),
            (3, 33, 5),
            (5, 100, 37),
            (9, 512, 70),
            (4, 1031, 33),
        ] {
            let ld = k + 5;
            let x: Vec<u16> = (0..m * ld)
                .map(|i| bf(((i * 7 % 29) as f32 - 14.0) / 9.0))
                .collect();
            let w: Vec<u16> = (0..n * k)
                .map(|i| bf(((i * 11 % 31) as f32 - 15.0) / 13.0))
                .collect();
            let xr = Rows::new(&x, m, k, ld).unwrap();
            for isa in isas.into_iter().filter(|i| i.supported()) {
                let mut o32 = vec![f32::NAN; m * n];
                let mut o16 = vec![0u16; m * n];
                matmul_bf16_with(isa, xr, &w, n, Out::F32(&mut o32)).unwrap();
                matmul_bf16_with(isa, xr, &w, n, Out::Bf16(&mut o16)).unwrap();
                for r in 0..m {
                    for c in 0..n {
                        let want: f64 = (0..k)
                            .map(|kk| to_f32(x[r * ld + kk]) as f64 * to_f32(w[c * k + kk]) as f64)
                            .sum();
                        let got = o32[r * n + c] as f64;
                        assert!(
                            (got - want).abs() <= 1e-5 * (k as f64).sqrt() * (1.0 + want.abs()),
                            "{isa:?} m={m} k={k} n={n} at {r},{c}: {got} vs {want}"
                        );
                        // bfloat16 output = the float32 result rounded once.
                        assert_eq!(o16[r * n + c], from_f32(o32[r * n + c]), "{isa:?} bf16 out");
                    }
                }
            }
        }
    }

    /// A sequence's products must not depend on what it is batched with: one and two
    /// rows (read in memory order with AVX-512 BF16) give the bits that the same rows
    /// get inside a block of 16, as do 3-9 rows (one register block of 4 or 5 rows, or
    /// a block and a remainder), on every path; `K` with a partial 32-key step, `N`
    /// over several tasks with a partial block.
    #[test]
    fn a_row_gets_the_same_bits_alone_in_a_pair_or_in_a_block() {
        let (k, n) = (300usize, 2_101usize);
        let x: Vec<u16> = (0..16 * k)
            .map(|i| bf(((i * 7 % 29) as f32 - 14.0) / 9.0))
            .collect();
        let w: Vec<u16> = (0..n * k)
            .map(|i| bf(((i * 11 % 31) as f32 - 15.0) / 13.0))
            .collect();
        for isa in [Isa::Scalar, Isa::Avx2, Isa::Avx512Bf16] {
            if !isa.supported() {
                continue;
            }
            let mut all = vec![0.0f32; 16 * n];
            let xr = Rows::dense(&x, k).unwrap();
            matmul_bf16_with(isa, xr, &w, n, Out::F32(&mut all)).unwrap();
            for m in [1usize, 2, 3, 4, 5, 6, 9] {
                let mut few = vec![0.0f32; m * n];
                let xr = Rows::dense(&x[..m * k], k).unwrap();
                matmul_bf16_with(isa, xr, &w, n, Out::F32(&mut few)).unwrap();
                let same = few.iter().zip(&all).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{isa:?}: {m} rows differ from the same rows in a block of 16");
            }
        }
    }

    /// The AVX-512 tile's bfloat16 rounding, four lanes at once, against [`from_f32`]:
    /// ties both ways, the largest values, infinities, NaNs, zeros, subnormals.
    #[test]
    fn the_vector_rounding_is_from_f32_lane_by_lane() {
        #[cfg(target_arch = "x86_64")]
        if Isa::Avx512Bf16.supported() {
            #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
            unsafe fn rounded(v: [f32; 4]) -> [u32; 4] {
                use std::arch::x86_64::*;
                let mut out = [0u32; 4];
                _mm_storeu_si128(out.as_mut_ptr() as *mut __m128i, avx512::round4(_mm_loadu_ps(v.as_ptr())));
                out
            }
            let mut values: Vec<f32> = vec![
                0.0, -0.0, 1.0, -1.0, f32::MAX, f32::MIN, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -f32::NAN,
                f32::MIN_POSITIVE, 1e-40, -1e-40, f32::from_bits(0x7f7f_ffff), f32::from_bits(0x3f80_8000),
                f32::from_bits(0x3f81_8000), f32::from_bits(0x3f80_8001), f32::from_bits(0x3f80_7fff),
                f32::from_bits(0xff80_0001), f32::from_bits(0x0000_8000),
            ];
            let mut seed = 12345u32;
            for _ in 0..4000 {
                seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                values.push(f32::from_bits(seed));
            }
            for chunk in values.chunks(4) {
                let mut v = [0.0f32; 4];
                v[..chunk.len()].copy_from_slice(chunk);
                let got = unsafe { rounded(v) };
                for (x, g) in v.iter().zip(got) {
                    assert_eq!(g, from_f32(*x) as u32, "{x:e} ({:#010x})", x.to_bits());
                }
            }
        }
    }

    #[test]
    fn this_cpu_runs_the_vdpbf16ps_path_when_it_has_avx512_bf16() {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx512bf16") && std::is_x86_feature_detected!("avx512bw")
        {
            assert_eq!(Isa::detect(), Isa::Avx512Bf16);
        }
    }

    #[test]
    fn wrong_shapes_are_errors() {
        let x = vec![0u16; 6];
        let xr = Rows::dense(&x, 3).unwrap();
        let mut o = vec![0.0f32; 2 * 4];
        assert!(matmul_bf16(xr, &[0u16; 11], 4, Out::F32(&mut o)).is_err());
        let mut o = vec![0.0f32; 7];
        assert!(matmul_bf16(xr, &[0u16; 12], 4, Out::F32(&mut o)).is_err());
    }
}
