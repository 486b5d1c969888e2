//! q8_0 and q4_0 matrices repacked for the CPU's 8-bit dot-product instructions, held as
//! the only copy of the weight.
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
//! block sums of `x` take off again. q4_0 tiles hold the same groups as nibbles (values
//! `8g..8g+3` of each row in the low halves of group `g`'s 64 bytes, `8g+4..8g+7` in the
//! high halves), already unsigned with an offset of 8: a mask, or a shift and a mask, make
//! the same operands, so a q4_0 tile takes 4 loads for 8 `vpdpbusd`. This is the layout
//! Candle uses for its own repacked kernels, which keep it *beside* the original; here it
//! replaces it, so a model holds one copy of each weight. Rows past the end of the last
//! tile have zero scales.
//!
//! Sums are exact integers per block and f32 across blocks, as in ggml. The kernels use
//! AVX-512 VNNI; [`Packed::new`] packs only where the CPU has it (elsewhere a matrix stays
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
/// Bytes of a tile's scales.
const SCALES: usize = 2 * TILE;

/// The formats packed here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Format {
    Q8_0,
    Q4_0,
}

impl Format {
    /// Bytes per tile (16 rows × one block: the stored blocks' bytes).
    fn tile_bytes(self) -> usize {
        match self {
            Self::Q8_0 => TILE * (2 + QK),
            Self::Q4_0 => TILE * (2 + QK / 2),
        }
    }

    /// What the unsigned operands carry on top of the value.
    fn offset(self) -> i32 {
        match self {
            Self::Q8_0 => 128,
            Self::Q4_0 => 8,
        }
    }

    /// Where value `v` of row `r` sits in a tile's values, and whether in the high nibble.
    fn place(self, r: usize, v: usize) -> (usize, bool) {
        match self {
            Self::Q8_0 => ((v / 4) * 4 * TILE + 4 * r + v % 4, false),
            Self::Q4_0 => ((v / 8) * 4 * TILE + 4 * r + v % 4, v % 8 >= 4),
        }
    }

    /// The unsigned operand (value plus offset) of value `v`, row `r`, in tile values `q`.
    fn operand(self, q: &[u8], r: usize, v: usize) -> i32 {
        let (at, high) = self.place(r, v);
        match (self, high) {
            (Self::Q8_0, _) => q[at] as i32,
            (Self::Q4_0, false) => (q[at] & 15) as i32,
            (Self::Q4_0, true) => (q[at] >> 4) as i32,
        }
    }
}

/// A q8_0 or q4_0 matrix `[n, k]` in tiles of 16 rows (see the module's description).
pub struct Packed {
    format: Format,
    n: usize,
    k: usize,
    /// `[n / 16 (rounded up), k / 32]` tiles of `format.tile_bytes()`.
    data: Vec<u8>,
}

impl std::fmt::Debug for Packed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Packed {:?} [{}, {}]", self.format, self.n, self.k)
    }
}

impl Packed {
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

    /// `w` repacked, or `None` when it is not a q8_0 or q4_0 matrix on the CPU or the CPU
    /// lacks the kernels.
    pub fn new(w: &QTensor) -> Result<Option<Self>> {
        if !Self::available() {
            return Ok(None);
        }
        Self::pack(w)
    }

    /// The packing alone, whatever the CPU (the tests' scalar path uses it everywhere).
    fn pack(w: &QTensor) -> Result<Option<Self>> {
        if !w.device().is_cpu() {
            return Ok(None);
        }
        let (n, k) = w.shape().dims2()?;
        let data = w.data()?;
        let mut at = 0;
        Self::from_rows(w.dtype(), n, k, |chunk| {
            let Some(src) = data.get(at..at + chunk.len()) else {
                bail!(
                    "a {:?} matrix [{n}, {k}] of {} bytes",
                    w.dtype(),
                    data.len()
                )
            };
            chunk.copy_from_slice(src);
            at += chunk.len();
            Ok(())
        })
    }

