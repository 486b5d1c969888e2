//! Vectorisable row kernels for the CPU attention path, compiled for AVX-512 and AVX2 and
//! chosen at run time, so one binary runs anywhere and is fast where it can be.
//!
//! Rust does not reassociate float sums, so reductions keep 16 partial accumulators that
//! the compiler maps to vector lanes.

mod scalar;

pub use scalar::Widen;
use scalar::*;

/// Product kernels on AVX-512 for f32, f16 and bf16 weights, each widened as it is loaded
/// (`vcvtph2ps` for f16, a shift for bf16). Written out because the generic loops above,
/// compiled for AVX-512, vectorise f32 poorly (2-lane loads and separate multiplies and
/// adds: f32 decoding read its weights at 0.71 of the read floor where f16 reached 0.89).
/// CPUs with AVX2 but not AVX-512 take the same kernels over eight lanes ([`avx2`]).
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;

/// The AVX2 kernels' loads of eight values as f32 lanes (f16 by `vcvtph2ps`, bf16 by a
/// shift), for the decoding attention of `mha` on CPUs with AVX2 alone.
#[cfg(target_arch = "x86_64")]
pub use avx2::Load as Load8;

/// The AVX-512 kernels, for the fused attention of `mha` as well (its decoding step widens
/// half-precision caches with [`avx512::Load`]).
#[cfg(target_arch = "x86_64")]
pub mod avx512;

/// The f32 GEMM of a prefill product's tasks on AVX-512.
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512_gemm;

/// The GEMM of a prefill product's tasks over half-precision weights on AVX2 alone.
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2_gemm;

/// Whether this CPU has the f16 product kernels below (AVX-512F, or AVX2 with FMA and
/// F16C).
pub fn f16_kernels() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f") || avx2_kernels()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Runs `$f(args)` from `avx512` where AVX-512F is present, from `avx2` where AVX2, FMA
/// and F16C are, and `$scalar` elsewhere.
macro_rules! wide_dispatch {
    ($f:ident($($arg:expr),*), $scalar:expr) => {{
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU has just been seen to support AVX-512F.
                return unsafe { avx512::$f($($arg),*) };
            }
            if avx2_kernels() {
                // SAFETY: the CPU has just been seen to support AVX2, FMA and F16C.
                return unsafe { avx2::$f($($arg),*) };
            }
        }
        $scalar
    }};
}

/// Whether this CPU runs the [`avx2`] kernels (when it has no AVX-512).
#[cfg(target_arch = "x86_64")]
pub(crate) fn avx2_kernels() -> bool {
    use std::arch::is_x86_feature_detected as has;
    has!("avx2") && has!("fma") && has!("f16c")
}

/// `dst[i] = src[i]` as f32 for `i < min(src.len(), dst.len())` (AVX-512: 16 values per
/// instruction, where `half`'s slice conversion takes 8 per call).
pub fn widen_f16(src: &[half::f16], dst: &mut [f32]) {
    wide_dispatch!(widen(src, dst), {
        let n = src.len().min(dst.len());
        half::slice::HalfFloatSliceExt::convert_to_f32_slice(&src[..n], &mut dst[..n])
    })
}

/// [`widen_f16`] for bf16.
pub fn widen_bf16(src: &[half::bf16], dst: &mut [f32]) {
    wide_dispatch!(widen(src, dst), {
        let n = src.len().min(dst.len());
        half::slice::HalfFloatSliceExt::convert_to_f32_slice(&src[..n], &mut dst[..n])
    })
}

/// `y += Σ_j a[j]·w[j]` over four f16 rows, each at least as long as `y`.
pub fn axpy4_f16(y: &mut [f32], a: [f32; 4], w: [&[half::f16]; 4]) {
    wide_dispatch!(axpy4(y, a, w), axpy4_impl(y, a, w))
}

/// The dot product of `x` with an f16 row at least as long as `x`.
pub fn dot_f16(x: &[f32], w: &[half::f16]) -> f32 {
    wide_dispatch!(dot(x, w), dot_impl(x, w))
}

