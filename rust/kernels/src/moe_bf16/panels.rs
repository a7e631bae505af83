//! The routed experts' weights in the layout `vdpbf16ps` reads without lane sums:
//! column panels of pairs of keys.
//!
//! A weight `W` `[N, K]` (HF's layout: one row per output) becomes panels of
//! [`PANEL`] outputs (the last one narrower when `N` is not a multiple): panel `p`
//! starts at element `PANEL p K` and holds, for every pair of keys `k2`, its `w`
//! outputs' two keys side by side, `[W[n, 2 k2], W[n, 2 k2 + 1]]` for `n` in the
//! panel (`[K/2, w, 2]`, "VNNI" order), then, for an odd `K`, the last key of each of
//! its outputs (`[w]`). Same number of elements as `W`, so a tensor is packed in place
//! ([`pack`], [`unpack`]: one matrix of scratch).
//!
//! Why: with HF's layout each output is a dot product over a short weight row (`K` =
//! 192-256 in the MoE models' experts), one lane sum per output, and a walk over the
//! rows in memory order read the weights at 9-10 GB/s from memory on one or two rows
//! of `x` (probe on moe-bench's experts, one thread: 9.6-9.9 GB/s against a 23-25 GB/s
//! plain stream). A panel is one contiguous run in which every 64-byte load is 16
//! outputs' next two keys: a block of rows keeps `rows x 4` accumulators of 16 outputs
//! each, `acc += dpbf16(broadcast(x[m, 2 k2 .. 2 k2 + 2]), panel[k2])`, and stores
//! them with no reduction (the same probe: 24-30 GB/s at 1, 2 and 4 rows, 18-20 at 8).
//!
//! Every output is summed over its keys in one fixed order (pair by pair, the odd
//! last key last) whatever the number of rows in its block, so a row's result does
//! not depend on the rows it is batched with.

use crate::bf16::{to_f32, Isa};
use crate::matmul_bf16::OutPtr;
use crate::Rows;

/// Outputs per panel: four 16-lane float32 accumulators per row of `x`.
pub const PANEL: usize = 64;
/// Rows of `x` per register block: `6 x 4` accumulators, 4 weight vectors and a
/// broadcast fit AVX-512's 32 registers.
pub const MR: usize = 6;

/// Element offset of `W[n, k]` in `W`'s panel layout (`N` = `n_total`).
#[inline]
pub fn packed_index(n: usize, k: usize, n_total: usize, k_total: usize) -> usize {
    let p0 = n / PANEL * PANEL;
    let w = (n_total - p0).min(PANEL);
    let base = p0 * k_total;
    if k < k_total / 2 * 2 {
        base + (k / 2) * 2 * w + 2 * (n - p0) + k % 2
    } else {
        base + (k_total / 2) * 2 * w + (n - p0)
    }
}

/// `w` (`[N, K]` row-major) rearranged into its panel layout, in place; `scratch`
/// is resized to `N K`.
pub fn pack(w: &mut [u16], n: usize, k: usize, scratch: &mut Vec<u16>) {
    assert_eq!(w.len(), n * k, "pack: w must be [N={n}, K={k}]");
    scratch.clear();
    scratch.extend_from_slice(w);
    for r in 0..n {
        for c in 0..k {
            w[packed_index(r, c, n, k)] = scratch[r * k + c];
        }
    }
}

/// The inverse of [`pack`]: `w` back to `[N, K]` row-major, in place.
pub fn unpack(w: &mut [u16], n: usize, k: usize, scratch: &mut Vec<u16>) {
    assert_eq!(w.len(), n * k, "unpack: w must be [N={n}, K={k}]");
    scratch.clear();
    scratch.extend_from_slice(w);
    for r in 0..n {
        for c in 0..k {
            w[r * k + c] = scratch[packed_index(r, c, n, k)];
        }
    }
}