    /// A q8_0 or q4_0 matrix `[n, k]` (`None` for other formats) packed from its stored
    /// rows, which `read` fills 16 at a time (fewer for the last tile), in order: a loader
    /// can read them from a file with no buffer the size of the matrix. Packs whatever the
    /// CPU; [`Self::available`] says whether the kernels will run.
    pub fn from_rows(
        dtype: GgmlDType,
        n: usize,
        k: usize,
        mut read: impl FnMut(&mut [u8]) -> Result<()>,
    ) -> Result<Option<Self>> {
        let format = match dtype {
            GgmlDType::Q8_0 => Format::Q8_0,
            GgmlDType::Q4_0 => Format::Q4_0,
            _ => return Ok(None),
        };
        if !k.is_multiple_of(QK) {
            bail!("a {format:?} matrix [{n}, {k}]: rows are not whole blocks of {QK}")
        }
        let nb = k / QK;
        let block = format.tile_bytes() / TILE;
        // Missing rows of the last tile: zero scales, and operands that stand for zero.
        let empty = match format {
            Format::Q8_0 => 128u8,
            Format::Q4_0 => 0x88,
        };
        let mut tiles =
            crate::memory::weight_vec(n.div_ceil(TILE) * nb * format.tile_bytes(), empty);
        let mut rows = vec![0u8; TILE * nb * block];
        for (t, column) in tiles
            .chunks_exact_mut(nb * format.tile_bytes().max(1))
            .enumerate()
        {
            let count = TILE.min(n - t * TILE);
            let rows = &mut rows[..count * nb * block];
            read(rows)?;
            for (b, tile) in column.chunks_exact_mut(format.tile_bytes()).enumerate() {
                tile[..SCALES].fill(0);
                let (scales, q) = tile.split_at_mut(SCALES);
                for r in 0..count {
                    let src = &rows[(r * nb + b) * block..][..block];
                    scales[2 * r..2 * r + 2].copy_from_slice(&src[..2]);
                    for v in 0..QK {
                        let (at, high) = format.place(r, v);
                        match format {
                            Format::Q8_0 => q[at] = src[2 + v] ^ 0x80,
                            Format::Q4_0 => {
                                // Stored: value j in the low nibble of byte j, j + 16 in
                                // its high nibble.
                                let byte = src[2 + v % 16];
                                let nib = if v < 16 { byte & 15 } else { byte >> 4 };
                                q[at] = if high {
                                    (q[at] & 0x0f) | (nib << 4)
                                } else {
                                    (q[at] & 0xf0) | nib
                                };
                            }
                        }
                    }
                }
            }
        }
        Ok(Some(Self {
            format,
            n,
            k,
            data: tiles,
        }))
    }

    /// Matrices of the same format and width stacked, `[Σ n_i, k]`, or `None` when they
    /// differ or a part other than the last has rows that do not fill its last tile (its
    /// padding rows would sit between two parts).
    pub fn concat(parts: &[&Packed]) -> Option<Packed> {
        let first = parts.first()?;
        let aligned = parts[..parts.len() - 1]
            .iter()
            .all(|p| p.n.is_multiple_of(TILE));
        if !aligned
            || parts
                .iter()
                .any(|p| p.format != first.format || p.k != first.k)
        {
            return None;
        }
        let bytes: usize = parts.iter().map(|p| p.data.len()).sum();
        let mut data = crate::memory::weight_vec(bytes, 0u8);
        let mut at = 0;
        for p in parts {
            data[at..at + p.data.len()].copy_from_slice(&p.data);
            at += p.data.len();
        }
        Some(Packed {
            format: first.format,
            n: parts.iter().map(|p| p.n).sum(),
            k: first.k,
            data,
        })
    }

    /// `(n, k)`: rows (outputs) and columns (inputs).
    pub fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    /// Bytes held.
    pub fn size_in_bytes(&self) -> usize {
        self.data.len()
    }

    fn tile(&self, t: usize, b: usize) -> &[u8] {
        let size = self.format.tile_bytes();
        &self.data[(t * (self.k / QK) + b) * size..][..size]
    }

