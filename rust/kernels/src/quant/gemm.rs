//! The few-row GEMM on quantized weights and the row dequantizer.
//!
//! `out[t, j] = x[t] . W[j]`: each `x` row is quantized once per call (Q8_0 or Q8_K,
//! [`super::act`]), then tasks of consecutive weight rows run every weight row against
//! the activation rows, up to four at a time, so a row's unpacked blocks are reused from
//! registers and its bytes from L1. One or two activation rows only stream the weight:
//! consecutive rows in a task keep that stream sequential for the hardware prefetcher,
//! and a task's rows go to one kernel call ([`rows_kernel`]; a decode row is a few
//! blocks, too short to pay a call's entry each).
//! Above four activation rows every type takes eight weight rows per pass instead,
//! their unpacked blocks transposed so each lane is one output ([`many8`], [`many8_32`]),
//! the next pass's rows prefetched meanwhile.
//! A row's result does not depend on how many rows share the call: each output is one
//! dot product in one fixed order.

use super::act::{ActRow, QAct};
use super::blocks::{dequantize_row, GgmlType, QK_K};
use super::QIsa;
use crate::bf16::{from_f32, Elem};
use crate::matmul_bf16::Out;
use crate::pool::for_each_task;
use crate::{KernelError, Rows};

/// Weight rows per task.
const ROWS_PER_TASK: usize = 32;
/// Activation rows per register block.
pub(crate) const MR: usize = 4;

#[derive(Clone, Copy)]
enum OutPtr {
    F32(*mut f32),
    Bf16(*mut u16),
}
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    fn of(out: &mut Out<'_>) -> (OutPtr, usize) {
        match out {
            Out::F32(o) => (OutPtr::F32(o.as_mut_ptr()), o.len()),
            Out::Bf16(o) => (OutPtr::Bf16(o.as_mut_ptr()), o.len()),
        }
    }
    /// # Safety
    /// `at` lies in the output and is written by this task alone.
    #[inline(always)]
    unsafe fn put(self, at: usize, v: f32) {
        match self {
            OutPtr::F32(p) => *p.add(at) = v,
            OutPtr::Bf16(p) => *p.add(at) = from_f32(v),
        }
    }
}

fn check_weight(ty: GgmlType, w_len: usize, k: usize) -> Result<(usize, usize), KernelError> {
    if k == 0 || k % ty.block_size() != 0 {
        return Err(KernelError::new(format!(
            "{} rows hold whole blocks of {}; K={k} is not a multiple",
            ty.name(),
            ty.block_size()
        )));
    }
    let rb = ty.row_bytes(k);
    if w_len % rb != 0 {
        return Err(KernelError::new(format!(
            "w must be [N, {rb}] bytes ({} rows of K={k}); got {w_len} bytes",
            ty.name()
        )));
    }
    Ok((rb, w_len / rb))
}

pub(crate) fn check_isa(isa: QIsa) -> Result<(), KernelError> {
    if isa.supported() {
        Ok(())
    } else {
        Err(KernelError::new(format!("this CPU cannot run the {} quantized kernels", isa.name())))
    }
}

/// `out = x W^T`: `x` `[M, K]` float32 or bfloat16 (row-strided view allowed), `w`
/// `[N, row_bytes]` blocks of `ty`, `out` `[M, N]` row-major.
pub fn quant_matmul<T: Elem>(x: Rows<'_, T>, w: &[u8], ty: GgmlType, out: Out<'_>) -> Result<(), KernelError> {
    quant_matmul_with(QIsa::detect(), x, w, ty, out)
}