/// `out[m, oc + j - j0] = sum_k x[m, k] W[j, k]` for outputs `j0..j1` of a weight in
/// panel layout (`wp`: the whole `[N, K]` matrix, `N` = `n`); `j0` must start a panel.
///
/// # Safety
/// `isa` must be supported; `out` must hold `x.rows` rows of `ldo` values whose columns
/// `oc..oc + j1 - j0` are this caller's alone.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn panel_columns(
    isa: Isa,
    x: &Rows<'_, u16>,
    wp: &[u16],
    n: usize,
    j0: usize,
    j1: usize,
    out: OutPtr,
    ldo: usize,
    oc: usize,
) {
    debug_assert!(j0 % PANEL == 0 && j1 <= n && wp.len() == n * x.width);
    let k = x.width;
    let mut p0 = j0;
    while p0 < j1 {
        let w = (n - p0).min(PANEL);
        let used = (j1 - p0).min(w);
        let panel = wp.as_ptr().add(p0 * k);
        let mut r = 0;
        while r < x.rows {
            let mr = (x.rows - r).min(MR);
            let xs: [*const u16; MR] = std::array::from_fn(|i| x.row(r + i.min(mr - 1)).as_ptr());
            let mut tile = [[0.0f32; PANEL]; MR];
            match isa {
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512Bf16 => match mr {
                    1 => avx512::block::<1>(&xs, panel, w, k, &mut tile),
                    2 => avx512::block::<2>(&xs, panel, w, k, &mut tile),
                    3 => avx512::block::<3>(&xs, panel, w, k, &mut tile),
                    4 => avx512::block::<4>(&xs, panel, w, k, &mut tile),
                    5 => avx512::block::<5>(&xs, panel, w, k, &mut tile),
                    _ => avx512::block::<6>(&xs, panel, w, k, &mut tile),
                },
                _ => scalar_block(&xs, mr, panel, w, k, &mut tile),
            }
            for (i, row) in tile.iter().enumerate().take(mr) {
                for (c, &v) in row.iter().enumerate().take(used) {
                    out.put((r + i) * ldo + oc + (p0 - j0) + c, v);
                }
            }
            r += mr;
        }
        p0 += w;
    }
}

