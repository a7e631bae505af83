//! Writing a step's new K/V rows into the paged cache: one row copy per token.
//!
//! torch runs `k_cache[block, offset] = key` as an advanced-index `index_put_` with
//! two index tensors (plus `slots // bs`, `slots % bs` and a `slots >= 0` check), two
//! per attention layer and step: 6.6% of a float32 decode step by torch's profiler at
//! the 0.1b bench shape, on a machine under load (its parallel region waits for every
//! worker). The copy itself is `T x Hkv x D` elements, nothing to parallelise: it
//! runs on the calling thread.

use crate::KernelError;

/// The paged cache of one attention layer (K or V): `num_blocks` blocks
/// `block_stride` elements apart, each `block_size` rows of `row_len` (`Hkv x D`).
///
/// Held as a base pointer and an extent, not a `&mut [E]`: the K and V views of
/// one layer are interleaved views of the same arena pages (a page holds the
/// block's K rows, then its V rows), so their extents overlap and two `&mut`
/// slices over them would alias (undefined behaviour even though no element is
/// written through both). Writes go through the pointer, one row at a time, and
/// no reference to the cache's elements is ever formed.
pub struct KvPages<'a, E> {
    ptr: *mut E,
    len: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    pub block_stride: usize,
    pub row_len: usize,
    _borrow: std::marker::PhantomData<&'a mut [E]>,
}

// SAFETY: a `KvPages` is a write capability over memory its constructor's
// caller lent for `'a` (like `&'a mut [E]`, which is `Send` for `E: Send`);
// it holds no thread-bound state. Two views of one arena may be sent to one
// other thread together; `write_kv` uses them from one thread only.
unsafe impl<E: Send> Send for KvPages<'_, E> {}

impl<'a, E: Copy> KvPages<'a, E> {
    /// A view over a buffer of its own.
    pub fn new(data: &'a mut [E], num_blocks: usize, block_size: usize, block_stride: usize, row_len: usize) -> Self {
        KvPages {
            ptr: data.as_mut_ptr(),
            len: data.len(),
            num_blocks,
            block_size,
            block_stride,
            row_len,
            _borrow: std::marker::PhantomData,
        }
    }

