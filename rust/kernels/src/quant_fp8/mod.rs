//! `y = x W^T` for few rows on weights kept in a checkpoint's quantized form: FP8
//! e4m3 with one float32 scale per 128 x 128 block (Qwen's and DeepSeek's official FP8
//! checkpoints), and 4-bit integers with a float32 scale and zero point per group of
//! inputs (AWQ's int4, repacked at load into rows; see [`int4_matmul`]).
//!
//! A decode step's GEMMs are bound by reading the weight, and these read 1 byte (FP8)
//! or half a byte (int4) per weight instead of bfloat16's 2. Each output is a dot
//! product of an `x` row with one weight row (stored `[N, K]`, contiguous along `K`):
//! a block (FP8: 128 inputs, int4: one group) of the weight row is widened once into
//! a float32 buffer in L1, then every row of `x` takes its dot product with it, in
//! 16 float32 lanes, scaled per block into 16 lane totals that are summed once per
//! output. The widening is plain Rust that the compiler vectorises, built for AVX-512
//! and for AVX2 + FMA (chosen at run time), plain Rust elsewhere.
//!
//! FP8 widening: an e4m3 byte's bits `s eeee mmm` placed at a float32's sign and
//! exponent / mantissa top (`s << 24 | (eeee mmm) << 20`) are the float32 whose value
//! is the e4m3 value times `2^-120` (exponent bias 127 vs 7; e4m3's subnormals land
//! on float32 subnormals of the same mantissa), so one multiply by `2^120` gives the
//! exact value. e4m3's NaN (`0x7f` / `0xff`) is not expected in weights and reads as
//! 480.

use crate::bf16::Elem;
use crate::pool::for_each_task;
use crate::{KernelError, Rows};

/// FP8 block edge (rows and inputs per scale).
pub const FP8_BLOCK: usize = 128;
/// Inputs per packed int4 run: 32 bytes, input `i` in byte `i`'s low nibble and input
/// `32 + i` in its high nibble.
pub const INT4_RUN: usize = 64;
/// Rows of `x` per pass over the weight (larger inputs are split).
const MAX_M: usize = 16;
/// Weight rows per task.
const ROWS_PER_TASK: usize = 64;
const LANES: usize = 16;

#[derive(Clone, Copy)]
struct SendPtr<T>(*mut T);
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}

/// `sum_i a[i] b[i]` into 16 lanes `acc` (`a`, `b` the same length).
#[inline(always)]
fn dot_lanes<const FMA: bool>(a: &[f32], b: &[f32], acc: &mut [f32; LANES]) {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut ca = a.chunks_exact(LANES);
    let mut cb = b.chunks_exact(LANES);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for i in 0..LANES {
            acc[i] = if FMA {
                x[i].mul_add(y[i], acc[i])
            } else {
                acc[i] + x[i] * y[i]
            };
        }
    }
    for (i, (x, y)) in ca.remainder().iter().zip(cb.remainder()).enumerate() {
        acc[i] += x * y;
    }
}

#[inline(always)]
fn decode_fp8(src: &[u8], dst: &mut [f32]) {
    const TWO_120: f32 = 1.329_228e36; // 2^120
    for (d, &b) in dst.iter_mut().zip(src) {
        let b = b as u32;
        *d = f32::from_bits(((b & 0x80) << 24) | ((b & 0x7f) << 20)) * TWO_120;
    }
}

#[inline(always)]
fn decode_int4(src: &[u8], dst: &mut [f32]) {
    // src: whole runs of 32 bytes; dst: 64 values per run.
    for (s, d) in src
        .chunks_exact(INT4_RUN / 2)
        .zip(dst.chunks_exact_mut(INT4_RUN))
    {
        let (lo, hi) = d.split_at_mut(INT4_RUN / 2);
        for i in 0..INT4_RUN / 2 {
            lo[i] = (s[i] & 0xf) as f32;
            hi[i] = (s[i] >> 4) as f32;
        }
    }
}

