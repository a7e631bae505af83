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
//!   repacking of the weight.
//! * [`moe`]: a whole sparse mixture-of-experts block (routing, tokens grouped by
//!   expert in one counting pass, every expert's GEMM pair on the few-row GEMM, the
//!   weighted scatter back), the shared expert fused in.
//! * [`rope`]: attention's per-head q/k norm and rotary embedding in one pass.
//! * [`norm`]: RMSNorm with the residual add fused in.
//! * [`attention`]: decode attention (one query per sequence) straight from the paged
//!   KV pool through the block table, every query head of a KV group at once.
//!
//! Every kernel is checked here against a scalar transcription of its formula and,
//! from Python, against the plain-PyTorch references (`hybridserve.kernels`), which
//! are the project's oracles. Work is split by sequence and head into tasks that never
//! share an output element, run on the host's OpenMP workers when it hands them over
//! ([`use_openmp`]: torch's, so the two never fight for cores) or on a rayon pool
//! (see `pool.rs`, and [`set_num_threads`]).

#![allow(clippy::manual_is_multiple_of)] // is_multiple_of needs Rust 1.87; the MSRV is 1.80

pub mod attention;
pub mod conv1d;
pub mod delta_rule;
mod math;
pub mod matmul;
pub mod moe;
pub mod norm;
mod pool;
pub mod rope;

pub use pool::{num_threads, set_num_threads, use_openmp, uses_openmp};

/// A row-strided 2-D view: row `t` is `data[t * stride .. t * stride + width]`.
///
/// Lets a kernel read a column range of a wider buffer (e.g. `q` inside the fused
/// projection output) without a copy.
#[derive(Clone, Copy, Debug)]
pub struct Rows<'a> {
    pub data: &'a [f32],
    pub rows: usize,
    pub width: usize,
    pub stride: usize,
}

impl<'a> Rows<'a> {
    /// Checks that every row lies inside `data`.
    pub fn new(
        data: &'a [f32],
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
    pub fn dense(data: &'a [f32], width: usize) -> Result<Self, KernelError> {
        if width == 0 || data.len() % width != 0 {
            return Err(KernelError::new(format!(
                "{} elements are not rows of {width}",
                data.len()
            )));
        }
        Self::new(data, data.len() / width, width, width)
    }

    #[inline(always)]
    pub fn row(&self, t: usize) -> &'a [f32] {
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
    pub state_slots: &'a [i64],
    pub has_initial_state: &'a [bool],
}

impl Varlen<'_> {
    pub fn num_seqs(&self) -> usize {
        self.state_slots.len()
    }

    /// Checks offsets (rising from 0 to `t`), slots (in `0..num_slots`, distinct among
    /// sequences that run: two runs writing one slot would race) and lengths.
    pub fn validate(&self, t: usize, num_slots: usize) -> Result<(), KernelError> {
        let b = self.state_slots.len();
        if self.query_start_loc.len() != b + 1 || self.has_initial_state.len() != b {
            return Err(KernelError::new(format!(
                "query_start_loc must have B+1 = {} entries and has_initial_state B = {b}; got {} and {}",
                b + 1,
                self.query_start_loc.len(),
                self.has_initial_state.len()
            )));
        }
        let qsl = self.query_start_loc;
        if qsl[0] != 0 || qsl[b] as usize != t || qsl.windows(2).any(|w| w[0] > w[1]) {
            return Err(KernelError::new(format!(
                "query_start_loc must rise from 0 to T = {t}"
            )));
        }
        let mut seen = vec![false; num_slots];
        for (i, &s) in self.state_slots.iter().enumerate() {
            if s < 0 || s as usize >= num_slots {
                return Err(KernelError::new(format!(
                    "state slot {s} of sequence {i} is outside 0..{num_slots}"
                )));
            }
            if qsl[i + 1] > qsl[i] {
                if seen[s as usize] {
                    return Err(KernelError::new(format!(
                        "state slot {s} is used by two sequences of one step"
                    )));
                }
                seen[s as usize] = true;
            }
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

/// A raw pointer that tasks of one kernel call share to write disjoint elements.
#[derive(Clone, Copy)]
pub(crate) struct SharedMut(*mut f32);
unsafe impl Send for SharedMut {}
unsafe impl Sync for SharedMut {}

impl SharedMut {
    pub(crate) fn new(s: &mut [f32]) -> Self {
        Self(s.as_mut_ptr())
    }

    /// # Safety
    /// `at..at + len` must lie in the slice this was made from, and no other task may
    /// touch those elements during the call.
    /// The pointer `at` elements further on.
    ///
    /// # Safety
    /// `at` must lie within the slice this was made from.
    #[inline(always)]
    pub(crate) unsafe fn add(self, at: usize) -> Self {
        Self(self.0.add(at))
    }

    #[inline(always)]
    pub(crate) unsafe fn slice<'a>(self, at: usize, len: usize) -> &'a mut [f32] {
        std::slice::from_raw_parts_mut(self.0.add(at), len)
    }
}
