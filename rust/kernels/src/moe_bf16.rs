//! The sparse mixture-of-experts block of a bfloat16 Qwen3.5 MoE model in one call,
//! the bfloat16 twin of [`crate::moe`]: routing, the routed experts' SwiGLU MLPs, the
//! gated shared expert and the weighted sum, one call per layer and step.
//!
//! The weights come in one of two layouts. As the checkpoints and HF's in-memory
//! model hold them: the router `[E, H]`, the experts' `gate_up_proj` `[E, 2I, H]`
//! (gate rows, then up rows) and `down_proj` `[E, H, I]`, the shared expert's
//! `[2Is, H]` / `[H, Is]` and its gate `[1, H]`: every one `[N, K]` row-major, what
//! the bfloat16 few-row GEMM ([`crate::matmul_bf16`]) reads as dot products over
//! contiguous weight rows (its inner kernel, [`columns`], runs per expert). Or, for
//! the routed experts (`Experts::packed`) and the shared expert (`SharedExpert::packed`),
//! each gate, up and down matrix rearranged in place into column panels of key pairs
//! ([`panels`], [`pack_experts`]: same size, no second copy), which `vdpbf16ps`
//! accumulates 16 outputs per register without lane sums and reads as one run per
//! panel: the model packs its experts at the first call (`Experts.pack_bf16`), because
//! the dot-product walk over HF's short expert rows (`K` = 192-256) reads them at
//! 9-10 GB/s from memory on one or two rows and the panels at 24-30 GB/s.
//!
//! Per call:
//!
//! 1. Router logits (bfloat16, as HF's bfloat16 `F.linear` returns them), then per
//!    token HF's routing in float32: softmax, top-k (equal probabilities chosen and
//!    ordered as `torch.topk` does, [`crate::topk`]), the k weights divided by their
//!    sum, then rounded to bfloat16
//!    (HF casts them back to the logits' dtype); the shared gate
//!    `sigmoid(x . wg)`, its logit and its sigmoid each rounded to bfloat16.
//! 2. One counting pass groups the `T x k` (token, slot) pairs by expert (stable) and
//!    gathers their rows of `x` contiguously.
//! 3. Every active expert's gate+up GEMM on its rows, `silu(gate) * up` applied to the
//!    task's columns while they are in cache; the shared expert is one more group (all
//!    `T` rows), so routed and shared share one parallel region. Then every group's down
//!    GEMM, likewise one region. Tasks are a tile of rows by a run of weight rows; for
//!    one or two rows (HF's layout) or one register block of rows (packed) the run is
//!    long and read in memory order (what reaches the stream rate, see
//!    [`crate::matmul_bf16`]): a whole expert's gate+up in one run when one task
//!    covers it.
//! 4. Per token, its k weighted rows summed plus the gated shared row: one pass.
//!
//! Where HF's bfloat16 model rounds, this rounds (HF's default `grouped_mm` experts
//! path, the one `from_pretrained` picks): each GEMM's output once to bfloat16 (the
//! logits, gate and up, the down rows, as a bfloat16 GEMM stores them), `silu(gate)`
//! then `* up` (two bfloat16 tensor ops), each routed row times its bfloat16 weight;
//! the k weighted rows are summed in float32 in slot order and rounded once (HF's
//! `view(T, k, H).sum(dim=1)`, which torch accumulates in float32 on the CPU); the
//! shared row times its gate, then the sum of routed and shared, each rounded. Same
//! rounding points, so the only differences from HF are the float32 sums' order inside
//! the GEMMs (as for every bfloat16 projection) and the last bit of `exp`; rounding
//! fewer intermediates would be more accurate but would drift from the oracle the
//! tests hold the model to (tokens equal to HF bfloat16's).

use crate::bf16::{from_f32, to_f32, Isa};
use crate::math::{dispatch, silu};
use crate::matmul_bf16::{columns, matmul_bf16, Out, OutPtr};
use crate::moe::grouping::{self, ByExpert};
use crate::moe::Routing;
use crate::pool::for_each_task;
use crate::{KernelError, Rows, SharedMut};
use panels::panel_columns;

