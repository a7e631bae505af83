//! A speculative step's MTP draft passes in one call (issue 34).
//!
//! At one sequence a draft pass of the multi-token-prediction layer is about fifteen
//! small kernel calls (embedding rows, three norms, `fc`, the attention layer's norm,
//! projection, q/k norm and rope, cache write, decode attention, output projection,
//! the MLP, the final norm and the draft vocabulary's LM head with its argmax), and
//! from Python each call's glue cost about as much as its kernel. [`draft`] runs every
//! pass of a step (pass 0 over the step's committed rows, then the chained passes, one
//! row per drafting sequence) with the same kernels in the same order on the same
//! inputs as the Python path (`NativeDecodeStep._mtp_pass` / `mtp_draft`), so the drafts
//! and the MTP layer's KV are bit-identical to it.
//!
//! One step stays outside: the attention's sigmoid output gate, which the Python path
//! (and the module path it matches) computes with torch's `sigmoid` and `mul`, whose
//! float32 `exp` is not this crate's. The caller passes it as a callback that fills
//! `gated` from the projection's gate columns and the attention output.
//!
//! The buffers are raw pointers ([`Buf`]) rather than slices: the gate callback reads
//! and writes some of them through the caller's own views while [`draft`] runs, so no
//! Rust reference to them may live across it. Each kernel call borrows its operands
//! for the call alone.

use crate::activation::{silu_mul, Act};
use crate::attention::{paged_attention_decode, paged_attention_decode_bf16, DecodeSeqs, PagedKv};
use crate::bf16::Elem;
use crate::cache_write::{write_kv, KvPages};
use crate::matmul_bf16::{matmul_bf16, Out};
use crate::matmul_rows::matmul_rows;
use crate::norm::{rms_norm, rms_norm_bf16};
use crate::rope::{qk_norm_rope, qk_norm_rope_bf16};
use crate::{KernelError, Rows};

