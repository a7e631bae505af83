//! What every kernel of one instruction set shares: the byte dot products (`vpmaddubsw`
//! pairs or VNNI `vpdpbusd`), horizontal sums, the 32-block unpacking, prefetch and the
//! 8x8 transpose of the eight-row kernels. Expanded inside each instruction set's module
//! by `kernels!` (the parent file).

macro_rules! common {
    ($feat:literal, $vnni:literal) => {
            /// Unsigned bytes `u` times signed bytes `x`, four neighbours summed into
            /// each int32 lane.
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn idot(u: __m256i, x: __m256i) -> __m256i {
                if $vnni {
                    _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x)
                } else {
                    _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1))
                }
            }

            /// [`idot`] with elements 0..16 times `s.0`, 16..32 times `s.1` (integer
            /// scales, as the register [`scales`] builds).
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn sdot(u: __m256i, x: __m256i, s: __m256i) -> __m256i {
                if $vnni {
                    _mm256_mullo_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x), s)
                } else {
                    _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), s)
                }
            }

            /// The scale register [`sdot`] takes: `lo` for elements 0..16, `hi` after.
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn scales(lo: i32, hi: i32) -> __m256i {
                if $vnni {
                    _mm256_set_m128i(_mm_set1_epi32(hi), _mm_set1_epi32(lo))
                } else {
                    _mm256_set_m128i(_mm_set1_epi16(hi as i16), _mm_set1_epi16(lo as i16))
                }
            }

            /// `acc` plus int16 pairs `p` times int16 `s`, pair sums into int32 lanes
            /// (`vpdpwssd` on VNNI, `vpmaddwd` and an add else).
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn wdot(acc: __m256i, p: __m256i, s: __m256i) -> __m256i {
                if $vnni {
                    _mm256_dpwssd_epi32(acc, p, s)
                } else {
                    _mm256_add_epi32(acc, _mm256_madd_epi16(p, s))
                }
            }

            /// A Q4_K / Q5_K super-block's eight 6-bit scales (bytes 0..8) and mins
            /// (8..16), repeated in both 128-bit halves, unpacked from the 12 packed bytes
            /// in registers (`blocks::scale_min_k4` for all eight at once): scales 0..4 and
            /// mins 0..4 are the low six bits of bytes 0..4 and 4..8; scales 4..8 take
            /// the low nibbles of bytes 8..12 with the top two bits of bytes 0..4 above
            /// them, mins 4..8 the high nibbles with the top bits of bytes 4..8.
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn k4_scale_mins(blk: *const u8) -> __m256i {
                // Bytes 4..20 of the block: the 12 packed bytes and 4 of the quants after.
                let q = _mm_loadu_si128(blk.add(4) as *const __m128i);
                let a = _mm_shuffle_epi8(q, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
                let lo = _mm_or_si128(
                    _mm_and_si128(a, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0)),
                    _mm_and_si128(
                        _mm_srli_epi16::<4>(a),
                        _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15),
                    ),
                );
                let t = _mm_shuffle_epi8(q, _mm_setr_epi8(-128, -128, -128, -128, 0, 1, 2, 3, -128, -128, -128, -128, 4, 5, 6, 7));
                // Bits 6..8 of each byte to 4..6 (the 16-bit shift's spill from the byte
                // above lands in bits 6..8, masked off).
                let top = _mm_and_si128(_mm_srli_epi16::<2>(t), _mm_set1_epi8(0x30));
                _mm256_broadcastsi128_si256(_mm_or_si128(lo, top))
            }

            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn hsum_i32(v: __m256i) -> i32 {
                let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
                let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
                let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
                _mm_cvtsi128_si32(s)
            }

            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn hsum_ps(v: __m256) -> f32 {
                let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
                let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
                let s = _mm_add_ss(s, _mm_movehdup_ps(s));
                _mm_cvtss_f32(s)
            }

            /// The float16 at `p` (F16C's conversion, exact like `blocks::rd_f16`).
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn h2f(p: *const u8) -> f32 {
                let h = (p as *const u16).read_unaligned();
                _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
            }

            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn ld(p: *const u8) -> __m256i {
                _mm256_loadu_si256(p as *const __m256i)
            }

            /// 32 bits as 32 bytes: `0xFF` where bit `i` is set (llama.cpp's
            /// `bytes_from_bits_32`): each byte picks its bit's byte, ORs in every other
            /// bit and tests for all ones.
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn bits_to_bytes(bits: u32) -> __m256i {
                let v = _mm256_shuffle_epi8(
                    _mm256_set1_epi32(bits as i32),
                    _mm256_setr_epi64x(0, 0x0101_0101_0101_0101, 0x0202_0202_0202_0202, 0x0303_0303_0303_0303),
                );
                let v = _mm256_or_si256(v, _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe));
                _mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1))
            }

            /// A 32-weight block at `blk` as unsigned bytes in weight order, the weight
            /// being `u - off32::<KIND>()` times the block's scale: Q8_0 on VNNI flips
            /// the sign bit (`w + 128`), Q4_0 / Q5_0 keep their stored `q`; Q5_1 is
            /// unsigned already. On AVX2, Q8_0 stays signed (`vpmaddubsw` would saturate
            /// on `w + 128`): [`bdot`] takes the sign trick there.
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn unpack32<const KIND: u8>(blk: *const u8) -> __m256i {
                let m4 = _mm256_set1_epi8(0x0F);
                // The nibbles of the 16 bytes at `p`: low ones first, then high.
                macro_rules! nib {
                    ($p:expr) => {{
                        let q = _mm_loadu_si128($p as *const __m128i);
                        _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(q), q), m4)
                    }};
                }
                // The fifth bits (a u32 at `p`) as 0x10 bytes.
                macro_rules! fifth {
                    ($p:expr) => {
                        _mm256_and_si256(bits_to_bytes(($p as *const u32).read_unaligned()), _mm256_set1_epi8(0x10))
                    };
                }
                match KIND {
                    Q8_0 if $vnni => _mm256_xor_si256(ld(blk.add(2)), _mm256_set1_epi8(-128)),
                    Q8_0 => ld(blk.add(2)),
                    Q4_0 => nib!(blk.add(2)),
                    Q5_0 => _mm256_or_si256(nib!(blk.add(6)), fifth!(blk.add(2))),
                    _ => _mm256_or_si256(nib!(blk.add(8)), fifth!(blk.add(4))),
                }
            }

            /// The offset [`unpack32`]'s bytes carry (`OFF` times the activation block's
            /// sum comes off the integer dot product).
            const fn off32<const KIND: u8>() -> i32 {
                match KIND {
                    Q8_0 if $vnni => 128,
                    Q4_0 => 8,
                    Q5_0 => 16,
                    _ => 0,
                }
            }

            /// [`idot`] of unpacked weight bytes `u` ([`unpack32`]) and activation bytes.
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn bdot<const KIND: u8>(u: __m256i, x: __m256i) -> __m256i {
                if KIND == Q8_0 && !$vnni {
                    idot(_mm256_abs_epi8(u), _mm256_sign_epi8(x, u))
                } else {
                    idot(u, x)
                }
            }

            /// Eight float16 bit patterns in a register, built in registers: a 128-bit
            /// load over eight 16-bit stores would wait for them (no store forwarding).
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn halves(h: &[u16; 8]) -> __m128i {
                let w = |i: usize| h[i] as i64 | (h[i + 1] as i64) << 16 | (h[i + 2] as i64) << 32 | (h[i + 3] as i64) << 48;
                let (lo, hi) = (w(0), w(4));
                _mm_set_epi64x(hi, lo)
            }

            /// Asks for the cache lines of `len` bytes from `p` (may lie past the weight:
            /// a prefetch does not fault). One weight row streams from memory: the
            /// hardware prefetcher alone keeps too few lines in flight for a kernel
            /// that spends tens of cycles on each.
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn prefetch(p: *const u8, len: usize) {
                let mut o = 0;
                while o < len {
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(o) as *const i8);
                    o += 64;
                }
            }

            /// Lane `i`: the sum of `p[i]`'s eight lanes (integers: exact in any order).
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn sum8(p: &[__m256i; 8]) -> __m256i {
                macro_rules! pair {
                    ($a:expr, $b:expr) => {
                        _mm256_add_epi32(_mm256_unpacklo_epi32($a, $b), _mm256_unpackhi_epi32($a, $b))
                    };
                }
                macro_rules! quad {
                    ($a:expr, $b:expr) => {
                        _mm256_add_epi32(_mm256_unpacklo_epi64($a, $b), _mm256_unpackhi_epi64($a, $b))
                    };
                }
                let r0 = quad!(pair!(p[0], p[1]), pair!(p[2], p[3]));
                let r1 = quad!(pair!(p[4], p[5]), pair!(p[6], p[7]));
                _mm256_add_epi32(_mm256_permute2x128_si256::<0x20>(r0, r1), _mm256_permute2x128_si256::<0x31>(r0, r1))
            }

            /// `acc + ` [`idot`]`(u, x)`.
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn idot_acc(acc: __m256i, u: __m256i, x: __m256i) -> __m256i {
                if $vnni {
                    _mm256_dpbusd_epi32(acc, u, x)
                } else {
                    _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)))
                }
            }

            /// An 8 x 8 transpose of 32-bit lanes: `out[q]` lane `i` is `r[i]` lane `q`.
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn transpose8(r: &[__m256i; 8]) -> [__m256i; 8] {
                let t0 = _mm256_unpacklo_epi32(r[0], r[1]);
                let t1 = _mm256_unpackhi_epi32(r[0], r[1]);
                let t2 = _mm256_unpacklo_epi32(r[2], r[3]);
                let t3 = _mm256_unpackhi_epi32(r[2], r[3]);
                let t4 = _mm256_unpacklo_epi32(r[4], r[5]);
                let t5 = _mm256_unpackhi_epi32(r[4], r[5]);
                let t6 = _mm256_unpacklo_epi32(r[6], r[7]);
                let t7 = _mm256_unpackhi_epi32(r[6], r[7]);
                let u0 = _mm256_unpacklo_epi64(t0, t2);
                let u1 = _mm256_unpackhi_epi64(t0, t2);
                let u2 = _mm256_unpacklo_epi64(t1, t3);
                let u3 = _mm256_unpackhi_epi64(t1, t3);
                let u4 = _mm256_unpacklo_epi64(t4, t6);
                let u5 = _mm256_unpackhi_epi64(t4, t6);
                let u6 = _mm256_unpacklo_epi64(t5, t7);
                let u7 = _mm256_unpackhi_epi64(t5, t7);
                [
                    _mm256_permute2x128_si256::<0x20>(u0, u4),
                    _mm256_permute2x128_si256::<0x20>(u1, u5),
                    _mm256_permute2x128_si256::<0x20>(u2, u6),
                    _mm256_permute2x128_si256::<0x20>(u3, u7),
                    _mm256_permute2x128_si256::<0x31>(u0, u4),
                    _mm256_permute2x128_si256::<0x31>(u1, u5),
                    _mm256_permute2x128_si256::<0x31>(u2, u6),
                    _mm256_permute2x128_si256::<0x31>(u3, u7),
                ]
            }
    };
}
