use super::*;

fn e4m3_value(b: u8) -> f32 {
    // The format's definition: sign, 4-bit exponent (bias 7), 3-bit mantissa.
    let s = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((b >> 3) & 0xf) as i32;
    let m = (b & 7) as f32;
    if e == 0 {
        s * m / 8.0 * 2f32.powi(-6)
    } else {
        s * (1.0 + m / 8.0) * 2f32.powi(e - 7)
    }
}

struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) as u32
    }
    fn f(&mut self) -> f32 {
        self.next() as f32 / (1u64 << 31) as f32 - 0.5
    }
}

#[test]
fn fp8_decode_is_the_format_definition() {
    let all: Vec<u8> = (0..=255u8).filter(|b| b & 0x7f != 0x7f).collect();
    let mut got = vec![0f32; all.len()];
    decode_fp8(&all, &mut got);
    for (b, g) in all.iter().zip(&got) {
        assert_eq!(*g, e4m3_value(*b), "byte {b:#x}");
    }
}

/// Random e4m3 bytes, every one but the format's NaN (0x7f / 0xff).
fn random_fp8(r: &mut Lcg, len: usize) -> Vec<u8> {
    (0..len)
        .map(|_| (r.next() & 0xff) as u8)
        .map(|b| if b & 0x7f == 0x7f { b - 1 } else { b })
        .collect()
}

/// 4-bit values `q` `[n, k]` packed as the kernel reads them: input `i` of each run of
/// 64 in byte `i`'s low nibble, input `32 + i` in its high one.
fn pack_int4(q: &[u8], n: usize, k: usize) -> Vec<u8> {
    let mut w = vec![0u8; n * k / 2];
    for j in 0..n {
        for run in 0..k / 64 {
            for i in 0..32 {
                let (lo, hi) = (q[j * k + run * 64 + i], q[j * k + run * 64 + 32 + i]);
                w[j * k / 2 + run * 32 + i] = lo | (hi << 4);
            }
        }
    }
    w
}

/// `out` `[m, n]` against the float64 sum of `x[i, c] * weight(j, c)`, within `tol`
/// relative to `1 + |want|`.
fn assert_reference<E: Elem>(
    x: &[E],
    out: &[E],
    (m, n, k): (usize, usize, usize),
    tol: f64,
    weight: impl Fn(usize, usize) -> f64,
) {
    for i in 0..m {
        for j in 0..n {
            let want: f64 = (0..k)
                .map(|c| x[i * k + c].get() as f64 * weight(j, c))
                .sum();
            let got = out[i * n + j].get() as f64;
            assert!(
                (got - want).abs() < tol * (1.0 + want.abs()),
                "{m} {n} {k} [{i}, {j}]: {got} vs {want}"
            );
        }
    }
}

/// The FP8 kernel on `E` activations over `cases` `(m, n, k, row_offset)`.
fn fp8_cases<E: Elem>(seed: u64, cases: &[(usize, usize, usize, usize)], tol: f64) {
    let mut r = Lcg(seed);
    for &(m, n, k, off) in cases {
        let w = random_fp8(&mut r, n * k);
        let (sr, sc) = ((off + n).div_ceil(128), k.div_ceil(128));
        let scale: Vec<f32> = (0..sr * sc).map(|_| r.f() + 1.0).collect();
        let x: Vec<E> = (0..m * k).map(|_| E::narrow(r.f())).collect();
        let mut out = vec![E::narrow(0.0); m * n];
        fp8_matmul(Rows::dense(&x, k).unwrap(), &w, n, &scale, off, &mut out).unwrap();
        assert_reference(&x, &out, (m, n, k), tol, |j, c| {
            e4m3_value(w[j * k + c]) as f64 * scale[(off + j) / 128 * sc + c / 128] as f64
        });
    }
}

/// The int4 kernel on `E` activations over `cases` `(m, n, k, group)`.
fn int4_cases<E: Elem>(seed: u64, cases: &[(usize, usize, usize, usize)], tol: f64) {
    let mut r = Lcg(seed);
    for &(m, n, k, g) in cases {
        let q: Vec<u8> = (0..n * k).map(|_| (r.next() & 0xf) as u8).collect();
        let w = pack_int4(&q, n, k);
        let scales: Vec<f32> = (0..n * k / g).map(|_| r.f() + 1.0).collect();
        let zeros: Vec<f32> = (0..n * k / g).map(|_| (r.next() & 0xf) as f32).collect();
        let x: Vec<E> = (0..m * k).map(|_| E::narrow(r.f())).collect();
        let mut out = vec![E::narrow(0.0); m * n];
        int4_matmul(
            Rows::dense(&x, k).unwrap(),
            &w,
            n,
            &scales,
            &zeros,
            g,
            &mut out,
        )
        .unwrap();
        assert_reference(&x, &out, (m, n, k), tol, |j, c| {
            let gi = j * (k / g) + c / g;
            (q[j * k + c] as f64 - zeros[gi] as f64) * scales[gi] as f64
        });
    }
}

#[test]
fn fp8_matches_scalar_reference() {
    fp8_cases::<f32>(
        1,
        &[
            (1, 130, 200, 0),
            (5, 64, 256, 3),
            (17, 257, 128, 127),
            (3, 1, 7, 0),
        ],
        1e-3,
    );
}

#[test]
fn int4_matches_scalar_reference() {
    int4_cases::<f32>(
        2,
        &[(1, 33, 256, 128), (16, 8, 128, 64), (18, 70, 384, 128)],
        1e-3,
    );
}

#[test]
fn fp8_bf16_activations_match_scalar_reference() {
    fp8_cases::<u16>(
        3,
        &[(1, 70, 256, 0), (16, 33, 128, 5), (18, 9, 384, 127)],
        1e-2,
    );
}

#[test]
fn int4_bf16_activations_match_scalar_reference() {
    int4_cases::<u16>(
        4,
        &[(1, 20, 256, 128), (16, 9, 128, 128), (17, 33, 384, 128)],
        1e-2,
    );
}

#[test]
fn shapes_are_checked() {
    let x = vec![0f32; 128];
    let mut out = vec![0f32; 2];
    let e = fp8_matmul(
        Rows::dense(&x, 128).unwrap(),
        &[0u8; 100],
        2,
        &[1.0],
        0,
        &mut out,
    )
    .unwrap_err();
    assert!(e.0.contains("FP8 weight"));
    let e = int4_matmul(
        Rows::dense(&x, 128).unwrap(),
        &[0u8; 128],
        2,
        &[1.0; 2],
        &[0.0; 2],
        96,
        &mut out,
    )
    .unwrap_err();
    assert!(e.0.contains("group size"));
}
