//! The kernels' thread pool: rayon, sized by the engine (its `cpu_threads`).
//!
//! Its own pool rather than rayon's global one so that an embedding application's
//! rayon work and ours do not share (or size) one pool.

use std::sync::{OnceLock, RwLock};

/// The pool and the thread count it was built with.
type PoolSlot = Option<(usize, std::sync::Arc<rayon::ThreadPool>)>;

static POOL: OnceLock<RwLock<PoolSlot>> = OnceLock::new();

fn slot() -> &'static RwLock<PoolSlot> {
    POOL.get_or_init(|| RwLock::new(None))
}

/// Use `n` threads (at least 1) for the kernels from now on.
pub fn set_num_threads(n: usize) {
    let n = n.max(1);
    let mut g = slot().write().unwrap_or_else(|e| e.into_inner());
    if matches!(&*g, Some((m, _)) if *m == n) {
        return;
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .thread_name(|i| format!("hybridserve-kernel-{i}"))
        .build()
        .expect("cannot start the kernel thread pool");
    *g = Some((n, std::sync::Arc::new(pool)));
}

/// Threads the kernels use (the machine's available parallelism until set).
pub fn num_threads() -> usize {
    pool().current_num_threads()
}

pub(crate) fn pool() -> std::sync::Arc<rayon::ThreadPool> {
    if let Some((_, p)) = &*slot().read().unwrap_or_else(|e| e.into_inner()) {
        return p.clone();
    }
    let n = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    set_num_threads(n);
    slot()
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .unwrap()
        .1
        .clone()
}

/// Runs `f(i)` for `i in 0..n` tasks: inline when there is one task or one thread or
/// too little work (`work` in rough multiply-adds) to pay for waking a thread.
pub(crate) fn for_each_task<F: Fn(usize) + Sync + Send>(n: usize, work: usize, f: F) {
    const MIN_PARALLEL_WORK: usize = 1 << 15;
    if n <= 1 || work < MIN_PARALLEL_WORK {
        (0..n).for_each(f);
        return;
    }
    let p = pool();
    if p.current_num_threads() <= 1 {
        (0..n).for_each(f);
        return;
    }
    use rayon::prelude::*;
    p.install(|| (0..n).into_par_iter().with_max_len(1).for_each(f));
}
