//! A whole sampling step on the CPU in one call: for every sample of a step, the logit
//! processors, the cuts and the draw that `hybridserve.sampler` runs as a chain of
//! torch ops over `[rows, vocab]` (the oracle), on one row at a time in a reused
//! float32 buffer.
//!
//! Per sample, in vLLM v1's order (the torch path's, see its `processors.py`):
//! logit bias, `min_tokens` bans, repetition / frequency / presence penalties from
//! the running count tables; a greedy sample then takes the first maximum (NaN counted
//! as the maximum, numpy's rule); a sampled one is divided by its temperature, cut by
//! min-p, top-k (ties with the k-th kept) and top-p (a token is kept iff the mass
//! strictly before it, in descending order, is below p; ties with the last kept one
//! kept), and drawn by the exponential race `argmax exp(x - max) / q`, the lowest
//! column winning ties, with `q = -ln u` from the sample's splitmix64 stream
//! ([`stream`]) for a seeded sample, so a seed gives the torch path's tokens. Every
//! float operation is the torch path's, in its order (a penalised logit, the
//! temperature's quotient and a race score are the very numbers torch computes; the
//! cumulative sums of top-p accumulate in float64 as torch's CPU cumsum does; only
//! the sums inside log-sum-exp may differ from torch's in their last bits).
//!
//! The parameters are not copied per call: they are read from the sampler's
//! persistent tables (a row per slot, `[slots, 6]` float32 and `[slots, 3]` int64, the
//! layout of `hybridserve.sampler.rows`), which change only when the batch does.
//! When asked to (`advance`), the call also does the bookkeeping of a draw: each seeded
//! stream's offset in the table moves on by one, and each penalised sample's drawn
//! token is counted.
//!
//! Constrained decoding's token mask (xgrammar's bitmask, see `token_bitmask`) can be
//! given with the samples ([`Mask`]): a masked sample's row is read as if every token
//! whose bit is clear were `-inf` (exactly what `apply_token_bitmask` on the logits
//! before the call gives), in the pass that copies the row into the work buffer; a
//! plain greedy masked row is a masked argmax that reads only the allowed tokens'
//! logits. So the mask costs no pass of its own over the logits.
//!
//! One thread: the engine runs its host work on one (a decode step of a few hundred
//! rows is well under a millisecond here).

mod select;
pub mod stream;
#[cfg(test)]
mod tests;

use crate::bf16::Elem;
use crate::{KernelError, Rows};
use select::{at_least_kth, sort_descending, Entry, Select};

/// Columns of the float parameter table (`rows.F_*`).
pub const F_TEMP: usize = 0;
pub const F_TOPP: usize = 1;
pub const F_MINP: usize = 2;
pub const F_PRES: usize = 3;
pub const F_FREQ: usize = 4;
pub const F_REP: usize = 5;
pub const NF: usize = 6;
/// Columns of the integer parameter table (`rows.I_*`).
pub const I_TOPK: usize = 0;
pub const I_KEY: usize = 1;
pub const I_OFF: usize = 2;
pub const NI: usize = 3;

/// The first partial top-K of a top-p row without a small top_k (grown 8x while its K
/// leading tokens hold less than p), as the torch path's `TOP_P_FIRST_K`.
const TOP_P_FIRST_K: usize = 256;

/// How a sample is drawn (`kinds` codes 0, 1, 2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Greedy,
    Seeded,
    Unseeded,
}

impl Kind {
    fn from_code(c: u8) -> Option<Kind> {
        match c {
            0 => Some(Kind::Greedy),
            1 => Some(Kind::Seeded),
            2 => Some(Kind::Unseeded),
            _ => None,
        }
    }
}

/// The sampler's persistent tables (`hybridserve.sampler.rows.RowTables`), read in place.
pub struct Tables<'a> {
    /// `[slots, NF]`: temperature, top_p, min_p, presence, frequency, repetition.
    pub fp: &'a [f32],
    /// `[slots, NI]`: top_k, stream key (the u64's bits), stream offset.
    pub ip: &'a mut [i64],
    /// `[pslots, vocab]`: each penalised sample's output token counts.
    pub counts: &'a mut [f32],
    /// `[pslots, vocab]`: 1 where the token is in the prompt (repetition penalty).
    pub prompt_seen: &'a [u8],
    /// `[slots, bias_width]` token ids and biases (padding: token 0, bias 0).
    pub bias_tok: &'a [i64],
    pub bias_val: &'a [f32],
    pub bias_width: usize,
}

