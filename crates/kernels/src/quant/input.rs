//! The rows of `x` (the activations) quantized for the integer products, as ggml quantizes
//! them so that sums track llama.cpp's to rounding: in blocks of 32 as q8_0 (with each
//! block's sum, for the formats with an offset or a minimum), or in super-blocks of 256 as
//! q8_K for the k-quants.

use half::f16;
use rayon::prelude::*;

use super::format::{Format, QK, QK_K};

/// Rows of `x` quantized as ggml's q8_0 (the scale rounded to f16, as the block stores it).
pub(super) struct QRows {
    /// `[m, k]`.
    pub(super) q: Vec<i8>,
    /// `[m, k / 32]` scales.
    pub(super) d: Vec<f32>,
    /// `[m, k / 32]`: `Σ q` per block. The kernels that multiply unsigned weight bytes
    /// `u = w + c` (q4_0's `c = 8`; q8_0's `c = 128` where it is offset) take `c · Σ q`
    /// off the block's sum.
    pub(super) sum: Vec<i32>,
    pub(super) k: usize,
}

impl QRows {
    pub(super) fn new(x: &[f32], k: usize) -> Self {
        let (q, d, sum) = quantize_in_parts(x, QK, 1, quantize_blocks);
        Self { q, d, sum, k }
    }

    /// Row `r`: its values, scales and block sums.
    pub(super) fn row(&self, r: usize) -> (&[i8], &[f32], &[i32]) {
        let nb = self.k / QK;
        (
            &self.q[r * self.k..][..self.k],
            &self.d[r * nb..][..nb],
            &self.sum[r * nb..][..nb],
        )
    }

    pub(super) fn rows(&self) -> usize {
        self.q.len() / self.k.max(1)
    }
}

/// `x` quantized in blocks of `block` values by `f`, which writes each block's values, its
/// scale and `sums` sums: one call for a few rows, a part per thread for a prefill's (on one
/// thread, quantizing a prefill's rows takes a fair share of the time its products do).
pub(super) fn quantize_in_parts(
    x: &[f32],
    block: usize,
    sums: usize,
    f: impl Fn(&[f32], &mut [i8], &mut [f32], &mut [i32]) + Sync,
) -> (Vec<i8>, Vec<f32>, Vec<i32>) {
    let blocks = x.len() / block;
    let mut q = vec![0i8; x.len()];
    let (mut d, mut sum) = (vec![0f32; blocks], vec![0i32; blocks * sums]);
    if x.len() < 1 << 16 {
        f(x, &mut q, &mut d, &mut sum);
    } else {
        let per = (blocks / rayon::current_num_threads()).max(1);
        x.par_chunks(per * block)
            .zip(q.par_chunks_mut(per * block))
            .zip(d.par_chunks_mut(per).zip(sum.par_chunks_mut(per * sums)))
            .for_each(|((x, q), (d, sum))| f(x, q, d, sum));
    }
    (q, d, sum)
}

crate::simd::dispatch!(
    /// Blocks of 32 values of `x` quantized as ggml's q8_0: values `q`, scales `d` (rounded
    /// to f16), and each block's sum of `q`. Compiled for the vector width the CPU has:
    /// built for baseline x86-64 it ran one value at a time, on the calling thread while
    /// the pool waited.
    pub(super) quantize_blocks, quantize_blocks_impl,
    (x: &[f32], q: &mut [i8], d: &mut [f32], sum: &mut [i32]) -> ()
);

#[inline(always)]
pub(super) fn quantize_blocks_impl(x: &[f32], q: &mut [i8], d: &mut [f32], sum: &mut [i32]) {
    for (((xb, qb), d), s) in x
        .chunks_exact(QK)
        .zip(q.chunks_exact_mut(QK))
        .zip(d)
        .zip(sum)
    {
        let amax = abs_max(xb);
        let scale = amax / 127.0;
        let inv = if scale != 0.0 { 1.0 / scale } else { 0.0 };
        let mut total = 0i32;
        for (q, &v) in qb.iter_mut().zip(xb) {
            // `round` (half away from zero, as ggml's `roundf`) without the call to libm's
            // `roundf` that `f32::round` compiles to on baseline x86-64: it stopped this
            // loop from vectorising, and quantizing a prefill's rows took longer than
            // multiplying them. Adding the float just
            // below ½ with the value's sign and truncating is exact: it is the expansion
            // LLVM itself uses where it has no rounding instruction.
            let r = v * inv;
            *q = saturate_i8(r + 0.49999997f32.copysign(r));
            total += *q as i32;
        }
        *d = f16::from_f32(scale).to_f32();
        *s = total;
    }
}

