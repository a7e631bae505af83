//! The sampling-step binding (`hybridserve_cpu_kernels::sample`): the sampler's
//! persistent tables and one call's per-sample arrays, all numpy views of CPU tensors
//! (no copy), logits float32 or bfloat16 bits (uint16 view).

use super::*;
use hybridserve_cpu_kernels::sample::{sample_rows as run, Mask, Outputs, Samples, Tables};
use numpy::{PyReadonlyArray1, PyReadwriteArray1};

fn flat<'a, T: numpy::Element>(name: &str, a: &'a PyReadonlyArrayDyn<'_, T>) -> PyResult<&'a [T]> {
    a.as_slice()
        .map_err(|_| PyValueError::new_err(format!("{name} must be C-contiguous")))
}

fn flat_mut<'a, T: numpy::Element>(
    name: &str,
    a: &'a mut PyReadwriteArrayDyn<'_, T>,
) -> PyResult<&'a mut [T]> {
    a.as_slice_mut()
        .map_err(|_| PyValueError::new_err(format!("{name} must be C-contiguous")))
}

fn vec1<'a, T: numpy::Element>(name: &str, a: &'a PyReadonlyArray1<'_, T>) -> PyResult<&'a [T]> {
    a.as_slice()
        .map_err(|_| PyValueError::new_err(format!("{name} must be a contiguous 1-D array")))
}

/// Draws one token per sample of a step into `tokens` (see the kernel's docs):
/// `logits` `[rows, vocab]` (float32 or bfloat16 bits); per sample `row_of`, `slots`,
/// `pslots` (int64, -1 = no penalties), `kinds` (uint8: 0 greedy, 1 seeded,
/// 2 unseeded), `biased` (uint8); `min_tokens` bans as (sample, token) int64 pairs;
/// the tables `fp` `[slots, 6]` float32, `ip` `[slots, 3]` int64 (stream offsets
/// advance when `advance`), `counts` `[pslots, vocab]` float32 (drawn tokens counted
/// when `advance`), `prompt_seen` `[pslots, vocab]` uint8, `bias_tok` / `bias_val`
/// `[slots, width]`; `processed` (optional) `[samples, vocab]` float32 receives the
/// processed logits. `mask` (optional): constrained decoding's token masks as
/// `(bitmask, mask_of, vocab)`: `bitmask` `[R, words]` int32 (xgrammar's layout),
/// `mask_of` int64 per sample (its bitmask row, -1: unmasked), tokens `< vocab` masked;
/// a masked sample is drawn as if its logits row had been masked first.
#[pyfunction]
#[pyo3(signature = (logits, row_of, slots, kinds, pslots, biased, ban_samples, ban_tokens, unseeded_key,
                    fp, ip, counts, prompt_seen, bias_tok, bias_val, tokens, processed=None, advance=true,
                    mask=None))]
#[allow(clippy::too_many_arguments)]
fn sample_rows(
    py: Python<'_>,
    logits: &Bound<'_, PyAny>,
    row_of: PyReadonlyArray1<'_, i64>,
    slots: PyReadonlyArray1<'_, i64>,
    kinds: PyReadonlyArray1<'_, u8>,
    pslots: PyReadonlyArray1<'_, i64>,
    biased: PyReadonlyArray1<'_, u8>,
    ban_samples: PyReadonlyArray1<'_, i64>,
    ban_tokens: PyReadonlyArray1<'_, i64>,
    unseeded_key: u64,
    fp: PyReadonlyArrayDyn<'_, f32>,
    mut ip: PyReadwriteArrayDyn<'_, i64>,
    mut counts: PyReadwriteArrayDyn<'_, f32>,
    prompt_seen: PyReadonlyArrayDyn<'_, u8>,
    bias_tok: PyReadonlyArrayDyn<'_, i64>,
    bias_val: PyReadonlyArrayDyn<'_, f32>,
    mut tokens: PyReadwriteArray1<'_, i64>,
    processed: Option<&Bound<'_, PyAny>>,
    advance: bool,
    mask: Option<(PyReadonlyArray2<'_, i32>, PyReadonlyArray1<'_, i64>, usize)>,
) -> PyResult<()> {
    let bias_width = match bias_tok.shape() {
        [_, w] => *w,
        s => {
            return Err(PyValueError::new_err(format!(
                "bias_tok must be [slots, width]; got shape {s:?}"
            )))
        }
    };
    let mask = match &mask {
        Some((bits, mask_of, vocab)) => Some(Mask {
            bits: bits
                .as_slice()
                .map_err(|_| PyValueError::new_err("the mask's bitmask must be C-contiguous"))?,
            words: bits.shape()[1],
            row_of: vec1("the mask's mask_of", mask_of)?,
            vocab: *vocab,
        }),
        None => None,
    };
    let samples = Samples {
        row_of: vec1("row_of", &row_of)?,
        slots: vec1("slots", &slots)?,
        kinds: vec1("kinds", &kinds)?,
        pslots: vec1("pslots", &pslots)?,
        biased: vec1("biased", &biased)?,
        ban_samples: vec1("ban_samples", &ban_samples)?,
        ban_tokens: vec1("ban_tokens", &ban_tokens)?,
        unseeded_key,
        mask,
    };
    let mut tables = Tables {
        fp: flat("fp", &fp)?,
        ip: flat_mut("ip", &mut ip)?,
        counts: flat_mut("counts", &mut counts)?,
        prompt_seen: flat("prompt_seen", &prompt_seen)?,
        bias_tok: flat("bias_tok", &bias_tok)?,
        bias_val: flat("bias_val", &bias_val)?,
        bias_width,
    };
    let mut proc_arr: Option<PyReadwriteArrayDyn<'_, f32>> = match processed {
        Some(p) if !p.is_none() => Some(p.extract().map_err(|_| {
            PyValueError::new_err("processed must be a writable float32 array [samples, vocab]")
        })?),
        _ => None,
    };
    let processed = match proc_arr.as_mut() {
        Some(a) => Some(flat_mut("processed", a)?),
        None => None,
    };
    let out = Outputs {
        tokens: tokens
            .as_slice_mut()
            .map_err(|_| PyValueError::new_err("tokens must be a contiguous int64 array"))?,
        processed,
        advance,
    };
    if let Ok(a) = logits.extract::<PyReadonlyArray2<'_, u16>>() {
        let l = rows("logits", &a)?;
        return py
            .detach(|| run(l, &samples, &mut tables, out))
            .map_err(err);
    }
    let a = logits.extract::<PyReadonlyArray2<'_, f32>>().map_err(|_| {
        PyValueError::new_err("logits must be a 2-D float32 array or bfloat16 bits (uint16 view)")
    })?;
    let l = rows("logits", &a)?;
    py.detach(|| run(l, &samples, &mut tables, out))
        .map_err(err)
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(sample_rows, m)?)
}