/// The element types of a model the draft passes run in, each with the kernels the
/// Python path calls for that dtype (`matmul_rows` / `matmul_bf16`, and the `_bf16`
/// variants of the norms, rope and attention).
pub trait MtpElem: Elem + Act {
    fn gemm(x: Rows<'_, Self>, w: &[Self], n: usize, out: &mut [Self]) -> Result<(), KernelError>;
    fn norm(x: &[Self], res: Option<&mut [Self]>, w: &[Self], eps: f32, out: &mut [Self])
        -> Result<(), KernelError>;
    #[allow(clippy::too_many_arguments)]
    fn rope(x: Rows<'_, Self>, heads: usize, stride: usize, w: &[Self], eps: f32, cos: Rows<'_, Self>,
            sin: Rows<'_, Self>, out: &mut [Self]) -> Result<(), KernelError>;
    fn attend(q: Rows<'_, Self>, kv: PagedKv<'_, Self>, seqs: DecodeSeqs<'_>, heads: usize, scale: f32,
              out: &mut [Self]) -> Result<(), KernelError>;
}

impl MtpElem for f32 {
    fn gemm(x: Rows<'_, f32>, w: &[f32], n: usize, out: &mut [f32]) -> Result<(), KernelError> {
        matmul_rows(x, w, n, out)
    }
    fn norm(x: &[f32], res: Option<&mut [f32]>, w: &[f32], eps: f32, out: &mut [f32]) -> Result<(), KernelError> {
        rms_norm(x, res, w, eps, true, out)
    }
    fn rope(x: Rows<'_, f32>, heads: usize, stride: usize, w: &[f32], eps: f32, cos: Rows<'_, f32>,
            sin: Rows<'_, f32>, out: &mut [f32]) -> Result<(), KernelError> {
        qk_norm_rope(x, heads, stride, w, eps, cos, sin, out)
    }
    fn attend(q: Rows<'_, f32>, kv: PagedKv<'_, f32>, seqs: DecodeSeqs<'_>, heads: usize, scale: f32,
              out: &mut [f32]) -> Result<(), KernelError> {
        paged_attention_decode(q, kv, seqs, heads, scale, out)
    }
}

impl MtpElem for u16 {
    fn gemm(x: Rows<'_, u16>, w: &[u16], n: usize, out: &mut [u16]) -> Result<(), KernelError> {
        matmul_bf16(x, w, n, Out::Bf16(out))
    }
    fn norm(x: &[u16], res: Option<&mut [u16]>, w: &[u16], eps: f32, out: &mut [u16]) -> Result<(), KernelError> {
        rms_norm_bf16(x, res, w, eps, true, out)
    }
    fn rope(x: Rows<'_, u16>, heads: usize, stride: usize, w: &[u16], eps: f32, cos: Rows<'_, u16>,
            sin: Rows<'_, u16>, out: &mut [u16]) -> Result<(), KernelError> {
        qk_norm_rope_bf16(x, heads, stride, w, eps, cos, sin, out)
    }
    fn attend(q: Rows<'_, u16>, kv: PagedKv<'_, u16>, seqs: DecodeSeqs<'_>, heads: usize, scale: f32,
              out: &mut [u16]) -> Result<(), KernelError> {
        paged_attention_decode_bf16(q, kv, seqs, heads, scale, out)
    }
}

/// `len` elements at `ptr`: a buffer the caller lent for the plan's life.
#[derive(Debug)]
pub struct Buf<T> {
    ptr: *mut T,
    len: usize,
}

impl<T> Clone for Buf<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Buf<T> {}

unsafe impl<T: Send> Send for Buf<T> {}
unsafe impl<T: Sync> Sync for Buf<T> {}

impl<T> Buf<T> {
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` elements for as long as the
    /// `Buf` is used, and while [`draft`] runs nothing but it and its gate callback may
    /// touch them (the callback through its own views, between kernel calls).
    pub unsafe fn new(ptr: *mut T, len: usize) -> Self {
        Buf { ptr, len }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first `n` elements, shared, for one kernel call.
    pub fn s<'a>(&self, n: usize) -> &'a [T] {
        assert!(n <= self.len, "buffer of {} read past its end ({n})", self.len);
        // SAFETY: in bounds (checked), valid by the constructor's contract; the slice
        // lives for one kernel call, during which nothing writes these elements.
        unsafe { std::slice::from_raw_parts(self.ptr, n) }
    }

    /// The first `n` elements, exclusive, for one kernel call.
    #[allow(clippy::mut_from_ref)]
    pub fn m<'a>(&self, n: usize) -> &'a mut [T] {
        assert!(n <= self.len, "buffer of {} written past its end ({n})", self.len);
        // SAFETY: as for `s`; no other slice of these elements lives during the call.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, n) }
    }
}

/// The MTP layer's shapes and constants.
#[derive(Clone, Copy, Debug)]
pub struct Dims {
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub inter: usize,
    /// Rows of `embed` (token ids the embedding takes).
    pub vocab: usize,
    /// Columns of the rope tables (rotary dimension).
    pub rot: usize,
    pub eps: f32,
    pub q_eps: f32,
    pub k_eps: f32,
    pub scale: f32,
}

/// The weights, each C-contiguous in the model's element type.
#[derive(Clone, Copy, Debug)]
pub struct Weights<T> {
    /// `[vocab, hidden]`.
    pub embed: Buf<T>,
    pub norm_e: Buf<T>,
    pub norm_h: Buf<T>,
    /// `[hidden, 2 hidden]`.
    pub fc: Buf<T>,
    pub in_norm: Buf<T>,
    pub post_norm: Buf<T>,
    /// The MTP block's final norm.
    pub out_norm: Buf<T>,
    /// `[2 heads head_dim + 2 kv_heads head_dim, hidden]`: rows `[q_h | gate_h]` per head, then k, v.
    pub qkv: Buf<T>,
    pub q_norm: Buf<T>,
    pub k_norm: Buf<T>,
    /// `[hidden, heads head_dim]`.
    pub o: Buf<T>,
    /// `[2 inter, hidden]`.
    pub gate_up: Buf<T>,
    /// `[hidden, inter]`.
    pub down: Buf<T>,
    /// The LM head `[V, hidden]`; drafts read its first rows.
    pub head: Buf<T>,
}

/// The MTP layer's paged KV (one attention layer's view of the arena).
#[derive(Clone, Copy, Debug)]
pub struct Kv<T> {
    pub k: Buf<T>,
    pub v: Buf<T>,
    pub num_blocks: usize,
    pub block_size: usize,
    pub block_stride: usize,
}

/// Activations for up to `rows` rows, each C-contiguous `[rows, width]`. `qkv`,
/// `attn` and `gated` are the ones the gate callback reads and writes.
#[derive(Clone, Copy, Debug)]
pub struct Scratch<T> {
    pub rows: usize,
    pub emb: Buf<T>,
    pub e_norm: Buf<T>,
    pub h_norm: Buf<T>,
    pub hid: Buf<T>,
    pub cat: Buf<T>,
    pub residual: Buf<T>,
    pub normed: Buf<T>,
    pub qkv: Buf<T>,
    pub rq: Buf<T>,
    pub rk: Buf<T>,
    pub attn: Buf<T>,
    pub gated: Buf<T>,
    pub mixer_out: Buf<T>,
    pub gate_up: Buf<T>,
    pub mlp_out: Buf<T>,
    pub cos: Buf<T>,
    pub sin: Buf<T>,
    /// `[rows, V]`: a pass's draft logits.
    pub logits: Buf<T>,
}

/// One step's inputs.
pub struct Step<'a, T> {
    /// `[R, hidden]`: the trunk's hidden state of each committed row.
    pub hidden: &'a [T],
    /// `[R]` token ids fed with them, their positions and MTP KV slots.
    pub ids: &'a [i64],
    pub positions: &'a [i64],
    pub slots: &'a [i64],
    /// `[R, width]` block-table rows.
    pub tables: &'a [i32],
    pub width: usize,
    /// Rows of pass 0 that draft (one per drafting sequence, its last row).
    pub last: &'a [i64],
    pub steps: usize,
    /// Draft ids are below `vocab` (the LM head's first rows).
    pub vocab: usize,
    /// Rope's cos and sin tables `[N, rot]` over positions `0 .. N - 1`.
    pub cos: &'a [T],
    pub sin: &'a [T],
}

/// Index of the first maximum of `row` as float32, or of its first NaN (numpy's and
/// torch's argmax rule).
pub fn argmax<T: Elem>(row: &[T]) -> usize {
    let mut best = 0;
    let mut top = f32::NEG_INFINITY;
    for (i, v) in row.iter().enumerate() {
        let v = v.get();
        if v.is_nan() {
            return i;
        }
        if v > top || i == 0 {
            top = v;
            best = i;
        }
    }
    best
}

fn check<T>(what: &str, b: &Buf<T>, want: usize) -> Result<(), KernelError> {
    if b.len != want {
        return Err(KernelError::new(format!("{what} must have {want} elements; got {}", b.len)));
    }
    Ok(())
}

/// Checks the plan's shapes once (each buffer and weight its exact size).
pub fn validate<T>(d: &Dims, w: &Weights<T>, kv: &Kv<T>, s: &Scratch<T>) -> Result<(), KernelError> {
    let (h, r) = (d.hidden, s.rows);
    let (qr, kvr) = (2 * d.heads * d.head_dim, d.kv_heads * d.head_dim);
    if h == 0 || r == 0 || d.heads == 0 || d.kv_heads == 0 || d.head_dim == 0 || d.inter == 0 || d.vocab == 0 {
        return Err(KernelError::new("every MTP dimension must be positive"));
    }
    check("embed", &w.embed, d.vocab * h)?;
    for (n, b) in [("norm_e", &w.norm_e), ("norm_h", &w.norm_h), ("in_norm", &w.in_norm),
                   ("post_norm", &w.post_norm), ("out_norm", &w.out_norm)] {
        check(n, b, h)?;
    }
    check("fc", &w.fc, h * 2 * h)?;
    check("qkv", &w.qkv, (qr + 2 * kvr) * h)?;
    check("q_norm", &w.q_norm, d.head_dim)?;
    check("k_norm", &w.k_norm, d.head_dim)?;
    check("o", &w.o, h * d.heads * d.head_dim)?;
    check("gate_up", &w.gate_up, 2 * d.inter * h)?;
    check("down", &w.down, h * d.inter)?;
    if w.head.len == 0 || w.head.len % h != 0 {
        return Err(KernelError::new(format!("head must be [V, {h}]; got {} elements", w.head.len)));
    }
    let v = w.head.len / h;
    for (n, b, width) in [("emb", &s.emb, h), ("e_norm", &s.e_norm, h), ("h_norm", &s.h_norm, h),
                          ("hid", &s.hid, h), ("cat", &s.cat, 2 * h), ("residual", &s.residual, h),
                          ("normed", &s.normed, h), ("qkv", &s.qkv, qr + 2 * kvr),
                          ("rq", &s.rq, qr / 2), ("rk", &s.rk, kvr), ("attn", &s.attn, qr / 2),
                          ("gated", &s.gated, qr / 2), ("mixer_out", &s.mixer_out, h),
                          ("gate_up", &s.gate_up, 2 * d.inter), ("mlp_out", &s.mlp_out, h),
                          ("cos", &s.cos, d.rot), ("sin", &s.sin, d.rot), ("logits", &s.logits, v)] {
        check(n, b, r * width)?;
    }
    let row = kvr;
    let fits = kv.num_blocks > 0 && kv.block_size > 0
        && (kv.num_blocks - 1) * kv.block_stride + kv.block_size * row <= kv.k.len
        && kv.k.len == kv.v.len;
    if !fits {
        return Err(KernelError::new("the MTP KV views do not hold num_blocks blocks of block_size rows"));
    }
    Ok(())
}

/// Every draft pass of one step; drafts go to `out` (`[steps, n]`, `n = last.len()`).
/// `gate(t)` must set `gated[:t] = attn[:t] * sigmoid(gate columns of qkv[:t])` in the
/// model's rounding. The plan must have passed [`validate`].
pub fn draft<T: MtpElem>(
    d: &Dims,
    w: &Weights<T>,
    kv: &Kv<T>,
    s: &Scratch<T>,
    step: &Step<'_, T>,
    out: &mut [i64],
    gate: &mut dyn FnMut(usize) -> Result<(), KernelError>,
) -> Result<(), KernelError> {
    let (h, rt) = (d.hidden, step.ids.len());
    let n = step.last.len();
    let v = step.vocab;
    if rt == 0 || rt > s.rows || n == 0 || n > rt || step.steps == 0 {
        return Err(KernelError::new(format!(
            "{rt} committed rows (at most {}) and {n} drafting rows (1 ..= rows), steps >= 1", s.rows
        )));
    }
    if step.hidden.len() != rt * h || step.positions.len() != rt || step.slots.len() != rt
        || step.width == 0 || step.tables.len() != rt * step.width
    {
        return Err(KernelError::new("hidden, positions, slots and tables must have one row per id"));
    }
    if v == 0 || v * h > w.head.len || out.len() != step.steps * n {
        return Err(KernelError::new(format!(
            "the draft vocabulary must be 1 ..= the LM head's rows, out [steps, {n}]"
        )));
    }
    if step.cos.len() != step.sin.len() || step.cos.len() % d.rot != 0 {
        return Err(KernelError::new("cos and sin must be [N, rot] alike"));
    }
    let rope_rows = step.cos.len() / d.rot;
    let bs = kv.block_size as i64;
    for &l in step.last {
        if l < 0 || l as usize >= rt {
            return Err(KernelError::new(format!("last row {l} not below {rt}")));
        }
    }
    for &p in step.positions {
        if p < 0 || (p as usize + step.steps) > rope_rows {
            return Err(KernelError::new(format!("position {p} (+{}) past the rope table ({rope_rows})", step.steps)));
        }
    }
    // Pass 0 over the committed rows.
    s.hid.m(rt * h).copy_from_slice(step.hidden);
    let lens: Vec<i64> = step.positions.iter().map(|p| p + 1).collect();
    // Rows `last` in increasing order: the other committed rows stop after their KV
    // write (nothing reads the rest of their pass), and `normed[i]` ends as row
    // `last[i]`'s output.
    let keep = step.last.windows(2).all(|p| p[0] < p[1]);
    pass(d, w, kv, s, step, rt, step.ids, step.positions, step.slots, &lens, step.tables,
         if keep { Some(step.last) } else { None }, gate)?;
    // The drafting rows' states and their tables and positions, for the chain.
    let (mut pos, mut tab) = (Vec::with_capacity(n), Vec::with_capacity(n * step.width));
    {
        let (normed, hid) = (s.normed.s(rt * h), s.hid.m(n * h));
        for (i, &l) in step.last.iter().enumerate() {
            let l = l as usize;
            let from = if keep { i } else { l };
            hid[i * h..(i + 1) * h].copy_from_slice(&normed[from * h..(from + 1) * h]);
            pos.push(step.positions[l]);
            tab.extend_from_slice(&step.tables[l * step.width..(l + 1) * step.width]);
        }
    }
    let mut ids = vec![0i64; n];
    let head = w.head.s(v * h);
    heads(s, head, v, h, n, &mut ids, keep)?;
    out[..n].copy_from_slice(&ids);
    let mut slots = vec![0i64; n];
    let mut lens = vec![0i64; n];
    for j in 1..step.steps {
        for i in 0..n {
            let p = pos[i] + 1;
            pos[i] = p;
            let block = (p / bs) as usize;
            if block >= step.width {
                return Err(KernelError::new(format!("position {p} past its block-table row")));
            }
            slots[i] = tab[i * step.width + block] as i64 * bs + p % bs;
            lens[i] = p + 1;
        }
        // hid holds the previous pass's drafting rows (copied before normed is rewritten).
        pass(d, w, kv, s, step, n, &ids, &pos, &slots, &lens, &tab, None, gate)?;
        s.hid.m(n * h).copy_from_slice(s.normed.s(n * h));
        heads(s, head, v, h, n, &mut ids, true)?;
        out[j * n..(j + 1) * n].copy_from_slice(&ids);
    }
    Ok(())
}

/// The draft argmax of `n` rows: `normed`'s first rows (`every`) or `hid`'s.
fn heads<T: MtpElem>(s: &Scratch<T>, head: &[T], v: usize, h: usize, n: usize, ids: &mut [i64], every: bool)
    -> Result<(), KernelError> {
    let x = if every { s.normed.s(n * h) } else { s.hid.s(n * h) };
    let lg = s.logits.m(n * v);
    T::gemm(Rows::dense(x, h)?, head, v, lg)?;
    for (i, id) in ids.iter_mut().enumerate() {
        *id = argmax(&lg[i * v..(i + 1) * v]) as i64;
    }
    Ok(())
}

/// One MTP pass over `t` rows, fed `hid[:t]` and `ids`, into `normed[:t]` (the Python
/// path's `_mtp_pass`, kernel for kernel). With `keep` (increasing row indices) every
/// row writes its K/V but only the kept rows run the rest (attention, MLP, norms),
/// compacted: `normed[i]` is row `keep[i]`'s output. Every kernel after the K/V write
/// is row-wise (a row's bits do not depend on the rows beside it), so the kept rows'
/// bits are those of the full pass.
#[allow(clippy::too_many_arguments)]
fn pass<T: MtpElem>(
    d: &Dims,
    w: &Weights<T>,
    kv: &Kv<T>,
    s: &Scratch<T>,
    step: &Step<'_, T>,
    t: usize,
    ids: &[i64],
    positions: &[i64],
    slots: &[i64],
    lens: &[i64],
    tables: &[i32],
    keep: Option<&[i64]>,
    gate: &mut dyn FnMut(usize) -> Result<(), KernelError>,
) -> Result<(), KernelError> {
    let h = d.hidden;
    let (nh, nkv, hd) = (d.heads, d.kv_heads, d.head_dim);
    let (qr, kvr) = (2 * nh * hd, nkv * hd);
    let qw = qr + 2 * kvr;
    // The embedding rows (index_select).
    {
        let (emb, table) = (s.emb.m(t * h), w.embed.s(d.vocab * h));
        for (r, &id) in ids.iter().enumerate() {
            if id < 0 || id as usize >= d.vocab {
                return Err(KernelError::new(format!("token id {id} not below {}", d.vocab)));
            }
            let id = id as usize;
            emb[r * h..(r + 1) * h].copy_from_slice(&table[id * h..(id + 1) * h]);
        }
    }
    // [pre_fc_norm_embedding(embed) | pre_fc_norm_hidden(hidden)], then fc.
    T::norm(s.emb.s(t * h), None, w.norm_e.s(h), d.eps, s.e_norm.m(t * h))?;
    T::norm(s.hid.s(t * h), None, w.norm_h.s(h), d.eps, s.h_norm.m(t * h))?;
    {
        let (cat, e, hn) = (s.cat.m(t * 2 * h), s.e_norm.s(t * h), s.h_norm.s(t * h));
        for r in 0..t {
            cat[r * 2 * h..r * 2 * h + h].copy_from_slice(&e[r * h..(r + 1) * h]);
            cat[r * 2 * h + h..(r + 1) * 2 * h].copy_from_slice(&hn[r * h..(r + 1) * h]);
        }
    }
    T::gemm(Rows::dense(s.cat.s(t * 2 * h), 2 * h)?, w.fc.s(2 * h * h), h, s.residual.m(t * h))?;
    T::norm(s.residual.s(t * h), None, w.in_norm.s(h), d.eps, s.normed.m(t * h))?;
    // Attention: qkv, q/k norm and rope, the cache write, decode attention.
    T::gemm(Rows::dense(s.normed.s(t * h), h)?, w.qkv.s(qw * h), qw, s.qkv.m(t * qw))?;
    {
        let (cos, sin) = (s.cos.m(t * d.rot), s.sin.m(t * d.rot));
        for (r, &p) in positions.iter().enumerate() {
            let p = p as usize;
            cos[r * d.rot..(r + 1) * d.rot].copy_from_slice(&step.cos[p * d.rot..(p + 1) * d.rot]);
            sin[r * d.rot..(r + 1) * d.rot].copy_from_slice(&step.sin[p * d.rot..(p + 1) * d.rot]);
        }
    }
    let qkv = s.qkv.s(t * qw);
    let (cos, sin) = (Rows::dense(s.cos.s(t * d.rot), d.rot)?, Rows::dense(s.sin.s(t * d.rot), d.rot)?);
    T::rope(Rows::new(qkv, t, qr, qw)?, nh, 2 * hd, w.q_norm.s(hd), d.q_eps, cos, sin, s.rq.m(t * nh * hd))?;
    T::rope(Rows::new(&qkv[qr..], t, kvr, qw)?, nkv, hd, w.k_norm.s(hd), d.k_eps, cos, sin, s.rk.m(t * kvr))?;
    {
        // SAFETY: the K and V views are the arena's (validated extents); no slice of
        // them lives during the write.
        let (kp, vp) = unsafe {
            (KvPages::from_raw_parts(kv.k.ptr, kv.k.len, kv.num_blocks, kv.block_size, kv.block_stride, kvr),
             KvPages::from_raw_parts(kv.v.ptr, kv.v.len, kv.num_blocks, kv.block_size, kv.block_stride, kvr))
        };
        write_kv(Rows::dense(s.rk.s(t * kvr), kvr)?, Rows::new(&qkv[qr + kvr..], t, kvr, qw)?, slots, kp, vp)?;
    }
    // The kept rows moved to the front (row keep[i] to i: keep increases, so a source
    // row is read before anything overwrites it).
    let (mut kl, mut kt) = (Vec::new(), Vec::new());
    let (t, lens, tables) = match keep {
        Some(k) if k.len() < t => {
            let nq = nh * hd;
            let (rq, res, qkv) = (s.rq.m(t * nq), s.residual.m(t * h), s.qkv.m(t * qw));
            for (i, &r) in k.iter().enumerate() {
                let r = r as usize;
                if r >= t || (i > 0 && r <= k[i - 1] as usize) {
                    return Err(KernelError::new("kept rows must increase and lie below the rows"));
                }
                if r != i {
                    rq.copy_within(r * nq..(r + 1) * nq, i * nq);
                    res.copy_within(r * h..(r + 1) * h, i * h);
                    qkv.copy_within(r * qw..(r + 1) * qw, i * qw);
                }
                kl.push(lens[r]);
                kt.extend_from_slice(&tables[r * step.width..(r + 1) * step.width]);
            }
            (k.len(), &kl[..], &kt[..])
        }
        _ => (t, lens, tables),
    };
    let rows: Vec<i64> = (0..t as i64).collect();
    let pk = PagedKv {
        k_cache: kv.k.s(kv.k.len),
        v_cache: kv.v.s(kv.v.len),
        block_size: kv.block_size,
        kv_heads: nkv,
        head_dim: hd,
        num_blocks: kv.num_blocks,
        block_stride: kv.block_stride,
    };
    let seqs = DecodeSeqs { rows: &rows, seq_lens: lens, block_tables: tables, width: step.width };
    T::attend(Rows::dense(s.rq.s(t * nh * hd), nh * hd)?, pk, seqs, nh, d.scale, s.attn.m(t * nh * hd))?;
    // The sigmoid output gate: the caller's (torch's rounding).
    gate(t)?;
    T::gemm(Rows::dense(s.gated.s(t * nh * hd), nh * hd)?, w.o.s(h * nh * hd), h, s.mixer_out.m(t * h))?;
    T::norm(s.mixer_out.s(t * h), Some(s.residual.m(t * h)), w.post_norm.s(h), d.eps, s.normed.m(t * h))?;
    // The dense SwiGLU MLP.
    let i2 = 2 * d.inter;
    T::gemm(Rows::dense(s.normed.s(t * h), h)?, w.gate_up.s(i2 * h), i2, s.gate_up.m(t * i2))?;
    silu_mul(s.gate_up.m(t * i2), t, d.inter, i2)?;
    T::gemm(Rows::new(s.gate_up.s(t * i2), t, d.inter, i2)?, w.down.s(h * d.inter), h, s.mlp_out.m(t * h))?;
    T::norm(s.mlp_out.s(t * h), Some(s.residual.m(t * h)), w.out_norm.s(h), d.eps, s.normed.m(t * h))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_takes_the_first_maximum_and_the_first_nan() {
        assert_eq!(argmax(&[1.0f32, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
        assert_eq!(argmax(&[1.0f32, f32::NAN, 5.0, f32::NAN]), 1);
        assert_eq!(argmax(&[-0.0f32, 0.0]), 0);
        // bfloat16 bits: 1.0 = 0x3f80, 2.0 = 0x4000, -1.0 = 0xbf80.
        assert_eq!(argmax(&[0xbf80u16, 0x4000, 0x3f80, 0x4000]), 1);
    }
}
