//! The fused experts against the per-expert loop they replace (the few-row GEMM per
//! expert, `silu(gate) * up`, the weighted `index_add_` in expert order), bit for bit;
//! that GEMM is itself checked against the dequantized reference in `gemm`'s tests,
//! and the whole product against the `gguf` reader's dequantization from Python
//! (tests/quant/test_quant_experts.py).

use super::*;
use crate::bf16::{from_f32, to_f32};
use crate::quant::test_util::{isas, random_weight, Lcg};
use crate::quant::gemm::quant_matmul_with;


/// Distinct experts per token (as top-k chooses them), weights summing to about 1.
fn random_route(t: usize, k: usize, e: usize, g: &mut Lcg) -> (Vec<i64>, Vec<f32>) {
    let mut ids = Vec::with_capacity(t * k);
    for _ in 0..t {
        let mut chosen: Vec<i64> = Vec::new();
        while chosen.len() < k {
            let c = (g.next() as usize % e) as i64;
            if !chosen.contains(&c) {
                chosen.push(c);
            }
        }
        ids.extend(chosen);
    }
    let weights = (0..t * k).map(|_| 0.05 + g.f().abs()).collect();
    (ids, weights)
}

struct Case {
    gate: Vec<u8>,
    up: Option<Vec<u8>>,
    down: Vec<u8>,
    tys: (GgmlType, GgmlType, GgmlType),
    e: usize,
    h: usize,
    inter: usize,
}

impl Case {
    fn new(tys: (GgmlType, Option<GgmlType>, GgmlType), e: usize, h: usize, inter: usize, g: &mut Lcg) -> Case {
        let (gt, ut, dt) = tys;
        match ut {
            Some(ut) => Case {
                gate: random_weight(gt, e * inter, h, g),
                up: Some(random_weight(ut, e * inter, h, g)),
                down: random_weight(dt, e * h, inter, g),
                tys: (gt, ut, dt),
                e,
                h,
                inter,
            },
            None => Case {
                gate: random_weight(gt, e * 2 * inter, h, g),
                up: None,
                down: random_weight(dt, e * h, inter, g),
                tys: (gt, gt, dt),
                e,
                h,
                inter,
            },
        }
    }

    fn experts(&self) -> QuantExperts<'_> {
        QuantExperts {
            gate: ExpertBlocks { data: &self.gate, ty: self.tys.0 },
            up: self.up.as_ref().map(|u| ExpertBlocks { data: u, ty: self.tys.1 }),
            down: ExpertBlocks { data: &self.down, ty: self.tys.2 },
            num: self.e,
            inter: self.inter,
        }
    }

    /// The kernel, float32 (`bf16` false) or bfloat16 activations and output, as float32.
    fn run(&self, isa: QIsa, x: &[f32], ids: &[i64], w: &[f32], k: usize, bf16: bool) -> Vec<f32> {
        let h = self.h;
        let t = x.len() / h;
        let route = Route { ids, weights: w, top_k: k };
        if bf16 {
            let xb: Vec<u16> = x.iter().map(|&v| from_f32(v)).collect();
            let mut o = vec![0u16; t * h];
            quant_experts_with(isa, Rows::new(&xb, t, h, h).unwrap(), route, &self.experts(), Out::Bf16(&mut o))
                .unwrap();
            o.iter().map(|&v| to_f32(v)).collect()
        } else {
            let mut o = vec![0.0f32; t * h];
            quant_experts_with(isa, Rows::new(x, t, h, h).unwrap(), route, &self.experts(), Out::F32(&mut o)).unwrap();
            o
        }
    }

    /// The per-expert loop (`QuantizedExperts.forward`'s Python loop, transcribed).
    fn reference(&self, isa: QIsa, x: &[f32], ids: &[i64], w: &[f32], k: usize, bf16: bool) -> Vec<f32> {
        let (h, inter) = (self.h, self.inter);
        let t = x.len() / h;
        let round = |v: f32| if bf16 { to_f32(from_f32(v)) } else { v };
        // The matmul in the activations' dtype: bfloat16 in and out, or float32.
        let mm = |xs: &[f32], wb: &[u8], ty: GgmlType, n: usize, cols: usize| -> Vec<f32> {
            let m = xs.len() / cols;
            if bf16 {
                let xb: Vec<u16> = xs.iter().map(|&v| from_f32(v)).collect();
                let mut o = vec![0u16; m * n];
                quant_matmul_with(isa, Rows::new(&xb, m, cols, cols).unwrap(), wb, ty, Out::Bf16(&mut o)).unwrap();
                o.iter().map(|&v| to_f32(v)).collect()
            } else {
                let mut o = vec![0.0f32; m * n];
                quant_matmul_with(isa, Rows::new(xs, m, cols, cols).unwrap(), wb, ty, Out::F32(&mut o)).unwrap();
                o
            }
        };
        let mut out = vec![0.0f32; t * h];
        let (gt, ut, dt) = self.tys;
        for e in 0..self.e {
            let sel: Vec<usize> = (0..t * k).filter(|&p| ids[p] as usize == e).collect();
            if sel.is_empty() {
                continue;
            }
            let xe: Vec<f32> = sel.iter().flat_map(|&p| x[p / k * h..(p / k + 1) * h].iter().map(|&v| round(v))).collect();
            let (g, u) = match &self.up {
                Some(up) => {
                    let rb = gt.row_bytes(h);
                    let g = mm(&xe, &self.gate[e * inter * rb..(e + 1) * inter * rb], gt, inter, h);
                    let rbu = ut.row_bytes(h);
                    let u = mm(&xe, &up[e * inter * rbu..(e + 1) * inter * rbu], ut, inter, h);
                    (g, u)
                }
                None => {
                    let rb = gt.row_bytes(h);
                    let gu = mm(&xe, &self.gate[e * 2 * inter * rb..(e + 1) * 2 * inter * rb], gt, 2 * inter, h);
                    let n = sel.len();
                    let g = (0..n).flat_map(|r| gu[r * 2 * inter..r * 2 * inter + inter].to_vec()).collect();
                    let u = (0..n).flat_map(|r| gu[r * 2 * inter + inter..(r + 1) * 2 * inter].to_vec()).collect();
                    (g, u)
                }
            };
            let act: Vec<f32> = g.iter().zip(&u).map(|(&a, &b)| round(round(silu(a)) * b)).collect();
            let rb = dt.row_bytes(inter);
            let y = mm(&act, &self.down[e * h * rb..(e + 1) * h * rb], dt, h, inter);
            for (r, &p) in sel.iter().enumerate() {
                let tok = p / k;
                for c in 0..h {
                    out[tok * h + c] += y[r * h + c] * w[p];
                }
            }
        }
        out.iter().map(|&v| round(v)).collect()
    }
}

