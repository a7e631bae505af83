//! bfloat16 as the kernels see it: `u16` bit patterns (numpy has no bfloat16 dtype;
//! Python passes `tensor.view(torch.uint16)`), widened to `f32` for arithmetic and
//! rounded back the way torch rounds (`c10::BFloat16`: to nearest, ties to even,
//! NaN kept a quiet NaN), so a kernel's bfloat16 output is bit-equal to torch's cast
//! of the same float32 value.
//!
//! Which instructions a bfloat16 kernel may use is decided once per process
//! ([`Isa::detect`]): AVX-512 BF16 (`vdpbf16ps`: two bfloat16 products per float32
//! lane, summed in float32) where the CPU has it, AVX2+FMA on widened values
//! otherwise, plain Rust elsewhere.

/// `b` widened to `f32` (exact: a bfloat16 is the top half of a float32).
#[inline(always)]
pub fn to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// `x` rounded to the nearest bfloat16, ties to even (torch's rounding).
#[inline(always)]
pub fn from_f32(x: f32) -> u16 {
    let bits = x.to_bits();
    let bias = 0x7fff + ((bits >> 16) & 1);
    let rounded = (bits.wrapping_add(bias) >> 16) as u16;
    // A select, not an early return: loops that round stay vectorisable.
    if x.is_nan() {
        0x7fc0
    } else {
        rounded
    }
}

/// An element a kernel reads and writes: `f32`, or `u16` holding bfloat16 bits.
/// Kernels generic over it compute in float32 either way.
pub trait Elem: Copy + Send + Sync + 'static {
    /// `src` as float32: `src` itself for `f32` (no copy), widened into `buf` (at least
    /// `src.len()` long) for bfloat16.
    fn widen<'b>(src: &'b [Self], buf: &'b mut [f32]) -> &'b [f32];
    /// `v` stored as `Self` (rounded to nearest even for bfloat16).
    fn narrow(v: f32) -> Self;
    /// One element as float32 (exact).
    fn get(self) -> f32;
    /// `v` rounded to what `Self` can hold, as float32: where HF's bfloat16 run rounds
    /// an intermediate, a kernel generic over `Elem` calls this (identity for `f32`).
    #[inline(always)]
    fn round(v: f32) -> f32 {
        Self::narrow(v).get()
    }
    /// `a . b` in float32, as the type's kernels take a single dot product (the
    /// shared expert's gate): float32 by [`crate::math::dot`] (eight lanes);
    /// bfloat16 widened products summed in index order (the bfloat16 block's
    /// transcription of HF's one-output linear).
    fn dot(a: &[Self], b: &[Self]) -> f32;
    /// Scratch for [`Elem::widen`]: `n` floats for bfloat16, none for `f32` (read in place).
    #[inline(always)]
    fn scratch(n: usize) -> Vec<f32> {
        vec![0.0; if std::mem::size_of::<Self>() == 4 { 0 } else { n }]
    }
}

impl Elem for f32 {
    #[inline(always)]
    fn widen<'b>(src: &'b [f32], _buf: &'b mut [f32]) -> &'b [f32] {
        src
    }
    #[inline(always)]
    fn narrow(v: f32) -> f32 {
        v
    }
    #[inline(always)]
    fn get(self) -> f32 {
        self
    }
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        crate::math::dot(a, b)
    }
}

impl Elem for u16 {
    #[inline(always)]
    fn widen<'b>(src: &'b [u16], buf: &'b mut [f32]) -> &'b [f32] {
        let buf = &mut buf[..src.len()];
        for (b, &s) in buf.iter_mut().zip(src) {
            *b = to_f32(s);
        }
        buf
    }
    #[inline(always)]
    fn narrow(v: f32) -> u16 {
        from_f32(v)
    }
    #[inline(always)]
    fn get(self) -> f32 {
        to_f32(self)
    }
    fn dot(a: &[u16], b: &[u16]) -> f32 {
        a.iter().zip(b).map(|(&x, &y)| to_f32(x) * to_f32(y)).sum()
    }
}

/// The instruction set a bfloat16 kernel runs with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512F/BW plus AVX-512 BF16 (`vdpbf16ps`).
    Avx512Bf16,
    /// AVX2 + FMA on bfloat16 widened to float32 by a 16-bit shift.
    Avx2,
    /// Plain Rust (any CPU).
    Scalar,
}

impl Isa {
    /// The best this CPU supports (checked once per process).
    pub fn detect() -> Isa {
        use std::sync::OnceLock;
        static ISA: OnceLock<Isa> = OnceLock::new();
        *ISA.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                if std::is_x86_feature_detected!("avx512f")
                    && std::is_x86_feature_detected!("avx512bw")
                    && std::is_x86_feature_detected!("avx512bf16")
                {
                    return Isa::Avx512Bf16;
                }
                if crate::math::has_avx2() {
                    return Isa::Avx2;
                }
            }
            Isa::Scalar
        })
    }

    /// True when this CPU can run kernels compiled for `self`.
    pub fn supported(self) -> bool {
        match self {
            Isa::Scalar => true,
            Isa::Avx2 => cfg!(target_arch = "x86_64") && Isa::detect() != Isa::Scalar,
            Isa::Avx512Bf16 => Isa::detect() == Isa::Avx512Bf16,
        }
    }

    /// `"avx512_bf16"`, `"avx2"` or `"scalar"` (reported by benches).
    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx512Bf16 => "avx512_bf16",
            Isa::Avx2 => "avx2",
            Isa::Scalar => "scalar",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_is_to_nearest_even_and_widening_is_exact() {
        // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: ties go to the even (1.0).
        assert_eq!(from_f32(1.0 + 2f32.powi(-8)), 0x3f80);
        // 1 + 3 * 2^-8 lies halfway between 1 + 2^-7 (odd) and 1 + 2^-6: up.
        assert_eq!(from_f32(1.0 + 3.0 * 2f32.powi(-8)), 0x3f82);
        // Just above the halfway point rounds up.
        assert_eq!(from_f32(f32::from_bits(0x3f80_8001)), 0x3f81);
        assert_eq!(from_f32(-2.5), 0xc020);
        assert_eq!(from_f32(f32::INFINITY), 0x7f80);
        assert!(to_f32(from_f32(f32::NAN)).is_nan());
        for b in [0u16, 0x3f80, 0xbf80, 0x7f7f, 0x0001, 0x4049] {
            assert_eq!(from_f32(to_f32(b)), b);
        }
    }
}