/// What differs between the formats: how a block of a weight row widens, and its
/// scale (and, for int4, the zero point's correction).
#[derive(Clone, Copy)]
enum Format<'a> {
    Fp8 {
        w: &'a [u8],
        scale: &'a [f32],
        scale_cols: usize,
        row_offset: usize,
    },
    Int4 {
        w: &'a [u8],
        scales: &'a [f32],
        zeros: &'a [f32],
        group: usize,
    },
}

impl Format<'_> {
    fn block(&self) -> usize {
        match self {
            Format::Fp8 { .. } => FP8_BLOCK,
            Format::Int4 { group, .. } => *group,
        }
    }
}

/// Output columns `j0..j1` of rows `m0..m0 + mm` of `out` (`[M, N]`), `xf` the
/// widened `x` (`[M, K]` float32), `xsum` (int4 only) each row's sum per group.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn columns<T: Elem, const FMA: bool>(
    f: Format<'_>,
    xf: &[f32],
    xsum: &[f32],
    k: usize,
    n: usize,
    m0: usize,
    mm: usize,
    j0: usize,
    j1: usize,
    out: SendPtr<T>,
) {
    let block = f.block();
    let nblocks = k.div_ceil(block);
    let mut buf = vec![0f32; block];
    let mut tot = [[0f32; LANES]; MAX_M];
    let mut corr = [0f32; MAX_M];
    for j in j0..j1 {
        for m in 0..mm {
            tot[m] = [0.0; LANES];
            corr[m] = 0.0;
        }
        for b in 0..nblocks {
            let (c0, c1) = (b * block, ((b + 1) * block).min(k));
            let len = c1 - c0;
            let s = match f {
                Format::Fp8 {
                    w,
                    scale,
                    scale_cols,
                    row_offset,
                } => {
                    decode_fp8(&w[j * k + c0..j * k + c1], &mut buf[..len]);
                    scale[(row_offset + j) / FP8_BLOCK * scale_cols + b]
                }
                Format::Int4 {
                    w,
                    scales,
                    zeros,
                    group,
                } => {
                    let half = k / 2;
                    decode_int4(&w[j * half + c0 / 2..j * half + c1 / 2], &mut buf[..len]);
                    let g = k / group;
                    let (s, z) = (scales[j * g + b], zeros[j * g + b]);
                    for m in 0..mm {
                        corr[m] += s * z * xsum[(m0 + m) * g + b];
                    }
                    s
                }
            };
            for m in 0..mm {
                let row = &xf[(m0 + m) * k + c0..(m0 + m) * k + c1];
                let mut acc = [0f32; LANES];
                dot_lanes::<FMA>(row, &buf[..len], &mut acc);
                let t = &mut tot[m];
                for i in 0..LANES {
                    t[i] = if FMA {
                        s.mul_add(acc[i], t[i])
                    } else {
                        t[i] + s * acc[i]
                    };
                }
            }
        }
        for m in 0..mm {
            let v = tot[m].iter().sum::<f32>() - corr[m];
            // SAFETY: column j of rows m0..m0 + mm belongs to this task alone (the
            // caller's contract), and lies inside the [M, N] output.
            unsafe { *out.0.add((m0 + m) * n + j) = T::narrow(v) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512;

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn columns_avx2<T: Elem>(
    f: Format<'_>,
    xf: &[f32],
    xsum: &[f32],
    k: usize,
    n: usize,
    m0: usize,
    mm: usize,
    j0: usize,
    j1: usize,
    out: SendPtr<T>,
) {
    columns::<T, true>(f, xf, xsum, k, n, m0, mm, j0, j1, out)
}

#[cfg(target_arch = "x86_64")]
mod vbmi;

/// The instruction set the quantized kernels run on here: `"avx512"`, `"avx2"` or
/// `"scalar"` (AVX-512 takes whole 128-input blocks; other shapes the AVX2 loop).
pub fn quant_isa() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512bw")
            && std::is_x86_feature_detected!("avx512vl")
            && std::is_x86_feature_detected!("fma")
        {
            return "avx512";
        }
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            return "avx2";
        }
    }
    "scalar"
}

#[cfg(target_arch = "x86_64")]
fn has_vbmi_bf16() -> bool {
    std::is_x86_feature_detected!("avx512f")
        && std::is_x86_feature_detected!("avx512bw")
        && std::is_x86_feature_detected!("avx512vbmi")
        && std::is_x86_feature_detected!("avx512bf16")
}

/// Every output column range of `ROWS_PER_TASK` weight rows as one task, over the
/// activation rows in runs of at most `MAX_M`: `body(m0, mm, j0, j1)` computes rows
/// `m0 .. m0 + mm` of output columns `j0 .. j1`.
fn column_tasks(m: usize, n: usize, k: usize, body: impl Fn(usize, usize, usize, usize) + Sync) {
    let tasks = n.div_ceil(ROWS_PER_TASK);
    for m0 in (0..m).step_by(MAX_M) {
        let mm = (m - m0).min(MAX_M);
        for_each_task(tasks, mm * n * k, |t| {
            body(m0, mm, t * ROWS_PER_TASK, ((t + 1) * ROWS_PER_TASK).min(n))
        });
    }
}

/// `x` `[m, k]` as bfloat16 bits, each run of `order.len()` inputs permuted so that
/// position `i` holds input `order[i]` (the order the VBMI kernels unpack weights in).
#[cfg(target_arch = "x86_64")]
fn permuted_bf16(xf: &[f32], m: usize, k: usize, order: &[usize]) -> Vec<u16> {
    let mut xp = vec![0u16; m * k];
    for r in 0..m {
        for c in (0..k).step_by(order.len()) {
            for (i, &o) in order.iter().enumerate() {
                xp[r * k + c + i] = crate::bf16::from_f32(xf[r * k + c + o]);
            }
        }
    }
    xp
}

fn run<T: Elem>(f: Format<'_>, x: Rows<'_, T>, n: usize, out: &mut [T]) -> Result<(), KernelError> {
    let (m, k) = (x.rows, x.width);
    if out.len() != m * n {
        return Err(KernelError::new(format!(
            "out must be [M={m}, N={n}]; got {} elements",
            out.len()
        )));
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    // x widened to float32 once (a few rows: small next to the weight).
    let mut xf = vec![0f32; m * k];
    for r in 0..m {
        let src = &x.data[r * x.stride..r * x.stride + k];
        for (d, s) in xf[r * k..(r + 1) * k].iter_mut().zip(src) {
            *d = s.get();
        }
    }
    let xsum = match f {
        Format::Int4 { group, .. } => {
            let g = k / group;
            let mut s = vec![0f32; m * g];
            for r in 0..m {
                for b in 0..g {
                    s[r * g + b] = xf[r * k + b * group..r * k + (b + 1) * group].iter().sum();
                }
            }
            s
        }
        Format::Fp8 { .. } => Vec::new(),
    };
    let isa = quant_isa();
    let ptr = SendPtr(out.as_mut_ptr());
    // bfloat16 activations on FP8 blocks: the VBMI + BF16 path (exact bfloat16 weights,
    // `vdpbf16ps`); float32 activations keep float32 arithmetic.
    #[cfg(target_arch = "x86_64")]
    if let Format::Fp8 {
        w,
        scale,
        scale_cols,
        row_offset,
    } = f
    {
        if std::mem::size_of::<T>() == 2 && k % FP8_BLOCK == 0 && has_vbmi_bf16() {
            let xp = permuted_bf16(&xf, m, k, &vbmi::run_order());
            column_tasks(m, n, k, |m0, mm, j0, j1| {
                // SAFETY: features detected above; columns j0..j1 are this task's.
                unsafe {
                    vbmi::columns(
                        w, scale, scale_cols, row_offset, &xp, k, n, m0, mm, j0, j1, ptr,
                    )
                }
            });
            return Ok(());
        }
    }
    #[cfg(target_arch = "x86_64")]
    if let Format::Int4 {
        w,
        scales,
        zeros,
        group,
    } = f
    {
        if std::mem::size_of::<T>() == 2 && group == FP8_BLOCK && has_vbmi_bf16() {
            let xp = permuted_bf16(&xf, m, k, &vbmi::int4_order());
            column_tasks(m, n, k, |m0, mm, j0, j1| {
                // SAFETY: features detected above; columns j0..j1 are this task's.
                unsafe {
                    vbmi::columns_int4(w, scales, zeros, &xp, &xsum, k, n, m0, mm, j0, j1, ptr)
                }
            });
            return Ok(());
        }
    }
    column_tasks(m, n, k, |m0, mm, j0, j1| {
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: the ISA was detected on this CPU; columns j0..j1 are this task's.
            if isa == "avx512" && k % FP8_BLOCK == 0 && f.block() == FP8_BLOCK {
                return unsafe { avx512::columns(f, &xf, &xsum, k, n, m0, mm, j0, j1, ptr) };
            }
            if isa == "avx2" || isa == "avx512" {
                return unsafe { columns_avx2(f, &xf, &xsum, k, n, m0, mm, j0, j1, ptr) };
            }
        }
        let _ = isa;
        columns::<T, false>(f, &xf, &xsum, k, n, m0, mm, j0, j1, ptr)
    });
    Ok(())
}

/// `out[m, j] = sum_k x[m, k] W[j, k]` for an FP8 block-scaled `W`: `w` `[N, K]` e4m3
/// bytes row-major, `scale` float32 `[ceil((row_offset + N) / 128), ceil(K / 128)]`
/// row-major, `W[j, c] = e4m3(w[j, c]) * scale[(row_offset + j) / 128, c / 128]`
/// (`row_offset` < 128: where row 0 sits in its scale block, for a row range of a
/// larger weight). `x` `[M, K]` and `out` `[M, N]` float32 or bfloat16 bits.
pub fn fp8_matmul<T: Elem>(
    x: Rows<'_, T>,
    w: &[u8],
    n: usize,
    scale: &[f32],
    row_offset: usize,
    out: &mut [T],
) -> Result<(), KernelError> {
    let k = x.width;
    let (sr, sc) = ((row_offset + n).div_ceil(FP8_BLOCK), k.div_ceil(FP8_BLOCK));
    if row_offset >= FP8_BLOCK || w.len() != n * k || scale.len() != sr * sc {
        return Err(KernelError::new(format!(
            "FP8 weight must be [N={n}, K={k}] bytes with scales [{sr}, {sc}] (row_offset {row_offset} < 128); \
             got {} bytes and {} scales",
            w.len(),
            scale.len()
        )));
    }
    run(
        Format::Fp8 {
            w,
            scale,
            scale_cols: sc,
            row_offset,
        },
        x,
        n,
        out,
    )
}

/// `out[m, j] = sum_k x[m, k] W[j, k]` for an int4 `W` with a scale and zero point
/// per group of `group` inputs: `w` `[N, K / 2]` bytes, each run of 64 inputs in 32
/// bytes (input `i` of the run in byte `i`'s low nibble, input `32 + i` in its high
/// one), `scales` / `zeros` float32 `[N, K / group]`, `W[j, c] = (q[j, c] - zeros[j,
/// c / group]) * scales[j, c / group]`. `group` a multiple of 64 dividing `K`.
pub fn int4_matmul<T: Elem>(
    x: Rows<'_, T>,
    w: &[u8],
    n: usize,
    scales: &[f32],
    zeros: &[f32],
    group: usize,
    out: &mut [T],
) -> Result<(), KernelError> {
    let k = x.width;
    if group == 0 || group % INT4_RUN != 0 || k % group != 0 {
        return Err(KernelError::new(format!(
            "int4 group size must be a multiple of {INT4_RUN} dividing K={k}; got {group}"
        )));
    }
    let g = k / group;
    if w.len() != n * k / 2 || scales.len() != n * g || zeros.len() != n * g {
        return Err(KernelError::new(format!(
            "int4 weight must be [N={n}, K/2={}] bytes with scales and zeros [{n}, {g}]; got {}, {} and {}",
            k / 2,
            w.len(),
            scales.len(),
            zeros.len()
        )));
    }
    run(
        Format::Int4 {
            w,
            scales,
            zeros,
            group,
        },
        x,
        n,
        out,
    )
}

#[cfg(test)]
mod tests;
