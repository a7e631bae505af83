//! hybridserve-core: the bookkeeping of a paged, continuously batched engine.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
