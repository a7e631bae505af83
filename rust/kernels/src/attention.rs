//! Decode attention straight from the paged KV pool.
//!
//! Each listed sequence has one query (its last token), whose K/V, like all earlier
//! ones, are already in the pool: `[num_blocks, block_size, Hkv, D]`, logical block
//! `i` of sequence `b` at physical block `block_tables[b, i]`. Query head `h` reads KV
//! head `h / (Hq / Hkv)` (GQA, HF's `repeat_kv`); a task is one (sequence, KV head)
//! and serves all query heads of the group, so each K/V row is read once per task.
//!
//! Softmax in float32 with the maximum subtracted, as torch does; the sums differ
//! from torch's only in rounding order. A bfloat16 model's query, cache and output
//! are bfloat16 ([`paged_attention_decode_bf16`]): each row is widened as it is read
//! (float32 reads it in place), the output rounded once.

use crate::bf16::Elem;
use crate::math::{dispatch, dot, exp};
use crate::pool::for_each_task;
use crate::{KernelError, Rows, SharedMut};

/// Layout of the paged pool: `num_blocks` blocks `block_stride` elements apart (the
/// arena's page size: a page holds every attention layer's block), each
/// `[block_size, kv_heads, head_dim]` contiguous.
#[derive(Clone, Copy, Debug)]
pub struct PagedKv<'a, T = f32> {
    pub k_cache: &'a [T],
    pub v_cache: &'a [T],
    pub block_size: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub num_blocks: usize,
    pub block_stride: usize,
}

/// The decode sequences of a step.
#[derive(Clone, Copy, Debug)]
pub struct DecodeSeqs<'a> {
    /// Row of `q` (and of `out`) holding each sequence's query.
    pub rows: &'a [i64],
    /// Tokens with K/V, the query's own included.
    pub seq_lens: &'a [i64],
    /// `[n, width]` physical block ids, one row per listed sequence.
    pub block_tables: &'a [i32],
    pub width: usize,
}

struct Ctx<'a, T = f32> {
    q: Rows<'a, T>,
    kv: PagedKv<'a, T>,
    seqs: DecodeSeqs<'a>,
    heads: usize,
    scale: f32,
    out: SharedMut<T>,
}

/// `out[rows[i]]` = attention of `q[rows[i]]` (`[Hq * D]`) over sequence `i`'s
/// `seq_lens[i]` keys; other rows of `out` are left as they are.
/// O(sum of seq_lens * Hq * D).
pub fn paged_attention_decode(
    q: Rows<'_>,
    kv: PagedKv<'_>,
    seqs: DecodeSeqs<'_>,
    heads: usize,
    scale: f32,
    out: &mut [f32],
) -> Result<(), KernelError> {
    decode_with(q, kv, seqs, heads, scale, out, run_task_f32)
}

/// [`paged_attention_decode`] for a bfloat16 model: `q`, the caches and `out` are
/// bfloat16 bits.
pub fn paged_attention_decode_bf16(
    q: Rows<'_, u16>,
    kv: PagedKv<'_, u16>,
    seqs: DecodeSeqs<'_>,
    heads: usize,
    scale: f32,
    out: &mut [u16],
) -> Result<(), KernelError> {
    decode_with(q, kv, seqs, heads, scale, out, run_task_bf16)
}