/// One call's samples, in output order.
pub struct Samples<'a> {
    /// The logits row of each sample (a fork row's samples share one).
    pub row_of: &'a [i64],
    /// Each sample's row of `fp` / `ip` / the bias tables.
    pub slots: &'a [i64],
    /// [`Kind`] codes.
    pub kinds: &'a [u8],
    /// Each sample's row of the count tables; -1: no penalties.
    pub pslots: &'a [i64],
    /// 1: the sample's logit bias applies.
    pub biased: &'a [u8],
    /// `min_tokens` bans as (sample, token) pairs, samples in ascending order.
    pub ban_samples: &'a [i64],
    pub ban_tokens: &'a [i64],
    /// This call's random key for the unseeded samples' streams.
    pub unseeded_key: u64,
    /// Constrained decoding's token masks, if any sample has one.
    pub mask: Option<Mask<'a>>,
}

/// Token masks of a call: xgrammar's layout, bit `t % 32` of word `t / 32` set when
/// token `t` is allowed.
pub struct Mask<'a> {
    /// `[mask_rows, words]`.
    pub bits: &'a [i32],
    pub words: usize,
    /// Per sample: its row of `bits`, or -1 (unmasked).
    pub row_of: &'a [i64],
    /// Tokens `< vocab` are masked (the grammar's vocabulary; logits columns past it
    /// are left as they are). `vocab <= 32 * words` and at most the logits' width.
    pub vocab: usize,
}

impl Mask<'_> {
    fn row(&self, sample: usize) -> Option<&[i32]> {
        let r = self.row_of[sample];
        (r >= 0).then(|| &self.bits[r as usize * self.words..(r as usize + 1) * self.words])
    }
}

/// What a call writes.
pub struct Outputs<'a> {
    /// `[samples]` the drawn tokens.
    pub tokens: &'a mut [i64],
    /// `[samples, vocab]`: the processed logits each sample was drawn from (dropped
    /// tokens -inf; a greedy sample's after bias, bans and penalties), if wanted.
    pub processed: Option<&'a mut [f32]>,
    /// Advance the seeded streams and count the drawn tokens in the tables.
    pub advance: bool,
}

fn bad(msg: String) -> KernelError {
    KernelError::new(msg)
}

fn index(what: &str, v: i64, n: usize) -> Result<usize, KernelError> {
    if v < 0 || v as usize >= n {
        return Err(bad(format!("{what} {v} is outside 0..{n}")));
    }
    Ok(v as usize)
}

