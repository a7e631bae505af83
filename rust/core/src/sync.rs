//! Atomics shim: the real `std` atomics normally, loom's model-checked ones when
//! built with `--cfg loom`, so the loom test explores the exact code that ships.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU32, AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
