//! A whole sparse mixture-of-experts block (Qwen3.5 MoE) in one call: routing, the
//! routed experts' SwiGLU MLPs, the gated shared expert and the weighted sum.
//!
//! Per call (one layer of one step):
//!
//! 1. Router logits `x Wr^T` and, per token, HF's routing in float32: softmax, top-k
//!    (ties to the lower expert index, as `torch.topk`), the k weights divided by their
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
//! where the CPU has them; groups of at most [`FEW_ROWS`] rows stream their weight
//! whole ([`wide_rows`]).

use crate::math::{dispatch, sigmoid, silu};
use crate::matmul::{run_strip, Ctx};
use crate::pool::for_each_task;
use crate::matmul::run_strip16;
use crate::{KernelError, Rows, SharedMut};

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

    // 1. Router logits (one GEMM group), then per-token routing.
    let mut logits = vec![0.0f32; t * e];
    run_gemm(x, router.weight_t, e, &mut logits);
    let mut shared_scale = vec![0.0f32; if shared.is_some() { t } else { 0 }];
    route(
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
    let mut counts = vec![0usize; e];
    for &id in routing.ids.iter() {
        counts[id as usize] += 1;
    }
    let mut start = vec![0usize; e + 1];
    for j in 0..e {
        start[j + 1] = start[j] + counts[j];
    }
    let mut fill = start.clone();
    let mut pos = vec![0usize; t * k];
    let mut token_of = vec![0usize; t * k];
    for (p, &id) in routing.ids.iter().enumerate() {
        let row = fill[id as usize];
        fill[id as usize] += 1;
        pos[p] = row;
        token_of[row] = p / k;
    }
    let rows = t * k;
    let mut xs = vec![0.0f32; rows * h];
    {
        let dst = SharedMut::new(&mut xs);
        let chunk = 64;
        for_each_task(rows.div_ceil(chunk), rows * h, |c| {
            let r0 = c * chunk;
            for (r, &tok) in token_of
                .iter()
                .enumerate()
                .take((r0 + chunk).min(rows))
                .skip(r0)
            {
                // SAFETY: row r of xs belongs to this task alone.
                unsafe { dst.slice(r * h, h) }.copy_from_slice(x.row(tok));
            }
        });
    }

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
    let mut act = vec![0.0f32; rows * inter];
    let s_inter = shared.as_ref().map_or(0, |s| s.inter);
    let mut act_s = vec![0.0f32; t * s_inter];
    let mut ys = vec![0.0f32; rows * h];
    let mut ys_s = vec![0.0f32; if shared.is_some() { t * h } else { 0 }];
    let bufs = |g: &Group<'_>, a: SharedMut, a_s: SharedMut| if g.shared { a_s } else { a };
    {
        let (a, a_s) = (SharedMut::new(&mut act), SharedMut::new(&mut act_s));
        let tasks = tasks(&groups, |g| g.inter, FEW_UP_UNITS);
        let work = groups.iter().map(|g| g.x.rows * h * 2 * g.inter).sum();
        for_each_task(tasks.len(), work, |i| {
            let (g, r0, u0) = tasks[i];
            // SAFETY: the task's rows x strip pairs of act are its own.
            unsafe { up_task(&groups[g], bufs(&groups[g], a, a_s), r0, u0) };
        });
    }
    {
        let (y, y_s) = (SharedMut::new(&mut ys), SharedMut::new(&mut ys_s));
        let tasks = tasks(&groups, |_| h, FEW_DOWN_UNITS);
        let work = groups.iter().map(|g| g.x.rows * h * g.inter).sum();
        let (act, act_s) = (&act, &act_s);
        for_each_task(tasks.len(), work, |i| {
            let (g, r0, u0) = tasks[i];
            let grp = &groups[g];
            let a = if grp.shared { act_s } else { act };
            // SAFETY: the task's rows x strips of y are its own.
            unsafe { down_task(grp, a, h, bufs(grp, y, y_s), r0, u0) };
        });
    }

    // 4. Weighted sum per token.
    {
        let dst = SharedMut::new(out);
        let ids = &*routing.ids;
        let w = &*routing.weights;
        let chunk = 32;
        for_each_task(t.div_ceil(chunk), rows * h, |c| {
            let mut order: Vec<usize> = (0..k).collect();
            for tok in c * chunk..((c + 1) * chunk).min(t) {
                // SAFETY: row tok of out belongs to this task alone.
                let o = unsafe { dst.slice(tok * h, h) };
                o.fill(0.0);
                order.sort_unstable_by_key(|&j| ids[tok * k + j]);
                for &j in &order {
                    let wj = w[tok * k + j];
                    let y = &ys[pos[tok * k + j] * h..][..h];
                    for (ov, &yv) in o.iter_mut().zip(y) {
                        *ov += yv * wj;
                    }
                }
                if !ys_s.is_empty() {
                    let sg = shared_scale[tok];
                    for (ov, &yv) in o.iter_mut().zip(&ys_s[tok * h..][..h]) {
                        *ov += sg * yv;
                    }
                }
            }
        });
    }
    Ok(counts.into_iter().max().unwrap_or(0))
}

