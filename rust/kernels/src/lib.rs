//! CPU kernels for the parts of a Qwen3.5 step that torch runs as storms of small ops.
//!
//! The GEMMs stay in torch (MKL/oneDNN are as good as it gets); what is here is the
//! work between them, which on a CPU is bound by memory traffic and per-op overhead,
//! not arithmetic:
//!
//! * [`delta_rule`]: the gated delta rule, token by token, reading and writing each
//!   sequence's recurrent state in place in the slot pool. Per token and value head the
//!   `K x V` state (4 KiB at 32 x 32) stays in L1, so a 2,048-token prefill costs a few
//!   passes over L1 per token instead of the chunked form's many small batched matmuls,
//!   and a decode step touches each state twice instead of gather + five ops + scatter.
//!   The gates (`beta = sigmoid(b)`, `g = -exp(A_log) softplus(a + dt_bias)`), the
//!   q/k l2-norm and the gated RMSNorm of the output are fused in.
//! * [`conv1d`]: the depthwise causal conv1d over a flattened varlen batch, with the
//!   conv state read from and written back to its slot and `silu` fused.
//! * [`matmul`]: `x W^T` for the few rows of a decode step, without BLAS's per-call
//!   repacking of the weight (stored transposed, `[K, N]`).
//! * [`matmul_rows`]: the same over a weight stored `[N, K]` (as checkpoints have it),
//!   read as dot products: one contiguous stream, the layout one or two rows (a lone
//!   sequence's decode, bound by reading the weight) need.
//! * [`moe`]: a whole sparse mixture-of-experts block (routing, tokens grouped by
//!   expert in one counting pass, every expert's GEMM pair on the few-row GEMM, the
//!   weighted scatter back), the shared expert fused in; [`moe_bf16`] the same for a
//!   bfloat16 model, on [`matmul_bf16`]'s inner kernel over the weights as stored.
//! * [`rope`]: attention's per-head q/k norm and rotary embedding in one pass.
//! * [`norm`]: RMSNorm with the residual add fused in.
//! * [`sample`]: a whole sampling step (processors, top-k/top-p/min-p, the seeded
//!   draw) per row in one reused buffer, the torch sampler's numbers.
//! * [`attention`]: decode attention (one query per sequence) straight from the paged
//!   KV pool through the block table, every query head of a KV group at once.
//!
//! A bfloat16 model runs the same code: every kernel but the float32 GEMMs is one loop
//! generic over [`bf16::Elem`] (float32 read in place, bfloat16 widened as read,
//! float32 arithmetic, outputs rounded once; the DeltaNet state stays float32), with
//! `*_bf16` entry points; [`matmul_bf16`] is the bfloat16 few-row GEMM.
//!
//! Every kernel is checked here against a scalar transcription of its formula and,
//! from Python, against the plain-PyTorch references (`hybridserve.kernels`), which
//! are the project's oracles. Work is split by sequence and head into tasks that never
//! share an output element, run on the host's OpenMP workers when it hands them over
//! ([`use_openmp`]: torch's, so the two never fight for cores) or on a rayon pool
//! (see `pool.rs`, and [`set_num_threads`]).

#![allow(clippy::manual_is_multiple_of)] // is_multiple_of needs Rust 1.87; the MSRV is 1.80

pub mod activation;
pub mod attention;
pub mod bf16;
pub mod cache_write;
pub mod conv1d;
pub mod delta_rule;
mod math;
pub mod matmul;
pub mod matmul_bf16;
pub mod matmul_rows;
pub mod moe;
pub mod moe_bf16;
pub mod mtp;
pub mod norm;
pub mod quant;
mod pool;
pub mod quant_fp8;
pub mod rope;
mod row_tiles;
pub mod sample;
pub mod token_bitmask;
mod topk;

pub use pool::{num_threads, set_num_threads, use_openmp, uses_openmp};
#[doc(hidden)]
pub use pool::panic_in_task as pool_panic_in_task;

/// A row-strided 2-D view: row `t` is `data[t * stride .. t * stride + width]`.
///
/// Lets a kernel read a column range of a wider buffer (e.g. `q` inside the fused
/// projection output) without a copy. `T` is `f32`, or `u16` for bfloat16 bits.
#[derive(Clone, Copy, Debug)]
pub struct Rows<'a, T = f32> {
    pub data: &'a [T],
    pub rows: usize,
    pub width: usize,
    pub stride: usize,
}

impl<'a, T> Rows<'a, T> {
    /// Checks that every row lies inside `data`.
    pub fn new(
        data: &'a [T],
        rows: usize,
        width: usize,
        stride: usize,
    ) -> Result<Self, KernelError> {
        if rows > 0 && (stride < width || (rows - 1) * stride + width > data.len()) {
            return Err(KernelError::new(format!(
                "a view of {rows} rows x {width} with row stride {stride} does not fit in {} elements",
                data.len()
            )));
        }
        Ok(Self {
            data,
            rows,
            width,
            stride,
        })
    }

