//! `hybridserve._core`: thin PyO3 bindings over `hybridserve-core`.
//!
//! One Python method per core call; the GIL is released around work that is
//! not O(1) (allocate_n, match_prefix, append_slots, cache_full_blocks, freeing
//! a table). Block tables and slot mappings come back as numpy int32 arrays
//! built from owned Vecs (no extra copy). Errors are the classes of
//! `hybridserve.errors`.
use pyo3::prelude::*;

mod allocator;
mod errors;
mod kernels;
mod kv_cache;
mod scheduler;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", hybridserve_core::VERSION)?;
    m.add_class::<allocator::PyBlockAllocator>()?;
    m.add_class::<kv_cache::PyBlockTable>()?;
    m.add_class::<kv_cache::PyKvCacheManager>()?;
    scheduler::register(m)?;
    // CPU kernels live in a submodule: hybridserve._core.kernels.
    let k = PyModule::new(m.py(), "kernels")?;
    kernels::register(&k)?;
    m.add_submodule(&k)?;
    Ok(())
}