/// The largest magnitude in `xs` (0 for an empty slice), NaN ignored as `f32::max`
/// ignores it. Sixteen running maxima taken with `>`, which the compiler turns into vector
/// instructions, where `f32::max`'s rule for NaN kept each step scalar.
#[inline(always)]
pub(super) fn abs_max(xs: &[f32]) -> f32 {
    let mut m = [0f32; 16];
    let mut chunks = xs.chunks_exact(16);
    for c in &mut chunks {
        for i in 0..16 {
            let v = c[i].abs();
            m[i] = if v > m[i] { v } else { m[i] };
        }
    }
    // The sixteen maxima folded in halves, with `>` as above: a fold with `f32::max` was
    // sixteen dependent scalar steps, each with its NaN test, and took most of the time of
    // quantizing a decoding step's rows.
    let mut w = 16;
    while w > 1 {
        w /= 2;
        for i in 0..w {
            m[i] = if m[i + w] > m[i] { m[i + w] } else { m[i] };
        }
    }
    let rest = chunks.remainder().iter().fold(0f32, |a, &v| a.max(v.abs()));
    if m[0] > rest {
        m[0]
    } else {
        rest
    }
}

/// `v as i8` (truncated, saturating, NaN to 0) in a form the compiler vectorises: its
/// saturating conversion to bytes or words stays one value at a time, with branches.
#[inline(always)]
pub(super) fn saturate_i8(v: f32) -> i8 {
    let c = v.clamp(-128.0, 127.0);
    let c = if c.is_nan() { 0.0 } else { c };
    // SAFETY: `c` is finite and within i32's range.
    unsafe { c.to_int_unchecked::<i32>() as i8 }
}

/// Rows of `x` quantized for a product: in blocks of 32 as ggml's q8_0 for q8_0 and q4_0
/// weights, in super-blocks of 256 as its q8_K for the k-quants (as ggml multiplies them,
/// so that results track llama.cpp's to rounding).
pub(super) enum XRows {
    Blocks(QRows),
    Super(SuperRows),
}

impl XRows {
    pub(super) fn new(format: Format, x: &[f32], k: usize) -> Self {
        match format {
            Format::Q4K | Format::Q5K | Format::Q6K | Format::Q3K | Format::Q2K => {
                Self::Super(SuperRows::new(x, k))
            }
            _ => Self::Blocks(QRows::new(x, k)),
        }
    }
}

/// Rows of `x` quantized as ggml's q8_K: per 256 values an f32 scale `d` (`max / -127`, the
/// value of largest magnitude going to -127) and values rounded to `[-127, 127]`, with the
/// sums of each 16.
pub(super) struct SuperRows {
    /// `[m, k]`.
    pub(super) q: Vec<i8>,
    /// `[m, k / 256]`.
    pub(super) d: Vec<f32>,
    /// `[m, k / 16]`.
    pub(super) sum: Vec<i32>,
    /// `[m, k / 32]`: the sums of 32 (exact in f32), for the two-column prefill kernels'
    /// minima (`avx512::q4k_pair`).
    pub(super) sum32: Vec<f32>,
    pub(super) k: usize,
}

impl SuperRows {
    pub(super) fn new(x: &[f32], k: usize) -> Self {
        let (q, d, sum) = quantize_in_parts(x, QK_K, QK_K / 16, quantize_super);
        let sum32 = sum.chunks_exact(2).map(|s| (s[0] + s[1]) as f32).collect();
        Self {
            q,
            d,
            sum,
            sum32,
            k,
        }
    }