fn decode_with<T: Elem>(
    q: Rows<'_, T>,
    kv: PagedKv<'_, T>,
    seqs: DecodeSeqs<'_>,
    heads: usize,
    scale: f32,
    out: &mut [T],
    run_task: fn(&Ctx<'_, T>, (usize, usize), usize),
) -> Result<(), KernelError> {
    let PagedKv {
        block_size: bs,
        kv_heads: hkv,
        head_dim: d,
        ..
    } = kv;
    if bs == 0 || hkv == 0 || d == 0 || heads % hkv != 0 || heads == 0 {
        return Err(KernelError::new(format!(
            "query heads ({heads}) must be a positive multiple of KV heads ({hkv}); block size and head dim positive"
        )));
    }
    let row_len = bs * hkv * d;
    let extent = kv.num_blocks.saturating_sub(1) * kv.block_stride + row_len;
    if kv.block_stride < row_len || kv.k_cache.len() < extent || kv.v_cache.len() < extent {
        return Err(KernelError::new(format!(
            "k_cache and v_cache must both hold {} blocks of [{bs}, {hkv}, {d}] {} elements apart",
            kv.num_blocks, kv.block_stride
        )));
    }
    let num_blocks = kv.num_blocks as i64;
    if q.width != heads * d || out.len() != q.rows * heads * d {
        return Err(KernelError::new(format!(
            "q and out must be [T, Hq*D = {}]",
            heads * d
        )));
    }
    let n = seqs.rows.len();
    if seqs.seq_lens.len() != n || seqs.block_tables.len() != n * seqs.width {
        return Err(KernelError::new(format!(
            "seq_lens must have {n} entries and block_tables be [{n}, width]"
        )));
    }
    let mut seen = vec![false; q.rows];
    for i in 0..n {
        let (r, len) = (seqs.rows[i], seqs.seq_lens[i]);
        if r < 0 || r as usize >= q.rows || seen[r as usize] {
            return Err(KernelError::new(format!(
                "row {r} of sequence {i} is out of 0..{} or listed twice",
                q.rows
            )));
        }
        seen[r as usize] = true;
        let nb = (len.max(0) as usize).div_ceil(bs);
        if len < 1 || nb > seqs.width {
            return Err(KernelError::new(format!(
                "sequence {i} has {len} tokens: it needs 1..={} (block table width {} x block size {bs})",
                seqs.width * bs,
                seqs.width
            )));
        }
        if let Some(bad) = seqs.block_tables[i * seqs.width..i * seqs.width + nb]
            .iter()
            .find(|&&blk| blk < 0 || blk as i64 >= num_blocks)
        {
            return Err(KernelError::new(format!(
                "sequence {i} names block {bad}, outside 0..{num_blocks}"
            )));
        }
    }
    let ctx = Ctx {
        q,
        kv,
        seqs,
        heads,
        scale,
        out: SharedMut::new(out),
    };
    // Entries that share a block-table row (a speculative verify run's rows: one
    // query per row, each seeing one position more) form one group: a task reads each
    // K/V row once for all of them. Each entry's sums are the ones it gets alone.
    let w = seqs.width;
    let mut groups: Vec<(usize, usize)> = Vec::new();
    for i in 0..n {
        match groups.last_mut() {
            Some((_, end)) if seqs.block_tables[(i - 1) * w..i * w] == seqs.block_tables[i * w..(i + 1) * w] => {
                *end = i + 1
            }
            _ => groups.push((i, i + 1)),
        }
    }
    let work: usize = seqs.seq_lens.iter().map(|&l| l as usize).sum::<usize>() * heads * d * 2;
    for_each_task(groups.len() * hkv, work, |t| {
        run_task(&ctx, groups[t / hkv], t % hkv)
    });
    Ok(())
}

dispatch!(fn run_task_f32(ctx: &Ctx<'_, f32>, g: (usize, usize), j: usize) => body_f32);
dispatch!(fn run_task_bf16(ctx: &Ctx<'_, u16>, g: (usize, usize), j: usize) => body_bf16);

#[inline(always)]
fn body_f32(ctx: &Ctx<'_, f32>, g: (usize, usize), j: usize) {
    run_task_body(ctx, g, j)
}

#[inline(always)]
fn body_bf16(ctx: &Ctx<'_, u16>, g: (usize, usize), j: usize) {
    run_task_body(ctx, g, j)
}

/// KV head `j` of the entries `g.0 .. g.1` (one block-table row): for every position,
/// the K row (then the V row) is read and widened once, and used by each entry that
/// sees it. Per entry and query head the arithmetic is that of an entry alone: its
/// scores in position order, the softmax over its own length, its weighted V rows
/// summed in position order, so a row's output does not depend on its group.
#[inline(always)]
fn run_task_body<T: Elem>(ctx: &Ctx<'_, T>, (g0, g1): (usize, usize), j: usize) {
    let PagedKv {
        block_size: bs,
        kv_heads: hkv,
        head_dim: d,
        ..
    } = ctx.kv;
    let rep = ctx.heads / hkv;
    let ne = g1 - g0;
    let lens: Vec<usize> = (g0..g1).map(|i| ctx.seqs.seq_lens[i] as usize).collect();
    let max_len = lens.iter().copied().max().unwrap_or(0);
    let table = &ctx.seqs.block_tables[g0 * ctx.seqs.width..(g0 + 1) * ctx.seqs.width];
    // Every entry's query heads of the group, widened: [ne, rep * d].
    let mut qbuf = vec![0.0f32; if std::mem::size_of::<T>() == 4 { 0 } else { ne * rep * d }];
    let qrows: Vec<&[f32]> = if std::mem::size_of::<T>() == 4 {
        (g0..g1)
            .map(|i| T::widen(&ctx.q.row(ctx.seqs.rows[i] as usize)[j * rep * d..(j + 1) * rep * d], &mut []))
            .collect()
    } else {
        for (e, i) in (g0..g1).enumerate() {
            let src = &ctx.q.row(ctx.seqs.rows[i] as usize)[j * rep * d..(j + 1) * rep * d];
            for (x, &v) in qbuf[e * rep * d..(e + 1) * rep * d].iter_mut().zip(src) {
                *x = v.get();
            }
        }
        qbuf.chunks_exact(rep * d).collect()
    };
    // Where a bfloat16 K or V row is widened (unused for float32).
    let mut rowbuf = vec![0.0f32; if std::mem::size_of::<T>() == 4 { 0 } else { d }];
    let stride = ctx.kv.block_stride;
    // Scores, per entry [rep, len_e] from offset `off[e]`.
    let mut off = Vec::with_capacity(ne);
    let mut total = 0;
    for &l in &lens {
        off.push(total);
        total += rep * l;
    }
    let mut p = vec![0.0f32; total];
    // Position `pos` in block `blk` at row `r` of the block: no division per position.
    // (This walk and the V pass's are written out: as closures given to one shared
    // walker the kernel ran much slower, see benches/RESULTS.md, "the verify step's cost".)
    let mut pos = 0;
    for &blk in table.iter().take(max_len.div_ceil(bs)) {
        let base = blk as usize * stride + j * d;
        for r in 0..bs.min(max_len - pos) {
            let at = base + r * hkv * d;
            let krow = T::widen(&ctx.kv.k_cache[at..at + d], &mut rowbuf);
            for e in 0..ne {
                let len = lens[e];
                if pos < len {
                    let q = qrows[e];
                    for h in 0..rep {
                        p[off[e] + h * len + pos] = dot(&q[h * d..(h + 1) * d], krow) * ctx.scale;
                    }
                }
            }
            pos += 1;
        }
    }
    let mut inv = vec![0.0f32; ne * rep];
    for e in 0..ne {
        let len = lens[e];
        for h in 0..rep {
            let s = &mut p[off[e] + h * len..off[e] + (h + 1) * len];
            let m = s.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            for x in s.iter_mut() {
                *x = exp(*x - m);
            }
            let mut lanes = [0.0f32; 8];
            let chunks = s.chunks_exact(8);
            let tail: f32 = chunks.remainder().iter().sum();
            for ch in chunks {
                for l in 0..8 {
                    lanes[l] += ch[l];
                }
            }
            inv[e * rep + h] = 1.0 / (lanes.iter().sum::<f32>() + tail);
        }
    }
    let mut acc = vec![0.0f32; ne * rep * d];
    let mut pos = 0;
    for &blk in table.iter().take(max_len.div_ceil(bs)) {
        let base = blk as usize * stride + j * d;
        for r in 0..bs.min(max_len - pos) {
            let at = base + r * hkv * d;
            let vrow = T::widen(&ctx.kv.v_cache[at..at + d], &mut rowbuf);
            for e in 0..ne {
                let len = lens[e];
                if pos < len {
                    for h in 0..rep {
                        let w = p[off[e] + h * len + pos];
                        let a = &mut acc[(e * rep + h) * d..(e * rep + h + 1) * d];
                        for (a, &v) in a.iter_mut().zip(vrow) {
                            *a += w * v;
                        }
                    }
                }
            }
            pos += 1;
        }
    }
    for (e, i) in (g0..g1).enumerate() {
        let row = ctx.seqs.rows[i] as usize;
        // SAFETY: this row's query heads j*rep .. (j+1)*rep belong to this task (rows
        // are distinct among entries, validated; one task per group and KV head).
        let dst = unsafe { ctx.out.slice((row * ctx.heads + j * rep) * d, rep * d) };
        for h in 0..rep {
            let a = &acc[(e * rep + h) * d..(e * rep + h + 1) * d];
            for (o, &x) in dst[h * d..(h + 1) * d].iter_mut().zip(a) {
                *o = T::narrow(x * inv[e * rep + h]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tests' data: a value in [0, 1) from a linear congruential stream.
    fn unit(seed: &mut u64) -> f32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
        (*seed >> 40) as f32 / (1u64 << 24) as f32
    }

    #[test]
    fn matches_softmax_attention_over_scattered_blocks() {
        let (bs, hkv, d, heads, nblocks) = (4usize, 2usize, 8usize, 4usize, 9usize);
        // Blocks a page apart: another layer's block and padding sit between them.
        let stride = 2 * bs * hkv * d + 5;
        let mut seed = 11u64;
        let mut rnd = || unit(&mut seed) - 0.5;
        let kc: Vec<f32> = (0..nblocks * stride).map(|_| rnd()).collect();
        let vc: Vec<f32> = (0..nblocks * stride).map(|_| rnd()).collect();
        let t = 3;
        let q: Vec<f32> = (0..t * heads * d).map(|_| rnd()).collect();
        let rows = [2i64, 0];
        let lens = [10i64, 1];
        let width = 3;
        let tables = [7i32, 2, 5, 4, 0, 0];
        let mut out = vec![-1.0f32; t * heads * d];
        paged_attention_decode(
            Rows::dense(&q, heads * d).unwrap(),
            PagedKv {
                k_cache: &kc,
                v_cache: &vc,
                block_size: bs,
                kv_heads: hkv,
                head_dim: d,
                num_blocks: nblocks,
                block_stride: stride,
            },
            DecodeSeqs {
                rows: &rows,
                seq_lens: &lens,
                block_tables: &tables,
                width,
            },
            heads,
            0.3,
            &mut out,
        )
        .unwrap();
        for (i, (&row, &len)) in rows.iter().zip(&lens).enumerate() {
            for h in 0..heads {
                let j = h / (heads / hkv);
                let at = |p: usize| {
                    tables[i * width + p / bs] as usize * stride + ((p % bs) * hkv + j) * d
                };
                let qh = &q[(row as usize * heads + h) * d..][..d];
                let s: Vec<f64> = (0..len as usize)
                    .map(|p| {
                        (0..d)
                            .map(|x| qh[x] as f64 * kc[at(p) + x] as f64)
                            .sum::<f64>()
                            * 0.3
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for x in 0..d {
                    let want: f64 = (0..len as usize)
                        .map(|p| e[p] / z * vc[at(p) + x] as f64)
                        .sum();
                    let got = out[(row as usize * heads + h) * d + x];
                    assert!(
                        (got as f64 - want).abs() < 1e-5,
                        "seq {i} head {h} dim {x}: {got} want {want}"
                    );
                }
            }
        }
        // row 1 is not a decode row: untouched
        assert!(out[heads * d..2 * heads * d].iter().all(|&v| v == -1.0));
    }

    #[test]
    fn rows_sharing_a_block_table_get_the_bits_they_get_alone() {
        // A verify run: 4 rows of one sequence (one block-table row, lengths 7..10) next
        // to another sequence; each row's output must equal a call with that row alone.
        use crate::bf16::from_f32;
        let (bs, hkv, d, heads, nblocks) = (4usize, 2usize, 16usize, 4usize, 9usize);
        let stride = 2 * bs * hkv * d + 5;
        let mut seed = 3u64;
        let mut rnd = || from_f32(unit(&mut seed) * 2.0 - 1.0);
        let kc: Vec<u16> = (0..nblocks * stride).map(|_| rnd()).collect();
        let vc: Vec<u16> = (0..nblocks * stride).map(|_| rnd()).collect();
        let t = 6;
        let q: Vec<u16> = (0..t * heads * d).map(|_| rnd()).collect();
        let kv = PagedKv {
            k_cache: &kc,
            v_cache: &vc,
            block_size: bs,
            kv_heads: hkv,
            head_dim: d,
            num_blocks: nblocks,
            block_stride: stride,
        };
        let width = 3;
        let run = [7i32, 2, 5];
        let other = [4i32, 0, 0];
        let rows = [0i64, 1, 2, 3, 5];
        let lens = [7i64, 8, 9, 10, 3];
        let tables: Vec<i32> = [run, run, run, run, other].concat();
        let mut together = vec![0u16; t * heads * d];
        let seqs = DecodeSeqs { rows: &rows, seq_lens: &lens, block_tables: &tables, width };
        let qrows = Rows::dense(&q, heads * d).unwrap();
        paged_attention_decode_bf16(qrows, kv, seqs, heads, 0.25, &mut together).unwrap();
        for i in 0..rows.len() {
            let mut alone = vec![0u16; t * heads * d];
            let one = DecodeSeqs {
                rows: &rows[i..i + 1],
                seq_lens: &lens[i..i + 1],
                block_tables: &tables[i * width..(i + 1) * width],
                width,
            };
            paged_attention_decode_bf16(qrows, kv, one, heads, 0.25, &mut alone).unwrap();
            let r = rows[i] as usize * heads * d..(rows[i] as usize + 1) * heads * d;
            assert_eq!(together[r.clone()], alone[r], "row {}", rows[i]);
        }
        // Row 4 is not a decode row: untouched.
        assert!(together[4 * heads * d..5 * heads * d].iter().all(|&v| v == 0));
    }

    #[test]
    fn bf16_matches_the_float32_kernel_on_bf16_values() {
        use crate::bf16::{from_f32, to_f32};
        let (bs, hkv, d, heads, nblocks) = (4usize, 2usize, 16usize, 6usize, 9usize);
        let stride = 2 * bs * hkv * d + 3;
        let mut seed = 7u64;
        let mut rnd = || to_f32(from_f32(unit(&mut seed) * 3.0 - 1.5));
        let kc: Vec<f32> = (0..nblocks * stride).map(|_| rnd()).collect();
        let vc: Vec<f32> = (0..nblocks * stride).map(|_| rnd()).collect();
        let t = 4;
        let q: Vec<f32> = (0..t * heads * d).map(|_| rnd()).collect();
        let (rows, lens, width) = ([3i64, 0, 1], [10i64, 1, 7], 3);
        let tables = [7i32, 2, 5, 4, 0, 0, 1, 8, 0];
        let seqs = DecodeSeqs {
            rows: &rows,
            seq_lens: &lens,
            block_tables: &tables,
            width,
        };
        fn layout<'a, T>(k: &'a [T], v: &'a [T], dims: [usize; 5]) -> PagedKv<'a, T> {
            let [block_size, kv_heads, head_dim, num_blocks, block_stride] = dims;
            PagedKv {
                k_cache: k,
                v_cache: v,
                block_size,
                kv_heads,
                head_dim,
                num_blocks,
                block_stride,
            }
        }
        let dims = [bs, hkv, d, nblocks, stride];
        let mut o32 = vec![0.0f32; t * heads * d];
        paged_attention_decode(
            Rows::dense(&q, heads * d).unwrap(),
            layout(&kc, &vc, dims),
            seqs,
            heads,
            0.25,
            &mut o32,
        )
        .unwrap();
        let bits = |v: &[f32]| v.iter().map(|&f| from_f32(f)).collect::<Vec<u16>>();
        let (qb, kb, vb) = (bits(&q), bits(&kc), bits(&vc));
        let mut o16 = vec![0x7fc0u16; t * heads * d];
        paged_attention_decode_bf16(
            Rows::dense(&qb, heads * d).unwrap(),
            layout(&kb, &vb, dims),
            seqs,
            heads,
            0.25,
            &mut o16,
        )
        .unwrap();
        for &row in &rows {
            for x in row as usize * heads * d..(row as usize + 1) * heads * d {
                let (g, w) = (to_f32(o16[x]), o32[x]);
                assert!((g - w).abs() <= w.abs() * 2f32.powi(-8) + 1e-6, "{x}: {g} vs {w}");
            }
        }
        // Row 2 is not a decode row: untouched.
        assert!(o16[2 * heads * d..3 * heads * d].iter().all(|&v| v == 0x7fc0));
    }
}
