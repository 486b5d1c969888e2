//! Block-quantized matrices (ggml's q8_0, q4_0, q5_0, q4_1, q5_1 and the k-quants q2_K to
//! q6_K) repacked for the CPU's 8-bit dot-product instructions, held as the only copy of
//! the weight.
//!
//! A q8_0 matrix `[n, k]` is stored by GGUF (and Candle) row after row of blocks (an f16
//! scale and 32 signed bytes). A product with that layout must reduce each block's sums
//! across lanes before scaling them, about eight instructions per 32 products. Here the
//! same bytes are regrouped in tiles of 16 rows × one block: the 16 scales, then the 32
//! values of each row in groups of four, so that one 64-byte load holds four values of
//! each of the 16 rows, and one `vpdpbusd` multiplies them by four values of `x` broadcast
//! to every lane, adding into one lane per row. A tile's 512
//! products take eight instructions and its scaling one: no horizontal sums at all. Values
//! are stored with 128 added (unsigned, as `vpdpbusd` wants its first operand), which the
//! block sums of `x` take off again. q4_0 tiles hold the same groups as nibbles (values
//! `8g..8g+3` of each row in the low halves of group `g`'s 64 bytes, `8g+4..8g+7` in the
//! high halves), already unsigned with an offset of 8: a mask, or a shift and a mask, make
//! the same operands, so a q4_0 tile takes 4 loads for 8 `vpdpbusd`. The five-bit formats
//! add a plane of 64 bytes per block whose bit `g` is the fifth bit of group `g`'s operand;
//! q4_1 and q5_1 keep their minima beside the scales, multiplied by the block sums of `x`.
//! The k-quants tile 16 rows × one super-block of 256 values: each sub-block's values laid
//! out as above (q2_K's and q3_K's two low bits as bit pairs, four groups to 64 bytes), its
//! integer scales (and minima) in bytes, one lane per row, and multiplied in as integers,
//! as ggml does, with `x` quantized per 256 values as ggml's q8_K, so the products track
//! llama.cpp's to rounding. A prefill (8 rows of `x` or more) unpacks each column of
//! three-, five- and six-bit tiles once, into a buffer of operands its thread reuses,
//! instead of in every pass of four rows. Candle 0.11 repacks q8_0 this way
//! (and q4_K, q6_K its own way) for its x86 kernels, but keeps the copy *beside* the
//! original; here it replaces it, so a model holds one copy of each weight (a few % more
//! bytes for the k-quants, whose scales are unpacked). Rows past the end of the last tile
//! have zero scales.
//!
//! Sums are exact integers per block (per super-block for the k-quants) and f32 across blocks,
//! as in ggml. The kernels use AVX-512 VNNI, or AVX2 (`vpmaddubsw` on each half of a tile,
//! rows 0–7 and 8–15, in place of `vpdpbusd`; for q8_0 the values' magnitudes by `x` with
//! their signs, as ggml's AVX2 code multiplies them); [`Packed::new`] packs
//! only where the CPU has kernels for the format (elsewhere a matrix stays a `QTensor` on
//! [`crate::quant::stored`]'s scalar products or Candle's kernels), and a scalar version of
//! the same arithmetic is the tests' reference for the packing and the kernels, beside Candle's dequantized weights
//! and products.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{bail, Result};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use super::ahead::Spread;
use super::format::{q4k, Format, SCALES, TILE};
use super::input::XRows;
use super::level::{level, Level};
use super::scalar::scalar_rows;
#[cfg(target_arch = "x86_64")]
use super::{avx2, avx512};
use crate::dense::{map_ranges, ranges};
use crate::shared::SharedOut;
use crate::team::Streams;

/// A block-quantized matrix `[n, k]` in tiles of 16 rows (see the module's
/// description).
pub struct Packed {
    format: Format,
    n: usize,
    k: usize,
    /// `[n / 16 (rounded up), k / format.values()]` tiles of `format.tile_bytes()`.
    data: Tiles,
}

/// Where a matrix's tiles live: its own buffer (as loaded), or a range of a slab shared
/// with the model's other matrices ([`Packed::settled`]).
enum Tiles {
    Own(Vec<u8>),
    #[cfg(unix)]
    Slab(crate::memory::SlabBytes),
}

impl std::ops::Deref for Tiles {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Tiles::Own(v) => v,
            #[cfg(unix)]
            Tiles::Slab(s) => s,
        }
    }
}

impl Tiles {
    /// `len` bytes in a slab, filled by `fill`; `None` where there is no slab (a system
    /// without `mmap`, or one that refused the mapping).
    fn in_slab(len: usize, fill: impl FnOnce(&mut [u8])) -> Option<Tiles> {
        #[cfg(unix)]
        if let Some(mut s) = crate::memory::slab_bytes(len) {
            fill(s.as_mut_slice());
            return Some(Tiles::Slab(s));
        }
        let _ = (len, fill);
        None
    }

    /// `len` zero bytes, in a slab where `slab` asks for one and there is one, else in a
    /// buffer of their own; either way untouched until written where the memory is fresh.
    fn zeroed(len: usize, slab: bool) -> Tiles {
        #[cfg(unix)]
        if let Some(s) = slab.then(|| crate::memory::slab_bytes(len)).flatten() {
            return Tiles::Slab(s);
        }
        let _ = slab;
        Tiles::Own(crate::memory::packed_weight_zeroed(len))
    }

    /// The bytes, to write.
    fn as_mut_slice(&mut self) -> &mut [u8] {
        match self {
            Tiles::Own(v) => v,
            #[cfg(unix)]
            Tiles::Slab(s) => s.as_mut_slice(),
        }
    }

    /// `len` bytes in a slab where there is one, else in a buffer of their own.
    fn new(len: usize, fill: impl Fn(&mut [u8])) -> Tiles {
        Self::in_slab(len, &fill).unwrap_or_else(|| {
            let mut v = crate::memory::packed_weight_vec(len, 0u8);
            fill(&mut v);
            Tiles::Own(v)
        })
    }
}

impl std::fmt::Debug for Packed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Packed {:?} [{}, {}]", self.format, self.n, self.k)
    }
}

impl Drop for Packed {
    fn drop(&mut self) {
        PACKED_BYTES.fetch_sub(self.data.len(), Ordering::Relaxed);
    }
}

/// The bytes all live [`Packed`] matrices hold: the weights a decoding step streams.
static PACKED_BYTES: AtomicUsize = AtomicUsize::new(0);

/// Stored bytes [`Packed::from_rows`] asks its reader for at once (whole tiles, at least
/// one): enough tiles to share among the threads, little memory beside the matrix.
const PACK_GROUP_BYTES: usize = 1 << 20;

/// From this many packed bytes on, decoding reads the weights from memory rather than
/// from the last-level cache (the size of a desktop CPU's), and each tile's successor
/// is prefetched (see [`Packed::product`]). The unit tests' small matrices take that path.
const STREAMED_BYTES: usize = if cfg!(test) { 1 } else { 32 << 20 };

