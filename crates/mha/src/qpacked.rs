//! q8_0 matrices repacked for the CPU's 8-bit dot-product instructions, held as the only
//! copy of the weight.
//!
//! A q8_0 matrix `[n, k]` is stored by GGUF (and Candle) row after row of blocks (an f16
//! scale and 32 signed bytes). A product with that layout must reduce each block's sums
//! across lanes before scaling them, about eight instructions per 32 products
//! ([`crate::qmatvec`]). Here the same bytes are regrouped in tiles of 16 rows × one block:
//! the 16 scales, then the 32 values of each row in groups of four, so that one 64-byte
//! load holds four values of each of the 16 rows, and one `vpdpbusd` multiplies them by
//! four values of `x` broadcast to every lane, adding into one lane per row. A tile's 512
//! products take eight instructions and its scaling one: no horizontal sums at all. Values
//! are stored with 128 added (unsigned, as `vpdpbusd` wants its first operand), which the
//! block sums of `x` take off again. This is the layout Candle uses for its own repacked
//! kernels, which keep it *beside* the original; here it replaces it, so a model holds one
//! copy of each weight. Rows past the end of the last tile have zero scales.
//!
//! Sums are exact integers per block and f32 across blocks, as in ggml. The kernels use
//! AVX-512 VNNI; [`PackedQ8::new`] packs only where the CPU has it (elsewhere a matrix stays
//! a `QTensor` on [`crate::qmatvec`] or Candle's kernels), and a scalar version of the same
//! arithmetic is the tests' reference for the packing and for the kernels.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{bail, Result};
use half::f16;

use crate::matvec::{map_ranges, ranges};
use crate::qmatvec::QRows;

/// Rows per tile.
const TILE: usize = 16;
/// Values per block.
const QK: usize = 32;

/// One block (32 values) of 16 rows.
#[derive(Clone, Copy)]
#[repr(C)]
struct Tile {
    /// Each row's scale.
    d: [f16; TILE],
    /// `q[g][4·r + j]` = value `4g + j` of row `r`, plus 128.
    q: [[u8; 4 * TILE]; QK / 4],
}

const _: () = assert!(std::mem::size_of::<Tile>() == TILE * (2 + QK));

/// A q8_0 matrix `[n, k]` in tiles of 16 rows (see the module's description).
pub struct PackedQ8 {
    n: usize,
    k: usize,
    /// `[n / 16 (rounded up), k / 32]`.
    tiles: Vec<Tile>,
}

impl std::fmt::Debug for PackedQ8 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PackedQ8 [{}, {}]", self.n, self.k)
    }
}