/// `out[M, N] = x wt` split into row-tile x strip tasks (unlike `matmul`, whose tasks
/// are strips of all rows: the router has few columns and, at prefill, many rows).
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
            unsafe { run_strip(&ctx, st * STRIP, r0, r1, st * STRIP) };
        }
    });
}

/// HF's routing for every token: softmax (float32, times the reciprocal of the sum as
/// torch's CPU softmax does), top-k, renormalise; the shared gate's sigmoid.
#[allow(clippy::too_many_arguments)]
fn route(
    x: &Rows<'_>,
    logits: &[f32],
    e: usize,
    k: usize,
    gate: Option<&[f32]>,
    ids: &mut [i64],
    weights: &mut [f32],
    shared_scale: &mut [f32],
) {
    let t = x.rows;
    let (ids_p, w_p) = (SharedI64(ids.as_mut_ptr()), SharedMut::new(weights));
    let sc = SharedMut::new(shared_scale);
    let chunk = 32;
    for_each_task(t.div_ceil(chunk), t * e * 8, |c| {
        let mut probs = vec![0.0f32; e];
        for tok in c * chunk..((c + 1) * chunk).min(t) {
            let l = &logits[tok * e..(tok + 1) * e];
            let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0f32;
            for (p, &v) in probs.iter_mut().zip(l) {
                *p = crate::math::exp(v - max);
                sum += *p;
            }
            let inv = 1.0 / sum;
            for p in probs.iter_mut() {
                *p *= inv;
            }
            // SAFETY: token tok's k entries belong to this task alone.
            let (id_row, w_row) = unsafe { (ids_p.slice(tok * k, k), w_p.slice(tok * k, k)) };
            for j in 0..k {
                // The largest remaining probability; ties to the lower index.
                let mut best = usize::MAX;
                for (cand, &p) in probs.iter().enumerate() {
                    if p.is_nan() || id_row[..j].contains(&(cand as i64)) {
                        continue;
                    }
                    if best == usize::MAX || p > probs[best] {
                        best = cand;
                    }
                }
                let best = if best == usize::MAX { j } else { best };
                id_row[j] = best as i64;
                w_row[j] = probs[best];
            }
            let total: f32 = w_row.iter().sum();
            for w in w_row.iter_mut() {
                *w /= total;
            }
            if let Some(g) = gate {
                // SAFETY: entry tok belongs to this task alone.
                let dst = unsafe { sc.slice(tok, 1) };
                dst[0] = sigmoid(crate::math::dot(x.row(tok), g));
            }
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
        let step = if g.x.rows <= FEW_ROWS {
            few_units
        } else {
            STRIPS_PER_TASK
        };
        for r0 in (0..g.x.rows).step_by(ROW_TILE) {
            for u0 in (0..units).step_by(step) {
                out.push((gi, r0, u0));
            }
        }
    }
    out
}

/// Groups of at most this many rows (most experts at decode sizes) take
/// [`wide_rows`] instead of the strip kernel. 8, not 4: at 64 tokens of `moe-bench`
/// (4 rows per expert on average) a third of the experts had 5-8 rows and read their
/// weight through the strip kernel's strided pieces.
const FEW_ROWS: usize = 8;
/// Columns [`wide_rows`] computes per call: an expert's whole gate+up row up to an
/// intermediate size of 512 (35B-A3B's), its whole down row up to 1,024.
const WIDE_COLS: usize = 1024;
/// Strip units per task of a few-row group: first GEMM (gate and up halves), second.
const FEW_UP_UNITS: usize = WIDE_COLS / 2 / STRIP;
const FEW_DOWN_UNITS: usize = WIDE_COLS / STRIP;

dispatch!(fn wide_rows(ctx: &Ctx<'_>, m: usize, c0: usize, w: usize, oc: usize) => wide_rows_body);

/// `out[r, oc..oc + w] = x[r] wt[:, c0..c0 + w]` for `m <= FEW_ROWS` rows and
/// `w <= WIDE_COLS`, reading the weight key by key as contiguous runs of `w` floats
/// (for a whole row, one sequential stream). An expert with a row or two is bound by
/// reading its weight once from memory: the strip kernel's 64-byte pieces a row
/// stride apart ran 3x slower (6.9 vs 2.3 ms at 16 tokens x 64 experts whose weights
/// do not fit in cache; MKL 9.5 ms), and so did register-blocked passes of 16 keys
/// over all strips (3.6 ms). The accumulators stay in L1.
#[inline(always)]
fn wide_rows_body(ctx: &Ctx<'_>, m: usize, c0: usize, w: usize, oc: usize) {
    #[cfg(target_arch = "x86_64")]
    if crate::matmul::has_avx512() {
        // SAFETY: AVX-512F is present; the caller's task owns these output columns.
        unsafe { avx512::wide_rows(ctx, m, c0, w, oc) };
        return;
    }
    portable_rows(ctx, m, c0, w, oc);
}

/// [`wide_rows_body`] without AVX-512: the compiler vectorises [`wide_rows_m`].
#[inline(always)]
fn portable_rows(ctx: &Ctx<'_>, m: usize, c0: usize, w: usize, oc: usize) {
    match m {
        1 => wide_rows_m::<1, STREAMS>(ctx, c0, w, oc),
        2 => wide_rows_m::<2, STREAMS>(ctx, c0, w, oc),
        3 => wide_rows_m::<3, STREAMS>(ctx, c0, w, oc),
        4 => wide_rows_m::<4, STREAMS>(ctx, c0, w, oc),
        5 => wide_rows_m::<5, STREAMS>(ctx, c0, w, oc),
        6 => wide_rows_m::<6, STREAMS>(ctx, c0, w, oc),
        7 => wide_rows_m::<7, STREAMS>(ctx, c0, w, oc),
        _ => wide_rows_m::<8, STREAMS>(ctx, c0, w, oc),
    }
}

/// Weight streams [`wide_rows_m`] reads at once: the key range cut in this many parts
/// walked in lockstep, so more memory requests are in flight than one sequential
/// stream's hardware prefetcher keeps (measured at 16 tokens x 64 experts, thread CPU
/// time, one process: the MoE layer 1.71 ms with one stream, 1.65 with two, 1.62 with
/// four; at 4 tokens 0.66 -> 0.56 ms).
const STREAMS: usize = 4;

/// [`wide_rows_body`] for `M` rows and `S` weight streams ([`STREAMS`]): each weight
/// element is loaded once for all `M` rows (a row-at-a-time pass would load it `M`
/// times from L1).
#[inline(always)]
fn wide_rows_m<const M: usize, const S: usize>(ctx: &Ctx<'_>, c0: usize, w: usize, oc: usize) {
    let mut acc = [[0.0f32; WIDE_COLS]; M];
    let w = w.min(WIDE_COLS);
    let k = ctx.x.width;
    let part = k / S;
    let step = |acc: &mut [[f32; WIDE_COLS]; M], kk: usize| {
        let wr = &ctx.wt[kk * ctx.n + c0..][..w];
        let xv: [f32; M] = std::array::from_fn(|r| ctx.x.row(r)[kk]);
        let rows = acc.each_mut().map(|a| &mut a[..w]);
        for (c, &wv) in wr.iter().enumerate() {
            for r in 0..M {
                // SAFETY: c < w, the length of every row slice.
                unsafe {
                    let a = rows[r].get_unchecked_mut(c);
                    *a += xv[r] * wv;
                }
            }
        }
    };
    for kk in 0..part {
        let wr: [&[f32]; S] = std::array::from_fn(|s| &ctx.wt[(kk + s * part) * ctx.n + c0..][..w]);
        let xv: [[f32; M]; S] =
            std::array::from_fn(|s| std::array::from_fn(|r| ctx.x.row(r)[kk + s * part]));
        let rows = acc.each_mut().map(|a| &mut a[..w]);
        for c in 0..w {
            for r in 0..M {
                // SAFETY: c < w, the length of every row and weight slice.
                unsafe {
                    let a = rows[r].get_unchecked_mut(c);
                    let mut v = *a;
                    for s in 0..S {
                        v += xv[s][r] * *wr[s].get_unchecked(c);
                    }
                    *a = v;
                }
            }
        }
    }
    for kk in S * part..k {
        step(&mut acc, kk);
    }
    for (r, a) in acc.iter().enumerate() {
        // SAFETY: the caller's task owns these output columns of these rows.
        unsafe { ctx.out.slice(r * ctx.ldo + oc, w) }.copy_from_slice(&a[..w]);
    }
}

/// [`wide_rows`] with explicit AVX-512 fused multiply-adds: the same walk as
/// [`wide_rows_m`] (the key range in [`STREAMS`] parts read in lock-step, one
/// sequential stream each, accumulators in L1), 16 columns per vector. Rust never
/// contracts `a += x * w` into an FMA, so the portable body pays a multiply and an add
/// per element and row. (Accumulators in registers over a 32-column block, walking
/// every key a weight row apart, ran 2x slower: the weight is then read in 128-byte
/// pieces a row stride apart, which the prefetcher does not follow.)
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{Ctx, FEW_ROWS};
    use std::arch::x86_64::*;

    /// # Safety
    /// AVX-512F must be present; the caller owns the output columns `oc..oc + w` of
    /// every row.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn wide_rows(ctx: &Ctx<'_>, m: usize, c0: usize, w: usize, oc: usize) {
        match m {
            1 => rows::<1>(ctx, c0, w, oc),
            2 => rows::<2>(ctx, c0, w, oc),
            3 => rows::<3>(ctx, c0, w, oc),
            4 => rows::<4>(ctx, c0, w, oc),
            5 => rows::<5>(ctx, c0, w, oc),
            6 => rows::<6>(ctx, c0, w, oc),
            7 => rows::<7>(ctx, c0, w, oc),
            _ => rows::<FEW_ROWS>(ctx, c0, w, oc),
        }
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn rows<const M: usize>(ctx: &Ctx<'_>, c0: usize, w: usize, oc: usize) {
        const S: usize = super::STREAMS;
        let w = w.min(super::WIDE_COLS);
        let k = ctx.x.width;
        let part = k / S;
        let xs: [*const f32; M] = std::array::from_fn(|r| ctx.x.row(r).as_ptr());
        let wt = ctx.wt.as_ptr();
        let mut acc = [[0.0f32; super::WIDE_COLS]; M];
        let vecs = w / 16;
        let tail = w % 16;
        let mt: __mmask16 = ((1u32 << tail) - 1) as u16;
        // One pass over the columns per group of S keys (the S key ranges walked in
        // lock-step, one sequential stream each), accumulators in L1.
        let pass = |acc: &mut [[f32; super::WIDE_COLS]; M], keys: [usize; S], ns: usize| {
            let ws: [*const f32; S] = std::array::from_fn(|s| wt.add(keys[s] * ctx.n + c0));
            let xv: [[__m512; M]; S] =
                std::array::from_fn(|s| std::array::from_fn(|r| _mm512_set1_ps(*xs[r].add(keys[s]))));
            for v in 0..vecs + (tail > 0) as usize {
                let mask = if v < vecs { 0xffff } else { mt };
                let wv: [__m512; S] = std::array::from_fn(|s| {
                    if s < ns { _mm512_maskz_loadu_ps(mask, ws[s].add(v * 16)) } else { _mm512_setzero_ps() }
                });
                for r in 0..M {
                    let a = acc[r].as_mut_ptr().add(v * 16);
                    let mut t = _mm512_loadu_ps(a);
                    for s in 0..ns {
                        t = _mm512_fmadd_ps(xv[s][r], wv[s], t);
                    }
                    _mm512_storeu_ps(a, t);
                }
            }
        };
        for kk in 0..part {
            pass(&mut acc, std::array::from_fn(|s| kk + s * part), S);
        }
        for kk in S * part..k {
            pass(&mut acc, [kk; S], 1);
        }
        for (r, a) in acc.iter().enumerate() {
            ctx.out.slice(r * ctx.ldo + oc, w).copy_from_slice(&a[..w]);
        }
    }
}

/// First GEMM of a task's rows and strip pairs, with `silu(gate) * up` into `act`.
///
/// # Safety
/// The task's rows x columns of `act` (a `[rows, I]` buffer, rows from `g.at`) must be
/// its own.
unsafe fn up_task(g: &Group<'_>, act: SharedMut, r0: usize, u0: usize) {
    let i = g.inter;
    let r1 = (r0 + ROW_TILE).min(g.x.rows);
    let n = r1 - r0;
    let x = Rows {
        data: &g.x.data[r0 * g.x.stride..],
        rows: n,
        width: g.x.width,
        stride: g.x.stride,
    };
    if n <= FEW_ROWS {
        let c0 = u0 * STRIP;
        let w = (FEW_UP_UNITS * STRIP).min(i - c0);
        let mut scratch = [0.0f32; FEW_ROWS * WIDE_COLS + STRIP];
        let ctx = Ctx {
            x,
            wt: g.w13,
            n: 2 * i,
            out: SharedMut::new(&mut scratch),
            ldo: WIDE_COLS,
        };
        // Gate columns at 0, up columns at `half`: the whole row in one stream when
        // the task covers all of the intermediate size.
        let half = if w == i {
            wide_rows(&ctx, n, 0, 2 * i, 0);
            i
        } else {
            wide_rows(&ctx, n, c0, w, 0);
            wide_rows(&ctx, n, i + c0, w, WIDE_COLS / 2);
            WIDE_COLS / 2
        };
        for r in 0..n {
            let s = &scratch[r * WIDE_COLS..];
            let dst = act.slice((g.at + r0 + r) * i + c0, w);
            for (c, d) in dst.iter_mut().enumerate() {
                *d = silu(s[c]) * s[half + c];
            }
        }
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
    let r1 = (r0 + ROW_TILE).min(g.x.rows);
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
    if r1 - r0 <= FEW_ROWS {
        let c0 = u0 * STRIP;
        wide_rows(&ctx, r1 - r0, c0, (FEW_DOWN_UNITS * STRIP).min(h - c0), c0);
        return;
    }
    let strips = h.div_ceil(STRIP);
    for s in u0..(u0 + STRIPS_PER_TASK).min(strips) {
        run_strip16(&ctx, s * STRIP, 0, r1 - r0, s * STRIP);
    }
}

#[derive(Clone, Copy)]
struct SharedI64(*mut i64);
unsafe impl Send for SharedI64 {}
unsafe impl Sync for SharedI64 {}

impl SharedI64 {
    /// # Safety
    /// As [`SharedMut::slice`].
    unsafe fn slice<'a>(self, at: usize, len: usize) -> &'a mut [i64] {
        std::slice::from_raw_parts_mut(self.0.add(at), len)
    }
}

#[cfg(test)]
mod tests;
