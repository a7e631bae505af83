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
            mask: None,
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

/// A masked call against the unmasked call on logits masked first by
/// `token_bitmask::apply_token_bitmask` (the unfused path): the same tokens, processed
/// rows, stream offsets and counts, for every kind of sample, with bias, bans and
/// penalties, ties, NaN and -inf in the rows, masks of every word shape, and a mask
/// vocabulary narrower than the logits.
#[test]
fn a_masked_call_equals_masking_the_logits_first() {
    use crate::token_bitmask::apply_token_bitmask;
    let mut r = lcg(77);
    let mut bits_r = {
        let mut s = 12345u64;
        move || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 32) as u32
        }
    };
    for (width, mvocab, grid) in [
        (100usize, 100usize, false),
        (100, 90, true),
        (1000, 1000, true),
        (333, 300, false),
        (64, 64, true),
    ] {
        let words = mvocab.div_ceil(32) + 1;
        let rows = 6usize;
        for trial in 0..12 {
            let mut logits: Vec<f32> = (0..rows * width)
                .map(|_| if grid { r().round() } else { r() })
                .collect();
            if trial % 3 == 0 {
                logits[3] = f32::NAN;
                logits[width + 40] = f32::NAN;
                logits[2 * width + 7] = f32::NEG_INFINITY;
            }
            let mut bits = vec![0i32; rows * words];
            for (k, b) in bits.iter_mut().enumerate() {
                *b = match (k + trial) % 5 {
                    0 => 0,
                    1 => -1,
                    2 => 1 << (bits_r() % 32),
                    _ => bits_r() as i32 & if trial % 2 == 0 { 0x0101_0101 } else { -1 },
                };
            }
            // Row 5 allows nothing at all: an all -inf row.
            for b in &mut bits[5 * words..6 * words] {
                *b = 0;
            }
            // Samples: every kind on masked rows 0..5, one unmasked (row 0 again).
            let n = 12usize;
            let row_of: Vec<i64> = (0..n).map(|i| (i % rows) as i64).collect();
            let mask_of: Vec<i64> = (0..n)
                .map(|i| if i == 6 { -1 } else { (i % rows) as i64 })
                .collect();
            let kinds: Vec<u8> = (0..n).map(|i| ((i / 2 + trial) % 3) as u8).collect();
            let slots: Vec<i64> = (0..n as i64).collect();
            let pslots: Vec<i64> = (0..n)
                .map(|i| if i % 3 == 1 { (i / 3) as i64 } else { -1 })
                .collect();
            let biased: Vec<u8> = (0..n).map(|i| (i % 4 == 2) as u8).collect();
            let (mut fp, mut ip, _, _) = tables_for(n, width);
            for s in 0..n {
                fp[s * NF + F_TEMP] = [1.0, 0.7, 1.3][s % 3];
                fp[s * NF + F_TOPP] = if s % 4 == 3 { 0.8 } else { 1.0 };
                fp[s * NF + F_MINP] = if s % 5 == 4 { 0.05 } else { 0.0 };
                fp[s * NF + F_REP] = 1.2;
                fp[s * NF + F_FREQ] = 0.3;
                fp[s * NF + F_PRES] = 0.1;
                ip[s * NI + I_TOPK] = if s % 2 == 0 { 5 } else { 0 };
                ip[s * NI + I_KEY] = 1000 + s as i64;
                ip[s * NI + I_OFF] = trial as i64;
            }
            let pn = 4usize;
            let counts: Vec<f32> = (0..pn * width)
                .map(|k| ((k * 7) % 5 == 0) as u8 as f32)
                .collect();
            let prompt: Vec<u8> = (0..pn * width).map(|k| ((k * 3) % 7 == 0) as u8).collect();
            let bias_width = 2;
            let bias_tok: Vec<i64> = (0..n * bias_width)
                .map(|k| ((k * 13) % width) as i64)
                .collect();
            let bias_val: Vec<f32> = (0..n * bias_width)
                .map(|k| if k % 2 == 0 { 5.0 } else { -2.0 })
                .collect();
            let ban_samples = [1i64, 4, 4];
            let ban_tokens = [0i64, 1, 2];
            let run = |logits: &[f32], mask: Option<Mask<'_>>, processed: bool| {
                let mut ip = ip.clone();
                let mut counts = counts.clone();
                let mut tokens = vec![0i64; n];
                let mut proc = vec![0f32; if processed { n * width } else { 0 }];
                let mut t = Tables {
                    fp: &fp,
                    ip: &mut ip,
                    counts: &mut counts,
                    prompt_seen: &prompt,
                    bias_tok: &bias_tok,
                    bias_val: &bias_val,
                    bias_width,
                };
                let s = Samples {
                    row_of: &row_of,
                    slots: &slots,
                    kinds: &kinds,
                    pslots: &pslots,
                    biased: &biased,
                    ban_samples: &ban_samples,
                    ban_tokens: &ban_tokens,
                    unseeded_key: 99,
                    mask,
                };
                let out = Outputs {
                    tokens: &mut tokens,
                    processed: processed.then_some(&mut proc[..]),
                    advance: true,
                };
                sample_rows(Rows::dense(logits, width).unwrap(), &s, &mut t, out).unwrap();
                (tokens, proc, ip, counts)
            };
            for processed in [false, true] {
                // The unfused path: each masked sample on its own copy of the masked row.
                let mut want_tokens = vec![0i64; n];
                for i in 0..n {
                    let mut pre = logits.clone();
                    if mask_of[i] >= 0 {
                        apply_token_bitmask(
                            &mut pre,
                            width,
                            mvocab,
                            &bits,
                            words,
                            &[row_of[i] as usize],
                        )
                        .unwrap();
                    }
                    want_tokens[i] = run(&pre, None, processed).0[i];
                }
                let m = Mask {
                    bits: &bits,
                    words,
                    row_of: &mask_of,
                    vocab: mvocab,
                };
                let (tokens, proc, ip2, counts2) = run(&logits, Some(m), processed);
                assert_eq!(
                    tokens, want_tokens,
                    "width {width} trial {trial} processed {processed}"
                );
                if processed {
                    // Row by row against the unfused path's processed rows.
                    for i in 0..n {
                        let mut pre = logits.clone();
                        if mask_of[i] >= 0 {
                            apply_token_bitmask(
                                &mut pre,
                                width,
                                mvocab,
                                &bits,
                                words,
                                &[row_of[i] as usize],
                            )
                            .unwrap();
                        }
                        let (_, p, _, _) = run(&pre, None, true);
                        let (a, b) = (
                            &proc[i * width..(i + 1) * width],
                            &p[i * width..(i + 1) * width],
                        );
                        assert!(
                            a.iter()
                                .zip(b)
                                .all(|(x, y)| x.to_bits() == y.to_bits()
                                    || (x.is_nan() && y.is_nan())),
                            "processed row {i}, width {width} trial {trial}"
                        );
                    }
                }
                // Bookkeeping: the drawn tokens counted, the streams moved, as unfused
                // (which draws the same tokens).
                let mut want_counts = counts.clone();
                let mut want_ip = ip.clone();
                for i in 0..n {
                    if kinds[i] == 1 {
                        want_ip[i * NI + I_OFF] += 1;
                    }
                    if pslots[i] >= 0 {
                        want_counts[pslots[i] as usize * width + want_tokens[i] as usize] += 1.0;
                    }
                }
                assert_eq!(ip2, want_ip);
                assert_eq!(counts2, want_counts);
            }
        }
    }
}

#[test]
fn masked_argmax_reads_the_allowed_tokens_only() {
    // Two rows' worth: row 0 is masked to a few tokens; the rest of the row may hold
    // anything (NaN, +inf) without changing the answer.
    let mut x = vec![0f32; 96];
    x[5] = f32::NAN;
    x[40] = f32::INFINITY;
    x[33] = 2.0;
    x[70] = 2.0;
    x[71] = 3.0;
    let bits = [0i32, (1 << 1) | (1 << 6), 1 << 6 | 1 << 7];
    // Allowed: 33, 38, 70, 71; 71 holds the max.
    assert_eq!(masked_first_argmax(&x, &bits, 96), 71);
    // Ties: the first.
    x[71] = 2.0;
    assert_eq!(masked_first_argmax(&x, &bits, 96), 33);
    // Nothing allowed (-inf everywhere): 0; past the mask's vocabulary, unmasked.
    assert_eq!(masked_first_argmax(&x, &[0, 0, 0], 96), 0);
    assert_eq!(masked_first_argmax(&x, &[0, 0, 0], 64), 70);
    // An allowed NaN wins.
    assert_eq!(masked_first_argmax(&x, &[-1, 0, 0], 96), 5);
}
