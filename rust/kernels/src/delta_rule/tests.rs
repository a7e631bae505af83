//! The delta rule against a float64 reference of its recurrence, and the bfloat16
//! kernel against the float32 one on the same values.

use super::*;

/// A small deterministic generator (no dev-dependency needed for this).
pub(crate) struct Lcg(u64);
impl Lcg {
    pub(crate) fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    pub(crate) fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next()).collect()
    }
}

/// The formula in f64, one sequence and head at a time, expanded heads. `item(b, h)`:
/// where the state of sequence b's head h lives; `ckpt[b] = k >= 1`: the state after
/// k tokens also goes to `ck_item(b, h)`.
#[allow(clippy::too_many_arguments)]
fn reference(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    heads: Heads,
    scale: f32,
    state: &mut [f64],
    qsl: &[i64],
    item: &dyn Fn(usize, usize) -> usize,
    init: &[bool],
    ckpt: &[i64],
    ck_item: &dyn Fn(usize, usize) -> usize,
) -> Vec<f64> {
    let Heads {
        key_heads: hk,
        value_heads: h,
        key_dim: kd,
        value_dim: vd,
    } = heads;
    let t = qsl[qsl.len() - 1] as usize;
    let mut out = vec![0.0f64; t * h * vd];
    for b in 0..init.len() {
        let (s0, e0) = (qsl[b] as usize, qsl[b + 1] as usize);
        if e0 == s0 {
            continue;
        }
        for head in 0..h {
            let j = head / (h / hk);
            let base = item(b, head);
            let mut st = state[base..base + kd * vd].to_vec();
            if !init[b] {
                st.iter_mut().for_each(|x| *x = 0.0);
            }
            for tt in s0..e0 {
                let qr: Vec<f64> = (0..kd)
                    .map(|i| q[tt * hk * kd + j * kd + i] as f64)
                    .collect();
                let kr: Vec<f64> = (0..kd)
                    .map(|i| k[tt * hk * kd + j * kd + i] as f64)
                    .collect();
                let qn = 1.0 / (qr.iter().map(|x| x * x).sum::<f64>() + 1e-6).sqrt();
                let kn = 1.0 / (kr.iter().map(|x| x * x).sum::<f64>() + 1e-6).sqrt();
                let qr: Vec<f64> = qr.iter().map(|x| x * qn * scale as f64).collect();
                let kr: Vec<f64> = kr.iter().map(|x| x * kn).collect();
                let d = (g[tt * h + head] as f64).exp();
                st.iter_mut().for_each(|x| *x *= d);
                for vv in 0..vd {
                    let mem: f64 = (0..kd).map(|i| st[i * vd + vv] * kr[i]).sum();
                    let delta = (v[(tt * h + head) * vd + vv] as f64 - mem)
                        * beta[tt * h + head] as f64;
                    for i in 0..kd {
                        st[i * vd + vv] += kr[i] * delta;
                    }
                    out[(tt * h + head) * vd + vv] =
                        (0..kd).map(|i| st[i * vd + vv] * qr[i]).sum();
                }
                if ckpt[b] >= 0 && tt + 1 == s0 + ckpt[b] as usize {
                    let at = ck_item(b, head);
                    state[at..at + kd * vd].copy_from_slice(&st);
                }
            }
            state[base..base + kd * vd].copy_from_slice(&st);
        }
    }
    out
}

#[test]
fn matches_the_formula_on_a_mixed_batch_in_scattered_pages() {
    // 12: the portable task; 32, 64 and 128: the vector ones (AVX-512 or AVX2 registers,
    // whichever the CPU has).
    for vd in [12, 32, 64, 128] {
        check_mixed_batch(vd);
    }
}

/// The AVX-512 task gives the AVX2 task's bits, output and state, on the mixed batch
/// (checkpoints, fresh and continued runs). Where the CPU lacks AVX-512 both runs take
/// the AVX2 task and this only repeats the check against the formula.
#[test]
fn the_avx512_task_gives_the_avx2_bits() {
    use std::sync::atomic::Ordering;
    for vd in [32, 64, 128] {
        let wide = check_mixed_batch(vd);
        FORCE_AVX2.store(true, Ordering::Relaxed);
        let narrow = check_mixed_batch(vd);
        FORCE_AVX2.store(false, Ordering::Relaxed);
        for (name, a, b) in [("out", &wide.0, &narrow.0), ("state", &wide.1, &narrow.1)] {
            let same = a.iter().zip(b.iter()).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "vd {vd}: {name} differs between the AVX-512 and AVX2 tasks");
        }
    }
}

