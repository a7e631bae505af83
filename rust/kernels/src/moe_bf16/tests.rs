use super::*;

fn bf(v: f32) -> u16 {
    from_f32(v)
}

fn r(v: f64) -> f64 {
    to_f32(from_f32(v as f32)) as f64
}

/// Deterministic pseudo-random bfloat16 values in about `[-scale/2, scale/2)`.
fn values(n: usize, seed: usize, scale: f32) -> Vec<u16> {
    (0..n)
        .map(|i| bf(((((i + 1) * 2654435761 + seed * 40503) % 1000) as f32 / 1000.0 - 0.5) * scale))
        .collect()
}

struct Case {
    t: usize,
    h: usize,
    e: usize,
    k: usize,
    i: usize,
    si: usize,
}

struct Weights {
    x: Vec<u16>,
    router: Vec<u16>,
    gate_up: Vec<u16>,
    down: Vec<u16>,
    s_gate_up: Vec<u16>,
    s_down: Vec<u16>,
    s_gate: Vec<u16>,
}

fn weights(c: &Case, seed: usize) -> Weights {
    Weights {
        x: values(c.t * c.h, seed, 4.0),
        router: values(c.e * c.h, seed + 1, 1.0),
        gate_up: values(c.e * 2 * c.i * c.h, seed + 2, 0.5),
        down: values(c.e * c.h * c.i, seed + 3, 0.5),
        s_gate_up: values(2 * c.si * c.h, seed + 4, 0.5),
        s_down: values(c.h * c.si, seed + 5, 0.5),
        s_gate: values(c.h, seed + 6, 0.5),
    }
}

/// The block on `w`'s experts as HF stores them, or (`packed`) on copies of the routed
/// and shared experts rearranged by [`pack_experts`].
fn run(c: &Case, w: &Weights, t: usize, x: &[u16], packed: bool) -> (Vec<u16>, Vec<i64>, usize) {
    let (mut gate_up, mut down) = (w.gate_up.clone(), w.down.clone());
    let (mut s_gate_up, mut s_down) = (w.s_gate_up.clone(), w.s_down.clone());
    if packed {
        pack_experts(&mut gate_up, &mut down, c.e, c.h, c.i, false).unwrap();
        pack_experts(&mut s_gate_up, &mut s_down, 1, c.h, c.si, false).unwrap();
    }
    let mut out = vec![0u16; t * c.h];
    let mut ids = vec![0i64; t * c.k];
    let mut rw = vec![0f32; t * c.k];
    let shared = (c.si > 0).then(|| SharedExpert {
        gate_up: &s_gate_up,
        down: &s_down,
        inter: c.si,
        gate: &w.s_gate,
        packed,
    });
    let busiest = moe_block_bf16(
        Rows::dense(x, c.h).unwrap(),
        Router {
            weight: &w.router,
            num_experts: c.e,
            top_k: c.k,
        },
        Experts {
            gate_up: &gate_up,
            down: &down,
            inter: c.i,
            packed,
        },
        shared,
        &mut out,
        Routing {
            ids: &mut ids,
            weights: &mut rw,
        },
    )
    .unwrap();
    (out, ids, busiest)
}

