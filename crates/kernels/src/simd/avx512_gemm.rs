//! The f32 GEMM of one prefill task on AVX-512: `dst [m, n] = x [m, k] · w [k, n]` on the
//! calling thread, for the spans of [`crate::dense`]'s prefill products (a few dozen to a few
//! hundred output columns, from 9 rows to thousands, `k` the model's width).
//!
//! Why not the `gemm` crate here: for such a span it packs `x` (all `m × k` of it) again for
//! every task, and with the span's columns as its vector dimension the spans' widths
//! (multiples of 16, rarely of its 64) fall to its narrower edge kernels; both cost a fifth
//! of a prefill (docs/PERFORMANCE.md, "Dense products"). Here the vectors run along the output
//! columns instead: `x` is read where it lies, each value broadcast to a 6 × 64 tile of 24
//! accumulators (the BLIS arrangement: 24 FMAs per 4 weight loads and 6 broadcasts), over
//! the weights of a block of `KC` inputs by 64 columns at a time (in L1 while every row of
//! `x` passes; `x`'s block of `KC` columns stays in L2 from panel to panel). Weights stored
//! by columns (an `nn.Linear`'s `[out, in]`, and the widened or dequantized spans of such
//! weights) are packed into a `[KC][64]` panel first, transposed 16 × 16 in registers;
//! stored by rows (`[in, out]`) they are read in place, though `dense` keeps those on the
//! `gemm` crate, which measured faster for them. A panel narrower than 64 takes 16, 32 or
//! 48 lanes, the last masked to the span's width.
//!
//! Sums run over `k` in blocks of `KC`, each block's partial sums added to `dst` in order;
//! the result differs from a single running sum by rounding only (the tests hold it to
//! `matmul`).

use std::arch::x86_64::*;
use std::cell::RefCell;

/// Rows of `x` per tile.
const MR: usize = 6;
/// Inputs per packed block: a 64-column panel of it is 32 KiB, within a 48 KiB L1.
const KC: usize = 128;
/// Columns per panel (four vectors of 16).
const PANEL: usize = 64;