const QWEN35MOE_TYPES: [GgmlType; 6] =
    [GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K, GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q5_0];

#[test]
fn matches_the_per_expert_loop_for_every_type() {
    let mut g = Lcg(11);
    let (e, h, inter) = (6, 256, 256);
    for &ty in &QWEN35MOE_TYPES {
        // Gate and up of one type, down of the next (llama-quantize mixes them), and a
        // fused gate_up.
        let next = QWEN35MOE_TYPES[(QWEN35MOE_TYPES.iter().position(|&x| x == ty).unwrap() + 1) % 6];
        for tys in [(ty, Some(ty), next), (ty, None, ty)] {
            let case = Case::new(tys, e, h, inter, &mut g);
            for (t, k) in [(1, 1), (1, 4), (3, 2), (5, 3), (9, 4), (17, 2)] {
                let x: Vec<f32> = (0..t * h).map(|_| g.f()).collect();
                let (ids, w) = random_route(t, k, e, &mut g);
                for isa in isas() {
                    for bf16 in [false, true] {
                        let got = case.run(isa, &x, &ids, &w, k, bf16);
                        let want = case.reference(isa, &x, &ids, &w, k, bf16);
                        assert_eq!(got, want, "{tys:?} {isa:?} T={t} k={k} bf16={bf16}");
                    }
                }
            }
        }
    }
}

#[test]
fn every_token_count_and_top_k() {
    let mut g = Lcg(5);
    let (e, h, inter) = (8, 256, 256);
    // Q4_K_M's usual mix: gate / up Q4_K, down Q6_K; gate and up of different kinds too.
    for tys in [(GgmlType::Q4K, Some(GgmlType::Q4K), GgmlType::Q6K), (GgmlType::Q8_0, Some(GgmlType::Q5K), GgmlType::Q4_0)] {
        let case = Case::new(tys, e, h, inter, &mut g);
        for t in 1..=17 {
            for k in 1..=4 {
                let x: Vec<f32> = (0..t * h).map(|_| g.f()).collect();
                let (ids, w) = random_route(t, k, e, &mut g);
                let isa = QIsa::detect();
                let got = case.run(isa, &x, &ids, &w, k, false);
                assert_eq!(got, case.reference(isa, &x, &ids, &w, k, false), "{tys:?} T={t} k={k}");
            }
        }
    }
}