/// Checks every index of a call before anything is written.
fn validate(
    vocab: usize,
    rows: usize,
    s: &Samples<'_>,
    t: &Tables<'_>,
    o: &Outputs<'_>,
) -> Result<(), KernelError> {
    let n = s.slots.len();
    if s.row_of.len() != n || s.kinds.len() != n || s.pslots.len() != n || s.biased.len() != n {
        return Err(bad(format!(
            "row_of, slots, kinds, pslots and biased must each have one entry per sample; got {}, {n}, {}, {}, {}",
            s.row_of.len(),
            s.kinds.len(),
            s.pslots.len(),
            s.biased.len()
        )));
    }
    if o.tokens.len() != n {
        return Err(bad(format!(
            "tokens must have {n} entries, got {}",
            o.tokens.len()
        )));
    }
    if let Some(p) = &o.processed {
        if p.len() != n * vocab {
            return Err(bad(format!(
                "processed must be [{n}, {vocab}], got {} elements",
                p.len()
            )));
        }
    }
    if t.fp.len() % NF != 0 || t.ip.len() % NI != 0 || t.fp.len() / NF != t.ip.len() / NI {
        return Err(bad(format!(
            "fp must be [slots, {NF}] and ip [slots, {NI}] with the same slots; got {} and {} elements",
            t.fp.len(),
            t.ip.len()
        )));
    }
    let slots = t.ip.len() / NI;
    if vocab == 0 || t.counts.len() % vocab != 0 || t.prompt_seen.len() != t.counts.len() {
        return Err(bad(format!(
            "counts and prompt_seen must both be [pslots, vocab={vocab}]; got {} and {} elements",
            t.counts.len(),
            t.prompt_seen.len()
        )));
    }
    let pslots = t.counts.len() / vocab;
    if t.bias_tok.len() != t.bias_val.len() || t.bias_tok.len() != slots * t.bias_width {
        return Err(bad(format!(
            "bias_tok and bias_val must be [slots={slots}, {}]; got {} and {} elements",
            t.bias_width,
            t.bias_tok.len(),
            t.bias_val.len()
        )));
    }
    for i in 0..n {
        index("a sample's logits row", s.row_of[i], rows)?;
        let slot = index("a sample's slot", s.slots[i], slots)?;
        if Kind::from_code(s.kinds[i]).is_none() {
            return Err(bad(format!(
                "kind {} of sample {i} is not 0 (greedy), 1 (seeded) or 2 (unseeded)",
                s.kinds[i]
            )));
        }
        if s.pslots[i] != -1 {
            index("a sample's count-table row", s.pslots[i], pslots)?;
        }
        if s.biased[i] != 0 {
            for &tok in &t.bias_tok[slot * t.bias_width..(slot + 1) * t.bias_width] {
                index("a logit_bias token id", tok, vocab)?;
            }
        }
    }
    if s.ban_samples.len() != s.ban_tokens.len() {
        return Err(bad(
            "ban_samples and ban_tokens must be pairs (the same length)".into(),
        ));
    }
    if let Some(m) = &s.mask {
        if m.row_of.len() != n {
            return Err(bad(format!(
                "the mask's row_of must have one entry per sample ({n}), got {}",
                m.row_of.len()
            )));
        }
        if m.words == 0 || m.bits.len() % m.words != 0 || m.vocab > 32 * m.words || m.vocab > vocab
        {
            return Err(bad(format!(
                "the mask must be [rows, words={}] with vocab {} <= 32 x words and <= the logits' {vocab}; got {} words in all",
                m.words,
                m.vocab,
                m.bits.len()
            )));
        }
        let mask_rows = m.bits.len() / m.words;
        for &r in m.row_of {
            if r != -1 {
                index("a sample's mask row", r, mask_rows)?;
            }
        }
    }
    let mut last = 0usize;
    for (&b, &tok) in s.ban_samples.iter().zip(s.ban_tokens) {
        let b = index("a ban's sample", b, n)?;
        if b < last {
            return Err(bad("ban_samples must be in ascending order".into()));
        }
        last = b;
        index("a banned token id", tok, vocab)?;
    }
    Ok(())
}

/// Scratch reused across the rows of a call.
struct Work {
    x: Vec<f32>,
    list: Vec<Entry>,
    select: Select,
    packed: Vec<u64>,
    exps: Vec<f32>,
}