/// Runs the mixed batch, checks it against the formula, returns (out, state).
fn check_mixed_batch(vd: usize) -> (Vec<f32>, Vec<f32>) {
    let heads = Heads {
        key_heads: 2,
        value_heads: 4,
        key_dim: 16,
        value_dim: vd,
    };
    let lens = [1usize, 37, 0, 1, 5, 64, 20];
    // Checkpoints: mid-run, at the first token, at the last token, and none.
    let ck: [i64; 7] = [-1, 17, -1, 1, 5, -1, 3];
    let mut qsl = vec![0i64];
    for l in lens {
        qsl.push(qsl.last().unwrap() + l as i64);
    }
    let t = *qsl.last().unwrap() as usize;
    let b = lens.len();
    let init = [true, false, true, true, true, false, true];
    // Pages of 3 items of K x V plus 5 elements of padding; a layer of 4 heads whose
    // items start at item 5 (page column 1, slot 2): they straddle columns 1..=3.
    let item_len = 16 * vd;
    let (per_page, page_stride, cols, base) = (3usize, 3 * item_len + 5, 4usize, 5usize);
    let num_pages = 2 * b * cols + 3;
    // Scattered, distinct pages (a permutation), checkpoint rows from the same set.
    let perm: Vec<i64> = (0..num_pages)
        .map(|i| ((i * 7 + 3) % num_pages) as i64)
        .collect();
    let table: Vec<i64> = perm[..b * cols].to_vec();
    let ck_table: Vec<i64> = perm[b * cols..2 * b * cols].to_vec();
    let mut rng = Lcg(7);
    let q = rng.vec(t * 2 * 16);
    let k = rng.vec(t * 2 * 16);
    let v = rng.vec(t * 4 * vd);
    let g: Vec<f32> = rng.vec(t * 4).iter().map(|x| -(x.abs()) * 0.5).collect();
    let beta: Vec<f32> = rng.vec(t * 4).iter().map(|x| x.abs()).collect();
    let mut state: Vec<f32> = rng
        .vec(num_pages * page_stride)
        .iter()
        .map(|x| x * 0.3)
        .collect();
    let mut want_state: Vec<f64> = state.iter().map(|&x| x as f64).collect();
    let at = |tab: &[i64], s: usize, h: usize| {
        let i = base + h;
        tab[s * cols + i / per_page] as usize * page_stride + (i % per_page) * item_len
    };
    let item = |s: usize, h: usize| at(&table, s, h);
    let ck_item = |s: usize, h: usize| at(&ck_table, s, h);
    let want = reference(
        &q,
        &k,
        &v,
        &g,
        &beta,
        heads,
        0.25,
        &mut want_state,
        &qsl,
        &item,
        &init,
        &ck,
        &ck_item,
    );
    let mut out = vec![0.0f32; t * 4 * vd];
    let varlen = Varlen {
        query_start_loc: &qsl,
        has_initial_state: &init,
    };
    let paged = PagedState {
        table: &table,
        cols,
        item_base: base,
        per_page,
        page_stride,
        item_len,
        num_pages,
        checkpoint_positions: &ck,
        checkpoint_table: &ck_table,
        read_only: &[],
    };
    gated_delta_rule(
        Rows::dense(&q, 32).unwrap(),
        Rows::dense(&k, 32).unwrap(),
        Rows::dense(&v, 4 * vd).unwrap(),
        Gates::Direct {
            g: Rows::dense(&g, 4).unwrap(),
            beta: Rows::dense(&beta, 4).unwrap(),
        },
        None,
        heads,
        0.25,
        true,
        &mut state,
        paged,
        varlen,
        &mut out,
    )
    .unwrap();
    for (i, (a, b)) in out.iter().zip(&want).enumerate() {
        assert!((*a as f64 - b).abs() < 1e-4, "out[{i}] = {a}, want {b}");
    }
    // Every element of the pool: run items, checkpoint items, and everything else
    // (other pages, padding) untouched.
    for (i, (a, b)) in state.iter().zip(&want_state).enumerate() {
        assert!(
            (*a as f64 - b).abs() < 1e-4,
            "state[{i}] = {a}, want {b} (vd {vd})"
        );
    }
    (out, state)
}

