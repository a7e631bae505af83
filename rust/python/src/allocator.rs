//! `BlockAllocator`: the lock-free allocator itself, callable from any Python
//! thread (the class is frozen and every method takes `&self`).

use crate::errors::{block_id, count, CoreResultExt};
use hybridserve_core::BlockAllocator;
use numpy::{IntoPyArray, PyArray1};
use pyo3::prelude::*;

#[pyclass(name = "BlockAllocator", module = "hybridserve._core", frozen)]
pub struct PyBlockAllocator {
    inner: BlockAllocator,
}

#[pymethods]
impl PyBlockAllocator {
    #[new]
    fn new(num_blocks: u32) -> PyResult<Self> {
        if num_blocks >= 1 << 31 {
            return Err(crate::errors::ConfigError::new_err(format!(
                "num_blocks must be below 2^31, got {num_blocks}; lower num_blocks"
            )));
        }
        Ok(PyBlockAllocator { inner: BlockAllocator::new(num_blocks) })
    }

    #[getter]
    fn num_blocks(&self) -> u32 {
        self.inner.num_blocks()
    }

    #[getter]
    fn num_free(&self) -> u32 {
        self.inner.num_free()
    }

    fn allocate(&self) -> PyResult<u32> {
        self.inner.allocate().py()
    }

    fn allocate_n<'py>(&self, py: Python<'py>, n: i64) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let n = count(n, "n")?;
        let mut out = Vec::with_capacity(n);
        py.detach(|| self.inner.allocate_n(n, &mut out)).py()?;
        Ok(out.into_iter().map(|b| b as i32).collect::<Vec<i32>>().into_pyarray(py))
    }

    fn incref(&self, block: i64) -> PyResult<u32> {
        self.inner.incref(block_id(block)?).py()
    }

    fn decref(&self, block: i64) -> PyResult<u32> {
        self.inner.decref(block_id(block)?).py()
    }

    fn decref_retain(&self, block: i64) -> PyResult<u32> {
        self.inner.decref_retain(block_id(block)?).py()
    }

    fn release(&self, block: i64) -> PyResult<()> {
        self.inner.release(block_id(block)?).py()
    }

    fn revive(&self, block: i64) -> PyResult<()> {
        self.inner.revive(block_id(block)?).py()
    }

    fn refcount(&self, block: i64) -> u32 {
        u32::try_from(block).map_or(0, |b| self.inner.refcount(b))
    }

    fn is_free(&self, block: i64) -> bool {
        u32::try_from(block).is_ok_and(|b| self.inner.is_free(b))
    }

    fn free_list<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        self.inner.free_list_snapshot().into_iter().map(|b| b as i32).collect::<Vec<i32>>().into_pyarray(py)
    }

    fn __repr__(&self) -> String {
        format!("BlockAllocator(num_blocks={}, num_free={})", self.inner.num_blocks(), self.inner.num_free())
    }
}
