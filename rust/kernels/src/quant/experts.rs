//! An MoE layer's routed experts on quantized blocks, in one call: a GGUF's
//! `ffn_{gate,up,down}_exps` tensors (`[E, rows, row_bytes]`, as the file stores them)
//! against `x` `[T, H]` and the router's choice `ids` / `weights` `[T, k]`.
//!
//! 1. Each token's row of `x` is quantized once per activation kind the gate and up
//!    weights take (Q8_K for the k-quants, Q8_0 for the 32-blocks; [`super::act`]), not
//!    once per expert; its quantized rows are then copied into expert order (the
//!    `T x k` (token, slot) pairs grouped by expert, stably: token order within one), so
//!    each expert's rows are one run, as [`super::gemm`]'s row kernels take them.
//! 2. Every chosen expert's gate and up rows on its run: one parallel region of
//!    (expert, weight-row tile) tasks.
//! 3. `silu(gate) * up` per pair, quantized for the down weights' type.
//! 4. Every chosen expert's down rows on its run, one region of (expert, tile) tasks.
//! 5. Per token, its k rows times their routing weights summed in float32 in expert
//!    order (the order the per-expert loop's `index_add_` adds them), one region over
//!    tokens.
//!
//! A token's output depends only on its own row, its routing and the weights: each
//! product is one dot product in one fixed order ([`super::gemm`]'s kernels, whose
//! results do not depend on the neighbouring rows), and the sum's order is fixed; the
//! thread count and the other tokens of the step change nothing.
//!
//! With bfloat16 activations the intermediates are rounded where the per-expert loop on
//! bfloat16 tensors rounds them (and HF's bfloat16 experts do): each product's output,
//! `silu(gate)`, its product with `up`, the down output; the weighted sum is float32,
//! rounded once at the end.

use super::act::QAct;
use super::blocks::{GgmlType, QK_K};
use super::gemm::{check_isa, dot_rows, MANY_MIN_ROWS, MR};
use super::QIsa;
use crate::bf16::Elem;
use crate::math::silu;
use crate::matmul_bf16::{Out, OutPtr};
use crate::pool::for_each_task;
use crate::{KernelError, Rows, SharedMut};

/// Weight rows per task (as the few-row GEMM's).
const ROWS_PER_TASK: usize = 32;

/// One kind of the experts' weights: `[E, rows, row_bytes]` blocks of `ty`, C-contiguous.
#[derive(Clone, Copy)]
pub struct ExpertBlocks<'a> {
    pub data: &'a [u8],
    pub ty: GgmlType,
}

/// The routed SwiGLU experts in blocks: expert `e` computes
/// `down[e](silu(x gate[e]^T) * (x up[e]^T))`.
#[derive(Clone, Copy)]
pub struct QuantExperts<'a> {
    /// `[E, I, row_bytes(H)]`; with `up` None, gate and up stacked by rows:
    /// `[E, 2I, row_bytes(H)]` (one fused tensor).
    pub gate: ExpertBlocks<'a>,
    /// `[E, I, row_bytes(H)]`, possibly of another type than `gate`.
    pub up: Option<ExpertBlocks<'a>>,
    /// `[E, H, row_bytes(I)]`.
    pub down: ExpertBlocks<'a>,
    pub num: usize,
    pub inter: usize,
}

/// The router's choice: `ids` / `weights` `[T, k]` row-major.
#[derive(Clone, Copy)]
pub struct Route<'a> {
    pub ids: &'a [i64],
    pub weights: &'a [f32],
    pub top_k: usize,
}

fn act_block(ty: GgmlType) -> usize {
    if ty.is_k() {
        QK_K
    } else {
        32
    }
}

fn check_kind(name: &str, b: &ExpertBlocks<'_>, e: usize, rows: usize, k: usize) -> Result<usize, KernelError> {
    let ty = b.ty;
    if k % ty.block_size() != 0 {
        return Err(KernelError::new(format!(
            "{name} is {} whose rows hold whole blocks of {}; its K={k} is not a multiple",
            ty.name(),
            ty.block_size()
        )));
    }
    let rb = ty.row_bytes(k);
    if b.data.len() != e * rows * rb {
        return Err(KernelError::new(format!(
            "{name} must be [E={e}, {rows}, {rb}] bytes of {} blocks (K={k}); got {} bytes",
            ty.name(),
            b.data.len()
        )));
    }
    Ok(rb)
}

