//! The many-row GEMM on quantized weights (prefill): `out = x W^T` for many activation
//! rows, with llama.cpp's rounding (each `x` row quantized to Q8_0 / Q8_K as
//! [`super::act`] does, for the few-row kernels too).
//!
//! The few-row kernels stream each weight row past a handful of activation rows. Here a
//! tile of [`NR`] weight rows is unpacked once into signed bytes laid out
//! `[K / 4][NR][4]` (plus each group's integer scale, min and byte sum, each block's
//! float scales), and every activation row runs against it [`MR`] at a time: one
//! `vpdpbusd` takes four products for each of eight outputs, the activation's four bytes
//! broadcast, so the unpacking is paid once per tile instead of once per row.
//!
//! `vpdpbusd` multiplies unsigned by signed bytes. The weights are the signed side
//! (Q8_0's `q`, Q4_0's `q - 8`, Q5_0's `q - 16`, Q6_K's `q - 32`; Q5_1 / Q4_K / Q5_K are
//! non-negative), the activations the unsigned one, offset by 128 (`q ^ 0x80`): each
//! group's sum then carries `128 * sum(w)`, which the accumulator starts at minus.
//! Integer sums are exact, so only the float steps matter, and they are those of
//! [`super::dot_scalar`] per output (for the 32-weight blocks its eight accumulators,
//! block `b` into `b % 8`, summed pairwise): the results equal the few-row kernels' bit
//! for bit, every type and every instruction set.
//!
//! Without AVX-512 VNNI this runs the few-row GEMM ([`super::gemm::quant_matmul_with`]),
//! whose results it equals.

use super::act::{quantize_q8_0, quantize_q8_k};
use super::blocks::{rd_f16, scale_min_k4, GgmlType, QK_K};
use super::gemm::quant_matmul_with;
use super::QIsa;
use crate::bf16::{from_f32, Elem};
use crate::matmul_bf16::Out;
use crate::pool::for_each_task;
use crate::{KernelError, Rows};

/// Weight rows per tile (two 8-lane registers).
pub const NR: usize = 16;
/// Activation rows per register block.
pub const MR: usize = 4;
/// Tiles per task: a block of activation rows runs against each while it sits in L1.
const TASK_TILES: usize = 4;

/// The float steps a type takes per block (see [`super::dot_scalar::dot`]).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Q8_0 / Q4_0 / Q5_0: `acc += (d dx) s`.
    B32,
    /// Q5_1: then `acc += (m dx) sum(x)`.
    B32Min,
    /// Q4_K / Q5_K: `acc += (d dx) sum(sc s) - (dmin dx) sum(mn sum(x))`, groups of 32.
    K45,
    /// Q6_K: `acc += (d dx) sum(sc s)`, groups of 16.
    K6,
}

fn kind(ty: GgmlType) -> Kind {
    match ty {
        GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q5_0 => Kind::B32,
        GgmlType::Q5_1 => Kind::B32Min,
        GgmlType::Q4K | GgmlType::Q5K => Kind::K45,
        GgmlType::Q6K => Kind::K6,
    }
}

/// Weights per group (one integer scale).
fn group(ty: GgmlType) -> usize {
    if ty == GgmlType::Q6K {
        16
    } else {
        32
    }
}

