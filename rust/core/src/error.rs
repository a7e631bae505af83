//! Typed errors of the core. A `CoreError` is always a caller's mistake or a
//! capacity limit, never an internal bug (those panic). Every message says what to
//! change, because it usually travels unmodified to a Python exception or an HTTP
//! error body.

use crate::BlockId;
use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CoreError {
    /// The block pool cannot supply `needed` blocks; only `free` are allocatable.
    OutOfBlocks { needed: u32, free: u32 },
    /// A block id out of range, or used while it holds no reference.
    InvalidBlock { block: BlockId, reason: &'static str },
    /// A bad constructor or call argument; the message names it and the valid range.
    InvalidArgument(String),
}

impl fmt::Display for CoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CoreError::OutOfBlocks { needed, free } => write!(
                f,
                "out of arena pages: needed {needed}, {free} free; raise num_pages \
                 (more GPU memory for the cache arena) or lower max_num_seqs / max_num_batched_tokens"
            ),
            CoreError::InvalidBlock { block, reason } => write!(
                f,
                "invalid KV block {block}: {reason}; use only block ids this pool handed out \
                 and still referenced"
            ),
            CoreError::InvalidArgument(msg) => f.write_str(msg),
        }
    }
}

impl std::error::Error for CoreError {}