/// `out[r·cols + j] = x_r · data[first + j·stride ..][..d]` for the `m` rows of `x`
/// (`[m, d]`) and `cols` f16 weight rows (each row's start and length checked): the
/// decoding products of weights stored `[out, in]`.
#[allow(clippy::too_many_arguments)]
pub fn dot_rows_f16(
    x: &[f32],
    m: usize,
    data: &[half::f16],
    first: usize,
    stride: usize,
    out: &mut [f32],
    cols: usize,
) {
    wide_dispatch!(
        dot_rows_multi(x, m, data, first, stride, out, cols),
        dot_rows_with(dot_f16, dot4_f16, x, m, data, first, stride, out, cols)
    )
}

/// [`dot_rows_f16`] over f32 weight rows.
#[allow(clippy::too_many_arguments)]
pub fn dot_rows(
    x: &[f32],
    m: usize,
    data: &[f32],
    first: usize,
    stride: usize,
    out: &mut [f32],
    cols: usize,
) {
    wide_dispatch!(
        dot_rows_multi(x, m, data, first, stride, out, cols),
        dot_rows_with(dot, dot4, x, m, data, first, stride, out, cols)
    )
}

/// [`dot_rows_f16`] over bf16 weight rows.
#[allow(clippy::too_many_arguments)]
pub fn dot_rows_bf16(
    x: &[f32],
    m: usize,
    data: &[half::bf16],
    first: usize,
    stride: usize,
    out: &mut [f32],
    cols: usize,
) {
    wide_dispatch!(
        dot_rows_multi(x, m, data, first, stride, out, cols),
        dot_rows_with(dot_bf16, dot4_bf16, x, m, data, first, stride, out, cols)
    )
}

/// `dot_rows_*` on CPUs without AVX-512 or AVX2: one `dot` per weight row for one row of `x` (one
/// stream), else one `dot4` per row of `x` and four weight rows.
#[allow(clippy::too_many_arguments)]
fn dot_rows_with<W>(
    dot: fn(&[f32], &[W]) -> f32,
    dot4: fn(&[f32], [&[W]; 4]) -> [f32; 4],
    x: &[f32],
    m: usize,
    data: &[W],
    first: usize,
    stride: usize,
    out: &mut [f32],
    cols: usize,
) {
    let d = x.len() / m;
    if m == 1 {
        for (j, y) in out[..cols].iter_mut().enumerate() {
            *y = dot(x, &data[first + j * stride..][..d]);
        }
        return;
    }
    let mut o = 0;
    while o < cols {
        // Four weight rows at a time; the last group repeats its last row.
        let k = (cols - o).min(4);
        let w = [0, 1, 2, 3].map(|j| &data[first + (o + j.min(k - 1)) * stride..][..d]);
        for r in 0..m {
            let sums = dot4(&x[r * d..][..d], w);
            out[r * cols + o..][..k].copy_from_slice(&sums[..k]);
        }
        o += k;
    }
}

/// Four dot products of `x` with f16 rows at least as long as `x`.
pub fn dot4_f16(x: &[f32], w: [&[half::f16]; 4]) -> [f32; 4] {
    wide_dispatch!(dot4(x, w), dot4_impl(x, w))
}

/// `y += Σ_j a[j]·w[j]` over four f32 rows, each at least as long as `y`.
pub fn axpy4(y: &mut [f32], a: [f32; 4], w: [&[f32]; 4]) {
    wide_dispatch!(axpy4(y, a, w), axpy4_generic(y, a, w))
}

/// `y += Σ_j a[j]·w[j]` over four bf16 rows, each at least as long as `y`.
pub fn axpy4_bf16(y: &mut [f32], a: [f32; 4], w: [&[half::bf16]; 4]) {
    wide_dispatch!(axpy4(y, a, w), axpy4_bf16_generic(y, a, w))
}

/// The dot product of `x` with an f32 row at least as long as `x`.
pub fn dot(x: &[f32], w: &[f32]) -> f32 {
    wide_dispatch!(dot(x, w), dot_generic(x, w))
}

/// The dot product of `x` with a bf16 row at least as long as `x`.
pub fn dot_bf16(x: &[f32], w: &[half::bf16]) -> f32 {
    wide_dispatch!(dot(x, w), dot_bf16_generic(x, w))
}

