//! The native CPU kernels at the `bench` model's shapes (Gated DeltaNet: 4 key heads,
//! 8 value heads, K = V = 32, conv 512 channels x 4 taps; attention: 4 query heads over
//! 2 KV heads of 64, blocks of 16), for a prefill step (8 runs of 256 tokens) and a
//! decode step (64 sequences; attention at 300 tokens of context), and decode-sized
//! projections (throughput in flops).
//!
//! The DeltaNet state lives as the arena holds it (issue 17): items in 32 KiB pages
//! (the bench model's page at block size 16: 8 recurrent heads or 5 conv states per
//! page), each sequence's pages scattered through a state page table, the layer's items
//! at its item base; attention's K/V blocks a page apart (two layers per page).
//!
//! Run: `cargo bench -p hybridserve-cpu-kernels --bench cpu_kernels -- --warm-up-time 0.5 --measurement-time 2`.
//! Threads: `HYBRIDSERVE_KERNEL_THREADS` (default 1), printed.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use hybridserve_cpu_kernels::attention::{paged_attention_decode, DecodeSeqs, PagedKv};
use hybridserve_cpu_kernels::conv1d::causal_conv1d;
use hybridserve_cpu_kernels::delta_rule::{gated_delta_rule, Gates, Heads, OutputNorm};
use hybridserve_cpu_kernels::matmul::matmul;
use hybridserve_cpu_kernels::{PagedState, Rows, Varlen};

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

fn varlen(runs: usize, len: usize) -> (Vec<i64>, Vec<bool>) {
    (
        (0..=runs).map(|i| (i * len) as i64).collect(),
        vec![true; runs],
    )
}

/// The bench model's arena page (32 KiB = 8,192 floats) and a sequence's state page
/// table (6 recurrent pages + 2 conv pages); `runs` sequences' rows at scattered pages
/// of a pool twice as large.
const PAGE: usize = 8192;
const STATE_PAGES: usize = 8;

fn state_table(runs: usize) -> (Vec<i64>, usize) {
    let pages = 2 * runs * STATE_PAGES;
    let table = (0..runs * STATE_PAGES)
        .map(|i| ((i * 2654435761) % pages) as i64)
        .collect();
    (table, pages)
}

fn paged(
    table: &[i64],
    pages: usize,
    item_base: usize,
    per_page: usize,
    item_len: usize,
) -> PagedState<'_> {
    PagedState {
        table,
        cols: STATE_PAGES,
        item_base,
        per_page,
        page_stride: PAGE,
        item_len,
        num_pages: pages,
        checkpoint_positions: &[],
        checkpoint_table: &[],
    }
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
        let (qsl, init) = varlen(runs, len);
        let vl = Varlen {
            query_start_loc: &qsl,
            has_initial_state: &init,
        };
        let (table, pages) = state_table(runs);
        // The third DeltaNet layer's heads (items 16..24: page column 2) and its conv
        // state (conv item 6*5 + 2: column 6, slot 2).
        let rec = paged(&table, pages, 16, 8, 32 * 32);
        let cst = paged(&table, pages, 6 * 5 + 2, 5, CONV * 3);
        let mut state = data(pages * PAGE, 3);
        let mut conv_state = data(pages * PAGE, 4);
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
                    cst,
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
                    rec,
                    vl,
                    &mut out,
                )
                .unwrap()
            })
        });
    }
    // Decode attention: 64 sequences at 300 tokens, blocks scattered over a large pool.
    let (n, len, bs, blocks) = (64usize, 300usize, 16usize, 4096usize);
    // One page per block: this layer's K and V, another layer's, as in the arena.
    let blk = bs * 2 * 64;
    let kv_page = 4 * blk;
    let arena = data(blocks * kv_page, 9);
    let (k_cache, v_cache) = (&arena[..], &arena[blk..]);
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
                    k_cache,
                    v_cache,
                    block_size: bs,
                    kv_heads: 2,
                    head_dim: 64,
                    num_blocks: blocks,
                    block_stride: kv_page,
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