/// Draws one token per sample (see the module docs): `logits` `[rows, vocab]`
/// float32, or bfloat16 bits (`u16`), widened exactly as torch's `.float()` does.
pub fn sample_rows<T: Elem>(
    logits: Rows<'_, T>,
    samples: &Samples<'_>,
    tables: &mut Tables<'_>,
    mut out: Outputs<'_>,
) -> Result<(), KernelError> {
    let vocab = logits.width;
    validate(vocab, logits.rows, samples, tables, &out)?;
    let mut w = Work {
        x: vec![0.0; vocab],
        list: Vec::new(),
        select: Select::default(),
        packed: Vec::new(),
        exps: Vec::new(),
    };
    let mut wide = T::scratch(vocab);
    let mut ban = 0usize;
    for i in 0..samples.slots.len() {
        let slot = samples.slots[i] as usize;
        let kind = Kind::from_code(samples.kinds[i]).expect("validated");
        let pslot = samples.pslots[i];
        let src = logits.row(samples.row_of[i] as usize);
        let has_ban = ban < samples.ban_samples.len() && samples.ban_samples[ban] as usize == i;
        let mask = samples
            .mask
            .as_ref()
            .and_then(|m| m.row(i).map(|bits| (bits, m.vocab)));
        if kind == Kind::Greedy
            && pslot < 0
            && samples.biased[i] == 0
            && !has_ban
            && out.processed.is_none()
        {
            // Nothing changes a plain greedy row: the argmax of the logits as they are
            // (of the allowed ones, for a masked row).
            let token = match mask {
                Some((bits, mv)) => masked_first_argmax(src, bits, mv),
                None => first_argmax(T::widen(src, &mut wide)),
            };
            out.tokens[i] = token as i64;
            continue;
        }
        match mask {
            Some((bits, mv)) => copy_masked(&mut w.x, src, bits, mv),
            None => {
                for (d, &v) in w.x.iter_mut().zip(src) {
                    *d = v.get();
                }
            }
        }
        let x = &mut w.x[..];
        // 0. logit bias.
        if samples.biased[i] != 0 {
            let at = slot * tables.bias_width;
            for j in at..at + tables.bias_width {
                x[tables.bias_tok[j] as usize] += tables.bias_val[j];
            }
        }
        // 1. min_tokens bans.
        while ban < samples.ban_samples.len() && samples.ban_samples[ban] as usize == i {
            x[samples.ban_tokens[ban] as usize] = f32::NEG_INFINITY;
            ban += 1;
        }
        let fp = &tables.fp[slot * NF..(slot + 1) * NF];
        // 2. penalties.
        if pslot >= 0 {
            let at = pslot as usize * vocab;
            penalise(
                x,
                &tables.counts[at..at + vocab],
                &tables.prompt_seen[at..at + vocab],
                fp[F_REP],
                fp[F_FREQ],
                fp[F_PRES],
            );
        }
        let (token, cut) = if kind == Kind::Greedy {
            (first_argmax(x), f32::NEG_INFINITY)
        } else {
            let ip = &tables.ip[slot * NI..(slot + 1) * NI];
            let state = match kind {
                Kind::Seeded => stream::row_state(ip[I_KEY] as u64, ip[I_OFF] as u64),
                _ => stream::row_state(stream::unseeded_key(samples.unseeded_key, i), 0),
            };
            // A masked row with nothing added to it (no bias or penalties) holds -inf at
            // every masked token: the draw may pass over those (see `draw`).
            let allowed = mask.filter(|_| pslot < 0 && samples.biased[i] == 0);
            draw(
                x,
                fp,
                ip[I_TOPK],
                state,
                allowed,
                &mut w.list,
                &mut w.select,
                &mut w.packed,
                &mut w.exps,
            )
        };
        out.tokens[i] = token as i64;
        if let Some(p) = out.processed.as_deref_mut() {
            let dst = &mut p[i * vocab..(i + 1) * vocab];
            for (d, &v) in dst.iter_mut().zip(x.iter()) {
                *d = if v < cut { f32::NEG_INFINITY } else { v };
            }
        }
        if out.advance {
            if kind == Kind::Seeded {
                tables.ip[slot * NI + I_OFF] += 1;
            }
            if pslot >= 0 && token < vocab {
                tables.counts[pslot as usize * vocab + token] += 1.0;
            }
        }
    }
    Ok(())
}

/// Repetition, frequency and presence penalties in the torch path's arithmetic
/// (`processors.apply_penalties`): `seen` and "in the output" are exactly 0.0 or 1.0,
/// the factor is `seen * rep + (1 - seen)`, a positive logit is divided by it and a
/// negative one multiplied, then `count * freq` and `in_output * pres` are subtracted.
fn penalise(x: &mut [f32], counts: &[f32], prompt: &[u8], rep: f32, freq: f32, pres: f32) {
    // A token neither in the prompt nor in the output is left exactly as it is by the
    // arithmetic below (factor 1, nothing subtracted): chunks of such tokens (most of
    // a large vocabulary) are skipped after a vectorised check.
    for ((xs, cs), ps) in x
        .chunks_mut(16)
        .zip(counts.chunks(16))
        .zip(prompt.chunks(16))
    {
        let seen = cs.iter().fold(0u32, |a, &c| a | (c != 0.0) as u32)
            | ps.iter().fold(0u8, |a, &p| a | p) as u32;
        if seen != 0 {
            penalise_chunk(xs, cs, ps, rep, freq, pres);
        }
    }
}

