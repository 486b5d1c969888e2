//! The row kernels with AVX-512: four weight rows at a time, half-precision rows widened
//! sixteen lanes at a time as they are read ([`Load`](crate::simd::avx512::Load)).

use half::{bf16, f16};
use std::arch::x86_64::*;

/// A weight element loaded 16 at a time as f32 lanes.
pub trait Load: super::scalar::Widen + Copy {
    /// # Safety
    /// 16 readable values at `p` (unaligned is fine); AVX-512F present.
    unsafe fn load16(p: *const Self) -> __m512;
}

impl Load for f32 {
    #[inline(always)]
    unsafe fn load16(p: *const f32) -> __m512 {
        unsafe { _mm512_loadu_ps(p) }
    }
}

impl Load for f16 {
    #[inline(always)]
    unsafe fn load16(p: *const f16) -> __m512 {
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)) }
    }
}

impl Load for bf16 {
    #[inline(always)]
    unsafe fn load16(p: *const bf16) -> __m512 {
        // bf16 is the top half of an f32.
        unsafe {
            let wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i));
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(wide))
        }
    }
}

/// `y += Σ_j a[j] · w[j]` over four rows at once.
///
/// # Safety
/// The CPU has AVX-512F (the slices are bounds-checked).
#[target_feature(enable = "avx512f")]
pub fn axpy4<W: Load>(y: &mut [f32], a: [f32; 4], w: [&[W]; 4]) {
    let n = y.len();
    let w = w.map(|w| &w[..n]);
    let av = [0, 1, 2, 3].map(|j| _mm512_set1_ps(a[j]));
    let mut c = 0;
    while c + 16 <= n {
        // SAFETY: c + 16 <= n elements of `y` and of every row.
        unsafe {
            let mut acc = _mm512_loadu_ps(y.as_ptr().add(c));
            for j in 0..4 {
                acc = _mm512_fmadd_ps(av[j], W::load16(w[j].as_ptr().add(c)), acc);
            }
            _mm512_storeu_ps(y.as_mut_ptr().add(c), acc);
        }
        c += 16;
    }
    super::scalar::axpy4_impl(&mut y[c..], a, w.map(|w| &w[c..]));
}

/// The dot product of `x` with a row at least as long: two sums of 16 lanes, 32 values
/// a step, then one 16-wide step and a scalar tail where the length needs them.
///
/// # Safety
/// The CPU has AVX-512F (the slices are bounds-checked).
#[target_feature(enable = "avx512f")]
#[inline]
pub fn dot<W: Load>(x: &[f32], w: &[W]) -> f32 {
    let n = x.len();
    let w = &w[..n];
    let (mut a0, mut a1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    let mut i = 0;
    while i + 32 <= n {
        // SAFETY: i + 32 <= n elements of `x` and `w`.
        unsafe {
            let (xp, wp) = (x.as_ptr().add(i), w.as_ptr().add(i));
            a0 = _mm512_fmadd_ps(_mm512_loadu_ps(xp), W::load16(wp), a0);
            a1 = _mm512_fmadd_ps(_mm512_loadu_ps(xp.add(16)), W::load16(wp.add(16)), a1);
        }
        i += 32;
    }
    if i + 16 <= n {
        // SAFETY: i + 16 <= n elements of `x` and `w`.
        unsafe {
            let (xp, wp) = (x.as_ptr().add(i), w.as_ptr().add(i));
            a0 = _mm512_fmadd_ps(_mm512_loadu_ps(xp), W::load16(wp), a0);
        }
        i += 16;
    }
    let tail: f32 = x[i..].iter().zip(&w[i..]).map(|(a, b)| a * b.widen()).sum();
    _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)) + tail
}

/// `dst[i] = src[i]` as f32 for `i < min(len)`: 16 values per conversion.
///
/// # Safety
/// The CPU has AVX-512F (the slices are bounds-checked).
#[target_feature(enable = "avx512f")]
pub fn widen<W: Load>(src: &[W], dst: &mut [f32]) {
    let n = src.len().min(dst.len());
    let n16 = n / 16 * 16;
    for i in (0..n16).step_by(16) {
        // SAFETY: i + 16 ≤ n, within both slices.
        unsafe { _mm512_storeu_ps(dst.as_mut_ptr().add(i), W::load16(src.as_ptr().add(i))) };
    }
    for (d, s) in dst[n16..n].iter_mut().zip(&src[n16..n]) {
        *d = s.widen();
    }
}

