//! A whole sparse mixture-of-experts block (Qwen3.5 MoE) in one call: routing, the
//! routed experts' SwiGLU MLPs, the gated shared expert and the weighted sum.
//!
//! Per call (one layer of one step):
//!
//! 1. Router logits `x Wr^T` and, per token, HF's routing in float32: softmax, top-k
//!    (equal probabilities chosen and ordered as `torch.topk` does, [`crate::topk`]), the k weights divided by their
//!    sum; the shared expert's gate `sigmoid(x . wg)`.
//! 2. One counting pass groups the `T x k` (token, expert) pairs by expert (stable:
//!    token order within an expert) and gathers their rows of `x` contiguously.
//! 3. Every active expert's first GEMM (`x W13`, gate and up halves) on its rows, with
//!    `silu(gate) * up` applied to each 16-column strip pair while it is in cache; the
//!    shared expert is one more group (all `T` rows, its own width), so routed and
//!    shared run as the tasks of one parallel region. Then every group's second GEMM
//!    (`act W2`), likewise one region.
//! 4. Per token, its k rows weighted and summed (in expert order, as HF's `index_add_`
//!    loop adds them) plus the gated shared row: one pass, no atomics.
//!
//! The GEMMs are the few-row kernel of [`crate::matmul`] (weights transposed, `[K, N]`
//! row-major: the dense path's layout), cut into tasks of a tile of up to
//! [`ROW_TILE`] rows by a few 16-column strips, so a large group's tile of `x` stays
//! in L2 while the strips pass over it and a small group still splits over threads.
//! Groups of more than 6 rows take the 16-row AVX-512 blocks of `strip16`
//! where the CPU has them. A routed expert of at most [`FEW_ROUTED_ROWS`] rows, and
//! the shared expert up to [`SHARED_STREAM_ROWS`] rows (16 at a time), take the
//! few-row kernel instead ([`few_rows`]: whole weight rows in memory order).

use crate::math::silu;
use crate::matmul::{run_strip16, Ctx};
use crate::pool::for_each_task;
use crate::{KernelError, Rows, SharedMut};
use few_rows::{wide_rows, FEW_ROWS, WIDE_COLS};

const STRIP: usize = 16;
/// Rows per task: a multiple of the micro-kernel's 6-row blocks.
const ROW_TILE: usize = 48;
/// Strips (or strip pairs) per task.
const STRIPS_PER_TASK: usize = 4;

/// The router: `weight_t` `[H, E]` row-major (the gate's weight transposed).
pub struct Router<'a> {
    pub weight_t: &'a [f32],
    pub num_experts: usize,
    pub top_k: usize,
}

/// The routed experts: `w13` `[E, H, 2I]` (gate columns then up), `w2` `[E, I, H]`.
pub struct Experts<'a> {
    pub w13: &'a [f32],
    pub w2: &'a [f32],
    pub inter: usize,
}

/// The shared expert: `w13` `[H, 2Is]`, `w2` `[Is, H]`, its gate's weight `[H]`.
pub struct SharedExpert<'a> {
    pub w13: &'a [f32],
    pub w2: &'a [f32],
    pub inter: usize,
    pub gate: &'a [f32],
}

/// Where the routing went: `ids` / `weights` `[T, k]`, as HF's router returns them.
pub struct Routing<'a> {
    pub ids: &'a mut [i64],
    pub weights: &'a mut [f32],
}

/// One expert's (or the shared expert's) GEMM pair over a run of rows.
struct Group<'a> {
    /// Its input rows.
    x: Rows<'a>,
    w13: &'a [f32],
    w2: &'a [f32],
    inter: usize,
    /// First row of its `act` / `y` rows in the group's buffers.
    at: usize,
    shared: bool,
}