/// Four dot products of `x` with f32 rows at least as long as `x`.
pub fn dot4(x: &[f32], w: [&[f32]; 4]) -> [f32; 4] {
    wide_dispatch!(dot4(x, w), dot4_generic(x, w))
}

/// Four dot products of `x` with bf16 rows at least as long as `x`.
pub fn dot4_bf16(x: &[f32], w: [&[half::bf16]; 4]) -> [f32; 4] {
    wide_dispatch!(dot4(x, w), dot4_bf16_generic(x, w))
}

/// `$vis fn $name` running `$impl` (an `#[inline(always)]` loop the compiler vectorises)
/// compiled for AVX-512F, for AVX2 with FMA, or for the baseline, as the CPU has them.
macro_rules! dispatch {
    ($(#[$doc:meta])* $name:ident, $impl:ident, ($($arg:ident: $ty:ty),*) -> $ret:ty) => {
        $crate::simd::dispatch!($(#[$doc])* pub $name, $impl, ($($arg: $ty),*) -> $ret);
    };
    ($(#[$doc:meta])* $vis:vis $name:ident, $impl:ident, ($($arg:ident: $ty:ty),*) -> $ret:ty) => {
        $(#[$doc])*
        #[inline]
        $vis fn $name($($arg: $ty),*) -> $ret {
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
pub(crate) use dispatch;

dispatch!(
    /// The sum of the elements.
    sum, sum_impl, (xs: &[f32]) -> f32
);
dispatch!(
    /// The largest element (`-inf` for an empty slice).
    max, max_impl, (xs: &[f32]) -> f32
);
dispatch!(
    /// Where the largest element first stands; NaNs are never taken (0 when nothing else
    /// is there, or for an empty slice).
    argmax, argmax_impl, (xs: &[f32]) -> usize
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
    /// `ys[i] = silu(g[i])·u[i]` over the shortest of the three slices.
    silu_mul, silu_mul_impl, (g: &[f32], u: &[f32], ys: &mut [f32]) -> ()
);
dispatch!(
    /// The gradients of `silu(g)·u`: `dg[i]` (the output's gradient on entry) becomes the
    /// gate's, `du[i]` the up projection's, over the shortest of the four slices.
    silu_mul_grad, silu_mul_grad_impl, (g: &[f32], u: &[f32], dg: &mut [f32], du: &mut [f32]) -> ()
);
dispatch!(
    /// `xs[i] = gelu_tanh(xs[i])`.
    gelu_tanh_in_place, gelu_tanh_in_place_impl, (xs: &mut [f32]) -> ()
);
dispatch!(
    /// `u[i] = silu(g[i])·u[i]` over the shorter of the two slices.
    silu_mul_in_place, silu_mul_in_place_impl, (g: &[f32], u: &mut [f32]) -> ()
);
dispatch!(
    /// `xs[i] += b[i]` over the shorter of the two slices.
    add, add_impl, (xs: &mut [f32], b: &[f32]) -> ()
);
dispatch!(
    /// `gs[i] *= gelu_tanh'(xs[i])` over the shorter of the two slices.
    gelu_tanh_grad, gelu_tanh_grad_impl, (xs: &[f32], gs: &mut [f32]) -> ()
);
dispatch!(
    /// [`axpy4`] without AVX-512 or AVX2.
    axpy4_generic, axpy4_f32_impl, (y: &mut [f32], a: [f32; 4], w: [&[f32]; 4]) -> ()
);
dispatch!(
    /// [`axpy4_bf16`] without AVX-512 or AVX2.
    axpy4_bf16_generic, axpy4_bf16_impl, (y: &mut [f32], a: [f32; 4], w: [&[half::bf16]; 4]) -> ()
);
dispatch!(
    /// `y += a·w` over the shorter of the two.
    axpy, axpy_impl, (y: &mut [f32], a: f32, w: &[f32]) -> ()
);
dispatch!(
    /// [`dot`] without AVX-512 or AVX2.
    dot_generic, dot_f32_impl, (x: &[f32], w: &[f32]) -> f32
);
dispatch!(
    /// [`dot_bf16`] without AVX-512 or AVX2.
    dot_bf16_generic, dot_bf16_impl, (x: &[f32], w: &[half::bf16]) -> f32
);
dispatch!(
    /// [`dot4`] without AVX-512 or AVX2.
    dot4_generic, dot4_f32_impl, (x: &[f32], w: [&[f32]; 4]) -> [f32; 4]
);
dispatch!(
    /// [`dot4_bf16`] without AVX-512 or AVX2.
    dot4_bf16_generic, dot4_bf16_impl, (x: &[f32], w: [&[half::bf16]; 4]) -> [f32; 4]
);
dispatch!(
    /// `dp[i] = p[i]·(dp[i] - delta)`: the softmax's backward for one row.
    softmax_grad, softmax_grad_impl, (p: &[f32], dp: &mut [f32], delta: f32) -> ()
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

    #[test]
    fn product_kernels_match_scalar_code() {
        let row = |k: usize| -> Vec<f32> {
            (0..37)
                .map(|i| ((i * 13 + k * 7) % 17) as f32 - 8.0)
                .collect()
        };
        let rows: Vec<Vec<f32>> = (0..4).map(row).collect();
        let r = [&rows[0][..], &rows[1][..], &rows[2][..], &rows[3][..]];
        let x = row(9);
        let dots = dot4(&x, r);
        for j in 0..4 {
            let want: f32 = x.iter().zip(&rows[j]).map(|(a, b)| a * b).sum();
            assert_eq!(dots[j], want, "small integers sum exactly in any order");
            assert_eq!(dot(&x, r[j]), want);
            // The loops CPUs without AVX-512 or AVX2 run.
            assert_eq!(dot_generic(&x, r[j]), want);
            assert_eq!(dot4_generic(&x, r)[j], want);
        }
        let mut y = row(5);
        let mut want = y.clone();
        axpy4(&mut y, [1.0, -2.0, 0.5, 3.0], r);
        axpy(&mut y, 2.0, &x);
        for c in 0..want.len() {
            want[c] +=
                rows[0][c] - 2.0 * rows[1][c] + 0.5 * rows[2][c] + 3.0 * rows[3][c] + 2.0 * x[c];
        }
        assert_eq!(y, want);
        // bf16 rows: the same integers, exactly representable.
        let bf: Vec<Vec<half::bf16>> = rows
            .iter()
            .map(|r| r.iter().map(|&v| half::bf16::from_f32(v)).collect())
            .collect();
        let rb = [&bf[0][..], &bf[1][..], &bf[2][..], &bf[3][..]];
        assert_eq!(dot4_bf16(&x, rb), dots);
        assert_eq!([0, 1, 2, 3].map(|j| dot_bf16(&x, rb[j])), dots);
        let mut yb = row(5);
        axpy4_bf16(&mut yb, [1.0, -2.0, 0.5, 3.0], rb);
        axpy(&mut yb, 2.0, &x);
        assert_eq!(yb, want);
        // f16 rows: the same integers, exactly representable; 37 values cover the
        // 16-wide loops and their scalar tails.
        let hf: Vec<Vec<half::f16>> = rows
            .iter()
            .map(|r| r.iter().map(|&v| half::f16::from_f32(v)).collect())
            .collect();
        let rh = [&hf[0][..], &hf[1][..], &hf[2][..], &hf[3][..]];
        assert_eq!(dot4_f16(&x, rh), dots);
        assert_eq!([0, 1, 2, 3].map(|j| dot_f16(&x, rh[j])), dots);
        let mut yh = row(5);
        axpy4_f16(&mut yh, [1.0, -2.0, 0.5, 3.0], rh);
        axpy(&mut yh, 2.0, &x);
        assert_eq!(yh, want);
        assert!(half::bf16::NAN.widen().is_nan());
        assert_eq!(half::bf16::from_f32(-1.5).widen(), -1.5);
    }

    /// `dot_rows_*` (one call over a range of weight rows) against the f64 sums of the same
    /// widened values and the loops CPUs without AVX-512 or AVX2 run: 1–9 rows of `x` (one stream
    /// for one; tiles of 4, 3, 2 and 1 for more), 1–9 weight rows (a short last group) with
    /// gaps between them and not starting at 0, widths around the 32- and 16-wide steps.
    /// Widening equals the scalar conversion value for value, subnormals, infinities and
    /// NaN included, for lengths around the 16-wide step and a longer destination.
    #[test]
    fn widening_equals_the_scalar_conversion() {
        let specials = [
            0.0,
            -0.0,
            1.0,
            -2.5,
            65504.0,
            6.0e-8,
            -1.0e-5,
            f32::INFINITY,
            f32::NAN,
        ];
        for n in [0, 1, 15, 16, 17, 31, 32, 33, 100] {
            let vals: Vec<f32> = (0..n)
                .map(|i| match i % 4 {
                    0 => specials[(i / 4) % specials.len()],
                    _ => (i as f32 * 0.37).sin() * 10f32.powi(i as i32 % 7 - 3),
                })
                .collect();
            let h: Vec<half::f16> = vals.iter().map(|&v| half::f16::from_f32(v)).collect();
            let b: Vec<half::bf16> = vals.iter().map(|&v| half::bf16::from_f32(v)).collect();
            let mut dst = vec![7.0f32; n + 3];
            widen_f16(&h, &mut dst);
            for (i, (&d, w)) in dst.iter().zip(&h).enumerate() {
                assert!(
                    d.to_bits() == w.to_f32().to_bits() || (d.is_nan() && w.is_nan()),
                    "f16 {n} {i}"
                );
            }
            assert!(
                dst[n..].iter().all(|&d| d == 7.0),
                "f16 {n}: wrote past the source"
            );
            widen_bf16(&b, &mut dst);
            for (i, (&d, w)) in dst.iter().zip(&b).enumerate() {
                assert!(
                    d.to_bits() == w.to_f32().to_bits() || (d.is_nan() && w.is_nan()),
                    "bf16 {n} {i}"
                );
            }
        }
    }

    #[test]
    fn dot_rows_match_the_f64_product() {
        type Multi<W> = fn(&[f32], usize, &[W], usize, usize, &mut [f32], usize);
        fn check<W: Widen>(
            widen: fn(f32) -> W,
            multi: Multi<W>,
            dot_fn: fn(&[f32], &[W]) -> f32,
            dot4_fn: fn(&[f32], [&[W]; 4]) -> [f32; 4],
        ) {
            let value = |i: usize| ((i * 7919 % 1009) as f32 / 1009.0 - 0.5) * 3.0;
            for d in [0, 1, 15, 16, 17, 31, 32, 33, 48, 63, 100, 576, 583] {
                for m in 1..=9 {
                    for cols in [1, 3, 4, 7, 9] {
                        let (stride, first) = (d + 3, 5);
                        let data: Vec<W> = (0..first + cols * stride)
                            .map(|i| widen(value(i)))
                            .collect();
                        let x: Vec<f32> = (0..m * d).map(|i| value(i + 700)).collect();
                        let mut out = vec![f32::NAN; m * cols];
                        multi(&x, m, &data, first, stride, &mut out, cols);
                        let mut scalar = vec![f32::NAN; m * cols];
                        dot_rows_with(
                            dot_fn,
                            dot4_fn,
                            &x,
                            m,
                            &data,
                            first,
                            stride,
                            &mut scalar,
                            cols,
                        );
                        if m == 1 {
                            // One row of `x` reads two weight rows at a time, each summed
                            // as `dot` sums it.
                            for j in 0..cols {
                                let w = &data[first + j * stride..][..d];
                                assert_eq!(
                                    out[j].to_bits(),
                                    dot_fn(&x, w).to_bits(),
                                    "d {d} ({j})"
                                );
                            }
                        }
                        for r in 0..m {
                            for j in 0..cols {
                                let (xr, w) = (&x[r * d..][..d], &data[first + j * stride..][..d]);
                                let want: f64 = xr
                                    .iter()
                                    .zip(w)
                                    .map(|(&a, b)| a as f64 * b.widen() as f64)
                                    .sum();
                                let scale: f64 = xr
                                    .iter()
                                    .zip(w)
                                    .map(|(&a, b)| (a * b.widen()).abs() as f64)
                                    .sum();
                                let tol = 1e-6 * scale + 1e-12;
                                let at = r * cols + j;
                                assert!(
                                    (out[at] as f64 - want).abs() <= tol,
                                    "d {d} m {m} cols {cols} ({r}, {j})"
                                );
                                assert!(
                                    (scalar[at] as f64 - want).abs() <= tol,
                                    "d {d} m {m} (generic loops)"
                                );
                            }
                        }
                    }
                }
            }
        }
        check(|v| v, dot_rows, dot, dot4);
        check(half::f16::from_f32, dot_rows_f16, dot_f16, dot4_f16);
        check(half::bf16::from_f32, dot_rows_bf16, dot_bf16, dot4_bf16);
        // The AVX2 kernels, which a CPU with AVX-512 does not dispatch to.
        #[cfg(target_arch = "x86_64")]
        if avx2_kernels() {
            fn avx2_check<W: avx2::Load>(widen: fn(f32) -> W) {
                // SAFETY (each call): the CPU has AVX2, FMA and F16C.
                check(
                    widen,
                    |x, m, data, first, stride, out, cols| unsafe {
                        avx2::dot_rows_multi(x, m, data, first, stride, out, cols)
                    },
                    |x, w| unsafe { avx2::dot(x, w) },
                    |x, w| unsafe { avx2::dot4(x, w) },
                );
            }
            avx2_check(|v| v);
            avx2_check(half::f16::from_f32);
            avx2_check(half::bf16::from_f32);
        }
    }

    /// The AVX2 kernels on the small integers of `product_kernels_match_scalar_code`
    /// (exact in any order), and widening value for value, on any CPU with AVX2 (one with
    /// AVX-512 dispatches to those instead).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_kernels_match_scalar_code() {
        if !avx2_kernels() {
            return;
        }
        fn check<W: avx2::Load>(widen: fn(f32) -> W) {
            for n in [0, 1, 7, 8, 9, 15, 16, 17, 37, 100] {
                let row = |k: usize| -> Vec<f32> {
                    (0..n)
                        .map(|i| ((i * 13 + k * 7) % 17) as f32 - 8.0)
                        .collect()
                };
                let rows: Vec<Vec<W>> = (0..4)
                    .map(|k| row(k).into_iter().map(widen).collect())
                    .collect();
                let r = [&rows[0][..], &rows[1][..], &rows[2][..], &rows[3][..]];
                let x = row(9);
                let want: Vec<f32> = (0..4)
                    .map(|j| x.iter().zip(r[j]).map(|(a, b)| a * b.widen()).sum())
                    .collect();
                // SAFETY (each call): the CPU has AVX2, FMA and F16C.
                assert_eq!(unsafe { avx2::dot4(&x, r) }[..], want[..], "{n}");
                for j in 0..4 {
                    assert_eq!(unsafe { avx2::dot(&x, r[j]) }, want[j], "{n}");
                }
                let a = [1.0, -2.0, 0.5, 3.0];
                let mut y = row(5);
                let mut expect = y.clone();
                for c in 0..n {
                    expect[c] += (0..4).map(|j| a[j] * r[j][c].widen()).sum::<f32>();
                }
                unsafe { avx2::axpy4(&mut y, a, r) };
                assert_eq!(y, expect, "{n}");
                let mut wide = vec![7.0f32; n + 3];
                unsafe { avx2::widen(r[1], &mut wide) };
                for (&d, w) in wide.iter().zip(r[1]) {
                    assert_eq!(d.to_bits(), w.widen().to_bits());
                }
                assert!(wide[n..].iter().all(|&d| d == 7.0), "wrote past the source");
            }
        }
        check(|v| v);
        check(half::f16::from_f32);
        check(half::bf16::from_f32);
        // Widening f16 specials: subnormals, infinities, NaN.
        let specials = [0.0, -0.0, 65504.0, 6.0e-8, -1.0e-5, f32::INFINITY, f32::NAN];
        let h: Vec<half::f16> = (0..19)
            .map(|i| half::f16::from_f32(specials[i % specials.len()]))
            .collect();
        let mut dst = vec![0f32; 19];
        unsafe { avx2::widen(&h, &mut dst) };
        for (&d, w) in dst.iter().zip(&h) {
            assert!(d.to_bits() == w.to_f32().to_bits() || (d.is_nan() && w.is_nan()));
        }
    }
}
