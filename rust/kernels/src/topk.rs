//! `torch.topk` (largest, sorted) of one row on the CPU, including which of several
//! equal values it picks and in what order: the MoE router's choice between experts
//! whose probabilities tie. In bfloat16 such ties are common (HF's bfloat16 router
//! rounds the logits to 8 bits before its float32 softmax, so the k-th and (k+1)-th
//! expert often share a logit), and HF's choice among them is whatever torch's
//! selection does; "the lower index" is not it (e.g. torch picks experts 3 and 5 of
//! three tied 3, 4, 5 for k = 2).
//!
//! torch (`aten/src/ATen/native/TopKImpl.h`, `topk_impl_loop`) fills a vector of
//! `(value, index)` pairs in index order, then with the comparator "greater, NaN
//! first" runs `std::partial_sort` of the first k when `k * 64 <= n`, otherwise
//! `std::nth_element` at k - 1 followed by `std::sort` of the first k - 1. What
//! follows is a transcription of libstdc++'s versions of those algorithms (the C++
//! library torch's Linux wheels are built with), so equal values land where torch's
//! land. `tests` checks it against `torch.topk`'s choices on tie-heavy rows from
//! Python (`tests/kernels/test_native_moe_bf16.py`).

type Elem = (f32, usize);

#[inline(always)]
fn comp(x: &Elem, y: &Elem) -> bool {
    (x.0.is_nan() && !y.0.is_nan()) || x.0 > y.0
}

/// The indices and values of the `k` largest of `values`, in torch's order, into
/// `out` (`k` long); `queue` is scratch (any contents, reused across rows).
pub(crate) fn topk(values: &[f32], k: usize, queue: &mut Vec<Elem>, out: &mut [Elem]) {
    let n = values.len();
    debug_assert!(k >= 1 && k <= n && out.len() == k);
    queue.clear();
    queue.extend(values.iter().enumerate().map(|(j, &v)| (v, j)));
    let q = &mut queue[..];
    if k * 64 <= n {
        heap_select(q, k);
        sort_heap(&mut q[..k]);
    } else {
        nth_element(q, k - 1);
        sort(&mut q[..k - 1]);
    }
    out.copy_from_slice(&q[..k]);
}

fn lg(n: usize) -> usize {
    (usize::BITS - 1 - n.leading_zeros()) as usize
}

// ---- std::nth_element (__introselect) ----

fn nth_element(q: &mut [Elem], nth: usize) {
    if q.is_empty() || nth == q.len() {
        return;
    }
    let (mut first, mut last) = (0usize, q.len());
    let mut depth = lg(q.len()) * 2;
    while last - first > 3 {
        if depth == 0 {
            heap_select(&mut q[first..last], nth + 1 - first);
            q.swap(first, nth);
            return;
        }
        depth -= 1;
        let cut = first + partition_pivot(&mut q[first..last]);
        if cut <= nth {
            first = cut;
        } else {
            last = cut;
        }
    }
    insertion_sort(&mut q[first..last]);
}

/// `__unguarded_partition_pivot`: median of (second, middle, last) moved to the front,
/// then partition around it; returns the cut.
fn partition_pivot(q: &mut [Elem]) -> usize {
    let len = q.len();
    let mid = len / 2;
    move_median_to_first(q, 0, 1, mid, len - 1);
    unguarded_partition(q, 1, len, 0)
}

fn move_median_to_first(q: &mut [Elem], result: usize, a: usize, b: usize, c: usize) {
    let pick = if comp(&q[a], &q[b]) {
        if comp(&q[b], &q[c]) {
            b
        } else if comp(&q[a], &q[c]) {
            c
        } else {
            a
        }
    } else if comp(&q[a], &q[c]) {
        a
    } else if comp(&q[b], &q[c]) {
        c
    } else {
        b
    };
    q.swap(result, pick);
}

fn unguarded_partition(q: &mut [Elem], mut first: usize, mut last: usize, pivot: usize) -> usize {
    loop {
        while comp(&q[first], &q[pivot]) {
            first += 1;
        }
        last -= 1;
        while comp(&q[pivot], &q[last]) {
            last -= 1;
        }
        if first >= last {
            return first;
        }
        q.swap(first, last);
        first += 1;
    }
}

fn insertion_sort(q: &mut [Elem]) {
    for i in 1..q.len() {
        if comp(&q[i], &q[0]) {
            let v = q[i];
            q.copy_within(0..i, 1);
            q[0] = v;
        } else {
            unguarded_linear_insert(q, i);
        }
    }
}

