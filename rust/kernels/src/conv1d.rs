//! Depthwise causal conv1d over a flattened varlen batch, conv state in slots.
//!
//! `y[t, c] = act(bias[c] + sum_j w[c, j] * x_ext[t - (W-1) + j, c])`, where a
//! sequence's `x_ext` before its first row is its slot's last `W-1` inputs (oldest
//! first; zeros when it starts fresh). Afterwards the slot holds the last `W-1`
//! inputs, so a sequence can be fed in pieces of any size, one decode token included,
//! and produce what one pass over the whole sequence would.
//!
//! Tasks are (sequence, block of channels); the history is read into a small local
//! buffer first, so the slot can be overwritten in place at the end of the task.

use crate::math::{dispatch, silu};
use crate::pool::for_each_task;
use crate::{KernelError, Rows, SharedMut, Varlen};

const CHANNEL_BLOCK: usize = 256;

struct Ctx<'a> {
    x: Rows<'a>,
    /// `[W, C]`: the weight transposed, so a tap's weights are contiguous over channels.
    wt: Vec<f32>,
    bias: Option<&'a [f32]>,
    silu: bool,
    width: usize,
    varlen: Varlen<'a>,
    state: SharedMut,
    out: SharedMut,
}

/// * `x` `[T, C]` (row-strided view allowed), `weight` `[C, W]` (HF's
///   `conv1d.weight[:, 0, :]`), `bias` `[C]` or none.
/// * `state` `[S, C, W-1]`, read and written in place; sequences with no rows keep theirs.
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
    varlen: Varlen<'_>,
    out: &mut [f32],
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
    let per_slot = c * (w - 1);
    if state.len() % per_slot != 0 {
        return Err(KernelError::new(format!(
            "state must be [S, C={c}, W-1={}]",
            w - 1
        )));
    }
    if out.len() != t * c {
        return Err(KernelError::new(format!("out must be [T={t}, C={c}]")));
    }
    varlen.validate(t, state.len() / per_slot)?;
    let mut wt = vec![0.0f32; w * c];
    for ch in 0..c {
        for j in 0..w {
            wt[j * c + ch] = weight[ch * w + j];
        }
    }
    let ctx = Ctx {
        x,
        wt,
        bias,
        silu,
        width: w,
        varlen,
        state: SharedMut::new(state),
        out: SharedMut::new(out),
    };
    let runs: Vec<usize> = (0..varlen.num_seqs())
        .filter(|&b| {
            let (s, e) = varlen.run(b);
            e > s
        })
        .collect();
    let blocks = c.div_ceil(CHANNEL_BLOCK);
    for_each_task(runs.len() * blocks, (t + runs.len() * w) * c * w, |i| {
        run_task(&ctx, runs[i / blocks], (i % blocks) * CHANNEL_BLOCK)
    });
    Ok(())
}

dispatch!(fn run_task(ctx: &Ctx<'_>, b: usize, c0: usize) => run_task_body);

#[inline(always)]
fn run_task_body(ctx: &Ctx<'_>, b: usize, c0: usize) {
    let c = ctx.x.width;
    let c1 = (c0 + CHANNEL_BLOCK).min(c);
    let n = c1 - c0;
    let hw = ctx.width - 1;
    let (start, end) = ctx.varlen.run(b);
    let len = end - start;
    let slot = ctx.varlen.state_slots[b] as usize;
    // SAFETY: channels c0..c1 of this slot are this task's alone (distinct slots
    // among runs, validated; channel blocks split by task).
    let st = unsafe { ctx.state.slice((slot * c + c0) * hw, n * hw) };
    // hist[i] = input at position i - hw of the sequence, for i in 0..hw.
    let mut hist = vec![0.0f32; hw * n];
    if ctx.varlen.has_initial_state[b] {
        for k in 0..n {
            for i in 0..hw {
                hist[i * n + k] = st[k * hw + i];
            }
        }
    }
    let input = |p: isize| -> &[f32] {
        // Input at position p of this sequence (negative: the stored history).
        if p < 0 {
            let i = (p + hw as isize) as usize;
            &hist[i * n..(i + 1) * n]
        } else {
            &ctx.x.row(start + p as usize)[c0..c1]
        }
    };
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
                *a += wv * xv;
            }
        }
        // SAFETY: row start + p, channels c0..c1 of the output are this task's.
        let dst = unsafe { ctx.out.slice((start + p) * c + c0, n) };
        if ctx.silu {
            for (d, &a) in dst.iter_mut().zip(&acc) {
                *d = silu(a);
            }
        } else {
            dst.copy_from_slice(&acc);
        }
    }
    // The new state: the last hw inputs, ending at the sequence's last row.
    let mut last = vec![0.0f32; hw * n];
    for i in 0..hw {
        last[i * n..(i + 1) * n].copy_from_slice(input(len as isize - hw as isize + i as isize));
    }
    for k in 0..n {
        for i in 0..hw {
            st[k * hw + i] = last[i * n + k];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let mut whole = vec![0.0f32; t * c];
        let mut st1 = vec![9.0f32; 2 * c * (w - 1)];
        causal_conv1d(
            Rows::dense(&x, c).unwrap(),
            &weight,
            Some(&bias),
            true,
            &mut st1,
            Varlen {
                query_start_loc: &[0, t as i64],
                state_slots: &[1],
                has_initial_state: &[false],
            },
            &mut whole,
        )
        .unwrap();
        let mut pieces = vec![0.0f32; t * c];
        let mut st2 = vec![0.0f32; 2 * c * (w - 1)];
        for (i, (s, e)) in [(0usize, 4usize), (4, 5), (5, 11)].into_iter().enumerate() {
            causal_conv1d(
                Rows::dense(&x[s * c..e * c], c).unwrap(),
                &weight,
                Some(&bias),
                true,
                &mut st2,
                Varlen {
                    query_start_loc: &[0, (e - s) as i64],
                    state_slots: &[1],
                    has_initial_state: &[i > 0],
                },
                &mut pieces[s * c..e * c],
            )
            .unwrap();
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
        assert_eq!(st1[c * (w - 1)..], st2[c * (w - 1)..]);
        // slot 0 untouched
        assert!(st1[..c * (w - 1)].iter().all(|&v| v == 9.0));
    }
}