/// One panel of `w` outputs for `mr` rows in plain Rust (any CPU; AVX2 too: the
/// routed experts' few rows are memory-bound and CPUs without AVX-512 BF16 are not
/// where bfloat16 serving runs fast): per output, the pairs' products added in key
/// order.
unsafe fn scalar_block(
    xs: &[*const u16; MR],
    mr: usize,
    panel: *const u16,
    w: usize,
    k: usize,
    tile: &mut [[f32; PANEL]; MR],
) {
    for (i, row) in tile.iter_mut().enumerate().take(mr) {
        let x = std::slice::from_raw_parts(xs[i], k);
        for k2 in 0..k / 2 {
            let pr = std::slice::from_raw_parts(panel.add(k2 * 2 * w), 2 * w);
            let (x0, x1) = (to_f32(x[2 * k2]), to_f32(x[2 * k2 + 1]));
            for c in 0..w {
                row[c] += x0 * to_f32(pr[2 * c]) + x1 * to_f32(pr[2 * c + 1]);
            }
        }
        if k % 2 == 1 {
            let last = std::slice::from_raw_parts(panel.add(k / 2 * 2 * w), w);
            let xl = to_f32(x[k - 1]);
            for c in 0..w {
                row[c] += xl * to_f32(last[c]);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{MR, PANEL};
    use std::arch::x86_64::*;

    /// `R` rows against one panel of `w` outputs: per pair of keys, 4 loads of 16
    /// outputs' pairs (masked past `w`), and per row one broadcast of its pair and 4
    /// `vdpbf16ps`; the odd last key as a pair with a zero.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn block<const R: usize>(
        xs: &[*const u16; MR],
        panel: *const u16,
        w: usize,
        k: usize,
        tile: &mut [[f32; PANEL]; MR],
    ) {
        // Lanes (pairs) of each of the 4 vectors that hold outputs of this panel.
        let masks: [__mmask16; 4] = std::array::from_fn(|c| {
            let live = w.saturating_sub(16 * c).min(16);
            ((1u32 << live) - 1) as __mmask16
        });
        let full = w == PANEL;
        let mut acc = [[_mm512_setzero_ps(); 4]; R];
        for k2 in 0..k / 2 {
            let row = panel.add(k2 * 2 * w) as *const i32;
            let wv: [__m512bh; 4] = std::array::from_fn(|c| {
                let v = if full {
                    _mm512_loadu_si512(row.add(16 * c) as *const _)
                } else {
                    _mm512_maskz_loadu_epi32(masks[c], row.add(16 * c))
                };
                std::mem::transmute::<__m512i, __m512bh>(v)
            });
            for i in 0..R {
                let pair = (xs[i].add(2 * k2) as *const i32).read_unaligned();
                let xb = std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(pair));
                for c in 0..4 {
                    acc[i][c] = _mm512_dpbf16_ps(acc[i][c], xb, wv[c]);
                }
            }
        }
        if k % 2 == 1 {
            // The last key of each output, widened to a (key, 0) pair.
            let last = panel.add(k / 2 * 2 * w);
            let wv: [__m512bh; 4] = std::array::from_fn(|c| {
                let v16 = _mm256_maskz_loadu_epi16(masks[c], last.add(16 * c) as *const i16);
                std::mem::transmute::<__m512i, __m512bh>(_mm512_cvtepu16_epi32(v16))
            });
            for i in 0..R {
                let xb = std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(
                    *xs[i].add(k - 1) as i32,
                ));
                for c in 0..4 {
                    acc[i][c] = _mm512_dpbf16_ps(acc[i][c], xb, wv[c]);
                }
            }
        }
        for i in 0..R {
            for c in 0..4 {
                _mm512_storeu_ps(tile[i].as_mut_ptr().add(16 * c), acc[i][c]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bf16::from_f32;

    fn values(n: usize, seed: usize) -> Vec<u16> {
        (0..n)
            .map(|i| {
                from_f32(
                    ((((i + 1) * 2654435761 + seed * 40503) % 1000) as f32 / 1000.0 - 0.5) * 2.0,
                )
            })
            .collect()
    }

    #[test]
    fn pack_then_unpack_is_the_identity_and_pack_is_a_permutation() {
        let mut scratch = Vec::new();
        for (n, k) in [(64usize, 256usize), (100, 7), (1, 1), (130, 192), (37, 33)] {
            let w = values(n * k, n + k);
            let mut p = w.clone();
            pack(&mut p, n, k, &mut scratch);
            let mut seen = vec![false; n * k];
            for r in 0..n {
                for c in 0..k {
                    let at = packed_index(r, c, n, k);
                    assert!(!seen[at], "two elements at {at}");
                    seen[at] = true;
                    assert_eq!(p[at], w[r * k + c]);
                }
            }
            unpack(&mut p, n, k, &mut scratch);
            assert_eq!(p, w, "n={n} k={k}");
        }
    }

    /// Every path against the float64 sum of the same bfloat16 values, for row counts
    /// around the register block, partial panels and odd `K`; and a row's bits are
    /// the same alone and inside any block.
    #[test]
    fn panel_columns_match_the_f64_sum_and_a_row_is_the_same_in_any_block() {
        for (m, k, n) in [
            (1usize, 256usize, 384usize),
            (2, 192, 256),
            (7, 33, 100),
            (13, 64, 64),
            (3, 1, 17),
            (16, 9, 130),
        ] {
            let x = values(m * k, 3);
            let w = values(n * k, 5);
            let mut wp = w.clone();
            pack(&mut wp, n, k, &mut Vec::new());
            for isa in [Isa::Scalar, Isa::Avx2, Isa::Avx512Bf16]
                .into_iter()
                .filter(|i| i.supported())
            {
                let mut o = vec![f32::NAN; m * n];
                let xr = Rows::dense(&x, k).unwrap();
                // SAFETY: the whole output; supported ISA.
                unsafe { panel_columns(isa, &xr, &wp, n, 0, n, OutPtr::F32(o.as_mut_ptr()), n, 0) };
                for r in 0..m {
                    for c in 0..n {
                        let want: f64 = (0..k)
                            .map(|kk| to_f32(x[r * k + kk]) as f64 * to_f32(w[c * k + kk]) as f64)
                            .sum();
                        let got = o[r * n + c] as f64;
                        assert!(
                            (got - want).abs() <= 1e-5 * (k as f64).sqrt() * (1.0 + want.abs()),
                            "{isa:?} m={m} k={k} n={n} at {r},{c}: {got} vs {want}"
                        );
                    }
                }
                for r in 0..m {
                    let mut one = vec![0.0f32; n];
                    let xr = Rows::dense(&x[r * k..(r + 1) * k], k).unwrap();
                    // SAFETY: as above; a column range starting at the second panel.
                    unsafe {
                        panel_columns(isa, &xr, &wp, n, 0, n, OutPtr::F32(one.as_mut_ptr()), n, 0)
                    };
                    let same = one
                        .iter()
                        .zip(&o[r * n..(r + 1) * n])
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "{isa:?} m={m} k={k} n={n}: row {r} alone differs from its block"
                    );
                    if n > PANEL {
                        let mut part = vec![0.0f32; n - PANEL];
                        unsafe {
                            panel_columns(
                                isa,
                                &xr,
                                &wp,
                                n,
                                PANEL,
                                n,
                                OutPtr::F32(part.as_mut_ptr()),
                                n - PANEL,
                                0,
                            )
                        };
                        assert_eq!(part, one[PANEL..], "{isa:?}: columns from the second panel");
                    }
                }
            }
        }
    }
}