fn unguarded_linear_insert(q: &mut [Elem], mut last: usize) {
    let v = q[last];
    let mut next = last - 1;
    while comp(&v, &q[next]) {
        q[last] = q[next];
        last = next;
        next -= 1;
    }
    q[last] = v;
}

// ---- std::sort (introsort, then the final insertion sort) ----

const SORT_THRESHOLD: usize = 16;

fn sort(q: &mut [Elem]) {
    if q.is_empty() {
        return;
    }
    let depth = lg(q.len()) * 2;
    introsort_loop(q, 0, q.len(), depth);
    if q.len() > SORT_THRESHOLD {
        insertion_sort(&mut q[..SORT_THRESHOLD]);
        for i in SORT_THRESHOLD..q.len() {
            unguarded_linear_insert(q, i);
        }
    } else {
        insertion_sort(q);
    }
}

fn introsort_loop(q: &mut [Elem], first: usize, mut last: usize, mut depth: usize) {
    while last - first > SORT_THRESHOLD {
        if depth == 0 {
            let s = &mut q[first..last];
            let n = s.len();
            heap_select(s, n);
            sort_heap(s);
            return;
        }
        depth -= 1;
        let cut = first + partition_pivot(&mut q[first..last]);
        introsort_loop(q, cut, last, depth);
        last = cut;
    }
}

// ---- heaps (std::partial_sort = __heap_select + __sort_heap) ----

/// The `middle` largest (by `comp`) of `q` into a heap at its front.
fn heap_select(q: &mut [Elem], middle: usize) {
    make_heap(&mut q[..middle]);
    for i in middle..q.len() {
        if comp(&q[i], &q[0]) {
            pop_heap(q, middle, i);
        }
    }
}

fn sort_heap(q: &mut [Elem]) {
    let mut last = q.len();
    while last > 1 {
        last -= 1;
        pop_heap(q, last, last);
    }
}

fn make_heap(q: &mut [Elem]) {
    let len = q.len();
    if len < 2 {
        return;
    }
    let mut parent = (len - 2) / 2;
    loop {
        let v = q[parent];
        adjust_heap(q, parent, len, v);
        if parent == 0 {
            return;
        }
        parent -= 1;
    }
}

/// `__pop_heap(first, first + len, result)`: the heap's top to `result`, `result`'s
/// value sifted into the heap of `len`.
fn pop_heap(q: &mut [Elem], len: usize, result: usize) {
    let v = q[result];
    q[result] = q[0];
    adjust_heap(q, 0, len, v);
}

fn adjust_heap(q: &mut [Elem], mut hole: usize, len: usize, v: Elem) {
    let top = hole;
    let mut second = hole;
    while len >= 2 && second < (len - 1) / 2 {
        second = 2 * (second + 1);
        if comp(&q[second], &q[second - 1]) {
            second -= 1;
        }
        q[hole] = q[second];
        hole = second;
    }
    if len % 2 == 0 && len >= 2 && second == (len - 2) / 2 {
        second = 2 * (second + 1);
        q[hole] = q[second - 1];
        hole = second - 1;
    }
    push_heap(q, hole, top, v);
}

fn push_heap(q: &mut [Elem], mut hole: usize, top: usize, v: Elem) {
    while hole > top {
        let parent = (hole - 1) / 2;
        if !comp(&q[parent], &v) {
            break;
        }
        q[hole] = q[parent];
        hole = parent;
    }
    q[hole] = v;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The k largest values, in descending order, whatever the ties (the order among
    /// equal values is torch's, checked from Python against torch itself).
    #[test]
    fn picks_the_k_largest_in_descending_order() {
        let mut queue = Vec::new();
        for n in [1usize, 2, 3, 4, 5, 7, 16, 17, 33, 64, 100, 256, 513] {
            for k in [1usize, 2, 3, 4, 8, 10, 17] {
                if k > n {
                    continue;
                }
                for seed in 0..5usize {
                    let v: Vec<f32> = (0..n)
                        .map(|i| (((i + 1) * 2654435761 + seed * 97) % 13) as f32)
                        .collect();
                    let mut out = vec![(0.0, 0); k];
                    topk(&v, k, &mut queue, &mut out);
                    let mut want = v.clone();
                    want.sort_by(|a, b| b.partial_cmp(a).unwrap());
                    let got: Vec<f32> = out.iter().map(|e| e.0).collect();
                    assert_eq!(got, want[..k], "n={n} k={k}");
                    let mut ids: Vec<usize> = out.iter().map(|e| e.1).collect();
                    assert!(out.iter().all(|&(val, j)| v[j] == val));
                    ids.sort();
                    ids.dedup();
                    assert_eq!(ids.len(), k);
                }
            }
        }
    }
}