pub mod panels;

/// The router's weight `[E, H]` (HF's `mlp.gate.weight`).
pub struct Router<'a> {
    pub weight: &'a [u16],
    pub num_experts: usize,
    pub top_k: usize,
}

/// The routed experts: `gate_up` `[E, 2I, H]` (gate rows then up rows), `down`
/// `[E, H, I]`: HF's `experts.gate_up_proj` / `experts.down_proj`; with `packed`, each
/// expert's gate `[I, H]`, up `[I, H]` and down `[H, I]` in the panel layout of
/// [`panels`] (what [`pack_experts`] makes of HF's).
pub struct Experts<'a> {
    pub gate_up: &'a [u16],
    pub down: &'a [u16],
    pub inter: usize,
    pub packed: bool,
}

/// HF's expert tensors (`gate_up` `[E, 2I, H]`, `down` `[E, H, I]`) rearranged in
/// place into the panel layout [`Experts`] `packed` reads, one matrix of scratch at a
/// time (no second copy of the weights); `unpack` the inverse.
pub fn pack_experts(
    gate_up: &mut [u16],
    down: &mut [u16],
    e: usize,
    h: usize,
    inter: usize,
    unpack: bool,
) -> Result<(), KernelError> {
    if gate_up.len() != e * 2 * inter * h || down.len() != e * h * inter {
        return Err(KernelError::new(format!(
            "expert weights must be gate_up [E={e}, 2I={}, H={h}] and down [E, H, I={inter}]; got {} and {} elements",
            2 * inter,
            gate_up.len(),
            down.len()
        )));
    }
    let f = if unpack { panels::unpack } else { panels::pack };
    let mut scratch = Vec::new();
    if inter * h > 0 {
        for m in gate_up.chunks_exact_mut(inter * h) {
            f(m, inter, h, &mut scratch);
        }
        for m in down.chunks_exact_mut(h * inter) {
            f(m, h, inter, &mut scratch);
        }
    }
    Ok(())
}

/// The shared expert: `gate_up` `[2Is, H]`, `down` `[H, Is]`, its gate's weight `[H]`;
/// with `packed`, `gate_up` and `down` in the panel layout (as one routed expert's,
/// [`pack_experts`] with `E = 1`).
pub struct SharedExpert<'a> {
    pub gate_up: &'a [u16],
    pub down: &'a [u16],
    pub inter: usize,
    pub gate: &'a [u16],
    pub packed: bool,
}

/// One expert's (or the shared expert's) GEMM pair over a run of rows.
struct Group<'a> {
    x: Rows<'a, u16>,
    gate_up: &'a [u16],
    down: &'a [u16],
    inter: usize,
    /// First row of its `act` / `y` rows in its kind's buffers.
    at: usize,
    shared: bool,
    /// Weights in the panel layout ([`panels`]).
    packed: bool,
}

/// Rows per task of a group of more than [`FEW`] rows: a multiple of the register
/// block's 4 rows; 64 rows of `x` (32 KiB at H = 256) stay in L2 while the task's
/// weight rows pass over them one 4-row block at a time.
const ROW_TILE: usize = 64;
/// One or two rows only stream the weight (see [`crate::matmul_bf16`]).
const FEW: usize = 2;
/// Intermediate columns (gate and up: twice as many weight rows) and down-projection
/// outputs per task: for few rows long in-order runs, as `matmul_bf16`'s 128 weight
/// rows per task; otherwise `matmul_bf16`'s 32 weight rows per task.
const UP_COLS_FEW: usize = 64;
const DOWN_COLS_FEW: usize = 128;
const UP_COLS: usize = 16;
const DOWN_COLS: usize = 32;
/// Columns per task on packed weights: for more rows than one register block
/// ([`panels::MR`]) one panel (its 32 KiB stay in L1/L2 while the task's row blocks
/// pass over it); for up to one block of rows four panels, a whole expert of moe-bench
/// in one task (each of gate, up and down one run in memory order: moe-bench layer,
/// one thread, thread CPU ms, 8 tokens 0.69 against 0.72 with one or two panels per
/// task; 32 tokens 1.49 / 1.61, 64 tokens 2.20 / 2.35 with such tasks for up to 6
/// rows against up to 2).
const PACKED_COLS: usize = panels::PANEL;
const PACKED_COLS_FEW: usize = 4 * panels::PANEL;

