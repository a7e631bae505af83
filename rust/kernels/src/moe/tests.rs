use super::*;
use crate::matmul::run_strip16;
use grouping::top_k;

fn silu64(v: f64) -> f64 {
    v / (1.0 + (-v).exp())
}

/// One `moe_block` call with a shared expert over dense `[T, H]` rows; returns the
/// output, the routing (ids, weights) and the busiest expert's row count.
#[allow(clippy::too_many_arguments)]
fn block_with_shared(
    x: &[f32],
    h: usize,
    (wr, e, k): (&[f32], usize, usize),
    (w13, w2, i): (&[f32], &[f32], usize),
    (s13, s2, sg, si): (&[f32], &[f32], &[f32], usize),
) -> (Vec<f32>, Vec<i64>, Vec<f32>, usize) {
    let t = x.len() / h;
    let mut out = vec![0.0f32; t * h];
    let (mut ids, mut ws) = (vec![0i64; t * k], vec![0.0f32; t * k]);
    let max = moe_block(
        Rows::dense(x, h).unwrap(),
        Router {
            weight_t: wr,
            num_experts: e,
            top_k: k,
        },
        Experts { w13, w2, inter: i },
        Some(SharedExpert {
            w13: s13,
            w2: s2,
            inter: si,
            gate: sg,
        }),
        &mut out,
        Routing {
            ids: &mut ids,
            weights: &mut ws,
        },
    )
    .unwrap();
    (out, ids, ws, max)
}