/// One block's integer weights (`q`, `block_size` long, signed as the module doc
/// says), its groups' integer scales and mins, and its float scale and min.
fn unpack_block(ty: GgmlType, b: &[u8], q: &mut [i8], sc: &mut [i32], mn: &mut [i32]) -> (f32, f32) {
    match ty {
        GgmlType::Q8_0 => {
            for (o, &v) in q.iter_mut().zip(&b[2..34]) {
                *o = v as i8;
            }
            (rd_f16(b, 0), 0.0)
        }
        GgmlType::Q4_0 => {
            for i in 0..16 {
                q[i] = (b[2 + i] & 0xF) as i8 - 8;
                q[i + 16] = (b[2 + i] >> 4) as i8 - 8;
            }
            (rd_f16(b, 0), 0.0)
        }
        GgmlType::Q5_0 | GgmlType::Q5_1 => {
            let one = ty == GgmlType::Q5_1;
            let at = if one { 4 } else { 2 };
            let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
            let qs = &b[at + 4..at + 20];
            let off = if one { 0 } else { 16 };
            for i in 0..16 {
                let lo = (qs[i] & 0xF) as u32 | (((qh >> i) & 1) << 4);
                let hi = (qs[i] >> 4) as u32 | (((qh >> (i + 16)) & 1) << 4);
                q[i] = lo as i8 - off;
                q[i + 16] = hi as i8 - off;
            }
            (rd_f16(b, 0), if one { rd_f16(b, 2) } else { 0.0 })
        }
        GgmlType::Q4K | GgmlType::Q5K => {
            let five = ty == GgmlType::Q5K;
            // Fixed-size arrays: the loops vectorize without bounds checks.
            let (qh, qs): (&[u8; 32], &[u8; 128]) = if five {
                (b[16..48].try_into().unwrap(), b[48..176].try_into().unwrap())
            } else {
                (&[0u8; 32], b[16..144].try_into().unwrap())
            };
            let q: &mut [i8; 256] = (&mut q[..256]).try_into().unwrap();
            for j in 0..8 {
                let (s, m) = scale_min_k4(j, &b[4..16]);
                sc[j] = s as i32;
                mn[j] = m as i32;
                let shift = 4 * (j % 2) as u32;
                let run: &[u8; 32] = qs[32 * (j / 2)..32 * (j / 2) + 32].try_into().unwrap();
                let o: &mut [i8] = &mut q[32 * j..32 * j + 32];
                for l in 0..32 {
                    o[l] = (((run[l] >> shift) & 0xF) | (((qh[l] >> j) & 1) << 4)) as i8;
                }
            }
            (rd_f16(b, 0), rd_f16(b, 2))
        }
        GgmlType::Q6K => {
            let (ql, qh, s) = (&b[0..128], &b[128..192], &b[192..208]);
            let q: &mut [i8; 256] = (&mut q[..256]).try_into().unwrap();
            for g in 0..8 {
                let (h, k) = (g / 4, g % 4);
                let lo: &[u8; 32] = ql[64 * h + 32 * (k % 2)..64 * h + 32 * (k % 2) + 32].try_into().unwrap();
                let hi: &[u8; 32] = qh[32 * h..32 * h + 32].try_into().unwrap();
                let shift = 4 * (k / 2) as u32;
                let o: &mut [i8] = &mut q[32 * g..32 * g + 32];
                for l in 0..32 {
                    o[l] = ((((lo[l] >> shift) & 0xF) | (((hi[l] >> (2 * k)) & 3) << 4)) as i8).wrapping_sub(32);
                }
            }
            for (o, &v) in sc.iter_mut().zip(s) {
                *o = v as i8 as i32;
            }
            (rd_f16(b, 208), 0.0)
        }
    }
}

/// [`NR`] weight rows unpacked: `q` `[K / 4][NR][4]`, per group `[G][NR]` the integer
/// scale `sc`, min `mn` and `-128 sum(q)` (`off`), per block `[B][NR]` `d` and `m`.
/// Rows past the weight's end are zeros.
struct Tile {
    q: Vec<i8>,
    sc: Vec<i32>,
    mn: Vec<i32>,
    off: Vec<i32>,
    d: Vec<f32>,
    m: Vec<f32>,
}

impl Tile {
    fn new(ty: GgmlType, k: usize) -> Tile {
        let (nb, ng) = (k / ty.block_size(), k / group(ty));
        Tile {
            q: vec![0; k * NR],
            sc: vec![1; ng * NR],
            mn: vec![0; ng * NR],
            off: vec![0; ng * NR],
            d: vec![0.0; nb * NR],
            m: vec![0.0; nb * NR],
        }
    }

    /// Unpacks weight rows `rows` (`rows.len() / rb` of them, at most [`NR`]), compiled
    /// for AVX2 (only VNNI CPUs run the tiles): the unpacking loops vectorize 32 wide.
    ///
    /// # Safety
    /// The CPU has AVX2.
    #[cfg_attr(target_arch = "x86_64", target_feature(enable = "avx2,fma,f16c"))]
    unsafe fn pack(&mut self, ty: GgmlType, k: usize, rows: &[u8], rb: usize) {
        self.pack_impl(ty, k, rows, rb)
    }