fn check(
    x: &Rows<'_, u16>,
    router: &Router<'_>,
    experts: &Experts<'_>,
    shared: Option<&SharedExpert<'_>>,
    out: &[u16],
    routing: &Routing<'_>,
) -> Result<(), KernelError> {
    let (t, h) = (x.rows, x.width);
    let (e, k, i) = (router.num_experts, router.top_k, experts.inter);
    if e == 0 || k == 0 || k > e || i == 0 || h == 0 {
        return Err(KernelError::new(format!(
            "need 1 <= top_k ({k}) <= num_experts ({e}), moe inter ({i}) > 0 and hidden ({h}) > 0"
        )));
    }
    if router.weight.len() != e * h {
        return Err(KernelError::new(format!(
            "router weight must be [E={e}, H={h}], got {} elements",
            router.weight.len()
        )));
    }
    if experts.gate_up.len() != e * 2 * i * h || experts.down.len() != e * h * i {
        return Err(KernelError::new(format!(
            "expert weights must be gate_up [E={e}, 2I={}, H={h}] and down [E, H, I={i}]; got {} and {} elements",
            2 * i,
            experts.gate_up.len(),
            experts.down.len()
        )));
    }
    if let Some(s) = shared {
        if s.inter == 0
            || s.gate_up.len() != 2 * s.inter * h
            || s.down.len() != h * s.inter
            || s.gate.len() != h
        {
            return Err(KernelError::new(format!(
                "shared expert must be gate_up [2Is, H={h}], down [H, Is] and gate [1, H] with Is = {} > 0; \
                 got {}, {} and {} elements",
                s.inter,
                s.gate_up.len(),
                s.down.len(),
                s.gate.len()
            )));
        }
    }
    if out.len() != t * h || routing.ids.len() != t * k || routing.weights.len() != t * k {
        return Err(KernelError::new(format!(
            "out must be [T={t}, H={h}] and the routing ids/weights [T, k={k}]"
        )));
    }
    Ok(())
}

