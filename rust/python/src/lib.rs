//! `hybridserve._core`: thin PyO3 bindings over `hybridserve-core`.
use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", hybridserve_core::VERSION)?;
    Ok(())
}
