//! The 32-weight blocks (Q8_0, Q4_0, Q5_0, Q5_1): one weight row against a few
//! activation rows ([`q32`]), and eight weight rows against many ([`q32_x8`]).

macro_rules! q32_kernels {
    ($feat:literal, $vnni:literal) => {
            /// Blocks of 32 weights (`KIND` [`Q8_0`], [`Q4_0`], [`Q5_0`], [`Q5_1`]), one
            /// weight row against `R` activation rows. The float order is the one
            /// [`super::super::dot_scalar`] and [`q32_x8`] take: each block's exact
            /// integer sum `s` gives `f = (d_w d_x) s` (Q5_1: `+ (m d_x) sum_x`), block
            /// `b` goes to accumulator `b % 8` (a lane here), and the eight are summed as
            /// [`hsum_ps`] does; so any path gives a row the same bits.
            #[inline]
            #[target_feature(enable = $feat)]
            pub unsafe fn q32<const R: usize, const KIND: u8>(
                w: *const u8,
                nb: usize,
                xs: &[ActRow<'_>; R],
            ) -> [f32; R] {
                let mut out = [0.0f32; R];
                q32_rows::<R, KIND>(w, 0, 1, nb, xs, &mut out);
                out
            }

            /// [`q32`] for `n` consecutive weight rows (`rb` bytes apart) in one call:
            /// `out[R j + r]` = weight row `j` times activation row `r`. The body is here and [`q32`] calls
            /// it with `n = 1`: LLVM did not inline a per-row function into a loop this size.
            #[target_feature(enable = $feat)]
            pub unsafe fn q32_rows<const R: usize, const KIND: u8>(
                w0: *const u8,
                rb: usize,
                n: usize,
                nb: usize,
                xs: &[ActRow<'_>; R],
                out: &mut [f32],
            ) {
                let bb = match KIND {
                    Q8_0 => 34,
                    Q4_0 => 18,
                    Q5_0 => 22,
                    _ => 24,
                };
                let off = off32::<KIND>();
                let pf = super::pf_dist();
                for row in 0..n {
                    let w = w0.add(row * rb);
                    let mut acc = [_mm256_setzero_ps(); R];
                    let mut b0 = 0;
                    while b0 < nb {
                        let nblk = (nb - b0).min(8);
                        prefetch(w.wrapping_add(b0 * bb + pf), 8 * bb);
                        let mut p = [[_mm256_setzero_si256(); 8]; R];
                        let (mut dh, mut mh) = ([0u16; 8], [0u16; 8]);
                        macro_rules! block {
                            ($i:expr) => {{
                                let i: usize = $i;
                                let blk = w.add((b0 + i) * bb);
                                dh[i] = (blk as *const u16).read_unaligned();
                                if KIND == Q5_1 {
                                    mh[i] = (blk.add(2) as *const u16).read_unaligned();
                                }
                                let u = unpack32::<KIND>(blk);
                                for r in 0..R {
                                    p[r][i] = bdot::<KIND>(u, ld(xs[r].qs.as_ptr().add(32 * (b0 + i)) as *const u8));
                                }
                            }};
                        }
                        if nblk == 8 {
                            for i in 0..8 {
                                block!(i);
                            }
                        } else {
                            for i in 0..nblk {
                                block!(i);
                            }
                        }
                        let dw = _mm256_cvtph_ps(halves(&dh));
                        let mw = if KIND == Q5_1 { _mm256_cvtph_ps(halves(&mh)) } else { _mm256_setzero_ps() };
                        for r in 0..R {
                            let (dx, xsum) = if nblk == 8 {
                                (
                                    _mm256_loadu_ps(xs[r].d.as_ptr().add(b0)),
                                    _mm256_loadu_si256(xs[r].sums.as_ptr().add(b0) as *const __m256i),
                                )
                            } else {
                                let (mut d, mut s) = ([0.0f32; 8], [0i32; 8]);
                                d[..nblk].copy_from_slice(&xs[r].d[b0..b0 + nblk]);
                                s[..nblk].copy_from_slice(&xs[r].sums[b0..b0 + nblk]);
                                (_mm256_loadu_ps(d.as_ptr()), _mm256_loadu_si256(s.as_ptr() as *const __m256i))
                            };
                            let mut s = sum8(&p[r]);
                            if off != 0 {
                                s = _mm256_sub_epi32(s, _mm256_mullo_epi32(xsum, _mm256_set1_epi32(off)));
                            }
                            let mut f = _mm256_mul_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(s));
                            if KIND == Q5_1 {
                                f = _mm256_add_ps(f, _mm256_mul_ps(_mm256_mul_ps(mw, dx), _mm256_cvtepi32_ps(xsum)));
                            }
                            acc[r] = _mm256_add_ps(acc[r], f);
                        }
                        b0 += 8;
                    }
                    let acc: [f32; R] = std::array::from_fn(|r| hsum_ps(acc[r]));
                    out[R * row..R * row + R].copy_from_slice(&acc);
                }
            }

            /// Eight weight rows of 32-weight blocks (`rb` bytes apart) against any
            /// number of activation rows, as [`q4k_q5k_x8`] lays them out (each block of
            /// the eight rows unpacked once, transposed so lane `i` is weight row `i`);
            /// the float steps of [`q32`] lane-wise: `acc[r]` is row `r`'s eight
            /// accumulators (block `b` into `8 (b % 8)..`), zeroed here, and on return
            /// `acc[r][..8]` holds the eight outputs. Equal to [`q32`] bit for bit.
            #[target_feature(enable = $feat)]
            pub unsafe fn q32_x8<const KIND: u8>(
                w: *const u8,
                rb: usize,
                nb: usize,
                xs: &[ActRow<'_>],
                acc: &mut [[f32; 64]],
            ) {
                let bb = match KIND {
                    Q8_0 => 34,
                    Q4_0 => 18,
                    Q5_0 => 22,
                    _ => 24,
                };
                let off = off32::<KIND>();
                let signed = KIND == Q8_0 && !$vnni;
                for a in acc.iter_mut() {
                    a.fill(0.0);
                }
                // The eight rows are one run of `8 rb` bytes, read a block of each row at a
                // time: too many short streams for the hardware prefetcher. The next pass's
                // run is asked for a slice per block instead.
                let pf_on = super::pf_rows() != 0;
                let slice = (8 * rb).div_ceil(nb);
                for b in 0..nb {
                    if pf_on {
                        prefetch(w.wrapping_add(8 * rb + b * slice), slice);
                    }
                    let mut v = [_mm256_setzero_si256(); 8];
                    let (mut dh, mut mh) = ([0u16; 8], [0u16; 8]);
                    for i in 0..8 {
                        let blk = w.add(i * rb + b * bb);
                        dh[i] = (blk as *const u16).read_unaligned();
                        if KIND == Q5_1 {
                            mh[i] = (blk.add(2) as *const u16).read_unaligned();
                        }
                        v[i] = unpack32::<KIND>(blk);
                    }
                    // Signed Q8_0 on AVX2: magnitudes to multiply, the weights for the signs.
                    let vs = transpose8(&v);
                    let vu = if signed { transpose8(&v.map(|r| _mm256_abs_epi8(r))) } else { vs };
                    let dw = _mm256_cvtph_ps(halves(&dh));
                    let mw = if KIND == Q5_1 { _mm256_cvtph_ps(halves(&mh)) } else { _mm256_setzero_ps() };
                    let l = 8 * (b % 8);
                    for (r, x) in xs.iter().enumerate() {
                        let xp = x.qs.as_ptr().add(32 * b) as *const i32;
                        let (mut p0, mut p1) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                        for q in 0..4 {
                            let mut x0 = _mm256_set1_epi32(xp.add(2 * q).read_unaligned());
                            let mut x1 = _mm256_set1_epi32(xp.add(2 * q + 1).read_unaligned());
                            if signed {
                                x0 = _mm256_sign_epi8(x0, vs[2 * q]);
                                x1 = _mm256_sign_epi8(x1, vs[2 * q + 1]);
                            }
                            p0 = idot_acc(p0, vu[2 * q], x0);
                            p1 = idot_acc(p1, vu[2 * q + 1], x1);
                        }
                        let xsum = *x.sums.get_unchecked(b);
                        let mut s = _mm256_add_epi32(p0, p1);
                        if off != 0 {
                            s = _mm256_sub_epi32(s, _mm256_set1_epi32(off * xsum));
                        }
                        let dx = _mm256_set1_ps(*x.d.get_unchecked(b));
                        let mut f = _mm256_mul_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(s));
                        if KIND == Q5_1 {
                            f = _mm256_add_ps(f, _mm256_mul_ps(_mm256_mul_ps(mw, dx), _mm256_set1_ps(xsum as f32)));
                        }
                        let a = acc.get_unchecked_mut(r).as_mut_ptr().add(l);
                        _mm256_storeu_ps(a, _mm256_add_ps(_mm256_loadu_ps(a), f));
                    }
                }
                // The eight accumulators summed in `hsum_ps`'s order, lane-wise.
                for a in acc.iter_mut().take(xs.len()) {
                    let v: [__m256; 8] = std::array::from_fn(|l| _mm256_loadu_ps(a.as_ptr().add(8 * l)));
                    let t = _mm256_add_ps(
                        _mm256_add_ps(_mm256_add_ps(v[0], v[4]), _mm256_add_ps(v[2], v[6])),
                        _mm256_add_ps(_mm256_add_ps(v[1], v[5]), _mm256_add_ps(v[3], v[7])),
                    );
                    _mm256_storeu_ps(a.as_mut_ptr(), t);
                }
            }
    };
}
