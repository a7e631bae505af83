//! The MoE block's steps that are the same for float32 and bfloat16, written once
//! over [`Elem`]: HF's routing (softmax, top-k, renormalise, the shared gate), the
//! counting sort of the `T x k` (token, slot) pairs by expert, and the gather of
//! each pair's row of `x` into its expert's run of rows. Where HF's bfloat16 run
//! rounds an intermediate, [`Elem::round`] does (the identity for float32), so each
//! element type keeps the numbers its own kernel had.

use crate::bf16::Elem;
use crate::math::{exp, sigmoid};
use crate::pool::for_each_task;
use crate::{Rows, SharedMut};

/// HF's routing for every token from its router logits: softmax in float32 (times
/// the reciprocal of the sum, as torch's CPU softmax), top-k (`torch.topk`'s choice
/// and order, equal probabilities included), the weights divided by their sum (then
/// rounded to `E`); the shared gate's logit (rounded to `E`) and its sigmoid
/// (rounded to `E`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn route<E: Elem>(
    x: &Rows<'_, E>,
    logits: &[E],
    e: usize,
    k: usize,
    gate: Option<&[E]>,
    ids: &mut [i64],
    weights: &mut [f32],
    shared_scale: &mut [f32],
) {
    let t = x.rows;
    let (ids_p, w_p) = (SharedMut::new(ids), SharedMut::new(weights));
    let sc = SharedMut::new(shared_scale);
    let chunk = 32;
    for_each_task(t.div_ceil(chunk), t * e * 8, |c| {
        let mut probs = vec![0.0f32; e];
        let mut best = vec![0usize; k];
        let (mut queue, mut picked) = (Vec::with_capacity(e), vec![(0.0f32, 0usize); k]);
        for tok in c * chunk..((c + 1) * chunk).min(t) {
            let l = &logits[tok * e..(tok + 1) * e];
            let max = l.iter().map(|v| v.get()).fold(f32::NEG_INFINITY, f32::max);
            // The exponentials in a loop of their own (it vectorises), then their sum
            // in index order (the same float32 sum as one loop doing both).
            for (p, &v) in probs.iter_mut().zip(l) {
                *p = exp(v.get() - max);
            }
            let mut sum = 0.0f32;
            for &p in probs.iter() {
                sum += p;
            }
            let inv = 1.0 / sum;
            for p in probs.iter_mut() {
                *p *= inv;
            }
            // SAFETY: token tok's k entries belong to this task alone.
            let (id_row, w_row) = unsafe { (ids_p.slice(tok * k, k), w_p.slice(tok * k, k)) };
            let (mut found, tie) = top_k(&probs, &mut best);
            if tie {
                // Equal probabilities at or above the k-th (or a NaN): which of them
                // torch takes, and in what order, is its selection algorithm's doing.
                crate::topk::topk(&probs, k, &mut queue, &mut picked);
                for (b, &(_, id)) in best.iter_mut().zip(picked.iter()) {
                    *b = id;
                }
                found = k;
            }
            for j in 0..k {
                // Fewer than k numbers (NaN logits): the slot's own index.
                let id = if j < found { best[j] } else { j };
                id_row[j] = id as i64;
                w_row[j] = probs[id];
            }
            let total: f32 = w_row.iter().sum();
            for w in w_row.iter_mut() {
                *w = E::round(*w / total);
            }
            if let Some(g) = gate {
                let logit = E::round(E::dot(x.row(tok), g));
                // SAFETY: entry tok belongs to this task alone.
                let dst = unsafe { sc.slice(tok, 1) };
                dst[0] = E::round(sigmoid(logit));
            }
        }
    });
}

/// The indices of the `best.len()` largest of `probs` into `best`, largest first, in
/// one pass: a candidate enters the sorted list only if it beats its last entry.
/// Returns how many were found (fewer than `best.len()` only when fewer numbers than
/// that are not NaN) and whether the choice met a tie: two equal probabilities of
/// which at least one is kept, or a NaN. Without one the choice and its order are
/// `torch.topk`'s; with one the caller asks [`crate::topk`], which follows torch's
/// selection (torch does not simply prefer the lower index among equals).
pub(crate) fn top_k(probs: &[f32], best: &mut [usize]) -> (usize, bool) {
    let k = best.len();
    let mut n = 0;
    let mut tie = false;
    for (cand, &p) in probs.iter().enumerate() {
        if p.is_nan() {
            tie = true;
            continue;
        }
        if n == k {
            let last = probs[best[k - 1]];
            if p <= last {
                tie |= p == last;
                continue;
            }
        }
        let mut pos = n.min(k - 1);
        while pos > 0 && probs[best[pos - 1]] < p {
            pos -= 1;
        }
        tie |= pos > 0 && probs[best[pos - 1]] == p;
        let end = n.min(k - 1);
        best.copy_within(pos..end, pos + 1);
        best[pos] = cand;
        n = (n + 1).min(k);
    }
    (n, tie)
}