/// [`quant_matmul`] on the instruction set the caller names (tests, benches).
pub fn quant_matmul_with<T: Elem>(
    isa: QIsa,
    x: Rows<'_, T>,
    w: &[u8],
    ty: GgmlType,
    mut out: Out<'_>,
) -> Result<(), KernelError> {
    let (m, k) = (x.rows, x.width);
    let (rb, n) = check_weight(ty, w.len(), k)?;
    let (ptr, olen) = OutPtr::of(&mut out);
    if olen != m * n {
        return Err(KernelError::new(format!("out must be [M={m}, N={n}]; got {olen} elements")));
    }
    check_isa(isa)?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    let mut act = QAct::new(m, k, if ty.is_k() { QK_K } else { 32 });
    let mut buf = T::scratch(k);
    for t in 0..m {
        let xr = T::widen(x.row(t), &mut buf);
        act.set_row(t, xr);
    }
    let act = &act;
    // One or two activation rows stream the weight: a few long runs of rows per thread
    // keep each thread's reads sequential (and its prefetches on its own rows).
    let per_task = if m <= 2 {
        n.div_ceil(8 * crate::pool::num_threads()).next_multiple_of(8).max(ROWS_PER_TASK)
    } else {
        ROWS_PER_TASK
    };
    let tasks = n.div_ceil(per_task);
    for_each_task(tasks, m * n * k / 4, |task| {
        let (j0, j1) = (task * per_task, ((task + 1) * per_task).min(n));
        let mut j = j0;
        // Many rows: eight weight rows per pass, each block unpacked once for all rows.
        #[cfg(target_arch = "x86_64")]
        if m > MANY_MIN_ROWS && isa != QIsa::Scalar {
            let rows: Vec<ActRow<'_>> = (0..m).map(|t| act.row(t)).collect();
            let nb = k / ty.block_size();
            if ty.is_k() {
                let mut acc = vec![0.0f32; m];
                {
                    // Eight weight rows at a time, one output per lane.
                    let mut acc8 = vec![[0.0f32; 8]; m];
                    while j + 8 <= j1 {
                        let p = w[j * rb..(j + 8) * rb].as_ptr();
                        acc8.fill([0.0; 8]);
                        // SAFETY: as below, for eight rows `rb` bytes apart.
                        unsafe { many8(isa, ty, p, rb, nb, &rows, &mut acc8) };
                        for (t, a) in acc8.iter().enumerate() {
                            for (i, &v) in a.iter().enumerate() {
                                // SAFETY: column j + i of every row belongs to this task alone.
                                unsafe { ptr.put(t * n + j + i, v) };
                            }
                        }
                        j += 8;
                    }
                }
                for j in j..j1 {
                    let p = w[j * rb..(j + 1) * rb].as_ptr();
                    acc.fill(0.0);
                    // SAFETY: the ISA was checked above; the row holds `nb` super-blocks and
                    // every activation row `k` values.
                    unsafe { many(isa, ty, p, nb, &rows, &mut acc) };
                    for (t, &v) in acc.iter().enumerate() {
                        // SAFETY: column j of every row belongs to this task alone.
                        unsafe { ptr.put(t * n + j, v) };
                    }
                }
                return;
            }
            // The 32-weight blocks: eight rows per pass; the rest below, same float steps.
            let mut acc = vec![[0.0f32; 64]; m];
            while j + 8 <= j1 {
                let p = w[j * rb..(j + 8) * rb].as_ptr();
                // SAFETY: the ISA was checked above; eight rows of `nb` blocks `rb` bytes
                // apart, every activation row `k` values.
                unsafe { many8_32(isa, ty, p, rb, nb, &rows, &mut acc) };
                for (t, a) in acc.iter().enumerate() {
                    for (i, &v) in a[..8].iter().enumerate() {
                        // SAFETY: column j + i of every row belongs to this task alone.
                        unsafe { ptr.put(t * n + j + i, v) };
                    }
                }
                j += 8;
            }
        }
        // One or two activation rows: every weight row of the task in one kernel call.
        #[cfg(target_arch = "x86_64")]
        if m <= 2 && j < j1 && isa != QIsa::Scalar && rows_call() {
            let mut vals = vec![0.0f32; m * (j1 - j)];
            let xs2 = [act.row(0), act.row(m - 1)];
            let nb = k / ty.block_size();
            // SAFETY: the ISA was checked above; rows j..j1 lie in `w`, each `nb` blocks,
            // every activation row `k` values.
            unsafe { rows_kernel(isa, ty, w[j * rb..j1 * rb].as_ptr(), rb, j1 - j, nb, &xs2[..m], &mut vals) };
            for (i, v) in vals.chunks_exact(m).enumerate() {
                for (t, &v) in v.iter().enumerate() {
                    // SAFETY: column j + i of every row belongs to this task alone.
                    unsafe { ptr.put(t * n + j + i, v) };
                }
            }
            return;
        }
        for j in j..j1 {
            let wr = &w[j * rb..(j + 1) * rb];
            let mut t = 0;
            while t < m {
                // Q6_K's unpacked groups and scales take more registers: pairs of rows.
                let r = (m - t).min(if ty == GgmlType::Q6K { 2 } else { MR });
                let mut vals = [0.0f32; MR];
                match r {
                    1 => vals[..1].copy_from_slice(&dot_rows::<1>(isa, ty, wr, act, t)),
                    2 => vals[..2].copy_from_slice(&dot_rows::<2>(isa, ty, wr, act, t)),
                    3 => vals[..3].copy_from_slice(&dot_rows::<3>(isa, ty, wr, act, t)),
                    _ => vals.copy_from_slice(&dot_rows::<4>(isa, ty, wr, act, t)),
                }
                for (i, &v) in vals.iter().enumerate().take(r) {
                    // SAFETY: column j of every row belongs to this task alone.
                    unsafe { ptr.put((t + i) * n + j, v) };
                }
                t += r;
            }
        }
    });
    Ok(())
}

