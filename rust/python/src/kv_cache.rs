//! `KvCacheManager` and its `BlockTable` handles.
//!
//! A `BlockTable` is an opaque per-sequence handle created by
//! `KvCacheManager.new_table()` (or `BlockTable()`, bound to the first manager it
//! is used with) and passed back to the manager's methods; Python never edits it.
//! Dropping a table without `free(table)` leaks its blocks (the manager cannot
//! see Python's garbage collector), exactly like forgetting a `decref`.

use crate::errors::{block_id, count, CoreResultExt};
use hybridserve_core::{BlockId, BlockTable, KvCacheManager};
use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray1, PyArray2, PyReadonlyArray1};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::sync::atomic::{AtomicU64, Ordering};

static NEXT_MANAGER_ID: AtomicU64 = AtomicU64::new(1);

#[pyclass(name = "BlockTable", module = "hybridserve._core")]
#[derive(Default)]
pub struct PyBlockTable {
    inner: BlockTable,
    /// Id of the manager whose blocks this table holds; 0 = not bound yet.
    owner: u64,
}

#[pymethods]
impl PyBlockTable {
    #[new]
    fn new() -> Self {
        Self::default()
    }

    /// Physical block ids in logical order (a fresh int32 array).
    #[getter]
    fn blocks<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        self.inner.blocks().iter().map(|&b| b as i32).collect::<Vec<i32>>().into_pyarray(py)
    }

    /// Tokens whose KV slots are reserved.
    #[getter]
    fn num_tokens(&self) -> usize {
        self.inner.num_tokens()
    }

    #[getter]
    fn num_blocks(&self) -> usize {
        self.inner.num_blocks()
    }

    /// Chained hashes of the leading full blocks registered or matched in the cache.
    fn block_hashes(&self) -> Vec<u64> {
        (0..self.inner.num_hashed_blocks()).filter_map(|i| self.inner.block_hash(i)).collect()
    }

    fn __repr__(&self) -> String {
        format!("BlockTable(num_tokens={}, blocks={:?})", self.inner.num_tokens(), self.inner.blocks())
    }
}

/// Token ids from a list/tuple of ints or a 1-D integer numpy array.
fn tokens_from(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    fn conv<T: Copy + TryInto<u32>>(it: impl Iterator<Item = T>) -> PyResult<Vec<u32>> {
        it.map(|t| t.try_into().map_err(|_| PyValueError::new_err("token ids must be integers in [0, 2^32); fix the tokenizer output")))
            .collect()
    }
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i32>>() {
        return conv(a.as_array().iter().copied());
    }
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i64>>() {
        return conv(a.as_array().iter().copied());
    }
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, u32>>() {
        return Ok(a.as_array().to_vec());
    }
    let v: Vec<i64> = obj
        .extract()
        .map_err(|_| PyValueError::new_err("tokens must be a sequence of ints or a 1-D integer numpy array"))?;
    conv(v.into_iter())
}

#[pyclass(name = "KvCacheManager", module = "hybridserve._core")]
pub struct PyKvCacheManager {
    inner: KvCacheManager,
    id: u64,
}

impl PyKvCacheManager {
    /// The table's core object, after checking it belongs to this manager.
    fn own<'a>(&self, t: &'a mut PyBlockTable) -> PyResult<&'a mut BlockTable> {
        if t.owner == 0 {
            t.owner = self.id;
        } else if t.owner != self.id {
            return Err(PyValueError::new_err(
                "this BlockTable holds blocks of another KvCacheManager; use each table only with the manager that created it",
            ));
        }
        Ok(&mut t.inner)
    }
}

#[pymethods]
impl PyKvCacheManager {
    #[new]
    #[pyo3(signature = (num_blocks, block_size, enable_prefix_caching = true))]
    fn new(num_blocks: u32, block_size: u32, enable_prefix_caching: bool) -> PyResult<Self> {
        Ok(PyKvCacheManager {
            inner: KvCacheManager::new(num_blocks, block_size, enable_prefix_caching).py()?,
            id: NEXT_MANAGER_ID.fetch_add(1, Ordering::Relaxed),
        })
    }

    #[getter]
    fn block_size(&self) -> u32 {
        self.inner.block_size()
    }
    #[getter]
    fn num_blocks(&self) -> u32 {
        self.inner.num_blocks()
    }
    #[getter]
    fn num_free_blocks(&self) -> u32 {
        self.inner.num_free_blocks()
    }
    #[getter]
    fn num_used_blocks(&self) -> u32 {
        self.inner.num_used_blocks()
    }
    #[getter]
    fn num_cached_blocks(&self) -> u32 {
        self.inner.num_cached_blocks()
    }
    #[getter]
    fn prefix_caching_enabled(&self) -> bool {
        self.inner.prefix_caching_enabled()
    }

    /// An empty table bound to this manager.
    fn new_table(&self) -> PyBlockTable {
        PyBlockTable { inner: BlockTable::new(), owner: self.id }
    }

    fn blocks_needed(&self, mut table: PyRefMut<'_, PyBlockTable>, num_new_tokens: i64) -> PyResult<u32> {
        let n = count(num_new_tokens, "num_new_tokens")?;
        let t = self.own(&mut table)?;
        Ok(self.inner.blocks_needed(t, n))
    }