type FewRows = fn(&Ctx<'_>, usize, usize, usize, usize);

/// Every few-row walk (portable, and with AVX-512 the streaming and the blocked walk)
/// against an f64 sum, for every row count 1-16, a key count that is not a multiple of
/// the streams or of the blocked walk's key block, and a column range with a tail.
#[test]
fn few_row_paths_match_f64() {
    let (k, n, c0, w) = (37usize, 70usize, 3usize, 45usize);
    let val = |i: usize, s: usize| (((i * 2654435761 + s * 40503) % 1000) as f32 / 1000.0) - 0.5;
    let wt: Vec<f32> = (0..k * n).map(|i| val(i, 1)).collect();
    for m in 1..=FEW_ROWS {
        let x: Vec<f32> = (0..m * k).map(|i| val(i, 2 + m)).collect();
        let want: Vec<f64> = (0..m * w)
            .map(|i| {
                let (r, c) = (i / w, i % w);
                (0..k)
                    .map(|kk| x[r * k + kk] as f64 * wt[kk * n + c0 + c] as f64)
                    .sum()
            })
            .collect();
        let mut paths: Vec<(&str, FewRows)> = vec![("portable", few_rows::portable_rows)];
        #[cfg(target_arch = "x86_64")]
        if crate::matmul::has_avx512() {
            // SAFETY (of the calls below): AVX-512F is present.
            paths.push(("stream", |c, m, c0, w, oc| unsafe {
                few_rows::avx512::stream_rows(c, m, c0, w, oc)
            }));
            paths.push(("blocked", |c, m, c0, w, oc| unsafe {
                few_rows::avx512::blocked_rows(c, m, c0, w, oc)
            }));
        }
        for (name, f) in paths {
            let ldo = w + 5;
            let mut out = vec![f32::NAN; m * ldo];
            let ctx = Ctx {
                x: Rows::dense(&x, k).unwrap(),
                wt: &wt,
                n,
                out: SharedMut::new(&mut out),
                ldo,
            };
            f(&ctx, m, c0, w, 2);
            for r in 0..m {
                for c in 0..w {
                    let (got, exp) = (out[r * ldo + 2 + c] as f64, want[r * w + c]);
                    assert!(
                        (got - exp).abs() <= 1e-5 * (1.0 + exp.abs()),
                        "{name} m={m} r={r} c={c}: {got} vs {exp}"
                    );
                }
                assert!(
                    out[r * ldo..r * ldo + 2].iter().all(|v| v.is_nan())
                        && out[r * ldo + 2 + w..(r + 1) * ldo]
                            .iter()
                            .all(|v| v.is_nan()),
                    "{name} wrote outside its columns"
                );
            }
        }
    }
}

/// The block in f64 with plain loops, routing on the same expert choice. 37 tokens
/// take the strip kernel (also for the shared expert), 21 the shared expert's 16-row
/// streaming blocks (16 + 5), 12 both kernels, 5 and 2 the few-row one (also for the
/// shared expert); H and I are not multiples of its weight streams.
#[test]
fn matches_a_scalar_transcription() {
    for t in [37usize, 21, 12, 5, 2] {
        check_against_scalar(t);
    }
}

fn check_against_scalar(t: usize) {
    let (h, e, k, i, si) = (26usize, 7usize, 3usize, 21usize, 36usize);
    // A small LCG: values without the exact ties a periodic pattern would give.
    let gen = |n: usize, s: u64| -> Vec<f32> {
        let mut st = s.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        (0..n)
            .map(|_| {
                st = st
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((st >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 1.5
            })
            .collect()
    };
    let x = gen(t * h, 11);
    let wr = gen(h * e, 13);
    let w13 = gen(e * h * 2 * i, 17);
    let w2 = gen(e * i * h, 19);
    let s13 = gen(h * 2 * si, 23);
    let s2 = gen(si * h, 29);
    let sg = gen(h, 31);
    let (out, ids, ws, max) =
        block_with_shared(&x, h, (&wr, e, k), (&w13, &w2, i), (&s13, &s2, &sg, si));
    let mut counts = vec![0usize; e];
    let ffn = |xr: &[f32], w13: &[f32], w2: &[f32], inter: usize| -> Vec<f64> {
        let a: Vec<f64> = (0..inter)
            .map(|c| {
                let g: f64 = (0..h)
                    .map(|kk| xr[kk] as f64 * w13[kk * 2 * inter + c] as f64)
                    .sum();
                let u: f64 = (0..h)
                    .map(|kk| xr[kk] as f64 * w13[kk * 2 * inter + inter + c] as f64)
                    .sum();
                silu64(g) * u
            })
            .collect();
        (0..h)
            .map(|c| (0..inter).map(|j| a[j] * w2[j * h + c] as f64).sum())
            .collect()
    };
    for tok in 0..t {
        let xr = &x[tok * h..(tok + 1) * h];
        let logits: Vec<f64> = (0..e)
            .map(|j| (0..h).map(|kk| xr[kk] as f64 * wr[kk * e + j] as f64).sum())
            .collect();
        let m = logits.iter().cloned().fold(f64::MIN, f64::max);
        let z: f64 = logits.iter().map(|l| (l - m).exp()).sum();
        let mut order: Vec<usize> = (0..e).collect();
        order.sort_by(|&a, &b| logits[b].partial_cmp(&logits[a]).unwrap());
        let chosen = &order[..k];
        let ids_row: Vec<usize> = ids[tok * k..(tok + 1) * k]
            .iter()
            .map(|&v| v as usize)
            .collect();
        assert_eq!(ids_row, chosen, "token {tok} routed differently");
        let tot: f64 = chosen.iter().map(|&j| (logits[j] - m).exp() / z).sum();
        let mut want = vec![0.0f64; h];
        for (jj, &j) in chosen.iter().enumerate() {
            counts[j] += 1;
            let wj = (logits[j] - m).exp() / z / tot;
            assert!((ws[tok * k + jj] as f64 - wj).abs() < 1e-5);
            let y = ffn(xr, &w13[j * h * 2 * i..], &w2[j * i * h..], i);
            for c in 0..h {
                want[c] += wj * y[c];
            }
        }
        let g: f64 = (0..h).map(|kk| xr[kk] as f64 * sg[kk] as f64).sum();
        let y = ffn(xr, &s13, &s2, si);
        for c in 0..h {
            want[c] += y[c] / (1.0 + (-g).exp());
            assert!(
                (out[tok * h + c] as f64 - want[c]).abs() < 1e-4,
                "token {tok} col {c}"
            );
        }
    }
    assert_eq!(max, counts.into_iter().max().unwrap());
}

/// The blocked walk sums over the keys in order with one FMA per key, as the strip
/// kernels do: a row gets the same bits whichever kernel its group size picks.
#[test]
fn blocked_walk_matches_the_strip_kernel_bit_for_bit() {
    #[cfg(target_arch = "x86_64")]
    if crate::matmul::has_avx512() {
        let (k, n) = (300usize, 48usize);
        let val =
            |i: usize, s: usize| (((i * 2654435761 + s * 40503) % 1000) as f32 / 1000.0) - 0.5;
        let wt: Vec<f32> = (0..k * n).map(|i| val(i, 7)).collect();
        for m in [4usize, 7, 8, 12, 16] {
            let x: Vec<f32> = (0..m * k).map(|i| val(i, 9 + m)).collect();
            let run = |f: &dyn Fn(&Ctx<'_>)| {
                let mut out = vec![0.0f32; m * n];
                let ctx = Ctx {
                    x: Rows::dense(&x, k).unwrap(),
                    wt: &wt,
                    n,
                    out: SharedMut::new(&mut out),
                    ldo: n,
                };
                f(&ctx);
                out
            };
            // SAFETY: AVX-512F is present; each call owns all of `out`.
            let blocked = run(&|c| unsafe { few_rows::avx512::blocked_rows(c, m, 0, n, 0) });
            let strips = run(&|c| unsafe {
                for s in 0..n / 16 {
                    run_strip16(c, s * 16, 0, m, s * 16);
                }
            });
            let same = blocked
                .iter()
                .zip(&strips)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "{m} rows: the blocked walk and the strip kernel differ"
            );
        }
    }
}

/// The one-pass top-k against k rounds of "the largest remaining, NaN skipped" on rows
/// full of ties, NaNs and zeros, for every k up to the row length: where it reports no
/// tie it chose as those rounds do (and, without ties, as `torch.topk`), and it reports
/// one whenever a kept probability equals another non-NaN one or the row has a NaN
/// (then `route` asks `crate::topk`, torch's own selection).
#[test]
fn top_k_matches_repeated_argmax() {
    let brute = |p: &[f32], k: usize| -> Vec<usize> {
        let mut chosen: Vec<usize> = Vec::new();
        for j in 0..k {
            let mut best = usize::MAX;
            for (c, &v) in p.iter().enumerate() {
                if v.is_nan() || chosen.contains(&c) {
                    continue;
                }
                if best == usize::MAX || v > p[best] {
                    best = c;
                }
            }
            chosen.push(if best == usize::MAX { j } else { best });
        }
        chosen
    };
    let mut st = 0x1234_5678_u64;
    for case in 0..2_000usize {
        let e = 1 + case % 13;
        let row: Vec<f32> = (0..e)
            .map(|_| {
                st = st
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                match (st >> 33) % 9 {
                    0 => f32::NAN,
                    1 => 0.0,
                    // A few distinct values: many exact ties.
                    v => (v % 4) as f32 * 0.25,
                }
            })
            .collect();
        for k in 1..=e {
            let mut best = vec![0usize; k];
            let (found, tie) = top_k(&row, &mut best);
            let got: Vec<usize> = (0..k)
                .map(|j| if j < found { best[j] } else { j })
                .collect();
            let want = brute(&row, k);
            let kept: Vec<usize> = want.iter().copied().filter(|&c| c < e).collect();
            let tied = row.iter().any(|v| v.is_nan())
                || kept.iter().any(|&c| row.iter().filter(|&&v| v == row[c]).count() > 1);
            assert!(tie || !tied, "row {row:?}, k {k}: a tie went unreported");
            if !tie {
                assert_eq!(got, want, "row {row:?}, k {k}");
            }
        }
    }
}

/// One row whose output fits in registers takes `one_row`: the same bits as the
/// streaming walk it replaces (whose order the 2-3-row groups keep), at every width it
/// takes (1-24 vectors), key counts that are and are not multiples of the streams, and
/// a column range that starts inside the weight; and near the f64 sum.
#[test]
fn one_row_matches_the_streaming_walk_bit_for_bit() {
    #[cfg(target_arch = "x86_64")]
    if crate::matmul::has_avx512() {
        let val =
            |i: usize, s: usize| (((i * 2654435761 + s * 40503) % 1000) as f32 / 1000.0) - 0.5;
        for (k, w, c0) in [
            (256usize, 384usize, 0usize),
            (37, 16, 5),
            (3, 48, 0),
            (192, 256, 16),
            (70, 368, 32),
        ] {
            let n = c0 + w + 9;
            let wt: Vec<f32> = (0..k * n).map(|i| val(i, 3)).collect();
            let x: Vec<f32> = (0..k).map(|i| val(i, 5)).collect();
            let run = |f: &dyn Fn(&Ctx<'_>)| {
                let mut out = vec![f32::NAN; w + 4];
                let ctx = Ctx {
                    x: Rows::dense(&x, k).unwrap(),
                    wt: &wt,
                    n,
                    out: SharedMut::new(&mut out),
                    ldo: w + 4,
                };
                f(&ctx);
                out
            };
            // SAFETY: AVX-512F is present; each call owns all of `out`.
            let fast = run(&|c| unsafe { few_rows::avx512::stream_rows(c, 1, c0, w, 2) });
            let walk = run(&|c| unsafe { few_rows::avx512::stream::<1>(c, c0, w, 2) });
            let same = fast
                .iter()
                .zip(&walk)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "k={k} w={w}: one_row and the streaming walk differ");
            for c in 0..w {
                let want: f64 = (0..k)
                    .map(|kk| x[kk] as f64 * wt[kk * n + c0 + c] as f64)
                    .sum();
                assert!(
                    (fast[2 + c] as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "k={k} w={w} c={c}"
                );
            }
            assert!(
                fast[..2].iter().chain(&fast[2 + w..]).all(|v| v.is_nan()),
                "wrote outside its columns"
            );
        }
    }
}

/// The block's buffers outlive a call (see `Buffers`): a call on a thread whose buffers
/// an earlier, larger call left full of NaN gives the same bits as on a fresh thread.
#[test]
fn a_call_reads_nothing_an_earlier_call_left() {
    let (h, e, k, i, si, t) = (24usize, 6usize, 2usize, 20usize, 36usize, 9usize);
    let mut st = 77u64;
    let mut gen = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| {
                st = st
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((st >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 1.5
            })
            .collect()
    };
    let (x, wr, w13, w2) = (gen(t * h), gen(h * e), gen(e * h * 2 * i), gen(e * i * h));
    let (s13, s2, sg) = (gen(h * 2 * si), gen(si * h), gen(h));
    let run = || block_with_shared(&x, h, (&wr, e, k), (&w13, &w2, i), (&s13, &s2, &sg, si)).0;
    let fresh = std::thread::scope(|s| s.spawn(run).join().unwrap());
    BUFFERS.with_borrow_mut(|b| {
        for v in [
            &mut b.logits,
            &mut b.xs,
            &mut b.act,
            &mut b.act_s,
            &mut b.ys,
            &mut b.ys_s,
        ] {
            v.clear();
            v.resize(100_000, f32::NAN);
        }
    });
    let reused = run();
    assert!(fresh.iter().all(|v| v.is_finite()));
    assert!(
        fresh
            .iter()
            .zip(&reused)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "a call read what an earlier call left in its buffers"
    );
}
