//! Constrained decoding's token mask: every logit whose bit is clear becomes `-inf`.
//!
//! The grammar engine (xgrammar) packs a row's allowed tokens into 32-bit words, bit
//! `t % 32` of word `t / 32` for token `t`. At Qwen's 248,320-token vocabulary a row is
//! 7,760 words over 1 MB of float32 logits, and a JSON step allows a few hundred
//! tokens: nearly every word is zero. A word that is zero is 32 stores of `-inf`
//! (contiguous, vectorised), a word that is all ones is skipped, and only mixed words
//! test bits. Rows are spread over the kernel pool.

use crate::pool::for_each_task;
use crate::{KernelError, SharedMut};

/// Applies `bitmask` (`rows_total` rows of `words` i32 words) to the logits rows
/// `rows` (indices into both): `logits` holds `rows_total` rows of `stride` floats,
/// of which the first `vocab` are masked (`vocab <= 32 * words`, `vocab <= stride`).
pub fn apply_token_bitmask(
    logits: &mut [f32],
    stride: usize,
    vocab: usize,
    bitmask: &[i32],
    words: usize,
    rows: &[usize],
) -> Result<(), KernelError> {
    if vocab > words * 32 || vocab > stride {
        return Err(KernelError::new(format!(
            "vocab {vocab} must fit the bitmask's {words} words (x32) and the logits' row of {stride}"
        )));
    }
    let total = logits.len() / stride.max(1);
    if let Some(&bad) = rows
        .iter()
        .find(|&&r| r >= total || (r + 1) * words > bitmask.len())
    {
        return Err(KernelError::new(format!(
            "row {bad} is outside the logits ({total} rows) or the bitmask ({} rows)",
            bitmask.len() / words.max(1)
        )));
    }
    let out = SharedMut::new(logits);
    for_each_task(rows.len(), rows.len() * vocab, |i| {
        let r = rows[i];
        // SAFETY: the rows are checked in bounds above and each task writes its own row
        // (a row listed twice is written twice with the same values).
        let row = unsafe { std::slice::from_raw_parts_mut(out.add(r * stride).0, vocab) };
        mask_row(row, &bitmask[r * words..(r + 1) * words]);
    });
    Ok(())
}

#[inline]
fn mask_row(row: &mut [f32], mask: &[i32]) {
    let full = row.len() / 32;
    let (head, tail) = row.split_at_mut(full * 32);
    for (chunk, &w) in head.chunks_exact_mut(32).zip(mask) {
        match w {
            -1 => {}
            0 => chunk.fill(f32::NEG_INFINITY),
            w => {
                let w = w as u32;
                for (b, x) in chunk.iter_mut().enumerate() {
                    if (w >> b) & 1 == 0 {
                        *x = f32::NEG_INFINITY;
                    }
                }
            }
        }
    }
    if !tail.is_empty() {
        let w = mask[full] as u32;
        for (b, x) in tail.iter_mut().enumerate() {
            if (w >> b) & 1 == 0 {
                *x = f32::NEG_INFINITY;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_a_bit_by_bit_oracle() {
        let (rows_total, vocab, words) = (3usize, 100usize, 4usize);
        let stride = 104;
        let mut logits: Vec<f32> = (0..rows_total * stride).map(|i| i as f32).collect();
        let want = logits.clone();
        let mask: Vec<i32> = vec![0, -1, 0x1234_5678, 7, -1, -1, -1, -1, 5, 0, -1, 0x0F];
        apply_token_bitmask(&mut logits, stride, vocab, &mask, words, &[0, 2]).unwrap();
        for r in 0..rows_total {
            for t in 0..stride {
                let v = logits[r * stride + t];
                let allowed =
                    r == 1 || t >= vocab || (mask[r * words + t / 32] as u32 >> (t % 32)) & 1 == 1;
                if allowed {
                    assert_eq!(v, want[r * stride + t], "row {r} token {t}");
                } else {
                    assert_eq!(v, f32::NEG_INFINITY, "row {r} token {t}");
                }
            }
        }
    }
}