thread_local! {
    /// A task's packed panel, `KC × 64` values.
    static PACKED: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// `dst[r·ds + j] = Σ_k x[r·d_in + k] · w[k·rs + j·cs]` for `r < m`, `j < n`, `k < d_in`.
/// Each element of `dst` is written before it is read, so `dst` may start uninitialised.
///
/// # Safety
/// The CPU has AVX-512F; `dst` has `m` rows of stride `ds` with `n` writable columns that
/// no other thread touches; `x` holds `m × d_in` values and `w` every element the strides
/// address.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f")]
pub unsafe fn gemm(
    x: &[f32],
    m: usize,
    d_in: usize,
    dst: *mut f32,
    ds: usize,
    n: usize,
    w: &[f32],
    rs: usize,
    cs: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    if d_in == 0 {
        for r in 0..m {
            // SAFETY: row r's n columns are the caller's to write.
            unsafe { std::ptr::write_bytes(dst.add(r * ds), 0, n) };
        }
        return;
    }
    PACKED.with(|buf| {
        let mut buf = buf.borrow_mut();
        if buf.len() < PANEL * KC {
            buf.resize(PANEL * KC, 0.0);
        }
        let mut k0 = 0;
        while k0 < d_in {
            let kc = KC.min(d_in - k0);
            let mut j0 = 0;
            while j0 < n {
                let cols = PANEL.min(n - j0);
                // The block's rows of the panel: in place, or packed `[kc][cols to 16]`.
                let (b, ldb) = match cs == 1 {
                    true => (w[k0 * rs + j0..].as_ptr(), rs),
                    false => {
                        // SAFETY: the caller's bounds on `w`; `buf` holds KC × 64.
                        unsafe { pack(w, rs, cs, k0, kc, j0, cols, &mut buf) };
                        (buf.as_ptr(), cols.next_multiple_of(16))
                    }
                };
                let mut r0 = 0;
                while r0 < m {
                    let rows = MR.min(m - r0);
                    // SAFETY: rows r0.. of `x` from column k0 (kc values each), the packed
                    // panel, and rows r0.. of `dst` from column j0 (`cols` of them), all
                    // within the caller's bounds.
                    unsafe {
                        tile(
                            rows,
                            cols,
                            x.as_ptr().add(r0 * d_in + k0),
                            d_in,
                            b,
                            ldb,
                            kc,
                            dst.add(r0 * ds + j0),
                            ds,
                            k0 > 0,
                        )
                    };
                    r0 += rows;
                }
                j0 += cols;
            }
            k0 += kc;
        }
    })
}

/// One tile of `rows ≤ 6` rows and `cols ≤ 64` columns: the kernel for its shape.
///
/// # Safety
/// As [`micro`]'s.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f")]
unsafe fn tile(
    rows: usize,
    cols: usize,
    a: *const f32,
    lda: usize,
    b: *const f32,
    ldb: usize,
    kc: usize,
    c: *mut f32,
    ldc: usize,
    add: bool,
) {
    let vectors = cols.div_ceil(16);
    // The last vector's lanes within the span.
    let last: __mmask16 = match cols % 16 {
        0 => 0xffff,
        r => (1u16 << r) - 1,
    };
    macro_rules! by_vectors {
        ($r:literal) => {
            // SAFETY (each): the caller's.
            match vectors {
                1 => unsafe { micro::<$r, 1>(a, lda, b, ldb, kc, c, ldc, last, add) },
                2 => unsafe { micro::<$r, 2>(a, lda, b, ldb, kc, c, ldc, last, add) },
                3 => unsafe { micro::<$r, 3>(a, lda, b, ldb, kc, c, ldc, last, add) },
                _ => unsafe { micro::<$r, 4>(a, lda, b, ldb, kc, c, ldc, last, add) },
            }
        };
    }
    match rows {
        1 => by_vectors!(1),
        2 => by_vectors!(2),
        3 => by_vectors!(3),
        4 => by_vectors!(4),
        5 => by_vectors!(5),
        _ => by_vectors!(6),
    }
}

/// `c[i][..] (+)= Σ_k a[i·lda + k] · b[k·ldb + ..]` for `R` rows and `V` vectors of 16
/// columns, the last read and stored under `last`.
///
/// # Safety
/// AVX-512F; `a` has `R` rows of `kc` readable values at stride `lda`, `b` has `kc` rows at
/// stride `ldb` of `16·(V − 1)` values plus the lanes of `last`, and `c` has `R` rows at
/// stride `ldc` with as many writable columns.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn micro<const R: usize, const V: usize>(
    a: *const f32,
    lda: usize,
    b: *const f32,
    ldb: usize,
    kc: usize,
    c: *mut f32,
    ldc: usize,
    last: __mmask16,
    add: bool,
) {
    let mut acc = [[_mm512_setzero_ps(); V]; R];
    for k in 0..kc {
        // SAFETY (the loads): row k of `b` (the last vector under `last`) and column k of
        // the R rows of `a`.
        let bp = unsafe { b.add(k * ldb) };
        let mut bv = [_mm512_setzero_ps(); V];
        for (v, bv) in bv.iter_mut().enumerate() {
            *bv = match v + 1 == V {
                true => unsafe { _mm512_maskz_loadu_ps(last, bp.add(16 * v)) },
                false => unsafe { _mm512_loadu_ps(bp.add(16 * v)) },
            };
        }
        for (i, acc) in acc.iter_mut().enumerate() {
            let av = _mm512_set1_ps(unsafe { *a.add(i * lda + k) });
            for (acc, bv) in acc.iter_mut().zip(&bv) {
                *acc = _mm512_fmadd_ps(av, *bv, *acc);
            }
        }
    }
    for (i, acc) in acc.iter().enumerate() {
        for (v, acc) in acc.iter().enumerate() {
            let mask = if v + 1 == V { last } else { 0xffff };
            // SAFETY: row i's vector v of `c`, under the lanes the caller allows.
            unsafe {
                let p = c.add(i * ldc + 16 * v);
                let sum = match add {
                    true => _mm512_add_ps(*acc, _mm512_maskz_loadu_ps(mask, p)),
                    false => *acc,
                };
                _mm512_mask_storeu_ps(p, mask, sum);
            }
        }
    }
}

