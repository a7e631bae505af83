//! The K/V cache write binding (`hybridserve_cpu_kernels::cache_write`), for float32
//! and bfloat16 (uint16 bits) caches alike.

use super::*;
use hybridserve_cpu_kernels::cache_write::{write_kv as write, KvPages};

/// One layer's paged cache view `[num_blocks, block_size, Hkv, D]` as [`KvPages`].
/// The K and V views are interleaved views of the same arena pages, so no
/// `&mut` slice is formed over either (they would alias): the view keeps the
/// array's pointer and extent.
fn pages<'a, T: numpy::Element + Copy>(
    name: &str,
    a: &'a mut PyReadwriteArrayDyn<'_, T>,
) -> PyResult<KvPages<'a, T>> {
    let mut v = a.as_array_mut();
    let (extent, num_blocks, block_size, block_stride, row_len) = paged_view(name, v.shape(), v.strides())?;
    // SAFETY: the view's strided extent lies in the array's buffer (numpy
    // guarantees it is allocated) and the borrow `a` (numpy's borrow checker
    // holds it writable) outlives the view; the other view of the same pages
    // is also a `KvPages`, and write_kv touches both from one thread, through
    // the pointers only, with no reference to the elements alive.
    Ok(unsafe { KvPages::from_raw_parts(v.as_mut_ptr(), extent, num_blocks, block_size, block_stride, row_len) })
}

fn write_typed<T: numpy::Element + Copy>(
    py: Python<'_>,
    key: &Bound<'_, PyAny>,
    value: &Bound<'_, PyAny>,
    slots: &[i64],
    k_cache: &Bound<'_, PyAny>,
    v_cache: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let key: PyReadonlyArray2<'_, T> = key.extract()?;
    let value: PyReadonlyArray2<'_, T> = value.extract()?;
    let mut kc: PyReadwriteArrayDyn<'_, T> = k_cache.extract()?;
    let mut vc: PyReadwriteArrayDyn<'_, T> = v_cache.extract()?;
    let (key, value) = (rows("key", &key)?, rows("value", &value)?);
    let (kp, vp) = (pages("k_cache", &mut kc)?, pages("v_cache", &mut vc)?);
    py.detach(|| write(key, value, slots, kp, vp)).map_err(err)
}

/// Rows of `key` / `value` (`[T, Hkv * D]`, row-strided allowed) into the paged caches
/// (`[num_blocks, block_size, Hkv, D]` arena views) at `slot_mapping` (int64, `-1` =
/// skip); all float32, or all bfloat16 bits (uint16 views).
#[pyfunction]
fn write_kv(
    py: Python<'_>,
    key: &Bound<'_, PyAny>,
    value: &Bound<'_, PyAny>,
    slot_mapping: PyReadonlyArray1<'_, i64>,
    k_cache: &Bound<'_, PyAny>,
    v_cache: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let slots = ints("slot_mapping", &slot_mapping)?;
    if key.extract::<PyReadonlyArray2<'_, u16>>().is_ok() {
        return write_typed::<u16>(py, key, value, slots, k_cache, v_cache);
    }
    write_typed::<f32>(py, key, value, slots, k_cache, v_cache).map_err(|e| {
        PyValueError::new_err(format!(
            "key, value and the caches must all be float32 or all bfloat16 bits (uint16): {e}"
        ))
    })
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(write_kv, m)?)
}
