//! The gated delta rule over a flattened varlen batch, in place on the state pool.
//!
//! Per value head, with state `S` `[K, V]` and, per token, `q, k` `[K]` (l2-normalised,
//! `q` then scaled), `v` `[V]`, log-decay `g` and write strength `beta`:
//!
//! ```text
//! S <- exp(g) S
//! S <- S + k (beta (v - S^T k))^T
//! o  = S^T q
//! ```
//!
//! This is `transformers`' `torch_recurrent_gated_delta_rule`, token by token. On a
//! CPU it beats the chunked form for the head sizes of the Qwen3.5 family: the state
//! stays in L1, each token is two passes over it (decay + read `S^T k`, then write +
//! read `S^T q`), and there is no `c x c` intra-chunk work or solve. Key head `j`
//! serves value heads `j * H/Hk ..` (HF's `repeat_interleave`), read without expanding.
//!
//! Tasks are (sequence, value head) pairs: each owns its state item (found through the
//! sequence's state page table, [`PagedState`]) and its output elements, so they run in
//! parallel without locks. A requested checkpoint (the state after the run's first `k`
//! tokens) is copied out by the task as it passes token `k`: no second pass.
//!
//! A bfloat16 model ([`gated_delta_rule_bf16`]) passes its activations and parameters
//! as bfloat16 bits: each token's rows are widened as the task reads them, the state
//! stays float32 (as HF keeps it), and the output is rounded where HF's bfloat16 run
//! rounds (the rule's output, then inside the gated norm), once each.

use crate::bf16::Elem;
use crate::math::{dispatch, inv_rms, sigmoid, silu, softplus, sum_sq};
use crate::pool::for_each_task;
use crate::{KernelError, PagedState, Rows, SharedMut, Varlen};

/// Head counts and sizes.
#[derive(Clone, Copy, Debug)]
pub struct Heads {
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
}

/// Where each token's log-decay `g` and write strength `beta` come from.
#[derive(Clone, Copy, Debug)]
pub enum Gates<'a, T = f32> {
    /// Given: `g` and `beta` `[T, H]`.
    Direct { g: Rows<'a, T>, beta: Rows<'a, T> },
    /// Gated DeltaNet's projections: `beta = sigmoid(b)`,
    /// `g = -exp(a_log) * softplus(a + dt_bias)` (`a`, `b` `[T, H]`; `a_log`, `dt_bias` `[H]`).
    /// For bfloat16, `beta` is rounded to bfloat16 as HF's `b.sigmoid()` is; `g` is float32.
    Raw {
        a: Rows<'a, T>,
        b: Rows<'a, T>,
        a_log: &'a [T],
        dt_bias: &'a [T],
    },
}

/// The gated RMSNorm Gated DeltaNet applies to each head's output:
/// `weight * rmsnorm(o) * silu(z)` (plain weight, not 1-centred).
#[derive(Clone, Copy, Debug)]
pub struct OutputNorm<'a, T = f32> {
    /// `[T, H * V]`.
    pub z: Rows<'a, T>,
    /// `[V]`.
    pub weight: &'a [T],
    pub eps: f32,
}

struct Ctx<'a, T = f32> {
    q: Rows<'a, T>,
    k: Rows<'a, T>,
    v: Rows<'a, T>,
    gates: Gates<'a, T>,
    norm: Option<OutputNorm<'a, T>>,
    /// The small parameter vectors as float32 (`[H]`, `[H]`, `[V]`; empty when unused):
    /// read in place, or widened once per call for bfloat16.
    a_log: &'a [f32],
    dt_bias: &'a [f32],
    norm_weight: &'a [f32],
    heads: Heads,
    scale: f32,
    l2norm: bool,
    varlen: Varlen<'a>,
    paged: PagedState<'a>,
    state: SharedMut,
    out: SharedMut<T>,
}

