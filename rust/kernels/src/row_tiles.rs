//! What the two dot-product few-row GEMMs share: `matmul_rows` (float32) and
//! `matmul_bf16` both multiply rows of `x` by weight rows stored `[out, in]`, a
//! register tile of `R` input rows by `C` weight rows at a time, and differ only in
//! how 8 or 16 keys are loaded and multiplied. Here: the lane reductions both use and
//! the AVX2 tile, generic over the element (a float32 load, or bfloat16 widened to
//! float32 by a shift), so that both keep one key order and one prefetch cadence.

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use crate::bf16::Elem;
    use std::arch::x86_64::*;

    /// An element the AVX2 tile can load 8 of as float32.
    pub(crate) trait Load8: Elem {
        /// Elements per 64-byte cache line (the prefetch cadence).
        const PER_LINE: usize;
        /// # Safety
        /// 8 elements must be readable at `p`; the CPU must have AVX2.
        unsafe fn load8(p: *const Self) -> __m256;
    }

    impl Load8 for f32 {
        const PER_LINE: usize = 16;
        #[inline(always)]
        unsafe fn load8(p: *const f32) -> __m256 {
            _mm256_loadu_ps(p)
        }
    }

    impl Load8 for u16 {
        const PER_LINE: usize = 32;
        /// 8 bfloat16 widened to float32 (a bfloat16 is a float32's top half).
        #[inline(always)]
        unsafe fn load8(p: *const u16) -> __m256 {
            let h = _mm_loadu_si128(p as *const __m128i);
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        }
    }

    /// The sum of the 8 lanes.
    ///
    /// # Safety
    /// The CPU must have AVX.
    #[inline(always)]
    pub(crate) unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }

    /// The lane sums of four accumulators at once: `[sum a, sum b, sum c, sum d]`,
    /// each in the same order whatever the other three hold. Interleaving them first
    /// takes 9 shuffles and adds instead of 4 x 7: at `K = 1,024` a tile has only a few
    /// dozen steps, and separate reductions cost a fifth of it.
    ///
    /// # Safety
    /// The CPU must have AVX-512F.
    #[inline(always)]
    unsafe fn reduce4(a: __m512, b: __m512, c: __m512, d: __m512) -> __m128 {
        // Per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3], the same for c, d.
        let ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
        let cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
        // Per 128-bit lane: [a, b, c, d] summed over that lane's four elements.
        let abcd = _mm512_add_ps(
            _mm512_shuffle_ps::<0x44>(ab, cd),
            _mm512_shuffle_ps::<0xEE>(ab, cd),
        );
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(abcd)));
        let s = _mm256_add_ps(_mm512_castps512_ps256(abcd), hi);
        _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s))
    }

    /// An AVX-512 tile's result: each accumulator's lane sum, four at a time
    /// ([`reduce4`]); rows `R..MR` zero. `C` must be a multiple of 4.
    ///
    /// # Safety
    /// The CPU must have AVX-512F.
    #[inline(always)]
    pub(crate) unsafe fn lane_sums<const MR: usize, const R: usize, const C: usize>(
        acc: &[[__m512; C]; R],
    ) -> [[f32; C]; MR] {
        let mut tile = [[0.0f32; C]; MR];
        for i in 0..R {
            for c in (0..C).step_by(4) {
                let s = reduce4(acc[i][c], acc[i][c + 1], acc[i][c + 2], acc[i][c + 3]);
                _mm_storeu_ps(tile[i].as_mut_ptr().add(c), s);
            }
        }
        tile
    }

    /// `R` rows of `x` against the `C` weight rows over all `k`: 8 keys per step, the
    /// weight rows loaded once per step and shared by the `R` rows; the last `k % 8`
    /// keys in plain arithmetic. `next` (unless null): the `C k` elements to prefetch
    /// into L2, one line per weight row every `PER_LINE / 8` steps. Rows `R..MR` of the
    /// result are zero.
    ///
    /// # Safety
    /// `xs[..R]` and `ws` must each point at `k` readable elements; the CPU must have
    /// AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn avx2_tile<T: Load8, const MR: usize, const R: usize, const C: usize>(
        xs: &[*const T; MR],
        ws: &[*const T; C],
        k: usize,
        next: *const T,
    ) -> [[f32; C]; MR] {
        let mut acc = [[_mm256_setzero_ps(); C]; R];
        let mut kk = 0;
        while kk + 8 <= k {
            if !next.is_null() && kk % T::PER_LINE == 0 {
                for c in 0..C {
                    _mm_prefetch::<_MM_HINT_T1>(next.wrapping_add(C * kk + T::PER_LINE * c) as *const i8);
                }
            }
            let wv: [__m256; C] = std::array::from_fn(|c| T::load8(ws[c].add(kk)));
            for i in 0..R {
                let xv = T::load8(xs[i].add(kk));
                for c in 0..C {
                    acc[i][c] = _mm256_fmadd_ps(xv, wv[c], acc[i][c]);
                }
            }
            kk += 8;
        }
        let mut tile = [[0.0f32; C]; MR];
        for i in 0..R {
            for c in 0..C {
                let mut s = hsum(acc[i][c]);
                for t in kk..k {
                    s += (*xs[i].add(t)).get() * (*ws[c].add(t)).get();
                }
                tile[i][c] = s;
            }
        }
        tile
    }
}
