//! A prefill's products with q8_0, q4_0, q5_0 and q4_K matrices on CPUs with AVX2 but
//! without AVX-512 VNNI (where [`crate::qpacked`] does not pack them): an integer GEMM on
//! 8-bit activations. Candle 0.11 has no repacked kernel for the first three there; for
//! q4_K it has, but keeps the repacked copy of every matrix beside the file's blocks,
//! where this repacks a task's span into its thread's buffer and lets it go.
//!
//! As in decoding ([`crate::qmatvec`]) and in llama.cpp, each row of `x` is quantized to
//! 8 bits in blocks of 32 (q8_0), so a block's product is an exact integer sum times the
//! two scales. Each task of the product takes a span of weight rows and repacks it, into
//! its thread's buffer, as tiles of 8 rows × one block: the 8 scales as f32, then the 32
//! values of each row in groups of four, so that one 32-byte load holds four values of
//! each of the 8 rows. `vpmaddubsw` multiplies it by four values of a row of `x` broadcast
//! to every lane and `vpmaddwd` adds the pairs, leaving one lane per weight row: no
//! horizontal sums, and one conversion and one scaling per block for 8 rows. A tile block
//! serves three rows of `x` per pass from L1; a chunk of `x`'s rows stays in L2 while every
//! tile of the span passes over it.
//!
//! `vpmaddubsw` multiplies unsigned by signed bytes and saturates its pair sums at i16.
//! q4_0's and q5_0's values go in unsigned (their offsets of 8 and 16 come off through
//! the block sums of `x`), and their pair sums are small enough (2·31·127 at most) to add
//! four (q5_0) or eight (q4_0) groups as i16 before widening. q8_0 gives |w| and moves
//! w's sign onto `x`, whose values are in [-127, 127]: pairs reach 2·128·127, inside an
//! i16, and are widened at once.
//!
//! The k-quants split a block of 32 differently. A q4_K super-block of 256 holds 8
//! sub-blocks of 32, each `d·sc·q − dmin·m` with its own 6-bit `sc` and `m`: a tile block
//! takes one sub-block, its 8 rows' scales and minimums as f32, the values as q4_0's, and
//! `dmin·m · d_x · Σ x` comes off in f32.
//!
//! Against each task dequantizing its span to f32 for the f32 GEMM
//! ([`crate::qmatvec::prefill_dequantized`], what a prefill did before on these CPUs), on
//! a Zen 3 CPU: q4_0 and q5_0 products of GPT-2's shapes 1.27–1.76× as fast
//! (`cargo bench -p mha --bench matvec -- qgemm`), whole prefills 1.08–1.38×; q8_0, with
//! its sign moves and a widening per group, only level with the f32 GEMM, so `Proj` keeps
//! q8_0 on the dequantized path (docs/PERFORMANCE.md). The sums are the scalar code's
//! ([`crate::qmatvec`]) in the same order of blocks; the tests hold the kernel to it.

use std::cell::RefCell;
use std::ops::Range;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Result, Tensor};
use half::f16;
use rayon::prelude::*;

use crate::matvec::SharedOut;
use crate::qmatvec::{Format, QRows, QK};

/// Weight rows per tile: one 32-bit lane each.
const ROWS: usize = 8;
/// Bytes per tile and block: 8 f32 scales, then 8 groups of four values of each row.
const TILE: usize = 4 * ROWS + QK * ROWS;
/// Rows of `x` per pass over a tile (four measured the same).
const XR: usize = 3;
/// Rows of `x` per chunk: their values (`CHUNK · in` bytes, 192 KiB for GPT-2's MLP
/// input of 3072) stay in L2 while the span's tiles pass over them.
const CHUNK: usize = 64;