/// The routed experts' weighted sum for `x` `[T, H]` into `out` `[T, H]` (float32, or
/// bfloat16 bits rounded once). Returns the most (token, slot) pairs any one expert
/// received (the metrics' expert load).
pub fn quant_experts<T: Elem>(
    x: Rows<'_, T>,
    route: Route<'_>,
    ex: &QuantExperts<'_>,
    out: Out<'_>,
) -> Result<usize, KernelError> {
    quant_experts_with(QIsa::detect(), x, route, ex, out)
}

/// The part gate / up / fused gate_up a task of the first products runs.
#[derive(Clone, Copy)]
struct Part<'a> {
    blocks: ExpertBlocks<'a>,
    /// Rows per expert in `blocks`.
    rows: usize,
    /// Its first column in the `[P, 2I]` gate|up buffer.
    col: usize,
    /// Which quantized copy of `x` it reads (0 or 1).
    act: usize,
}

/// [`quant_experts`] on the instruction set the caller names (tests, benches).
pub fn quant_experts_with<T: Elem>(
    isa: QIsa,
    x: Rows<'_, T>,
    route: Route<'_>,
    ex: &QuantExperts<'_>,
    out: Out<'_>,
) -> Result<usize, KernelError> {
    let (t, h, k, e, inter) = (x.rows, x.width, route.top_k, ex.num, ex.inter);
    if e == 0 || inter == 0 || k == 0 || h == 0 {
        return Err(KernelError::new(format!(
            "need num_experts ({e}), inter ({inter}), top_k ({k}) and hidden ({h}) > 0"
        )));
    }
    if route.ids.len() != t * k || route.weights.len() != t * k {
        return Err(KernelError::new(format!(
            "routing ids and weights must be [T={t}, k={k}]; got {} and {} elements",
            route.ids.len(),
            route.weights.len()
        )));
    }
    let olen = match &out {
        Out::F32(o) => o.len(),
        Out::Bf16(o) => o.len(),
    };
    if olen != t * h {
        return Err(KernelError::new(format!("out must be [T={t}, H={h}]; got {olen} elements")));
    }
    let parts_vec: Vec<(ExpertBlocks<'_>, usize, usize)> = match ex.up {
        Some(up) => vec![(ex.gate, inter, 0), (up, inter, inter)],
        None => vec![(ex.gate, 2 * inter, 0)],
    };
    let names = if ex.up.is_some() { ["gate", "up"] } else { ["gate_up", ""] };
    let mut gu_rb = [0usize; 2];
    for (i, (b, rows, _)) in parts_vec.iter().enumerate() {
        gu_rb[i] = check_kind(names[i], b, e, *rows, h)?;
    }
    let down_rb = check_kind("down", &ex.down, e, h, inter)?;
    check_isa(isa)?;
    if let Some(&bad) = route.ids.iter().find(|&&i| i < 0 || i as usize >= e) {
        return Err(KernelError::new(format!("routing ids must lie in [0, {e}); got {bad}")));
    }
    if t == 0 {
        return Ok(0);
    }

    // (token, slot) pairs grouped by expert, stably.
    let p_total = t * k;
    let mut start = vec![0usize; e + 1];
    for &i in route.ids {
        start[i as usize + 1] += 1;
    }
    let max_load = start.iter().copied().max().unwrap_or(0);
    for i in 0..e {
        start[i + 1] += start[i];
    }
    let mut fill = start.clone();
    let mut order = vec![0usize; p_total]; // sorted position -> pair
    let mut pos = vec![0usize; p_total]; // pair -> sorted position
    for (pair, &i) in route.ids.iter().enumerate() {
        let p = fill[i as usize];
        fill[i as usize] += 1;
        order[p] = pair;
        pos[pair] = p;
    }
    let active: Vec<usize> = (0..e).filter(|&i| start[i + 1] > start[i]).collect();

    // 1. x quantized once per token and kind, then copied into expert order.
    let mut kinds: Vec<usize> = Vec::with_capacity(2);
    let parts: Vec<Part<'_>> = parts_vec
        .iter()
        .map(|&(blocks, rows, col)| {
            let b = act_block(blocks.ty);
            let act = kinds.iter().position(|&k| k == b).unwrap_or_else(|| {
                kinds.push(b);
                kinds.len() - 1
            });
            Part { blocks, rows, col, act }
        })
        .collect();
    let mut buf = T::scratch(h);
    let xq: Vec<QAct> = kinds
        .iter()
        .map(|&b| {
            let mut per_token = QAct::new(t, h, b);
            for r in 0..t {
                per_token.set_row(r, T::widen(x.row(r), &mut buf));
            }
            let mut grouped = QAct::new(p_total, h, b);
            for (p, &pair) in order.iter().enumerate() {
                copy_row(&per_token, pair / k, &mut grouped, p);
            }
            grouped
        })
        .collect();

    // 2. gate | up: h2[p] = [x_p gate^T, x_p up^T] for the expert of position p.
    let two_i = 2 * inter;
    let mut gu = vec![0.0f32; p_total * two_i];
    {
        let gu_ptr = SharedMut::new(&mut gu);
        let mut tasks: Vec<(usize, usize, usize)> = Vec::new(); // (expert, part, first row)
        for &ei in &active {
            for (pi, part) in parts.iter().enumerate() {
                for j0 in (0..part.rows).step_by(ROWS_PER_TASK) {
                    tasks.push((ei, pi, j0));
                }
            }
        }
        let xq = &xq;
        let parts = &parts;
        let start = &start;
        for_each_task(tasks.len(), p_total * two_i * h / 4, |ti| {
            let (ei, pi, j0) = tasks[ti];
            let part = parts[pi];
            let rb = gu_rb[pi];
            let j1 = (j0 + ROWS_PER_TASK).min(part.rows);
            let w = &part.blocks.data[ei * part.rows * rb..(ei + 1) * part.rows * rb];
            let (a0, m) = (start[ei], start[ei + 1] - start[ei]);
            rows_against(isa, part.blocks.ty, w, rb, j0, j1, &xq[part.act], a0, m, |r, j, v| {
                // SAFETY: row a0 + r, column col + j of the buffer belongs to this task
                // alone (its expert's rows, its weight rows).
                unsafe { gu_ptr.slice((a0 + r) * two_i + part.col + j, 1)[0] = T::round(v) };
            });
        });
    }

    // 3. silu(gate) * up, quantized for the down weights.
    let mut aq = QAct::new(p_total, inter, act_block(ex.down.ty));
    {
        let mut a = vec![0.0f32; inter];
        for p in 0..p_total {
            let row = &gu[p * two_i..(p + 1) * two_i];
            for (i, v) in a.iter_mut().enumerate() {
                *v = T::round(T::round(silu(row[i])) * row[inter + i]);
            }
            aq.set_row(p, &a);
        }
    }

    // 4. down: y[p] = a_p down^T.
    let mut y = vec![0.0f32; p_total * h];
    {
        let y_ptr = SharedMut::new(&mut y);
        let mut tasks: Vec<(usize, usize)> = Vec::new();
        for &ei in &active {
            for j0 in (0..h).step_by(ROWS_PER_TASK) {
                tasks.push((ei, j0));
            }
        }
        let aq = &aq;
        let start = &start;
        for_each_task(tasks.len(), p_total * h * inter / 4, |ti| {
            let (ei, j0) = tasks[ti];
            let j1 = (j0 + ROWS_PER_TASK).min(h);
            let w = &ex.down.data[ei * h * down_rb..(ei + 1) * h * down_rb];
            let (a0, m) = (start[ei], start[ei + 1] - start[ei]);
            rows_against(isa, ex.down.ty, w, down_rb, j0, j1, aq, a0, m, |r, j, v| {
                // SAFETY: as above, for the down buffer.
                unsafe { y_ptr.slice((a0 + r) * h + j, 1)[0] = T::round(v) };
            });
        });
    }

    // 5. Per token: its rows times their weights, summed in expert order. The sorted
    //    positions of a token's pairs increase with the expert id (stable grouping).
    let optr = match out {
        Out::F32(o) => OutPtr::F32(o.as_mut_ptr()),
        Out::Bf16(o) => OutPtr::Bf16(o.as_mut_ptr()),
    };
    const TOKENS_PER_TASK: usize = 4;
    let (y, pos) = (&y, &pos);
    for_each_task(t.div_ceil(TOKENS_PER_TASK), t * k * h, |task| {
        let mut acc = vec![0.0f32; h];
        let mut ps: Vec<(usize, f32)> = Vec::with_capacity(k);
        for r in task * TOKENS_PER_TASK..((task + 1) * TOKENS_PER_TASK).min(t) {
            ps.clear();
            ps.extend((0..k).map(|s| (pos[r * k + s], route.weights[r * k + s])));
            ps.sort_unstable_by_key(|&(p, _)| p);
            acc.fill(0.0);
            for &(p, wgt) in &ps {
                for (a, &v) in acc.iter_mut().zip(&y[p * h..(p + 1) * h]) {
                    // Two roundings, no fused multiply-add: as torch's `y * w` then `index_add_`.
                    let prod = v * wgt;
                    *a += prod;
                }
            }
            for (c, &v) in acc.iter().enumerate() {
                // SAFETY: row r of the output belongs to this task alone.
                unsafe { optr.put(r * h + c, v) };
            }
        }
    });
    Ok(max_load)
}

