//! [`crate::conv1d`]'s depthwise causal conv1d for a bfloat16 model: bfloat16 inputs,
//! weight, bias and conv state (the arena keeps the conv state in the model's dtype),
//! float32 sums, each output rounded once to bfloat16.
//!
//! Same contract and task split (sequence x block of channels) as the float32
//! kernel; the inputs are widened a row at a time into a ring of the last `W` rows
//! (the history first), so nothing is converted through memory. The stored state
//! and checkpoints are the inputs themselves, copied bit for bit.

use crate::bf16::{from_f32, to_f32};
use crate::math::{dispatch, silu};
use crate::pool::for_each_task;
use crate::{KernelError, PagedState, Rows, SharedMut, Varlen};

const CHANNEL_BLOCK: usize = 256;

struct Ctx<'a> {
    x: Rows<'a, u16>,
    /// `[W, C]` float32: the weight widened and transposed (a tap's weights contiguous).
    wt: Vec<f32>,
    bias: Option<Vec<f32>>,
    silu: bool,
    width: usize,
    varlen: Varlen<'a>,
    paged: PagedState<'a>,
    state: SharedMut<u16>,
    out: SharedMut<u16>,
}

/// As [`crate::conv1d::causal_conv1d`], every tensor bfloat16 bits: `x` `[T, C]`
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
    let mut wt = vec![0.0f32; w * c];
    for ch in 0..c {
        for j in 0..w {
            wt[j * c + ch] = to_f32(weight[ch * w + j]);
        }
    }
    let ctx = Ctx {
        x,
        wt,
        bias: bias.map(|b| b.iter().map(|&v| to_f32(v)).collect()),
        silu,
        width: w,
        varlen,
        paged,
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
    let (w, hw) = (ctx.width, ctx.width - 1);
    let (start, end) = ctx.varlen.run(b);
    let len = end - start;
    // SAFETY: channels c0..c1 of this item are this task's alone (distinct pages
    // among runs and checkpoints, validated; channel blocks split by task).
    let st = unsafe { ctx.state.slice(ctx.paged.item(b, 0) + c0 * hw, n * hw) };
    // ring[(p mod W) * n ..]: the widened input at sequence position p (negative: the
    // stored history), for the last W positions.
    let slot = |p: isize| p.rem_euclid(w as isize) as usize * n;
    let mut ring = vec![0.0f32; w * n];
    if ctx.varlen.has_initial_state[b] {
        for i in 0..hw {
            let s = slot(i as isize - hw as isize);
            for k in 0..n {
                ring[s + k] = to_f32(st[k * hw + i]);
            }
        }
    }
    // The last hw inputs ending before position `upto` (all in the ring), as bits.
    let store = |ring: &[f32], dst: &mut [u16], upto: usize| {
        for i in 0..hw {
            let s = slot(upto as isize - hw as isize + i as isize);
            for k in 0..n {
                // Exact: every value in the ring was a bfloat16.
                dst[k * hw + i] = from_f32(ring[s + k]);
            }
        }
    };
    let ckpt = ctx.paged.checkpoint(b, 0);
    let mut acc = vec![0.0f32; n];
    for p in 0..len {
        let s = slot(p as isize);
        for (r, &v) in ring[s..s + n]
            .iter_mut()
            .zip(&ctx.x.row(start + p)[c0..c1])
        {
            *r = to_f32(v);
        }
        match &ctx.bias {
            Some(bias) => acc.copy_from_slice(&bias[c0..c1]),
            None => acc.fill(0.0),
        }
        for j in 0..w {
            let s = slot(p as isize - hw as isize + j as isize);
            let wj = &ctx.wt[j * c + c0..j * c + c1];
            for ((a, &xv), &wv) in acc.iter_mut().zip(&ring[s..s + n]).zip(wj) {
                *a += wv * xv;
            }
        }
        // SAFETY: row start + p, channels c0..c1 of the output are this task's.
        let dst = unsafe { ctx.out.slice((start + p) * c + c0, n) };
        if ctx.silu {
            for (d, &a) in dst.iter_mut().zip(&acc) {
                *d = from_f32(silu(a));
            }
        } else {
            for (d, &a) in dst.iter_mut().zip(&acc) {
                *d = from_f32(a);
            }
        }
        if let Some((k, at)) = ckpt {
            if k == p + 1 {
                // SAFETY: as for the state item: the checkpoint's page is this run's.
                store(&ring, unsafe { ctx.state.slice(at + c0 * hw, n * hw) }, k);
            }
        }
    }
    // The ring holds the old state where the run is shorter than hw.
    store(&ring, st, len);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bf16::{from_f32, to_f32};
    use crate::conv1d::causal_conv1d;

    /// Against the float32 kernel on the same (bfloat16-valued) inputs: outputs equal
    /// after one rounding, state and checkpoint bit-equal; a run shorter than the
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
        for (i, (&g, &want)) in o16.iter().zip(&o32).enumerate() {
            let g = to_f32(g);
            assert!(
                (g - want).abs() <= want.abs() * 2f32.powi(-8) + 1e-6,
                "out[{i}] = {g}, float32 kernel {want}"
            );
        }
    }
}
