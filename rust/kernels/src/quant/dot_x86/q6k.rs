//! Q6_K: eight weight rows against many activation rows, one against many, and one
//! against a few.

macro_rules! q6k_kernels {
    ($feat:literal, $vnni:literal) => {
            /// Eight Q6_K weight rows against any number of activation rows, laid out
            /// as [`q4k_q5k_x8`]; the offset term by int16 pairs (`vpmaddwd`). Equal to
            /// [`q6k`] bit for bit.
            #[target_feature(enable = $feat)]
            pub unsafe fn q6k_x8(w: *const u8, rb: usize, nb: usize, xs: &[ActRow<'_>], acc: &mut [[f32; 8]]) {
                let m4 = _mm256_set1_epi8(0x0F);
                let m2 = _mm256_set1_epi8(0x30);
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
                    let mut v = [[_mm256_setzero_si256(); 8]; 8];
                    // Scales widened per row (row i: scales 0..8, 8..16), then transposed:
                    // `sc[gi]` lane i is row i's scale gi.
                    let (mut slo, mut shi) = ([_mm256_setzero_si256(); 8], [_mm256_setzero_si256(); 8]);
                    let mut dh = [0u16; 8];
                    for i in 0..8 {
                        let blk = w.add(i * rb + b * 210);
                        dh[i] = (blk.add(208) as *const u16).read_unaligned();
                        let s16 = _mm_loadu_si128(blk.add(192) as *const __m128i);
                        slo[i] = _mm256_cvtepi8_epi32(s16);
                        shi[i] = _mm256_cvtepi8_epi32(_mm_srli_si128::<8>(s16));
                        for h in 0..2 {
                            let a = ld(blk.add(64 * h));
                            let bq = ld(blk.add(64 * h + 32));
                            let qh = ld(blk.add(128 + 32 * h));
                            v[4 * h][i] =
                                _mm256_or_si256(_mm256_and_si256(a, m4), _mm256_and_si256(_mm256_slli_epi16::<4>(qh), m2));
                            v[4 * h + 1][i] =
                                _mm256_or_si256(_mm256_and_si256(bq, m4), _mm256_and_si256(_mm256_slli_epi16::<2>(qh), m2));
                            v[4 * h + 2][i] = _mm256_or_si256(
                                _mm256_and_si256(_mm256_srli_epi16::<4>(a), m4),
                                _mm256_and_si256(qh, m2),
                            );
                            v[4 * h + 3][i] = _mm256_or_si256(
                                _mm256_and_si256(_mm256_srli_epi16::<4>(bq), m4),
                                _mm256_and_si256(_mm256_srli_epi16::<2>(qh), m2),
                            );
                        }
                    }
                    for vg in v.iter_mut() {
                        *vg = transpose8(vg);
                    }
                    let (tlo, thi) = (transpose8(&slo), transpose8(&shi));
                    macro_rules! sc {
                        ($gi:expr) => {{
                            let gi: usize = $gi;
                            if gi < 8 {
                                tlo[gi]
                            } else {
                                thi[gi - 8]
                            }
                        }};
                    }
                    for s in isum.iter_mut() {
                        *s = _mm256_setzero_si256();
                    }
                    for g in 0..8 {
                        let vg = &v[g];
                        let (s0, s1) = (sc!(2 * g), sc!(2 * g + 1));
                        for (r, x) in xs.iter().enumerate() {
                            let xp = x.qs.as_ptr().add(256 * b + 32 * g) as *const i32;
                            let (mut p0, mut p1) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                            for q in 0..4 {
                                p0 = idot_acc(p0, vg[q], _mm256_set1_epi32(xp.add(q).read_unaligned()));
                                p1 = idot_acc(p1, vg[q + 4], _mm256_set1_epi32(xp.add(q + 4).read_unaligned()));
                            }
                            let s = isum.get_unchecked_mut(r);
                            *s = _mm256_add_epi32(*s, _mm256_add_epi32(_mm256_mullo_epi32(p0, s0), _mm256_mullo_epi32(p1, s1)));
                        }
                    }
                    let d = _mm256_cvtph_ps(halves(&dh));
                    // Scales (int8) and 16-sums (at most 16 x 127 in size) fit int16: pairs
                    // (2k, 2k + 1) in one int32 lane each, for `vpmaddwd`.
                    let lo16 = _mm256_set1_epi32(0xFFFF);
                    let mut sp = [_mm256_setzero_si256(); 8];
                    for (k, spk) in sp.iter_mut().enumerate() {
                        *spk = _mm256_or_si256(_mm256_and_si256(sc!(2 * k), lo16), _mm256_slli_epi32::<16>(sc!(2 * k + 1)));
                    }
                    for (r, x) in xs.iter().enumerate() {
                        let s = x.sums.as_ptr().add(16 * b);
                        // The sixteen sums as int16 pairs: `vpackssdw` packs within 128-bit
                        // halves, the permute puts the pairs back in order.
                        let pk = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi32(
                            _mm256_loadu_si256(s as *const __m256i),
                            _mm256_loadu_si256(s.add(8) as *const __m256i),
                        ));
                        let mut off = _mm256_setzero_si256();
                        for (k, spk) in sp.iter().enumerate() {
                            let bs = _mm256_permutevar8x32_epi32(pk, _mm256_set1_epi32(k as i32));
                            off = _mm256_add_epi32(off, _mm256_madd_epi16(*spk, bs));
                        }
                        let v = _mm256_sub_epi32(*isum.get_unchecked(r), _mm256_slli_epi32::<5>(off));
                        let dx = _mm256_set1_ps(*x.d.get_unchecked(b));
                        let t = _mm256_mul_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(v));
                        let a = acc.get_unchecked_mut(r).as_mut_ptr();
                        _mm256_storeu_ps(a, _mm256_add_ps(_mm256_loadu_ps(a), t));
                    }
                }
            }

            /// [`q6k`] for any number of activation rows, each super-block unpacked
            /// once (as [`q4k_q5k_many`]); equal to [`q6k`] bit for bit.
            #[target_feature(enable = $feat)]
            pub unsafe fn q6k_many(w: *const u8, nb: usize, xs: &[ActRow<'_>], acc: &mut [f32]) {
                let m4 = _mm256_set1_epi8(0x0F);
                let m2 = _mm256_set1_epi8(0x30);
                for b in 0..nb {
                    let blk = w.add(b * 210);
                    let sc = std::slice::from_raw_parts(blk.add(192), 16);
                    let d = h2f(blk.add(208));
                    let mut u = [_mm256_setzero_si256(); 8];
                    let mut s = [_mm256_setzero_si256(); 8];
                    for h in 0..2 {
                        let a = ld(blk.add(64 * h));
                        let bq = ld(blk.add(64 * h + 32));
                        let qh = ld(blk.add(128 + 32 * h));
                        u[4 * h] = _mm256_or_si256(_mm256_and_si256(a, m4), _mm256_and_si256(_mm256_slli_epi16::<4>(qh), m2));
                        u[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(bq, m4), _mm256_and_si256(_mm256_slli_epi16::<2>(qh), m2));
                        u[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(a), m4), _mm256_and_si256(qh, m2));
                        u[4 * h + 3] = _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16::<4>(bq), m4),
                            _mm256_and_si256(_mm256_srli_epi16::<2>(qh), m2),
                        );
                    }
                    for g in 0..8 {
                        s[g] = scales(sc[2 * g] as i8 as i32, sc[2 * g + 1] as i8 as i32);
                    }
                    let sc_lo = _mm256_cvtepi8_epi32(_mm_loadl_epi64(sc.as_ptr() as *const __m128i));
                    let sc_hi = _mm256_cvtepi8_epi32(_mm_loadl_epi64(sc.as_ptr().add(8) as *const __m128i));
                    for (r, x) in xs.iter().enumerate() {
                        let xp = x.qs.as_ptr().add(256 * b) as *const u8;
                        let mut i0 = sdot(u[0], ld(xp), s[0]);
                        let mut i1 = sdot(u[1], ld(xp.add(32)), s[1]);
                        for g in (2..8).step_by(2) {
                            i0 = _mm256_add_epi32(i0, sdot(u[g], ld(xp.add(32 * g)), s[g]));
                            i1 = _mm256_add_epi32(i1, sdot(u[g + 1], ld(xp.add(32 * g + 32)), s[g + 1]));
                        }
                        let sp = x.sums.as_ptr().add(16 * b);
                        let off = _mm256_add_epi32(
                            _mm256_mullo_epi32(sc_lo, _mm256_loadu_si256(sp as *const __m256i)),
                            _mm256_mullo_epi32(sc_hi, _mm256_loadu_si256(sp.add(8) as *const __m256i)),
                        );
                        let v = _mm256_sub_epi32(_mm256_add_epi32(i0, i1), _mm256_slli_epi32::<5>(off));
                        let a = acc.get_unchecked_mut(r);
                        *a += d * *x.d.get_unchecked(b) * hsum_i32(v) as f32;
                    }
                }
            }

            /// A Q6_K half's four groups of 32 six-bit values from its 32 + 32 low-nibble
            /// bytes `a`, `bq` and 32 high-bit bytes `qh`. With AVX-512VL one ternary-logic
            /// instruction takes "low nibble of one, bits 4..6 of the other, zero above".
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn q6_groups(a: __m256i, bq: __m256i, qh: __m256i) -> [__m256i; 4] {
                let m4 = _mm256_set1_epi8(0x0F);
                let m2 = _mm256_set1_epi8(0x30);
                if $vnni {
                    // `m4 ? lo : hi` bitwise (truth table 0xD8 on (hi, lo, m4)), then the
                    // two bits above the six cleared.
                    let m6 = _mm256_set1_epi8(0x3F);
                    macro_rules! sel {
                        ($lo:expr, $hi:expr) => {
                            _mm256_and_si256(_mm256_ternarylogic_epi32::<0xD8>($hi, $lo, m4), m6)
                        };
                    }
                    let _ = m2;
                    [
                        sel!(a, _mm256_slli_epi16::<4>(qh)),
                        sel!(bq, _mm256_slli_epi16::<2>(qh)),
                        sel!(_mm256_srli_epi16::<4>(a), qh),
                        sel!(_mm256_srli_epi16::<4>(bq), _mm256_srli_epi16::<2>(qh)),
                    ]
                } else {
                    [
                        _mm256_or_si256(_mm256_and_si256(a, m4), _mm256_and_si256(_mm256_slli_epi16::<4>(qh), m2)),
                        _mm256_or_si256(_mm256_and_si256(bq, m4), _mm256_and_si256(_mm256_slli_epi16::<2>(qh), m2)),
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(a), m4), _mm256_and_si256(qh, m2)),
                        _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16::<4>(bq), m4),
                            _mm256_and_si256(_mm256_srli_epi16::<2>(qh), m2),
                        ),
                    ]
                }
            }

            /// Q6_K weights, one weight row against `R` activation rows. The sixteen
            /// scales widened to int16 once per super-block, a group's pair of them one
            /// byte shuffle; the products `vpmaddubsw` pairs (at most 2 x 63 x 127) times
            /// the scale into int32 (`vpdpwssd` on VNNI); the offset `32 sum_g sc_g sums_g`
            /// one `vpmaddwd` of the packed 16-sums. Exact integer sums, the float steps of
            /// [`super::super::dot_scalar`]: equal bit for bit.
            #[inline]
            #[target_feature(enable = $feat)]
            pub unsafe fn q6k<const R: usize>(w: *const u8, nb: usize, xs: &[ActRow<'_>; R]) -> [f32; R] {
                let mut out = [0.0f32; R];
                q6k_rows::<R>(w, 0, 1, nb, xs, &mut out);
                out
            }

            /// [`q6k`] for `n` consecutive weight rows (`rb` bytes apart) in one call:
            /// `out[R j + r]` = weight row `j` times activation row `r`. The body is here and
            /// [`q6k`] calls it with `n = 1` (as [`q32_rows`]).
            #[target_feature(enable = $feat)]
            pub unsafe fn q6k_rows<const R: usize>(
                w0: *const u8,
                rb: usize,
                n: usize,
                nb: usize,
                xs: &[ActRow<'_>; R],
                out: &mut [f32],
            ) {
                // Group k of a half: int16 scale 2k of the half's eight in the low 128 bits
                // (elements 0..16), 2k + 1 in the high (16..32).
                let pick = |k: i32| {
                    let (a, b) = ((4 * k) as i8, (4 * k + 2) as i8);
                    _mm256_setr_epi8(
                        a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, //
                        b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1,
                    )
                };
                let picks = [pick(0), pick(1), pick(2), pick(3)];
                let pf = super::pf_dist();
                for row in 0..n {
                    let w = w0.add(row * rb);
                    let mut acc = [0.0f32; R];
                    for b in 0..nb {
                        let blk = w.add(b * 210);
                        prefetch(blk.wrapping_add(pf), 210);
                        let d = h2f(blk.add(208));
                        // Scales as int16: [0..8 | 8..16].
                        let sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(blk.add(192) as *const __m128i));
                        let mut isum = [_mm256_setzero_si256(); R];
                        for h in 0..2 {
                            let a = ld(blk.add(64 * h));
                            let bq = ld(blk.add(64 * h + 32));
                            let qh = ld(blk.add(128 + 32 * h));
                            let groups = q6_groups(a, bq, qh);
                            // The half's eight scales in both 128-bit halves.
                            let sch = if h == 0 {
                                _mm256_permute2x128_si256::<0x00>(sc, sc)
                            } else {
                                _mm256_permute2x128_si256::<0x11>(sc, sc)
                            };
                            for (k, &u) in groups.iter().enumerate() {
                                let g = 4 * h + k;
                                let s = _mm256_shuffle_epi8(sch, picks[k]);
                                for r in 0..R {
                                    let x = ld(xs[r].qs.as_ptr().add(256 * b + 32 * g) as *const u8);
                                    isum[r] = wdot(isum[r], _mm256_maddubs_epi16(u, x), s);
                                }
                            }
                        }
                        // Scales in the order `vpackssdw` leaves the 16-sums: [0..4, 8..12 | 4..8, 12..16].
                        let scp = _mm256_permute4x64_epi64::<0b11_01_10_00>(sc);
                        for r in 0..R {
                            let s = xs[r].sums.as_ptr().add(16 * b);
                            let s16 = _mm256_packs_epi32(
                                _mm256_loadu_si256(s as *const __m256i),
                                _mm256_loadu_si256(s.add(8) as *const __m256i),
                            );
                            let off = _mm256_madd_epi16(s16, scp);
                            let v = _mm256_sub_epi32(isum[r], _mm256_slli_epi32::<5>(off));
                            acc[r] += d * *xs[r].d.get_unchecked(b) * hsum_i32(v) as f32;
                        }
                    }
                    out[R * row..R * row + R].copy_from_slice(&acc);
                }
            }
    };
}
