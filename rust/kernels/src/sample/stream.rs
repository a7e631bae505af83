//! The counter-based random stream of a seeded sample (splitmix64), bit for bit the
//! one of `hybridserve.sampler.streams`: a draw's row state is
//! `splitmix64(key ^ splitmix64(offset))`, and column `j`'s uniform is the top 24 bits
//! of the `(j + 1)`-th output of the splitmix64 sequence started at that state, as a
//! float32 in `(0, 1]`. A seed therefore draws the same tokens here as in torch.

pub const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;
const MIX1: u64 = 0xBF58_476D_1CE4_E5B9;
const MIX2: u64 = 0x94D0_49BB_1331_11EB;

/// splitmix64's finaliser (products wrap mod 2^64, shifts are logical).
#[inline(always)]
pub fn mix64(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(MIX1);
    x ^= x >> 27;
    x = x.wrapping_mul(MIX2);
    x ^ (x >> 31)
}

/// One step of splitmix64 from state `x`.
#[inline(always)]
pub fn splitmix64(x: u64) -> u64 {
    mix64(x.wrapping_add(GOLDEN))
}

/// The state of a stream's draw number `offset` (`streams.row_states`).
#[inline]
pub fn row_state(key: u64, offset: u64) -> u64 {
    splitmix64(key ^ splitmix64(offset))
}

/// The uniform of column `col` of the draw whose state is `state` (`streams.uniform_at`).
#[inline(always)]
pub fn uniform(state: u64, col: usize) -> f32 {
    let h = mix64(state.wrapping_add((col as u64 + 1).wrapping_mul(GOLDEN)));
    // At most 2^24: exact in float32, as torch's int64 -> float32 conversion is.
    ((h >> 40) + 1) as f32 * (1.0 / 16_777_216.0)
}

/// The key of an unseeded sample's stream in one call: a hash of the call's random
/// key (drawn from torch's global generator by the caller) and the sample's position,
/// the same construction as `make_generator`'s per-sample keys.
#[inline]
pub fn unseeded_key(call_key: u64, sample: usize) -> u64 {
    splitmix64(call_key ^ splitmix64(sample as u64))
}