/// Above this many activation rows the k-quants unpack each super-block once for
/// all rows (below, the register-blocked kernels keep the unpacked block in registers).
pub(crate) const MANY_MIN_ROWS: usize = 4;

/// # Safety
/// `isa` runs on this CPU and is not scalar; `p` holds `nb` super-blocks of `ty` (a
/// k-quant) and every row of `xs` `256 nb` values.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn many(isa: QIsa, ty: GgmlType, p: *const u8, nb: usize, xs: &[ActRow<'_>], acc: &mut [f32]) {
    use super::dot_x86::{avx2, vnni};
    match (isa, ty) {
        (QIsa::Avx512Vnni, GgmlType::Q4K) => vnni::q4k_q5k_many::<false>(p, nb, xs, acc),
        (QIsa::Avx512Vnni, GgmlType::Q5K) => vnni::q4k_q5k_many::<true>(p, nb, xs, acc),
        (QIsa::Avx512Vnni, GgmlType::Q6K) => vnni::q6k_many(p, nb, xs, acc),
        (_, GgmlType::Q4K) => avx2::q4k_q5k_many::<false>(p, nb, xs, acc),
        (_, GgmlType::Q5K) => avx2::q4k_q5k_many::<true>(p, nb, xs, acc),
        (_, GgmlType::Q6K) => avx2::q6k_many(p, nb, xs, acc),
        _ => unreachable!("many() takes the k-quants"),
    }
}

/// # Safety
/// As [`many`], for eight weight rows `rb` bytes apart from `p`.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn many8(isa: QIsa, ty: GgmlType, p: *const u8, rb: usize, nb: usize, xs: &[ActRow<'_>], acc: &mut [[f32; 8]]) {
    use super::dot_x86::{avx2, vnni};
    match (isa, ty) {
        (QIsa::Avx512Vnni, GgmlType::Q4K) => vnni::q4k_q5k_x8::<false>(p, rb, nb, xs, acc),
        (QIsa::Avx512Vnni, GgmlType::Q5K) => vnni::q4k_q5k_x8::<true>(p, rb, nb, xs, acc),
        (_, GgmlType::Q4K) => avx2::q4k_q5k_x8::<false>(p, rb, nb, xs, acc),
        (_, GgmlType::Q5K) => avx2::q4k_q5k_x8::<true>(p, rb, nb, xs, acc),
        (QIsa::Avx512Vnni, GgmlType::Q6K) => vnni::q6k_x8(p, rb, nb, xs, acc),
        (_, GgmlType::Q6K) => avx2::q6k_x8(p, rb, nb, xs, acc),
        _ => unreachable!("many8() takes the k-quants"),
    }
}