/// A transcription of HF's bfloat16 block in f64 with the same rounding points: each
/// GEMM output, silu, the product, the weighted rows, their sum, the shared row and
/// the final add. Returns (out as f64, ids, the k-th - (k+1)-th probability margin).
fn reference(c: &Case, w: &Weights, tok: usize) -> (Vec<f64>, Vec<usize>, f64) {
    let (h, e, k, i) = (c.h, c.e, c.k, c.i);
    let x: Vec<f64> = w.x[tok * h..(tok + 1) * h]
        .iter()
        .map(|&v| to_f32(v) as f64)
        .collect();
    let dot = |wr: &[u16]| -> f64 { x.iter().zip(wr).map(|(a, &b)| a * to_f32(b) as f64).sum() };
    let logits: Vec<f64> = (0..e)
        .map(|j| r(dot(&w.router[j * h..(j + 1) * h])))
        .collect();
    let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let ex: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
    let sum: f64 = ex.iter().sum();
    let mut order: Vec<usize> = (0..e).collect();
    order.sort_by(|&a, &b| ex[b].partial_cmp(&ex[a]).unwrap().then(a.cmp(&b)));
    let ids = order[..k].to_vec();
    let margin = if k < e {
        (ex[order[k - 1]] - ex[order[k]]) / sum
    } else {
        1.0
    };
    let total: f64 = ids.iter().map(|&j| ex[j]).sum();
    let swiglu = |gu: &[u16], down: &[u16], inter: usize| -> Vec<f64> {
        let act: Vec<f64> = (0..inter)
            .map(|c| {
                let g = r(dot(&gu[c * h..(c + 1) * h]));
                let u = r(dot(&gu[(inter + c) * h..(inter + c + 1) * h]));
                r(r(g / (1.0 + (-g).exp())) * u)
            })
            .collect();
        (0..h)
            .map(|o| {
                r(act
                    .iter()
                    .zip(&down[o * inter..(o + 1) * inter])
                    .map(|(a, &b)| a * to_f32(b) as f64)
                    .sum())
            })
            .collect()
    };
    let mut acc = vec![0.0f64; h];
    for &j in &ids {
        let wj = r(ex[j] / total);
        let y = swiglu(
            &w.gate_up[j * 2 * i * h..(j + 1) * 2 * i * h],
            &w.down[j * h * i..(j + 1) * h * i],
            i,
        );
        for (a, v) in acc.iter_mut().zip(y) {
            *a += r(v * wj);
        }
    }
    let mut out: Vec<f64> = acc.into_iter().map(r).collect();
    if c.si > 0 {
        let g = r(1.0 / (1.0 + (-r(dot(&w.s_gate))).exp()));
        let y = swiglu(&w.s_gate_up, &w.s_down, c.si);
        for (o, v) in out.iter_mut().zip(y) {
            *o = r(*o + r(g * v));
        }
    }
    (out, ids, margin)
}

/// Against the f64 transcription: the same experts wherever the k-th choice is clear,
/// and outputs within a few bfloat16 roundings of the row's scale (the sums' order
/// differs, so an intermediate may round the other way). Top-1 and top-k > 1, expert
/// counts not powers of two, with and without the shared expert, decode and prefill
/// sizes (groups of 1-2 rows, of a few, and of more than a row tile).
#[test]
fn matches_the_f64_transcription_of_hf_bf16() {
    for c in [
        Case {
            t: 1,
            h: 64,
            e: 7,
            k: 3,
            i: 40,
            si: 48,
        },
        Case {
            t: 2,
            h: 48,
            e: 5,
            k: 1,
            i: 150,
            si: 0,
        },
        Case {
            t: 19,
            h: 96,
            e: 13,
            k: 4,
            i: 72,
            si: 80,
        },
        Case {
            t: 70,
            h: 64,
            e: 3,
            k: 2,
            i: 200,
            si: 16,
        },
        Case {
            t: 300,
            h: 33,
            e: 6,
            k: 6,
            i: 17,
            si: 20,
        },
    ] {
        let w = weights(&c, c.t);
        for packed in [false, true] {
            let (out, ids, busiest) = run(&c, &w, c.t, &w.x, packed);
            let mut counts = vec![0usize; c.e];
            for tok in 0..c.t {
                let (want, want_ids, margin) = reference(&c, &w, tok);
                let mut got_ids: Vec<usize> = ids[tok * c.k..(tok + 1) * c.k]
                    .iter()
                    .map(|&v| v as usize)
                    .collect();
                for &j in &got_ids {
                    counts[j] += 1;
                }
                if margin < 1e-3 {
                    continue;
                }
                let mut want_sorted = want_ids.clone();
                want_sorted.sort();
                got_ids.sort();
                assert_eq!(got_ids, want_sorted, "t={} tok={tok} packed={packed}", c.t);
                let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1e-3);
                for (o, (&g, &wv)) in out[tok * c.h..(tok + 1) * c.h]
                    .iter()
                    .zip(&want)
                    .enumerate()
                {
                    let got = to_f32(g) as f64;
                    assert!(
                        (got - wv).abs() <= 2e-2 * scale,
                        "t={} tok={tok} col {o} packed={packed}: {got} vs {wv} (scale {scale})",
                        c.t
                    );
                }
            }
            assert_eq!(busiest, counts.into_iter().max().unwrap());
        }
    }
}