    /// A dense `[rows, width]` buffer.
    pub fn dense(data: &'a [T], width: usize) -> Result<Self, KernelError> {
        if width == 0 || data.len() % width != 0 {
            return Err(KernelError::new(format!(
                "{} elements are not rows of {width}",
                data.len()
            )));
        }
        Self::new(data, data.len() / width, width, width)
    }

    #[inline(always)]
    pub fn row(&self, t: usize) -> &'a [T] {
        &self.data[t * self.stride..t * self.stride + self.width]
    }
}

/// Misuse of a kernel: shapes that do not agree, indices out of range. The message
/// says which argument and what was expected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelError(pub String);

impl KernelError {
    pub fn new(msg: impl Into<String>) -> Self {
        Self(msg.into())
    }
}

impl std::fmt::Display for KernelError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for KernelError {}

/// The varlen layout shared by the kernels: sequence `b` owns rows
/// `query_start_loc[b]..query_start_loc[b + 1]` of a `T`-row batch.
#[derive(Clone, Copy, Debug)]
pub struct Varlen<'a> {
    pub query_start_loc: &'a [i64],
    pub has_initial_state: &'a [bool],
}

impl Varlen<'_> {
    pub fn num_seqs(&self) -> usize {
        self.has_initial_state.len()
    }

    /// Checks offsets (rising from 0 to `t`) and lengths.
    pub fn validate(&self, t: usize) -> Result<(), KernelError> {
        let b = self.has_initial_state.len();
        if self.query_start_loc.len() != b + 1 {
            return Err(KernelError::new(format!(
                "query_start_loc must have B+1 = {} entries (B from has_initial_state); got {}",
                b + 1,
                self.query_start_loc.len()
            )));
        }
        let qsl = self.query_start_loc;
        if qsl[0] != 0 || qsl[b] as usize != t || qsl.windows(2).any(|w| w[0] > w[1]) {
            return Err(KernelError::new(format!(
                "query_start_loc must rise from 0 to T = {t}"
            )));
        }
        Ok(())
    }

    #[inline]
    pub fn run(&self, b: usize) -> (usize, usize) {
        (
            self.query_start_loc[b] as usize,
            self.query_start_loc[b + 1] as usize,
        )
    }
}

/// Where each sequence's state items live in a paged pool (the arena), and where its
/// checkpoint goes, if any.
///
/// The pool is `num_pages` pages `page_stride` elements apart, each holding `per_page`
/// items of `item_len` elements. Sequence `b`'s item `h` (a value head of the layer's
/// recurrent state, or its conv state) is item `i = item_base + h`, at page
/// `table[b * cols + i / per_page]`, slot `i % per_page`: the state page table row
/// plus the layer's first item, the same arithmetic as `hybridserve.kernels.state_pages`.
#[derive(Clone, Copy, Debug)]
pub struct PagedState<'a> {
    /// `[B, cols]` page ids (the step's rows of the state page table).
    pub table: &'a [i64],
    pub cols: usize,
    pub item_base: usize,
    pub per_page: usize,
    pub page_stride: usize,
    pub item_len: usize,
    pub num_pages: usize,
    /// `[B]`: `k >= 1` = also write the state after the run's first `k` tokens at the
    /// same items of `checkpoint_table[b]`; `-1` = none. Empty = no checkpoints.
    pub checkpoint_positions: &'a [i64],
    /// `[B, cols]`, read only where `checkpoint_positions[b] >= 0`.
    pub checkpoint_table: &'a [i64],
    /// `[B]`: `true` = sequence `b` reads its state from its items but never writes them
    /// back (a speculative verify run: the state advances only once acceptance is known,
    /// by a replay of the accepted rows). Empty = every run writes its state.
    pub read_only: &'a [bool],
}

impl<'a> PagedState<'a> {
    /// Items from `item_base` of the pages that `table` (`[B, cols]`) names, in a pool of
    /// `num_pages` pages `page_stride` elements apart, each holding `per_page` items of
    /// `item_len` elements; no checkpoints, and every run writes its state back.
    pub fn plain(
        table: &'a [i64],
        cols: usize,
        item_base: usize,
        (num_pages, per_page, page_stride, item_len): (usize, usize, usize, usize),
    ) -> Self {
        PagedState {
            table,
            cols,
            item_base,
            per_page,
            page_stride,
            item_len,
            num_pages,
            checkpoint_positions: &[],
            checkpoint_table: &[],
            read_only: &[],
        }
    }
}