    /// Row `r`'s sums of 32 values.
    #[inline(always)]
    pub(super) fn sums32(&self, r: usize) -> &[f32] {
        &self.sum32[r * self.k / QK..][..self.k / QK]
    }

    /// Row `r`: its values, scales and sums of 16. (Inlined: the kernels look rows up per
    /// call, four rows of one tile column.)
    #[inline(always)]
    pub(super) fn row(&self, r: usize) -> (&[i8], &[f32], &[i32]) {
        (
            &self.q[r * self.k..][..self.k],
            &self.d[r * self.k / QK_K..][..self.k / QK_K],
            &self.sum[r * self.k / 16..][..self.k / 16],
        )
    }
}

crate::simd::dispatch!(
    /// Super-blocks of 256 values of `x` quantized as ggml's q8_K (see [`SuperRows`]),
    /// compiled for the vector width the CPU has (as [`quantize_blocks`]).
    pub(super) quantize_super, quantize_super_impl,
    (x: &[f32], q: &mut [i8], d: &mut [f32], sum: &mut [i32]) -> ()
);

#[inline(always)]
pub(super) fn quantize_super_impl(x: &[f32], q: &mut [i8], d: &mut [f32], sum: &mut [i32]) {
    for (((xs, qs), d), sum) in x
        .chunks_exact(QK_K)
        .zip(q.chunks_exact_mut(QK_K))
        .zip(d)
        .zip(sum.chunks_exact_mut(QK_K / 16))
    {
        // The largest magnitude, then the first value of that magnitude: ggml keeps the
        // first of equals, and its sign sets the scale's.
        let amax = abs_max(xs);
        // (Whole chunks of 16 compared, which the compiler keeps in vectors, then the
        // one that holds it: value by value, this search took most of the quantizer.)
        let first = xs
            .chunks_exact(16)
            .find(|c| c.iter().fold(false, |hit, v| hit | (v.abs() == amax)))
            .and_then(|c| c.iter().find(|v| v.abs() == amax));
        let Some(&max) = first.filter(|_| amax != 0.0) else {
            qs.fill(0);
            *d = 0.0;
            sum.fill(0);
            continue;
        };
        let iscale = -127.0 / max;
        for (q, &v) in qs.iter_mut().zip(xs) {
            // Rounded half away from zero as `f32::round`, without its libm call (see
            // `quantize_blocks_impl`).
            let r = iscale * v;
            *q = saturate_i8(r + 0.49999997f32.copysign(r));
        }
        *d = 1.0 / iscale;
        for (s, c) in sum.iter_mut().zip(qs.chunks_exact(16)) {
            *s = c.iter().map(|&v| v as i32).sum();
        }
    }
}

#[cfg(target_arch = "x86_64")]
/// The pointers to rows `r..r + R` of `x` (values, scales, sums of 16), checked to
/// hold `blocks` super-blocks.
/// (A loop, inlined: an `array::from_fn` closure stayed a call per row.)
#[inline(always)]
pub(super) fn super_rows<const R: usize>(x: &SuperRows, r: usize, blocks: usize) -> [XRow; R] {
    let null = XRow {
        q: std::ptr::null(),
        d: std::ptr::null(),
        s: std::ptr::null(),
        f: std::ptr::null(),
    };
    let mut rows = [null; R];
    for (j, row) in rows.iter_mut().enumerate() {
        let (q, d, s) = x.row(r + j);
        let f = x.sums32(r + j);
        assert!(q.len() >= blocks * QK_K && d.len() >= blocks && s.len() >= blocks * 16);
        assert!(f.len() >= blocks * 8);
        *row = XRow {
            q: q.as_ptr(),
            d: d.as_ptr(),
            s: s.as_ptr(),
            f: f.as_ptr(),
        };
    }
    rows
}

/// One row of `x` quantized as q8_K, as raw pointers (bounds checked by
/// [`super_rows`]).
#[derive(Clone, Copy)]
pub(super) struct XRow {
    pub(super) q: *const i8,
    pub(super) d: *const f32,
    pub(super) s: *const i32,
    /// Sums of 32.
    pub(super) f: *const f32,
}