fn one_item_pool<'a>(table: &'a [i64], ck: &'a [i64], ck_table: &'a [i64]) -> PagedState<'a> {
    PagedState {
        table,
        cols: 1,
        item_base: 0,
        per_page: 1,
        page_stride: 4,
        item_len: 4,
        num_pages: 2,
        checkpoint_positions: ck,
        checkpoint_table: ck_table,
        read_only: &[],
    }
}

#[test]
fn rejects_a_page_written_twice_and_bad_checkpoints() {
    let heads = Heads {
        key_heads: 1,
        value_heads: 1,
        key_dim: 2,
        value_dim: 2,
    };
    let x = [0.5f32; 4];
    let run = |paged: PagedState<'_>| {
        let mut state = vec![0.0f32; 2 * 4];
        let mut out = vec![0.0f32; 4];
        gated_delta_rule(
            Rows::dense(&x, 2).unwrap(),
            Rows::dense(&x, 2).unwrap(),
            Rows::dense(&x, 2).unwrap(),
            Gates::Direct {
                g: Rows::dense(&x[..2], 1).unwrap(),
                beta: Rows::dense(&x[..2], 1).unwrap(),
            },
            None,
            heads,
            1.0,
            true,
            &mut state,
            paged,
            Varlen {
                query_start_loc: &[0, 1, 2],
                has_initial_state: &[true, true],
            },
            &mut out,
        )
        .unwrap_err()
    };
    let err = run(one_item_pool(&[1, 1], &[], &[]));
    assert!(err.0.contains("written by two runs"), "{err}");
    let err = run(one_item_pool(&[0, 1], &[1, -1], &[1, 0]));
    assert!(err.0.contains("written by two runs"), "{err}");
    let err = run(one_item_pool(&[0, 1], &[2, -1], &[1, 0]));
    assert!(err.0.contains("must lie in 1..=1"), "{err}");
    let err = run(one_item_pool(&[0, 2], &[], &[]));
    assert!(err.0.contains("outside 0..2"), "{err}");
}
/// bfloat16 inputs read in place equal the float32 kernel on the same values: the
/// state (float32) bit-equal, the output its single rounding; portable (12) and
/// AVX2 (32) tasks, a fresh and a continued sequence, grouped heads.
#[test]
fn bf16_inputs_equal_the_float32_kernel_on_their_values() {
    use crate::bf16::{from_f32, to_f32};
    for vd in [12usize, 32] {
        let heads = Heads {
            key_heads: 1,
            value_heads: 2,
            key_dim: 16,
            value_dim: vd,
        };
        let (t, item) = (9usize, 16 * vd);
        let mut rng = Lcg(vd as u64);
        let mut bf = |n: usize, s: f32| -> Vec<f32> {
            rng.vec(n).iter().map(|x| to_f32(from_f32(x * s))).collect()
        };
        let (q, k, v) = (bf(t * 16, 1.0), bf(t * 16, 1.0), bf(t * 2 * vd, 1.0));
        let g: Vec<f32> = bf(t * 2, 1.0).iter().map(|x| -x.abs()).collect();
        let beta: Vec<f32> = bf(t * 2, 1.0).iter().map(|x| x.abs()).collect();
        let state0: Vec<f32> = Lcg(3).vec(4 * item);
        let table = [0i64, 1, 2, 3];
        let paged = PagedState {
            table: &table,
            cols: 2,
            item_base: 0,
            per_page: 1,
            page_stride: item,
            item_len: item,
            num_pages: 4,
            checkpoint_positions: &[],
            checkpoint_table: &[],
            read_only: &[],
        };
        let varlen = Varlen {
            query_start_loc: &[0, 4, 9],
            has_initial_state: &[false, true],
        };
        let (mut s32, mut o32) = (state0.clone(), vec![0.0f32; t * 2 * vd]);
        fn d<T>(x: &[T], w: usize) -> Rows<'_, T> {
            Rows::dense(x, w).unwrap()
        }
        gated_delta_rule(
            d(&q, 16),
            d(&k, 16),
            d(&v, 2 * vd),
            Gates::Direct {
                g: d(&g, 2),
                beta: d(&beta, 2),
            },
            None,
            heads,
            0.25,
            true,
            &mut s32,
            paged,
            varlen,
            &mut o32,
        )
        .unwrap();
        let bits = |x: &[f32]| x.iter().map(|&f| from_f32(f)).collect::<Vec<u16>>();
        let (qb, kb, vb, gb, bb) = (bits(&q), bits(&k), bits(&v), bits(&g), bits(&beta));
        let (mut s16, mut o16) = (state0.clone(), vec![0u16; t * 2 * vd]);
        gated_delta_rule_bf16(
            d(&qb, 16),
            d(&kb, 16),
            d(&vb, 2 * vd),
            Gates::Direct {
                g: d(&gb, 2),
                beta: d(&bb, 2),
            },
            None,
            heads,
            0.25,
            true,
            &mut s16,
            paged,
            varlen,
            &mut o16,
        )
        .unwrap();
        assert_eq!(s16, s32, "state (vd {vd})");
        assert_eq!(o16, bits(&o32), "output (vd {vd})");
    }
}