impl PagedState<'_> {
    #[inline(always)]
    fn at(&self, table: &[i64], b: usize, h: usize) -> usize {
        let i = self.item_base + h;
        table[b * self.cols + i / self.per_page] as usize * self.page_stride
            + (i % self.per_page) * self.item_len
    }

    /// Element offset of sequence `b`'s item `h` in the pool.
    #[inline(always)]
    pub fn item(&self, b: usize, h: usize) -> usize {
        self.at(self.table, b, h)
    }

    /// Whether sequence `b` leaves its state items untouched (see `read_only`).
    #[inline(always)]
    pub fn is_read_only(&self, b: usize) -> bool {
        self.read_only.get(b).copied().unwrap_or(false)
    }

    /// `(k, offset)`: the checkpoint of sequence `b`'s item `h`, if it has one.
    #[inline(always)]
    pub fn checkpoint(&self, b: usize, h: usize) -> Option<(usize, usize)> {
        match self.checkpoint_positions.get(b) {
            Some(&k) if k >= 0 => Some((k as usize, self.at(self.checkpoint_table, b, h))),
            _ => None,
        }
    }

    /// Checks shapes, page ids (in `0..num_pages`), checkpoint positions (in
    /// `1..=len`) and that no page is written by two runs of the call (items of
    /// `0..n_items` for every run with rows, their checkpoints too): tasks write their
    /// items without locks. `pool_len`: elements of the pool slice.
    pub fn validate(
        &self,
        varlen: &Varlen<'_>,
        n_items: usize,
        pool_len: usize,
    ) -> Result<(), KernelError> {
        let b = varlen.num_seqs();
        if self.per_page == 0 || self.item_len == 0 || self.table.len() != b * self.cols {
            return Err(KernelError::new(format!(
                "the state page table must be [B={b}, {}] and pages hold at least one item; got {} entries",
                self.cols,
                self.table.len()
            )));
        }
        if self.num_pages > 0
            && ((self.num_pages - 1) * self.page_stride + self.per_page * self.item_len > pool_len
                || self.page_stride < self.per_page * self.item_len)
        {
            return Err(KernelError::new(format!(
                "a pool of {} pages x {} items of {} (page stride {}) does not fit in {pool_len} elements",
                self.num_pages, self.per_page, self.item_len, self.page_stride
            )));
        }
        let has_ckpt = !self.checkpoint_positions.is_empty();
        if has_ckpt
            && (self.checkpoint_positions.len() != b
                || self.checkpoint_table.len() != b * self.cols)
        {
            return Err(KernelError::new(format!(
                "checkpoint positions must be [B={b}] and checkpoint pages [B, {}]",
                self.cols
            )));
        }
        if !self.read_only.is_empty() && self.read_only.len() != b {
            return Err(KernelError::new(format!(
                "read_only must be [B={b}], got {} entries",
                self.read_only.len()
            )));
        }
        if has_ckpt {
            if let Some(s) = (0..b).find(|&s| self.is_read_only(s) && self.checkpoint_positions[s] >= 0) {
                return Err(KernelError::new(format!(
                    "sequence {s} is read-only (speculative) and asks for a checkpoint: checkpoints are \
                     written only at accepted positions"
                )));
            }
        }
        let first = self.item_base / self.per_page;
        let last = (self.item_base + n_items.max(1) - 1) / self.per_page;
        if last >= self.cols {
            return Err(KernelError::new(format!(
                "items {}..{} need {} columns of the state page table; it has {}",
                self.item_base,
                self.item_base + n_items,
                last + 1,
                self.cols
            )));
        }
        let mut used: Vec<i64> = Vec::with_capacity(2 * b * (last - first + 1));
        for s in 0..b {
            let (start, end) = varlen.run(s);
            if end == start {
                continue;
            }
            let mut rows: [Option<&[i64]>; 2] = [Some(self.table), None];
            if has_ckpt {
                let k = self.checkpoint_positions[s];
                if k >= 0 {
                    if k < 1 || k as usize > end - start {
                        return Err(KernelError::new(format!(
                            "checkpoint position {k} of sequence {s} must lie in 1..={}",
                            end - start
                        )));
                    }
                    rows[1] = Some(self.checkpoint_table);
                }
            }
            for table in rows.into_iter().flatten() {
                for col in first..=last {
                    let p = table[s * self.cols + col];
                    if p < 0 || p as usize >= self.num_pages {
                        return Err(KernelError::new(format!(
                            "sequence {s} names state page {p}, outside 0..{}",
                            self.num_pages
                        )));
                    }
                    used.push(p);
                }
            }
        }
        used.sort_unstable();
        if let Some(w) = used.windows(2).find(|w| w[0] == w[1]) {
            return Err(KernelError::new(format!(
                "state page {} is written by two runs (or a run and a checkpoint) of one step",
                w[0]
            )));
        }
        Ok(())
    }
}

/// A raw pointer that tasks of one kernel call share to write disjoint elements
/// (`f32`, or `u16` bfloat16 bits).
pub(crate) struct SharedMut<T = f32>(*mut T);
impl<T> Clone for SharedMut<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SharedMut<T> {}
unsafe impl<T> Send for SharedMut<T> {}
unsafe impl<T> Sync for SharedMut<T> {}

impl<T> SharedMut<T> {
    pub(crate) fn new(s: &mut [T]) -> Self {
        Self(s.as_mut_ptr())
    }

    /// The pointer `at` elements further on.
    ///
    /// # Safety
    /// `at` must lie within the slice this was made from.
    #[inline(always)]
    pub(crate) unsafe fn add(self, at: usize) -> Self {
        Self(self.0.add(at))
    }

    /// # Safety
    /// `at..at + len` must lie in the slice this was made from, and no other task may
    /// touch those elements during the call.
    #[inline(always)]
    pub(crate) unsafe fn slice<'a>(self, at: usize, len: usize) -> &'a mut [T] {
        std::slice::from_raw_parts_mut(self.0.add(at), len)
    }
}