/// Runs the recurrence for every sequence of the batch.
///
/// * `q`, `k` `[T, Hk * K]`, `v` `[T, H * V]` (row-strided views allowed).
/// * `state`: the pool; value head `h` of sequence `b` is the `K x V` item
///   `paged.item(b, h)` (`paged.item_len` must be `K * V`). A sequence starts from
///   there when `has_initial_state[b]`, else from zeros, and its final state is left
///   there; with a checkpoint position `k`, the state after its first `k` tokens is
///   also copied to `paged.checkpoint(b, h)`. Sequences with no rows are untouched.
/// * `out` `[T, H * V]`: the output, normalised by `norm` when given.
/// * `l2norm`: l2-normalise q and k (eps 1e-6, HF's formula) before `q * scale`.
///
/// O(T * H * K * V) arithmetic; state traffic O(B * H * K * V).
#[allow(clippy::too_many_arguments)]
pub fn gated_delta_rule(
    q: Rows<'_>,
    k: Rows<'_>,
    v: Rows<'_>,
    gates: Gates<'_>,
    norm: Option<OutputNorm<'_>>,
    heads: Heads,
    scale: f32,
    l2norm: bool,
    state: &mut [f32],
    paged: PagedState<'_>,
    varlen: Varlen<'_>,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let args = (q, k, v, gates, norm, heads, scale, l2norm);
    rule_with(args, state, paged, varlen, out, run_task_f32)
}

/// [`gated_delta_rule`] for a bfloat16 model: `q`, `k`, `v`, the gates' inputs and
/// parameters, `z`, the norm weight and `out` are bfloat16 bits; the state is float32.
#[allow(clippy::too_many_arguments)]
pub fn gated_delta_rule_bf16(
    q: Rows<'_, u16>,
    k: Rows<'_, u16>,
    v: Rows<'_, u16>,
    gates: Gates<'_, u16>,
    norm: Option<OutputNorm<'_, u16>>,
    heads: Heads,
    scale: f32,
    l2norm: bool,
    state: &mut [f32],
    paged: PagedState<'_>,
    varlen: Varlen<'_>,
    out: &mut [u16],
) -> Result<(), KernelError> {
    let args = (q, k, v, gates, norm, heads, scale, l2norm);
    rule_with(args, state, paged, varlen, out, run_task_bf16)
}

type RuleArgs<'a, T> = (
    Rows<'a, T>,
    Rows<'a, T>,
    Rows<'a, T>,
    Gates<'a, T>,
    Option<OutputNorm<'a, T>>,
    Heads,
    f32,
    bool,
);

fn rule_with<T: Elem>(
    (q, k, v, gates, norm, heads, scale, l2norm): RuleArgs<'_, T>,
    state: &mut [f32],
    paged: PagedState<'_>,
    varlen: Varlen<'_>,
    out: &mut [T],
    portable: TaskFn<T>,
) -> Result<(), KernelError> {
    let Heads {
        key_heads: hk,
        value_heads: h,
        key_dim: kd,
        value_dim: vd,
    } = heads;
    if hk == 0 || h == 0 || kd == 0 || vd == 0 || h % hk != 0 {
        return Err(KernelError::new(format!(
            "heads: value heads ({h}) must be a positive multiple of key heads ({hk}), dims positive"
        )));
    }
    let t = q.rows;
    let check = |name: &str, r: &Rows<'_, T>, width: usize| {
        if r.rows != t || r.width != width {
            Err(KernelError::new(format!(
                "{name} must be [T={t}, {width}], got [{}, {}]",
                r.rows, r.width
            )))
        } else {
            Ok(())
        }
    };
    check("q", &q, hk * kd)?;
    check("k", &k, hk * kd)?;
    check("v", &v, h * vd)?;
    let (mut wide_a, mut wide_dt, mut wide_w) = (T::scratch(h), T::scratch(h), T::scratch(vd));
    let (mut a_log, mut dt_bias, mut norm_weight): (&[f32], &[f32], &[f32]) = (&[], &[], &[]);
    match &gates {
        Gates::Direct { g, beta } => {
            check("g", g, h)?;
            check("beta", beta, h)?;
        }
        Gates::Raw {
            a,
            b,
            a_log: al,
            dt_bias: dt,
        } => {
            check("a", a, h)?;
            check("b", b, h)?;
            if al.len() != h || dt.len() != h {
                return Err(KernelError::new(format!(
                    "A_log and dt_bias must have H = {h} entries"
                )));
            }
            (a_log, dt_bias) = (T::widen(al, &mut wide_a), T::widen(dt, &mut wide_dt));
        }
    }
    if let Some(n) = &norm {
        check("z", &n.z, h * vd)?;
        if n.weight.len() != vd {
            return Err(KernelError::new(format!(
                "the norm weight must have V = {vd} entries"
            )));
        }
        norm_weight = T::widen(n.weight, &mut wide_w);
    }
    if paged.item_len != kd * vd {
        return Err(KernelError::new(format!(
            "state items must be K x V = {kd} x {vd}, got {} elements",
            paged.item_len
        )));
    }
    if out.len() != t * h * vd {
        return Err(KernelError::new(format!(
            "out must be [T={t}, H*V={}]",
            h * vd
        )));
    }
    varlen.validate(t)?;
    paged.validate(&varlen, h, state.len())?;

    let ctx = Ctx {
        q,
        k,
        v,
        gates,
        norm,
        a_log,
        dt_bias,
        norm_weight,
        heads,
        scale,
        l2norm,
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
    let work = t * h * kd * vd * 4;
    let task = task_fn(vd, portable);
    for_each_task(runs.len() * h, work, |i| task(&ctx, runs[i / h], i % h));
    Ok(())
}