fn penalise_chunk(x: &mut [f32], counts: &[f32], prompt: &[u8], rep: f32, freq: f32, pres: f32) {
    for ((v, &c), &p) in x.iter_mut().zip(counts).zip(prompt) {
        let in_output = if c > 0.0 { 1.0f32 } else { 0.0 };
        let seen = if p != 0 { 1.0f32 } else { in_output };
        let factor = seen * rep + (-seen + 1.0);
        // torch's clamps: a NaN stays NaN (f32::min/max would give 0).
        let neg = if *v > 0.0 { 0.0 } else { *v } * factor;
        let pos = if *v < 0.0 { 0.0 } else { *v } / factor + neg;
        *v = pos - c * freq - in_output * pres;
    }
}

/// The first maximum; a NaN counts as the maximum (numpy's `argmax`, the torch path's).
fn first_argmax(x: &[f32]) -> usize {
    // One pass of 16 lanes, each keeping its first maximum and where it was
    // (vectorises), then the lowest position among the lanes holding the maximum.
    let mut lm = [f32::NEG_INFINITY; 16];
    let mut li = [0u32; 16];
    let mut nan = 0u32;
    let chunks = x.chunks_exact(16);
    let tail = chunks.remainder();
    for (c, chunk) in chunks.enumerate() {
        let base = (c * 16) as u32;
        for l in 0..16 {
            let v = chunk[l];
            let gt = v > lm[l];
            lm[l] = if gt { v } else { lm[l] };
            li[l] = if gt { base + l as u32 } else { li[l] };
            nan |= v.is_nan() as u32;
        }
    }
    let (mut m, mut at) = (f32::NEG_INFINITY, 0usize);
    for l in 0..16 {
        if lm[l] > m || (lm[l] == m && m > f32::NEG_INFINITY && (li[l] as usize) < at) {
            (m, at) = (lm[l], li[l] as usize);
        }
    }
    let base = x.len() - tail.len();
    for (j, &v) in tail.iter().enumerate() {
        nan |= v.is_nan() as u32;
        if v > m {
            (m, at) = (v, base + j);
        }
    }
    if nan != 0 {
        return x.iter().position(|v| v.is_nan()).expect("a NaN was seen");
    }
    // All -inf (or empty): 0, the first element, numpy's answer.
    at
}

/// `dst = src` widened, with every token `t < vocab` whose bit is clear in `bits` set to
/// `-inf` (a zero word's 32 logits are not read).
fn copy_masked<T: Elem>(dst: &mut [f32], src: &[T], bits: &[i32], vocab: usize) {
    let full = vocab / 32;
    for (wi, &w) in bits[..full].iter().enumerate() {
        let (d, s) = (&mut dst[wi * 32..wi * 32 + 32], &src[wi * 32..wi * 32 + 32]);
        match w {
            0 => d.fill(f32::NEG_INFINITY),
            -1 => {
                for (d, &v) in d.iter_mut().zip(s) {
                    *d = v.get();
                }
            }
            w => {
                let w = w as u32;
                for (b, (d, &v)) in d.iter_mut().zip(s).enumerate() {
                    *d = if (w >> b) & 1 == 1 {
                        v.get()
                    } else {
                        f32::NEG_INFINITY
                    };
                }
            }
        }
    }
    for t in full * 32..vocab {
        dst[t] = if (bits[full] as u32 >> (t % 32)) & 1 == 1 {
            src[t].get()
        } else {
            f32::NEG_INFINITY
        };
    }
    for (d, &v) in dst[vocab..].iter_mut().zip(&src[vocab..]) {
        *d = v.get();
    }
}

