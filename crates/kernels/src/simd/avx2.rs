//! The product kernels of [`super::avx512`] for CPUs with AVX2, FMA and F16C but not
//! AVX-512 (Zen 2 and 3, Intel's client cores before Ice Lake): eight f32 lanes, f16
//! widened by `vcvtph2ps`, bf16 by a shift. Without them f16 weights went through Candle's
//! f16 GEMM and the rest through the generic loops: on a Zen 3 CPU GPT-2 124M decoded f16
//! at 0.38 and f32 at 0.76 of llama.cpp's speed (docs/PERFORMANCE.md).
//!
//! Each function computes what its AVX-512 namesake does, over eight lanes. `dot` and
//! `dot_rows` (one row of `x`) sum every row in the same order, so the two agree bit for
//! bit; AVX2 has 16 vector registers, so `dot_rows_multi` takes two rows of `x` per pass
//! over four weight rows where AVX-512 takes four.

use half::{bf16, f16};
use std::arch::x86_64::*;

/// A weight element loaded 8 at a time as f32 lanes.
pub trait Load: super::scalar::Widen + Copy {
    /// # Safety
    /// 8 readable values at `p` (unaligned is fine); AVX2 and F16C present.
    unsafe fn load8(p: *const Self) -> __m256;
}

impl Load for f32 {
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> __m256 {
        unsafe { _mm256_loadu_ps(p) }
    }
}

impl Load for f16 {
    #[inline(always)]
    unsafe fn load8(p: *const f16) -> __m256 {
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }
}

impl Load for bf16 {
    #[inline(always)]
    unsafe fn load8(p: *const bf16) -> __m256 {
        // bf16 is the top half of an f32.
        unsafe {
            let wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(wide))
        }
    }
}

/// The sum of the eight lanes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// `Σ x[i]·w[i]` for `i` from `from` to the end of `x`, one value at a time.
#[inline(always)]
fn tail<W: Load>(x: &[f32], w: &[W], from: usize) -> f32 {
    x[from..]
        .iter()
        .zip(&w[from..])
        .map(|(a, b)| a * b.widen())
        .sum()
}

#[target_feature(enable = "avx2,fma,f16c")]
pub fn axpy4<W: Load>(y: &mut [f32], a: [f32; 4], w: [&[W]; 4]) {
    let n = y.len();
    let w = w.map(|w| &w[..n]);
    let av = [0, 1, 2, 3].map(|j| _mm256_set1_ps(a[j]));
    let mut c = 0;
    while c + 8 <= n {
        // SAFETY: c + 8 <= n elements of `y` and of every row.
        unsafe {
            let mut acc = _mm256_loadu_ps(y.as_ptr().add(c));
            for j in 0..4 {
                acc = _mm256_fmadd_ps(av[j], W::load8(w[j].as_ptr().add(c)), acc);
            }
            _mm256_storeu_ps(y.as_mut_ptr().add(c), acc);
        }
        c += 8;
    }
    super::scalar::axpy4_impl(&mut y[c..], a, w.map(|w| &w[c..]));
}

/// The dot product of `x` with a row at least as long: two sums of 8 lanes, 16 values a
/// step, then one 8-wide step and a scalar tail where the length needs them.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub fn dot<W: Load>(x: &[f32], w: &[W]) -> f32 {
    let n = x.len();
    let w = &w[..n];
    let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: i + 16 <= n elements of `x` and `w`.
        unsafe {
            let (xp, wp) = (x.as_ptr().add(i), w.as_ptr().add(i));
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(xp), W::load8(wp), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(xp.add(8)), W::load8(wp.add(8)), a1);
        }
        i += 16;
    }
    if i + 8 <= n {
        // SAFETY: i + 8 <= n elements of `x` and `w`.
        unsafe {
            let (xp, wp) = (x.as_ptr().add(i), w.as_ptr().add(i));
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(xp), W::load8(wp), a0);
        }
        i += 8;
    }
    hsum(_mm256_add_ps(a0, a1)) + tail(x, w, i)
}

/// `dst[i] = src[i]` as f32 for `i < min(len)`: 8 values per conversion.
#[target_feature(enable = "avx2,fma,f16c")]
pub fn widen<W: Load>(src: &[W], dst: &mut [f32]) {
    let n = src.len().min(dst.len());
    let n8 = n / 8 * 8;
    for i in (0..n8).step_by(8) {
        // SAFETY: i + 8 ≤ n, within both slices.
        unsafe { _mm256_storeu_ps(dst.as_mut_ptr().add(i), W::load8(src.as_ptr().add(i))) };
    }
    for (d, s) in dst[n8..n].iter_mut().zip(&src[n8..n]) {
        *d = s.widen();
    }
}

/// `out[j] = x · data[first + j·stride ..][..x.len()]` for every `j`: row j of the range's
/// first half read beside row j of its second (two streams through memory), each row's
/// sum [`dot`]'s, in the same order.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub fn dot_rows<W: Load>(x: &[f32], data: &[W], first: usize, stride: usize, out: &mut [f32]) {
    let n = x.len();
    let half = out.len() / 2;
    let row = |j: usize| &data[first + j * stride..][..n];
    let (a, b) = out.split_at_mut(half);
    for (j, (ya, yb)) in a.iter_mut().zip(b.iter_mut()).enumerate() {
        (*ya, *yb) = dot2(x, row(j), row(half + j));
    }
    if let Some(y) = b.get_mut(half) {
        *y = dot(x, row(2 * half));
    }
}

