//! Attention's per-head query/key preparation in one pass: Qwen3.5's zero-centred
//! RMSNorm of each head (`x * rsqrt(mean(x^2) + eps) * (1 + w)`), then rotary position
//! embedding on the first `rotary_dim` channels (half-split layout, HF's
//! `rotate_half`): for `i < r/2`, `y[i] = x[i] cos[i] - x[i + r/2] sin[i]` and
//! `y[i + r/2] = x[i + r/2] cos[i + r/2] + x[i] sin[i + r/2]`; channels past
//! `rotary_dim` pass through. In torch this is about fifteen ops per tensor.
//! [`qk_norm_rope_bf16`] is the same for a bfloat16 model (rows widened as read,
//! float32 arithmetic, the output rounded once).

use crate::bf16::Elem;
use crate::math::{dispatch, inv_rms};
use crate::pool::for_each_task;
use crate::{KernelError, Rows, SharedMut};

const ROWS_PER_TASK: usize = 32;

struct Ctx<'a, T = f32> {
    x: Rows<'a, T>,
    heads: usize,
    /// Elements from one head's start to the next in a row of `x`.
    head_stride: usize,
    head_dim: usize,
    /// float32 (a copy, widened for bfloat16).
    weight: Vec<f32>,
    eps: f32,
    cos: Rows<'a, T>,
    sin: Rows<'a, T>,
    out: SharedMut<T>,
}

/// `x`: rows holding `heads` heads of `head_dim` channels, head `h` at
/// `h * head_stride` in the row (so a head may be followed by other data, e.g. the
/// query's output gate). `cos`/`sin` `[T, rotary_dim]`, `weight` `[head_dim]`;
/// `out` `[T, heads, head_dim]` contiguous.
#[allow(clippy::too_many_arguments)]
pub fn qk_norm_rope(
    x: Rows<'_>,
    heads: usize,
    head_stride: usize,
    weight: &[f32],
    eps: f32,
    cos: Rows<'_>,
    sin: Rows<'_>,
    out: &mut [f32],
) -> Result<(), KernelError> {
    norm_rope_with(x, heads, head_stride, weight, eps, cos, sin, out, run_task_f32)
}

/// [`qk_norm_rope`] for a bfloat16 model: every array bfloat16 bits.
#[allow(clippy::too_many_arguments)]
pub fn qk_norm_rope_bf16(
    x: Rows<'_, u16>,
    heads: usize,
    head_stride: usize,
    weight: &[u16],
    eps: f32,
    cos: Rows<'_, u16>,
    sin: Rows<'_, u16>,
    out: &mut [u16],
) -> Result<(), KernelError> {
    norm_rope_with(x, heads, head_stride, weight, eps, cos, sin, out, run_task_bf16)
}

