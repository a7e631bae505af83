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

#[test]
fn fp8_matches_scalar_reference() {
    let mut r = Lcg(1);
    for &(m, n, k, off) in &[
        (1usize, 130usize, 200usize, 0usize),
        (5, 64, 256, 3),
        (17, 257, 128, 127),
        (3, 1, 7, 0),
    ] {
        // Every byte but e4m3's NaN (0x7f / 0xff).
        let w: Vec<u8> = (0..n * k)
            .map(|_| (r.next() & 0xff) as u8)
            .map(|b| if b & 0x7f == 0x7f { b - 1 } else { b })
            .collect();
        let (sr, sc) = ((off + n).div_ceil(128), k.div_ceil(128));
        let scale: Vec<f32> = (0..sr * sc).map(|_| r.f() + 1.0).collect();
        let x: Vec<f32> = (0..m * k).map(|_| r.f()).collect();
        let mut out = vec![0f32; m * n];
        fp8_matmul(Rows::dense(&x, k).unwrap(), &w, n, &scale, off, &mut out).unwrap();
        for i in 0..m {
            for j in 0..n {
                let want: f64 = (0..k)
                    .map(|c| {
                        x[i * k + c] as f64
                            * e4m3_value(w[j * k + c]) as f64
                            * scale[(off + j) / 128 * sc + c / 128] as f64
                    })
                    .sum();
                assert!(
                    (out[i * n + j] as f64 - want).abs() < 1e-3 * (1.0 + want.abs()),
                    "{m} {n} {k}"
                );
            }
        }
    }
}

#[test]
fn int4_matches_scalar_reference() {
    let mut r = Lcg(2);
    for &(m, n, k, g) in &[
        (1usize, 33usize, 256usize, 128usize),
        (16, 8, 128, 64),
        (18, 70, 384, 128),
    ] {
        let q: Vec<u8> = (0..n * k).map(|_| (r.next() & 0xf) as u8).collect();
        let mut w = vec![0u8; n * k / 2];
        for j in 0..n {
            for run in 0..k / 64 {
                for i in 0..32 {
                    let lo = q[j * k + run * 64 + i];
                    let hi = q[j * k + run * 64 + 32 + i];
                    w[j * k / 2 + run * 32 + i] = lo | (hi << 4);
                }
            }
        }
        let scales: Vec<f32> = (0..n * k / g).map(|_| r.f() + 1.0).collect();
        let zeros: Vec<f32> = (0..n * k / g).map(|_| (r.next() & 0xf) as f32).collect();
        let x: Vec<f32> = (0..m * k).map(|_| r.f()).collect();
        let mut out = vec![0f32; m * n];
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
        for i in 0..m {
            for j in 0..n {
                let want: f64 = (0..k)
                    .map(|c| {
                        let gi = j * (k / g) + c / g;
                        x[i * k + c] as f64
                            * (q[j * k + c] as f64 - zeros[gi] as f64)
                            * scales[gi] as f64
                    })
                    .sum();
                assert!((out[i * n + j] as f64 - want).abs() < 1e-3 * (1.0 + want.abs()));
            }
        }
    }
}

#[test]
fn fp8_bf16_activations_match_scalar_reference() {
    let mut r = Lcg(3);
    for &(m, n, k, off) in &[
        (1usize, 70usize, 256usize, 0usize),
        (16, 33, 128, 5),
        (18, 9, 384, 127),
    ] {
        let w: Vec<u8> = (0..n * k)
            .map(|_| (r.next() & 0xff) as u8)
            .map(|b| if b & 0x7f == 0x7f { b - 1 } else { b })
            .collect();
        let (sr, sc) = ((off + n).div_ceil(128), k.div_ceil(128));
        let scale: Vec<f32> = (0..sr * sc).map(|_| r.f() + 1.0).collect();
        let x: Vec<u16> = (0..m * k).map(|_| crate::bf16::from_f32(r.f())).collect();
        let mut out = vec![0u16; m * n];
        fp8_matmul(Rows::dense(&x, k).unwrap(), &w, n, &scale, off, &mut out).unwrap();
        for i in 0..m {
            for j in 0..n {
                let want: f64 = (0..k)
                    .map(|c| {
                        crate::bf16::to_f32(x[i * k + c]) as f64
                            * e4m3_value(w[j * k + c]) as f64
                            * scale[(off + j) / 128 * sc + c / 128] as f64
                    })
                    .sum();
                let got = crate::bf16::to_f32(out[i * n + j]) as f64;
                assert!(
                    (got - want).abs() < 1e-2 * (1.0 + want.abs()),
                    "{m} {n} {k}: {got} vs {want}"
                );
            }
        }
    }
}

#[test]
fn int4_bf16_activations_match_scalar_reference() {
    let mut r = Lcg(4);
    for &(m, n, k) in &[(1usize, 20usize, 256usize), (16, 9, 128), (17, 33, 384)] {
        let g = 128;
        let q: Vec<u8> = (0..n * k).map(|_| (r.next() & 0xf) as u8).collect();
        let mut w = vec![0u8; n * k / 2];
        for j in 0..n {
            for run in 0..k / 64 {
                for i in 0..32 {
                    w[j * k / 2 + run * 32 + i] =
                        q[j * k + run * 64 + i] | (q[j * k + run * 64 + 32 + i] << 4);
                }
            }
        }
        let scales: Vec<f32> = (0..n * k / g).map(|_| r.f() + 1.0).collect();
        let zeros: Vec<f32> = (0..n * k / g).map(|_| (r.next() & 0xf) as f32).collect();
        let x: Vec<u16> = (0..m * k).map(|_| crate::bf16::from_f32(r.f())).collect();
        let mut out = vec![0u16; m * n];
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
        for i in 0..m {
            for j in 0..n {
                let want: f64 = (0..k)
                    .map(|c| {
                        let gi = j * (k / g) + c / g;
                        crate::bf16::to_f32(x[i * k + c]) as f64
                            * (q[j * k + c] as f64 - zeros[gi] as f64)
                            * scales[gi] as f64
                    })
                    .sum();
                let got = crate::bf16::to_f32(out[i * n + j]) as f64;
                assert!(
                    (got - want).abs() < 1e-2 * (1.0 + want.abs()),
                    "{m} {n} {k}: {got} vs {want}"
                );
            }
        }
    }
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