/// The MoE block for `x` `[T, H]` (bfloat16 bits) into `out` `[T, H]` (bfloat16 bits);
/// fills `routing` (the weights as applied: bfloat16 values, widened). Returns the
/// most rows any one expert received (the metrics' expert load).
pub fn moe_block_bf16(
    x: Rows<'_, u16>,
    router: Router<'_>,
    experts: Experts<'_>,
    shared: Option<SharedExpert<'_>>,
    out: &mut [u16],
    routing: Routing<'_>,
) -> Result<usize, KernelError> {
    check(&x, &router, &experts, shared.as_ref(), out, &routing)?;
    let (t, h) = (x.rows, x.width);
    let (e, k, inter) = (router.num_experts, router.top_k, experts.inter);
    if t == 0 {
        return Ok(0);
    }
    let isa = Isa::detect();

    // 1. Router logits, rounded to bfloat16 as HF's bfloat16 linear stores them, then
    //    the routing.
    let mut logits = vec![0u16; t * e];
    matmul_bf16(x, router.weight, e, Out::Bf16(&mut logits))?;
    let mut shared_scale = vec![0.0f32; if shared.is_some() { t } else { 0 }];
    grouping::route(
        &x,
        &logits,
        e,
        k,
        shared.as_ref().map(|s| s.gate),
        routing.ids,
        routing.weights,
        &mut shared_scale,
    );

    // 2. Counting sort of the (token, slot) pairs by expert; `pos[t * k + j]` is the
    //    pair's row in the grouped buffers.
    let ByExpert { counts, start, pos, token_of } = grouping::sort_by_expert(routing.ids, e, k);
    let rows = t * k;
    let mut xs = vec![0u16; rows * h];
    grouping::gather_rows(&x, &token_of, &mut xs);

    // 3. The GEMM pairs: active experts, then the shared expert.
    let mut groups = Vec::with_capacity(e + 1);
    for j in 0..e {
        if counts[j] > 0 {
            groups.push(Group {
                x: Rows::new(&xs[start[j] * h..start[j + 1] * h], counts[j], h, h)?,
                gate_up: &experts.gate_up[j * 2 * inter * h..(j + 1) * 2 * inter * h],
                down: &experts.down[j * h * inter..(j + 1) * h * inter],
                inter,
                at: start[j],
                shared: false,
                packed: experts.packed,
            });
        }
    }
    if let Some(s) = &shared {
        groups.push(Group {
            x,
            gate_up: s.gate_up,
            down: s.down,
            inter: s.inter,
            at: 0,
            shared: true,
            packed: s.packed,
        });
    }
    let s_inter = shared.as_ref().map_or(0, |s| s.inter);
    let mut act = vec![0u16; rows * inter];
    let mut act_s = vec![0u16; t * s_inter];
    let mut ys = vec![0u16; rows * h];
    let mut ys_s = vec![0u16; if shared.is_some() { t * h } else { 0 }];
    {
        let (a, a_s) = (SharedMut::new(&mut act), SharedMut::new(&mut act_s));
        let tasks = tasks(&groups, |g| g.inter, UP_COLS_FEW, UP_COLS);
        let work = groups.iter().map(|g| g.x.rows * h * 2 * g.inter).sum();
        for_each_task(tasks.len(), work, |n| {
            let (gi, r0, c0) = tasks[n];
            let g = &groups[gi];
            // SAFETY: the task's rows x columns of act are its own; the ISA is the
            // detected one.
            unsafe { up_task(isa, g, if g.shared { a_s } else { a }, r0, c0) };
        });
    }
    {
        let (y, y_s) = (SharedMut::new(&mut ys), SharedMut::new(&mut ys_s));
        let tasks = tasks(&groups, |_| h, DOWN_COLS_FEW, DOWN_COLS);
        let work = groups.iter().map(|g| g.x.rows * h * g.inter).sum();
        let (act, act_s) = (&act, &act_s);
        for_each_task(tasks.len(), work, |n| {
            let (gi, r0, c0) = tasks[n];
            let g = &groups[gi];
            let (a, y) = if g.shared { (act_s, y_s) } else { (act, y) };
            // SAFETY: the task's rows x columns of y are its own.
            unsafe { down_task(isa, g, a, h, y, r0, c0) };
        });
    }

    // 4. Per token: the k weighted rows in float32 (slot order), rounded once, plus
    //    the gated shared row.
    grouping::combine(&ys, &ys_s, &shared_scale, routing.ids, routing.weights, &pos, k, h, false, out);
    Ok(counts.into_iter().max().unwrap_or(0))
}