fn check(
    x: &Rows<'_>,
    router: &Router<'_>,
    experts: &Experts<'_>,
    shared: Option<&SharedExpert<'_>>,
    out: &[f32],
    routing: &Routing<'_>,
) -> Result<(), KernelError> {
    let (t, h) = (x.rows, x.width);
    let (e, k, i) = (router.num_experts, router.top_k, experts.inter);
    if e == 0 || k == 0 || k > e || i == 0 {
        return Err(KernelError::new(format!(
            "need 1 <= top_k ({k}) <= num_experts ({e}) and moe inter ({i}) > 0"
        )));
    }
    if router.weight_t.len() != h * e {
        return Err(KernelError::new(format!(
            "router weight must be [H={h}, E={e}] (transposed), got {} elements",
            router.weight_t.len()
        )));
    }
    if experts.w13.len() != e * h * 2 * i || experts.w2.len() != e * i * h {
        return Err(KernelError::new(format!(
            "expert weights must be w13 [E={e}, H={h}, 2I={}] and w2 [E, I={i}, H]; got {} and {} elements",
            2 * i,
            experts.w13.len(),
            experts.w2.len()
        )));
    }
    if let Some(s) = shared {
        if s.inter == 0
            || s.w13.len() != h * 2 * s.inter
            || s.w2.len() != s.inter * h
            || s.gate.len() != h
        {
            return Err(KernelError::new(format!(
                "shared expert must be w13 [H={h}, 2Is], w2 [Is, H] and gate [H] with Is = {} > 0",
                s.inter
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

/// The MoE block for `x` `[T, H]` into `out` `[T, H]`; fills `routing`. Returns the
/// most rows any one expert received (the metrics' expert load).
pub fn moe_block(
    x: Rows<'_>,
    router: Router<'_>,
    experts: Experts<'_>,
    shared: Option<SharedExpert<'_>>,
    out: &mut [f32],
    routing: Routing<'_>,
) -> Result<usize, KernelError> {
    check(&x, &router, &experts, shared.as_ref(), out, &routing)?;
    let (t, h) = (x.rows, x.width);
    let (e, k, inter) = (router.num_experts, router.top_k, experts.inter);
    if t == 0 {
        return Ok(0);
    }

    let mut buffers = BUFFERS.with_borrow_mut(std::mem::take);
    let b = &mut buffers;

    // 1. Router logits (one GEMM group), then per-token routing.
    let logits = sized(&mut b.logits, t * e);
    run_gemm(x, router.weight_t, e, logits);
    let mut shared_scale = vec![0.0f32; if shared.is_some() { t } else { 0 }];
    grouping::route(
        &x,
        logits,
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
    let xs = sized(&mut b.xs, rows * h);
    grouping::gather_rows(&x, &token_of, xs);

    // 3. The GEMM pairs: active experts, then the shared expert.
    let mut groups = Vec::with_capacity(e + 1);
    for j in 0..e {
        if counts[j] > 0 {
            groups.push(Group {
                x: Rows::new(&xs[start[j] * h..start[j + 1] * h], counts[j], h, h)?,
                w13: &experts.w13[j * h * 2 * inter..(j + 1) * h * 2 * inter],
                w2: &experts.w2[j * inter * h..(j + 1) * inter * h],
                inter,
                at: start[j],
                shared: false,
            });
        }
    }
    if let Some(s) = &shared {
        groups.push(Group {
            x,
            w13: s.w13,
            w2: s.w2,
            inter: s.inter,
            at: 0,
            shared: true,
        });
    }
    let act = sized(&mut b.act, rows * inter);
    let s_inter = shared.as_ref().map_or(0, |s| s.inter);
    let act_s = sized(&mut b.act_s, t * s_inter);
    let ys = sized(&mut b.ys, rows * h);
    let ys_s = sized(&mut b.ys_s, if shared.is_some() { t * h } else { 0 });
    let bufs = |g: &Group<'_>, a: SharedMut, a_s: SharedMut| if g.shared { a_s } else { a };
    {
        let (a, a_s) = (SharedMut::new(act), SharedMut::new(act_s));
        let tasks = tasks(&groups, |g| g.inter, FEW_UP_UNITS);
        let work = groups.iter().map(|g| g.x.rows * h * 2 * g.inter).sum();
        for_each_task(tasks.len(), work, |i| {
            let (g, r0, u0) = tasks[i];
            // SAFETY: the task's rows x strip pairs of act are its own.
            unsafe { up_task(&groups[g], bufs(&groups[g], a, a_s), r0, u0) };
        });
    }
    {
        let (y, y_s) = (SharedMut::new(ys), SharedMut::new(ys_s));
        let tasks = tasks(&groups, |_| h, FEW_DOWN_UNITS);
        let work = groups.iter().map(|g| g.x.rows * h * g.inter).sum();
        let (act, act_s) = (&*act, &*act_s);
        for_each_task(tasks.len(), work, |i| {
            let (g, r0, u0) = tasks[i];
            let grp = &groups[g];
            let a = if grp.shared { act_s } else { act };
            // SAFETY: the task's rows x strips of y are its own.
            unsafe { down_task(grp, a, h, bufs(grp, y, y_s), r0, u0) };
        });
    }

    // 4. Weighted sum per token, in expert order (as HF's `index_add_` loop adds them).
    grouping::combine(ys, ys_s, &shared_scale, routing.ids, routing.weights, &pos, k, h, true, out);
    buffers.keep_small();
    BUFFERS.with_borrow_mut(|b| *b = buffers);
    Ok(counts.into_iter().max().unwrap_or(0))
}

/// The block's float buffers (router logits, gathered rows, activations, expert
/// outputs), kept per calling thread from one call to the next. Allocated zeroed and
/// freed per call, the six cost 67 / 108 / 150 us at 16 / 32 / 64 tokens of
/// `moe-bench` (233 / 467 / 934 KB; measured alone, allocation and release only), about
/// 4 % of the layer. Every call overwrites the part it reads.
#[derive(Default)]
struct Buffers {
    logits: Vec<f32>,
    xs: Vec<f32>,
    act: Vec<f32>,
    act_s: Vec<f32>,
    ys: Vec<f32>,
    ys_s: Vec<f32>,
}

/// Buffers larger than this many floats (4 MiB) are freed after the call: a prefill
/// chunk's would otherwise stay held by the thread, and at that size the allocation is
/// small beside the call's arithmetic.
const KEEP_FLOATS: usize = 1 << 20;

impl Buffers {
    fn keep_small(&mut self) {
        for v in [
            &mut self.logits,
            &mut self.xs,
            &mut self.act,
            &mut self.act_s,
            &mut self.ys,
            &mut self.ys_s,
        ] {
            if v.capacity() > KEEP_FLOATS {
                *v = Vec::new();
            }
        }
    }
}

thread_local! {
    static BUFFERS: std::cell::RefCell<Buffers> = std::cell::RefCell::new(Buffers::default());
}

/// The first `n` elements of `v`, grown (zeroed) to hold them; what an earlier call
/// left there is not cleared (each buffer's users write every element they read).
fn sized(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if v.len() < n {
        v.resize(n, 0.0);
    }
    &mut v[..n]
}

/// `out[M, N] = x wt` split into row-tile x strip tasks (unlike `matmul`, whose tasks
/// are strips of all rows: the router has few columns and, at prefill, many rows).
/// Past 6 rows a tile takes the 16-row AVX-512 blocks (the same bits as the AVX2
/// blocks: sums over the keys in order), which read each weight line once per 16 rows
/// instead of once per 6.
fn run_gemm(x: Rows<'_>, wt: &[f32], n: usize, out: &mut [f32]) {
    let ctx = Ctx {
        x,
        wt,
        n,
        out: SharedMut::new(out),
        ldo: n,
    };
    let strips = n.div_ceil(STRIP);
    let tiles = x.rows.div_ceil(ROW_TILE);
    let per = STRIPS_PER_TASK;
    let su = strips.div_ceil(per);
    for_each_task(tiles * su, x.rows * x.width * n, |i| {
        let (tile, s) = (i / su, i % su);
        let (r0, r1) = (tile * ROW_TILE, ((tile + 1) * ROW_TILE).min(x.rows));
        for st in s * per..((s + 1) * per).min(strips) {
            // SAFETY: rows r0..r1 x strip st are this task's.
            unsafe { run_strip16(&ctx, st * STRIP, r0, r1, st * STRIP) };
        }
    });
}

/// Tasks `(group, first row, first strip unit)` over every group's rows x `width(g)`
/// columns cut into strips: [`ROW_TILE`] rows x [`STRIPS_PER_TASK`] strips, or for a
/// group of at most [`FEW_ROWS`] rows, all its rows x `few_units` strips.
fn tasks(
    groups: &[Group<'_>],
    width: impl Fn(&Group<'_>) -> usize,
    few_units: usize,
) -> Vec<(usize, usize, usize)> {
    let mut out = Vec::new();
    for (gi, g) in groups.iter().enumerate() {
        let units = width(g).div_ceil(STRIP);
        let (tile, step) = if streamed(g) {
            (FEW_ROWS, few_units)
        } else {
            (ROW_TILE, STRIPS_PER_TASK)
        };
        for r0 in (0..g.x.rows).step_by(tile) {
            for u0 in (0..units).step_by(step) {
                out.push((gi, r0, u0));
            }
        }
    }
    out
}

/// True when a group's rows take the few-row kernel ([`wide_rows`], in row blocks of
/// up to [`FEW_ROWS`]): a routed expert of at most [`FEW_ROUTED_ROWS`] rows, or, with
/// AVX-512, the shared expert up to [`SHARED_STREAM_ROWS`] rows.
fn streamed(g: &Group<'_>) -> bool {
    g.x.rows <= FEW_ROUTED_ROWS
        || (g.shared && g.x.rows <= SHARED_STREAM_ROWS && crate::matmul::has_avx512())
}

/// The row block of one task of `g`.
fn row_tile(g: &Group<'_>) -> usize {
    if streamed(g) {
        FEW_ROWS
    } else {
        ROW_TILE
    }
}

/// Routed experts of at most this many rows (most experts at decode sizes) take
/// [`wide_rows`] instead of the strip kernel: at 64 tokens of `moe-bench` (4 rows per
/// expert on average) a third of the experts had 5-8 rows and read their weight
/// through the strip kernel's strided pieces. Taking 9-16 rows too measured slower
/// (64 tokens 4.25 -> 5.06 ms, one process; alone, both kernels run 9-16 rows at about
/// the FMA rate).
const FEW_ROUTED_ROWS: usize = 8;
/// The shared expert (all `T` rows) takes [`wide_rows`] in blocks of 16 rows up to
/// this many rows (past it, the strip kernel; the model hands it to BLAS past 128).
/// Its gate+up weight rows are 4 KiB apart at `moe-bench` (1,024 floats), so the strip
/// kernel's 64-byte pieces of one strip all fall in one L1 set and a few L2 sets.
/// Streaming whole rows per 16-row block reads the weight in memory order, once per
/// block: one process, MoE layer, thread CPU ms, streaming up to 16 / 32 / 64 rows:
/// 24 tokens 2.97 / 2.72 / 2.71, 32 tokens 2.88 / 2.70 / 2.75, 48 tokens 3.54 / 3.57 /
/// 3.67, 64 tokens 4.13 / 4.20 / 4.11 (load 5): it pays for one or two blocks, not for
/// three or four re-reads of the 1.5 MB.
const SHARED_STREAM_ROWS: usize = 32;
/// Strip units per task of a few-row group: first GEMM (gate and up halves), second.
const FEW_UP_UNITS: usize = WIDE_COLS / 2 / STRIP;
const FEW_DOWN_UNITS: usize = WIDE_COLS / STRIP;

thread_local! {
    /// The few-row path's gate+up outputs before `silu(gate) * up` (reused: zeroing a
    /// fresh buffer per task cost as much as a small expert's arithmetic).
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// First GEMM of a task's rows and strip pairs, with `silu(gate) * up` into `act`.
///
/// # Safety
/// The task's rows x columns of `act` (a `[rows, I]` buffer, rows from `g.at`) must be
/// its own.
unsafe fn up_task(g: &Group<'_>, act: SharedMut, r0: usize, u0: usize) {
    let i = g.inter;
    let r1 = (r0 + row_tile(g)).min(g.x.rows);
    let n = r1 - r0;
    let x = Rows {
        data: &g.x.data[r0 * g.x.stride..],
        rows: n,
        width: g.x.width,
        stride: g.x.stride,
    };
    if streamed(g) {
        let c0 = u0 * STRIP;
        let w = (FEW_UP_UNITS * STRIP).min(i - c0);
        // Rows a 16-float vector more than the gate+up width apart: at a width that is
        // a multiple of 1 KiB (e.g. 1,024 floats) every row's same column would fall in
        // one L1 set, and 9-16 rows of accumulators would not fit its 8 ways.
        let ldo = (2 * w).next_multiple_of(STRIP) + STRIP;
        SCRATCH.with_borrow_mut(|scratch| {
            if scratch.len() < n * ldo {
                scratch.resize(n * ldo, 0.0);
            }
            let ctx = Ctx {
                x,
                wt: g.w13,
                n: 2 * i,
                out: SharedMut::new(scratch),
                ldo,
            };
            // Gate columns at 0, up columns at `half`: the whole row in one stream when
            // the task covers all of the intermediate size.
            let half = if w == i {
                wide_rows(&ctx, n, 0, 2 * i, 0);
                i
            } else {
                wide_rows(&ctx, n, c0, w, 0);
                wide_rows(&ctx, n, i + c0, w, w);
                w
            };
            for r in 0..n {
                let s = &scratch[r * ldo..];
                let dst = act.slice((g.at + r0 + r) * i + c0, w);
                for (c, d) in dst.iter_mut().enumerate() {
                    *d = silu(s[c]) * s[half + c];
                }
            }
        });
        return;
    }
    // Gate strip in columns 0..16, up strip in 16..32.
    let mut scratch = [0.0f32; ROW_TILE * 2 * STRIP];
    let ctx = Ctx {
        x,
        wt: g.w13,
        n: 2 * i,
        out: SharedMut::new(&mut scratch),
        ldo: 2 * STRIP,
    };
    let units = i.div_ceil(STRIP);
    for u in u0..(u0 + STRIPS_PER_TASK).min(units) {
        let c0 = u * STRIP;
        let w = STRIP.min(i - c0);
        run_strip16(&ctx, c0, 0, n, 0);
        run_strip16(&ctx, i + c0, 0, n, STRIP);
        for r in 0..n {
            let s = &scratch[r * 2 * STRIP..];
            let dst = act.slice((g.at + r0 + r) * i + c0, w);
            for (c, d) in dst.iter_mut().enumerate() {
                *d = silu(s[c]) * s[STRIP + c];
            }
        }
    }
}

/// Second GEMM of a task's rows and strips into `y` (`[rows, H]`, rows from `g.at`).
///
/// # Safety
/// The task's rows x strips of `y` must be its own.
unsafe fn down_task(g: &Group<'_>, act: &[f32], h: usize, y: SharedMut, r0: usize, u0: usize) {
    let i = g.inter;
    let r1 = (r0 + row_tile(g)).min(g.x.rows);
    let x = Rows {
        data: &act[(g.at + r0) * i..(g.at + r1) * i],
        rows: r1 - r0,
        width: i,
        stride: i,
    };
    let ctx = Ctx {
        x,
        wt: g.w2,
        n: h,
        out: y.add((g.at + r0) * h),
        ldo: h,
    };
    if streamed(g) {
        let c0 = u0 * STRIP;
        wide_rows(&ctx, r1 - r0, c0, (FEW_DOWN_UNITS * STRIP).min(h - c0), c0);
        return;
    }
    let strips = h.div_ceil(STRIP);
    for s in u0..(u0 + STRIPS_PER_TASK).min(strips) {
        run_strip16(&ctx, s * STRIP, 0, r1 - r0, s * STRIP);
    }
}

mod few_rows;
pub(crate) mod grouping;
use grouping::ByExpert;

#[cfg(test)]
mod tests;