/// Packs inputs `k0..k0 + kc` of columns `j0..j0 + cols` (`cols ≤ 64`) into `buf` as
/// `[kc][width]`, `width` the columns rounded up to 16, lanes past `cols` zero: weights
/// stored by columns (`rs == 1`: an `nn.Linear`'s rows) transposed 16 × 16 in registers,
/// any other strides one value at a time.
///
/// # Safety
/// AVX-512F; `w` addresses every (k, j) of the block at `k·rs + j·cs`; `buf` holds kc × 64
/// values.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f")]
unsafe fn pack(
    w: &[f32],
    rs: usize,
    cs: usize,
    k0: usize,
    kc: usize,
    j0: usize,
    cols: usize,
    buf: &mut [f32],
) {
    let at = |k: usize, j: usize| w[(k0 + k) * rs + (j0 + j) * cs];
    let width = cols.next_multiple_of(16);
    let panel = &mut buf[..kc * width];
    let mut jb = 0;
    while jb < width {
        let mut kb = 0;
        while kb < kc {
            if rs == 1 && jb + 16 <= cols && kb + 16 <= kc {
                let mut r = [_mm512_setzero_ps(); 16];
                for (jj, r) in r.iter_mut().enumerate() {
                    let row = &w[(j0 + jb + jj) * cs + k0 + kb..][..16];
                    // SAFETY: 16 values of `row`.
                    *r = unsafe { _mm512_loadu_ps(row.as_ptr()) };
                }
                let t = transpose16(r);
                for (kk, t) in t.iter().enumerate() {
                    let out = &mut panel[(kb + kk) * width + jb..][..16];
                    // SAFETY: 16 values of `out`.
                    unsafe { _mm512_storeu_ps(out.as_mut_ptr(), *t) };
                }
            } else {
                for kk in kb..(kb + 16).min(kc) {
                    for jj in jb..jb + 16 {
                        panel[kk * width + jj] = match jj < cols {
                            true => at(kk, jj),
                            false => 0.0,
                        };
                    }
                }
            }
            kb += 16;
        }
        jb += 16;
    }
}

