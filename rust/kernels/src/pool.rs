//! Where the kernels' tasks run.
//!
//! In a torch process the cores already belong to torch's OpenMP pool, whose workers
//! spin for milliseconds after every parallel op (libgomp's default wait policy; a
//! `pause` is slow on some CPUs). A second pool (rayon) started right after a GEMM
//! finds its cores taken by spinning workers and gains nothing; measured in the
//! engine, two rayon threads ran the delta rule no faster than one. So when the host
//! hands us its libgomp entry points ([`use_openmp`]), tasks run on those same
//! workers through `GOMP_parallel`, which they pick up while still spinning. Without
//! them (no torch, another OpenMP runtime) tasks run on an own rayon pool.

use std::any::Any;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};

/// The rayon pool and the thread count it was built with.
type RayonSlot = Option<(usize, Arc<rayon::ThreadPool>)>;

static RAYON: OnceLock<RwLock<RayonSlot>> = OnceLock::new();
static THREADS: AtomicUsize = AtomicUsize::new(0);

/// libgomp's `GOMP_parallel(fn, data, num_threads, flags)` and `omp_get_thread_num()`.
type GompParallel =
    unsafe extern "C" fn(extern "C" fn(*mut std::ffi::c_void), *mut std::ffi::c_void, u32, u32);
type OmpThreadNum = unsafe extern "C" fn() -> i32;

static OPENMP: OnceLock<(GompParallel, OmpThreadNum)> = OnceLock::new();

fn rayon_slot() -> &'static RwLock<RayonSlot> {
    RAYON.get_or_init(|| RwLock::new(None))
}

/// Use `n` threads (at least 1) for the kernels from now on.
pub fn set_num_threads(n: usize) {
    THREADS.store(n.max(1), Ordering::Relaxed);
}

/// Threads the kernels use (the machine's available parallelism until set).
pub fn num_threads() -> usize {
    match THREADS.load(Ordering::Relaxed) {
        0 => {
            // Read once: on Linux this reads cgroup files (tens of microseconds).
            let n = std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1);
            let _ = THREADS.compare_exchange(0, n, Ordering::Relaxed, Ordering::Relaxed);
            THREADS.load(Ordering::Relaxed)
        }
        n => n,
    }
}

/// Run tasks on the host's OpenMP (libgomp) workers from now on.
///
/// # Safety
/// `gomp_parallel` and `omp_get_thread_num` must be the addresses of those two
/// functions of the libgomp loaded in this process (the one the host's own parallel
/// ops use, so both share one pool).
pub unsafe fn use_openmp(gomp_parallel: usize, omp_get_thread_num: usize) {
    let f: GompParallel = std::mem::transmute::<usize, GompParallel>(gomp_parallel);
    let g: OmpThreadNum = std::mem::transmute::<usize, OmpThreadNum>(omp_get_thread_num);
    let _ = OPENMP.set((f, g));
}

/// True when tasks run on the host's OpenMP workers.
pub fn uses_openmp() -> bool {
    OPENMP.get().is_some()
}

fn rayon_pool(n: usize) -> Arc<rayon::ThreadPool> {
    if let Some((m, p)) = &*rayon_slot().read().unwrap_or_else(|e| e.into_inner()) {
        if *m == n {
            return p.clone();
        }
    }
    let mut g = rayon_slot().write().unwrap_or_else(|e| e.into_inner());
    let pool = Arc::new(
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .thread_name(|i| format!("hybridserve-kernel-{i}"))
            .build()
            .expect("cannot start the kernel thread pool"),
    );
    *g = Some((n, pool.clone()));
    pool
}

/// What each OpenMP worker runs: claim task indices from a shared counter until none
/// are left (dynamic scheduling: tasks differ in size, e.g. runs of different lengths).
struct Job<'a> {
    next: AtomicUsize,
    n: usize,
    f: &'a (dyn Fn(usize) + Sync),
    /// The first panic of a task, re-raised on the calling thread once the
    /// parallel region is over (what rayon does), so it reaches Python as an
    /// exception instead of aborting the process.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

