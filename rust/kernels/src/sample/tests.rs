//! The kernel's parts against brute force (whole sorts, direct formulas); the whole
//! kernel is held to the torch sampler (the oracle) from Python, `tests/sampler/`.

use super::select::{at_least_kth, sort_descending, Select};
use super::*;

fn lcg(seed: u64) -> impl FnMut() -> f32 {
    let mut s = seed;
    move || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((s >> 40) as f32 / (1u64 << 24) as f32) * 8.0 - 4.0
    }
}

#[test]
fn at_least_kth_keeps_exactly_the_values_a_sort_keeps() {
    for (vocab, grid) in [
        (272usize, false),
        (1000, true),
        (5000, false),
        (33, true),
        (70000, false),
        (20000, true),
    ] {
        let mut r = lcg(vocab as u64);
        // On a coarse grid (`grid`) many values tie, the k-th's ties included.
        let x: Vec<f32> = (0..vocab)
            .map(|_| if grid { r().round() } else { r() })
            .collect();
        let mut sorted = x.clone();
        sorted.sort_by(|a, b| b.partial_cmp(a).unwrap());
        for k in [1, 2, 7, 50, vocab / 2, vocab]
            .into_iter()
            .filter(|&k| k <= vocab)
        {
            let mut list = Vec::new();
            let kth = at_least_kth(&x, k, &mut list, &mut Select::default());
            assert_eq!(kth, sorted[k - 1], "vocab {vocab} k {k}");
            let mut got: Vec<u32> = list.iter().map(|e| e.1).collect();
            got.sort_unstable();
            let want: Vec<u32> = (0..vocab as u32)
                .filter(|&j| x[j as usize] >= kth)
                .collect();
            assert_eq!(got, want, "vocab {vocab} k {k}");
            // And sorted: descending values, ties in column order.
            let mut packed = Vec::new();
            sort_descending(&mut list, &mut packed);
            let mut by_sort: Vec<(f32, u32)> = want.iter().map(|&j| (x[j as usize], j)).collect();
            by_sort.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap().then(a.1.cmp(&b.1)));
            assert_eq!(list, by_sort, "vocab {vocab} k {k}");
        }
    }
}

#[test]
fn first_argmax_takes_the_first_maximum_and_nan_first() {
    assert_eq!(first_argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
    assert_eq!(first_argmax(&[1.0, f32::NAN, 5.0, f32::NAN]), 1);
    assert_eq!(first_argmax(&[f32::NEG_INFINITY; 3]), 0);
    assert_eq!(first_argmax(&[f32::NEG_INFINITY, f32::INFINITY]), 1);
}

#[test]
fn stream_is_splitmix64() {
    // splitmix64 from state 0: its first outputs are the published test vector.
    assert_eq!(splitmix_next(0), 0xE220_A839_7B1D_CDAF);
    assert_eq!(splitmix_next(GOLDEN_FOR_TEST), 0x6E78_9E6A_A1B9_65F4);
    let state = stream::row_state(7, 3);
    let h = stream::mix64(state.wrapping_add(5u64.wrapping_mul(stream::GOLDEN)));
    assert_eq!(
        stream::uniform(state, 4),
        ((h >> 40) + 1) as f32 / 16_777_216.0
    );
}

const GOLDEN_FOR_TEST: u64 = stream::GOLDEN;

fn splitmix_next(state: u64) -> u64 {
    stream::splitmix64(state)
}

fn tables_for(slots: usize, vocab: usize) -> (Vec<f32>, Vec<i64>, Vec<f32>, Vec<u8>) {
    let mut fp = vec![0f32; slots * NF];
    for s in 0..slots {
        fp[s * NF + F_TEMP] = 1.0;
        fp[s * NF + F_TOPP] = 1.0;
        fp[s * NF + F_REP] = 1.0;
    }
    (
        fp,
        vec![0i64; slots * NI],
        vec![0f32; vocab],
        vec![0u8; vocab],
    )
}

#[test]
fn bad_indices_are_errors_and_change_nothing() {
    let vocab = 10;
    let logits: Vec<f32> = (0..2 * vocab).map(|i| i as f32).collect();
    let (fp, mut ip, mut counts, prompt) = tables_for(2, vocab);
    ip[I_OFF] = 5;
    for (row_of, slots, kinds, pslots, want) in [
        ([2i64, 0], [0i64, 1], [1u8, 0], [-1i64, -1], "logits row 2"),
        ([0, 1], [0, 2], [1, 0], [-1, -1], "slot 2"),
        ([0, 1], [0, 1], [1, 3], [-1, -1], "kind 3"),
        ([0, 1], [0, 1], [1, 0], [-1, 1], "count-table row 1"),
    ] {
        let mut tokens = [0i64; 2];
        let mut t = Tables {
            fp: &fp,
            ip: &mut ip,
            counts: &mut counts,
            prompt_seen: &prompt,
            bias_tok: &[],
            bias_val: &[],
            bias_width: 0,
        };
        let s = Samples {
            row_of: &row_of,
            slots: &slots,
            kinds: &kinds,
            pslots: &pslots,
            biased: &[0, 0],
            ban_samples: &[],
            ban_tokens: &[],
            unseeded_key: 0,
        };
        let out = Outputs {
            tokens: &mut tokens,
            processed: None,
            advance: true,
        };
        let e = sample_rows(Rows::dense(&logits, vocab).unwrap(), &s, &mut t, out).unwrap_err();
        assert!(e.0.contains(want), "{e:?} should name {want}");
        assert_eq!(ip[I_OFF], 5, "nothing advanced");
    }
}

#[test]
fn first_argmax_agrees_with_a_scan_on_rows_with_ties_and_tails() {
    for vocab in [1usize, 15, 16, 17, 40, 272, 1000] {
        let mut r = lcg(vocab as u64 + 9);
        for grid in [false, true] {
            let x: Vec<f32> = (0..vocab)
                .map(|_| if grid { r().round() } else { r() })
                .collect();
            let mut want = 0;
            for j in 0..vocab {
                if x[j] > x[want] {
                    want = j;
                }
            }
            assert_eq!(first_argmax(&x), want, "vocab {vocab} grid {grid}");
        }
    }
}
