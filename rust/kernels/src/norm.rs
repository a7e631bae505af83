//! RMSNorm with the residual add fused in (one pass over the rows instead of torch's
//! add, pow, mean, add, rsqrt, mul, add, mul).
//!
//! `residual += x` (when a residual is given), then
//! `out = r * rsqrt(mean(r^2) + eps) * (1 + weight)` (Qwen3.5's zero-centred weight) or
//! `* weight` (plain), with `r` the updated residual or `x`.
//!
//! One loop serves both precisions ([`Elem`]); a bfloat16 model ([`rms_norm_bf16`])
//! rounds where HF's bfloat16 run rounds: `residual + x` is a bfloat16 add (stored back
//! in `residual`), the norm is computed in float32 from it and rounded once at the end.

use crate::bf16::Elem;
use crate::math::{dispatch, inv_rms};
use crate::pool::for_each_task;
use crate::{KernelError, SharedMut};

const ROWS_PER_TASK: usize = 64;

struct Ctx<'a, T = f32> {
    x: &'a [T],
    residual: Option<SharedMut<T>>,
    /// float32: read in place, or widened once per call for bfloat16.
    weight: &'a [f32],
    eps: f32,
    centered: bool,
    out: SharedMut<T>,
}

/// `x`, `out` and `residual` are `[T, D]` (contiguous), `weight` `[D]`.
pub fn rms_norm(
    x: &[f32],
    residual: Option<&mut [f32]>,
    weight: &[f32],
    eps: f32,
    centered: bool,
    out: &mut [f32],
) -> Result<(), KernelError> {
    norm_with(x, residual, weight, eps, centered, out, run_task_f32)
}

/// [`rms_norm`] for a bfloat16 model, every array bfloat16 bits.
pub fn rms_norm_bf16(
    x: &[u16],
    residual: Option<&mut [u16]>,
    weight: &[u16],
    eps: f32,
    centered: bool,
    out: &mut [u16],
) -> Result<(), KernelError> {
    norm_with(x, residual, weight, eps, centered, out, run_task_bf16)
}

fn norm_with<T: Elem>(
    x: &[T],
    residual: Option<&mut [T]>,
    weight: &[T],
    eps: f32,
    centered: bool,
    out: &mut [T],
    run_task: fn(&Ctx<'_, T>, usize),
) -> Result<(), KernelError> {
    let d = weight.len();
    if d == 0 || x.len() % d != 0 || out.len() != x.len() {
        return Err(KernelError::new(format!(
            "x and out must be [T, D={d}] alike; got {} and {} elements",
            x.len(),
            out.len()
        )));
    }
    if residual.as_ref().is_some_and(|r| r.len() != x.len()) {
        return Err(KernelError::new(format!(
            "residual must be [T, D={d}] like x"
        )));
    }
    let t = x.len() / d;
    let mut wide = T::scratch(d);
    let ctx = Ctx {
        x,
        residual: residual.map(SharedMut::new),
        weight: T::widen(weight, &mut wide),
        eps,
        centered,
        out: SharedMut::new(out),
    };
    for_each_task(t.div_ceil(ROWS_PER_TASK), t * d * 4, |i| run_task(&ctx, i));
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
    let d = ctx.weight.len();
    let t = ctx.x.len() / d;
    // Where a bfloat16 row is widened (unused for float32, read in place).
    let mut wide = T::scratch(d);
    for row in i * ROWS_PER_TASK..((i + 1) * ROWS_PER_TASK).min(t) {
        let x = &ctx.x[row * d..(row + 1) * d];
        let src: &[f32] = match ctx.residual {
            Some(r) => {
                // SAFETY: this row of the residual belongs to this task.
                let r = unsafe { r.slice(row * d, d) };
                for (a, &b) in r.iter_mut().zip(x) {
                    *a = T::narrow(a.get() + b.get());
                }
                T::widen(r, &mut wide)
            }
            None => T::widen(x, &mut wide),
        };
        let inv = inv_rms(src, ctx.eps);
        // SAFETY: this row of the output belongs to this task.
        let dst = unsafe { ctx.out.slice(row * d, d) };
        if ctx.centered {
            for ((o, &v), &w) in dst.iter_mut().zip(src).zip(ctx.weight) {
                *o = T::narrow((v * inv) * (1.0 + w));
            }
        } else {
            for ((o, &v), &w) in dst.iter_mut().zip(src).zip(ctx.weight) {
                *o = T::narrow((v * inv) * w);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bf16::{from_f32, to_f32};

    #[test]
    fn adds_the_residual_then_normalises() {
        let (t, d) = (130usize, 40usize);
        let x: Vec<f32> = (0..t * d)
            .map(|i| ((i * 7 % 23) as f32 - 11.0) / 7.0)
            .collect();
        let r0: Vec<f32> = (0..t * d)
            .map(|i| ((i * 5 % 17) as f32 - 8.0) / 3.0)
            .collect();
        let w: Vec<f32> = (0..d).map(|i| (i as f32 - 20.0) / 50.0).collect();
        let mut r = r0.clone();
        let mut out = vec![0.0f32; t * d];
        rms_norm(&x, Some(&mut r), &w, 1e-6, true, &mut out).unwrap();
        for row in 0..t {
            let s: Vec<f64> = (0..d)
                .map(|c| r0[row * d + c] as f64 + x[row * d + c] as f64)
                .collect();
            let inv = 1.0 / (s.iter().map(|v| v * v).sum::<f64>() / d as f64 + 1e-6).sqrt();
            for c in 0..d {
                assert!((r[row * d + c] as f64 - s[c]).abs() < 1e-6);
                let want = s[c] * inv * (1.0 + w[c] as f64);
                assert!(
                    (out[row * d + c] as f64 - want).abs() < 1e-5,
                    "row {row} col {c}"
                );
            }
        }
    }

    #[test]
    fn adds_in_bf16_then_normalises_in_f32_and_rounds_once() {
        let (t, d) = (130usize, 40usize);
        let bits = |v: f32| from_f32(v);
        let x: Vec<u16> = (0..t * d).map(|i| bits(((i * 7 % 23) as f32 - 11.0) / 7.0)).collect();
        let r0: Vec<u16> = (0..t * d).map(|i| bits(((i * 5 % 17) as f32 - 8.0) / 3.0)).collect();
        let w: Vec<u16> = (0..d).map(|i| bits((i as f32 - 20.0) / 50.0)).collect();
        for centered in [true, false] {
            let mut r = r0.clone();
            let mut out = vec![0u16; t * d];
            rms_norm_bf16(&x, Some(&mut r), &w, 1e-6, centered, &mut out).unwrap();
            for row in 0..t {
                let s: Vec<f64> = (0..d)
                    .map(|c| to_f32(bits(to_f32(r0[row * d + c]) + to_f32(x[row * d + c]))) as f64)
                    .collect();
                let inv = 1.0 / (s.iter().map(|v| v * v).sum::<f64>() / d as f64 + 1e-6).sqrt();
                for c in 0..d {
                    assert_eq!(to_f32(r[row * d + c]) as f64, s[c], "residual {row},{c}");
                    let shift = if centered { 1.0 } else { 0.0 };
                    let want = s[c] * inv * (shift + to_f32(w[c]) as f64);
                    let got = to_f32(out[row * d + c]) as f64;
                    assert!(
                        (got - want).abs() <= want.abs() * 2f64.powi(-8) + 1e-6,
                        "row {row} col {c}: {got} vs {want}"
                    );
                }
            }
        }
    }
}
