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

/// Copies enough to spill the last-level cache; one with QT_HOT set (compute alone).
fn ring<T>(bytes_each: usize, mut make: impl FnMut(usize) -> T) -> Vec<T> {
    let copies = if std::env::var("QT_HOT").is_ok() { 1 } else { RING_BYTES.div_ceil(bytes_each).max(1) };
    (0..copies).map(&mut make).collect()
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

#[repr(C)]
struct Timespec {
    sec: i64,
    nsec: i64,
}
extern "C" {
    fn clock_gettime(clock: i32, ts: *mut Timespec) -> i32;
}

/// Seconds: CPU time of this thread with QT_CPU set (one thread: the kernel runs inline,
/// and time the thread spends descheduled on a loaded machine does not count), else
/// wall-clock time.
fn now() -> f64 {
    if std::env::var("QT_CPU").is_ok() {
        let mut ts = Timespec { sec: 0, nsec: 0 };
        // SAFETY: CLOCK_THREAD_CPUTIME_ID (3) with a valid out pointer.
        unsafe { clock_gettime(3, &mut ts) };
        ts.sec as f64 + ts.nsec as f64 * 1e-9
    } else {
        use std::sync::OnceLock;
        static T0: OnceLock<Instant> = OnceLock::new();
        T0.get_or_init(Instant::now).elapsed().as_secs_f64()
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Runs each named closure `reps` times per round, rounds interleaved; medians in ms.
fn interleave(fns: &mut [(String, Box<dyn FnMut() + '_>)], rounds: usize, reps: usize) -> Vec<f64> {
    let mut samples: Vec<Vec<f64>> = vec![vec![]; fns.len()];
    for _ in 0..rounds {
        for (i, (_, f)) in fns.iter_mut().enumerate() {
            f();
            for _ in 0..reps {
                let t0 = now();
                f();
                samples[i].push((now() - t0) * 1e3);
            }
        }
    }
    for (s, (name, _)) in samples.iter().zip(fns.iter()) {
        let min = s.iter().cloned().fold(f64::MAX, f64::min);
        println!("  {name}: min {min:.3} ms");
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
    let m: usize = std::env::var("QT_ROWS").ok().and_then(|s| s.parse().ok()).unwrap_or(16);
    let (n, k) = (4096, 768);
    let x: Vec<f32> = (0..m * k).map(|i| ((i % 17) as f32 - 8.0) * 0.1).collect();
    let xb: Vec<u16> = x.iter().map(|&v| crate::bf16::from_f32(v)).collect();
    let all = [
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
    ];
    // QT_TYPES=q8_0,q4_k: a subset; QT_PF_ROWS=0,512: each type at each many-row
    // prefetch distance.
    let types: Vec<GgmlType> = match std::env::var("QT_TYPES") {
        Ok(v) => all.into_iter().filter(|t| v.split(',').any(|n| n == t.name())).collect(),
        Err(_) => all.to_vec(),
    };
    let dists: Vec<usize> = std::env::var("QT_PF_ROWS")
        .ok()
        .map(|v| v.split(',').map(|d| d.parse().unwrap()).collect())
        .unwrap_or(vec![512]);
    let wb = ring(n * k * 2, |s| {
        (0..n * k).map(|i| crate::bf16::from_f32(((i * 7 + s) % 19) as f32 * 0.001)).collect::<Vec<u16>>()
    });
    let wq: Vec<Vec<Vec<u8>>> = types.iter().map(|&ty| ring(ty.row_bytes(k) * n, |s| weight(ty, n, k, s))).collect();
    let out = std::cell::RefCell::new(vec![0.0f32; m * n]);
    let turn = std::cell::Cell::new(0usize);
    let mut fns: Vec<(String, Box<dyn FnMut() + '_>)> = vec![];
    let (xr, xbr, wbr, outr, turnr) = (&x, &xb, &wb, &out, &turn);
    fns.push((
        "bf16".into(),
        Box::new(move || {
            turnr.set(turnr.get() + 1);
            let w = &wbr[turnr.get() % wbr.len()];
            matmul_bf16(Rows::dense(xbr, k).unwrap(), w, n, Out::F32(&mut outr.borrow_mut())).unwrap()
        }),
    ));
    for (&ty, r) in types.iter().zip(wq.iter()) {
        for &d in &dists {
            fns.push((
                format!("{} pf={d}", ty.name()),
                Box::new(move || {
                    super::dot_x86::set_prefetch(4096, d);
                    turnr.set(turnr.get() + 1);
                    let w = &r[turnr.get() % r.len()];
                    quant_matmul(Rows::dense(xr, k).unwrap(), w, ty, Out::F32(&mut outr.borrow_mut())).unwrap()
                }),
            ));
        }
    }
    let med = interleave(&mut fns, 7, 5);
    for ((name, _), ms) in fns.iter().zip(&med) {
        println!("{m} rows {n}x{k} threads={th} {name}: {ms:.3} ms, {:.2}x bf16", med[0] / ms);
    }
    super::dot_x86::set_prefetch(4096, 512);
}

/// Where a one-row call's time goes, per decode shape of the 0.1b peer model and type:
/// the activation's quantization alone (`act`), the dot loop over every weight row on
/// this thread with no pool, one kernel call per row (`per-row`), the whole call (`gemm`), and a plain read of the
/// same bytes split over the pool as the GEMM is (`read`). Weights from a ring larger
/// than the last-level cache. `QT_SHAPES=down,lm_head` picks shapes.
#[test]
#[ignore]
fn one_row_parts() {
    use super::act::QAct;
    use super::blocks::QK_K;
    let th = threads();
    set_num_threads(th);
    let shapes = [("in_proj", 3072usize, 768usize), ("gate_up", 4096, 768), ("down", 768, 2048), ("lm_head", 151_936, 768)];
    let pick: Option<String> = std::env::var("QT_SHAPES").ok();
    let types: Vec<GgmlType> = match std::env::var("QT_TYPES") {
        Ok(v) => [GgmlType::Q6K, GgmlType::Q8_0, GgmlType::Q4K]
            .into_iter()
            .filter(|t| v.split(',').any(|n| n == t.name()))
            .collect(),
        Err(_) => vec![GgmlType::Q6K, GgmlType::Q8_0, GgmlType::Q4K],
    };
    println!("threads={th} cpu-clock={} load={}", std::env::var("QT_CPU").is_ok(),
        std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim());
    for &(name, n, k) in &shapes {
        if let Some(p) = &pick {
            if !p.split(',').any(|s| s == name) {
                continue;
            }
        }
        for &ty in &types {
            let rb = ty.row_bytes(k);
            let wq = ring(rb * n, |s| weight(ty, n, k, s));
            let x: Vec<f32> = (0..k).map(|i| ((i % 17) as f32 - 8.0) * 0.1).collect();
            let out = std::cell::RefCell::new(vec![0.0f32; n]);
            let turn = std::cell::Cell::new(0usize);
            let sink = std::cell::Cell::new(0u64);
            let (wr, xr, outr, turnr, sinkr) = (&wq, &x, &out, &turn, &sink);
            let next = move || {
                turnr.set(turnr.get() + 1);
                &wr[turnr.get() % wr.len()]
            };
            let block = if ty.is_k() { QK_K } else { 32 };
            let mut fns: Vec<(String, Box<dyn FnMut() + '_>)> = vec![
                ("read".into(), Box::new(move || sinkr.set(sinkr.get().wrapping_add(read_all(next()))))),
                (
                    "act".into(),
                    Box::new(move || {
                        let mut a = QAct::new(1, k, block);
                        a.set_row(0, xr);
                        sinkr.set(sinkr.get().wrapping_add(a.qs[k / 2] as u64));
                    }),
                ),
                (
                    "dots".into(),
                    Box::new(move || {
                        let mut a = QAct::new(1, k, block);
                        a.set_row(0, xr);
                        let w = next();
                        let isa = super::QIsa::detect();
                        let mut o = outr.borrow_mut();
                        for j in 0..n {
                            o[j] = super::gemm::dot_rows::<1>(isa, ty, &w[j * rb..(j + 1) * rb], &a, 0)[0];
                        }
                    }),
                ),
                (
                    "gemm".into(),
                    Box::new(move || {
                        quant_matmul(Rows::dense(xr, k).unwrap(), next(), ty, Out::F32(&mut outr.borrow_mut())).unwrap()
                    }),
                ),
                (
                    "gemm, a call per row".into(),
                    Box::new(move || {
                        super::gemm::set_rows_call(false);
                        quant_matmul(Rows::dense(xr, k).unwrap(), next(), ty, Out::F32(&mut outr.borrow_mut())).unwrap();
                        super::gemm::set_rows_call(true);
                    }),
                ),
            ];
            // QT_PF1=1024,4096: the whole call again at each one-row prefetch distance.
            let dists: Vec<usize> = std::env::var("QT_PF1")
                .ok()
                .map(|v| v.split(',').map(|d| d.parse().unwrap()).collect())
                .unwrap_or_default();
            for &dist in &dists {
                fns.push((
                    format!("gemm pf={dist}"),
                    Box::new(move || {
                        super::dot_x86::set_prefetch(dist, 512);
                        quant_matmul(Rows::dense(xr, k).unwrap(), next(), ty, Out::F32(&mut outr.borrow_mut())).unwrap();
                        super::dot_x86::set_prefetch(4096, 512);
                    }),
                ));
            }
            let reps = if n > 100_000 { 3 } else { 20 };
            let med = interleave(&mut fns, 7, reps);
            drop(fns);
            let gb = (rb * n) as f64 / 1e9;
            println!(
                "{name} {n}x{k} {} t={th}: read {:.4} ms ({:.1} GB/s) act {:.4} per-row calls {:.4} ({:.1} GB/s) gemm {:.4} ms ({:.1} GB/s) call per row {:.4} ms",
                ty.name(),
                med[0],
                gb / med[0] * 1e3,
                med[1],
                med[2],
                gb / med[2] * 1e3,
                med[3],
                gb / med[3] * 1e3,
                med[4]
            );
            for (i, d) in dists.iter().enumerate() {
                println!("  {name} {} pf={d}: {:.4} ms ({:.1} GB/s)", ty.name(), med[5 + i], gb / med[5 + i] * 1e3);
            }
        }
    }
}
