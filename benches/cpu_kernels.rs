//! The native CPU kernels at the `bench` model's shapes (Gated DeltaNet: 4 key heads,
//! 8 value heads, K = V = 32, conv 512 channels x 4 taps; attention: 4 query heads over
//! 2 KV heads of 64, blocks of 16), for a prefill step (8 runs of 256 tokens) and a
//! decode step (64 sequences; attention at 300 tokens of context), and decode-sized
//! projections (throughput in flops).
//!
//! Run: `cargo bench -p hybridserve-cpu-kernels --bench cpu_kernels -- --warm-up-time 0.5 --measurement-time 2`.
//! Threads: `HYBRIDSERVE_KERNEL_THREADS` (default 1), printed.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use hybridserve_cpu_kernels::attention::{paged_attention_decode, DecodeSeqs, PagedKv};
use hybridserve_cpu_kernels::conv1d::causal_conv1d;
use hybridserve_cpu_kernels::delta_rule::{gated_delta_rule, Gates, Heads, OutputNorm};
use hybridserve_cpu_kernels::matmul::matmul;
use hybridserve_cpu_kernels::{Rows, Varlen};

fn data(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        })
        .collect()
}

const HEADS: Heads = Heads {
    key_heads: 4,
    value_heads: 8,
    key_dim: 32,
    value_dim: 32,
};
const CONV: usize = 2 * 4 * 32 + 8 * 32;
const PROJ: usize = CONV + 8 * 32 + 2 * 8;

fn varlen(runs: usize, len: usize) -> (Vec<i64>, Vec<i64>, Vec<bool>) {
    (
        (0..=runs).map(|i| (i * len) as i64).collect(),
        (0..runs).map(|i| (2 * i) as i64).collect(),
        vec![true; runs],
    )
}

fn bench(c: &mut Criterion) {
    let threads: usize = std::env::var("HYBRIDSERVE_KERNEL_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    hybridserve_cpu_kernels::set_num_threads(threads);
    println!("kernel threads: {threads}");
    let mut g = c.benchmark_group("cpu_kernels");
    for (name, runs, len) in [("prefill_8x256", 8usize, 256usize), ("decode_64", 64, 1)] {
        let t = runs * len;
        let proj = data(t * PROJ, 1);
        let mixed = data(t * CONV, 2);
        let (qsl, slots, init) = varlen(runs, len);
        let vl = Varlen {
            query_start_loc: &qsl,
            state_slots: &slots,
            has_initial_state: &init,
        };
        let mut state = data(2 * runs * 8 * 32 * 32, 3);
        let mut conv_state = data(2 * runs * CONV * 3, 4);
        let weight = data(CONV * 4, 5);
        let (a_log, dt_bias, norm_w) = (data(8, 6), data(8, 7), data(32, 8));
        let mut out = vec![0.0f32; t * 256];
        let mut conv_out = vec![0.0f32; t * CONV];
        g.throughput(Throughput::Elements(t as u64));
        g.bench_function(format!("conv1d/{name}"), |b| {
            b.iter(|| {
                causal_conv1d(
                    Rows::new(&proj, t, CONV, PROJ).unwrap(),
                    &weight,
                    None,
                    true,
                    &mut conv_state,
                    vl,
                    &mut conv_out,
                )
                .unwrap()
            })
        });
        g.bench_function(format!("delta_rule/{name}"), |b| {
            let col = |at: usize, w: usize| Rows::new(&mixed[at..], t, w, CONV).unwrap();
            let pcol = |at: usize, w: usize| Rows::new(&proj[at..], t, w, PROJ).unwrap();
            b.iter(|| {
                gated_delta_rule(
                    col(0, 128),
                    col(128, 128),
                    col(256, 256),
                    Gates::Raw {
                        a: pcol(CONV + 264, 8),
                        b: pcol(CONV + 256, 8),
                        a_log: &a_log,
                        dt_bias: &dt_bias,
                    },
                    Some(OutputNorm {
                        z: pcol(CONV, 256),
                        weight: &norm_w,
                        eps: 1e-6,
                    }),
                    HEADS,
                    0.17,
                    true,
                    &mut state,
                    vl,
                    &mut out,
                )
                .unwrap()
            })
        });
    }
    // Decode attention: 64 sequences at 300 tokens, blocks scattered over a large pool.
    let (n, len, bs, blocks) = (64usize, 300usize, 16usize, 4096usize);
    let k_cache = data(blocks * bs * 2 * 64, 9);
    let v_cache = data(blocks * bs * 2 * 64, 10);
    let width = len.div_ceil(bs);
    let tables: Vec<i32> = (0..n * width)
        .map(|i| ((i * 2654435761) % blocks) as i32)
        .collect();
    let q = data(n * 256, 11);
    let rows: Vec<i64> = (0..n as i64).collect();
    let lens = vec![len as i64; n];
    let mut out = vec![0.0f32; n * 256];
    g.throughput(Throughput::Elements(n as u64));
    g.bench_function("attention/decode_64x300", |b| {
        b.iter(|| {
            paged_attention_decode(
                Rows::new(&q, n, 256, 256).unwrap(),
                PagedKv {
                    k_cache: &k_cache,
                    v_cache: &v_cache,
                    block_size: bs,
                    kv_heads: 2,
                    head_dim: 64,
                },
                DecodeSeqs {
                    rows: &rows,
                    seq_lens: &lens,
                    block_tables: &tables,
                    width,
                },
                4,
                0.125,
                &mut out,
            )
            .unwrap()
        })
    });
    // Decode-sized projections: the MLP's gate+up (256 -> 2,560) and down (1,280 -> 256).
    for (m, k, n) in [
        (64usize, 256usize, 2560usize),
        (64, 1280, 256),
        (8, 256, 2560),
    ] {
        let x = data(m * k, 12);
        let wt = data(k * n, 13);
        let mut out = vec![0.0f32; m * n];
        g.throughput(Throughput::Elements((2 * m * k * n) as u64));
        g.bench_function(format!("matmul/{m}x{k}x{n}"), |b| {
            b.iter(|| matmul(Rows::new(&x, m, k, k).unwrap(), &wt, n, &mut out).unwrap())
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
