//! RMSNorm with the residual add fused in (one pass over the rows instead of torch's
//! add, pow, mean, add, rsqrt, mul, add, mul).
//!
//! `residual += x` (when a residual is given), then
//! `out = r * rsqrt(mean(r^2) + eps) * (1 + weight)` (Qwen3.5's zero-centred weight) or
//! `* weight` (plain), with `r` the updated residual or `x`.

use crate::math::{dispatch, inv_rms};
use crate::pool::for_each_task;
use crate::{KernelError, SharedMut};

const ROWS_PER_TASK: usize = 64;

struct Ctx<'a> {
    x: &'a [f32],
    residual: Option<SharedMut>,
    weight: &'a [f32],
    eps: f32,
    centered: bool,
    out: SharedMut,
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
    let ctx = Ctx {
        x,
        residual: residual.map(SharedMut::new),
        weight,
        eps,
        centered,
        out: SharedMut::new(out),
    };
    for_each_task(t.div_ceil(ROWS_PER_TASK), t * d * 4, |i| run_task(&ctx, i));
    Ok(())
}

dispatch!(fn run_task(ctx: &Ctx<'_>, i: usize) => run_task_body);

#[inline(always)]
fn run_task_body(ctx: &Ctx<'_>, i: usize) {
    let d = ctx.weight.len();
    let t = ctx.x.len() / d;
    for row in i * ROWS_PER_TASK..((i + 1) * ROWS_PER_TASK).min(t) {
        let x = &ctx.x[row * d..(row + 1) * d];
        let src: &[f32] = match ctx.residual {
            Some(r) => {
                // SAFETY: this row of the residual belongs to this task.
                let r = unsafe { r.slice(row * d, d) };
                for (a, &b) in r.iter_mut().zip(x) {
                    *a += b;
                }
                r
            }
            None => x,
        };
        let inv = inv_rms(src, ctx.eps);
        // SAFETY: this row of the output belongs to this task.
        let dst = unsafe { ctx.out.slice(row * d, d) };
        if ctx.centered {
            for ((o, &v), &w) in dst.iter_mut().zip(src).zip(ctx.weight) {
                *o = (v * inv) * (1.0 + w);
            }
        } else {
            for ((o, &v), &w) in dst.iter_mut().zip(src).zip(ctx.weight) {
                *o = (v * inv) * w;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