    /// A view of `len` elements at `ptr`, which may overlap another view
    /// (the K and V views of one arena).
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` elements of `E`
    /// during `'a`, and during `'a` nothing may read or write those elements
    /// except through `KvPages` views (no live reference to them), and no
    /// other thread may touch them.
    pub unsafe fn from_raw_parts(
        ptr: *mut E,
        len: usize,
        num_blocks: usize,
        block_size: usize,
        block_stride: usize,
        row_len: usize,
    ) -> Self {
        KvPages { ptr, len, num_blocks, block_size, block_stride, row_len, _borrow: std::marker::PhantomData }
    }

    fn check(&self, name: &str) -> Result<(), KernelError> {
        let fits = self.num_blocks == 0
            || ((self.num_blocks - 1) * self.block_stride + self.block_size * self.row_len
                <= self.len
                && (self.num_blocks == 1 || self.block_stride >= self.block_size * self.row_len));
        if !fits || self.block_size == 0 {
            return Err(KernelError::new(format!(
                "{name}: {} blocks of {} rows x {} a stride {} apart do not fit in {} elements",
                self.num_blocks,
                self.block_size,
                self.row_len,
                self.block_stride,
                self.len
            )));
        }
        Ok(())
    }

    /// Copies `row` (`row_len` elements) to element offset `at`.
    ///
    /// # Safety
    /// `at + row.len() <= self.len`, and `row` does not alias this view.
    #[inline]
    unsafe fn put(&mut self, at: usize, row: &[E]) {
        debug_assert!(at + row.len() <= self.len);
        // SAFETY: in bounds by the caller's check and the constructor's
        // contract; `row` is a separate buffer (the caller's).
        unsafe { std::ptr::copy_nonoverlapping(row.as_ptr(), self.ptr.add(at), row.len()) }
    }
}

/// Row `t` of `key` / `value` (`[T, row_len]`, row-strided allowed) goes to flat slot
/// `slots[t] = block * block_size + offset` of `k_cache` / `v_cache`; a negative slot
/// is skipped (padding). A slot past the cache is an error, and nothing is written
/// then (all slots are checked first).
pub fn write_kv<E: Copy>(
    key: crate::Rows<'_, E>,
    value: crate::Rows<'_, E>,
    slots: &[i64],
    k_cache: KvPages<'_, E>,
    v_cache: KvPages<'_, E>,
) -> Result<(), KernelError> {
    k_cache.check("k_cache")?;
    v_cache.check("v_cache")?;
    let t = slots.len();
    let w = k_cache.row_len;
    if key.rows != t || value.rows != t || key.width != w || value.width != w {
        return Err(KernelError::new(format!(
            "key and value must be [T={t}, Hkv x D={w}] (one row per slot); got [{}, {}] and [{}, {}]",
            key.rows, key.width, value.rows, value.width
        )));
    }
    if v_cache.row_len != w
        || v_cache.block_size != k_cache.block_size
        || v_cache.num_blocks != k_cache.num_blocks
    {
        return Err(KernelError::new(
            "k_cache and v_cache must have the same shape",
        ));
    }
    let capacity = (k_cache.num_blocks * k_cache.block_size) as i64;
    if let Some(&s) = slots.iter().find(|&&s| s >= capacity) {
        return Err(KernelError::new(format!(
            "slot {s} is past the cache's {capacity} slots"
        )));
    }
    let (bs, stride) = (k_cache.block_size, k_cache.block_stride);
    let (mut kd, mut vd) = (k_cache, v_cache);
    for (i, &s) in slots.iter().enumerate() {
        if s < 0 {
            continue;
        }
        let s = s as usize;
        // 0 <= s < num_blocks * block_size, so the row ends at most at
        // (num_blocks - 1) * stride + block_size * w <= len (both views checked).
        let at = (s / bs) * stride + (s % bs) * w;
        // SAFETY: in bounds (above); key / value are the caller's step rows,
        // not the cache (the binding borrows them read-only through numpy's
        // borrow checker, which refuses one overlapping a writable cache view).
        unsafe {
            kd.put(at, key.row(i));
            vd.put(at, value.row(i));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Rows;

    fn pages<E>(
        data: &mut [E],
        num_blocks: usize,
        block_size: usize,
        block_stride: usize,
        row_len: usize,
    ) -> KvPages<'_, E>
    where
        E: Copy,
    {
        KvPages::new(data, num_blocks, block_size, block_stride, row_len)
    }

    #[test]
    fn rows_land_at_their_slots_across_padded_blocks_and_padding_is_skipped() {
        let (blocks, bs, w, stride) = (4usize, 3usize, 5usize, 3 * 5 + 7);
        let len = (blocks - 1) * stride + bs * w;
        let (mut kc, mut vc) = (vec![-1.0f32; len], vec![-2.0f32; len]);
        let slots = [7i64, -1, 0, 11, 4];
        let t = slots.len();
        // key rows 8 apart (a column range of a wider buffer).
        let kbuf: Vec<f32> = (0..t * 8).map(|i| i as f32).collect();
        let vbuf: Vec<f32> = (0..t * w).map(|i| 1000.0 + i as f32).collect();
        let key = Rows::new(&kbuf, t, w, 8).unwrap();
        let value = Rows::dense(&vbuf, w).unwrap();
        let kp = pages(&mut kc, blocks, bs, stride, w);
        let vp = pages(&mut vc, blocks, bs, stride, w);
        write_kv(key, value, &slots, kp, vp).unwrap();
        let mut want_k = vec![-1.0f32; len];
        let mut want_v = vec![-2.0f32; len];
        for (i, &s) in slots.iter().enumerate() {
            if s < 0 {
                continue;
            }
            let (b, o) = (s as usize / bs, s as usize % bs);
            for c in 0..w {
                want_k[b * stride + o * w + c] = kbuf[i * 8 + c];
                want_v[b * stride + o * w + c] = vbuf[i * w + c];
            }
        }
        assert_eq!(kc, want_k);
        assert_eq!(vc, want_v);
    }

    #[test]
    fn a_slot_past_the_cache_is_an_error_and_writes_nothing() {
        let mut kc = vec![0u16; 2 * 4];
        let mut vc = vec![0u16; 2 * 4];
        let rows = vec![9u16; 2 * 4];
        let key = Rows::dense(&rows, 4).unwrap();
        let e = write_kv(
            key,
            key,
            &[0, 2],
            pages(&mut kc, 1, 2, 8, 4),
            pages(&mut vc, 1, 2, 8, 4),
        )
        .unwrap_err();
        assert!(e.0.contains("past the cache"), "{}", e.0);
        assert!(kc.iter().all(|&x| x == 0));
    }

    #[test]
    fn k_and_v_views_interleaved_in_one_arena() {
        // The engine's layout: each page holds a block's K rows then its V rows,
        // and the two views share the one buffer (overlapping extents).
        let (blocks, bs, w) = (3usize, 2usize, 4usize);
        let page = 2 * bs * w;
        let mut arena = vec![0.0f32; blocks * page];
        let slots = [5i64, 0, -1, 2];
        let kbuf: Vec<f32> = (0..slots.len() * w).map(|i| 1.0 + i as f32).collect();
        let vbuf: Vec<f32> = (0..slots.len() * w).map(|i| -1.0 - i as f32).collect();
        let base = arena.as_mut_ptr();
        let extent = (blocks - 1) * page + bs * w;
        // SAFETY: both views lie in `arena` (V's extent ends at its last element)
        // and nothing else touches it until write_kv returns.
        let (kp, vp) = unsafe {
            (
                KvPages::from_raw_parts(base, extent, blocks, bs, page, w),
                KvPages::from_raw_parts(base.add(bs * w), extent, blocks, bs, page, w),
            )
        };
        let key = Rows::dense(&kbuf, w).unwrap();
        let value = Rows::dense(&vbuf, w).unwrap();
        write_kv(key, value, &slots, kp, vp).unwrap();
        let mut want = vec![0.0f32; blocks * page];
        for (i, &s) in slots.iter().enumerate() {
            if s < 0 {
                continue;
            }
            let (b, o) = (s as usize / bs, s as usize % bs);
            for c in 0..w {
                want[b * page + o * w + c] = kbuf[i * w + c];
                want[b * page + bs * w + o * w + c] = vbuf[i * w + c];
            }
        }
        assert_eq!(arena, want);
    }
}
