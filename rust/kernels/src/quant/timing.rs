//! Timing of the quantized GEMM against a plain read of the same bytes and the bfloat16
//! GEMM, variants interleaved, medians printed (ignored tests):
//!
//! `QT_THREADS=2 cargo test --release -p hybridserve-cpu-kernels quant::timing -- --ignored --nocapture`
//!
//! Weights come from a ring of copies larger than the last-level cache, as a model's do.

use super::gemm::quant_matmul;
use super::GgmlType;
use crate::matmul_bf16::{matmul_bf16, Out};
use crate::pool::{for_each_task, set_num_threads};
use crate::Rows;
use std::time::Instant;

const RING_BYTES: usize = 96 << 20;

fn threads() -> usize {
    std::env::var("QT_THREADS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1)
}

fn weight(ty: GgmlType, n: usize, k: usize, seed: usize) -> Vec<u8> {
    let mut w: Vec<u8> = (0..n * ty.row_bytes(k))
        .map(|i| ((i * 7 + seed * 13) % 251) as u8)
        .collect();
    // Small finite float16 scales (0x1400 is about 0.001).
    let (bb, at): (usize, &[usize]) = match ty {
        GgmlType::Q6K => (210, &[208]),
        GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => (ty.block_bytes(), &[0, 2]),
        _ => (ty.block_bytes(), &[0]),
    };
    for b in w.chunks_exact_mut(bb) {
        for &a in at {
            b[a..a + 2].copy_from_slice(&0x1400u16.to_le_bytes());
        }
    }
    w
}

fn ring<T>(bytes_each: usize, mut make: impl FnMut(usize) -> T) -> Vec<T> {
    (0..RING_BYTES.div_ceil(bytes_each).max(1))
        .map(&mut make)
        .collect()
}

/// Sums the bytes as u64 words, split over the pool as the GEMM splits rows.
fn read_all(w: &[u8]) -> u64 {
    let words: &[u64] =
        unsafe { std::slice::from_raw_parts(w.as_ptr() as *const u64, w.len() / 8) };
    let chunk = 32 * 1024;
    let tasks = words.len().div_ceil(chunk);
    let total = std::sync::atomic::AtomicU64::new(0);
    for_each_task(tasks, usize::MAX, |t| {
        let s: u64 = words[t * chunk..((t + 1) * chunk).min(words.len())]
            .iter()
            .fold(0u64, |a, &b| a.wrapping_add(b));
        total.fetch_add(s, std::sync::atomic::Ordering::Relaxed);
    });
    total.into_inner()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Runs each named closure `reps` times per round, rounds interleaved; medians in ms.
fn interleave(fns: &mut [(String, Box<dyn FnMut() + '_>)], rounds: usize, reps: usize) -> Vec<f64> {
    let mut samples = vec![vec![]; fns.len()];
    for _ in 0..rounds {
        for (i, (_, f)) in fns.iter_mut().enumerate() {
            f();
            for _ in 0..reps {
                let t0 = Instant::now();
                f();
                samples[i].push(t0.elapsed().as_secs_f64() * 1e3);
            }
        }
    }
    samples.into_iter().map(median).collect()
}

#[test]
#[ignore]
fn lm_head_one_row() {
    let th = threads();
    set_num_threads(th);
    let (n, k) = (151_936, 768);
    // QT_HOT=1: a weight that stays in L2 (compute alone, no memory).
    let hot = std::env::var("QT_HOT").is_ok();
    let n = if hot { 1024 } else { n };
    for ty in [GgmlType::Q6K, GgmlType::Q8_0] {
        let w = weight(ty, n, k, 1);
        let x: Vec<f32> = (0..k).map(|i| ((i % 17) as f32 - 8.0) * 0.1).collect();
        let mut out = vec![0.0f32; n];
        let mut sink = 0u64;
        let names = ["read", "gemm"];
        let mut fns: Vec<(String, Box<dyn FnMut()>)> = vec![
            (
                names[0].into(),
                Box::new(|| sink = sink.wrapping_add(read_all(&w))),
            ),
            (
                names[1].into(),
                Box::new(|| {
                    quant_matmul(Rows::dense(&x, k).unwrap(), &w, ty, Out::F32(&mut out)).unwrap()
                }),
            ),
        ];
        let med = interleave(&mut fns, 5, 5);
        drop(fns);
        let gb = w.len() as f64 / 1e9;
        println!(
            "lm_head {ty:?} {n}x{k} threads={th}: read {:.2} ms ({:.1} GB/s), gemm {:.2} ms ({:.1} GB/s), gemm/read {:.2}",
            med[0],
            gb / med[0] * 1e3,
            med[1],
            gb / med[1] * 1e3,
            med[1] / med[0]
        );
    }
}

#[test]
#[ignore]
fn sixteen_rows() {
    let th = threads();
    set_num_threads(th);
    let m: usize = std::env::var("QT_ROWS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(16);
    let (n, k) = (4096, 768);
    let x: Vec<f32> = (0..m * k).map(|i| ((i % 17) as f32 - 8.0) * 0.1).collect();
    let xb: Vec<u16> = x.iter().map(|&v| crate::bf16::from_f32(v)).collect();
    let types = [
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
    ];
    let wb = ring(n * k * 2, |s| {
        (0..n * k)
            .map(|i| crate::bf16::from_f32(((i * 7 + s) % 19) as f32 * 0.001))
            .collect::<Vec<u16>>()
    });
    let wq: Vec<Vec<Vec<u8>>> = types
        .iter()
        .map(|&ty| ring(ty.row_bytes(k) * n, |s| weight(ty, n, k, s)))
        .collect();
    let mut outs = vec![vec![0.0f32; m * n]; types.len() + 1];
    let mut idx = vec![0usize; types.len() + 1];
    let mut fns: Vec<(String, Box<dyn FnMut() + '_>)> = vec![];
    let (o0, rest) = outs.split_first_mut().unwrap();
    let (i0, irest) = idx.split_first_mut().unwrap();
    let (xr, xbr, wbr) = (&x, &xb, &wb);
    fns.push((
        "bf16".into(),
        Box::new(move || {
            *i0 = (*i0 + 1) % wbr.len();
            matmul_bf16(Rows::dense(xbr, k).unwrap(), &wbr[*i0], n, Out::F32(o0)).unwrap()
        }),
    ));
    for (((ty, o), i), r) in types
        .iter()
        .zip(rest.iter_mut())
        .zip(irest.iter_mut())
        .zip(wq.iter())
    {
        let ty = *ty;
        fns.push((
            ty.name().into(),
            Box::new(move || {
                *i = (*i + 1) % r.len();
                quant_matmul(Rows::dense(xr, k).unwrap(), &r[*i], ty, Out::F32(o)).unwrap()
            }),
        ));
    }
    let med = interleave(&mut fns, 5, 5);
    for ((name, _), ms) in fns.iter().zip(&med) {
        println!(
            "{m} rows {n}x{k} threads={th} {name}: {ms:.3} ms, {:.2}x bf16",
            med[0] / ms
        );
    }
}
