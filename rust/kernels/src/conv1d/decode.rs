//! The conv of a decode step: every sequence with rows has exactly one.
//!
//! The general path transposes the weight to `[W, C]` and reads each task's history
//! into a `[W-1, n]` buffer, which pays off over many rows; for one row per sequence
//! that setup is most of the call (at the 0.1B bench shape ~8K strided writes for
//! 8K multiply-adds, per layer and step). Here each channel reads its `W` weights
//! and its `W-1` state inputs where they lie (both contiguous per channel), sums the
//! taps in the same order with the same float32 operations as the general path (so
//! the output and the state are bit-identical to it), and shifts its state item in
//! place; the activation then runs over the row's sums in one vectorisable pass.

use super::Elem;
use crate::math::{dispatch, silu};
use crate::pool::for_each_task;
use crate::{PagedState, Rows, SharedMut, Varlen};

/// What [`run`] needs besides the pool and the output.
pub(super) struct Decode<'a, T> {
    pub x: Rows<'a, T>,
    /// `[C, W]` as the caller passed it.
    pub weight: &'a [T],
    pub bias: Option<&'a [f32]>,
    pub silu: bool,
    pub width: usize,
    pub varlen: Varlen<'a>,
    pub paged: PagedState<'a>,
}

/// One sequence's row (see [`seq_body`]), compiled per element type and ISA.
pub(super) type SeqFn<T> = fn(&Decode<'_, T>, usize, SharedMut<T>, SharedMut<T>);

/// Runs every sequence's one row; `runs`: the sequences with a row (validated by the
/// caller: shapes, pages and checkpoints as for the general path).
pub(super) fn run<T: Elem>(
    d: &Decode<'_, T>,
    runs: &[usize],
    state: &mut [T],
    out: &mut [T],
    seq: SeqFn<T>,
) {
    let (state, out) = (SharedMut::new(state), SharedMut::new(out));
    // One task per sequence: a lone decode runs inline (no thread wakes for ~8K
    // multiply-adds), a batch of them in parallel.
    for_each_task(runs.len(), runs.len() * d.x.width * d.width, |i| {
        seq(d, runs[i], state, out)
    });
}

dispatch!(pub(super) fn seq_f32(d: &Decode<'_, f32>, b: usize, state: SharedMut<f32>, out: SharedMut<f32>) => body_f32);
dispatch!(pub(super) fn seq_bf16(d: &Decode<'_, u16>, b: usize, state: SharedMut<u16>, out: SharedMut<u16>) => body_bf16);

#[inline(always)]
fn body_f32(d: &Decode<'_, f32>, b: usize, state: SharedMut<f32>, out: SharedMut<f32>) {
    seq_body(d, b, state, out)
}

#[inline(always)]
fn body_bf16(d: &Decode<'_, u16>, b: usize, state: SharedMut<u16>, out: SharedMut<u16>) {
    seq_body(d, b, state, out)
}

#[inline(always)]
fn seq_body<T: Elem>(d: &Decode<'_, T>, b: usize, state: SharedMut<T>, out: SharedMut<T>) {
    let c = d.x.width;
    let (row, _) = d.varlen.run(b);
    let hw = d.width - 1;
    // SAFETY: sequence b's item (and its checkpoint's) is written by this task alone
    // (distinct pages among runs and checkpoints, validated by the caller); the output
    // row is b's own.
    let item = unsafe { state.slice(d.paged.item(b, 0), c * hw) };
    // A read-only (speculative) run shifts a private copy: its item stays as it was.
    let mut private: Vec<T>;
    let st: &mut [T] = if d.paged.is_read_only(b) {
        private = item.to_vec();
        &mut private
    } else {
        item
    };
    let fresh = !d.varlen.has_initial_state[b];
    let x = d.x.row(row);
    let mut acc = vec![0.0f32; c];
    for (ch, a) in acc.iter_mut().enumerate() {
        let s = &mut st[ch * hw..(ch + 1) * hw];
        let wc = &d.weight[ch * d.width..(ch + 1) * d.width];
        let mut sum = d.bias.map_or(0.0, |bias| bias[ch]);
        // As the general path: a fresh sequence's history is zeros, summed all the same
        // (the sign of a zero sum, and a non-finite weight, come out as they do there).
        for j in 0..hw {
            let xv = if fresh { 0.0 } else { s[j].get() };
            sum += wc[j].get() * xv;
        }
        sum += wc[hw].get() * x[ch].get();
        *a = sum;
        // The state keeps the last W-1 inputs, oldest first.
        for j in 0..hw - 1 {
            s[j] = if fresh { T::narrow(0.0) } else { s[j + 1] };
        }
        s[hw - 1] = x[ch];
    }
    let dst = unsafe { out.slice(row * c, c) };
    if d.silu {
        for (o, &a) in dst.iter_mut().zip(&acc) {
            *o = T::narrow(silu(a));
        }
    } else {
        for (o, &a) in dst.iter_mut().zip(&acc) {
            *o = T::narrow(a);
        }
    }
    // A checkpoint after the run's first (only) token is the new state.
    if let Some((_, at)) = d.paged.checkpoint(b, 0) {
        unsafe { state.slice(at, c * hw) }.copy_from_slice(st);
    }
}