/// A sequence's output must not depend on what it is batched with: each token alone
/// gets the bits it gets inside a batch (the few-row kernel's per-output sums do not
/// depend on the rows sharing a call, and the weighted sum is per token).
#[test]
fn a_token_gets_the_same_bits_alone_and_in_a_batch() {
    let c = Case {
        t: 40,
        h: 80,
        e: 9,
        k: 3,
        i: 56,
        si: 64,
    };
    let w = weights(&c, 7);
    for packed in [false, true] {
        let (all, all_ids, _) = run(&c, &w, c.t, &w.x, packed);
        for tok in [0usize, 13, 39] {
            let x = &w.x[tok * c.h..(tok + 1) * c.h];
            let (one, ids, busiest) = run(&c, &w, 1, x, packed);
            assert_eq!(busiest, 1);
            assert_eq!(ids, all_ids[tok * c.k..(tok + 1) * c.k]);
            assert_eq!(
                one,
                all[tok * c.h..(tok + 1) * c.h],
                "token {tok} packed={packed}"
            );
        }
    }
}

#[test]
fn routing_ties_are_chosen_as_torch_topk_chooses() {
    // Every router row equal: all six logits tie; torch.topk(k=2) of six equal values
    // returns indices 3 and 5 (libstdc++'s nth_element; checked against torch itself in
    // tests/kernels/test_native_moe_bf16.py).
    let c = Case {
        t: 3,
        h: 16,
        e: 6,
        k: 2,
        i: 8,
        si: 0,
    };
    let mut w = weights(&c, 3);
    let row = w.router[..c.h].to_vec();
    for j in 0..c.e {
        w.router[j * c.h..(j + 1) * c.h].copy_from_slice(&row);
    }
    let mut out = vec![0u16; c.t * c.h];
    let (mut ids, mut rw) = (vec![0i64; c.t * c.k], vec![0f32; c.t * c.k]);
    moe_block_bf16(
        Rows::dense(&w.x, c.h).unwrap(),
        Router {
            weight: &w.router,
            num_experts: c.e,
            top_k: c.k,
        },
        Experts {
            gate_up: &w.gate_up,
            down: &w.down,
            inter: c.i,
            packed: false,
        },
        None,
        &mut out,
        Routing {
            ids: &mut ids,
            weights: &mut rw,
        },
    )
    .unwrap();
    assert_eq!(ids, [3, 5, 3, 5, 3, 5]);
    assert!(rw.iter().all(|&v| v == 0.5));
}

#[test]
fn wrong_shapes_are_errors_naming_the_argument() {
    let c = Case {
        t: 2,
        h: 16,
        e: 4,
        k: 2,
        i: 8,
        si: 8,
    };
    let w = weights(&c, 1);
    let call = |router: &[u16], gu: &[u16], s_gate: &[u16], k: usize, out_len: usize| {
        let mut out = vec![0u16; out_len];
        let (mut ids, mut rw) = (vec![0i64; c.t * k], vec![0f32; c.t * k]);
        moe_block_bf16(
            Rows::dense(&w.x, c.h).unwrap(),
            Router {
                weight: router,
                num_experts: c.e,
                top_k: k,
            },
            Experts {
                gate_up: gu,
                down: &w.down,
                inter: c.i,
                packed: false,
            },
            Some(SharedExpert {
                gate_up: &w.s_gate_up,
                down: &w.s_down,
                inter: c.si,
                gate: s_gate,
                packed: false,
            }),
            &mut out,
            Routing {
                ids: &mut ids,
                weights: &mut rw,
            },
        )
        .map(|_| ())
        .map_err(|e| e.0)
    };
    let n = c.t * c.h;
    assert!(call(&w.router, &w.gate_up, &w.s_gate, 2, n).is_ok());
    assert!(call(&w.router[1..], &w.gate_up, &w.s_gate, 2, n)
        .unwrap_err()
        .contains("router weight"));
    assert!(call(&w.router, &w.gate_up[1..], &w.s_gate, 2, n)
        .unwrap_err()
        .contains("gate_up"));
    assert!(call(&w.router, &w.gate_up, &w.s_gate[1..], 2, n)
        .unwrap_err()
        .contains("shared expert"));
    assert!(call(&w.router, &w.gate_up, &w.s_gate, 5, n)
        .unwrap_err()
        .contains("top_k"));
    assert!(call(&w.router, &w.gate_up, &w.s_gate, 2, n - 1)
        .unwrap_err()
        .contains("out must be"));
}