extern "C" fn openmp_worker(data: *mut std::ffi::c_void) {
    // SAFETY: `data` is the `Job` that `for_each_task` keeps alive across GOMP_parallel.
    let job = unsafe { &*(data as *const Job<'_>) };
    // A panic must not unwind into C: caught here, kept, and the remaining tasks
    // are given up (every worker sees the counter past the end).
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| loop {
        let i = job.next.fetch_add(1, Ordering::Relaxed);
        if i >= job.n {
            break;
        }
        (job.f)(i);
    }));
    if let Err(payload) = r {
        job.next.store(usize::MAX / 2, Ordering::Relaxed);
        let mut slot = job.panic.lock().unwrap_or_else(|e| e.into_inner());
        slot.get_or_insert(payload);
    }
}

/// Runs `f(i)` for `i in 0..n` tasks: inline when there is one task or one thread or
/// too little work (`work` in rough multiply-adds) to pay for waking a thread.
pub(crate) fn for_each_task<F: Fn(usize) + Sync + Send>(n: usize, work: usize, f: F) {
    const MIN_PARALLEL_WORK: usize = 1 << 15;
    let threads = num_threads().min(n);
    if threads <= 1 || work < MIN_PARALLEL_WORK {
        (0..n).for_each(f);
        return;
    }
    if let Some((gomp_parallel, _)) = OPENMP.get() {
        let job = Job {
            next: AtomicUsize::new(0),
            n,
            f: &f,
            panic: Mutex::new(None),
        };
        // SAFETY: the entry point was registered by `use_openmp`; `job` outlives the
        // call, which returns only when every worker has finished.
        unsafe {
            gomp_parallel(
                openmp_worker,
                &job as *const Job<'_> as *mut std::ffi::c_void,
                threads as u32,
                0,
            )
        };
        // Every worker has left the region: re-raise a task's panic here.
        if let Some(payload) = job.panic.into_inner().unwrap_or_else(|e| e.into_inner()) {
            std::panic::resume_unwind(payload);
        }
        return;
    }
    use rayon::prelude::*;
    // One pool of the configured size (not of `threads`, which follows the task count).
    rayon_pool(num_threads()).install(|| (0..n).into_par_iter().with_max_len(1).for_each(f));
}

/// Runs `n` tasks of which task `bad` panics, on the kernels' pool: the panic
/// must come back to the caller after the parallel region, on every pool
/// (a test hook for the bindings; `work` forces the parallel path).
#[doc(hidden)]
pub fn panic_in_task(n: usize, bad: usize) -> usize {
    let done = AtomicUsize::new(0);
    for_each_task(n, usize::MAX, |i| {
        if i == bad {
            panic!("kernel task {i} panicked (test hook)");
        }
        done.fetch_add(1, Ordering::Relaxed);
    });
    done.into_inner()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[link(name = "gomp")]
    extern "C" {
        fn GOMP_parallel(f: extern "C" fn(*mut std::ffi::c_void), data: *mut std::ffi::c_void, n: u32, flags: u32);
        fn omp_get_thread_num() -> i32;
    }

    fn panics_come_back(pool: &str) {
        set_num_threads(4);
        let r = std::panic::catch_unwind(|| panic_in_task(64, 5));
        let payload = r.expect_err("the task's panic reached the caller");
        let msg = payload.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(msg.contains("kernel task 5 panicked"), "{pool}: {msg}");
        // The pool still works afterwards.
        assert_eq!(panic_in_task(64, usize::MAX), 64, "{pool}");
    }

    #[test]
    fn a_task_panic_reaches_the_caller_on_rayon_then_openmp() {
        // One test: the OpenMP switch is process-wide and one-way.
        panics_come_back("rayon");
        // SAFETY: the addresses of this process's libgomp entry points.
        unsafe { use_openmp(GOMP_parallel as *const () as usize, omp_get_thread_num as *const () as usize) };
        assert!(uses_openmp());
        panics_come_back("openmp");
    }
}