#[allow(clippy::too_many_arguments)]
fn norm_rope_with<T: Elem>(
    x: Rows<'_, T>,
    heads: usize,
    head_stride: usize,
    weight: &[T],
    eps: f32,
    cos: Rows<'_, T>,
    sin: Rows<'_, T>,
    out: &mut [T],
    run_task: fn(&Ctx<'_, T>, usize),
) -> Result<(), KernelError> {
    let (t, d, r) = (x.rows, weight.len(), cos.width);
    if heads == 0 || d == 0 || head_stride < d || (heads - 1) * head_stride + d > x.width {
        return Err(KernelError::new(format!(
            "{heads} heads of {d} channels, {head_stride} apart, do not fit in rows of {}",
            x.width
        )));
    }
    if r % 2 != 0 || r > d || cos.rows != t || sin.rows != t || sin.width != r {
        return Err(KernelError::new(format!(
            "cos and sin must both be [T={t}, rotary_dim] with an even rotary_dim <= head_dim {d}"
        )));
    }
    if out.len() != t * heads * d {
        return Err(KernelError::new(format!(
            "out must be [T={t}, {heads}, {d}]"
        )));
    }
    let ctx = Ctx {
        x,
        heads,
        head_stride,
        head_dim: d,
        weight: T::widen(weight, &mut vec![0.0f32; d]).to_vec(),
        eps,
        cos,
        sin,
        out: SharedMut::new(out),
    };
    for_each_task(t.div_ceil(ROWS_PER_TASK), t * heads * d * 4, |i| {
        run_task(&ctx, i)
    });
    Ok(())
}

dispatch!(fn run_task_f32(ctx: &Ctx<'_, f32>, i: usize) => body_f32);
dispatch!(fn run_task_bf16(ctx: &Ctx<'_, u16>, i: usize) => body_bf16);

#[inline(always)]
fn body_f32(ctx: &Ctx<'_, f32>, i: usize) {
    run_task_body(ctx, i)
}

#[inline(always)]
fn body_bf16(ctx: &Ctx<'_, u16>, i: usize) {
    run_task_body(ctx, i)
}

#[inline(always)]
fn run_task_body<T: Elem>(ctx: &Ctx<'_, T>, i: usize) {
    let (d, r) = (ctx.head_dim, ctx.cos.width);
    let half = r / 2;
    let mut y = vec![0.0f32; d];
    // Where bfloat16 rows are widened (unused for float32, read in place).
    let wide = if std::mem::size_of::<T>() == 4 { 0 } else { 1 };
    let (mut xb, mut cb, mut sb) = (vec![0.0f32; wide * d], vec![0.0f32; wide * r], vec![0.0f32; wide * r]);
    for t in i * ROWS_PER_TASK..((i + 1) * ROWS_PER_TASK).min(ctx.x.rows) {
        let row = ctx.x.row(t);
        let cos = T::widen(ctx.cos.row(t), &mut cb);
        let sin = T::widen(ctx.sin.row(t), &mut sb);
        for h in 0..ctx.heads {
            let x = T::widen(&row[h * ctx.head_stride..h * ctx.head_stride + d], &mut xb);
            let inv = inv_rms(x, ctx.eps);
            for ((o, &v), &w) in y.iter_mut().zip(x).zip(&ctx.weight) {
                *o = (v * inv) * (1.0 + w);
            }
            // SAFETY: row t of the output belongs to this task.
            let dst = unsafe { ctx.out.slice((t * ctx.heads + h) * d, d) };
            for c in 0..half {
                dst[c] = T::narrow(y[c] * cos[c] - y[c + half] * sin[c]);
                dst[c + half] = T::narrow(y[c + half] * cos[c + half] + y[c] * sin[c + half]);
            }
            for (o, &v) in dst[r..].iter_mut().zip(&y[r..]) {
                *o = T::narrow(v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn norm_then_rotate_half() {
        let (t, heads, d, stride, r) = (5usize, 3usize, 8usize, 16usize, 4usize);
        let x: Vec<f32> = (0..t * heads * stride)
            .map(|i| ((i * 7 % 19) as f32 - 9.0) / 5.0)
            .collect();
        let w: Vec<f32> = (0..d).map(|i| i as f32 / 20.0 - 0.2).collect();
        let cos: Vec<f32> = (0..t * r).map(|i| ((i as f32) * 0.3).cos()).collect();
        let sin: Vec<f32> = (0..t * r).map(|i| ((i as f32) * 0.3).sin()).collect();
        let mut out = vec![0.0f32; t * heads * d];
        qk_norm_rope(
            Rows::dense(&x, heads * stride).unwrap(),
            heads,
            stride,
            &w,
            1e-6,
            Rows::dense(&cos, r).unwrap(),
            Rows::dense(&sin, r).unwrap(),
            &mut out,
        )
        .unwrap();
        for tt in 0..t {
            for h in 0..heads {
                let xs = &x[tt * heads * stride + h * stride..][..d];
                let inv = 1.0
                    / (xs.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / d as f64 + 1e-6)
                        .sqrt();
                let y: Vec<f64> = (0..d)
                    .map(|c| xs[c] as f64 * inv * (1.0 + w[c] as f64))
                    .collect();
                for c in 0..d {
                    let want = if c < r / 2 {
                        y[c] * cos[tt * r + c] as f64 - y[c + r / 2] * sin[tt * r + c] as f64
                    } else if c < r {
                        y[c] * cos[tt * r + c] as f64 + y[c - r / 2] * sin[tt * r + c] as f64
                    } else {
                        y[c]
                    };
                    let got = out[(tt * heads + h) * d + c] as f64;
                    assert!(
                        (got - want).abs() < 1e-5,
                        "t={tt} h={h} c={c}: {got} want {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn bf16_matches_the_float32_kernel_on_bf16_values() {
        use crate::bf16::{from_f32, to_f32};
        let (t, heads, d, stride, r) = (5usize, 3usize, 16usize, 32usize, 8usize);
        let mut seed = 9u64;
        let mut rnd = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
            to_f32(from_f32(((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0))
        };
        let width = heads * stride;
        let x: Vec<f32> = (0..t * width).map(|_| rnd()).collect();
        let w: Vec<f32> = (0..d).map(|_| to_f32(from_f32(rnd() * 0.2))).collect();
        let cos: Vec<f32> = (0..t * r).map(|_| rnd()).collect();
        let sin: Vec<f32> = (0..t * r).map(|_| rnd()).collect();
        let mut o32 = vec![0.0f32; t * heads * d];
        qk_norm_rope(
            Rows::dense(&x, width).unwrap(),
            heads,
            stride,
            &w,
            1e-6,
            Rows::dense(&cos, r).unwrap(),
            Rows::dense(&sin, r).unwrap(),
            &mut o32,
        )
        .unwrap();
        let bits = |v: &[f32]| v.iter().map(|&f| from_f32(f)).collect::<Vec<u16>>();
        let (xb, wb, cb, sb) = (bits(&x), bits(&w), bits(&cos), bits(&sin));
        let mut o16 = vec![0u16; t * heads * d];
        qk_norm_rope_bf16(
            Rows::dense(&xb, width).unwrap(),
            heads,
            stride,
            &wb,
            1e-6,
            Rows::dense(&cb, r).unwrap(),
            Rows::dense(&sb, r).unwrap(),
            &mut o16,
        )
        .unwrap();
        for (i, (&g, &want)) in o16.iter().zip(&o32).enumerate() {
            let g = to_f32(g);
            assert!(
                (g - want).abs() <= want.abs() * 2f32.powi(-8) + 1e-6,
                "{i}: {g} vs the float32 kernel's {want}"
            );
        }
    }
}