    #[inline(always)]
    fn pack_impl(&mut self, ty: GgmlType, k: usize, rows: &[u8], rb: usize) {
        let (bs, gs) = (ty.block_size(), group(ty));
        let (nb, gpb) = (k / bs, bs / gs);
        let n = rows.len() / rb;
        let mut q = vec![0i8; bs];
        let (mut sc, mut mn) = ([1i32; 16], [0i32; 16]);
        for c in 0..NR {
            for b in 0..nb {
                if c >= n {
                    q.fill(0);
                    sc.fill(0);
                    mn.fill(0);
                    self.d[b * NR + c] = 0.0;
                    self.m[b * NR + c] = 0.0;
                } else {
                    let blk = &rows[c * rb + b * ty.block_bytes()..c * rb + (b + 1) * ty.block_bytes()];
                    let (d, m) = unpack_block(ty, blk, &mut q, &mut sc, &mut mn);
                    self.d[b * NR + c] = d;
                    self.m[b * NR + c] = m;
                }
                for g in 0..gpb {
                    let gi = b * gpb + g;
                    let qg = &q[g * gs..(g + 1) * gs];
                    self.off[gi * NR + c] = -128 * qg.iter().map(|&v| v as i32).sum::<i32>();
                    if ty.is_k() {
                        self.sc[gi * NR + c] = sc[g];
                        self.mn[gi * NR + c] = mn[g];
                    }
                }
                let dst = &mut self.q[b * bs * NR..(b + 1) * bs * NR];
                for (s, v) in q.chunks_exact(4).enumerate() {
                    let at = (s * NR + c) * 4;
                    dst[at..at + 4].copy_from_slice(v);
                }
            }
        }
    }
}

/// Activation rows quantized for this kernel: `xu` the bytes offset by 128, `d` each
/// block's scale, `sums` the 16-sums (Q8_K) or block sums (Q8_0), as [`super::act::QAct`].
struct Acts {
    xu: Vec<u8>,
    d: Vec<f32>,
    sums: Vec<i32>,
    /// Activation values per scale, and per entry of `sums`.
    block: usize,
    sgroup: usize,
}

impl Acts {
    fn new<T: Elem>(x: &Rows<'_, T>, k_quant: bool) -> Acts {
        let (m, k) = (x.rows, x.width);
        let block = if k_quant { QK_K } else { 32 };
        let sgroup = if k_quant { 16 } else { 32 };
        let mut a = Acts {
            xu: vec![0; m * k],
            d: vec![0.0; m * k / block],
            sums: vec![0; m * k / sgroup],
            block,
            sgroup,
        };
        #[derive(Clone, Copy)]
        struct P(*mut u8, *mut f32, *mut i32);
        unsafe impl Send for P {}
        unsafe impl Sync for P {}
        let p = P(a.xu.as_mut_ptr(), a.d.as_mut_ptr(), a.sums.as_mut_ptr());
        const ROWS: usize = 8;
        for_each_task(m.div_ceil(ROWS), m * k * 4, |task| {
            let p = p;
            let mut buf = T::scratch(k);
            let mut qs = vec![0i8; k];
            for t in task * ROWS..((task + 1) * ROWS).min(m) {
                let xr = T::widen(x.row(t), &mut buf);
                // SAFETY: row t's slices belong to this task alone.
                let (xu, d, sums) = unsafe {
                    (
                        std::slice::from_raw_parts_mut(p.0.add(t * k), k),
                        std::slice::from_raw_parts_mut(p.1.add(t * k / block), k / block),
                        std::slice::from_raw_parts_mut(p.2.add(t * k / sgroup), k / sgroup),
                    )
                };
                // SAFETY: only AVX-512 VNNI CPUs get here, and they have AVX2.
                unsafe { quantize_row(k_quant, xr, &mut qs, d, sums, xu) };
            }
        });
        a
    }
}