/// [`first_argmax`] of `src` with every token `t < vocab` whose bit is clear in `bits`
/// taken as `-inf`: the first NaN among the allowed, else the first maximum, else 0
/// (every value -inf). Only the allowed tokens' logits are read.
fn masked_first_argmax<T: Elem>(src: &[T], bits: &[i32], vocab: usize) -> usize {
    let mut best = f32::NEG_INFINITY;
    let mut at = 0usize;
    // One allowed token, in column order.
    macro_rules! one {
        ($t:expr) => {{
            let t = $t;
            let v = src[t].get();
            if v.is_nan() {
                return t;
            }
            if v > best {
                best = v;
                at = t;
            }
        }};
    }
    let full = vocab / 32;
    for (wi, &w) in bits[..full].iter().enumerate() {
        match w {
            0 => {}
            -1 => {
                // A whole word allowed: its max first (vectorises), the position only
                // when it beats the best so far (or holds a NaN).
                let c = &src[wi * 32..wi * 32 + 32];
                let (mut m, mut nan) = (f32::NEG_INFINITY, false);
                for &v in c {
                    let v = v.get();
                    nan |= v.is_nan();
                    m = if v > m { v } else { m };
                }
                if nan || m > best {
                    for j in 0..32 {
                        one!(wi * 32 + j);
                    }
                }
            }
            w => {
                let mut w = w as u32;
                while w != 0 {
                    let b = w.trailing_zeros() as usize;
                    one!(wi * 32 + b);
                    w &= w - 1;
                }
            }
        }
    }
    for t in full * 32..vocab {
        if (bits[full] as u32 >> (t % 32)) & 1 == 1 {
            one!(t);
        }
    }
    for t in vocab..src.len() {
        one!(t);
    }
    at
}

fn row_max(x: &[f32]) -> f32 {
    x.iter()
        .fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a })
}

/// The row's log-sum-exp, as `processors.row_logsumexp` forms it (shift by the max
/// when finite; the sum itself in float64).
fn logsumexp(values: impl Iterator<Item = f32>, m: f32) -> f32 {
    let shift = if m.is_finite() { m } else { 0.0 };
    let total: f64 = values.map(|v| (v - shift).exp() as f64).sum();
    shift + (total as f32).ln()
}

/// Calls `f` on each column of a row of `n` that `bits` allows (every column from
/// `vocab` on), in ascending order; a zero word's 32 columns are not visited.
#[inline]
fn for_allowed(bits: &[i32], vocab: usize, n: usize, mut f: impl FnMut(usize)) {
    let full = vocab / 32;
    for (wi, &w) in bits[..full].iter().enumerate() {
        let mut w = w as u32;
        while w != 0 {
            let b = w.trailing_zeros() as usize;
            f(wi * 32 + b);
            w &= w - 1;
        }
    }
    for t in full * 32..vocab {
        if (bits[full] as u32 >> (t % 32)) & 1 == 1 {
            f(t);
        }
    }
    for t in vocab..n {
        f(t);
    }
}

