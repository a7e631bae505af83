//! The leading values of a row without sorting it: every element at or above the row's
//! k-th largest value. A long row is filtered in one pass that rejects a chunk of 16
//! at a time against a running lower bound of that value; selections and sorts work
//! on integer keys (a float's order as a `u32`), which sort several times faster than
//! float comparisons through a closure.

/// `(value, column)` of a row element.
pub type Entry = (f32, u32);

/// `v`'s order as an unsigned integer: `a < b` iff `key(a) < key(b)`, and `a == b`
/// iff `key(a) == key(b)`, for non-NaN floats (-0.0 is taken as 0.0, which it equals).
#[inline(always)]
pub fn key(v: f32) -> u32 {
    let b = (v + 0.0).to_bits();
    if b >> 31 == 1 {
        !b
    } else {
        b | 0x8000_0000
    }
}

/// The `k`-th largest of `keys` (`1 <= k <= keys.len()`, duplicates counted, as
/// `torch.topk` counts them); reorders `keys`.
fn kth_key(keys: &mut [u32], k: usize) -> u32 {
    let at = keys.len() - k;
    *keys.select_nth_unstable(at).1
}

/// Scratch of [`at_least_kth`].
#[derive(Default)]
pub struct Select {
    keys: Vec<u32>,
}

/// Fills `out` with every element of `x` whose value is at least the `k`-th largest
/// (`1 <= k <= x.len()`; ties with it all included; NaN never) and returns that value.
///
/// The bound only rises (it is the k-th largest of a subset seen so far), so an
/// element below it when seen is below the final k-th value too and is skipped.
pub fn at_least_kth(x: &[f32], k: usize, out: &mut Vec<Entry>, s: &mut Select) -> f32 {
    debug_assert!(k >= 1 && k <= x.len());
    out.clear();
    let cap = (4 * k).max(1024);
    if x.len() <= cap {
        s.keys.clear();
        s.keys
            .extend(x.iter().filter(|v| !v.is_nan()).map(|&v| key(v)));
        if s.keys.len() < k {
            return keep_all(x, out);
        }
        let kth = kth_key(&mut s.keys, k);
        for (j, &v) in x.iter().enumerate() {
            if !v.is_nan() && key(v) >= kth {
                out.push((v, j as u32));
            }
        }
        return out[out
            .iter()
            .position(|e| key(e.0) == kth)
            .expect("the k-th is kept")]
        .0;
    }
    let mut cap = cap;
    let mut bound = f32::NEG_INFINITY;
    for (c, chunk) in x.chunks(16).enumerate() {
        // An OR of comparison masks: vectorises (a float max reduction does not).
        let any = chunk.iter().fold(0u32, |a, &v| a | (v >= bound) as u32);
        if any == 0 {
            continue;
        }
        let base = c * 16;
        for (j, &v) in chunk.iter().enumerate() {
            if v >= bound {
                out.push((v, (base + j) as u32));
            }
        }
        if out.len() > cap {
            s.keys.clear();
            s.keys.extend(out.iter().map(|e| key(e.0)));
            let kb = kth_key(&mut s.keys, k);
            out.retain(|e| key(e.0) >= kb);
            bound = out
                .iter()
                .find(|e| key(e.0) == kb)
                .expect("the k-th is kept")
                .0;
            // Ties can keep the list long: never compact again before it doubles.
            cap = cap.max(2 * out.len());
        }
    }
    if out.len() < k {
        // Only NaN can be missing: no k-th value among the rest; keep what there is.
        return out.iter().fold(f32::INFINITY, |a, e| a.min(e.0));
    }
    s.keys.clear();
    s.keys.extend(out.iter().map(|e| key(e.0)));
    let kth = kth_key(&mut s.keys, k);
    out.retain(|e| key(e.0) >= kth);
    out.iter()
        .find(|e| key(e.0) == kth)
        .expect("the k-th is kept")
        .0
}

fn keep_all(x: &[f32], out: &mut Vec<Entry>) -> f32 {
    out.extend(
        x.iter()
            .enumerate()
            .filter(|(_, v)| !v.is_nan())
            .map(|(j, &v)| (v, j as u32)),
    );
    out.iter().fold(f32::INFINITY, |a, e| a.min(e.0))
}

/// Sorts entries by value, descending (ties in column order), through `u64` keys.
pub fn sort_descending(buf: &mut [Entry], packed: &mut Vec<u64>) {
    packed.clear();
    packed.extend(
        buf.iter()
            .map(|e| ((key(e.0) as u64) << 32) | (u32::MAX - e.1) as u64),
    );
    packed.sort_unstable_by(|a, b| b.cmp(a));
    for (e, &p) in buf.iter_mut().zip(packed.iter()) {
        let k = (p >> 32) as u32;
        let bits = if k >> 31 == 1 { k & 0x7FFF_FFFF } else { !k };
        *e = (f32::from_bits(bits), u32::MAX - p as u32);
    }
}