/// One activation row quantized (as [`super::act`] does, the same code) and offset by
/// 128. Compiled for AVX2 so the roundings inline as `vroundps` (bit-identical to the
/// libm calls the generic build makes, and a large part of the time without it).
///
/// # Safety
/// The CPU has AVX2, FMA and F16C.
#[cfg_attr(target_arch = "x86_64", target_feature(enable = "avx2,fma,f16c"))]
unsafe fn quantize_row(k_quant: bool, xr: &[f32], qs: &mut [i8], d: &mut [f32], sums: &mut [i32], xu: &mut [u8]) {
    if k_quant {
        quantize_q8_k(xr, qs, d, sums);
    } else {
        quantize_q8_0(xr, qs, d);
        for (s, b) in sums.iter_mut().zip(qs.chunks_exact(32)) {
            *s = b.iter().map(|&q| q as i32).sum();
        }
    }
    for (u, &q) in xu.iter_mut().zip(qs.iter()) {
        *u = (q as u8) ^ 0x80;
    }
}

#[derive(Clone, Copy)]
enum OutPtr {
    F32(*mut f32),
    Bf16(*mut u16),
}
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// `out = x W^T` for many rows: `x` `[M, K]` float32 or bfloat16 (row-strided view
/// allowed), `w` `[N, row_bytes]` blocks of `ty`, `out` `[M, N]` row-major. Equal to
/// [`super::quant_matmul`] on the scalar instruction set, bit for bit.
pub fn quant_matmul_prefill<T: Elem>(x: Rows<'_, T>, w: &[u8], ty: GgmlType, out: Out<'_>) -> Result<(), KernelError> {
    quant_matmul_prefill_with(QIsa::detect(), x, w, ty, out)
}

