//! Vectorisable row kernels for the CPU attention path, compiled for AVX-512 and AVX2 and
//! chosen at run time, so one binary runs anywhere and is fast where it can be.
//!
//! Rust does not reassociate float sums, so reductions keep 16 partial accumulators that
//! the compiler maps to vector lanes.

const LANES: usize = 16;

/// `exp(x)` for f32 in the Cephes style: `2^n · p(r)` with `|r| <= ln2/2`, accurate to
/// about 2 ulp on `[-87, 88]`; `-inf` and anything below -87 (where `exp` < 1.7e-38)
/// gives exactly 0.
#[inline(always)]
fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding 1.5·2^23 rounds to the nearest integer and leaves it in the low mantissa bits.
    const MAGIC: f32 = 12_582_912.0;
    let xc = x.clamp(-87.0, 88.0);
    let t = xc * LOG2E + MAGIC;
    let n = t - MAGIC;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let e = p * r * r + r + 1.0;
    let ni = t.to_bits() as i32 - MAGIC.to_bits() as i32;
    let scale = f32::from_bits(((ni + 127) << 23) as u32);
    if x < -87.0 {
        0.0
    } else {
        e * scale
    }
}

#[inline(always)]
fn max_impl(xs: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let mut chunks = xs.chunks_exact(LANES);
    for c in &mut chunks {
        for i in 0..LANES {
            acc[i] = if c[i] > acc[i] { c[i] } else { acc[i] };
        }
    }
    let m = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |a, &x| a.max(x));
    acc.iter().fold(m, |a, &x| a.max(x))
}

#[inline(always)]
fn exp_sub_sum_impl(xs: &mut [f32], m: f32) -> f32 {
    let mut acc = [0f32; LANES];
    let mut chunks = xs.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for i in 0..LANES {
            let e = exp(c[i] - m);
            c[i] = e;
            acc[i] += e;
        }
    }
    let mut sum = 0f32;
    for x in chunks.into_remainder() {
        *x = exp(*x - m);
        sum += *x;
    }
    acc.iter().sum::<f32>() + sum
}

#[inline(always)]
fn scale_impl(xs: &mut [f32], s: f32) {
    for x in xs {
        *x *= s;
    }
}

/// GPT-2's GELU, `0.5·x·(1 + tanh(u))` with `u = sqrt(2/π)·(x + 0.044715·x³)`, written
/// as `x / (1 + exp(-2u))` (the same function: `1 + tanh(u) = 2 / (1 + exp(-2u))`), so
/// that it costs one vectorised `exp` and one division.
#[inline(always)]
fn gelu_tanh_impl(xs: &[f32], ys: &mut [f32]) {
    const C: f32 = 0.797_884_6; // sqrt(2/π)
    for (y, &x) in ys.iter_mut().zip(xs) {
        let u = C * (x + 0.044_715 * x * x * x);
        *y = x / (1.0 + exp(-2.0 * u));
    }
}

macro_rules! dispatch {
    ($(#[$doc:meta])* $name:ident, $impl:ident, ($($arg:ident: $ty:ty),*) -> $ret:ty) => {
        $(#[$doc])*
        #[inline]
        pub fn $name($($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                fn avx512($($arg: $ty),*) -> $ret {
                    $impl($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                fn avx2($($arg: $ty),*) -> $ret {
                    $impl($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU has just been seen to support AVX-512F.
                    return unsafe { avx512($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: the CPU has just been seen to support AVX2 and FMA.
                    return unsafe { avx2($($arg),*) };
                }
            }
            $impl($($arg),*)
        }
    };
}

dispatch!(
    /// The largest element (`-inf` for an empty slice).
    max, max_impl, (xs: &[f32]) -> f32
);
dispatch!(
    /// Replaces each `x` by `exp(x - m)` and returns the sum.
    exp_sub_sum, exp_sub_sum_impl, (xs: &mut [f32], m: f32) -> f32
);
dispatch!(
    /// `ys[i] = gelu_tanh(xs[i])` over the shorter of the two slices.
    gelu_tanh, gelu_tanh_impl, (xs: &[f32], ys: &mut [f32]) -> ()
);
dispatch!(
    /// Multiplies every element by `s`.
    scale, scale_impl, (xs: &mut [f32], s: f32) -> ()
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_std() {
        let mut worst = 0f32;
        let mut x = -87.0f32;
        while x < 88.0 {
            let (got, want) = (exp(x), x.exp());
            {
                worst = worst.max(((got - want) / want).abs());
            }
            x += 0.0137;
        }
        assert!(worst < 5e-7, "worst relative error {worst:e}");
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(0.0), 1.0);
    }

    #[test]
    fn gelu_tanh_matches_the_tanh_formula() {
        let xs: Vec<f32> = (-2000..2000).map(|i| i as f32 / 100.0).collect();
        let mut ys = vec![0f32; xs.len()];
        gelu_tanh(&xs, &mut ys);
        for (&x, &y) in xs.iter().zip(&ys) {
            let (xd, c) = (x as f64, (2.0 / std::f64::consts::PI).sqrt());
            let want = 0.5 * xd * (1.0 + (c * (xd + 0.044715 * xd * xd * xd)).tanh());
            assert!(
                (y as f64 - want).abs() <= 1e-6 * want.abs().max(1.0),
                "gelu({x}) = {y}, want {want}"
            );
        }
        let mut out = [0f32; 3];
        gelu_tanh(&[f32::NAN, f32::INFINITY, 0.0], &mut out);
        assert!(out[0].is_nan() && out[1] == f32::INFINITY && out[2] == 0.0);
    }

    #[test]
    fn row_kernels_match_scalar_code() {
        let xs: Vec<f32> = (0..103)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        assert_eq!(
            max(&xs),
            xs.iter().cloned().fold(f32::NEG_INFINITY, f32::max)
        );
        let m = max(&xs);
        let mut ys = xs.clone();
        let sum = exp_sub_sum(&mut ys, m);
        let want: Vec<f32> = xs.iter().map(|x| (x - m).exp()).collect();
        for (a, b) in ys.iter().zip(&want) {
            assert!((a - b).abs() <= 1e-6 * b.abs().max(1e-30));
        }
        assert!((sum - want.iter().sum::<f32>()).abs() < 1e-5);
        assert_eq!(max(&[]), f32::NEG_INFINITY);
    }
}
