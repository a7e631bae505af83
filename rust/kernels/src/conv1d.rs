//! Depthwise causal conv1d over a flattened varlen batch, conv state in paged items.
//!
//! `y[t, c] = act(bias[c] + sum_j w[c, j] * x_ext[t - (W-1) + j, c])`, where a
//! sequence's `x_ext` before its first row is its slot's last `W-1` inputs (oldest
//! first; zeros when it starts fresh). Afterwards the slot holds the last `W-1`
//! inputs, so a sequence can be fed in pieces of any size, one decode token included,
//! and produce what one pass over the whole sequence would.
//!
//! Tasks are (sequence, block of channels); the history is read into a small local
//! buffer first, so the state item (found through the state page table,
//! [`PagedState`], item `0` of the layer) can be overwritten in place at the end of the
//! task, and a checkpoint (the `W-1` inputs ending at the run's `k`-th token) copied
//! out in the same task.
//!
//! One loop serves both precisions ([`Elem`]): a bfloat16 model
//! ([`causal_conv1d_bf16`]) keeps inputs, weight, bias and conv state in bfloat16
//! (the arena keeps the conv state in the model's dtype); its inputs are widened as
//! the taps read them, the sums are float32 and each output is rounded once. The
//! stored state and checkpoints are the inputs themselves, copied bit for bit.

use crate::bf16::Elem;
use crate::math::{dispatch, silu};
use crate::pool::for_each_task;
use crate::{KernelError, PagedState, Rows, SharedMut, Varlen};

mod decode;

const CHANNEL_BLOCK: usize = 256;

/// A (sequence, channel block) task of the general path, compiled per element type and ISA.
type TaskFn<T> = fn(&Ctx<'_, T>, usize, usize);

struct Ctx<'a, T = f32> {
    x: Rows<'a, T>,
    /// `[W, C]` float32: the weight transposed, so a tap's weights are contiguous over channels.
    wt: Vec<f32>,
    /// float32: read in place, or widened once per call for bfloat16.
    bias: Option<&'a [f32]>,
    silu: bool,
    width: usize,
    varlen: Varlen<'a>,
    paged: PagedState<'a>,
    state: SharedMut<T>,
    out: SharedMut<T>,
}

/// * `x` `[T, C]` (row-strided view allowed), `weight` `[C, W]` (HF's
///   `conv1d.weight[:, 0, :]`), `bias` `[C]` or none.
/// * `state`: the pool; sequence `b`'s `[C, W-1]` item is `paged.item(b, 0)`, read and
///   written in place (sequences with no rows keep theirs); checkpoints per `paged`.
/// * `out` `[T, C]`, `silu` applied when asked.
///
/// O((T + B W) C W).
#[allow(clippy::too_many_arguments)]
pub fn causal_conv1d(
    x: Rows<'_>,
    weight: &[f32],
    bias: Option<&[f32]>,
    silu: bool,
    state: &mut [f32],
    paged: PagedState<'_>,
    varlen: Varlen<'_>,
    out: &mut [f32],
) -> Result<(), KernelError> {
    conv_with(
        x,
        weight,
        bias,
        silu,
        state,
        paged,
        varlen,
        out,
        (run_task_f32, decode::seq_f32),
    )
}

/// [`causal_conv1d`] for a bfloat16 model, every tensor bfloat16 bits: `x` `[T, C]`
/// (row-strided allowed), `weight` `[C, W]`, `bias` `[C]`, the state pool, `out`
/// `[T, C]`.
#[allow(clippy::too_many_arguments)]
pub fn causal_conv1d_bf16(
    x: Rows<'_, u16>,
    weight: &[u16],
    bias: Option<&[u16]>,
    silu: bool,
    state: &mut [u16],
    paged: PagedState<'_>,
    varlen: Varlen<'_>,
    out: &mut [u16],
) -> Result<(), KernelError> {
    conv_with(
        x,
        weight,
        bias,
        silu,
        state,
        paged,
        varlen,
        out,
        (run_task_bf16, decode::seq_bf16),
    )
}