/// [`quant_matmul_prefill`] on a named instruction set: the tiled kernel on
/// AVX-512 VNNI, the few-row GEMM on the others.
pub fn quant_matmul_prefill_with<T: Elem>(
    isa: QIsa,
    x: Rows<'_, T>,
    w: &[u8],
    ty: GgmlType,
    mut out: Out<'_>,
) -> Result<(), KernelError> {
    if isa != QIsa::Avx512Vnni || !isa.supported() {
        return quant_matmul_with(isa, x, w, ty, out);
    }
    let (m, k) = (x.rows, x.width);
    if k == 0 || k % ty.block_size() != 0 {
        return Err(KernelError::new(format!(
            "{} rows hold whole blocks of {}; K={k} is not a multiple",
            ty.name(),
            ty.block_size()
        )));
    }
    let rb = ty.row_bytes(k);
    if w.len() % rb != 0 {
        return Err(KernelError::new(format!(
            "w must be [N, {rb}] bytes ({} rows of K={k}); got {} bytes",
            ty.name(),
            w.len()
        )));
    }
    let n = w.len() / rb;
    let (ptr, olen) = match &mut out {
        Out::F32(o) => (OutPtr::F32(o.as_mut_ptr()), o.len()),
        Out::Bf16(o) => (OutPtr::Bf16(o.as_mut_ptr()), o.len()),
    };
    if olen != m * n {
        return Err(KernelError::new(format!("out must be [M={m}, N={n}]; got {olen} elements")));
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    let acts = Acts::new(&x, ty.is_k());
    let acts = &acts;
    let tiles = n.div_ceil(NR);
    for_each_task(tiles.div_ceil(TASK_TILES), m * n * k / 16, |task| {
        let t0 = task * TASK_TILES;
        let tl: Vec<(usize, usize, Tile)> = (t0..(t0 + TASK_TILES).min(tiles))
            .map(|ti| {
                let (j0, j1) = (ti * NR, (ti * NR + NR).min(n));
                let mut tile = Tile::new(ty, k);
                // SAFETY: only AVX-512 VNNI CPUs get here, and they have AVX2.
                unsafe { tile.pack(ty, k, &w[j0 * rb..j1 * rb], rb) };
                (j0, j1, tile)
            })
            .collect();
        let mut res = [[0.0f32; NR]; MR];
        let mut t = 0;
        while t < m {
            let r = (m - t).min(MR);
            // Short last block: its missing rows repeat the last one (not stored).
            let rows: [usize; MR] = std::array::from_fn(|i| t + i.min(r - 1));
            // Every tile of the task against these rows, while they are in L1.
            for (j0, j1, tile) in &tl {
                let (j0, j1) = (*j0, *j1);
                #[cfg(target_arch = "x86_64")]
                // SAFETY: VNNI was checked above; the tile and the rows hold K values.
                unsafe {
                    match kind(ty) {
                        Kind::B32 => vnni::block::<{ Kind::B32 as u8 }>(tile, acts, rows, k, &mut res),
                        Kind::B32Min => vnni::block::<{ Kind::B32Min as u8 }>(tile, acts, rows, k, &mut res),
                        Kind::K45 => vnni::block::<{ Kind::K45 as u8 }>(tile, acts, rows, k, &mut res),
                        Kind::K6 => vnni::block::<{ Kind::K6 as u8 }>(tile, acts, rows, k, &mut res),
                    }
                }
                for (i, rr) in res.iter().enumerate().take(r) {
                    for (c, &v) in rr.iter().enumerate().take(j1 - j0) {
                        let at = (t + i) * n + j0 + c;
                        // SAFETY: columns j0..j1 belong to this task alone.
                        unsafe {
                            match ptr {
                                OutPtr::F32(p) => *p.add(at) = v,
                                OutPtr::Bf16(p) => *p.add(at) = from_f32(v),
                            }
                        }
                    }
                }
            }
            t += r;
        }
    });
    Ok(())
}

#[cfg(target_arch = "x86_64")]
mod vnni {
    use super::{Acts, Kind, Tile, MR, NR};
    use std::arch::x86_64::*;

    const B32: u8 = Kind::B32 as u8;
    const B32MIN: u8 = Kind::B32Min as u8;
    const K45: u8 = Kind::K45 as u8;
    const K6: u8 = Kind::K6 as u8;

    /// `res[i][c]` = activation row `rows[i]` times tile row `c`, all K.
    ///
    /// # Safety
    /// AVX-512 VNNI and VL run on this CPU; the tile and every row hold `k` values.
    #[target_feature(enable = "avx2,fma,avx512f,avx512vl,avx512vnni")]
    pub(super) unsafe fn block<const KIND: u8>(
        tile: &Tile,
        a: &Acts,
        rows: [usize; MR],
        k: usize,
        res: &mut [[f32; NR]; MR],
    ) {
        let (bs, gs) = match KIND {
            B32 | B32MIN => (32, 32),
            K45 => (256, 32),
            K6 => (256, 16),
            _ => unreachable!(),
        };
        let (nb, gpb) = (k / bs, bs / gs);
        let mut f = [[_mm256_setzero_ps(); 2]; MR];
        // The 32-weight blocks: block `b` into accumulator `b % 8`, the eight summed
        // pairwise at the end (`dot_scalar::dot`'s order, which every few-row path takes).
        let mut lanes8 = [[[_mm256_setzero_ps(); 8]; 2]; MR];
        let xp: [*const u8; MR] = std::array::from_fn(|i| a.xu.as_ptr().add(rows[i] * k));
        let qp = tile.q.as_ptr();
        for b in 0..nb {
            let mut isum = [[_mm256_setzero_si256(); 2]; MR];
            let mut mins = [[_mm256_setzero_si256(); 2]; MR];
            for g in 0..gpb {
                let gi = b * gpb + g;
                let off0 = _mm256_loadu_si256(tile.off.as_ptr().add(gi * NR) as *const __m256i);
                let off1 = _mm256_loadu_si256(tile.off.as_ptr().add(gi * NR + 8) as *const __m256i);
                let mut acc = [[off0, off1]; MR];
                let s0 = gi * gs / 4;
                for s in s0..s0 + gs / 4 {
                    let w0 = _mm256_loadu_si256(qp.add(s * NR * 4) as *const __m256i);
                    let w1 = _mm256_loadu_si256(qp.add(s * NR * 4 + 32) as *const __m256i);
                    for i in 0..MR {
                        let x = _mm256_set1_epi32((xp[i].add(4 * s) as *const i32).read_unaligned());
                        acc[i][0] = _mm256_dpbusd_epi32(acc[i][0], x, w0);
                        acc[i][1] = _mm256_dpbusd_epi32(acc[i][1], x, w1);
                    }
                }
                if KIND == B32 || KIND == B32MIN {
                    isum = acc;
                } else {
                    let sc0 = _mm256_loadu_si256(tile.sc.as_ptr().add(gi * NR) as *const __m256i);
                    let sc1 = _mm256_loadu_si256(tile.sc.as_ptr().add(gi * NR + 8) as *const __m256i);
                    for i in 0..MR {
                        isum[i][0] = _mm256_add_epi32(isum[i][0], _mm256_mullo_epi32(acc[i][0], sc0));
                        isum[i][1] = _mm256_add_epi32(isum[i][1], _mm256_mullo_epi32(acc[i][1], sc1));
                    }
                }
            }
            // The min term after the products: its registers are not live in the loop above.
            if KIND == K45 {
                for g in 0..gpb {
                    let gi = b * gpb + g;
                    let mn0 = _mm256_loadu_si256(tile.mn.as_ptr().add(gi * NR) as *const __m256i);
                    let mn1 = _mm256_loadu_si256(tile.mn.as_ptr().add(gi * NR + 8) as *const __m256i);
                    for i in 0..MR {
                        let s = a.sums.as_ptr().add(rows[i] * k / a.sgroup + 16 * b + 2 * g);
                        let bsum = _mm256_set1_epi32(*s + *s.add(1));
                        mins[i][0] = _mm256_add_epi32(mins[i][0], _mm256_mullo_epi32(mn0, bsum));
                        mins[i][1] = _mm256_add_epi32(mins[i][1], _mm256_mullo_epi32(mn1, bsum));
                    }
                }
            }
            // The float steps of `dot_scalar::dot`, lane-wise (no fused multiply-add).
            let d = [_mm256_loadu_ps(tile.d.as_ptr().add(b * NR)), _mm256_loadu_ps(tile.d.as_ptr().add(b * NR + 8))];
            let mv = [_mm256_loadu_ps(tile.m.as_ptr().add(b * NR)), _mm256_loadu_ps(tile.m.as_ptr().add(b * NR + 8))];
            for i in 0..MR {
                let dx = _mm256_set1_ps(*a.d.get_unchecked(rows[i] * k / a.block + b));
                for h in 0..2 {
                    let t1 = _mm256_mul_ps(_mm256_mul_ps(d[h], dx), _mm256_cvtepi32_ps(isum[i][h]));
                    match KIND {
                        K45 => {
                            let t2 = _mm256_mul_ps(_mm256_mul_ps(mv[h], dx), _mm256_cvtepi32_ps(mins[i][h]));
                            f[i][h] = _mm256_add_ps(f[i][h], _mm256_sub_ps(t1, t2));
                        }
                        B32MIN => {
                            let sx = *a.sums.get_unchecked(rows[i] * k / a.sgroup + b) as f32;
                            let t2 = _mm256_mul_ps(_mm256_mul_ps(mv[h], dx), _mm256_set1_ps(sx));
                            let l = &mut lanes8[i][h][b % 8];
                            *l = _mm256_add_ps(*l, _mm256_add_ps(t1, t2));
                        }
                        B32 => {
                            let l = &mut lanes8[i][h][b % 8];
                            *l = _mm256_add_ps(*l, t1);
                        }
                        _ => f[i][h] = _mm256_add_ps(f[i][h], t1),
                    }
                }
            }
        }
        if KIND == B32 || KIND == B32MIN {
            for i in 0..MR {
                for h in 0..2 {
                    let l = &lanes8[i][h];
                    let a = _mm256_add_ps(_mm256_add_ps(l[0], l[4]), _mm256_add_ps(l[2], l[6]));
                    let b = _mm256_add_ps(_mm256_add_ps(l[1], l[5]), _mm256_add_ps(l[3], l[7]));
                    f[i][h] = _mm256_add_ps(a, b);
                }
            }
        }
        for i in 0..MR {
            _mm256_storeu_ps(res[i].as_mut_ptr(), f[i][0]);
            _mm256_storeu_ps(res[i].as_mut_ptr().add(8), f[i][1]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::test_util::{random_weight, Lcg, TYPES};


    /// Row by row and bit for bit: the scalar few-row kernel and the detected instruction
    /// set's few-row kernel (every type), in float32 and bfloat16 out,
    /// for row counts around the register block and column counts around the tile.
    #[test]
    fn equals_the_few_row_kernels() {
        let mut g = Lcg(11);
        for ty in TYPES {
            for &(n, k) in &[(37usize, 512usize), (16, 256), (5, 768), (150, 256)] {
                let w = random_weight(ty, n, k, &mut g);
                for m in [1usize, 3, 4, 9, 33] {
                    let x: Vec<f32> = (0..m * k).map(|_| g.f() * 3.0).collect();
                    let xr = Rows::dense(&x, k).unwrap();
                    let mut got = vec![0.0f32; m * n];
                    quant_matmul_prefill(xr, &w, ty, Out::F32(&mut got)).unwrap();
                    let mut want = vec![0.0f32; m * n];
                    quant_matmul_with(QIsa::Scalar, xr, &w, ty, Out::F32(&mut want)).unwrap();
                    for t in 0..m {
                        assert_eq!(
                            got[t * n..(t + 1) * n].iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                            want[t * n..(t + 1) * n].iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                            "{ty:?} n={n} k={k} m={m} row {t} vs scalar"
                        );
                    }
                    let mut few = vec![0.0f32; m * n];
                    quant_matmul_with(QIsa::detect(), xr, &w, ty, Out::F32(&mut few)).unwrap();
                    assert_eq!(got, few, "{ty:?} m={m} vs {:?}", QIsa::detect());
                    let mut bf = vec![0u16; m * n];
                    quant_matmul_prefill(xr, &w, ty, Out::Bf16(&mut bf)).unwrap();
                    assert!(bf.iter().zip(&want).all(|(&b, &v)| b == from_f32(v)), "{ty:?} bfloat16 out");
                }
            }
        }
    }

    #[test]
    fn bad_shapes_are_refused() {
        let w = vec![0u8; 144 * 2];
        let x = vec![0.0f32; 300];
        let mut out = vec![0.0f32; 2];
        let e = quant_matmul_prefill(Rows::dense(&x, 300).unwrap(), &w, GgmlType::Q4K, Out::F32(&mut out)).unwrap_err();
        assert!(e.0.contains("multiple"), "{}", e.0);
        let x = vec![0.0f32; 256];
        let mut out = vec![0.0f32; 3];
        let e = quant_matmul_prefill(Rows::dense(&x, 256).unwrap(), &w, GgmlType::Q4K, Out::F32(&mut out)).unwrap_err();
        assert!(e.0.contains("out must be"), "{}", e.0);
        let e = quant_matmul_prefill(Rows::dense(&x, 256).unwrap(), &w[..100], GgmlType::Q4K, Out::F32(&mut out))
            .unwrap_err();
        assert!(e.0.contains("w must be"), "{}", e.0);
    }
}

#[cfg(test)]
mod timing {
    use super::*;

    /// `cargo test --release -p hybridserve-cpu-kernels quant::prefill::timing -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn against_the_few_row_gemm() {
        let (n, k) = (2048, 768);
        for ty in [GgmlType::Q8_0, GgmlType::Q5_0, GgmlType::Q4K, GgmlType::Q6K] {
            let w: Vec<u8> = (0..n * ty.row_bytes(k)).map(|i| (i * 7 % 251) as u8 & 0x3f).collect();
            for m in [4usize, 64, 200, 512] {
                let x: Vec<f32> = (0..m * k).map(|i| ((i % 17) as f32 - 8.0) * 0.1).collect();
                let mut out = vec![0.0f32; m * n];
                let (mut a, mut b) = (f64::MAX, f64::MAX);
                for _ in 0..5 {
                    let t0 = std::time::Instant::now();
                    quant_matmul_prefill(Rows::dense(&x, k).unwrap(), &w, ty, Out::F32(&mut out)).unwrap();
                    a = a.min(t0.elapsed().as_secs_f64());
                    let t0 = std::time::Instant::now();
                    super::super::quant_matmul(Rows::dense(&x, k).unwrap(), &w, ty, Out::F32(&mut out)).unwrap();
                    b = b.min(t0.elapsed().as_secs_f64());
                }
                println!("{ty:?} m={m}: prefill {:.3} ms, few-row {:.3} ms", a * 1e3, b * 1e3);
            }
        }
    }
}
