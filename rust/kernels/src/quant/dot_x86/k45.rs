//! Q4_K and Q5_K: one weight row against a few activation rows, against many, and
//! eight weight rows against many (the transposed kernel).

macro_rules! k45_kernels {
    ($feat:literal, $vnni:literal) => {
            /// Q4_K (`FIVE = false`) or Q5_K weights, one weight row against `R`
            /// activation rows (decode: one or two). Everything per super-block stays in
            /// vector registers: the scales and mins unpacked by [`k4_scale_mins`], each
            /// sub-block's scale one byte shuffle of them, the products `vpmaddubsw`
            /// pairs (at most 2 x 31 x 127) times the int16 scale into int32 (`vpdpwssd`
            /// on VNNI), the min term one `vpmaddwd` of the packed 16-sums, and the two
            /// sums reduced together. The integer sums are exact and the float steps
            /// those of [`super::super::dot_scalar`]: equal bit for bit.
            #[inline]
            #[target_feature(enable = $feat)]
            pub unsafe fn q4k_q5k<const R: usize, const FIVE: bool>(
                w: *const u8,
                nb: usize,
                xs: &[ActRow<'_>; R],
            ) -> [f32; R] {
                let mut out = [0.0f32; R];
                q4k_q5k_rows::<R, FIVE>(w, 0, 1, nb, xs, &mut out);
                out
            }

            /// [`q4k_q5k`] for `n` consecutive weight rows (`rb` bytes apart) in one
            /// call: `out[R j + r]` = weight row `j` times activation row `r`. A decode
            /// step's rows are a few super-blocks each: one call per row would pay its
            /// entry and constants per row. The body is here and [`q4k_q5k`] calls it with
            /// `n = 1` (as [`q32_rows`]).
            #[target_feature(enable = $feat)]
            pub unsafe fn q4k_q5k_rows<const R: usize, const FIVE: bool>(
                w0: *const u8,
                rb: usize,
                n: usize,
                nb: usize,
                xs: &[ActRow<'_>; R],
                out: &mut [f32],
            ) {
                let bb = if FIVE { 176 } else { 144 };
                let qs_at = if FIVE { 48 } else { 16 };
                let m4 = _mm256_set1_epi8(0x0F);
                let h5 = _mm256_set1_epi8(0x10);
                // Word pairs (m0, m0), (m1, m1), (m4, m4), (m5, m5) | (m2, ..), (m3, ..),
                // (m6, ..), (m7, ..): the order `vpackssdw` leaves the sixteen 16-sums in.
                let min_pick = _mm256_setr_epi8(
                    8, -128, 8, -128, 9, -128, 9, -128, 12, -128, 12, -128, 13, -128, 13, -128, //
                    10, -128, 10, -128, 11, -128, 11, -128, 14, -128, 14, -128, 15, -128, 15, -128,
                );
                let pf = super::pf_dist();
                for row in 0..n {
                    let w = w0.add(row * rb);
                    let mut acc = [0.0f32; R];
                    for b in 0..nb {
                        let blk = w.add(b * bb);
                        prefetch(blk.wrapping_add(pf), bb);
                        let sm = k4_scale_mins(blk);
                        let qh = if FIVE { ld(blk.add(16)) } else { _mm256_setzero_si256() };
                        let (mut i0, mut i1) = ([_mm256_setzero_si256(); R], [_mm256_setzero_si256(); R]);
                        for j in 0..4 {
                            let q = ld(blk.add(qs_at + 32 * j));
                            let mut lo = _mm256_and_si256(q, m4);
                            let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4);
                            if FIVE {
                                let bl = _mm256_set1_epi8((1u8 << (2 * j)) as i8);
                                let bh = _mm256_set1_epi8((1u8 << (2 * j + 1)) as i8);
                                lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bl), bl), h5));
                                hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bh), bh), h5));
                            }
                            let sl = _mm256_shuffle_epi8(sm, _mm256_set1_epi16((0x8000 | (2 * j)) as i16));
                            let sh = _mm256_shuffle_epi8(sm, _mm256_set1_epi16((0x8000 | (2 * j + 1)) as i16));
                            for r in 0..R {
                                let x = xs[r].qs.as_ptr().add(256 * b + 64 * j) as *const u8;
                                i0[r] = wdot(i0[r], _mm256_maddubs_epi16(lo, ld(x)), sl);
                                i1[r] = wdot(i1[r], _mm256_maddubs_epi16(hi, ld(x.add(32))), sh);
                            }
                        }
                        let mins16 = _mm256_shuffle_epi8(sm, min_pick);
                        // d and dmin in lanes 0 and 1.
                        let dd = _mm_cvtph_ps(_mm_cvtsi32_si128((blk as *const i32).read_unaligned()));
                        for r in 0..R {
                            let s = xs[r].sums.as_ptr().add(16 * b);
                            let s16 = _mm256_packs_epi32(
                                _mm256_loadu_si256(s as *const __m256i),
                                _mm256_loadu_si256(s.add(8) as *const __m256i),
                            );
                            let mins = _mm256_madd_epi16(s16, mins16);
                            // [isum, mins] in lanes 0 and 1, each an exact integer sum.
                            let t = _mm256_hadd_epi32(_mm256_add_epi32(i0[r], i1[r]), mins);
                            let t = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256::<1>(t));
                            let t = _mm_cvtepi32_ps(_mm_hadd_epi32(t, t));
                            let dx = _mm_set1_ps(*xs[r].d.get_unchecked(b));
                            // (d dx) isum - (dmin dx) mins, as the scalar path rounds it.
                            let p = _mm_mul_ps(_mm_mul_ps(dd, dx), t);
                            acc[r] += _mm_cvtss_f32(_mm_sub_ss(p, _mm_movehdup_ps(p)));
                        }
                    }
                    out[R * row..R * row + R].copy_from_slice(&acc);
                }
            }


            /// [`q4k_q5k`] for any number of activation rows: each super-block is
            /// unpacked once (bytes and scale registers) and every row runs against it,
            /// so a row costs its dot products alone. The same integer sums and float
            /// steps per row as [`q4k_q5k`]: equal bit for bit. `acc[r] +=` row `r`'s
            /// products.
            #[target_feature(enable = $feat)]
            pub unsafe fn q4k_q5k_many<const FIVE: bool>(w: *const u8, nb: usize, xs: &[ActRow<'_>], acc: &mut [f32]) {
                let bb = if FIVE { 176 } else { 144 };
                let qs_at = if FIVE { 48 } else { 16 };
                let m4 = _mm256_set1_epi8(0x0F);
                let h5 = _mm256_set1_epi8(0x10);
                for b in 0..nb {
                    let blk = w.add(b * bb);
                    let (d, dmin) = (h2f(blk), h2f(blk.add(2)));
                    let q = &*(blk.add(4) as *const [u8; 12]);
                    let mut sm = [(0u8, 0u8); 8];
                    for j in 0..4 {
                        sm[j] = (q[j] & 63, q[j + 4] & 63);
                        sm[j + 4] = ((q[j + 8] & 0xF) | ((q[j] >> 6) << 4), (q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4));
                    }
                    let qh = if FIVE { ld(blk.add(16)) } else { _mm256_setzero_si256() };
                    let mut u = [_mm256_setzero_si256(); 8];
                    let mut sc = [_mm256_setzero_si256(); 8];
                    for j in 0..4 {
                        let q = ld(blk.add(qs_at + 32 * j));
                        let mut lo = _mm256_and_si256(q, m4);
                        let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4);
                        if FIVE {
                            let bl = _mm256_set1_epi8((1u8 << (2 * j)) as i8);
                            let bh = _mm256_set1_epi8((1u8 << (2 * j + 1)) as i8);
                            lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bl), bl), h5));
                            hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bh), bh), h5));
                        }
                        u[2 * j] = lo;
                        u[2 * j + 1] = hi;
                        let (s0, s1) = (sm[2 * j].0 as i32, sm[2 * j + 1].0 as i32);
                        sc[2 * j] = scales(s0, s0);
                        sc[2 * j + 1] = scales(s1, s1);
                    }
                    let m = |j: usize| sm[j].1 as i32;
                    let m_lo = _mm256_setr_epi32(m(0), m(0), m(1), m(1), m(2), m(2), m(3), m(3));
                    let m_hi = _mm256_setr_epi32(m(4), m(4), m(5), m(5), m(6), m(6), m(7), m(7));
                    for (r, x) in xs.iter().enumerate() {
                        let xp = x.qs.as_ptr().add(256 * b) as *const u8;
                        let mut i0 = sdot(u[0], ld(xp), sc[0]);
                        let mut i1 = sdot(u[1], ld(xp.add(32)), sc[1]);
                        for j in 1..4 {
                            i0 = _mm256_add_epi32(i0, sdot(u[2 * j], ld(xp.add(64 * j)), sc[2 * j]));
                            i1 = _mm256_add_epi32(i1, sdot(u[2 * j + 1], ld(xp.add(64 * j + 32)), sc[2 * j + 1]));
                        }
                        let s = x.sums.as_ptr().add(16 * b);
                        let mins = hsum_i32(_mm256_add_epi32(
                            _mm256_mullo_epi32(m_lo, _mm256_loadu_si256(s as *const __m256i)),
                            _mm256_mullo_epi32(m_hi, _mm256_loadu_si256(s.add(8) as *const __m256i)),
                        ));
                        let dx = *x.d.get_unchecked(b);
                        let a = acc.get_unchecked_mut(r);
                        *a += d * dx * hsum_i32(_mm256_add_epi32(i0, i1)) as f32 - dmin * dx * mins as f32;
                    }
                }
            }

            /// Eight Q4_K / Q5_K weight rows (`rb` bytes apart) against any number of
            /// activation rows: `acc[r][i] +=` activation row `r` times weight row `i`.
            /// Each super-block of the eight rows is unpacked once and transposed so a
            /// register's lane `i` holds four bytes of weight row `i`: one instruction
            /// then takes four products for each of eight outputs (four activation bytes
            /// broadcast), with no horizontal sums, and each sub-block's scale is one
            /// lane-wise multiply per activation row. Integer sums are exact and the
            /// float steps per output those of [`super::super::dot_scalar`] (lane-wise,
            /// no fused multiply-add): equal bit for bit.
            #[target_feature(enable = $feat)]
            pub unsafe fn q4k_q5k_x8<const FIVE: bool>(
                w: *const u8,
                rb: usize,
                nb: usize,
                xs: &[ActRow<'_>],
                acc: &mut [[f32; 8]],
            ) {
                let bb = if FIVE { 176 } else { 144 };
                let qs_at = if FIVE { 48 } else { 16 };
                let m4 = _mm256_set1_epi8(0x0F);
                let h5 = _mm256_set1_epi8(0x10);
                let mut isum = vec![_mm256_setzero_si256(); xs.len()];
                // The eight rows are one run of `8 rb` bytes, read a block of each row at a
                // time: too many short streams for the hardware prefetcher. The next pass's
                // run is asked for a slice per block instead.
                let pf_on = super::pf_rows() != 0;
                let slice = (8 * rb).div_ceil(nb);
                for b in 0..nb {
                    if pf_on {
                        prefetch(w.wrapping_add(8 * rb + b * slice), slice);
                    }
                    // v[j][i]: sub-block j of weight row i (32 bytes), then transposed.
                    let mut v = [[_mm256_setzero_si256(); 8]; 8];
                    let mut sc = [[0i32; 8]; 8];
                    let mut mn = [[0i32; 8]; 8];
                    let (mut dv, mut dmv) = ([0.0f32; 8], [0.0f32; 8]);
                    for i in 0..8 {
                        let blk = w.add(i * rb + b * bb);
                        dv[i] = h2f(blk);
                        dmv[i] = h2f(blk.add(2));
                        let q = &*(blk.add(4) as *const [u8; 12]);
                        for j in 0..4 {
                            sc[j][i] = (q[j] & 63) as i32;
                            mn[j][i] = (q[j + 4] & 63) as i32;
                            sc[j + 4][i] = ((q[j + 8] & 0xF) | ((q[j] >> 6) << 4)) as i32;
                            mn[j + 4][i] = ((q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4)) as i32;
                        }
                        let qh = if FIVE { ld(blk.add(16)) } else { _mm256_setzero_si256() };
                        for j in 0..4 {
                            let q = ld(blk.add(qs_at + 32 * j));
                            let mut lo = _mm256_and_si256(q, m4);
                            let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4);
                            if FIVE {
                                let bl = _mm256_set1_epi8((1u8 << (2 * j)) as i8);
                                let bh = _mm256_set1_epi8((1u8 << (2 * j + 1)) as i8);
                                lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bl), bl), h5));
                                hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bh), bh), h5));
                            }
                            v[2 * j][i] = lo;
                            v[2 * j + 1][i] = hi;
                        }
                    }
                    for vj in v.iter_mut() {
                        *vj = transpose8(vj);
                    }
                    for s in isum.iter_mut() {
                        *s = _mm256_setzero_si256();
                    }
                    for j in 0..8 {
                        let vj = &v[j];
                        let scj = _mm256_loadu_si256(sc[j].as_ptr() as *const __m256i);
                        for (r, x) in xs.iter().enumerate() {
                            let xp = x.qs.as_ptr().add(256 * b + 32 * j) as *const i32;
                            // Two chains: each waits on its own accumulator only.
                            let (mut p, mut p1) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                            for q in 0..4 {
                                p = idot_acc(p, vj[2 * q], _mm256_set1_epi32(xp.add(2 * q).read_unaligned()));
                                p1 = idot_acc(p1, vj[2 * q + 1], _mm256_set1_epi32(xp.add(2 * q + 1).read_unaligned()));
                            }
                            let p = _mm256_add_epi32(p, p1);
                            let s = isum.get_unchecked_mut(r);
                            *s = _mm256_add_epi32(*s, _mm256_mullo_epi32(p, scj));
                        }
                    }
                    let d = _mm256_loadu_ps(dv.as_ptr());
                    let dmin = _mm256_loadu_ps(dmv.as_ptr());
                    // The min term by pairs of sub-blocks in int16 (`vpmaddwd`): a min is at
                    // most 63 and a sub-block's activation sum at most 32 x 127 in size.
                    let mv: [__m256i; 4] = std::array::from_fn(|jp| {
                        let pair: [i32; 8] =
                            std::array::from_fn(|i| (mn[2 * jp][i] & 0xFFFF) | (mn[2 * jp + 1][i] << 16));
                        _mm256_loadu_si256(pair.as_ptr() as *const __m256i)
                    });
                    for (r, x) in xs.iter().enumerate() {
                        let s = x.sums.as_ptr().add(16 * b);
                        let mut mins = _mm256_setzero_si256();
                        for jp in 0..4 {
                            let b0 = *s.add(4 * jp) + *s.add(4 * jp + 1);
                            let b1 = *s.add(4 * jp + 2) + *s.add(4 * jp + 3);
                            let bs = _mm256_set1_epi32((b0 & 0xFFFF) | (b1 << 16));
                            mins = _mm256_add_epi32(mins, _mm256_madd_epi16(mv[jp], bs));
                        }
                        let dx = _mm256_set1_ps(*x.d.get_unchecked(b));
                        let t1 = _mm256_mul_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(*isum.get_unchecked(r)));
                        let t2 = _mm256_mul_ps(_mm256_mul_ps(dmin, dx), _mm256_cvtepi32_ps(mins));
                        let a = acc.get_unchecked_mut(r).as_mut_ptr();
                        _mm256_storeu_ps(a, _mm256_add_ps(_mm256_loadu_ps(a), _mm256_sub_ps(t1, t2)));
                    }
                }
            }
    };
}
