//! The dot products on x86: one weight row against `R` quantized activation rows, the
//! weight's blocks unpacked once into bytes and reused for every row. All formats come
//! down to unsigned weight bytes times signed int8 activations, 32 at a time:
//!
//! * AVX2: `vpmaddubsw` (pairs into int16; no saturation: at most 2 x 127 x 127) and
//!   `vpmaddwd` (pairs into int32, times a sub-block's integer scale on the k-quants);
//! * AVX-512 VNNI: `vpdpbusd` (four products into int32 in one instruction) on 256-bit
//!   registers, whose width this AMD core runs at full rate (it splits 512-bit ones),
//!   then the integer scale by `vpmulld`.
//!
//! Q8_0, Q4_0 and Q5_0 weights are signed: llama.cpp's sign trick (`|w|` times `x` with
//! `w`'s sign) makes them unsigned; Q5_1 is unsigned with a min. Q4_K / Q5_K store `q >= 0` with a min, Q6_K `q + 32`:
//! their mins and offsets are taken from the activation's 16-sums ([`super::act`]).
//! The k-quants' integer sum of a super-block is exact and its float steps those of
//! [`super::dot_scalar`], so the three paths agree bit for bit there; the 32-weight blocks
//! accumulate per block in float32 lanes (rounding order differs from the scalar sum).

use super::act::ActRow;

/// `KIND`s of the 32-weight block kernel `q32`.
pub const Q8_0: u8 = 0;
pub const Q4_0: u8 = 1;
pub const Q5_0: u8 = 2;
pub const Q5_1: u8 = 3;

use std::sync::atomic::{AtomicUsize, Ordering};

/// Bytes ahead of the weight being read that the one-row kernels prefetch, and ahead
/// in each of the eight weight rows the many-row kernels read at once (atomics only
/// so that the timing harness can compare distances in one process).
static PF_DIST: AtomicUsize = AtomicUsize::new(4096);
static PF_ROWS_DIST: AtomicUsize = AtomicUsize::new(512);

#[inline(always)]
fn pf_dist() -> usize {
    PF_DIST.load(Ordering::Relaxed)
}

#[inline(always)]
fn pf_rows() -> usize {
    PF_ROWS_DIST.load(Ordering::Relaxed)
}

/// Sets the prefetch distances (one-row, many-row; the timing harness's variants). A
/// many-row distance of 0 turns its prefetch off; a one-row 0 asks for the line being read.
#[cfg(test)]
pub(crate) fn set_prefetch(one: usize, rows: usize) {
    PF_DIST.store(one, Ordering::Relaxed);
    PF_ROWS_DIST.store(rows, Ordering::Relaxed);
}

#[macro_use]
mod common;
#[macro_use]
mod k45;
#[macro_use]
mod q32;
#[macro_use]
mod q6k;

/// One module of kernels per instruction set (`$feat`: the target features; `$vnni`:
/// whether byte dot products use `vpdpbusd`), its parts expanded from the files beside.
macro_rules! kernels {
    ($name:ident, $feat:literal, $vnni:literal) => {
        pub mod $name {
            use super::{ActRow, Q4_0, Q5_0, Q5_1, Q8_0};
            use std::arch::x86_64::*;

            common!($feat, $vnni);
            q32_kernels!($feat, $vnni);
            k45_kernels!($feat, $vnni);
            q6k_kernels!($feat, $vnni);
        }
    };
}

kernels!(avx2, "avx2,fma,f16c", false);
kernels!(vnni, "avx2,fma,f16c,avx512f,avx512vl,avx512vnni", true);