#[test]
fn a_token_does_not_depend_on_the_step_or_the_threads() {
    let mut g = Lcg(9);
    let (e, h, inter) = (8, 256, 512);
    for tys in [(GgmlType::Q4K, Some(GgmlType::Q4K), GgmlType::Q6K), (GgmlType::Q5_0, Some(GgmlType::Q5_0), GgmlType::Q8_0)] {
        let case = Case::new(tys, e, h, inter, &mut g);
        let (t, k) = (16, 4);
        let x: Vec<f32> = (0..t * h).map(|_| g.f()).collect();
        let (ids, w) = random_route(t, k, e, &mut g);
        let isa = QIsa::detect();
        for bf16 in [false, true] {
            let all = case.run(isa, &x, &ids, &w, k, bf16);
            for r in [0, 7, 15] {
                let one = case.run(isa, &x[r * h..(r + 1) * h], &ids[r * k..(r + 1) * k], &w[r * k..(r + 1) * k], k, bf16);
                assert_eq!(&all[r * h..(r + 1) * h], &one[..], "{tys:?} token {r} bf16={bf16}");
            }
            // The same routed rows shared with other tokens in another order.
            let mut x2 = x[3 * h..4 * h].to_vec();
            x2.extend_from_slice(&x[..h]);
            let mut ids2 = ids[3 * k..4 * k].to_vec();
            ids2.extend_from_slice(&ids[..k]);
            let mut w2 = w[3 * k..4 * k].to_vec();
            w2.extend_from_slice(&w[..k]);
            let two = case.run(isa, &x2, &ids2, &w2, k, bf16);
            assert_eq!(&two[..h], &all[3 * h..4 * h]);
            assert_eq!(&two[h..], &all[..h]);
        }
        // The thread count (the pool is process-wide: other tests may see 3 threads
        // for a while, which changes nothing for them either).
        let before = crate::pool::num_threads();
        crate::pool::set_num_threads(1);
        let one_thread = case.run(isa, &x, &ids, &w, k, false);
        crate::pool::set_num_threads(3);
        let three = case.run(isa, &x, &ids, &w, k, false);
        crate::pool::set_num_threads(before);
        assert_eq!(one_thread, three, "{tys:?}");
    }
}

#[test]
fn bad_input_is_refused() {
    let mut g = Lcg(1);
    let case = Case::new((GgmlType::Q4K, Some(GgmlType::Q4K), GgmlType::Q6K), 4, 256, 256, &mut g);
    let x = vec![0.1f32; 2 * 256];
    let mut o = vec![0.0f32; 2 * 256];
    let run = |ids: &[i64], w: &[f32], k: usize, ex: &QuantExperts<'_>, o: &mut [f32]| {
        quant_experts(Rows::new(&x, 2, 256, 256).unwrap(), Route { ids, weights: w, top_k: k }, ex, Out::F32(o))
    };
    let ex = case.experts();
    let e = run(&[0, 4], &[0.5, 0.5], 1, &ex, &mut o).unwrap_err();
    assert!(e.0.contains("[0, 4)"), "{}", e.0);
    let e = run(&[0, 1, 2], &[0.5, 0.5, 0.1], 1, &ex, &mut o).unwrap_err();
    assert!(e.0.contains("routing ids and weights"), "{}", e.0);
    let e = run(&[0, 1], &[0.5, 0.5], 1, &ex, &mut o[..10]).unwrap_err();
    assert!(e.0.contains("out must be"), "{}", e.0);
    let short = QuantExperts { down: ExpertBlocks { data: &case.down[..100], ty: GgmlType::Q6K }, ..ex };
    let e = run(&[0, 1], &[0.5, 0.5], 1, &short, &mut o).unwrap_err();
    assert!(e.0.contains("down must be"), "{}", e.0);
    let odd = QuantExperts { inter: 100, ..ex };
    let e = run(&[0, 1], &[0.5, 0.5], 1, &odd, &mut o).unwrap_err();
    assert!(e.0.contains("multiple") || e.0.contains("must be"), "{}", e.0);
    // The fine case runs, and an expert load comes back.
    assert_eq!(run(&[2, 2], &[0.5, 0.5], 1, &ex, &mut o).unwrap(), 2);
}

/// `cargo test --release -p hybridserve-cpu-kernels quant::experts::tests::timing -- --ignored --nocapture`:
/// the bench shape (hidden 1,024, 64 experts of 256, top-8), Q4_K gate / up, Q6_K down.
#[test]
#[ignore]
fn timing() {
    let mut g = Lcg(2);
    let (e, h, inter, k) = (64, 1024, 256, 8);
    let case = Case::new((GgmlType::Q4K, Some(GgmlType::Q4K), GgmlType::Q6K), e, h, inter, &mut g);
    crate::pool::set_num_threads(1);
    for t in [1usize, 16] {
        let x: Vec<f32> = (0..t * h).map(|_| g.f()).collect();
        let (ids, w) = random_route(t, k, e, &mut g);
        let mut o = vec![0.0f32; t * h];
        let mut best = f64::MAX;
        for _ in 0..50 {
            let t0 = std::time::Instant::now();
            quant_experts(Rows::new(&x, t, h, h).unwrap(), Route { ids: &ids, weights: &w, top_k: k }, &case.experts(), Out::F32(&mut o))
                .unwrap();
            best = best.min(t0.elapsed().as_secs_f64());
        }
        println!("T={t}: {:.3} ms", best * 1e3);
    }
}