#[allow(clippy::too_many_arguments)]
fn conv_with<T: Elem>(
    x: Rows<'_, T>,
    weight: &[T],
    bias: Option<&[T]>,
    silu: bool,
    state: &mut [T],
    paged: PagedState<'_>,
    varlen: Varlen<'_>,
    out: &mut [T],
    (run_task, decode_seq): (TaskFn<T>, decode::SeqFn<T>),
) -> Result<(), KernelError> {
    let (t, c) = (x.rows, x.width);
    if c == 0 || weight.len() % c != 0 || weight.len() / c < 2 {
        return Err(KernelError::new(format!(
            "weight must be [C={c}, W] with W >= 2, got {} elements",
            weight.len()
        )));
    }
    let w = weight.len() / c;
    if bias.is_some_and(|b| b.len() != c) {
        return Err(KernelError::new(format!("bias must have C = {c} entries")));
    }
    if paged.item_len != c * (w - 1) {
        return Err(KernelError::new(format!(
            "state items must be [C={c}, W-1={}], got {} elements",
            w - 1,
            paged.item_len
        )));
    }
    if out.len() != t * c {
        return Err(KernelError::new(format!("out must be [T={t}, C={c}]")));
    }
    varlen.validate(t)?;
    paged.validate(&varlen, 1, state.len())?;
    let runs: Vec<usize> = (0..varlen.num_seqs())
        .filter(|&b| {
            let (s, e) = varlen.run(b);
            e > s
        })
        .collect();
    let mut wide_bias = T::scratch(c);
    if runs.len() == t {
        // One row per sequence (a decode step): no transposed weight, no history buffer.
        let d = decode::Decode {
            x,
            weight,
            bias: bias.map(|b| T::widen(b, &mut wide_bias)),
            silu,
            width: w,
            varlen,
            paged,
        };
        decode::run(&d, &runs, state, out, decode_seq);
        return Ok(());
    }
    let mut wt = vec![0.0f32; w * c];
    for ch in 0..c {
        for j in 0..w {
            wt[j * c + ch] = weight[ch * w + j].get();
        }
    }
    let ctx = Ctx {
        x,
        wt,
        bias: bias.map(|b| T::widen(b, &mut wide_bias)),
        silu,
        width: w,
        varlen,
        paged,
        state: SharedMut::new(state),
        out: SharedMut::new(out),
    };
    let blocks = c.div_ceil(CHANNEL_BLOCK);
    for_each_task(runs.len() * blocks, (t + runs.len() * w) * c * w, |i| {
        run_task(&ctx, runs[i / blocks], (i % blocks) * CHANNEL_BLOCK)
    });
    Ok(())
}