    #[pyo3(signature = (table, tokens, extra_key = 0))]
    fn match_prefix(&mut self, py: Python<'_>, mut table: PyRefMut<'_, PyBlockTable>, tokens: &Bound<'_, PyAny>, extra_key: u64) -> PyResult<usize> {
        let tokens = tokens_from(tokens)?;
        let t = self.own(&mut table)?;
        if t.num_blocks() != 0 {
            return Err(PyValueError::new_err("match_prefix needs an empty table; call it before appending, on a fresh table"));
        }
        let inner = &mut self.inner;
        Ok(py.detach(|| inner.match_prefix(t, &tokens, extra_key)))
    }

    /// Reserves slots for `n` more tokens; returns `(slot_mapping int32[n],
    /// block_copies int32[K, 2] of (src, dst))`. All or nothing (OutOfBlocks).
    #[allow(clippy::type_complexity)]
    fn append_slots<'py>(
        &mut self,
        py: Python<'py>,
        mut table: PyRefMut<'_, PyBlockTable>,
        n: i64,
    ) -> PyResult<(Bound<'py, PyArray1<i32>>, Bound<'py, PyArray2<i32>>)> {
        let n = count(n, "n")?;
        let t = self.own(&mut table)?;
        let inner = &mut self.inner;
        let (slots, copies) = py.detach(|| {
            let (mut slots, mut copies) = (Vec::with_capacity(n), Vec::<(BlockId, BlockId)>::new());
            inner.append_slots(t, n, &mut slots, &mut copies).map(|_| (slots, copies))
        }).py()?;
        let flat: Vec<i32> = copies.iter().flat_map(|&(s, d)| [s as i32, d as i32]).collect();
        let copies = Array2::from_shape_vec((copies.len(), 2), flat).expect("2 per copy");
        Ok((slots.into_pyarray(py), copies.into_pyarray(py)))
    }

    #[pyo3(signature = (table, tokens, extra_key = 0))]
    fn cache_full_blocks(&mut self, py: Python<'_>, mut table: PyRefMut<'_, PyBlockTable>, tokens: &Bound<'_, PyAny>, extra_key: u64) -> PyResult<()> {
        let tokens = tokens_from(tokens)?;
        let t = self.own(&mut table)?;
        let inner = &mut self.inner;
        py.detach(|| inner.cache_full_blocks(t, &tokens, extra_key));
        Ok(())
    }

    /// A child table sharing every block of `table` (copy-on-write).
    fn fork(&mut self, mut table: PyRefMut<'_, PyBlockTable>) -> PyResult<PyBlockTable> {
        let t = self.own(&mut table)?;
        Ok(PyBlockTable { inner: self.inner.fork(t), owner: self.id })
    }

    /// Drops the table's blocks (tail first); the table is empty and reusable.
    fn free(&mut self, py: Python<'_>, mut table: PyRefMut<'_, PyBlockTable>) -> PyResult<()> {
        let t = self.own(&mut table)?;
        let inner = &mut self.inner;
        py.detach(|| inner.free(t));
        Ok(())
    }

    fn tail_waste(&self, mut table: PyRefMut<'_, PyBlockTable>) -> PyResult<usize> {
        let t = self.own(&mut table)?;
        Ok(self.inner.tail_waste(t))
    }

    fn refcount(&self, block: i64) -> PyResult<u32> {
        let b = block_id(block)?;
        if b >= self.inner.num_blocks() {
            return Err(crate::errors::core_err(hybridserve_core::CoreError::InvalidBlock { block: b, reason: "id out of range" }));
        }
        Ok(self.inner.refcount(b))
    }

    fn is_cached(&self, block: i64) -> bool {
        u32::try_from(block).is_ok_and(|b| self.inner.is_cached(b))
    }

    /// Parked cached blocks, next to be evicted first.
    fn lru_order<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        self.inner.lru_order().into_iter().map(|b| b as i32).collect::<Vec<i32>>().into_pyarray(py)
    }

    /// Counters since construction plus current block counts.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        d.set_item("prefix_queries", s.prefix_queries)?;
        d.set_item("prefix_query_tokens", s.prefix_query_tokens)?;
        d.set_item("prefix_hit_tokens", s.prefix_hit_tokens)?;
        d.set_item("prefix_hits", s.prefix_hits)?;
        d.set_item("alloc_failures", s.alloc_failures)?;
        d.set_item("evictions", s.evictions)?;
        d.set_item("cow_copies", s.cow_copies)?;
        d.set_item("num_free_blocks", self.inner.num_free_blocks())?;
        d.set_item("num_used_blocks", self.inner.num_used_blocks())?;
        d.set_item("num_cached_blocks", self.inner.num_cached_blocks())?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        format!(
            "KvCacheManager(num_blocks={}, block_size={}, free={}, cached={})",
            self.inner.num_blocks(),
            self.inner.block_size(),
            self.inner.num_free_blocks(),
            self.inner.num_cached_blocks()
        )
    }
}