dispatch!(fn run_task_f32(ctx: &Ctx<'_, f32>, b: usize, head: usize) => body_f32);
dispatch!(fn run_task_bf16(ctx: &Ctx<'_, u16>, b: usize, head: usize) => body_bf16);

#[inline(always)]
fn body_f32(ctx: &Ctx<'_, f32>, b: usize, head: usize) {
    run_task_body(ctx, b, head)
}

#[inline(always)]
fn body_bf16(ctx: &Ctx<'_, u16>, b: usize, head: usize) {
    run_task_body(ctx, b, head)
}

type TaskFn<T> = fn(&Ctx<'_, T>, usize, usize);

thread_local! {
    /// A read-only run's private copy of its state item, kept for the thread's next
    /// such task: no allocation per task, and the buffer stays in the thread's cache.
    static PRIVATE_STATE: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// The hand-vectorised task for value dims of 32, 64 or 128 (Qwen3.5's sizes): with
/// AVX-512 registers where the CPU has them, else AVX2 ones (the same bits either
/// way, see [`simd`]); `portable` for other dims and CPUs.
fn task_fn<T: Elem>(vd: usize, portable: TaskFn<T>) -> TaskFn<T> {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::math::has_avx512f() && !tests_force_avx2() {
            match vd {
                32 => return |c, b, h| unsafe { simd::run_task_avx512::<2, T>(c, b, h) },
                64 => return |c, b, h| unsafe { simd::run_task_avx512::<4, T>(c, b, h) },
                128 => return |c, b, h| unsafe { simd::run_task_avx512::<8, T>(c, b, h) },
                _ => {}
            }
        }
        if crate::math::has_avx2() {
            match vd {
                32 => return |c, b, h| unsafe { simd::run_task_avx2::<4, T>(c, b, h) },
                64 => return |c, b, h| unsafe { simd::run_task_avx2::<8, T>(c, b, h) },
                128 => return |c, b, h| unsafe { simd::run_task_avx2::<16, T>(c, b, h) },
                _ => {}
            }
        }
    }
    portable
}

/// Tests set this to run the AVX2 task where the CPU has AVX-512 too (other tests
/// running meanwhile then take the AVX2 task as well: the same bits).
#[cfg(test)]
static FORCE_AVX2: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

#[inline(always)]
fn tests_force_avx2() -> bool {
    #[cfg(test)]
    return FORCE_AVX2.load(std::sync::atomic::Ordering::Relaxed);
    #[cfg(not(test))]
    false
}

/// Per-token inputs: normalised `k`, scaled normalised `q`, decay `exp(g)` and `beta`.
/// `wide`: `2 K` floats where bfloat16 rows are widened (empty for float32).
#[inline(always)]
fn token_inputs<T: Elem>(
    ctx: &Ctx<'_, T>,
    t: usize,
    j: usize,
    head: usize,
    kn: &mut [f32],
    qn: &mut [f32],
    wide: &mut [f32],
) -> (f32, f32) {
    let kd = ctx.heads.key_dim;
    let (qw, kw) = wide.split_at_mut(wide.len() / 2);
    let qr = T::widen(&ctx.q.row(t)[j * kd..(j + 1) * kd], qw);
    let kr = T::widen(&ctx.k.row(t)[j * kd..(j + 1) * kd], kw);
    let (qs, ks) = if ctx.l2norm {
        (
            1.0 / (sum_sq(qr) + 1e-6).sqrt(),
            1.0 / (sum_sq(kr) + 1e-6).sqrt(),
        )
    } else {
        (1.0, 1.0)
    };
    for i in 0..kd {
        kn[i] = kr[i] * ks;
        qn[i] = (qr[i] * qs) * ctx.scale;
    }
    let (g, beta) = match &ctx.gates {
        Gates::Direct { g, beta } => (g.row(t)[head].get(), beta.row(t)[head].get()),
        Gates::Raw { a, b: bb, .. } => (
            -ctx.a_log[head].exp() * softplus(a.row(t)[head].get() + ctx.dt_bias[head]),
            T::round(sigmoid(bb.row(t)[head].get())),
        ),
    };
    (g.exp(), beta)
}

/// Writes token `t`'s output `o` (normalised when asked) to its row. For bfloat16,
/// HF's rounding points: the rule's output is rounded before the norm, the normalised
/// value before the weight, the weighted value before the gate (all no-ops for
/// float32). `o` is the task's scratch (rounded in place); `wide`: `V` floats for a
/// bfloat16 `z` row (empty for float32).
#[inline(always)]
fn write_output<T: Elem>(ctx: &Ctx<'_, T>, t: usize, head: usize, o: &mut [f32], wide: &mut [f32]) {
    let (h, vd) = (ctx.heads.value_heads, o.len());
    // SAFETY: row t, head `head` of the output belongs to this task.
    let dst = unsafe { ctx.out.slice((t * h + head) * vd, vd) };
    match &ctx.norm {
        None => {
            for (d, &x) in dst.iter_mut().zip(o.iter()) {
                *d = T::narrow(x);
            }
        }
        Some(n) => {
            for x in o.iter_mut() {
                *x = T::round(*x);
            }
            let r = inv_rms(o, n.eps);
            let z = T::widen(&n.z.row(t)[head * vd..(head + 1) * vd], wide);
            for (((d, &x), &w), &zz) in dst.iter_mut().zip(o.iter()).zip(ctx.norm_weight).zip(z) {
                *d = T::narrow(T::round(w * T::round(x * r)) * silu(zz));
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod simd {
    //! Rows of `L::N * NV` values held in `NV` vector registers; the correction and
    //! the output accumulators stay in registers across the sweep. One body for two
    //! widths: AVX2 (8 lanes, 16 registers) and AVX-512 (16 lanes, 32 registers). At
    //! Qwen3.5's value dim of 128 the AVX2 task's three rows of accumulators (48
    //! registers' worth) spill to the stack on every step of the sweep; AVX-512 holds
    //! them (24 registers). Every operation is lane by lane, so both widths give each
    //! state element and output the same bits.
    //!
    //! Token `t` needs two sweeps over the state: decay it and read `S^T k`, then
    //! write `k delta^T` and read `S^T q`. The second sweep of token `t` and the first
    //! of token `t + 1` are fused, so a run of `L` tokens makes `L + 1` sweeps instead
    //! of `2L`.
    use super::{token_inputs, write_output, Ctx, Heads};
    use crate::bf16::Elem;
    use std::arch::x86_64::*;

    /// A float32 vector register and the lane-wise operations the task uses. The
    /// methods are `#[inline(always)]` so that they compile into the caller's
    /// `target_feature` function (the entry points below).
    pub(super) trait Lanes: Copy {
        /// Lanes per register.
        const N: usize;
        unsafe fn zero() -> Self;
        unsafe fn splat(x: f32) -> Self;
        unsafe fn load(p: *const f32) -> Self;
        unsafe fn store(self, p: *mut f32);
        unsafe fn sub(self, o: Self) -> Self;
        unsafe fn mul(self, o: Self) -> Self;
        /// `self * b + c`, rounded once.
        unsafe fn fmadd(self, b: Self, c: Self) -> Self;
    }

    #[derive(Clone, Copy)]
    pub(super) struct Ymm(__m256);
    #[derive(Clone, Copy)]
    pub(super) struct Zmm(__m512);

    /// `Lanes` for a register wrapper, from the intrinsics of its width.
    macro_rules! lanes {
        ($t:ident, $n:expr, $zero:ident, $set1:ident, $load:ident, $store:ident, $sub:ident, $mul:ident, $fmadd:ident) => {
            impl Lanes for $t {
                const N: usize = $n;
                #[inline(always)]
                unsafe fn zero() -> Self {
                    $t($zero())
                }
                #[inline(always)]
                unsafe fn splat(x: f32) -> Self {
                    $t($set1(x))
                }
                #[inline(always)]
                unsafe fn load(p: *const f32) -> Self {
                    $t($load(p))
                }
                #[inline(always)]
                unsafe fn store(self, p: *mut f32) {
                    $store(p, self.0)
                }
                #[inline(always)]
                unsafe fn sub(self, o: Self) -> Self {
                    $t($sub(self.0, o.0))
                }
                #[inline(always)]
                unsafe fn mul(self, o: Self) -> Self {
                    $t($mul(self.0, o.0))
                }
                #[inline(always)]
                unsafe fn fmadd(self, b: Self, c: Self) -> Self {
                    $t($fmadd(self.0, b.0, c.0))
                }
            }
        };
    }
    lanes!(Ymm, 8, _mm256_setzero_ps, _mm256_set1_ps, _mm256_loadu_ps, _mm256_storeu_ps, _mm256_sub_ps, _mm256_mul_ps, _mm256_fmadd_ps);
    lanes!(Zmm, 16, _mm512_setzero_ps, _mm512_set1_ps, _mm512_loadu_ps, _mm512_storeu_ps, _mm512_sub_ps, _mm512_mul_ps, _mm512_fmadd_ps);

    /// The task with 8-lane registers (`NV = V / 8`).
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn run_task_avx2<const NV: usize, T: Elem>(ctx: &Ctx<'_, T>, b: usize, head: usize) {
        run_task::<Ymm, NV, T>(ctx, b, head)
    }

    /// The task with 16-lane registers (`NV = V / 16`).
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn run_task_avx512<const NV: usize, T: Elem>(ctx: &Ctx<'_, T>, b: usize, head: usize) {
        run_task::<Zmm, NV, T>(ctx, b, head)
    }

    /// Token t's first sweep: decay the state read at `src` into `dst` (the same
    /// place, or a read-only run's private copy), and return `S^T k`.
    #[inline(always)]
    unsafe fn first_sweep<L: Lanes, const NV: usize>(
        src: *const f32,
        dst: *mut f32,
        kn: &[f32],
        decay: f32,
        vd: usize,
    ) -> [L; NV] {
        let mut mem = [L::zero(); NV];
        let dv = L::splat(decay);
        for (kk, &kc) in kn.iter().enumerate() {
            let kc = L::splat(kc);
            for (i, m) in mem.iter_mut().enumerate() {
                let at = kk * vd + L::N * i;
                let x = L::load(src.add(at)).mul(dv);
                x.store(dst.add(at));
                *m = x.fmadd(kc, *m);
            }
        }
        mem
    }

    #[inline(always)]
    unsafe fn run_task<L: Lanes, const NV: usize, T: Elem>(ctx: &Ctx<'_, T>, b: usize, head: usize) {
        let Heads {
            key_heads: hk,
            value_heads: h,
            key_dim: kd,
            value_dim: vd,
        } = ctx.heads;
        debug_assert_eq!(vd, L::N * NV);
        let j = head / (h / hk);
        let (start, end) = ctx.varlen.run(b);
        // SAFETY: this (sequence, head) item is this task's alone (pages distinct among
        // the runs and their checkpoints, validated; one task per head).
        let item = ctx.state.slice(ctx.paged.item(b, head), kd * vd);
        // A read-only (speculative) run advances a private copy, this thread's scratch:
        // its item stays as it was. The first sweep reads the item and writes the copy,
        // so the item is read once.
        let read_only = ctx.paged.is_read_only(b);
        let mut scratch = if read_only { super::PRIVATE_STATE.with(|p| p.take()) } else { Vec::new() };
        let (src, sp): (*const f32, *mut f32) = if read_only {
            scratch.resize(kd * vd, 0.0);
            let s = scratch.as_mut_ptr();
            if ctx.varlen.has_initial_state[b] {
                (item.as_ptr(), s)
            } else {
                scratch.fill(0.0);
                (s, s)
            }
        } else {
            if !ctx.varlen.has_initial_state[b] {
                item.fill(0.0);
            }
            (item.as_ptr(), item.as_mut_ptr())
        };
        // Absolute row after which the state is the checkpoint (never `start`: k >= 1).
        let ckpt = ctx.paged.checkpoint(b, head);
        let ck_row = ckpt.map_or(usize::MAX, |(k, _)| start + k);
        let (mut kn, mut qn) = (vec![0.0f32; kd], vec![0.0f32; kd]);
        let (mut kn2, mut qn2) = (vec![0.0f32; kd], vec![0.0f32; kd]);
        // Where bfloat16 q/k, v and z rows are widened (empty for float32).
        let (mut wide_qk, mut wide_v, mut wide_z) = (T::scratch(2 * kd), T::scratch(vd), T::scratch(vd));
        let mut o = vec![0.0f32; vd];
        let zero = L::zero();
        let (decay, mut beta) = token_inputs(ctx, start, j, head, &mut kn, &mut qn, &mut wide_qk);
        let mut mem = first_sweep::<L, NV>(src, sp, &kn, decay, vd);
        for t in start..end {
            let vr = T::widen(&ctx.v.row(t)[head * vd..(head + 1) * vd], &mut wide_v).as_ptr();
            let bv = L::splat(beta);
            let mut delta = [zero; NV];
            for i in 0..NV {
                delta[i] = L::load(vr.add(L::N * i)).sub(mem[i]).mul(bv);
            }
            let mut acc = [zero; NV];
            if t + 1 < end && t + 1 != ck_row {
                let (decay2, beta2) = token_inputs(ctx, t + 1, j, head, &mut kn2, &mut qn2, &mut wide_qk);
                let dv = L::splat(decay2);
                let mut mem2 = [zero; NV];
                for kk in 0..kd {
                    let (kc, qc, kc2) = (L::splat(kn[kk]), L::splat(qn[kk]), L::splat(kn2[kk]));
                    for i in 0..NV {
                        let p = sp.add(kk * vd + L::N * i);
                        let w = kc.fmadd(delta[i], L::load(p));
                        acc[i] = w.fmadd(qc, acc[i]);
                        let w2 = w.mul(dv);
                        mem2[i] = w2.fmadd(kc2, mem2[i]);
                        w2.store(p);
                    }
                }
                mem = mem2;
                beta = beta2;
            } else {
                // The run's last token, or the checkpoint's: the state must be whole
                // after this token, so no fused decay of the next one.
                for kk in 0..kd {
                    let (kc, qc) = (L::splat(kn[kk]), L::splat(qn[kk]));
                    for i in 0..NV {
                        let p = sp.add(kk * vd + L::N * i);
                        let w = kc.fmadd(delta[i], L::load(p));
                        acc[i] = w.fmadd(qc, acc[i]);
                        w.store(p);
                    }
                }
                if t + 1 == ck_row {
                    if let Some((_, at)) = ckpt {
                        // SAFETY: the checkpoint item is this task's alone (validated).
                        ctx.state
                            .slice(at, kd * vd)
                            .copy_from_slice(std::slice::from_raw_parts(sp, kd * vd));
                    }
                    if t + 1 < end {
                        let (decay2, beta2) = token_inputs(ctx, t + 1, j, head, &mut kn2, &mut qn2, &mut wide_qk);
                        mem = first_sweep::<L, NV>(sp, sp, &kn2, decay2, vd);
                        beta = beta2;
                    }
                }
            }
            for (i, a) in acc.iter().enumerate() {
                a.store(o.as_mut_ptr().add(L::N * i));
            }
            write_output(ctx, t, head, &mut o, &mut wide_z);
            std::mem::swap(&mut kn, &mut kn2);
            std::mem::swap(&mut qn, &mut qn2);
        }
        if read_only {
            super::PRIVATE_STATE.with(|p| p.set(scratch));
        }
    }
}

/// The portable task: two sweeps over the state per token (see the `simd` module for
/// the fused form).
#[inline(always)]
fn run_task_body<T: Elem>(ctx: &Ctx<'_, T>, b: usize, head: usize) {
    let Heads {
        key_heads: hk,
        value_heads: h,
        key_dim: kd,
        value_dim: vd,
    } = ctx.heads;
    let j = head / (h / hk);
    let (start, end) = ctx.varlen.run(b);
    // SAFETY: this (sequence, head) item is this task's alone: pages are distinct among
    // running sequences and their checkpoints (validated) and each head is one task.
    let item = unsafe { ctx.state.slice(ctx.paged.item(b, head), kd * vd) };
    // A read-only (speculative) run advances a private copy: its item stays as it was.
    let mut private: Vec<f32>;
    let s: &mut [f32] = if ctx.paged.is_read_only(b) {
        private = item.to_vec();
        &mut private
    } else {
        item
    };
    if !ctx.varlen.has_initial_state[b] {
        s.fill(0.0);
    }
    let ckpt = ctx.paged.checkpoint(b, head);
    let mut kn = vec![0.0f32; kd];
    let mut qn = vec![0.0f32; kd];
    let (mut wide_qk, mut wide_v, mut wide_z) = (T::scratch(2 * kd), T::scratch(vd), T::scratch(vd));
    let mut mem = vec![0.0f32; vd];
    let mut o = vec![0.0f32; vd];
    for t in start..end {
        let vr = T::widen(&ctx.v.row(t)[head * vd..(head + 1) * vd], &mut wide_v);
        let (decay, beta) = token_inputs(ctx, t, j, head, &mut kn, &mut qn, &mut wide_qk);
        // Pass 1: decay the state and read S^T k.
        mem.fill(0.0);
        for (row, &kc) in s.chunks_exact_mut(vd).zip(&kn) {
            for (x, m) in row.iter_mut().zip(mem.iter_mut()) {
                *x *= decay;
                *m += *x * kc;
            }
        }
        for (m, &vv) in mem.iter_mut().zip(vr) {
            *m = (vv - *m) * beta; // now the correction to write
        }
        // Pass 2: write k delta^T and read S^T q.
        o.fill(0.0);
        for ((row, &kc), &qc) in s.chunks_exact_mut(vd).zip(&kn).zip(&qn) {
            for ((x, &d), oo) in row.iter_mut().zip(&mem).zip(o.iter_mut()) {
                *x += kc * d;
                *oo += *x * qc;
            }
        }
        write_output(ctx, t, head, &mut o, &mut wide_z);
        if let Some((k, at)) = ckpt {
            if t + 1 == start + k {
                // SAFETY: the checkpoint item is this task's alone (validated).
                unsafe { ctx.state.slice(at, kd * vd) }.copy_from_slice(s);
            }
        }
    }
}

#[cfg(test)]
mod tests;