/// `out[j] = x · data[first + j·stride ..][..x.len()]` for every `j`, the rows read in
/// order, each row's sum reduced as the next one loads. One call per range of rows,
/// `dot` inlined: no call, feature check or generic tail code per row, which on narrow
/// rows (a small model's few hundred values) cost a good part of the row's own work.
///
/// Row j of the range's first half is read beside row j of its second: two streams
/// through memory, where one left each thread's reads waiting on each other (as the
/// quantized tiles, `quant::packed`). Each row's sum is `dot`'s, in the same order.
///
/// # Safety
/// The CPU has AVX-512F (the slices are bounds-checked).
#[target_feature(enable = "avx512f")]
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
#[target_feature(enable = "avx512f")]
#[inline]
fn dot2<W: Load>(x: &[f32], u: &[W], w: &[W]) -> (f32, f32) {
    let n = x.len();
    let (u, w) = (&u[..n], &w[..n]);
    let z = _mm512_setzero_ps();
    let (mut u0, mut u1, mut w0, mut w1) = (z, z, z, z);
    let mut i = 0;
    while i + 32 <= n {
        // SAFETY: i + 32 <= n elements of `x`, `u` and `w`.
        unsafe {
            let (xp, up, wp) = (x.as_ptr().add(i), u.as_ptr().add(i), w.as_ptr().add(i));
            let (x0, x1) = (_mm512_loadu_ps(xp), _mm512_loadu_ps(xp.add(16)));
            u0 = _mm512_fmadd_ps(x0, W::load16(up), u0);
            w0 = _mm512_fmadd_ps(x0, W::load16(wp), w0);
            u1 = _mm512_fmadd_ps(x1, W::load16(up.add(16)), u1);
            w1 = _mm512_fmadd_ps(x1, W::load16(wp.add(16)), w1);
        }
        i += 32;
    }
    if i + 16 <= n {
        // SAFETY: i + 16 <= n elements of `x`, `u` and `w`.
        unsafe {
            let xv = _mm512_loadu_ps(x.as_ptr().add(i));
            u0 = _mm512_fmadd_ps(xv, W::load16(u.as_ptr().add(i)), u0);
            w0 = _mm512_fmadd_ps(xv, W::load16(w.as_ptr().add(i)), w0);
        }
        i += 16;
    }
    let tail = |w: &[W]| -> f32 { x[i..].iter().zip(&w[i..]).map(|(a, b)| a * b.widen()).sum() };
    (
        _mm512_reduce_add_ps(_mm512_add_ps(u0, u1)) + tail(u),
        _mm512_reduce_add_ps(_mm512_add_ps(w0, w1)) + tail(w),
    )
}

/// `out[r·cols + j] = x_r · data[first + j·stride ..][..d]` for the `m` rows `x_r` of
/// `x` (`[m, d]`) and `cols` weight rows: the weight rows four at a time, each 16-value
/// slice of them loaded and widened once for up to four rows of `x` (16 sums in
/// registers), where a `dot4` per row of `x` widened it again for every row. One row
/// of `x` takes [`dot_rows`]: two streams through the weight rows.
///
/// # Safety
/// The CPU has AVX-512F (the slices are bounds-checked).
#[target_feature(enable = "avx512f")]
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
                2 => tile::<W, 2>(&x[r * d..], d, w),
                3 => tile::<W, 3>(&x[r * d..], d, w),
                _ => tile::<W, 4>(&x[r * d..], d, w),
            };
            let rows = (m - r).min(4);
            for (i, row) in sums.iter().enumerate().take(rows) {
                out[(r + i) * cols + o..][..k].copy_from_slice(&row[..k]);
            }
            r += rows;
        }
        o += k;
    }
}

/// The dot products of `R` rows of `x` (`[R, d]`, at the start of `x`) with four weight
/// rows: `[row of x][weight row]`, rows past `R` zero.
#[target_feature(enable = "avx512f")]
#[inline]
fn tile<W: Load, const R: usize>(x: &[f32], d: usize, w: [&[W]; 4]) -> [[f32; 4]; 4] {
    let x: [&[f32]; R] = std::array::from_fn(|r| &x[r * d..][..d]);
    let mut acc = [[_mm512_setzero_ps(); 4]; R];
    let mut i = 0;
    while i + 16 <= d {
        let mut wv = [_mm512_setzero_ps(); 4];
        for j in 0..4 {
            // SAFETY: i + 16 <= d elements of every weight row (each is d long).
            wv[j] = unsafe { W::load16(w[j].as_ptr().add(i)) };
        }
        for r in 0..R {
            // SAFETY: i + 16 <= d elements of every row of `x`.
            let xv = unsafe { _mm512_loadu_ps(x[r].as_ptr().add(i)) };
            for j in 0..4 {
                acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
            }
        }
        i += 16;
    }
    let mut sums = [[0f32; 4]; 4];
    for r in 0..R {
        for j in 0..4 {
            let tail: f32 = x[r][i..]
                .iter()
                .zip(&w[j][i..])
                .map(|(a, b)| a * b.widen())
                .sum();
            sums[r][j] = _mm512_reduce_add_ps(acc[r][j]) + tail;
        }
    }
    sums
}

/// `x · w[j]` for four rows at once.
///
/// # Safety
/// The CPU has AVX-512F (the slices are bounds-checked).
#[target_feature(enable = "avx512f")]
pub fn dot4<W: Load>(x: &[f32], w: [&[W]; 4]) -> [f32; 4] {
    let n = x.len();
    let w = w.map(|w| &w[..n]);
    let mut acc = [_mm512_setzero_ps(); 4];
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: i + 16 <= n elements of `x` and of every row.
        unsafe {
            let xv = _mm512_loadu_ps(x.as_ptr().add(i));
            for j in 0..4 {
                acc[j] = _mm512_fmadd_ps(xv, W::load16(w[j].as_ptr().add(i)), acc[j]);
            }
        }
        i += 16;
    }
    // The last `n % 16` values by the generic loop.
    let tail = super::scalar::dot4_impl(&x[i..], w.map(|w| &w[i..]));
    [0, 1, 2, 3].map(|j| _mm512_reduce_add_ps(acc[j]) + tail[j])
}