/// Copies quantized row `from` of `src` into row `to` of `dst` (same `k` and block).
fn copy_row(src: &QAct, from: usize, dst: &mut QAct, to: usize) {
    let (k, nb) = (src.k, src.k / src.block);
    let ns = src.sums.len() / (src.qs.len() / k);
    dst.qs[to * k..(to + 1) * k].copy_from_slice(&src.qs[from * k..(from + 1) * k]);
    dst.d[to * nb..(to + 1) * nb].copy_from_slice(&src.d[from * nb..(from + 1) * nb]);
    dst.sums[to * ns..(to + 1) * ns].copy_from_slice(&src.sums[from * ns..(from + 1) * ns]);
}

/// Weight rows `j0..j1` of `w` (`rb` bytes each, blocks of `ty`) against activation
/// rows `a0..a0 + m` of `act`: `put(r, j, v)` for activation row `a0 + r`, weight row
/// `j`. The few-row GEMM's per-task loop ([`super::gemm::quant_matmul`]), on a run of
/// rows of a bigger activation buffer.
#[allow(clippy::too_many_arguments)]
#[inline]
fn rows_against(
    isa: QIsa,
    ty: GgmlType,
    w: &[u8],
    rb: usize,
    j0: usize,
    j1: usize,
    act: &QAct,
    a0: usize,
    m: usize,
    mut put: impl FnMut(usize, usize, f32),
) {
    #[cfg(target_arch = "x86_64")]
    if m > MANY_MIN_ROWS && ty.is_k() && isa != QIsa::Scalar {
        use super::act::ActRow;
        use super::gemm::{many, many8};
        let rows: Vec<ActRow<'_>> = (a0..a0 + m).map(|r| act.row(r)).collect();
        let nb = act.k / QK_K;
        let mut j = j0;
        let mut acc8 = vec![[0.0f32; 8]; m];
        while j + 8 <= j1 {
            acc8.fill([0.0; 8]);
            // SAFETY: the ISA was checked by the caller; eight rows of `nb` super-blocks
            // `rb` bytes apart lie in `w`, every activation row holds `k` values.
            unsafe { many8(isa, ty, w[j * rb..(j + 8) * rb].as_ptr(), rb, nb, &rows, &mut acc8) };
            for (r, a) in acc8.iter().enumerate() {
                for (i, &v) in a.iter().enumerate() {
                    put(r, j + i, v);
                }
            }
            j += 8;
        }
        let mut acc = vec![0.0f32; m];
        for j in j..j1 {
            acc.fill(0.0);
            // SAFETY: as above, for one row.
            unsafe { many(isa, ty, w[j * rb..(j + 1) * rb].as_ptr(), nb, &rows, &mut acc) };
            for (r, &v) in acc.iter().enumerate() {
                put(r, j, v);
            }
        }
        return;
    }
    for j in j0..j1 {
        let wr = &w[j * rb..(j + 1) * rb];
        let mut r = 0;
        while r < m {
            let n = (m - r).min(if ty == GgmlType::Q6K { 2 } else { MR });
            let mut vals = [0.0f32; MR];
            let t = a0 + r;
            match n {
                1 => vals[..1].copy_from_slice(&dot_rows::<1>(isa, ty, wr, act, t)),
                2 => vals[..2].copy_from_slice(&dot_rows::<2>(isa, ty, wr, act, t)),
                3 => vals[..3].copy_from_slice(&dot_rows::<3>(isa, ty, wr, act, t)),
                _ => vals.copy_from_slice(&dot_rows::<4>(isa, ty, wr, act, t)),
            }
            for (i, &v) in vals.iter().enumerate().take(n) {
                put(r + i, j, v);
            }
            r += n;
        }
    }
}

#[cfg(test)]
mod tests;
