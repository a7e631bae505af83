//! Scheduler step latency: one `schedule()` + `update()` with N decoding
//! sequences (issue 3). Block size 16, distinct prompts, prefix caching on (so
//! block hashing is included), a pool large enough that nothing is preempted.
//!
//! * `steady/N`: 1024-token prompts, one new token per sequence per step.
//! * `churn/N`: the same, but every request lives 100 steps (1%/step finish) and
//!   as many new 1024-token requests arrive each step (their add_request, prompt
//!   hashing and prefill chunks are inside the measured step).
//! * `steady_16k/N`: 16,384-token prompts: the per-step cost must not grow with
//!   context length.
//!
//! Throughput is set to N elements, so criterion's "elem/s" inverts to the time
//! per sequence per step. Targets at N = 1024: <= 0.15 us/seq/step steady and
//! <= 0.5 us with churn.
//!
//! Run: `cargo bench -p hybridserve-core --bench scheduler -- --warm-up-time 0.5 --measurement-time 2`.
//! Setup (prefilling the prompts, rebuilding the scheduler every few thousand
//! steps so contexts stay bounded) is outside the timed region (`iter_custom`).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use hybridserve_core::scheduler::{RequestParams, Scheduler, SchedulerConfig};
use std::time::{Duration, Instant};

const BS: u32 = 16;
const LIFE: u32 = 100;
/// Steady runs rebuild after this many timed steps (contexts grow by 1 per step).
const REBUILD_STEPS: u64 = 2048;

struct Workload {
    s: Scheduler,
    prompt_len: usize,
    churn: bool,
    next_id: u64,
    prompt: Vec<u32>,
    sampled: Vec<i32>,
    steps: u64,
}

impl Workload {
    fn new(n: usize, prompt_len: usize, churn: bool) -> Self {
        let growth = if churn { LIFE as usize } else { REBUILD_STEPS as usize + 8 };
        let max_model_len = (prompt_len + growth + 16) as u32;
        let per_seq = (prompt_len + growth).div_ceil(BS as usize) + 2;
        // Churn: leave room for the parked (cached) blocks of finished requests.
        let num_blocks = (n * per_seq * if churn { 2 } else { 1 } + 1024) as u32;
        // One arena: the blocks plus a one-page DeltaNet state per sequence.
        let num_pages = num_blocks + n as u32 + 8;
        let mut cfg = SchedulerConfig::new(num_pages, BS, 1, n as u32, n as u32 + 16384, max_model_len);
        cfg.enable_prefix_caching = true;
        cfg.max_finished_retained = 1024;
        let s = Scheduler::new(cfg).unwrap();
        let mut w = Workload { s, prompt_len, churn, next_id: 0, prompt: Vec::with_capacity(prompt_len), sampled: Vec::new(), steps: 0 };
        for i in 0..n {
            // Churn: remaining lifetimes spread over 1..=LIFE decode steps.
            let life = if churn { 2 + (i as u32 % LIFE) } else { growth as u32 };
            w.add(life);
        }
        // Prefill everything (untimed): steady until every sequence decodes;
        // churn (which always has newcomers prefilling) until the initial prompts
        // are through and replacements have started.
        let prefill_steps = (n * prompt_len).div_ceil(16384) as u64 + 5;
        loop {
            let out = w.s.schedule(0.0).unwrap();
            let all_decode = out.num_decodes == out.num_seqs() && out.num_seqs() == n;
            w.sampled.clear();
            w.sampled.resize(out.total_samples(), 1);
            let finished = w.s.update(&w.sampled).unwrap().finished.len();
            if churn {
                for _ in 0..finished {
                    w.add(LIFE);
                }
            }
            w.steps += 1;
            if (!churn && all_decode) || (churn && w.steps >= prefill_steps) {
                break;
            }
        }
        w.steps = 0;
        w
    }

    fn add(&mut self, max_tokens: u32) {
        let r = self.next_id;
        self.next_id += 1;
        // Distinct prompts: token ids derived from the request number.
        self.prompt.clear();
        let base = (r as u32).wrapping_mul(7919);
        self.prompt.extend((0..self.prompt_len as u32).map(|j| base.wrapping_add(j) % 150_000 + 10));
        let params = RequestParams { max_tokens, ..Default::default() };
        self.s.add_request(&format!("req-{r}"), &self.prompt, params).unwrap();
    }

    #[inline]
    fn step(&mut self) {
        let out = self.s.schedule(0.0).unwrap();
        self.sampled.clear();
        self.sampled.resize(out.total_samples(), 1);
        let upd = self.s.update(&self.sampled).unwrap();
        let finished = upd.finished.len();
        if self.churn {
            for _ in 0..finished {
                self.add(LIFE);
            }
        }
        self.steps += 1;
    }
}

fn run_variant(c: &mut Criterion, name: &str, ns: &[usize], prompt_len: usize, churn: bool) {
    let mut g = c.benchmark_group(name);
    g.sample_size(10);
    for &n in ns {
        g.throughput(Throughput::Elements(n as u64));
        let mut w = Workload::new(n, prompt_len, churn);
        g.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, &n| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    if !churn && w.steps >= REBUILD_STEPS {
                        w = Workload::new(n, prompt_len, churn);
                    }
                    let t0 = Instant::now();
                    w.step();
                    total += t0.elapsed();
                }
                total
            })
        });
    }
    g.finish();
}

fn bench(c: &mut Criterion) {
    let ns: Vec<usize> = std::env::var("SCHED_BENCH_NS")
        .ok()
        .map(|v| v.split(',').map(|x| x.trim().parse().unwrap()).collect())
        .unwrap_or_else(|| vec![64, 256, 1024, 4096]);
    run_variant(c, "scheduler_steady", &ns, 1024, false);
    run_variant(c, "scheduler_churn", &ns, 1024, true);
    let ns16: Vec<usize> = ns.iter().copied().filter(|&n| n <= 1024).collect();
    run_variant(c, "scheduler_steady_16k", &ns16, 16384, false);
}

criterion_group!(benches, bench);
criterion_main!(benches);