/// [`dot`] of `x` with two rows at once, their loads interleaved.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn dot2<W: Load>(x: &[f32], u: &[W], w: &[W]) -> (f32, f32) {
    let n = x.len();
    let (u, w) = (&u[..n], &w[..n]);
    let z = _mm256_setzero_ps();
    let (mut u0, mut u1, mut w0, mut w1) = (z, z, z, z);
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: i + 16 <= n elements of `x`, `u` and `w`.
        unsafe {
            let (xp, up, wp) = (x.as_ptr().add(i), u.as_ptr().add(i), w.as_ptr().add(i));
            let (x0, x1) = (_mm256_loadu_ps(xp), _mm256_loadu_ps(xp.add(8)));
            u0 = _mm256_fmadd_ps(x0, W::load8(up), u0);
            w0 = _mm256_fmadd_ps(x0, W::load8(wp), w0);
            u1 = _mm256_fmadd_ps(x1, W::load8(up.add(8)), u1);
            w1 = _mm256_fmadd_ps(x1, W::load8(wp.add(8)), w1);
        }
        i += 16;
    }
    if i + 8 <= n {
        // SAFETY: i + 8 <= n elements of `x`, `u` and `w`.
        unsafe {
            let xv = _mm256_loadu_ps(x.as_ptr().add(i));
            u0 = _mm256_fmadd_ps(xv, W::load8(u.as_ptr().add(i)), u0);
            w0 = _mm256_fmadd_ps(xv, W::load8(w.as_ptr().add(i)), w0);
        }
        i += 8;
    }
    (
        hsum(_mm256_add_ps(u0, u1)) + tail(x, u, i),
        hsum(_mm256_add_ps(w0, w1)) + tail(x, w, i),
    )
}

/// `out[r·cols + j] = x_r · data[first + j·stride ..][..d]` for the `m` rows `x_r` of `x`
/// (`[m, d]`) and `cols` weight rows: the weight rows four at a time, each 8-value slice
/// of them loaded and widened once for two rows of `x` (8 sums in registers). One row of
/// `x` takes [`dot_rows`].
#[target_feature(enable = "avx2,fma,f16c")]
pub fn dot_rows_multi<W: Load>(
    x: &[f32],
    m: usize,
    data: &[W],
    first: usize,
    stride: usize,
    out: &mut [f32],
    cols: usize,
) {
    if m == 1 {
        return dot_rows(x, data, first, stride, &mut out[..cols]);
    }
    let d = x.len() / m;
    let mut o = 0;
    while o < cols {
        // The last group repeats its last weight row.
        let k = (cols - o).min(4);
        let w = [0, 1, 2, 3].map(|j| &data[first + (o + j.min(k - 1)) * stride..][..d]);
        let mut r = 0;
        while r < m {
            let sums = match m - r {
                1 => tile::<W, 1>(&x[r * d..], d, w),
                _ => tile::<W, 2>(&x[r * d..], d, w),
            };
            let rows = (m - r).min(2);
            for (i, row) in sums.iter().enumerate().take(rows) {
                out[(r + i) * cols + o..][..k].copy_from_slice(&row[..k]);
            }
            r += rows;
        }
        o += k;
    }
}

/// The dot products of `R` (1 or 2) rows of `x` (`[R, d]`, at the start of `x`) with four
/// weight rows: `[row of x][weight row]`, rows past `R` zero.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn tile<W: Load, const R: usize>(x: &[f32], d: usize, w: [&[W]; 4]) -> [[f32; 4]; 2] {
    let x: [&[f32]; R] = std::array::from_fn(|r| &x[r * d..][..d]);
    let mut acc = [[_mm256_setzero_ps(); 4]; R];
    let mut i = 0;
    while i + 8 <= d {
        let mut wv = [_mm256_setzero_ps(); 4];
        for j in 0..4 {
            // SAFETY: i + 8 <= d elements of every weight row (each is d long).
            wv[j] = unsafe { W::load8(w[j].as_ptr().add(i)) };
        }
        for r in 0..R {
            // SAFETY: i + 8 <= d elements of every row of `x`.
            let xv = unsafe { _mm256_loadu_ps(x[r].as_ptr().add(i)) };
            for j in 0..4 {
                acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);
            }
        }
        i += 8;
    }
    let mut sums = [[0f32; 4]; 2];
    for r in 0..R {
        for j in 0..4 {
            sums[r][j] = hsum(acc[r][j]) + tail(x[r], w[j], i);
        }
    }
    sums
}

#[target_feature(enable = "avx2,fma,f16c")]
pub fn dot4<W: Load>(x: &[f32], w: [&[W]; 4]) -> [f32; 4] {
    let n = x.len();
    let w = w.map(|w| &w[..n]);
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n elements of `x` and of every row.
        unsafe {
            let xv = _mm256_loadu_ps(x.as_ptr().add(i));
            for j in 0..4 {
                acc[j] = _mm256_fmadd_ps(xv, W::load8(w[j].as_ptr().add(i)), acc[j]);
            }
        }
        i += 8;
    }
    [0, 1, 2, 3].map(|j| hsum(acc[j]) + tail(x, w[j], i))
}