impl PackedQ8 {
    /// Whether this CPU has the kernels (AVX-512 with VNNI and byte operations).
    pub fn available() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            has!("avx512f") && has!("avx512bw") && has!("avx512vnni")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }

    /// `w` repacked, or `None` when it is not a q8_0 matrix on the CPU or the CPU lacks the
    /// kernels.
    pub fn new(w: &QTensor) -> Result<Option<Self>> {
        if !Self::available() {
            return Ok(None);
        }
        Self::pack(w)
    }

    /// The packing alone, whatever the CPU (the tests' scalar path uses it everywhere).
    fn pack(w: &QTensor) -> Result<Option<Self>> {
        if w.dtype() != GgmlDType::Q8_0 || !w.device().is_cpu() {
            return Ok(None);
        }
        let (n, k) = w.shape().dims2()?;
        let data = w.data()?;
        let nb = k / QK;
        if data.len() < n * nb * (2 + QK) {
            bail!("a q8_0 matrix [{n}, {k}] of {} bytes", data.len())
        }
        let empty = Tile {
            d: [f16::ZERO; TILE],
            q: [[128; 4 * TILE]; QK / 4],
        };
        let mut tiles = vec![empty; n.div_ceil(TILE) * nb];
        for (i, tile) in tiles.iter_mut().enumerate() {
            let (t, b) = (i / nb, i % nb);
            for r in 0..TILE.min(n - t * TILE) {
                let block = &data[((t * TILE + r) * nb + b) * (2 + QK)..][..2 + QK];
                tile.d[r] = f16::from_le_bytes([block[0], block[1]]);
                for (v, &q) in block[2..].iter().enumerate() {
                    tile.q[v / 4][4 * r + v % 4] = q ^ 0x80;
                }
            }
        }
        Ok(Some(Self { n, k, tiles }))
    }

    /// `(n, k)`: rows (outputs) and columns (inputs).
    pub fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    /// Bytes held.
    pub fn size_in_bytes(&self) -> usize {
        std::mem::size_of_val(self.tiles.as_slice())
    }

    /// Rows `ids`, dequantized: `[ids.len(), k]` (an embedding lookup).
    pub fn rows(&self, ids: &[u32]) -> Result<Vec<f32>> {
        let nb = self.k / QK;
        let mut out = vec![0f32; ids.len() * self.k];
        for (&id, row) in ids.iter().zip(out.chunks_exact_mut(self.k.max(1))) {
            let id = id as usize;
            if id >= self.n {
                bail!("row {id} of a table with {} rows", self.n)
            }
            let (t, r) = (id / TILE, id % TILE);
            for (b, values) in row.chunks_exact_mut(QK).enumerate() {
                let tile = &self.tiles[t * nb + b];
                let d = tile.d[r].to_f32();
                for (v, y) in values.iter_mut().enumerate() {
                    *y = ((tile.q[v / 4][4 * r + v % 4] ^ 0x80) as i8) as f32 * d;
                }
            }
        }
        Ok(out)
    }

    /// The whole matrix, dequantized: `[n, k]` row-major.
    pub fn dequantize(&self) -> Result<Vec<f32>> {
        let ids: Vec<u32> = (0..self.n as u32).collect();
        self.rows(&ids)
    }

    /// `x [m, k] · Wᵀ` over output rows `cols` (a range of `W`'s rows, which this rounds
    /// out to whole tiles while computing): `[m, cols.len()]` row-major.
    pub fn matmul(&self, x: &[f32], m: usize, cols: std::ops::Range<usize>) -> Result<Vec<f32>> {
        if x.len() != m * self.k {
            bail!(
                "packed product: {} inputs for {m} rows of {}",
                x.len(),
                self.k
            )
        }
        if cols.start > cols.end || cols.end > self.n {
            bail!("packed product: outputs {cols:?} of {}", self.n)
        }
        let x = QRows::new(x, self.k);
        Ok(self.product(&x, m, cols, PackedQ8::available()))
    }

    fn product(&self, x: &QRows, m: usize, cols: std::ops::Range<usize>, simd: bool) -> Vec<f32> {
        let nb = self.k / QK;
        let (t0, t1) = (cols.start / TILE, cols.end.div_ceil(TILE));
        let width = cols.len();
        if m == 0 || width == 0 {
            return vec![0.0; m * width];
        }
        // Each thread takes a contiguous range of tiles: one stream through memory.
        let parts = ranges(t1 - t0, 4, (t1 - t0) * TILE * self.k);
        let blocks = map_ranges(&parts, |lo, hi| {
            let mut out = vec![0f32; m * (hi - lo) * TILE];
            for t in lo..hi {
                let tiles = &self.tiles[(t0 + t) * nb..][..nb];
                let mut r = 0;
                while r < m {
                    // Up to four rows of `x` per pass over the tile's blocks (from L1): four
                    // independent sums in flight, the tile's loads shared.
                    let rows = (m - r).min(4);
                    let mut y = [[0f32; TILE]; 4];
                    tile_rows(tiles, x, r, rows, &mut y, simd);
                    for (j, y) in y.iter().enumerate().take(rows) {
                        let at = (r + j) * (hi - lo) * TILE + (t - lo) * TILE;
                        out[at..at + TILE].copy_from_slice(y);
                    }
                    r += rows;
                }
            }
            out
        });
        // Gather each thread's tiles, then keep the asked-for columns.
        let mut ys = vec![0f32; m * width];
        for (&(lo, hi), block) in parts.iter().zip(&blocks) {
            let span = (hi - lo) * TILE;
            for r in 0..m {
                // Columns of this part: global rows (t0 + lo)·16 ..
                let first = (t0 + lo) * TILE;
                for c in 0..span {
                    let col = first + c;
                    if col >= cols.start && col < cols.end {
                        ys[r * width + col - cols.start] = block[r * span + c];
                    }
                }
            }
        }
        ys
    }
}