/// How a decoding thread asks for the weights it streams from memory before its kernels
/// read them: the whole next tile column at once (`column`), or the k-quant kernels each
/// super-block's successor an eighth at a time (`spread`); and whether the AVX-512
/// kernels of the k-quants with the smaller tiles (q2_K, q3_K, q4_K) read two columns
/// together (`two`: two streams, each asking for its next super-block as `spread` does).
/// The column pays on AMD CPUs; on Intel's its hundreds of prefetches at once stall the
/// thread (each holds a line fill buffer until its line arrives), where the spread
/// requests pay. On an AMD CPU with AVX-512 the two streams read layer-sized q4_K, q3_K
/// and q2_K matrices faster than one stream and its columns; q5_K's and q6_K's about as
/// fast, and whole decoding with them level (not measured on Intel's). So AMD CPUs with
/// AVX-512 take the column, or the two streams where they pay, others the spread requests.
/// (With AVX2 alone the kernels spend longer on each tile, and on an AMD CPU too the
/// column's burst of requests stalled them where the spread ones let the reads overlap
/// the arithmetic.) The column, the two streams and q8_0's requests for the tile a few
/// blocks on (`avx512::legacy_rows`) paid on a Zen 5; a Zen 4 with AVX-512 (family 0x19,
/// whose 512-bit operations run as two halves) decoded faster without the column and the
/// two streams, with the spread requests as CPUs without AVX-512 take them, and its q8_0
/// streams faster through the AVX2 kernel, which asks for nothing (`q8_avx2`; from the
/// cache the AVX-512 one is the faster). There the spread requests ask four super-blocks
/// on, into the second-level cache (`far`, [`Spread::Far`]): one ahead left the q4_K and
/// q6_K kernels waiting on their loads. The unit tests take all of them but `q8_avx2`,
/// whose AVX2 kernel they take at its own level. The measurements are in
/// docs/PERFORMANCE.md ("Quantized products").
#[derive(Clone, Copy)]
struct Ahead {
    column: bool,
    spread: bool,
    far: bool,
    two: bool,
    q8_avx2: bool,
}

impl Ahead {
    fn here(level: Level) -> Ahead {
        let amd_avx512 = amd() && level >= Level::Avx512Vnni;
        let zen4 = amd_avx512 && family() == 0x19;
        let burst = amd_avx512 && !zen4;
        Ahead {
            column: burst || cfg!(test),
            spread: !burst || cfg!(test),
            far: zen4,
            two: burst || cfg!(test),
            q8_avx2: zen4 && !cfg!(test),
        }
    }
}