dispatch!(fn run_task_f32(ctx: &Ctx<'_, f32>, b: usize, c0: usize) => body_f32);
dispatch!(fn run_task_bf16(ctx: &Ctx<'_, u16>, b: usize, c0: usize) => body_bf16);

#[inline(always)]
fn body_f32(ctx: &Ctx<'_, f32>, b: usize, c0: usize) {
    run_task_body(ctx, b, c0)
}

#[inline(always)]
fn body_bf16(ctx: &Ctx<'_, u16>, b: usize, c0: usize) {
    run_task_body(ctx, b, c0)
}

/// Input at position `p` of a sequence starting at row `start` (negative: the stored
/// history `hist`, `[hw, n]`), channels `c0..c1`.
#[inline(always)]
fn input_at<'s, T>(
    hist: &'s [T],
    x: &Rows<'s, T>,
    (start, c0, c1, hw): (usize, usize, usize, usize),
    p: isize,
) -> &'s [T] {
    let n = c1 - c0;
    if p < 0 {
        let i = (p + hw as isize) as usize;
        &hist[i * n..(i + 1) * n]
    } else {
        &x.row(start + p as usize)[c0..c1]
    }
}

#[inline(always)]
fn run_task_body<T: Elem>(ctx: &Ctx<'_, T>, b: usize, c0: usize) {
    let c = ctx.x.width;
    let c1 = (c0 + CHANNEL_BLOCK).min(c);
    let n = c1 - c0;
    let hw = ctx.width - 1;
    let (start, end) = ctx.varlen.run(b);
    let len = end - start;
    // SAFETY: channels c0..c1 of this item are this task's alone (distinct pages
    // among runs and checkpoints, validated; channel blocks split by task).
    let st = unsafe { ctx.state.slice(ctx.paged.item(b, 0) + c0 * hw, n * hw) };
    // hist[i] = input at position i - hw of the sequence, for i in 0..hw.
    let mut hist = vec![T::narrow(0.0); hw * n];
    if ctx.varlen.has_initial_state[b] {
        for k in 0..n {
            for i in 0..hw {
                hist[i * n + k] = st[k * hw + i];
            }
        }
    }
    let input = |p: isize| -> &[T] { input_at(&hist, &ctx.x, (start, c0, c1, hw), p) };
    let mut acc = vec![0.0f32; n];
    for p in 0..len {
        match ctx.bias {
            Some(bias) => acc.copy_from_slice(&bias[c0..c1]),
            None => acc.fill(0.0),
        }
        for j in 0..ctx.width {
            let src = input(p as isize - hw as isize + j as isize);
            let wj = &ctx.wt[j * c + c0..j * c + c1];
            for ((a, &xv), &wv) in acc.iter_mut().zip(src).zip(wj) {
                *a += wv * xv.get();
            }
        }
        // SAFETY: row start + p, channels c0..c1 of the output are this task's.
        let dst = unsafe { ctx.out.slice((start + p) * c + c0, n) };
        if ctx.silu {
            for (d, &a) in dst.iter_mut().zip(&acc) {
                *d = T::narrow(silu(a));
            }
        } else {
            for (d, &a) in dst.iter_mut().zip(&acc) {
                *d = T::narrow(a);
            }
        }
    }
    // The checkpoint, then the new state: the last hw inputs ending at row k, and at
    // the sequence's last row.
    let store = |dst: &mut [T], upto: usize| {
        for i in 0..hw {
            let src = input(upto as isize - hw as isize + i as isize);
            for k in 0..n {
                dst[k * hw + i] = src[k];
            }
        }
    };
    if let Some((k, at)) = ctx.paged.checkpoint(b, 0) {
        // SAFETY: as for the state item: the checkpoint's page is this run's alone.
        store(unsafe { ctx.state.slice(at + c0 * hw, n * hw) }, k);
    }
    // `hist` holds the old state, so writing the item last cannot clobber an input. A
    // read-only (speculative) run leaves it as it was.
    if !ctx.paged.is_read_only(b) {
        store(st, len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bf16::{from_f32, to_f32};

    #[test]
    fn pieces_equal_one_pass_and_the_formula() {
        // One sequence of 11 tokens fed whole, and fed as 4 + 1 + 6 through its slot.
        let (c, w, t) = (300usize, 4usize, 11usize);
        let mut seed = 3u64;
        let mut rnd = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        };
        let x: Vec<f32> = (0..t * c).map(|_| rnd()).collect();
        let weight: Vec<f32> = (0..c * w).map(|_| rnd()).collect();
        let bias: Vec<f32> = (0..c).map(|_| rnd()).collect();
        let want = |tt: usize, ch: usize| -> f32 {
            let mut s = bias[ch] as f64;
            for j in 0..w {
                let p = tt as isize - (w as isize - 1) + j as isize;
                if p >= 0 {
                    s += weight[ch * w + j] as f64 * x[p as usize * c + ch] as f64;
                }
            }
            (s / (1.0 + (-s).exp())) as f32
        };
        // Pages of two items plus padding; the sequence's item is item 1 of page 2.
        let item = c * (w - 1);
        let (stride, pages) = (2 * item + 3, 3usize);
        let paged =
            |table: &'static [i64], ck: &'static [i64], ck_table: &'static [i64]| PagedState {
                table,
                cols: 1,
                item_base: 1,
                per_page: 2,
                page_stride: stride,
                item_len: item,
                num_pages: pages,
                checkpoint_positions: ck,
                checkpoint_table: ck_table,
                read_only: &[],
            };
        let mut whole = vec![0.0f32; t * c];
        let mut st1 = vec![9.0f32; pages * stride];
        // Whole, with checkpoints after 4 and 5 tokens in two calls (page 0, item 1).
        causal_conv1d(
            Rows::dense(&x, c).unwrap(),
            &weight,
            Some(&bias),
            true,
            &mut st1,
            paged(&[2], &[4], &[0]),
            Varlen {
                query_start_loc: &[0, t as i64],
                has_initial_state: &[false],
            },
            &mut whole,
        )
        .unwrap();
        let ck4 = st1[item..2 * item].to_vec();
        let mut pieces = vec![0.0f32; t * c];
        let mut st2 = vec![0.0f32; pages * stride];
        let mut after = Vec::new();
        for (i, (s, e)) in [(0usize, 4usize), (4, 5), (5, 11)].into_iter().enumerate() {
            causal_conv1d(
                Rows::dense(&x[s * c..e * c], c).unwrap(),
                &weight,
                Some(&bias),
                true,
                &mut st2,
                paged(&[2], &[], &[]),
                Varlen {
                    query_start_loc: &[0, (e - s) as i64],
                    has_initial_state: &[i > 0],
                },
                &mut pieces[s * c..e * c],
            )
            .unwrap();
            after.push(st2[2 * stride + item..2 * stride + 2 * item].to_vec());
        }
        for tt in 0..t {
            for ch in 0..c {
                let (a, b, r) = (whole[tt * c + ch], pieces[tt * c + ch], want(tt, ch));
                assert!(
                    (a - r).abs() < 1e-5 && (b - r).abs() < 1e-5,
                    "t={tt} c={ch}: {a} {b} want {r}"
                );
            }
        }
        let item_of = |st: &[f32]| st[2 * stride + item..2 * stride + 2 * item].to_vec();
        assert_eq!(item_of(&st1), item_of(&st2));
        // The checkpoint at token 4 is the state the pieces had after their first call.
        assert_eq!(ck4, after[0]);
        // Everything else untouched: item 0 of page 2, page 1, the padding.
        assert!(st1[2 * stride..2 * stride + item].iter().all(|&v| v == 9.0));
        assert!(st1[stride..2 * stride].iter().all(|&v| v == 9.0));
        assert!(st1[2 * item..stride].iter().all(|&v| v == 9.0));
    }

    /// Against the float32 kernel on the same (bfloat16-valued) inputs: outputs its
    /// float32 outputs rounded once, state and checkpoint bit-equal; a run shorter than the
    /// history, a fresh run, a run with a checkpoint.
    #[test]
    fn matches_the_float32_kernel_on_bf16_values() {
        let (c, w) = (300usize, 4usize);
        let lens = [2usize, 7, 1];
        let t: usize = lens.iter().sum();
        let mut seed = 5u64;
        let mut rnd = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
            to_f32(from_f32(((seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5))
        };
        let x: Vec<f32> = (0..t * c).map(|_| rnd()).collect();
        let weight: Vec<f32> = (0..c * w).map(|_| rnd()).collect();
        let bias: Vec<f32> = (0..c).map(|_| rnd()).collect();
        let item = c * (w - 1);
        let state: Vec<f32> = (0..5 * item).map(|_| rnd()).collect();
        let qsl = [0i64, 2, 9, 10];
        let init = [true, false, true];
        let table = [3i64, 0, 1];
        let (ckpos, cktab) = ([-1i64, 4, -1], [0i64, 4, 0]);
        let paged = PagedState {
            table: &table,
            cols: 1,
            item_base: 0,
            per_page: 1,
            page_stride: item,
            item_len: item,
            num_pages: 5,
            checkpoint_positions: &ckpos,
            checkpoint_table: &cktab,
            read_only: &[],
        };
        let varlen = Varlen {
            query_start_loc: &qsl,
            has_initial_state: &init,
        };
        let (mut s32, mut o32) = (state.clone(), vec![0.0f32; t * c]);
        causal_conv1d(
            Rows::dense(&x, c).unwrap(),
            &weight,
            Some(&bias),
            true,
            &mut s32,
            paged,
            varlen,
            &mut o32,
        )
        .unwrap();
        let bits = |v: &[f32]| v.iter().map(|&f| from_f32(f)).collect::<Vec<u16>>();
        let (xb, mut s16, mut o16) = (bits(&x), bits(&state), vec![0u16; t * c]);
        causal_conv1d_bf16(
            Rows::dense(&xb, c).unwrap(),
            &bits(&weight),
            Some(&bits(&bias)),
            true,
            &mut s16,
            paged,
            varlen,
            &mut o16,
        )
        .unwrap();
        assert_eq!(s16, bits(&s32), "state and checkpoint");
        // One loop for both: the same float32 sums in the same order, rounded once.
        assert_eq!(o16, bits(&o32), "outputs");
    }

    /// Read-only (speculative) runs: the outputs of a run that writes, their conv item
    /// untouched, the other runs written as usual; the general path (several rows per
    /// run) and the decode path (one row each).
    #[test]
    fn read_only_runs_compute_the_same_and_write_nothing() {
        let (c, w) = (300usize, 4usize);
        let item = c * (w - 1);
        let mut seed = 9u64;
        let mut rnd = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        };
        let weight: Vec<f32> = (0..c * w).map(|_| rnd()).collect();
        let state: Vec<f32> = (0..3 * item).map(|_| rnd()).collect();
        let x: Vec<f32> = (0..10 * c).map(|_| rnd()).collect();
        for qsl in [[0i64, 2, 9, 10], [0, 1, 2, 3]] {
            let t = qsl[3] as usize;
            let table = [2i64, 0, 1];
            let init = [true, false, true];
            let run = |read_only: &[bool]| {
                let paged = PagedState {
                    table: &table,
                    cols: 1,
                    item_base: 0,
                    per_page: 1,
                    page_stride: item,
                    item_len: item,
                    num_pages: 3,
                    checkpoint_positions: &[],
                    checkpoint_table: &[],
                    read_only,
                };
                let varlen = Varlen {
                    query_start_loc: &qsl,
                    has_initial_state: &init,
                };
                let (mut s, mut o) = (state.clone(), vec![0.0f32; t * c]);
                causal_conv1d(
                    Rows::dense(&x[..t * c], c).unwrap(),
                    &weight,
                    None,
                    true,
                    &mut s,
                    paged,
                    varlen,
                    &mut o,
                )
                .unwrap();
                (s, o)
            };
            let (s_w, o_w) = run(&[]);
            let (s_r, o_r) = run(&[true, false, true]);
            assert_eq!(o_r, o_w, "outputs ({qsl:?})");
            for (b, ro) in [(0usize, true), (1, false), (2, true)] {
                let p = table[b] as usize;
                let span = p * item..(p + 1) * item;
                let want = if ro { &state[span.clone()] } else { &s_w[span.clone()] };
                assert_eq!(&s_r[span.clone()], want, "sequence {b} ({qsl:?})");
                assert!(s_w[span.clone()] != state[span], "a writing run changes its item");
            }
        }
    }
}