/// The (token, slot) pairs grouped by expert, stable (token order within an expert).
pub(crate) struct ByExpert {
    /// Pairs per expert.
    pub counts: Vec<usize>,
    /// `start[j]..start[j + 1]`: expert `j`'s rows in the grouped buffers.
    pub start: Vec<usize>,
    /// `pos[t * k + j]`: pair `(t, j)`'s row in the grouped buffers.
    pub pos: Vec<usize>,
    /// The token of each grouped row.
    pub token_of: Vec<usize>,
}

/// One counting pass over `ids` (`[T, k]`, experts `< e`).
pub(crate) fn sort_by_expert(ids: &[i64], e: usize, k: usize) -> ByExpert {
    let mut counts = vec![0usize; e];
    for &id in ids {
        counts[id as usize] += 1;
    }
    let mut start = vec![0usize; e + 1];
    for j in 0..e {
        start[j + 1] = start[j] + counts[j];
    }
    let mut fill = start.clone();
    let mut pos = vec![0usize; ids.len()];
    let mut token_of = vec![0usize; ids.len()];
    for (p, &id) in ids.iter().enumerate() {
        let row = fill[id as usize];
        fill[id as usize] += 1;
        pos[p] = row;
        token_of[row] = p / k;
    }
    ByExpert { counts, start, pos, token_of }
}

/// Row `r` of `xs` (`[rows, h]`) = row `token_of[r]` of `x`, in parallel chunks.
pub(crate) fn gather_rows<E: Elem>(x: &Rows<'_, E>, token_of: &[usize], xs: &mut [E]) {
    let (h, rows) = (x.width, token_of.len());
    let dst = SharedMut::new(xs);
    let chunk = 64;
    for_each_task(rows.div_ceil(chunk), rows * h, |c| {
        let r0 = c * chunk;
        for (r, &tok) in token_of.iter().enumerate().take((r0 + chunk).min(rows)).skip(r0) {
            // SAFETY: row r of xs belongs to this task alone.
            unsafe { dst.slice(r * h, h) }.copy_from_slice(x.row(tok));
        }
    });
}

/// Per token, its k expert rows (`ys`, grouped; pair `(t, j)` at row `pos[t * k +
/// j]`) times their routing weights, summed in float32 with each product rounded
/// to `E`, plus the gated shared row (`ys_s`, `[T, h]`, empty without one): `out =
/// round(sum) + round(gate * shared)`, or the sum alone. `expert_order`: add the k
/// rows in expert order (HF's float32 `index_add_` loop over experts), else in
/// slot order (the bfloat16 block's transcription). For float32 every rounding is
/// the identity and this is the plain weighted sum.
#[allow(clippy::too_many_arguments)]
pub(crate) fn combine<E: Elem>(
    ys: &[E],
    ys_s: &[E],
    shared_scale: &[f32],
    ids: &[i64],
    weights: &[f32],
    pos: &[usize],
    k: usize,
    h: usize,
    expert_order: bool,
    out: &mut [E],
) {
    let t = ids.len() / k.max(1);
    let dst = SharedMut::new(out);
    let chunk = 32;
    for_each_task(t.div_ceil(chunk), t * k * h, |c| {
        let mut acc = vec![0.0f32; h];
        let mut order: Vec<usize> = (0..k).collect();
        for tok in c * chunk..((c + 1) * chunk).min(t) {
            acc.fill(0.0);
            if expert_order {
                order.sort_unstable_by_key(|&j| ids[tok * k + j]);
            }
            for &j in &order {
                let wj = weights[tok * k + j];
                let y = &ys[pos[tok * k + j] * h..][..h];
                for (a, &yv) in acc.iter_mut().zip(y) {
                    *a += E::round(yv.get() * wj);
                }
            }
            // SAFETY: row tok of out belongs to this task alone.
            let o = unsafe { dst.slice(tok * h, h) };
            if ys_s.is_empty() {
                for (ov, &a) in o.iter_mut().zip(&acc) {
                    *ov = E::narrow(a);
                }
            } else {
                let sg = shared_scale[tok];
                for ((ov, &a), &yv) in o.iter_mut().zip(&acc).zip(&ys_s[tok * h..][..h]) {
                    *ov = E::narrow(E::round(a) + E::round(sg * yv.get()));
                }
            }
        }
    });
}