    /// Rows `ids`, dequantized: `[ids.len(), k]` (an embedding lookup).
    pub fn rows(&self, ids: &[u32]) -> Result<Vec<f32>> {
        let mut out = vec![0f32; ids.len() * self.k];
        let offset = self.format.offset();
        for (&id, row) in ids.iter().zip(out.chunks_exact_mut(self.k.max(1))) {
            let id = id as usize;
            if id >= self.n {
                bail!("row {id} of a table with {} rows", self.n)
            }
            let (t, r) = (id / TILE, id % TILE);
            for (b, values) in row.chunks_exact_mut(QK).enumerate() {
                let tile = self.tile(t, b);
                let d = f16::from_le_bytes([tile[2 * r], tile[2 * r + 1]]).to_f32();
                for (v, y) in values.iter_mut().enumerate() {
                    let u = self.format.operand(&tile[SCALES..], r, v);
                    *y = (u - offset) as f32 * d;
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
        Ok(self.product(&x, m, cols, Packed::available()))
    }

    fn product(&self, x: &QRows, m: usize, cols: std::ops::Range<usize>, simd: bool) -> Vec<f32> {
        let nb = self.k / QK;
        let (t0, t1) = (cols.start / TILE, cols.end.div_ceil(TILE));
        let width = cols.len();
        if m == 0 || width == 0 {
            return vec![0.0; m * width];
        }
        let size = self.format.tile_bytes();
        let mut ys = vec![0f32; m * width];
        let out = SharedOut(ys.as_mut_ptr());
        // Each thread takes a contiguous range of tiles: one stream through memory.
        let parts = ranges(t1 - t0, 4, (t1 - t0) * TILE * self.k);
        map_ranges(&parts, |lo, hi| {
            let out = &out;
            for t in lo..hi {
                let tiles = &self.data[(t0 + t) * nb * size..][..nb * size];
                // The tile's outputs are rows first..first + 16 of W; the asked-for ones
                // land in columns c0..c1 of `ys`.
                let first = (t0 + t) * TILE;
                let (c0, c1) = (first.max(cols.start), (first + TILE).min(cols.end));
                let mut r = 0;
                while r < m {
                    // Up to four rows of `x` per pass over the tile's blocks (from L1): four
                    // independent sums in flight, the tile's loads shared. (Eight rows per
                    // pass prefilled 10-20% slower: registers run out.)
                    let rows = (m - r).min(4);
                    let mut y = [[0f32; TILE]; 4];
                    tile_rows(self.format, tiles, x, r, rows, &mut y, simd);
                    for (j, y) in y.iter().enumerate().take(rows) {
                        let at = (r + j) * width + c0 - cols.start;
                        // SAFETY: `at..at + c1 - c0` lies in row r + j of `ys` (m rows of
                        // `width`), and only the thread holding tile t writes its columns.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                y[c0 - first..].as_ptr(),
                                out.0.add(at),
                                c1 - c0,
                            )
                        };
                    }
                    r += rows;
                }
            }
        });
        ys
    }
}

/// The product's output, written by several threads at disjoint columns.
struct SharedOut(*mut f32);
// SAFETY: the threads write disjoint elements (see `Packed::product`), and the vector
// outlives them (`map_ranges` returns when they are done).
unsafe impl Sync for SharedOut {}

/// `y[j] += x row r + j · tile rows`, for `rows` (1–4) rows of `x` and one column of tiles.
fn tile_rows(
    format: Format,
    tiles: &[u8],
    x: &QRows,
    r: usize,
    rows: usize,
    y: &mut [[f32; TILE]; 4],
    simd: bool,
) {
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: `simd` is only set where `Packed::available()` saw the features; the
        // kernel checks the lengths.
        unsafe {
            match (format, rows) {
                (Format::Q8_0, 1) => x86::tile_rows::<1, false>(tiles, x, r, y),
                (Format::Q8_0, 2) => x86::tile_rows::<2, false>(tiles, x, r, y),
                (Format::Q8_0, 3) => x86::tile_rows::<3, false>(tiles, x, r, y),
                (Format::Q8_0, _) => x86::tile_rows::<4, false>(tiles, x, r, y),
                (Format::Q4_0, 1) => x86::tile_rows::<1, true>(tiles, x, r, y),
                (Format::Q4_0, 2) => x86::tile_rows::<2, true>(tiles, x, r, y),
                (Format::Q4_0, 3) => x86::tile_rows::<3, true>(tiles, x, r, y),
                (Format::Q4_0, _) => x86::tile_rows::<4, true>(tiles, x, r, y),
            }
        }
        return;
    }
    let _ = simd;
    let size = format.tile_bytes();
    for (j, y) in y.iter_mut().enumerate().take(rows) {
        let (xq, xd, xs) = x.row(r + j);
        for (b, tile) in tiles.chunks_exact(size).enumerate() {
            let xb = &xq[b * QK..][..QK];
            for (row, y) in y.iter_mut().enumerate() {
                let sum: i32 = (0..QK)
                    .map(|v| format.operand(&tile[SCALES..], row, v) * xb[v] as i32)
                    .sum::<i32>()
                    - format.offset() * xs[b];
                let d = f16::from_le_bytes([tile[2 * row], tile[2 * row + 1]]).to_f32();
                *y += sum as f32 * (d * xd[b]);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{QRows, QK, SCALES, TILE};
    use std::arch::x86_64::*;

    /// The low (or, `HIGH`, the high) nibbles of the 64 bytes at `p`, as bytes. (A function
    /// and not a closure: closures do not inherit the target features.)
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn nibbles<const HIGH: bool>(p: *const u8) -> __m512i {
        // SAFETY (caller): 64 readable bytes at `p`.
        let v = unsafe { _mm512_loadu_si512(p.cast()) };
        let v = if HIGH { _mm512_srli_epi16::<4>(v) } else { v };
        _mm512_and_si512(v, _mm512_set1_epi8(0x0f))
    }

    /// `R` rows of `x` (from row `r`) against one column of tiles (q4_0 when `Q4`, else
    /// q8_0). Per block and row of `x`: eight `vpdpbusd` (in two chains), one conversion
    /// and one multiply-add; the tile's operands are loaded (q4_0: and unpacked) once for
    /// the `R` rows.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
    pub unsafe fn tile_rows<const R: usize, const Q4: bool>(
        tiles: &[u8],
        x: &QRows,
        r: usize,
        y: &mut [[f32; TILE]; 4],
    ) {
        let (size, offset) = if Q4 {
            (SCALES + 256, 8)
        } else {
            (SCALES + 512, 128)
        };
        let nb = tiles.len() / size;
        let mut xq = [std::ptr::null::<i8>(); R];
        let mut xd = [std::ptr::null::<f32>(); R];
        let mut xs = [std::ptr::null::<i32>(); R];
        for j in 0..R {
            let (q, d, s) = x.row(r + j);
            assert!(q.len() >= nb * QK && d.len() >= nb && s.len() >= nb);
            (xq[j], xd[j], xs[j]) = (q.as_ptr(), d.as_ptr(), s.as_ptr());
        }
        let mut acc = [_mm512_setzero_ps(); R];
        for b in 0..nb {
            // SAFETY: tile b is `size` readable bytes; block b of each row of `x` is in
            // bounds (asserted above).
            unsafe {
                let tile = tiles.as_ptr().add(b * size);
                let d = _mm512_cvtph_ps(_mm256_loadu_si256(tile.cast()));
                let q = tile.add(SCALES);
                // w[g] pairs with values 4g..4g+3 of `x`'s block.
                let w = if Q4 {
                    [
                        nibbles::<false>(q),
                        nibbles::<true>(q),
                        nibbles::<false>(q.add(64)),
                        nibbles::<true>(q.add(64)),
                        nibbles::<false>(q.add(128)),
                        nibbles::<true>(q.add(128)),
                        nibbles::<false>(q.add(192)),
                        nibbles::<true>(q.add(192)),
                    ]
                } else {
                    [
                        _mm512_loadu_si512(q.cast()),
                        _mm512_loadu_si512(q.add(64).cast()),
                        _mm512_loadu_si512(q.add(128).cast()),
                        _mm512_loadu_si512(q.add(192).cast()),
                        _mm512_loadu_si512(q.add(256).cast()),
                        _mm512_loadu_si512(q.add(320).cast()),
                        _mm512_loadu_si512(q.add(384).cast()),
                        _mm512_loadu_si512(q.add(448).cast()),
                    ]
                };
                for j in 0..R {
                    let p = xq[j].add(b * QK).cast::<i32>();
                    let mut s0 = _mm512_setzero_si512();
                    let mut s1 = _mm512_set1_epi32(-offset * *xs[j].add(b));
                    for g in (0..8).step_by(2) {
                        let x0 = _mm512_set1_epi32(p.add(g).read_unaligned());
                        let x1 = _mm512_set1_epi32(p.add(g + 1).read_unaligned());
                        s0 = _mm512_dpbusd_epi32(s0, w[g], x0);
                        s1 = _mm512_dpbusd_epi32(s1, w[g + 1], x1);
                    }
                    let s = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
                    let dx = _mm512_set1_ps(*xd[j].add(b));
                    acc[j] = _mm512_fmadd_ps(s, _mm512_mul_ps(d, dx), acc[j]);
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

    fn quantized(n: usize, k: usize, dtype: GgmlDType) -> QTensor {
        let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu).unwrap();
        QTensor::quantize(&w, dtype).unwrap()
    }

    const FORMATS: [GgmlDType; 2] = [GgmlDType::Q8_0, GgmlDType::Q4_0];

    #[test]
    fn rows_are_candles_dequantized_rows() {
        // 37 rows: two whole tiles and a partial one.
        for dtype in FORMATS {
            let q = quantized(37, 96, dtype);
            let p = Packed::pack(&q).unwrap().unwrap();
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
    }

    #[test]
    fn products_match_candle_and_the_scalar_code() {
        for (dtype, (m, n, k, cols)) in FORMATS.into_iter().flat_map(|d| {
            [
                (1, 50, 64, 0..50),
                (3, 300, 768, 0..300),
                (6, 64, 128, 17..40),
                (9, 33, 32, 5..33),
                // Split across threads, a partial tile at either end.
                (5, 200, 512, 23..190),
            ]
            .map(|s| (d, s))
        }) {
            let q = quantized(n, k, dtype);
            let p = Packed::pack(&q).unwrap().unwrap();
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
                    "{dtype:?} {m}x{n}x{k}: {a} vs {b}"
                );
            }
            if Packed::available() {
                let simd = p.product(&xq, m, cols.clone(), true);
                for (a, b) in simd.iter().zip(&scalar) {
                    assert!((a - b).abs() <= 1e-5 * mag, "{m}x{n}x{k}: {a} vs {b}");
                }
            }
        }
    }

    #[test]
    fn other_formats_are_not_packed() {
        let w = Tensor::randn(0f32, 1.0, (16, 256), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&w, GgmlDType::Q4K).unwrap();
        assert!(Packed::pack(&q).unwrap().is_none());
    }
}
