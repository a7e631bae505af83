//! `StatePool`: DeltaNet state slots.

use crate::errors::{count, slot_id, CoreResultExt};
use hybridserve_core::{SlotUse, StatePool};
use numpy::{IntoPyArray, PyArray1};
use pyo3::prelude::*;

#[pyclass(name = "StatePool", module = "hybridserve._core")]
pub struct PyStatePool {
    inner: StatePool,
}

#[pymethods]
impl PyStatePool {
    #[new]
    fn new(num_slots: u32) -> Self {
        PyStatePool { inner: StatePool::new(num_slots) }
    }

    #[getter]
    fn num_slots(&self) -> u32 {
        self.inner.num_slots()
    }
    #[getter]
    fn num_free(&self) -> u32 {
        self.inner.num_free()
    }
    #[getter]
    fn num_used(&self) -> u32 {
        self.inner.num_used()
    }

    fn allocate(&mut self) -> PyResult<u32> {
        self.inner.allocate().py()
    }

    fn allocate_n<'py>(&mut self, py: Python<'py>, n: i64) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let n = count(n, "n")?;
        let mut out = Vec::with_capacity(n);
        self.inner.allocate_n(n, &mut out).py()?;
        Ok(out.into_iter().map(|s| s as i32).collect::<Vec<i32>>().into_pyarray(py))
    }

    fn allocate_checkpoint(&mut self, block_hash: u64) -> PyResult<u32> {
        self.inner.allocate_checkpoint(block_hash).py()
    }

    fn free(&mut self, slot: i64) -> PyResult<()> {
        self.inner.free(slot_id(slot)?).py()
    }

    fn fork(&mut self, src: i64) -> PyResult<(u32, u32)> {
        self.inner.fork(slot_id(src)?).py()
    }

    /// "free", "sequence", "checkpoint", or None for an id out of range.
    fn slot_use(&self, slot: i64) -> Option<&'static str> {
        let s = u32::try_from(slot).ok()?;
        self.inner.slot_use(s).map(|u| match u {
            SlotUse::Free => "free",
            SlotUse::Sequence => "sequence",
            SlotUse::Checkpoint { .. } => "checkpoint",
        })
    }

    fn __repr__(&self) -> String {
        format!("StatePool(num_slots={}, num_free={})", self.inner.num_slots(), self.inner.num_free())
    }
}