/// # Safety
/// As [`many8`], for the 32-weight block types; `acc` has one entry per row of `xs`.
#[cfg(target_arch = "x86_64")]
unsafe fn many8_32(isa: QIsa, ty: GgmlType, p: *const u8, rb: usize, nb: usize, xs: &[ActRow<'_>], acc: &mut [[f32; 64]]) {
    use super::dot_x86::{avx2, vnni, Q4_0, Q5_0, Q5_1, Q8_0};
    match (isa, ty) {
        (QIsa::Avx512Vnni, GgmlType::Q8_0) => vnni::q32_x8::<Q8_0>(p, rb, nb, xs, acc),
        (QIsa::Avx512Vnni, GgmlType::Q4_0) => vnni::q32_x8::<Q4_0>(p, rb, nb, xs, acc),
        (QIsa::Avx512Vnni, GgmlType::Q5_0) => vnni::q32_x8::<Q5_0>(p, rb, nb, xs, acc),
        (QIsa::Avx512Vnni, GgmlType::Q5_1) => vnni::q32_x8::<Q5_1>(p, rb, nb, xs, acc),
        (_, GgmlType::Q8_0) => avx2::q32_x8::<Q8_0>(p, rb, nb, xs, acc),
        (_, GgmlType::Q4_0) => avx2::q32_x8::<Q4_0>(p, rb, nb, xs, acc),
        (_, GgmlType::Q5_0) => avx2::q32_x8::<Q5_0>(p, rb, nb, xs, acc),
        (_, GgmlType::Q5_1) => avx2::q32_x8::<Q5_1>(p, rb, nb, xs, acc),
        _ => unreachable!("many8_32() takes the 32-weight blocks"),
    }
}

static ROWS_CALL: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Whether one or two activation rows take [`rows_kernel`] (an atomic only so that the
/// timing harness can compare it with a call per row in one process).
fn rows_call() -> bool {
    ROWS_CALL.load(std::sync::atomic::Ordering::Relaxed)
}

#[cfg(test)]
pub(crate) fn set_rows_call(on: bool) {
    ROWS_CALL.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// `n` consecutive weight rows (`rb` bytes apart from `p`) against one or two activation
/// rows: `out[m j + t]`, each value the one [`dot_rows`] gives.
///
/// # Safety
/// `isa` runs on this CPU and is not scalar; the rows hold `nb` blocks each and every row of `xs` (one or two) `nb` blocks' values.
#[cfg(target_arch = "x86_64")]
unsafe fn rows_kernel(isa: QIsa, ty: GgmlType, p: *const u8, rb: usize, n: usize, nb: usize, xs: &[ActRow<'_>], out: &mut [f32]) {
    use super::dot_x86::{avx2, vnni, Q4_0, Q5_0, Q5_1, Q8_0};
    macro_rules! go {
        ($f:ident $(, $g:expr)*) => {
            match (isa, xs) {
                (QIsa::Avx512Vnni, [a]) => vnni::$f::<1 $(, $g)*>(p, rb, n, nb, &[*a], out),
                (QIsa::Avx512Vnni, [a, b]) => vnni::$f::<2 $(, $g)*>(p, rb, n, nb, &[*a, *b], out),
                (_, [a]) => avx2::$f::<1 $(, $g)*>(p, rb, n, nb, &[*a], out),
                (_, [a, b]) => avx2::$f::<2 $(, $g)*>(p, rb, n, nb, &[*a, *b], out),
                _ => unreachable!("rows_kernel() takes one or two activation rows"),
            }
        };
    }
    match ty {
        GgmlType::Q4K => go!(q4k_q5k_rows, false),
        GgmlType::Q5K => go!(q4k_q5k_rows, true),
        GgmlType::Q6K => go!(q6k_rows),
        GgmlType::Q8_0 => go!(q32_rows, Q8_0),
        GgmlType::Q4_0 => go!(q32_rows, Q4_0),
        GgmlType::Q5_0 => go!(q32_rows, Q5_0),
        GgmlType::Q5_1 => go!(q32_rows, Q5_1),
    }
}

/// One weight row against activation rows `t..t + R`.
#[inline(always)]
pub(crate) fn dot_rows<const R: usize>(isa: QIsa, ty: GgmlType, wr: &[u8], act: &QAct, t: usize) -> [f32; R] {
    let xs: [ActRow<'_>; R] = std::array::from_fn(|i| act.row(t + i));
    let nb = act.k / ty.block_size();
    #[cfg(target_arch = "x86_64")]
    {
        use super::dot_x86::{avx2, vnni, Q4_0, Q5_0, Q5_1, Q8_0};
        let p = wr.as_ptr();
        // SAFETY: the ISA was checked by the caller; `wr` holds `nb` blocks of `ty` and
        // every activation row `k` values.
        unsafe {
            match (isa, ty) {
                (QIsa::Avx512Vnni, GgmlType::Q8_0) => return vnni::q32::<R, Q8_0>(p, nb, &xs),
                (QIsa::Avx512Vnni, GgmlType::Q4_0) => return vnni::q32::<R, Q4_0>(p, nb, &xs),
                (QIsa::Avx512Vnni, GgmlType::Q5_0) => return vnni::q32::<R, Q5_0>(p, nb, &xs),
                (QIsa::Avx512Vnni, GgmlType::Q5_1) => return vnni::q32::<R, Q5_1>(p, nb, &xs),
                (QIsa::Avx512Vnni, GgmlType::Q4K) => return vnni::q4k_q5k::<R, false>(p, nb, &xs),
                (QIsa::Avx512Vnni, GgmlType::Q5K) => return vnni::q4k_q5k::<R, true>(p, nb, &xs),
                (QIsa::Avx512Vnni, GgmlType::Q6K) => return vnni::q6k::<R>(p, nb, &xs),
                (QIsa::Avx2, GgmlType::Q8_0) => return avx2::q32::<R, Q8_0>(p, nb, &xs),
                (QIsa::Avx2, GgmlType::Q4_0) => return avx2::q32::<R, Q4_0>(p, nb, &xs),
                (QIsa::Avx2, GgmlType::Q5_0) => return avx2::q32::<R, Q5_0>(p, nb, &xs),
                (QIsa::Avx2, GgmlType::Q5_1) => return avx2::q32::<R, Q5_1>(p, nb, &xs),
                (QIsa::Avx2, GgmlType::Q4K) => return avx2::q4k_q5k::<R, false>(p, nb, &xs),
                (QIsa::Avx2, GgmlType::Q5K) => return avx2::q4k_q5k::<R, true>(p, nb, &xs),
                (QIsa::Avx2, GgmlType::Q6K) => return avx2::q6k::<R>(p, nb, &xs),
                _ => {}
            }
        }
    }
    let _ = isa;
    std::array::from_fn(|i| super::dot_scalar::dot(ty, wr, nb, xs[i]))
}

/// Weight rows as float32 or bfloat16: `w` `[R, row_bytes]` blocks of `ty`, `out`
/// `[R, K]`. Exactly the reference's values (float32; bfloat16 rounds them once).
pub fn dequantize_rows(w: &[u8], ty: GgmlType, k: usize, out: Out<'_>) -> Result<(), KernelError> {
    dequantize_rows_with(QIsa::detect(), w, ty, k, out)
}

/// [`dequantize_rows`] on a named instruction set (only the scalar dequantizer exists
/// so far; the ISA is checked for symmetry with the GEMM).
pub fn dequantize_rows_with(isa: QIsa, w: &[u8], ty: GgmlType, k: usize, mut out: Out<'_>) -> Result<(), KernelError> {
    let (rb, rows) = check_weight(ty, w.len(), k)?;
    let (ptr, olen) = OutPtr::of(&mut out);
    if olen != rows * k {
        return Err(KernelError::new(format!("out must be [R={rows}, K={k}]; got {olen} elements")));
    }
    check_isa(isa)?;
    const ROWS: usize = 16;
    for_each_task(rows.div_ceil(ROWS), rows * k, |task| {
        let mut buf = vec![0.0f32; k];
        for r in task * ROWS..((task + 1) * ROWS).min(rows) {
            match ptr {
                // SAFETY: row r of the output belongs to this task alone.
                OutPtr::F32(p) => {
                    let o = unsafe { std::slice::from_raw_parts_mut(p.add(r * k), k) };
                    dequantize_row(ty, &w[r * rb..(r + 1) * rb], o);
                }
                OutPtr::Bf16(p) => {
                    dequantize_row(ty, &w[r * rb..(r + 1) * rb], &mut buf);
                    let o = unsafe { std::slice::from_raw_parts_mut(p.add(r * k), k) };
                    for (d, &v) in o.iter_mut().zip(&buf) {
                        *d = from_f32(v);
                    }
                }
            }
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::blocks::dequantize_block;
    use crate::quant::test_util::{isas, random_weight, Lcg, TYPES};


    #[test]
    fn every_isa_matches_the_dequantized_reference() {
        let mut g = Lcg(7);
        for ty in TYPES {
            let (n, k) = (37, 512);
            let w = random_weight(ty, n, k, &mut g);
            let mut deq = vec![0.0f32; n * k];
            dequantize_rows_with(QIsa::Scalar, &w, ty, k, Out::F32(&mut deq)).unwrap();
            // Also against the per-block reference directly.
            let mut blk = vec![0.0f32; ty.block_size()];
            dequantize_block(ty, &w[..ty.block_bytes()], &mut blk);
            assert_eq!(&deq[..ty.block_size()], &blk[..]);
            for m in [1usize, 2, 3, 5, 9, 17] {
                let x: Vec<f32> = (0..m * k).map(|_| g.f()).collect();
                // The reference: the dequantized weight times the quantized-dequantized activation.
                let mut act = QAct::new(m, k, if ty.is_k() { QK_K } else { 32 });
                for t in 0..m {
                    act.set_row(t, &x[t * k..(t + 1) * k]);
                }
                let xd: Vec<f32> = (0..m * k).map(|i| act.qs[i] as f32 * act.d[i / act.block]).collect();
                let mut outs = vec![];
                for isa in isas() {
                    let mut out = vec![0.0f32; m * n];
                    quant_matmul_with(isa, Rows::dense(&x, k).unwrap(), &w, ty, Out::F32(&mut out)).unwrap();
                    for t in 0..m {
                        for j in 0..n {
                            let (mut r, mut mag) = (0.0f64, 0.0f64);
                            for i in 0..k {
                                let p = deq[j * k + i] as f64 * xd[t * k + i] as f64;
                                r += p;
                                mag += p.abs();
                            }
                            let got = out[t * n + j] as f64;
                            assert!(
                                (got - r).abs() <= 1e-5 * mag + 1e-6,
                                "{ty:?} {isa:?} m={m} ({t},{j}): {got} vs {r}"
                            );
                        }
                    }
                    outs.push((isa, out));
                }
                // Every path takes the same float steps: equal bit for bit.
                for (isa, o) in &outs[1..] {
                    assert_eq!(o, &outs[0].1, "{ty:?} {isa:?} m={m} differs from scalar");
                }
            }
        }
    }

    /// The one- and two-row path (a task's rows in one kernel call) at decode widths:
    /// three k-quant super-blocks, 25 blocks of 32 (a partial group of eight), rows over
    /// two tasks; every ISA equal to the scalar path bit for bit.
    #[test]
    fn one_and_two_rows_at_decode_widths_equal_the_scalar_path() {
        let mut g = Lcg(19);
        for ty in TYPES {
            let (n, k) = (45, if ty.is_k() { 768 } else { 800 });
            let w = random_weight(ty, n, k, &mut g);
            for m in [1usize, 2] {
                let x: Vec<f32> = (0..m * k).map(|_| g.f()).collect();
                let mut want = vec![0.0f32; m * n];
                quant_matmul_with(QIsa::Scalar, Rows::dense(&x, k).unwrap(), &w, ty, Out::F32(&mut want)).unwrap();
                for isa in isas() {
                    let mut got = vec![0.0f32; m * n];
                    quant_matmul_with(isa, Rows::dense(&x, k).unwrap(), &w, ty, Out::F32(&mut got)).unwrap();
                    assert_eq!(got, want, "{ty:?} {isa:?} m={m}");
                }
            }
        }
    }

    #[test]
    fn a_row_does_not_depend_on_its_neighbours() {
        let mut g = Lcg(3);
        for ty in TYPES {
            let (n, k) = (70, 256);
            let w = random_weight(ty, n, k, &mut g);
            let x: Vec<f32> = (0..6 * k).map(|_| g.f()).collect();
            let mut all = vec![0.0f32; 6 * n];
            quant_matmul(Rows::dense(&x, k).unwrap(), &w, ty, Out::F32(&mut all)).unwrap();
            for t in 0..6 {
                let mut one = vec![0.0f32; n];
                quant_matmul(Rows::dense(&x[t * k..(t + 1) * k], k).unwrap(), &w, ty, Out::F32(&mut one)).unwrap();
                assert_eq!(&all[t * n..(t + 1) * n], &one[..], "{ty:?} row {t}");
            }
        }
    }

    #[test]
    fn bad_shapes_are_refused() {
        let w = vec![0u8; 144 * 2];
        let x = vec![0.0f32; 300];
        let mut out = vec![0.0f32; 2];
        let e = quant_matmul(Rows::dense(&x, 300).unwrap(), &w, GgmlType::Q4K, Out::F32(&mut out)).unwrap_err();
        assert!(e.0.contains("multiple"), "{}", e.0);
        let x = vec![0.0f32; 256];
        let mut out = vec![0.0f32; 3];
        let e = quant_matmul(Rows::dense(&x, 256).unwrap(), &w, GgmlType::Q4K, Out::F32(&mut out)).unwrap_err();
        assert!(e.0.contains("out must be"), "{}", e.0);
        let e = quant_matmul(Rows::dense(&x, 256).unwrap(), &w[..100], GgmlType::Q4K, Out::F32(&mut out)).unwrap_err();
        assert!(e.0.contains("w must be"), "{}", e.0);
    }
}

#[cfg(test)]
mod timing {
    use super::*;

    /// `cargo test --release -p hybridserve-cpu-kernels quant::gemm::timing -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn rows_per_block() {
        let (n, k) = (3072, 768);
        for ty in [GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q6K] {
            let w: Vec<u8> = (0..n * ty.row_bytes(k)).map(|i| (i * 7 % 251) as u8 & 0x3f).collect();
            for m in [1usize, 2, 4, 16] {
                let x: Vec<f32> = (0..m * k).map(|i| ((i % 17) as f32 - 8.0) * 0.1).collect();
                let mut out = vec![0.0f32; m * n];
                let mut best = f64::MAX;
                for _ in 0..20 {
                    let t0 = std::time::Instant::now();
                    quant_matmul(Rows::dense(&x, k).unwrap(), &w, ty, Out::F32(&mut out)).unwrap();
                    best = best.min(t0.elapsed().as_secs_f64());
                }
                println!("{ty:?} m={m}: {:.3} ms", best * 1e3);
            }
        }
    }
}