/// Read-only (speculative) runs: the same output as a run that writes, their state
/// items left bit-for-bit as they were (fresh and continued runs), the other runs of
/// the call written as usual; a checkpoint on a read-only run is refused. Portable
/// (12) and vector (32, 128, then 32 again: the thread's reused private copy changes
/// size) tasks.
#[test]
fn read_only_runs_compute_the_same_and_write_nothing() {
    for vd in [12usize, 32, 128, 32] {
        let heads = Heads {
            key_heads: 1,
            value_heads: 2,
            key_dim: 16,
            value_dim: vd,
        };
        let (t, item) = (12usize, 16 * vd);
        let mut rng = Lcg(7 + vd as u64);
        let (q, k, v) = (rng.vec(t * 16), rng.vec(t * 16), rng.vec(t * 2 * vd));
        let g: Vec<f32> = rng.vec(t * 2).iter().map(|x| -x.abs()).collect();
        let beta: Vec<f32> = rng.vec(t * 2).iter().map(|x| x.abs()).collect();
        let state0: Vec<f32> = Lcg(5).vec(6 * item);
        let table = [0i64, 1, 2, 3, 4, 5];
        let varlen = Varlen {
            query_start_loc: &[0, 4, 9, 12],
            has_initial_state: &[false, true, true],
        };
        let run = |read_only: &[bool], ck: &[i64], ck_table: &[i64]| {
            let paged = PagedState {
                table: &table,
                cols: 2,
                item_base: 0,
                per_page: 1,
                page_stride: item,
                item_len: item,
                num_pages: 6,
                checkpoint_positions: ck,
                checkpoint_table: ck_table,
                read_only,
            };
            let (mut s, mut o) = (state0.clone(), vec![0.0f32; t * 2 * vd]);
            fn d(x: &[f32], w: usize) -> Rows<'_, f32> {
                Rows::dense(x, w).unwrap()
            }
            gated_delta_rule(
                d(&q, 16),
                d(&k, 16),
                d(&v, 2 * vd),
                Gates::Direct {
                    g: d(&g, 2),
                    beta: d(&beta, 2),
                },
                None,
                heads,
                0.25,
                true,
                &mut s,
                paged,
                varlen,
                &mut o,
            )
            .map(|_| (s, o))
        };
        let (s_w, o_w) = run(&[], &[], &[]).unwrap();
        let (s_r, o_r) = run(&[true, false, true], &[], &[]).unwrap();
        assert_eq!(o_r, o_w, "output (vd {vd})");
        // Sequence b's items are pages 2b, 2b+1 (two heads, one item per page).
        for (b, ro) in [(0usize, true), (1, false), (2, true)] {
            let span = 2 * b * item..(2 * b + 2) * item;
            let want = if ro { &state0[span.clone()] } else { &s_w[span.clone()] };
            assert_eq!(&s_r[span], want, "sequence {b} (vd {vd})");
        }
        assert!(s_w[..2 * item] != state0[..2 * item], "the writing run must change the state");
        let err = run(&[true, false, true], &[1, -1, -1], &[1, 0, 0, 0, 0, 0]).unwrap_err();
        assert!(format!("{err:?}").contains("read-only"), "{err:?}");
    }
}