/// The transpose of 16 vectors of 16: lane `j` of output `k` is lane `k` of input `j`.
#[inline]
#[target_feature(enable = "avx512f")]
fn transpose16(r: [__m512; 16]) -> [__m512; 16] {
    // Pairs of rows interleaved: in each 128-bit lane L, t[2i] holds elements 4L and 4L + 1
    // of rows 2i and 2i + 1, t[2i + 1] elements 4L + 2 and 4L + 3.
    let mut t = [_mm512_setzero_ps(); 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    // Then by 64-bit pairs: u[4i + e], in lane L, holds element 4L + e of rows 4i..4i + 4.
    let pd = _mm512_castps_pd;
    let ps = _mm512_castpd_ps;
    let mut u = [_mm512_setzero_ps(); 16];
    for i in 0..4 {
        let (a, b, c, d) = (t[4 * i], t[4 * i + 2], t[4 * i + 1], t[4 * i + 3]);
        u[4 * i] = ps(_mm512_unpacklo_pd(pd(a), pd(b)));
        u[4 * i + 1] = ps(_mm512_unpackhi_pd(pd(a), pd(b)));
        u[4 * i + 2] = ps(_mm512_unpacklo_pd(pd(c), pd(d)));
        u[4 * i + 3] = ps(_mm512_unpackhi_pd(pd(c), pd(d)));
    }
    // Output 4L + e gathers lane L of u[e], u[4 + e], u[8 + e], u[12 + e].
    let mut out = [_mm512_setzero_ps(); 16];
    for e in 0..4 {
        // Lanes 0 and 2 (0x88) or 1 and 3 (0xdd) of each of the two.
        let a0 = _mm512_shuffle_f32x4::<0x88>(u[e], u[4 + e]);
        let a1 = _mm512_shuffle_f32x4::<0xdd>(u[e], u[4 + e]);
        let b0 = _mm512_shuffle_f32x4::<0x88>(u[8 + e], u[12 + e]);
        let b1 = _mm512_shuffle_f32x4::<0xdd>(u[8 + e], u[12 + e]);
        out[e] = _mm512_shuffle_f32x4::<0x88>(a0, b0);
        out[8 + e] = _mm512_shuffle_f32x4::<0xdd>(a0, b0);
        out[4 + e] = _mm512_shuffle_f32x4::<0x88>(a1, b1);
        out[12 + e] = _mm512_shuffle_f32x4::<0xdd>(a1, b1);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(
        x: &[f32],
        m: usize,
        k: usize,
        w: &[f32],
        rs: usize,
        cs: usize,
        n: usize,
    ) -> Vec<f64> {
        let mut out = vec![0f64; m * n];
        for r in 0..m {
            for j in 0..n {
                out[r * n + j] = (0..k)
                    .map(|i| x[r * k + i] as f64 * w[i * rs + j * cs] as f64)
                    .sum();
            }
        }
        out
    }

    fn values(len: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(1);
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn transpose_of_sixteen_vectors() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            return;
        }
        let v: Vec<f32> = (0..256).map(|i| i as f32).collect();
        // SAFETY: AVX-512F was just seen; every load and store is 16 values of 256.
        let got = unsafe {
            let r: [__m512; 16] = std::array::from_fn(|j| _mm512_loadu_ps(v[j * 16..].as_ptr()));
            let t = transpose16(r);
            let mut out = vec![0f32; 256];
            for (k, t) in t.iter().enumerate() {
                _mm512_storeu_ps(out[k * 16..].as_mut_ptr(), *t);
            }
            out
        };
        for k in 0..16 {
            for j in 0..16 {
                assert_eq!(got[k * 16 + j], v[j * 16 + k], "({k}, {j})");
            }
        }
    }

    /// Every tile shape (rows 1..6 past multiples of 6, 1..4 vectors and masked lanes), `k`
    /// across block boundaries, weights by columns, by rows and strided, into a wider `dst`.
    #[test]
    fn products_equal_the_sums() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            return;
        }
        for (m, k, n) in [
            (1, 1, 1),
            (7, 16, 16),
            (13, 130, 64),
            (6, 257, 70),
            (17, 300, 131),
            (12, 128, 200),
            (5, 17, 33),
        ] {
            let x = values(m * k, (m * 31 + k) as u32);
            for layout in 0..3 {
                // (rs, cs, len): [n, k] stored (columns), [k, n] (rows), [k, n + 3] strided.
                let (rs, cs, len) = match layout {
                    0 => (1, k, n * k),
                    1 => (n, 1, n * k),
                    _ => (n + 3, 1, (n + 3) * k),
                };
                let w = values(len, (n * 7 + layout) as u32);
                let ds = n + 5;
                let mut dst = vec![f32::NAN; m * ds];
                // SAFETY: AVX-512F was just seen; dst holds m rows of ds ≥ n, x m × k, and
                // w every (k, j) at k·rs + j·cs.
                unsafe { gemm(&x, m, k, dst.as_mut_ptr(), ds, n, &w, rs, cs) };
                let want = reference(&x, m, k, &w, rs, cs, n);
                for r in 0..m {
                    for j in 0..n {
                        let (g, e) = (dst[r * ds + j] as f64, want[r * n + j]);
                        assert!(
                            (g - e).abs() <= 1e-5 * (1.0 + e.abs()) * (k as f64).sqrt(),
                            "m {m} k {k} n {n} layout {layout} ({r}, {j}): {g} vs {e}"
                        );
                    }
                    assert!(
                        dst[r * ds + n..(r + 1) * ds].iter().all(|v| v.is_nan()),
                        "wrote past n"
                    );
                }
            }
        }
    }
}
