//! `CoreError` -> the exception classes of `hybridserve.errors`, so Python callers
//! catch one hierarchy whichever side found the problem. The message is the
//! core's `Display`, which says what to change.

use hybridserve_core::CoreError;
use pyo3::exceptions::PyValueError;
use pyo3::PyErr;
use pyo3::PyResult;

pyo3::import_exception!(hybridserve.errors, OutOfBlocks);
pyo3::import_exception!(hybridserve.errors, InvalidBlock);
pyo3::import_exception!(hybridserve.errors, ConfigError);

pub fn core_err(e: CoreError) -> PyErr {
    let msg = e.to_string();
    match e {
        CoreError::OutOfBlocks { .. } => OutOfBlocks::new_err(msg),
        CoreError::InvalidBlock { .. } => InvalidBlock::new_err(msg),
        // Bad sizes and arguments: ConfigError is a ValueError subclass.
        CoreError::InvalidArgument(_) => ConfigError::new_err(msg),
    }
}

/// `result.py()?` instead of `result.map_err(core_err)?`.
pub trait CoreResultExt<T> {
    fn py(self) -> PyResult<T>;
}

impl<T> CoreResultExt<T> for Result<T, CoreError> {
    #[inline]
    fn py(self) -> PyResult<T> {
        self.map_err(core_err)
    }
}

/// A Python int as a block id; anything outside `u32` is an invalid block, not
/// an OverflowError, so callers see one exception class for bad ids.
pub fn block_id(b: i64) -> PyResult<u32> {
    u32::try_from(b).map_err(|_| {
        InvalidBlock::new_err(format!("invalid KV block {b}: id out of range; use only block ids this pool handed out"))
    })
}

pub fn count(n: i64, what: &str) -> PyResult<usize> {
    usize::try_from(n).map_err(|_| PyValueError::new_err(format!("{what} must be >= 0, got {n}")))
}