/// Tasks `(group, first row, first column)` over every group's rows x `width(g)`
/// columns: all of a few-row group's rows x `few_cols` columns, or [`ROW_TILE`] rows
/// x `cols` columns.
fn tasks(
    groups: &[Group<'_>],
    width: impl Fn(&Group<'_>) -> usize,
    few_cols: usize,
    cols: usize,
) -> Vec<(usize, usize, usize)> {
    let mut out = Vec::new();
    for (gi, g) in groups.iter().enumerate() {
        let (tile, step) = task_shape(g, few_cols, cols);
        for r0 in (0..g.x.rows).step_by(tile) {
            for c0 in (0..width(g)).step_by(step) {
                out.push((gi, r0, c0));
            }
        }
    }
    out
}

/// (rows, columns) of one task of `g` (whole panels on packed weights).
fn task_shape(g: &Group<'_>, few_cols: usize, cols: usize) -> (usize, usize) {
    match (g.packed, g.x.rows) {
        (false, r) if r <= FEW => (FEW, few_cols),
        (false, _) => (ROW_TILE, cols),
        (true, r) if r <= panels::MR => (panels::MR, PACKED_COLS_FEW),
        (true, _) => (ROW_TILE, PACKED_COLS),
    }
}

dispatch!(
    /// `dst = silu(gate) * up` from a row's float32 gate and up sums, with each op's
    /// bfloat16 result as HF's tensors hold them: gate and up (the GEMM's output),
    /// `silu(gate)`, the product. Compiled for AVX2 too (the loop vectorises).
    fn activate(gate: &[f32], up: &[f32], dst: &mut [u16]) => activate_body
);

#[inline(always)]
fn activate_body(gate: &[f32], up: &[f32], dst: &mut [u16]) {
    for ((d, &g), &u) in dst.iter_mut().zip(gate).zip(up) {
        let (g, u) = (to_f32(from_f32(g)), to_f32(from_f32(u)));
        *d = from_f32(to_f32(from_f32(silu(g))) * u);
    }
}

thread_local! {
    /// A task's gate+up sums before `silu(gate) * up` (reused across tasks).
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Gate+up GEMM of a task's rows and intermediate columns `c0..`, then
/// `silu(gate) * up` into `act` (`[rows, I]`, rows from `g.at`).
///
/// # Safety
/// `isa` must be supported; the task's rows x columns of `act` must be its own.
unsafe fn up_task(isa: Isa, g: &Group<'_>, act: SharedMut<u16>, r0: usize, c0: usize) {
    let i = g.inter;
    let (tile, cols) = task_shape(g, UP_COLS_FEW, UP_COLS);
    let r1 = (r0 + tile).min(g.x.rows);
    let n = r1 - r0;
    let c1 = (c0 + cols).min(i);
    let w = c1 - c0;
    let x = Rows {
        data: &g.x.data[r0 * g.x.stride..],
        rows: n,
        width: g.x.width,
        stride: g.x.stride,
    };
    SCRATCH.with_borrow_mut(|scratch| {
        // Gate sums in columns 0..w, up sums in w..2w.
        let ldo = 2 * w;
        if scratch.len() < n * ldo {
            scratch.resize(n * ldo, 0.0);
        }
        let out = OutPtr::F32(scratch.as_mut_ptr());
        if g.packed {
            // Gate then up, each an [I, H] matrix of panels.
            let (gate, up) = g.gate_up.split_at(i * x.width);
            panel_columns(isa, &x, gate, i, c0, c1, out, ldo, 0);
            panel_columns(isa, &x, up, i, c0, c1, out, ldo, w);
        } else if w == i {
            // The expert's whole gate+up: one run in memory order.
            columns(isa, &x, g.gate_up, 0, 2 * i, out, ldo, 0);
        } else {
            columns(isa, &x, g.gate_up, c0, c1, out, ldo, 0);
            columns(isa, &x, g.gate_up, i + c0, i + c1, out, ldo, w);
        }
        for r in 0..n {
            let s = &scratch[r * ldo..(r + 1) * ldo];
            activate(
                &s[..w],
                &s[w..2 * w],
                act.slice((g.at + r0 + r) * i + c0, w),
            );
        }
    });
}

/// Down GEMM of a task's rows and output columns `c0..` into `y` (`[rows, H]`
/// bfloat16, rows from `g.at`).
///
/// # Safety
/// `isa` must be supported; the task's rows x columns of `y` must be its own.
unsafe fn down_task(
    isa: Isa,
    g: &Group<'_>,
    act: &[u16],
    h: usize,
    y: SharedMut<u16>,
    r0: usize,
    c0: usize,
) {
    let i = g.inter;
    let (tile, cols) = task_shape(g, DOWN_COLS_FEW, DOWN_COLS);
    let r1 = (r0 + tile).min(g.x.rows);
    let x = Rows {
        data: &act[(g.at + r0) * i..(g.at + r1) * i],
        rows: r1 - r0,
        width: i,
        stride: i,
    };
    let c1 = (c0 + cols).min(h);
    let out = OutPtr::Bf16(y.add((g.at + r0) * h).0);
    if g.packed {
        panel_columns(isa, &x, g.down, h, c0, c1, out, h, c0);
    } else {
        columns(isa, &x, g.down, c0, c1, out, h, c0);
    }
}

#[cfg(test)]
mod tests;