/// Temperature, min-p, top-k, top-p and the race of a sampled row, in place on `x`;
/// returns the token and the cut (tokens below it are dropped). `allowed`: a token mask
/// `(bits, vocab)` under which every masked token of `x` is -inf; the temperature and
/// the race (without top-k and top-p) then visit the allowed tokens only (a masked
/// token stays -inf under a positive finite temperature, and the race skips -inf).
#[allow(clippy::too_many_arguments)]
fn draw(
    x: &mut [f32],
    fp: &[f32],
    top_k: i64,
    state: u64,
    allowed: Option<(&[i32], usize)>,
    list: &mut Vec<Entry>,
    select: &mut Select,
    packed: &mut Vec<u64>,
    exps: &mut Vec<f32>,
) -> (usize, f32) {
    let vocab = x.len();
    let temp = fp[F_TEMP];
    let allowed = allowed.filter(|_| temp.is_finite() && temp > 0.0);
    if temp != 1.0 {
        match allowed {
            Some((bits, mv)) => for_allowed(bits, mv, vocab, |j| x[j] /= temp),
            None => {
                for v in x.iter_mut() {
                    *v /= temp;
                }
            }
        }
    }
    let min_p = fp[F_MINP];
    if min_p > 0.0 {
        let m = row_max(x);
        let lse = logsumexp(x.iter().copied(), m);
        let threshold = (m - lse).exp() * min_p;
        for v in x.iter_mut() {
            if (*v - lse).exp() < threshold {
                *v = f32::NEG_INFINITY;
            }
        }
    }
    let top_p = fp[F_TOPP];
    let k = if top_k > 0 && (top_k as usize) < vocab {
        top_k as usize
    } else {
        0
    };
    let mut cut = f32::NEG_INFINITY;
    let mut listed = false;
    if k > 0 {
        cut = at_least_kth(x, k, list, select);
        listed = true;
    }
    // exp(v - max) of the sorted list's entries, when top-p's normaliser made them:
    // the race's numerators are the same numbers.
    let mut exps_ready = false;
    if top_p < 1.0 {
        let lse = if k > 0 {
            // Normalised over what top-k keeps (the torch path normalises the cut row).
            sort_descending(list, packed);
            let m = list[0].0;
            let shift = if m.is_finite() { m } else { 0.0 };
            exps.clear();
            exps.extend(list.iter().map(|e| (e.0 - shift).exp()));
            exps_ready = m.is_finite();
            shift + (exps.iter().map(|&e| e as f64).sum::<f64>() as f32).ln()
        } else {
            logsumexp(x.iter().copied(), row_max(x))
        };
        let mut kk = if k > 0 { k } else { TOP_P_FIRST_K.min(vocab) };
        loop {
            if k == 0 {
                at_least_kth(x, kk, list, select);
                sort_descending(list, packed);
            }
            let (last_kept, decided) = nucleus(list, lse, top_p);
            if decided || k > 0 || kk >= vocab {
                cut = cut.max(last_kept);
                break;
            }
            kk = (8 * kk).min(vocab);
        }
        listed = true;
    }
    let mut best = (-1.0f32, vocab);
    // The race: the highest exp(v - max) / q wins, the lowest column on a tie.
    let mut consider = |j: usize, e: f32| {
        let q = (-stream::uniform(state, j).ln()).max(f32::MIN_POSITIVE);
        let score = e / q;
        if score > best.0 || (score == best.0 && j < best.1) {
            best = (score, j);
        }
    };
    if listed {
        let m = list
            .iter()
            .fold(f32::NEG_INFINITY, |a, e| if e.0 > a { e.0 } else { a });
        for (i, &(v, j)) in list.iter().enumerate() {
            if v < cut || v == f32::NEG_INFINITY {
                continue;
            }
            let e = if exps_ready { exps[i] } else { (v - m).exp() };
            consider(j as usize, e);
        }
    } else if let Some((bits, mv)) = allowed {
        let mut m = f32::NEG_INFINITY;
        for_allowed(bits, mv, vocab, |j| {
            if x[j] > m {
                m = x[j];
            }
        });
        for_allowed(bits, mv, vocab, |j| {
            let v = x[j];
            if !(v < cut || v == f32::NEG_INFINITY) {
                consider(j, (v - m).exp());
            }
        });
    } else {
        let m = row_max(x);
        for (j, &v) in x.iter().enumerate() {
            if v < cut || v == f32::NEG_INFINITY {
                continue;
            }
            consider(j, (v - m).exp());
        }
    }
    // A row with nothing to draw from (all -inf) gets its first maximum.
    let token = if best.1 < vocab {
        best.1
    } else {
        first_argmax(x)
    };
    (token, cut)
}

/// The smallest value top-p keeps from a row's leading values in descending order
/// (`processors.nucleus_cut`): a value is kept iff the mass strictly before it (a
/// float64 cumulative sum of float32 probabilities, rounded to float32, as torch's CPU
/// cumsum) is below `p`. `decided`: the list holds the first value top-p drops or the
/// list's mass reaches p (a longer list would not change the answer).
fn nucleus(sorted: &[Entry], lse: f32, p: f32) -> (f32, bool) {
    let mut cum = 0f64;
    let mut last = f32::NEG_INFINITY;
    for &(v, _) in sorted {
        if (cum as f32) >= p {
            return (last, true);
        }
        last = v;
        cum += (v - lse).exp() as f64;
    }
    (last, (cum as f32) >= p)
}