/// Whether this is an AMD CPU.
fn amd() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static AMD: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *AMD.get_or_init(|| {
            // The vendor string, "AuthenticAMD", in EBX, EDX, ECX of leaf 0.
            let id = std::arch::x86_64::__cpuid(0);
            [id.ebx, id.edx, id.ecx] == [0x6874_7541, 0x6974_6e65, 0x444d_4163]
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// The CPU's family (CPUID leaf 1: the base family, plus the extended one where the base
/// is 0xF): 0x19 for AMD's Zen 3 and Zen 4, 0x1A for Zen 5.
fn family() -> u32 {
    #[cfg(target_arch = "x86_64")]
    {
        // (Looked up once: in a virtual machine CPUID traps to the host.)
        static FAMILY: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
        *FAMILY.get_or_init(|| {
            let eax = std::arch::x86_64::__cpuid(1).eax;
            let base = (eax >> 8) & 0xF;
            match base {
                0xF => base + ((eax >> 20) & 0xFF),
                _ => base,
            }
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    0
}

impl Packed {
    /// A matrix holding `data` (counted in [`PACKED_BYTES`] until dropped).
    fn holding(format: Format, n: usize, k: usize, data: Tiles) -> Self {
        PACKED_BYTES.fetch_add(data.len(), Ordering::Relaxed);
        Self { format, n, k, data }
    }

    /// Whether matrices of `dtype` can be packed (whatever the CPU).
    pub fn packs(dtype: GgmlDType) -> bool {
        Format::of(dtype).is_some()
    }

    /// Whether this CPU has kernels for packed matrices of `dtype`: every packed format
    /// with AVX-512 VNNI or AVX2.
    pub fn packs_here(dtype: GgmlDType) -> bool {
        Format::of(dtype).is_some_and(|f| f.kernels(level()))
    }

    /// `w` repacked, or `None` when it is not a matrix of a format packed here (see the
    /// module's description) on the CPU, or the CPU lacks the kernels for its format.
    pub fn new(w: &QTensor) -> Result<Option<Self>> {
        if !Self::packs_here(w.dtype()) {
            return Ok(None);
        }
        Self::pack(w)
    }

    /// The packing alone, whatever the CPU (the tests' scalar path uses it everywhere).
    fn pack(w: &QTensor) -> Result<Option<Self>> {
        if !crate::cpu_kernels(&w.device()) {
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

    /// A matrix `[n, k]` of a packed format (`None` for other formats) packed from its
    /// stored rows, which `read` fills in order, whole rows at a time: up to
    /// `PACK_GROUP_BYTES` of them, a whole number of tiles of 16 rows (fewer rows for the
    /// last group). A loader can read them from a file with no buffer the size of the
    /// matrix. Each group's tiles are packed in parallel on rayon's pool (the packing was
    /// most of a quantized model's loading). Packs whatever the CPU; [`Self::packs_here`]
    /// says whether the kernels will run.
    pub fn from_rows(
        dtype: GgmlDType,
        n: usize,
        k: usize,
        read: impl FnMut(&mut [u8]) -> Result<()>,
    ) -> Result<Option<Self>> {
        Self::from_rows_in(dtype, n, k, false, read)
    }

    /// [`Self::from_rows`] into a slab shared with the model's other settled matrices, as
    /// [`Self::settled`] would move it, without a buffer of its own or the copy, its pages
    /// first touched by the packing threads: for a model loaded for inference.
    pub fn from_rows_settled(
        dtype: GgmlDType,
        n: usize,
        k: usize,
        read: impl FnMut(&mut [u8]) -> Result<()>,
    ) -> Result<Option<Self>> {
        Self::from_rows_in(dtype, n, k, true, read)
    }

    fn from_rows_in(
        dtype: GgmlDType,
        n: usize,
        k: usize,
        slab: bool,
        read: impl FnMut(&mut [u8]) -> Result<()>,
    ) -> Result<Option<Self>> {
        let stored = Format::of(dtype).map_or(1, |f| TILE * k / f.values() * f.block_bytes());
        // At least two tiles a thread, so that a wide matrix is still shared.
        let group = (PACK_GROUP_BYTES / stored.max(1)).max(2 * rayon::current_num_threads());
        Self::from_row_groups(dtype, n, k, group, slab, read)
    }

    /// [`Self::from_rows_in`], reading `group` tiles' rows at a time.
    fn from_row_groups(
        dtype: GgmlDType,
        n: usize,
        k: usize,
        group: usize,
        slab: bool,
        mut read: impl FnMut(&mut [u8]) -> Result<()>,
    ) -> Result<Option<Self>> {
        use rayon::prelude::*;
        let Some(format) = Format::of(dtype) else {
            return Ok(None);
        };
        let values = format.values();
        if !k.is_multiple_of(values) {
            bail!("a {format:?} matrix [{n}, {k}]: rows are not whole blocks of {values}")
        }
        let nb = k / values;
        let (block, size) = (format.block_bytes(), format.tile_bytes());
        let mut data = Tiles::zeroed(n.div_ceil(TILE) * nb * size, slab);
        let tiles = data.as_mut_slice();
        // `pack_row` writes every byte a row owns; the missing rows of a last partial tile
        // keep what stands for zero: zero scales (the bytes are zeros already) and, for q8_0
        // and q4_0, operands of zero (after the tile's scales).
        let empty = match format {
            Format::Q8_0 => 128u8,
            Format::Q4_0 => 0x88,
            _ => 0,
        };
        if empty != 0 && !n.is_multiple_of(TILE) {
            for tile in tiles[n / TILE * nb * size..].chunks_exact_mut(size) {
                tile[SCALES..].fill(empty);
            }
        }
        // Bytes of one tile column, stored and packed; a matrix of empty rows has none.
        let (stored, column, group) = (TILE * nb * block, nb * size, group.max(1));
        if column > 0 {
            let mut rows = vec![0u8; (group * TILE).min(n) * nb * block];
            for (g, packed) in tiles.chunks_mut(group * column).enumerate() {
                let count = (n - g * group * TILE).min(group * TILE);
                let rows = &mut rows[..count * nb * block];
                read(rows)?;
                let rows = &*rows;
                // Tile columns are independent: each takes its 16 rows (fewer for the last).
                packed
                    .par_chunks_mut(column)
                    .zip(rows.par_chunks(stored))
                    .for_each(|(column, src)| {
                        for (b, tile) in column.chunks_exact_mut(size).enumerate() {
                            for (r, row) in src.chunks_exact(nb * block).enumerate() {
                                format.pack_row(&row[b * block..][..block], tile, r);
                            }
                        }
                    });
            }
        }
        Ok(Some(Self::holding(format, n, k, data)))
    }

    /// The matrix with its tiles in a slab shared with the model's other settled matrices
    /// (a copy; `None` when they are there already, or there is no slab). For inference,
    /// once a model's matrices are final (`concat` puts its results there too): a model's
    /// matrices side by side fill whole huge pages, where each of its own buffers held few
    /// or none.
    pub fn settled(&self) -> Option<Packed> {
        if !matches!(self.data, Tiles::Own(_)) {
            return None;
        }
        let data = Tiles::in_slab(self.data.len(), |d| d.copy_from_slice(&self.data))?;
        Some(Packed::holding(self.format, self.n, self.k, data))
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
        let data = Tiles::new(bytes, |data| {
            let mut at = 0;
            for p in parts {
                data[at..at + p.data.len()].copy_from_slice(&p.data);
                at += p.data.len();
            }
        });
        Some(Packed::holding(
            first.format,
            parts.iter().map(|p| p.n).sum(),
            first.k,
            data,
        ))
    }

    /// The GGUF type of the matrix's blocks.
    pub fn dtype(&self) -> GgmlDType {
        self.format.dtype()
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
        &self.data[(t * (self.k / self.format.values()) + b) * size..][..size]
    }

    /// Rows `ids`, dequantized: `[ids.len(), k]` (an embedding lookup).
    pub fn rows(&self, ids: &[u32]) -> Result<Vec<f32>> {
        let mut out = vec![0f32; ids.len() * self.k];
        for (&id, row) in ids.iter().zip(out.chunks_exact_mut(self.k.max(1))) {
            let id = id as usize;
            if id >= self.n {
                bail!("row {id} of a table with {} rows", self.n)
            }
            let (t, r) = (id / TILE, id % TILE);
            for (b, values) in row.chunks_exact_mut(self.format.values()).enumerate() {
                self.format.dequantize(self.tile(t, b), r, values);
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
        let x = XRows::new(self.format, x, self.k);
        let level = level();
        let level = if self.format.kernels(level) {
            level
        } else {
            Level::Scalar
        };
        Ok(self.product(&x, m, cols, level))
    }

    /// The product with the kernels of `level` (the scalar code where `level` has none for
    /// this format), which must not be above [`level()`].
    fn product(&self, x: &XRows, m: usize, cols: std::ops::Range<usize>, level: Level) -> Vec<f32> {
        let (t0, t1) = (cols.start / TILE, cols.end.div_ceil(TILE));
        let width = cols.len();
        if m == 0 || width == 0 {
            return vec![0.0; m * width];
        }
        // Not zeroed first: the tiles below write every output, and zeroing the head's
        // would be serial work on the calling thread.
        let mut ys: Vec<f32> = Vec::with_capacity(m * width);
        let out = SharedOut(ys.as_mut_ptr());
        // A prefill unpacks each column of five- and six-bit tiles once, for all its rows
        // of `x`: the kernels would or in the bit planes again for every four rows. (Four-
        // bit tiles take a mask or a shift per operand, where unpacking ahead gains
        // nothing, and q8_0 tiles are their operands.) With AVX2 too.
        let planes = matches!(
            self.format,
            Format::Q5_0 | Format::Q5_1 | Format::Q5K | Format::Q6K | Format::Q3K
        );
        // With AVX-512 VNNI a prefill takes the tiles two columns at a time
        // (`avx512::q4k_pair`), from their operands unpacked ahead: each value of `x` is
        // broadcast once for 32 outputs.
        let legacy = matches!(
            self.format,
            Format::Q8_0 | Format::Q4_0 | Format::Q5_0 | Format::Q4_1 | Format::Q5_1
        );
        let rows = if legacy {
            PAIR_ROWS_LEGACY
        } else {
            UNPACK_ROWS
        };
        let pair = level >= Level::Avx512Vnni && m >= rows;
        let unpack = level >= Level::Avx2 && (planes || pair) && m >= UNPACK_ROWS;
        // Bytes of one column's operands.
        let per = if unpack { self.k * TILE } else { 0 };
        let need = if pair { 2 * per } else { per };
        // Each thread takes a contiguous range of tiles (read as two streams when decoding,
        // below). (Not several parts per thread, as the dense decoding products take: each
        // part restarts the stream and its prefetching.)
        let parts = ranges(t1 - t0, 4, (t1 - t0) * TILE * self.k);
        // Decoding a model larger than the cache reads each tile from memory once, and the
        // hardware prefetchers alone fall short of the read floor while the kernels unpack:
        // the next tile is asked for while this one is worked on. Not where the weights
        // sit in the cache: there the prefetches are pure cost. How they are asked for
        // differs between AMD and Intel CPUs (`Ahead`), and q8_0 is decoded apart: its
        // plain bytes take the two streams of the legacy formats (below), each asking for
        // the tile a few blocks on (`avx512::legacy_rows`). q4_0's streams decoded slower
        // so (their unpacking hides the latency); q5_0, q4_1 and q5_1 go without as q4_0.
        // q2_K, q3_K and q4_K decode as two streams with AVX-512 on AMD CPUs (`Ahead`).
        let resident = PACKED_BYTES.load(Ordering::Relaxed) < STREAMED_BYTES;
        let stream = m < UNPACK_ROWS && self.format != Format::Q8_0 && !resident;
        let ahead = Ahead::here(level);
        // (Only decoding's choice of kernel: above, `pair` and `unpack` need m > 1.)
        let level = match self.format {
            Format::Q8_0 if m == 1 && !resident && ahead.q8_avx2 => level.min(Level::Avx2),
            _ => level,
        };
        let two = stream
            && m == 1
            && level >= Level::Avx512Vnni
            && ahead.two
            && matches!(self.format, Format::Q2K | Format::Q3K | Format::Q4K);
        let spread = match self.format {
            Format::Q8_0 if m == 1 && !resident => Spread::Next,
            Format::Q8_0 | Format::Q4_0 | Format::Q5_0 | Format::Q4_1 | Format::Q5_1 => Spread::Off,
            _ if stream && m == 1 && ahead.far => Spread::Far,
            _ if stream && m == 1 && (ahead.spread || two) => Spread::Next,
            _ => Spread::Off,
        };
        let pairs = m == 1 && (legacy || two);
        if m == 1 && parts.len() > 1 {
            // Decoding on several threads: what this product's second range reads is what a
            // helper waits to read, and the product after it is likely the one that came
            // after it last time (a decoding step runs the same products in the same order).
            let key = (self.data.as_ptr() as usize, t0);
            let bytes = (t1 - t0) * self.tiles(0).len();
            let next = crate::team::follow(key, bytes, self.streams(t0, parts[1], pairs));
            let units = Units::new(&parts, t0, pairs);
            let out = &out;
            crate::team::map(parts.len(), |i| {
                units.run(i, |a, b, front| match b {
                    Some(b) => self.columns([a, b], &[], x, m, &cols, out, level, spread),
                    None => {
                        if front && stream && ahead.column && a + 1 < t1 {
                            prefetch(self.tiles(a + 1));
                        }
                        self.columns([a], &[], x, m, &cols, out, level, spread);
                    }
                })
            });
            // SAFETY: as below; `Units::run` takes every tile column of every range once.
            unsafe { ys.set_len(m * width) };
            if let Some(next) = next {
                crate::team::hint(next);
            }
            return ys;
        }
        map_ranges(&parts, |lo, hi| {
            let out = &out;
            OPERANDS.with(|ops| {
                let mut ops = ops.borrow_mut();
                if ops.len() < need {
                    ops.resize(need, 0);
                }
                let ops = &mut ops[..need];
                // Decoding reads two columns of tiles together (`pairs`), tile j of the
                // range's first half beside tile j of its second: two streams through
                // memory (see `avx512::legacy_rows`, `avx512::q4k_rows`), which replace the
                // prefetch below (the two together gain nothing). The k-quants' decoding
                // kernels elsewhere and a prefill's unpacked operands take the range in
                // order: one column at a time, or two neighbours (`pair`).
                let half = match pairs {
                    true => (hi - lo) / 2,
                    false => 0,
                };
                for j in 0..half {
                    let (a, b) = (lo + j, lo + half + j);
                    self.columns([t0 + a, t0 + b], &[], x, m, &cols, out, level, spread);
                }
                let mut t = lo + 2 * half;
                while t < hi {
                    if stream && ahead.column && t + 1 < hi {
                        prefetch(self.tiles(t0 + t + 1));
                    }
                    // Two columns at once (`pair`), while two are left.
                    let count = if pair && t + 1 < hi { 2 } else { 1 };
                    #[cfg(target_arch = "x86_64")]
                    if unpack {
                        for (c, ops) in ops.chunks_exact_mut(per).take(count).enumerate() {
                            let tiles = self.tiles(t0 + t + c);
                            // SAFETY: `unpack` is only set at a level of kernels (at most
                            // the CPU's); `ops` holds k·16 bytes, 512 per block of 32 values.
                            unsafe {
                                match level {
                                    Level::Avx512Vnni | Level::Avx512Gfni => {
                                        avx512::unpack(self.format, tiles, ops)
                                    }
                                    _ => avx2::unpack_avx2(self.format, tiles, ops),
                                }
                            };
                        }
                    }
                    if count == 2 {
                        let ts = [t0 + t, t0 + t + 1];
                        self.columns(ts, ops, x, m, &cols, out, level, Spread::Off);
                    } else {
                        let ops = &ops[..per];
                        self.columns([t0 + t], ops, x, m, &cols, out, level, spread);
                    }
                    t += count;
                }
            })
        });
        // SAFETY: the ranges cover tile columns t0..t1, whose tiles hold outputs `cols`,
        // and `columns` wrote each of those for every row of `x` (a panic in a range
        // reaches here as a panic, before this).
        unsafe { ys.set_len(m * width) };
        ys
    }

    /// What decoding reads of tile columns `t0 + lo .. t0 + hi`: the two halves (`pairs`,
    /// see [`Units`]) or the whole, as `(address, bytes)`.
    fn streams(&self, t0: usize, (lo, hi): (usize, usize), pairs: bool) -> Streams {
        let size = self.tiles(0).len();
        let at = |t: usize| self.data.as_ptr() as usize + (t0 + t) * size;
        match pairs {
            true => {
                let half = (hi - lo) / 2;
                [
                    (at(lo), half * size),
                    (at(lo + half), (hi - lo - half) * size),
                ]
            }
            false => [(at(lo), (hi - lo) * size), (0, 0)],
        }
    }

    /// Tile column `t` (rows 16t..16t + 16 of W): `nb` tiles of `tile_bytes()`.
    fn tiles(&self, t: usize) -> &[u8] {
        let size = (self.k / self.format.values()) * self.format.tile_bytes();
        &self.data[t * size..][..size]
    }

    /// Every row of `x` (`m`) against tile columns `t`, written into their columns of the
    /// product's output (`out`, `m` rows of `cols.len()`, holding outputs `cols`).
    #[allow(clippy::too_many_arguments)]
    fn columns<const T: usize>(
        &self,
        t: [usize; T],
        ops: &[u8],
        x: &XRows,
        m: usize,
        cols: &std::ops::Range<usize>,
        out: &SharedOut,
        level: Level,
        spread: Spread,
    ) {
        let tiles = t.map(|t| self.tiles(t));
        let width = cols.len();
        // (Made once: each pass writes its rows, and zeroing it per pass would be a
        // `memset` call per four rows of `x`.)
        let mut y = [[[0f32; TILE]; 4]; T];
        let mut r = 0;
        while r < m {
            // Up to four rows of `x` per pass over the tiles' blocks (from L1): four
            // independent sums in flight, each tile's loads shared. (Not eight: registers
            // run out.)
            let rows = (m - r).min(4);
            tile_rows(
                self.format,
                tiles,
                ops,
                x,
                r,
                rows,
                y.each_mut(),
                level,
                spread,
            );
            for (&t, y) in t.iter().zip(&y) {
                // Tile column t's outputs are rows first..first + 16 of W; the asked-for
                // ones land in columns c0..c1 of the output.
                let first = t * TILE;
                let (c0, c1) = (first.max(cols.start), (first + TILE).min(cols.end));
                for (j, y) in y.iter().enumerate().take(rows) {
                    let at = (r + j) * width + c0 - cols.start;
                    // SAFETY: `at..at + c1 - c0` lies in row r + j of the output (m rows of
                    // `width`), and only the thread holding tile column t writes its columns.
                    // (A whole tile, as nearly all are, is one copy of a known size, not a
                    // `memcpy` call per row and tile.)
                    unsafe {
                        let to = out.0.add(at);
                        if c1 - c0 == TILE {
                            to.cast::<[f32; TILE]>().write_unaligned(*y);
                        } else {
                            std::ptr::copy_nonoverlapping(y[c0 - first..].as_ptr(), to, c1 - c0)
                        }
                    };
                }
            }
            r += rows;
        }
    }
}

/// Asks for `bytes` to be brought into the first-level cache, marked as read once (non-
/// temporal: they are not to push the activations out of the other caches).
#[inline]
fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    for line in bytes.chunks(64) {
        // SAFETY: a prefetch is a hint, never a fault; the address lies in `bytes`.
        unsafe {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_NTA};
            _mm_prefetch::<_MM_HINT_NTA>(line.as_ptr() as *const i8)
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes; // only x86 gets the hint
}

/// From this many rows of `x` on, [`Packed::product`] unpacks each column of tiles once
/// into [`OPERANDS`] rather than in every pass of four rows.
const UNPACK_ROWS: usize = 8;

/// From this many rows of `x` on, a product of q8_0, q4_0, q5_0, q4_1 or q5_1 tiles takes
/// two columns at a time with AVX-512 VNNI (`avx512::legacy_pair`; the k-quants from
/// [`UNPACK_ROWS`]): below it one column at a time is faster for these formats
/// (`examples/packed_prefill.rs`; docs/PERFORMANCE.md).
const PAIR_ROWS_LEGACY: usize = 16;

thread_local! {
    /// A column of tiles' operands, unpacked: 512 bytes per block of 32 values (16 bytes
    /// per value of a row of the weight).
    static OPERANDS: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The decoding product's ranges of tile columns, taken by the team a unit at a time: a thread
/// runs its own range from the front, then takes what is left of the others from their backs.
/// One range per thread keeps each stream through memory whole (ranges cut into more parts
/// decode slower, see [`Packed::product`]), while a thread that started late, or whose reads
/// were slower, no longer holds the other up. Where decoding reads two streams a unit is a
/// pair of tile columns, `j` of the range's first half beside `j` of its second (see
/// `avx512::legacy_rows`), and an odd last column is its owner's; elsewhere, one tile column.
struct Units<'a> {
    parts: &'a [(usize, usize)],
    t0: usize,
    pairs: bool,
    /// Per range, its units not yet taken: front (high 32 bits) to back (low 32 bits).
    left: Vec<Line>,
}

/// A counter alone on its cache lines: a thread takes units of its own range many times a
/// product, and with the ranges' counters side by side each take waited for the line to
/// come back from the other core (`Units::run`, most of it those loads, was 2–3% of
/// decoding's samples). 128 bytes: the adjacent-line prefetcher fetches lines in pairs.
#[repr(align(128))]
struct Line(AtomicU64);

impl<'a> Units<'a> {
    fn new(parts: &'a [(usize, usize)], t0: usize, pairs: bool) -> Self {
        let count = |(lo, hi): (usize, usize)| if pairs { (hi - lo) / 2 } else { hi - lo };
        Self {
            parts,
            t0,
            pairs,
            left: parts
                .iter()
                .map(|&r| Line(AtomicU64::new(count(r) as u64)))
                .collect(),
        }
    }

    /// Range `i`'s next units from its front or its back, if any is left: from the front
    /// up to [`Units::BATCH`] at once while many are left, so that the owner takes its
    /// range with few atomic updates (each one a fence that stalls the stream of reads);
    /// one at a time from the back, and near the end, where they even out the threads.
    fn take(&self, i: usize, front: bool) -> Option<std::ops::Range<usize>> {
        let left = &self.left[i].0;
        let mut w = left.load(Ordering::Relaxed);
        loop {
            let (f, b) = (w >> 32, w & 0xffff_ffff);
            if f >= b {
                return None;
            }
            let (next, units) = match front {
                true => {
                    let n = ((b - f) / (4 * Self::BATCH)).clamp(1, Self::BATCH);
                    ((f + n) << 32 | b, f..f + n)
                }
                false => (f << 32 | (b - 1), b - 1..b),
            };
            match left.compare_exchange_weak(w, next, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return Some(units.start as usize..units.end as usize),
                Err(now) => w = now,
            }
        }
    }

    /// The most units the owner of a range takes at once.
    const BATCH: u64 = 4;

    /// Task `i`: range `i` from its front (then its odd column), then the other ranges'
    /// units left, from their backs. `tile(a, b, front)` multiplies one unit: tile column
    /// `a` (an absolute index), and `b` beside it for a pair.
    fn run(&self, i: usize, tile: impl Fn(usize, Option<usize>, bool)) {
        while let Some(units) = self.take(i, true) {
            for j in units {
                self.unit(i, j, true, &tile);
            }
        }
        let (lo, hi) = self.parts[i];
        if self.pairs && (hi - lo) % 2 == 1 {
            tile(self.t0 + hi - 1, None, true);
        }
        let n = self.parts.len();
        for o in (1..n).map(|s| (i + s) % n) {
            while let Some(units) = self.take(o, false) {
                for j in units {
                    self.unit(o, j, false, &tile);
                }
            }
        }
    }

    /// Unit `j` of range `i`.
    fn unit(&self, i: usize, j: usize, front: bool, tile: &impl Fn(usize, Option<usize>, bool)) {
        let (lo, hi) = self.parts[i];
        let a = self.t0 + lo + j;
        let b = self.pairs.then_some(a + (hi - lo) / 2);
        tile(a, b, front);
    }
}

/// `y[c][j] = x row r + j · tile rows of column c`, for `rows` (1–4) rows of `x` and `T`
/// (1 or 2) columns of tiles, with the kernels of `level`; `ops` holds the columns'
/// operands unpacked by `avx512::unpack` (`unpack_avx2` at the AVX2 level) one after the
/// other, or is empty. The AVX-512 kernels read two columns together (block by block, or
/// super-block by super-block; two columns unpacked through `avx512::q4k_pair` and its
/// kind); the AVX2 k-quant kernels and the scalar code take them one after the other.
/// With `spread`, the k-quant kernels ask for a super-block ahead while they work on one,
/// and the AVX-512 q8_0 kernel for a tile a few blocks on (see `Ahead`).
#[allow(clippy::too_many_arguments)]
fn tile_rows<const T: usize>(
    format: Format,
    tiles: [&[u8]; T],
    ops: &[u8],
    x: &XRows,
    r: usize,
    rows: usize,
    y: [&mut [[f32; TILE]; 4]; T],
    level: Level,
    spread: Spread,
) {
    #[cfg(target_arch = "x86_64")]
    if level == Level::Avx2 {
        if let XRows::Blocks(x) = x {
            // SAFETY: `level` is at most what the CPU has (`level()`); the kernels
            // check the lengths.
            unsafe {
                use avx2::legacy_rows_avx2 as legacy;
                // The rows of `x` (1–4) as a constant `R`, the format as `BITS` and `MIN`.
                macro_rules! by_rows {
                    ($bits:literal, $min:literal) => {
                        match rows {
                            1 => legacy::<1, $bits, $min, T>(tiles, ops, x, r, y),
                            2 => legacy::<2, $bits, $min, T>(tiles, ops, x, r, y),
                            3 => legacy::<3, $bits, $min, T>(tiles, ops, x, r, y),
                            _ => legacy::<4, $bits, $min, T>(tiles, ops, x, r, y),
                        }
                    };
                }
                match format {
                    Format::Q8_0 => return by_rows!(8, false),
                    Format::Q4_0 => return by_rows!(4, false),
                    Format::Q5_0 => return by_rows!(5, false),
                    Format::Q4_1 => return by_rows!(4, true),
                    Format::Q5_1 => return by_rows!(5, true),
                    _ => {}
                }
            }
        }
        if let XRows::Super(x) = x {
            // SAFETY: as above.
            unsafe {
                use avx2::{q2k_rows_avx2 as q2k, q4k_rows_avx2 as q4k, q6k_rows_avx2 as q6k};
                macro_rules! by_rows {
                    ($kernel:ident, $($c:literal)? ; $($ops:ident)?) => {
                        for (tiles, y) in tiles.into_iter().zip(y) {
                            match rows {
                                1 => $kernel::<1 $(, $c)?>(tiles, $($ops,)? x, r, y, spread),
                                2 => $kernel::<2 $(, $c)?>(tiles, $($ops,)? x, r, y, spread),
                                3 => $kernel::<3 $(, $c)?>(tiles, $($ops,)? x, r, y, spread),
                                _ => $kernel::<4 $(, $c)?>(tiles, $($ops,)? x, r, y, spread),
                            }
                        }
                    };
                }
                match format {
                    Format::Q4K => return by_rows!(q4k, false; ops),
                    Format::Q5K => return by_rows!(q4k, true; ops),
                    Format::Q6K => return by_rows!(q6k, false; ops),
                    Format::Q3K => return by_rows!(q6k, true; ops),
                    Format::Q2K => return by_rows!(q2k,;),
                    _ => {}
                }
            }
        }
    }
    #[cfg(target_arch = "x86_64")]
    if level >= Level::Avx512Vnni {
        // (The legacy kernels ask for q8_0's tiles a few blocks on, or for nothing.)
        let asks = spread != Spread::Off;
        // SAFETY: `level` is at most what the CPU has (`level()`); the kernels check
        // the lengths.
        unsafe {
            use avx512::{
                legacy_rows as legacy, q2k_rows as q2k, q4k_rows as q4k, q6k_rows as q6k,
            };
            // The kernels take the rows of `x` (1–4) as a constant: `R` in each arm.
            macro_rules! by_rows {
                ($call:expr) => {
                    match rows {
                        1 => {
                            const R: usize = 1;
                            $call
                        }
                        2 => {
                            const R: usize = 2;
                            $call
                        }
                        3 => {
                            const R: usize = 3;
                            $call
                        }
                        _ => {
                            const R: usize = 4;
                            $call
                        }
                    }
                };
            }
            match (format, x) {
                (format, XRows::Blocks(x)) if T == 2 && !ops.is_empty() => {
                    // Two columns' operands, unpacked ahead one after the other (a
                    // prefill's, see `Packed::product`).
                    use avx512::legacy_pair as pair;
                    let (a, b) = ops.split_at(ops.len() / 2);
                    let mut y = y.into_iter();
                    let (Some(y0), Some(y1)) = (y.next(), y.next()) else {
                        unreachable!("two columns")
                    };
                    let (t, o) = ([tiles[0], tiles[1]], [a, b]);
                    match format {
                        Format::Q8_0 => by_rows!(pair::<R, 8, false>(t, o, x, r, [y0, y1])),
                        Format::Q4_0 => by_rows!(pair::<R, 4, false>(t, o, x, r, [y0, y1])),
                        Format::Q5_0 => by_rows!(pair::<R, 5, false>(t, o, x, r, [y0, y1])),
                        Format::Q4_1 => by_rows!(pair::<R, 4, true>(t, o, x, r, [y0, y1])),
                        Format::Q5_1 => by_rows!(pair::<R, 5, true>(t, o, x, r, [y0, y1])),
                        _ => unreachable!("{format:?} tiles with rows of x as q8_0"),
                    }
                }
                (Format::Q8_0, XRows::Blocks(x)) => {
                    by_rows!(legacy::<R, 8, false, T>(tiles, ops, x, r, y, asks))
                }
                (Format::Q4_0, XRows::Blocks(x)) => {
                    by_rows!(legacy::<R, 4, false, T>(tiles, ops, x, r, y, asks))
                }
                (Format::Q5_0, XRows::Blocks(x)) => {
                    by_rows!(legacy::<R, 5, false, T>(tiles, ops, x, r, y, asks))
                }
                (Format::Q4_1, XRows::Blocks(x)) => {
                    by_rows!(legacy::<R, 4, true, T>(tiles, ops, x, r, y, asks))
                }
                (Format::Q5_1, XRows::Blocks(x)) => {
                    by_rows!(legacy::<R, 5, true, T>(tiles, ops, x, r, y, asks))
                }
                (format, XRows::Super(x)) if T == 2 && !ops.is_empty() => {
                    // Two columns' operands, unpacked ahead one after the other (a
                    // prefill's, see `Packed::product`).
                    use avx512::{q2k_pair, q4k_pair, q6k_pair};
                    let (a, b) = ops.split_at(ops.len() / 2);
                    let mut y = y.into_iter();
                    let (Some(y0), Some(y1)) = (y.next(), y.next()) else {
                        unreachable!("two columns")
                    };
                    let (tiles, ops) = ([tiles[0], tiles[1]], [a, b]);
                    match format {
                        Format::Q4K => {
                            by_rows!(q4k_pair::<R>(q4k::BYTES, tiles, ops, x, r, [y0, y1]))
                        }
                        Format::Q5K => {
                            by_rows!(q4k_pair::<R>(q4k::Q5_BYTES, tiles, ops, x, r, [y0, y1]))
                        }
                        Format::Q6K => by_rows!(q6k_pair::<R, false>(tiles, ops, x, r, [y0, y1])),
                        Format::Q3K => by_rows!(q6k_pair::<R, true>(tiles, ops, x, r, [y0, y1])),
                        Format::Q2K => by_rows!(q2k_pair::<R>(tiles, ops, x, r, [y0, y1])),
                        _ => unreachable!("{format:?} tiles two columns at a time"),
                    }
                }
                (format, XRows::Super(x)) => match format {
                    Format::Q4K => by_rows!(q4k::<R, false, T>(tiles, ops, x, r, y, spread)),
                    Format::Q5K => by_rows!(q4k::<R, true, T>(tiles, ops, x, r, y, spread)),
                    Format::Q6K if level == Level::Avx512Gfni => {
                        use avx512::q6k_rows_gfni as q6k;
                        by_rows!(q6k::<R, false, T>(tiles, ops, x, r, y, spread))
                    }
                    Format::Q6K => by_rows!(q6k::<R, false, T>(tiles, ops, x, r, y, spread)),
                    Format::Q3K => by_rows!(q6k::<R, true, T>(tiles, ops, x, r, y, spread)),
                    Format::Q2K => by_rows!(q2k::<R, T>(tiles, x, r, y, spread)),
                    _ => unreachable!("{format:?} weights with rows of x as q8_K"),
                },
                _ => unreachable!("{format:?} weights with rows of x quantized for another"),
            }
        }
        return;
    }
    let _ = (level, ops);
    // The scalar version of the kernels' arithmetic: exact integer sums per block (per
    // super-block for the k-quants, scaled within it by the integer scales), then f32.
    for (tiles, y) in tiles.into_iter().zip(y) {
        scalar_rows(format, tiles, x, r, rows, y);
    }
}

#[cfg(test)]
mod tests {
    use super::super::format::{QK, QK_K};
    use super::super::input::*;
    use super::*;
    use candle_core::quantized::QMatMul;
    use candle_core::{Device, Module, Tensor};

    fn quantized(n: usize, k: usize, dtype: GgmlDType) -> QTensor {
        let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu).unwrap();
        QTensor::quantize(&w, dtype).unwrap()
    }

    const FORMATS: [GgmlDType; 10] = [
        GgmlDType::Q8_0,
        GgmlDType::Q4_0,
        GgmlDType::Q5_0,
        GgmlDType::Q4_1,
        GgmlDType::Q5_1,
        GgmlDType::Q5K,
        GgmlDType::Q4K,
        GgmlDType::Q6K,
        GgmlDType::Q3K,
        GgmlDType::Q2K,
    ];

    /// Candle's dequantized values of `q`, row-major.
    fn candle_values(q: &QTensor) -> Vec<f32> {
        let t = q.dequantize(&Device::Cpu).unwrap();
        t.flatten_all().unwrap().to_vec1().unwrap()
    }

    /// Row width `blocks` stored blocks wide.
    fn width(dtype: GgmlDType, blocks: usize) -> usize {
        Format::of(dtype).unwrap().values() * blocks
    }

    /// A settled matrix (its tiles copied into a shared slab) and a concatenation (made
    /// there) hold the same tiles as the matrices they come from, and multiply the same;
    /// settling one already in a slab is a no-op.
    #[cfg(unix)]
    #[test]
    fn settled_and_concatenated_matrices_keep_their_tiles() {
        for dtype in [GgmlDType::Q8_0, GgmlDType::Q4K] {
            let k = width(dtype, 2);
            let (a, b) = (quantized(48, k, dtype), quantized(37, k, dtype));
            let (a, b) = (
                Packed::pack(&a).unwrap().unwrap(),
                Packed::pack(&b).unwrap().unwrap(),
            );
            let settled = a.settled().expect("a loaded matrix moves to a slab");
            assert_eq!(&*settled.data, &*a.data, "{dtype:?}");
            assert!(settled.settled().is_none(), "{dtype:?}: settled twice");
            let both = Packed::concat(&[&a, &b]).unwrap();
            assert!(both.settled().is_none(), "{dtype:?}");
            let mut want = a.dequantize().unwrap();
            want.extend(b.dequantize().unwrap());
            assert_eq!(both.dequantize().unwrap(), want, "{dtype:?}");
            let x: Vec<f32> = (0..k).map(|i| (i as f32 * 0.37).sin()).collect();
            let (p, q) = (
                settled.matmul(&x, 1, 0..48).unwrap(),
                a.matmul(&x, 1, 0..48).unwrap(),
            );
            assert_eq!(p, q, "{dtype:?}");
            drop(a);
            // The copy outlives its source, and the slab its other ranges.
            assert_eq!(settled.matmul(&x, 1, 0..48).unwrap(), q, "{dtype:?}");
            drop(settled);
            assert_eq!(both.dequantize().unwrap(), want, "{dtype:?}");
        }
    }

    #[test]
    fn rows_are_candles_dequantized_rows() {
        // 37 rows: two whole tiles and a partial one.
        for dtype in FORMATS {
            let k = width(dtype, 3);
            let q = quantized(37, k, dtype);
            let p = Packed::pack(&q).unwrap().unwrap();
            let ours = p.dequantize().unwrap();
            let theirs = candle_values(&q);
            assert_eq!(ours, theirs, "{dtype:?}");
            assert_eq!(
                p.rows(&[36, 0]).unwrap(),
                [&theirs[36 * k..], &theirs[..k]].concat()
            );
            assert!(p.rows(&[37]).is_err());
        }
    }

    /// Packing reads the rows in order, a group of whole tiles at a time, and packs each
    /// group's tiles on several threads: the same tiles as one tile at a time, for every
    /// format, with groups of one, three (packed straight into a slab) and all tiles and a
    /// partial last tile.
    #[test]
    fn row_groups_pack_the_same_tiles() {
        // 149 rows: nine whole tiles and a partial one.
        let (n, tiles) = (149, 10);
        for dtype in FORMATS {
            let k = width(dtype, 3);
            let q = quantized(n, k, dtype);
            let bytes = q.data().unwrap();
            let row_bytes = bytes.len() / n;
            let pack = |group: usize| {
                let (mut at, mut reads) = (0, Vec::new());
                let p = Packed::from_row_groups(dtype, n, k, group, group == 3, |rows| {
                    rows.copy_from_slice(&bytes[at..at + rows.len()]);
                    at += rows.len();
                    reads.push(rows.len() / row_bytes);
                    Ok(())
                })
                .unwrap()
                .unwrap();
                assert_eq!(at, bytes.len(), "{dtype:?}: every row read");
                (p, reads)
            };
            let (one, reads) = pack(1);
            assert_eq!(reads, [[16; 9].as_slice(), &[5]].concat(), "{dtype:?}");
            assert_eq!(one.dequantize().unwrap(), candle_values(&q), "{dtype:?}");
            for (group, want) in [(3, vec![48, 48, 48, 5]), (tiles, vec![n])] {
                let (p, reads) = pack(group);
                assert_eq!(reads, want, "{dtype:?}, groups of {group}");
                assert_eq!(&*p.data, &*one.data, "{dtype:?}, groups of {group}");
            }
        }
    }

    #[test]
    fn k_quant_tiles_hold_every_scale_sign_and_value() {
        // Rows whose scales, minima and values reach the formats' ends: quantized from
        // rows of mixed magnitudes and signs, some all negative, some all zero.
        for dtype in [
            GgmlDType::Q4K,
            GgmlDType::Q5K,
            GgmlDType::Q6K,
            GgmlDType::Q3K,
            GgmlDType::Q2K,
        ] {
            let (n, k) = (20, 512);
            let w: Vec<f32> = (0..n * k)
                .map(|i| {
                    let (r, c) = (i / k, i % k);
                    let v = ((i * 7919) % 1009) as f32 / 1009.0 - 0.5;
                    match r % 4 {
                        0 => v * (1.0 + (c / 16) as f32),
                        1 => -v.abs() - 1e-3 * c as f32,
                        2 => 0.0,
                        _ => v * if c % 64 < 32 { 1e3 } else { 1e-3 },
                    }
                })
                .collect();
            let w = Tensor::from_vec(w, (n, k), &Device::Cpu).unwrap();
            let q = QTensor::quantize(&w, dtype).unwrap();
            let p = Packed::pack(&q).unwrap().unwrap();
            let theirs = candle_values(&q);
            assert_eq!(p.dequantize().unwrap(), theirs, "{dtype:?}");
        }
    }

    /// `x`'s rows as the kernels see them: each value times its block's scale.
    fn dequantized_x(x: &XRows, m: usize) -> Vec<f32> {
        let row = |r| match x {
            XRows::Blocks(x) => (x.row(r).0, x.row(r).1, QK),
            XRows::Super(x) => (x.row(r).0, x.row(r).1, QK_K),
        };
        (0..m)
            .flat_map(|r| {
                let (q, d, per) = row(r);
                q.iter()
                    .enumerate()
                    .map(|(i, &v)| v as f32 * d[i / per])
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    #[test]
    fn vector_super_quantizer_equals_the_scalar_code() {
        // As `stored`'s test of the q8_0 quantizer, for q8_K's super-blocks.
        crate::quant::stored::tests::assert_same_quantization(
            QK_K,
            QK_K / 16,
            quantize_super,
            quantize_super_impl,
        );
    }

    #[test]
    fn rows_of_x_for_k_quants_are_ggmls_q8_k() {
        // Rows with a zero block, one whose largest value is negative, one positive, one
        // where the largest magnitude comes twice with both signs; 90 rows (69,120
        // values) are quantized by several threads.
        let (k, m) = (3 * QK_K, 90);
        let mut x: Vec<f32> = (0..m * k).map(|i| ((i * 37) % 101) as f32 - 50.5).collect();
        x[k..k + QK_K].fill(0.0);
        x[7] = -300.0;
        x[QK_K + 9] = 250.0;
        x[2 * QK_K + 3] = -400.0;
        x[2 * QK_K + 5] = 400.0;
        let ours = SuperRows::new(&x, k);
        let x8k = Tensor::from_vec(x.clone(), (m, k), &Device::Cpu).unwrap();
        let theirs = candle_values(&QTensor::quantize(&x8k, GgmlDType::Q8K).unwrap());
        assert_eq!(dequantized_x(&XRows::Super(ours), m), theirs);
        let ours = SuperRows::new(&x, k);
        for r in 0..m {
            let (q, _, sums) = ours.row(r);
            for (c, &s) in q.chunks_exact(16).zip(sums) {
                assert_eq!(c.iter().map(|&v| v as i32).sum::<i32>(), s);
            }
        }
    }

    #[test]
    fn products_match_the_f64_product_candle_and_the_scalar_code() {
        for (dtype, (m, n, blocks, cols)) in FORMATS.into_iter().flat_map(|d| {
            [
                (1, 50, 2, 0..50),
                // Decoding: two tile columns at a time, an odd one left, partial tiles at
                // either end.
                (1, 200, 3, 23..190),
                (3, 300, 3, 0..300),
                (6, 64, 4, 17..40),
                (9, 33, 1, 5..33),
                // Split across threads, a partial tile at either end.
                (5, 200, 2, 23..190),
                // Decoding split across threads (more than PARALLEL_MIN weights), each
                // thread's range taken a unit at a time (`Units`): an odd count of tile
                // columns per range, and an even one.
                (1, 600, 4, 0..600),
                (1, 1000, 8, 5..997),
                // Ranges long enough that their owners take several units at once.
                (1, 4000, 2, 13..3990),
                // A prefill: each column's operands unpacked once (UNPACK_ROWS), for three
                // passes of four rows and one of one, on several threads; the k-quants'
                // two columns at a time (with AVX-512 VNNI), and an odd one left.
                (13, 200, 3, 23..190),
                (11, 64, 2, 0..64),
                (10, 48, 1, 0..48),
                // The legacy formats' two columns at a time (PAIR_ROWS_LEGACY).
                (17, 33, 1, 0..33),
                (18, 48, 1, 0..48),
                (19, 64, 2, 5..64),
            ]
            .map(|s| (d, s))
        }) {
            let k = width(dtype, blocks);
            let q = quantized(n, k, dtype);
            let p = Packed::pack(&q).unwrap().unwrap();
            let x = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu).unwrap();
            let xv: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
            let xq = XRows::new(Format::of(dtype).unwrap(), &xv, k);
            let scalar = p.product(&xq, m, cols.clone(), Level::Scalar);
            // The f64 product of what the kernels multiply: Candle's dequantized weights
            // and the quantized rows of x.
            let w = candle_values(&q);
            let xd = dequantized_x(&xq, m);
            let exact: Vec<f32> = (0..m)
                .flat_map(|i| {
                    let (w, xd) = (&w, &xd);
                    cols.clone().map(move |c| {
                        (0..k)
                            .map(|v| w[c * k + v] as f64 * xd[i * k + v] as f64)
                            .sum::<f64>() as f32
                    })
                })
                .collect();
            let mag = exact.iter().fold(1f32, |a, v| a.max(v.abs()));
            for (a, b) in scalar.iter().zip(&exact) {
                assert!(
                    (a - b).abs() <= 1e-6 * mag * (k as f32).sqrt(),
                    "{dtype:?} {m}x{n}x{k}: {a} vs {b}"
                );
            }
            // (Candle's q5_0 product takes blocks in pairs: an odd count fails its debug
            // assertion.)
            let pairs = dtype != GgmlDType::Q5_0 || (k / QK).is_multiple_of(2);
            if pairs && !matches!(dtype, GgmlDType::Q4_1 | GgmlDType::Q5_1) {
                // Candle's product quantizes x as ggml does: the same sums in another
                // order. (With q4_1/q5_1 ggml takes the block sums of x as f16 values
                // `d · Σq`, which moves the minima's terms by up to 1e-3 of the result;
                // here they stay f32.)
                let theirs = QMatMul::from_qtensor(q).unwrap().forward(&x).unwrap();
                let theirs: Vec<f32> = theirs
                    .narrow(1, cols.start, cols.len())
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                for (a, b) in scalar.iter().zip(&theirs) {
                    assert!(
                        (a - b).abs() <= 1e-5 * mag * (k as f32).sqrt(),
                        "{dtype:?} {m}x{n}x{k}: {a} vs {b}"
                    );
                }
            }
            // Every level of kernels this CPU runs that has them for the format.
            for level in [Level::Avx2, Level::Avx512Vnni, Level::Avx512Gfni] {
                if level > super::super::level::level() || !p.format.kernels(level) {
                    continue;
                }
                let simd = p.product(&xq, m, cols.clone(), level);
                for (a, b) in simd.iter().zip(&scalar) {
                    assert!(
                        (a - b).abs() <= 1e-5 * mag,
                        "{dtype:?} {level:?} {m}x{n}x{k}: {a} vs {b}"
                    );
                }
            }
        }
    }

    /// Every tile column of every range is taken once, from the front by its owner, from
    /// the back by another thread: here one thread runs the tasks in turn, so task 0 takes
    /// the other ranges from their backs, leaving their owners only their odd columns
    /// (pairs); then the team shares the work, its tasks of unequal speeds.
    #[test]
    fn units_take_every_tile_column_once() {
        use std::sync::Mutex;
        let parts = [(0, 7), (7, 20), (20, 31)];
        for pairs in [false, true] {
            let units = Units::new(&parts, 100, pairs);
            let seen = Mutex::new(Vec::new());
            for i in 0..parts.len() {
                units.run(i, |a, b, front| {
                    let mut seen = seen.lock().unwrap();
                    seen.extend([Some(a), b].into_iter().flatten().map(|t| (t, front)));
                });
            }
            let mut seen = seen.into_inner().unwrap();
            seen.sort();
            let tiles: Vec<usize> = seen.iter().map(|&(t, _)| t).collect();
            assert_eq!(tiles, (100..131).collect::<Vec<_>>(), "pairs {pairs}");
            for (t, front) in seen {
                let odd = pairs && (t == 119 || t == 130);
                assert_eq!(front, t < 107 || odd, "tile {t}, pairs {pairs}");
            }

            let units = Units::new(&parts, 0, pairs);
            let seen = Mutex::new(Vec::new());
            crate::team::map(parts.len(), |i| {
                units.run(i, |a, b, _| {
                    std::thread::sleep(std::time::Duration::from_micros(50 * (i as u64 + 1)));
                    seen.lock()
                        .unwrap()
                        .extend([Some(a), b].into_iter().flatten());
                })
            });
            let mut seen = seen.into_inner().unwrap();
            seen.sort();
            assert_eq!(seen, (0..31).collect::<Vec<_>>(), "pairs {pairs}");
        }
    }

    /// Operands at the top of their range (every value of a block or sub-block but the
    /// first, which sets the scale) times `x` at its largest magnitude everywhere: the
    /// largest sums the kernels' 16-bit partial sums hold (eight groups of q5_0 or q5_K
    /// values, or two of q6_K's, would overflow one).
    #[test]
    fn sums_at_the_top_of_the_range_do_not_overflow() {
        let (n, k) = (32, 512);
        for (dtype, period, top) in [
            (GgmlDType::Q4_0, 32, 15),
            (GgmlDType::Q5_0, 32, 31),
            (GgmlDType::Q4_1, 32, 15),
            (GgmlDType::Q5_1, 32, 31),
            (GgmlDType::Q4K, 32, 15),
            (GgmlDType::Q5K, 32, 31),
            (GgmlDType::Q6K, 16, 63),
        ] {
            // The first value maps to the bottom, the others (31/32 of it) to the top.
            let w: Vec<f32> = (0..n * k)
                .map(|i| if i % period == 0 { -1.0 } else { 0.96875 })
                .collect();
            let w = Tensor::from_vec(w, (n, k), &Device::Cpu).unwrap();
            let q = QTensor::quantize(&w, dtype).unwrap();
            let p = Packed::pack(&q).unwrap().unwrap();
            // (The operands really are at the top.)
            assert_eq!(p.format.operand(p.tile(1, 1), 3, 1), top, "{dtype:?}");
            for m in [1, 4] {
                let xq = XRows::new(p.format, &vec![1.0; m * k], k);
                let scalar = p.product(&xq, m, 0..n, Level::Scalar);
                for level in [Level::Avx2, Level::Avx512Vnni, Level::Avx512Gfni] {
                    if level > super::super::level::level() || !p.format.kernels(level) {
                        continue;
                    }
                    let simd = p.product(&xq, m, 0..n, level);
                    for (a, b) in simd.iter().zip(&scalar) {
                        let what = format!("{dtype:?} {level:?}: {a} vs {b}");
                        assert!((a - b).abs() <= 1e-5 * b.abs(), "{what}");
                    }
                }
            }
        }
    }

    /// q8_0 values at both ends of the byte, -128 (which ggml's quantizer never writes, but
    /// a file may hold) and 127, times `x` of both signs at its largest magnitude: the
    /// AVX2 kernel's `vpmaddubsw` of `|w|` (128 at most) by `x` with `w`'s sign. Against
    /// the sums worked out here from the raw values, and the scalar code.
    #[test]
    fn q8_0_values_at_both_ends_multiply_exactly() {
        let (n, k) = (32, 256);
        let value = |r: usize, v: usize| -> i8 {
            match r % 4 {
                0 => -128,
                1 => 127,
                2 => [-128, 127][v % 2],
                _ => (r * 37 + v * 11) as u8 as i8,
            }
        };
        // Blocks of an f16 scale of 1 and 32 values.
        let mut stored = Vec::new();
        for r in 0..n {
            for b in 0..k / QK {
                stored.extend(half::f16::from_f32(1.0).to_le_bytes());
                stored.extend((0..QK).map(|v| value(r, b * QK + v) as u8));
            }
        }
        let mut at = 0;
        let p = Packed::from_rows(GgmlDType::Q8_0, n, k, |rows| {
            rows.copy_from_slice(&stored[at..at + rows.len()]);
            at += rows.len();
            Ok(())
        })
        .unwrap()
        .unwrap();
        let sign = |v: usize| if v.is_multiple_of(3) { -1.0 } else { 1.0 };
        for m in [1, 4] {
            let x: Vec<f32> = (0..m * k)
                .map(|i| sign(i % k) * (1 + i / k) as f32)
                .collect();
            let xq = XRows::new(p.format, &x, k);
            // Each row of x quantizes to ±127 with the scale (1 + j) / 127 in f16.
            let want: Vec<f64> = (0..m)
                .flat_map(|j| {
                    let d = half::f16::from_f32((1 + j) as f32 / 127.0).to_f64();
                    (0..n).map(move |r| {
                        let sum: i64 = (0..k)
                            .map(|v| value(r, v) as i64 * 127 * sign(v) as i64)
                            .sum();
                        sum as f64 * d
                    })
                })
                .collect();
            for level in [
                Level::Scalar,
                Level::Avx2,
                Level::Avx512Vnni,
                Level::Avx512Gfni,
            ] {
                if level > super::super::level::level() || !p.format.kernels(level) {
                    continue;
                }
                let got = p.product(&xq, m, 0..n, level);
                for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                    let what = format!("{level:?} m {m} output {i}: {a} vs {b}");
                    assert!((*a as f64 - b).abs() <= 1e-6 * b.abs().max(1.0), "{what}");
                }
            }
        }
    }

    #[test]
    fn other_formats_are_not_packed() {
        let w = Tensor::randn(0f32, 1.0, (16, 256), &Device::Cpu).unwrap();
        for dtype in [GgmlDType::Q8K, GgmlDType::Q8_1] {
            let q = QTensor::quantize(&w, dtype).unwrap();
            assert!(Packed::pack(&q).unwrap().is_none(), "{dtype:?}");
        }
    }
}
