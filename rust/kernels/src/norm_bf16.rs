//! [`crate::norm`]'s RMSNorm (residual add fused in) for a bfloat16 model, rounding
//! where HF's bfloat16 run rounds: `residual + x` is a bfloat16 add (stored back in
//! `residual`), the norm is computed in float32 from it and rounded once at the end.

use crate::bf16::{from_f32, to_f32};
use crate::math::{dispatch, inv_rms};
use crate::pool::for_each_task;
use crate::{KernelError, SharedMut};

const ROWS_PER_TASK: usize = 64;

struct Ctx<'a> {
    x: &'a [u16],
    residual: Option<SharedMut<u16>>,
    /// float32: widened once per call.
    weight: Vec<f32>,
    eps: f32,
    centered: bool,
    out: SharedMut<u16>,
}

/// As [`crate::norm::rms_norm`], every array bfloat16 bits: `x`, `out`, `residual`
/// `[T, D]` (contiguous), `weight` `[D]`.
pub fn rms_norm_bf16(
    x: &[u16],
    residual: Option<&mut [u16]>,
    weight: &[u16],
    eps: f32,
    centered: bool,
    out: &mut [u16],
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
        weight: weight.iter().map(|&w| to_f32(w)).collect(),
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
    let mut src = vec![0.0f32; d];
    for row in i * ROWS_PER_TASK..((i + 1) * ROWS_PER_TASK).min(t) {
        let x = &ctx.x[row * d..(row + 1) * d];
        match ctx.residual {
            Some(r) => {
                // SAFETY: this row of the residual belongs to this task.
                let r = unsafe { r.slice(row * d, d) };
                for ((s, a), &b) in src.iter_mut().zip(r.iter_mut()).zip(x) {
                    *a = from_f32(to_f32(*a) + to_f32(b));
                    *s = to_f32(*a);
                }
            }
            None => {
                for (s, &b) in src.iter_mut().zip(x) {
                    *s = to_f32(b);
                }
            }
        }
        let inv = inv_rms(&src, ctx.eps);
        // SAFETY: this row of the output belongs to this task.
        let dst = unsafe { ctx.out.slice(row * d, d) };
        let shift = if ctx.centered { 1.0 } else { 0.0 };
        for ((o, &v), &w) in dst.iter_mut().zip(&src).zip(&ctx.weight) {
            *o = from_f32((v * inv) * (shift + w));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