thread_local! {
    /// Each thread's tiles of the span it multiplies.
    static TILES: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Whether this CPU runs [`prefill`]'s kernel: AVX2, FMA and F16C.
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        has!("avx2") && has!("fma") && has!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `xs [m, in] · wᵀ` over output rows `rows` of `w` (`[out, in]`, q8_0, q4_0 or q5_0 on the
/// CPU), `[m, rows.len()]` in f32, with `xs` quantized to 8 bits per block of 32; `None`
/// for other formats or devices, or a CPU without AVX2 (see [`available`]).
pub fn prefill(xs: &Tensor, w: &QTensor, rows: Range<usize>) -> Result<Option<Tensor>> {
    if !available() {
        return Ok(None);
    }
    if w.dtype() == GgmlDType::Q4K && w.shape().rank() == 2 {
        return crate::qmatvec::with_rows_of(xs, w, rows, (QK_K, Q4K_BYTES), |w, rb, x| {
            product(Kind::Q4K, w, rb, x)
        });
    }
    crate::qmatvec::with_stored_rows(xs, w, rows, |format, w, rb, x| {
        product(Kind::Stored(format), w, rb, x)
    })
}

/// A weight format the kernel takes: one of [`Format`]'s, or q4_K (super-blocks of 256
/// in 8 sub-blocks of 32, each with its own 6-bit scale and minimum).
#[derive(Clone, Copy)]
enum Kind {
    Stored(Format),
    Q4K,
}

impl Kind {
    /// Bytes of a tile block: 8 scales (and for q4_K 8 minimums) as f32, then the values.
    fn tile(self) -> usize {
        match self {
            Kind::Stored(_) => TILE,
            Kind::Q4K => TILE + 4 * ROWS,
        }
    }
}

/// Values per q4_K super-block, and its bytes: f16 `d` and `dmin`, 12 bytes of 6-bit
/// scales and minimums, 128 bytes of 4-bit values.
const QK_K: usize = 256;
const Q4K_BYTES: usize = 4 + 12 + QK_K / 2;

/// `[m, n]`: every row of `x` against the `n` weight rows of `row_bytes` bytes in `w`.
/// The caller has checked that the CPU has AVX2, FMA and F16C.
fn product(kind: Kind, w: &[u8], row_bytes: usize, x: &QRows) -> Vec<f32> {
    let tile_bytes = kind.tile();
    let (m, k) = (x.rows(), x.width());
    let n = w.len() / row_bytes.max(1);
    let mut ys = vec![0f32; m * n];
    if m == 0 || n == 0 || k == 0 {
        return ys;
    }
    let nb = k / QK;
    let (spans, parallel) = crate::matvec::spans(k, n, k * n);
    let out = SharedOut(ys.as_mut_ptr());
    let task = |&(c0, c1): &(usize, usize)| {
        let tiles = (c1 - c0).div_ceil(ROWS);
        TILES.with(|buf| {
            let mut buf = buf.borrow_mut();
            if buf.len() < tiles * nb * tile_bytes {
                buf.resize(tiles * nb * tile_bytes, 0);
            }
            for (t, tile) in buf
                .chunks_exact_mut(nb * tile_bytes)
                .take(tiles)
                .enumerate()
            {
                let rows = c0 + t * ROWS..(c0 + (t + 1) * ROWS).min(c1);
                pack(kind, w, row_bytes, rows, tile);
            }
            for r0 in (0..m).step_by(CHUNK) {
                let r1 = (r0 + CHUNK).min(m);
                for (t, tile) in buf.chunks_exact(nb * tile_bytes).take(tiles).enumerate() {
                    let c = c0 + t * ROWS;
                    let cols = (c1 - c).min(ROWS);
                    let mut r = r0;
                    while r < r1 {
                        let take = (r1 - r).min(XR);
                        let sums = tile_product(kind, tile, x, r, take);
                        for (j, s) in sums.iter().take(take).enumerate() {
                            // SAFETY: row r + j < m of `ys` (`[m, n]`), columns c..c + cols
                            // inside this task's span, which no other task writes.
                            unsafe {
                                std::ptr::copy_nonoverlapping(
                                    s.as_ptr(),
                                    out.at((r + j) * n + c),
                                    cols,
                                )
                            };
                        }
                        r += take;
                    }
                }
            }
        })
    };
    match parallel && spans.len() > 1 {
        true => spans.par_iter().for_each(task),
        false => spans.iter().for_each(task),
    }
    ys
}

/// Weight rows `rows` (at most [`ROWS`]) of `w` as tiles, one per block of 32, into
/// `tile` (`in / 32` tiles): lane `i` holds row `rows.start + i`, or zeros past `rows.end`.
fn pack(kind: Kind, w: &[u8], row_bytes: usize, rows: Range<usize>, tile: &mut [u8]) {
    let tile_bytes = kind.tile();
    // Where the values start: after the scales, and for q4_K the minimums.
    let at = tile_bytes - QK * ROWS;
    let nb = tile.len() / tile_bytes;
    for i in 0..ROWS {
        let r = rows.start + i;
        let row = (r < rows.end).then(|| &w[r * row_bytes..][..row_bytes]);
        for b in 0..nb {
            let t = &mut tile[b * tile_bytes..][..tile_bytes];
            // The scale, the minimum (q4_K), the values.
            let (d, min, v) = match (row, kind) {
                (None, _) => (0.0, 0.0, [0; QK]),
                (Some(row), Kind::Stored(format)) => {
                    let bytes = format.block_bytes();
                    let (d, v) = values(format, &row[b * bytes..][..bytes]);
                    (d, 0.0, v)
                }
                (Some(row), Kind::Q4K) => q4k_values(&row[b / 8 * Q4K_BYTES..][..Q4K_BYTES], b % 8),
            };
            t[4 * i..][..4].copy_from_slice(&d.to_le_bytes());
            if let Kind::Q4K = kind {
                t[4 * ROWS + 4 * i..][..4].copy_from_slice(&min.to_le_bytes());
            }
            for g in 0..QK / 4 {
                t[at + QK * g + 4 * i..][..4].copy_from_slice(&v[4 * g..][..4]);
            }
        }
    }
}

/// Sub-block `j` (of 8) of a q4_K super-block: its scale `d · sc`, minimum `dmin · m` and
/// 32 values `q` (the weights are `d · sc · q − dmin · m`), as ggml's `get_scale_min_k4`
/// and `dequantize_row_q4_K` read them.
fn q4k_values(block: &[u8], j: usize) -> (f32, f32, [u8; QK]) {
    let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
    let dmin = f16::from_le_bytes([block[2], block[3]]).to_f32();
    let q = &block[4..16];
    let (sc, m) = match j < 4 {
        true => (q[j] & 63, q[j + 4] & 63),
        false => (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        ),
    };
    // Sub-blocks 2p and 2p + 1 share 32 bytes: low nibbles, then high.
    let bytes = &block[16 + 32 * (j / 2)..][..32];
    let mut v = [0u8; QK];
    for (v, b) in v.iter_mut().zip(bytes) {
        *v = if j.is_multiple_of(2) { b & 15 } else { b >> 4 };
    }
    (d * sc as f32, dmin * m as f32, v)
}

/// A block's scale and its 32 values as the kernel takes them: q8_0's signed bytes,
/// q4_0's and q5_0's unsigned values (`q`, not `q - 8` or `q - 16`).
fn values(format: Format, block: &[u8]) -> (f32, [u8; QK]) {
    let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
    let mut v = [0u8; QK];
    match format {
        Format::Q8_0 => v.copy_from_slice(&block[2..2 + QK]),
        Format::Q4_0 => {
            for j in 0..QK / 2 {
                v[j] = block[2 + j] & 15;
                v[j + QK / 2] = block[2 + j] >> 4;
            }
        }
        Format::Q5_0 => {
            let qh = u32::from_le_bytes([block[2], block[3], block[4], block[5]]);
            for j in 0..QK / 2 {
                let high = |e: usize| (((qh >> e) & 1) as u8) << 4;
                v[j] = (block[6 + j] & 15) | high(j);
                v[j + QK / 2] = (block[6 + j] >> 4) | high(j + QK / 2);
            }
        }
    }
    (d, v)
}

/// Rows `r..r + take` of `x` (`take` ≤ [`XR`]) against one tile's 8 weight rows:
/// `[take][8]` sums (rows of `x` past `take` are zeros).
fn tile_product(kind: Kind, tile: &[u8], x: &QRows, r: usize, take: usize) -> [[f32; 8]; XR] {
    let nb = x.width() / QK;
    assert!(tile.len() >= nb * kind.tile() && r + take <= x.rows() && (1..=XR).contains(&take));
    let rows: [_; XR] = std::array::from_fn(|j| x.row(r + j.min(take - 1)));
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: the caller checked the CPU's features (`available`); the tile holds `nb`
        // tile blocks and every row of `x` `nb` blocks (checked above and by `QRows`).
        unsafe {
            match kind {
                Kind::Stored(Format::Q8_0) => {
                    x86::tile_rows::<true, 1, false, XR>(tile, nb, rows, 0)
                }
                Kind::Stored(Format::Q4_0) => {
                    x86::tile_rows::<false, 8, false, XR>(tile, nb, rows, 8)
                }
                Kind::Stored(Format::Q5_0) => {
                    x86::tile_rows::<false, 4, false, XR>(tile, nb, rows, 16)
                }
                Kind::Q4K => x86::tile_rows::<false, 8, true, XR>(tile, nb, rows, 0),
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (kind, rows);
        unreachable!("`prefill` returns None before a product on this architecture")
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{ROWS, TILE};
    use std::arch::x86_64::*;

    /// `R` rows of `x` (values, scales, block sums) against a tile's 8 weight rows over
    /// `nb` blocks. `SIGNED`: q8_0's signed values; otherwise unsigned values `u = w + c`,
    /// whose pair sums add as i16 for `ACC` groups before widening (ACC · 2 · 127 · max u
    /// must stay inside an i16), and whose offset `c · Σ x` comes off each block's sum.
    /// `MINS` (q4_K): the tile holds each row's minimum after its scales, and
    /// `min · d_x · Σ x` comes off instead of the offset.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `tile` holds `nb` tile blocks, and each row of `x`
    /// `nb` blocks of values, scales and sums.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn tile_rows<
        const SIGNED: bool,
        const ACC: usize,
        const MINS: bool,
        const R: usize,
    >(
        tile: &[u8],
        nb: usize,
        x: [(&[i8], &[f32], &[i32]); R],
        c: i32,
    ) -> [[f32; 8]; R] {
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); R];
        let (stride, at) = match MINS {
            true => (TILE + 4 * ROWS, 8 * ROWS),
            false => (TILE, 4 * ROWS),
        };
        for b in 0..nb {
            // SAFETY: block b of the tile and of every row of `x` are in bounds (caller).
            unsafe {
                let t = tile.as_ptr().add(b * stride);
                let mut sums = [_mm256_setzero_si256(); R];
                let mut pairs = [_mm256_setzero_si256(); R];
                for g in 0..8 {
                    let wv = _mm256_loadu_si256(t.add(at + 32 * g).cast());
                    let aw = if SIGNED { _mm256_sign_epi8(wv, wv) } else { wv };
                    for j in 0..R {
                        let xp = x[j].0.as_ptr().add(b * 32 + 4 * g).cast::<i32>();
                        let xb = _mm256_set1_epi32(xp.read_unaligned());
                        if SIGNED {
                            let p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xb, wv));
                            sums[j] = _mm256_add_epi32(sums[j], _mm256_madd_epi16(p, ones));
                        } else {
                            pairs[j] = _mm256_add_epi16(pairs[j], _mm256_maddubs_epi16(wv, xb));
                            if (g + 1) % ACC == 0 {
                                let p = _mm256_madd_epi16(pairs[j], ones);
                                sums[j] = _mm256_add_epi32(sums[j], p);
                                pairs[j] = _mm256_setzero_si256();
                            }
                        }
                    }
                }
                let dw = _mm256_loadu_ps(t.cast());
                let mins = match MINS {
                    true => _mm256_loadu_ps(t.add(4 * ROWS).cast()),
                    false => _mm256_setzero_ps(),
                };
                for j in 0..R {
                    let s = match SIGNED || MINS {
                        true => sums[j],
                        false => _mm256_sub_epi32(sums[j], _mm256_set1_epi32(c * x[j].2[b])),
                    };
                    let dx = x[j].1[b];
                    let scale = _mm256_mul_ps(dw, _mm256_set1_ps(dx));
                    acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[j]);
                    if MINS {
                        let off = _mm256_set1_ps(dx * x[j].2[b] as f32);
                        acc[j] = _mm256_fnmadd_ps(mins, off, acc[j]);
                    }
                }
            }
        }
        let mut out = [[0f32; 8]; R];
        for (o, a) in out.iter_mut().zip(acc) {
            // SAFETY: eight floats to `o`.
            unsafe { _mm256_storeu_ps(o.as_mut_ptr(), a) };
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::qmatvec::tests::weight;
    use candle_core::quantized::GgmlDType;
    use candle_core::{DType, Device};

    /// The kernel against the decoding kernels' scalar code (exact integer sums per block,
    /// f32 across blocks in the same order), for row counts around the pass of three rows and the
    /// chunk, widths with odd block counts, tiles cut short, and a range of rows.
    #[test]
    fn integer_gemm_matches_the_scalar_code() {
        if !available() {
            eprintln!("skipped: the CPU has no AVX2");
            return;
        }
        let dev = Device::Cpu;
        for dtype in [GgmlDType::Q8_0, GgmlDType::Q4_0, GgmlDType::Q5_0] {
            for (m, k, n) in [(1, 96, 5), (3, 800, 13), (70, 256, 129), (133, 512, 300)] {
                let (wd, q) = weight(n, k, dtype, m as u64);
                let x = Tensor::randn(0f32, 1.0, (m, k), &dev).unwrap();
                let xv: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
                let want = crate::qmatvec::tests::scalar_product(&q, &xv);
                for (lo, hi) in [(0, n), (1, n - 2)] {
                    let got = prefill(&x, &q, lo..hi).unwrap().unwrap();
                    assert_eq!(got.dims2().unwrap(), (m, hi - lo));
                    let got: Vec<f32> = got.flatten_all().unwrap().to_vec1().unwrap();
                    for r in 0..m {
                        for o in lo..hi {
                            let (xr, wr) = (&xv[r * k..][..k], &wd[o * k..][..k]);
                            // Σ |w|·|x|: the scale of f32 rounding in sums of its terms.
                            let mag: f32 = xr.iter().zip(wr).map(|(a, b)| (a * b).abs()).sum();
                            let (a, b) = (got[r * (hi - lo) + o - lo], want[r * n + o]);
                            assert!(
                                (a - b).abs() <= 1e-6 * mag,
                                "{dtype:?} {m}x{k}x{n} [{r}, {o}]: {a} vs {b}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// q4_K against Candle's dequantized weights times `x` as the kernel quantizes it
    /// (exact integer sums per sub-block: f32 rounding apart, the same products).
    #[test]
    fn q4_k_matches_the_dequantized_weights() {
        if !available() {
            return;
        }
        let dev = Device::Cpu;
        for (m, k, n) in [(1, 256, 9), (5, 768, 16), (70, 512, 21)] {
            let (wd, q) = weight(n, k, GgmlDType::Q4K, m as u64);
            let x = Tensor::randn(0f32, 1.0, (m, k), &dev).unwrap();
            let xv: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
            let xq = QRows::new(&xv, k);
            for (lo, hi) in [(0, n), (2, n - 1)] {
                let got = prefill(&x, &q, lo..hi).unwrap().unwrap();
                assert_eq!(got.dims2().unwrap(), (m, hi - lo));
                let got: Vec<f32> = got.flatten_all().unwrap().to_vec1().unwrap();
                for r in 0..m {
                    let (qx, dx, _) = xq.row(r);
                    for o in lo..hi {
                        let (mut want, mut mag) = (0f64, 0f64);
                        for i in 0..k {
                            let p = wd[o * k + i] as f64 * (qx[i] as f64 * dx[i / QK] as f64);
                            want += p;
                            mag += p.abs();
                        }
                        let a = got[r * (hi - lo) + o - lo] as f64;
                        assert!(
                            (a - want).abs() <= 1e-5 * mag,
                            "{m}x{k}x{n} [{r}, {o}]: {a} vs {want}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn other_formats_and_mismatched_inputs_are_refused() {
        let dev = Device::Cpu;
        let x = Tensor::zeros((2, 256), DType::F32, &dev).unwrap();
        let (_, q) = weight(4, 256, GgmlDType::Q6K, 0);
        assert!(prefill(&x, &q, 0..4).unwrap().is_none());
        if !available() {
            return;
        }
        let (_, q) = weight(4, 256, GgmlDType::Q8_0, 0);
        assert!(prefill(&x, &q, 2..5).is_err(), "rows past the weight");
        let x = Tensor::zeros((2, 128), DType::F32, &dev).unwrap();
        assert!(prefill(&x, &q, 0..4).is_err(), "inputs of another width");
    }
}
