//! The leading values of a row without sorting it: every element at or above the row's
//! k-th largest value, found in one pass that rejects most elements a chunk of 16 at a
//! time against a running lower bound of that value.

use std::cmp::Ordering;

/// `(value, column)` of a row element.
pub type Entry = (f32, u32);

#[inline]
fn descending(a: &Entry, b: &Entry) -> Ordering {
    b.0.partial_cmp(&a.0).unwrap_or(Ordering::Equal)
}

/// The `k`-th largest value of `buf` (duplicates counted, as `torch.topk` counts them),
/// `1 <= k <= buf.len()`; reorders `buf`.
fn kth_of(buf: &mut [Entry], k: usize) -> f32 {
    buf.select_nth_unstable_by(k - 1, descending);
    buf[k - 1].0
}

/// Fills `out` with every element of `x` whose value is at least the `k`-th largest
/// (`1 <= k <= x.len()`; ties with it all included, NaN never) and returns that value.
///
/// The bound only rises (it is the k-th largest of a subset seen so far), so an
/// element below it when seen is below the final k-th value too and is skipped.
pub fn at_least_kth(x: &[f32], k: usize, out: &mut Vec<Entry>) -> f32 {
    debug_assert!(k >= 1 && k <= x.len());
    out.clear();
    let mut cap = (4 * k).max(512);
    let mut bound = f32::NEG_INFINITY;
    for (c, chunk) in x.chunks(16).enumerate() {
        let top = chunk
            .iter()
            .fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a });
        if top < bound {
            continue;
        }
        let base = c * 16;
        for (j, &v) in chunk.iter().enumerate() {
            if v >= bound {
                out.push((v, (base + j) as u32));
            }
        }
        if out.len() > cap && out.len() >= k {
            bound = kth_of(out, k);
            out.retain(|e| e.0 >= bound);
            // Ties can keep the list long: never compact again before it doubles.
            cap = cap.max(2 * out.len());
        }
    }
    if out.len() < k {
        // Only NaN can be missing: no k-th value among the rest; keep what there is.
        return out.iter().fold(f32::INFINITY, |a, e| a.min(e.0));
    }
    let kth = kth_of(out, k);
    out.retain(|e| e.0 >= kth);
    kth
}

/// Sorts entries by value, descending (ties in column order, for determinism).
pub fn sort_descending(buf: &mut [Entry]) {
    buf.sort_unstable_by(|a, b| descending(a, b).then(a.1.cmp(&b.1)));
}