/// `y[j] = x row r + j · tile rows`, for `rows` (1–4) rows of `x` and one tile column.
fn tile_rows(
    tiles: &[Tile],
    x: &QRows,
    r: usize,
    rows: usize,
    y: &mut [[f32; TILE]; 4],
    simd: bool,
) {
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: `simd` is only set where `PackedQ8::available()` saw the features, and
        // every row of `x` holds one block per tile.
        unsafe {
            match rows {
                1 => x86::tile_rows::<1>(tiles, x, r, y),
                2 => x86::tile_rows::<2>(tiles, x, r, y),
                3 => x86::tile_rows::<3>(tiles, x, r, y),
                _ => x86::tile_rows::<4>(tiles, x, r, y),
            }
        }
        return;
    }
    let _ = simd;
    for (j, y) in y.iter_mut().enumerate().take(rows) {
        let (xq, xd, xs) = x.row(r + j);
        for (b, tile) in tiles.iter().enumerate() {
            let xb = &xq[b * QK..][..QK];
            for (row, y) in y.iter_mut().enumerate() {
                let sum: i32 = (0..QK)
                    .map(|v| tile.q[v / 4][4 * row + v % 4] as i32 * xb[v] as i32)
                    .sum::<i32>()
                    - 128 * xs[b];
                *y += sum as f32 * (tile.d[row].to_f32() * xd[b]);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{QRows, Tile, QK, TILE};
    use std::arch::x86_64::*;

    /// `R` rows of `x` (from row `r`) against one column of tiles. Per block and row of
    /// `x`: eight `vpdpbusd` (in two chains), the offset, one conversion and one multiply-add.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
    pub unsafe fn tile_rows<const R: usize>(
        tiles: &[Tile],
        x: &QRows,
        r: usize,
        y: &mut [[f32; TILE]; 4],
    ) {
        let mut xq = [std::ptr::null::<i8>(); R];
        let mut xd = [std::ptr::null::<f32>(); R];
        let mut xs = [std::ptr::null::<i32>(); R];
        for j in 0..R {
            let (q, d, s) = x.row(r + j);
            assert!(
                q.len() >= tiles.len() * QK && d.len() >= tiles.len() && s.len() >= tiles.len()
            );
            (xq[j], xd[j], xs[j]) = (q.as_ptr(), d.as_ptr(), s.as_ptr());
        }
        let mut acc = [_mm512_setzero_ps(); R];
        for (b, tile) in tiles.iter().enumerate() {
            // SAFETY: the tile is 544 readable bytes; block b of each row of `x` is in
            // bounds (asserted above).
            unsafe {
                let d = _mm512_cvtph_ps(_mm256_loadu_si256(tile.d.as_ptr().cast()));
                let q = tile.q.as_ptr().cast::<u8>();
                let w = [
                    _mm512_loadu_si512(q.cast()),
                    _mm512_loadu_si512(q.add(64).cast()),
                    _mm512_loadu_si512(q.add(128).cast()),
                    _mm512_loadu_si512(q.add(192).cast()),
                    _mm512_loadu_si512(q.add(256).cast()),
                    _mm512_loadu_si512(q.add(320).cast()),
                    _mm512_loadu_si512(q.add(384).cast()),
                    _mm512_loadu_si512(q.add(448).cast()),
                ];
                for j in 0..R {
                    let p = xq[j].add(b * QK).cast::<i32>();
                    let mut s0 = _mm512_setzero_si512();
                    let mut s1 = _mm512_set1_epi32(-128 * *xs[j].add(b));
                    for g in (0..8).step_by(2) {
                        s0 = _mm512_dpbusd_epi32(
                            s0,
                            w[g],
                            _mm512_set1_epi32(p.add(g).read_unaligned()),
                        );
                        s1 = _mm512_dpbusd_epi32(
                            s1,
                            w[g + 1],
                            _mm512_set1_epi32(p.add(g + 1).read_unaligned()),
                        );
                    }
                    let s = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
                    acc[j] =
                        _mm512_fmadd_ps(s, _mm512_mul_ps(d, _mm512_set1_ps(*xd[j].add(b))), acc[j]);
                }
            }
        }
        for j in 0..R {
            // SAFETY: 16 floats to a [f32; 16].
            unsafe { _mm512_storeu_ps(y[j].as_mut_ptr(), acc[j]) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::QMatMul;
    use candle_core::{Device, Module, Tensor};

    fn quantized(n: usize, k: usize) -> QTensor {
        let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu).unwrap();
        QTensor::quantize(&w, GgmlDType::Q8_0).unwrap()
    }

    #[test]
    fn rows_are_candles_dequantized_rows() {
        // 37 rows: two whole tiles and a partial one.
        let q = quantized(37, 96);
        let p = PackedQ8::pack(&q).unwrap().unwrap();
        let ours = p.dequantize().unwrap();
        let theirs: Vec<f32> = q
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(ours, theirs);
        assert_eq!(
            p.rows(&[36, 0]).unwrap(),
            [&theirs[36 * 96..], &theirs[..96]].concat()
        );
        assert!(p.rows(&[37]).is_err());
    }

    #[test]
    fn products_match_candle_and_the_scalar_code() {
        for (m, n, k, cols) in [
            (1, 50, 64, 0..50),
            (3, 300, 768, 0..300),
            (6, 64, 128, 17..40),
            (9, 33, 32, 5..33),
        ] {
            let q = quantized(n, k);
            let p = PackedQ8::pack(&q).unwrap().unwrap();
            let x = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu).unwrap();
            let xv: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
            let xq = QRows::new(&xv, k);
            let scalar = p.product(&xq, m, cols.clone(), false);
            // Candle's product quantizes x as ggml does: the same sums in another order.
            let theirs = QMatMul::from_qtensor(q).unwrap().forward(&x).unwrap();
            let theirs: Vec<f32> = theirs
                .narrow(1, cols.start, cols.len())
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let mag = theirs.iter().fold(1f32, |a, v| a.max(v.abs()));
            for (a, b) in scalar.iter().zip(&theirs) {
                assert!(
                    (a - b).abs() <= 1e-5 * mag * (k as f32).sqrt(),
                    "{m}x{n}x{k}: {a} vs {b}"
                );
            }
            if PackedQ8::available() {
                let simd = p.product(&xq, m, cols.clone(), true);
                for (a, b) in simd.iter().zip(&scalar) {
                    assert!((a - b).abs() <= 1e-5 * mag, "{m}x{n}x{k}: {a} vs {b}");
                }
            }
        }
    }

    #[test]
    fn other_formats_are_not_packed() {
        let w = Tensor::randn(0f32, 1.0, (16, 64), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&w, GgmlDType::Q4_0).unwrap();
        assert!(PackedQ8::pack(&q).unwrap().is_none());
    }
}
