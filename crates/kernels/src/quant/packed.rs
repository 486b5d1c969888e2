//! Block-quantized matrices (ggml's q8_0, q4_0, q5_0, q4_1, q5_1 and the k-quants q2_K to
//! q6_K) repacked for the CPU's 8-bit dot-product instructions, held as the only copy of
//! the weight.
//!
//! A q8_0 matrix `[n, k]` is stored by GGUF (and Candle) row after row of blocks (an f16
//! scale and 32 signed bytes). A product with that layout must reduce each block's sums
//! across lanes before scaling them, about eight instructions per 32 products
//! ([`crate::quant::stored`]). Here the same bytes are regrouped in tiles of 16 rows × one block:
//! the 16 scales, then the 32 values of each row in groups of four, so that one 64-byte
//! load holds four values of each of the 16 rows, and one `vpdpbusd` multiplies them by
//! four values of `x` broadcast to every lane, adding into one lane per row. A tile's 512
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
//! Sums are exact integers per block (per super-block for the k-quants) and f32 across
//! blocks, as in ggml. The kernels use AVX-512 VNNI, and for every format but q8_0 AVX2 (`vpmaddubsw` on each half of a tile, rows 0–7 and 8–15, in place of `vpdpbusd`);
//! [`Packed::new`] packs only where the CPU has kernels for the format (elsewhere a matrix
//! stays a `QTensor` on [`crate::quant::stored`] or Candle's kernels), and a
//! scalar version of the same arithmetic is the tests' reference for the packing and the
//! kernels, beside Candle's dequantized weights and products.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{bail, Result};
use half::f16;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crate::dense::{map_ranges, ranges};
use crate::quant::stored::{abs_max, level, quantize_in_parts, saturate_i8, Level, QRows};
use crate::team::Streams;

/// Rows per tile.
const TILE: usize = 16;
/// Values per block of q8_0 and q4_0, and per block of the quantized rows of `x`.
const QK: usize = 32;
/// Values per k-quant super-block.
const QK_K: usize = 256;
/// Bytes of a tile's 16 f16 scales (and of q4_1/q5_1's 16 f16 minima after them).
const SCALES: usize = 2 * TILE;

/// Where the parts of a q4_K or q5_K tile (16 rows × one super-block of 8 sub-blocks of
/// 32) start: 16 f16 `d`, 16 f16 `dmin`, the 6-bit scales and minima as bytes (`[8][16]`
/// each: one 16-byte load per sub-block), then each sub-block's nibbles laid out as a q4_0
/// tile's, then (q5_K) each sub-block's fifth bits laid out as a q5_0 tile's. 2368 bytes
/// (q5_K 2880) against the file's 2304 (2816): the scales unpacked from their 12 bytes.
mod q4k {
    pub const DMIN: usize = 32;
    pub const SC: usize = 64;
    pub const MIN: usize = 192;
    pub const QS: usize = 320;
    pub const BYTES: usize = QS + 8 * 256;
    pub const Q5_BYTES: usize = BYTES + 8 * 64;
}

/// Where the parts of a q6_K tile (16 rows × one super-block of 16 sub-blocks of 16) start:
/// 16 f16 `d`, the signed 8-bit scales (`[16][16]`), the low four bits of each block of 32
/// laid out as a q4_0 tile's nibbles, then their high two bits, 128 bytes per block of 32:
/// bits `2f..2f + 1` of byte `64h + 4r + i` belong to value `4g + i` of row `r`, `g = 4h + f`.
/// The same 3360 bytes as the file's 16 blocks.
mod q6k {
    pub const SC: usize = 32;
    pub const QL: usize = 288;
    pub const QH: usize = QL + 8 * 256;
    pub const BYTES: usize = QH + 8 * 128;
}

/// Where the parts of a q3_K tile (16 rows × one super-block of 16 sub-blocks of 16) start:
/// 16 f16 `d`, the signed 8-bit scales less 32 (`[16][16]`, as q6_K's), then per block of
/// 32 the low two bits of each value laid out as q6_K's high bit pairs (128 bytes), then
/// per block of 32 the third bits laid out as q5_0's fifth bits (64 bytes). 1824 bytes
/// against the file's 1760 (the scales unpacked from their 12 bytes).
mod q3k {
    pub const SC: usize = 32;
    pub const QL: usize = 288;
    pub const QH: usize = QL + 8 * 128;
    pub const BYTES: usize = QH + 8 * 64;
}

/// Where the parts of a q2_K tile (16 rows × one super-block of 16 sub-blocks of 16) start:
/// 16 f16 `d`, 16 f16 `dmin`, the stored bytes of 4-bit scale and minimum (`[16][16]`, one
/// lane per row), then per block of 32 the values' bit pairs laid out as q3_K's. The same
/// 1344 bytes as the file's 16 blocks.
mod q2k {
    pub const DMIN: usize = 32;
    pub const SC: usize = 64;
    pub const QL: usize = 320;
    pub const BYTES: usize = QL + 8 * 128;
}

/// The formats packed here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Format {
    Q8_0,
    Q4_0,
    Q5_0,
    Q4_1,
    Q5_1,
    Q4K,
    Q5K,
    Q6K,
    Q3K,
    Q2K,
}

impl Format {
    fn of(dtype: GgmlDType) -> Option<Self> {
        match dtype {
            GgmlDType::Q8_0 => Some(Self::Q8_0),
            GgmlDType::Q4_0 => Some(Self::Q4_0),
            GgmlDType::Q5_0 => Some(Self::Q5_0),
            GgmlDType::Q4_1 => Some(Self::Q4_1),
            GgmlDType::Q5_1 => Some(Self::Q5_1),
            GgmlDType::Q5K => Some(Self::Q5K),
            GgmlDType::Q4K => Some(Self::Q4K),
            GgmlDType::Q6K => Some(Self::Q6K),
            GgmlDType::Q3K => Some(Self::Q3K),
            GgmlDType::Q2K => Some(Self::Q2K),
            _ => None,
        }
    }

    /// Values of a row in one stored block (and so in one tile).
    fn values(self) -> usize {
        match self {
            Self::Q8_0 | Self::Q4_0 | Self::Q5_0 | Self::Q4_1 | Self::Q5_1 => QK,
            Self::Q4K | Self::Q5K | Self::Q6K | Self::Q3K | Self::Q2K => QK_K,
        }
    }

    /// Bytes of one row's stored block.
    fn block_bytes(self) -> usize {
        match self {
            Self::Q8_0 => 2 + QK,
            Self::Q4_0 => 2 + QK / 2,
            Self::Q5_0 => 2 + 4 + QK / 2,
            Self::Q4_1 => 4 + QK / 2,
            Self::Q5_1 => 4 + 4 + QK / 2,
            Self::Q4K => 4 + 12 + QK_K / 2,
            Self::Q5K => 4 + 12 + QK_K / 8 + QK_K / 2,
            Self::Q6K => QK_K / 2 + QK_K / 4 + QK_K / 16 + 2,
            Self::Q3K => QK_K / 8 + QK_K / 4 + 12 + 2,
            Self::Q2K => QK_K / 16 + QK_K / 4 + 2 + 2,
        }
    }

    /// Bytes per tile (16 rows × one block).
    fn tile_bytes(self) -> usize {
        match self {
            Self::Q8_0 | Self::Q4_0 | Self::Q5_0 | Self::Q4_1 | Self::Q5_1 => {
                TILE * self.block_bytes()
            }
            Self::Q4K => q4k::BYTES,
            Self::Q5K => q4k::Q5_BYTES,
            Self::Q6K => q6k::BYTES,
            Self::Q3K => q3k::BYTES,
            Self::Q2K => q2k::BYTES,
        }
    }

    /// What the unsigned operands carry on top of the value (formats with minima: none).
    fn offset(self) -> i32 {
        match self {
            Self::Q8_0 => 128,
            Self::Q4_0 => 8,
            Self::Q5_0 => 16,
            Self::Q4_1 | Self::Q5_1 | Self::Q4K | Self::Q5K | Self::Q2K => 0,
            Self::Q6K => 32,
            Self::Q3K => 4,
        }
    }

    /// Where the nibbles of q4_0, q5_0, q4_1 and q5_1 tiles start (after the scales, and
    /// the minima of the last two), and their fifth bits after them.
    fn nibbles(self) -> usize {
        match self {
            Self::Q4_1 | Self::Q5_1 => 2 * SCALES,
            _ => SCALES,
        }
    }

    /// Where value `v` of row `r` sits in a q8_0 or q4_0 tile's values, and whether in the
    /// high nibble (q4_0; the k-quants lay out their four-bit parts per 32 values the same).
    fn place(self, r: usize, v: usize) -> (usize, bool) {
        match self {
            Self::Q8_0 => ((v / 4) * 4 * TILE + 4 * r + v % 4, false),
            _ => ((v / 8) * 4 * TILE + 4 * r + v % 4, v % 8 >= 4),
        }
    }

    /// The unsigned operand (value plus offset) of value `v` of row `r` in tile `t`.
    fn operand(self, t: &[u8], r: usize, v: usize) -> i32 {
        let nibble = |q: &[u8], v: usize| {
            let (at, high) = self.place(r, v);
            (if high { q[at] >> 4 } else { q[at] & 15 }) as i32
        };
        // Value v's fifth bit: bit v / 4 of byte 4r + v % 4, beside its nibble's group.
        let fifth = |q: &[u8], v: usize| ((q[4 * r + v % 4] >> (v / 4) & 1) as i32) << 4;
        let at = self.nibbles();
        match self {
            Self::Q8_0 => t[SCALES + self.place(r, v).0] as i32,
            Self::Q4_0 | Self::Q4_1 => nibble(&t[at..], v),
            Self::Q5_0 | Self::Q5_1 => nibble(&t[at..], v) | fifth(&t[at + 256..], v),
            Self::Q4K => nibble(&t[q4k::QS + v / QK * 256..], v % QK),
            Self::Q5K => {
                let (b, v) = (v / QK, v % QK);
                nibble(&t[q4k::QS + b * 256..], v) | fifth(&t[q4k::BYTES + b * 64..], v)
            }
            Self::Q6K => {
                let (b, v) = (v / QK, v % QK);
                let (g, i) = (v / 4, v % 4);
                let high = t[q6k::QH + b * 128 + (g / 4) * 64 + 4 * r + i] >> (2 * (g % 4)) & 3;
                nibble(&t[q6k::QL + b * 256..], v) | (high as i32) << 4
            }
            Self::Q3K | Self::Q2K => {
                let at = if self == Self::Q3K { q3k::QL } else { q2k::QL };
                let (b, v) = (v / QK, v % QK);
                let (g, i) = (v / 4, v % 4);
                let low = t[at + b * 128 + (g / 4) * 64 + 4 * r + i] >> (2 * (g % 4)) & 3;
                match self {
                    Self::Q3K => low as i32 | fifth(&t[q3k::QH + b * 64..], v) >> 2,
                    _ => low as i32,
                }
            }
        }
    }

    /// Row `r` of tile `t`, dequantized as ggml (and Candle) do, to the same bits.
    fn dequantize(self, t: &[u8], r: usize, out: &mut [f32]) {
        let half = |at: usize| f16::from_le_bytes([t[at + 2 * r], t[at + 2 * r + 1]]).to_f32();
        let d = half(0);
        match self {
            Self::Q8_0 | Self::Q4_0 | Self::Q5_0 => {
                for (v, y) in out.iter_mut().enumerate() {
                    *y = (self.operand(t, r, v) - self.offset()) as f32 * d;
                }
            }
            Self::Q4_1 | Self::Q5_1 => {
                let m = half(SCALES);
                for (v, y) in out.iter_mut().enumerate() {
                    *y = self.operand(t, r, v) as f32 * d + m;
                }
            }
            Self::Q4K | Self::Q5K => {
                let dmin = half(q4k::DMIN);
                for (j, out) in out.chunks_exact_mut(QK).enumerate() {
                    let d1 = d * t[q4k::SC + 16 * j + r] as f32;
                    let m1 = dmin * t[q4k::MIN + 16 * j + r] as f32;
                    for (v, y) in out.iter_mut().enumerate() {
                        *y = d1 * self.operand(t, r, QK * j + v) as f32 - m1;
                    }
                }
            }
            Self::Q6K | Self::Q3K => {
                // (q6k::SC == q3k::SC)
                for (v, y) in out.iter_mut().enumerate() {
                    let sc = t[q6k::SC + 16 * (v / 16) + r] as i8;
                    *y = d * sc as f32 * (self.operand(t, r, v) - self.offset()) as f32;
                }
            }
            Self::Q2K => {
                let dmin = half(q2k::DMIN);
                for (v, y) in out.iter_mut().enumerate() {
                    let sc = t[q2k::SC + 16 * (v / 16) + r];
                    let (dl, ml) = (d * (sc & 15) as f32, dmin * (sc >> 4) as f32);
                    *y = dl * self.operand(t, r, v) as f32 - ml;
                }
            }
        }
    }

    /// Writes stored block `src` (one row's) as row `r` of tile `t`; rows not written keep
    /// the tile's initial bytes, which stand for zeros (see [`Packed::from_rows`]).
    fn pack_row(self, src: &[u8], t: &mut [u8], r: usize) {
        // Fifth bit `bit` of value `v` (of a block of 32) into the bit layout at `q`.
        let put_fifth = |q: &mut [u8], v: usize, bit: u8| q[4 * r + v % 4] |= bit << (v / 4);
        // Four-bit value `v` (of a block of 32) into the nibble layout at `q`.
        let put = |q: &mut [u8], v: usize, nib: u8| {
            let (at, high) = self.place(r, v);
            q[at] = if high {
                (q[at] & 0x0f) | (nib << 4)
            } else {
                (q[at] & 0xf0) | nib
            };
        };
        match self {
            Self::Q8_0 => {
                t[2 * r..2 * r + 2].copy_from_slice(&src[..2]);
                for v in 0..QK {
                    t[SCALES + self.place(r, v).0] = src[2 + v] ^ 0x80;
                }
            }
            Self::Q4_0 | Self::Q5_0 | Self::Q4_1 | Self::Q5_1 => {
                // Stored: d, (q4_1, q5_1) m, (q5_0, q5_1) the fifth bits as a
                // little-endian u32, bit j for value j, then value j in the low nibble of
                // byte j, j + 16 in its high nibble.
                t[2 * r..2 * r + 2].copy_from_slice(&src[..2]);
                let mut src = &src[2..];
                if matches!(self, Self::Q4_1 | Self::Q5_1) {
                    t[SCALES + 2 * r..][..2].copy_from_slice(&src[..2]);
                    src = &src[2..];
                }
                let five = matches!(self, Self::Q5_0 | Self::Q5_1);
                let qh = match five {
                    true => u32::from_le_bytes([src[0], src[1], src[2], src[3]]),
                    false => 0,
                };
                let qs = &src[if five { 4 } else { 0 }..];
                let at = self.nibbles();
                for v in 0..QK {
                    let byte = qs[v % 16];
                    put(&mut t[at..], v, if v < 16 { byte & 15 } else { byte >> 4 });
                    if five {
                        put_fifth(&mut t[at + 256..], v, (qh >> v & 1) as u8);
                    }
                }
            }
            Self::Q4K | Self::Q5K => {
                // Stored: d, dmin, 12 bytes of scales and minima, (q5_K) 32 bytes of fifth
                // bits (bit c of byte l for value 32c + l), then each 64 values as 32
                // bytes: values 0..32 in the low nibbles, 32..64 in the high ones.
                t[2 * r..2 * r + 2].copy_from_slice(&src[..2]);
                t[q4k::DMIN + 2 * r..][..2].copy_from_slice(&src[2..4]);
                let (scales, mut qs) = (&src[4..16], &src[16..]);
                if self == Self::Q5K {
                    let qh = &qs[..32];
                    qs = &qs[32..];
                    for v in 0..QK_K {
                        let bit = qh[v % 32] >> (v / 32) & 1;
                        put_fifth(&mut t[q4k::BYTES + v / QK * 64..], v % QK, bit);
                    }
                }
                for j in 0..8 {
                    let (sc, m) = scale_min_k4(j, scales);
                    t[q4k::SC + 16 * j + r] = sc;
                    t[q4k::MIN + 16 * j + r] = m;
                }
                for v in 0..QK_K {
                    let (c, l) = (v / 64, v % 64);
                    let byte = qs[32 * c + l % 32];
                    let nib = if l < 32 { byte & 15 } else { byte >> 4 };
                    put(&mut t[q4k::QS + v / QK * 256..], v % QK, nib);
                }
            }
            Self::Q6K => {
                // Stored: 128 bytes of low nibbles, 64 of high bit pairs, 16 scales, d;
                // each 128 values as four runs of 32 (see Candle's `BlockQ6K::to_float`).
                let (ql, qh, sc) = (&src[..128], &src[128..192], &src[192..208]);
                t[2 * r..2 * r + 2].copy_from_slice(&src[208..210]);
                for (j, &s) in sc.iter().enumerate() {
                    t[q6k::SC + 16 * j + r] = s;
                }
                for v in 0..QK_K {
                    let (half, run, l) = (v / 128, v % 128 / 32, v % 32);
                    let low = ql[64 * half + l + 32 * (run % 2)];
                    let nib = if run < 2 { low & 15 } else { low >> 4 };
                    let high = qh[32 * half + l] >> (2 * run) & 3;
                    let (b, v) = (v / QK, v % QK);
                    put(&mut t[q6k::QL + b * 256..], v, nib);
                    let (g, i) = (v / 4, v % 4);
                    t[q6k::QH + b * 128 + (g / 4) * 64 + 4 * r + i] |= high << (2 * (g % 4));
                }
            }
            Self::Q3K => {
                // Stored: 32 bytes of third bits (bit c of byte l for value 32c + l), 64
                // of low bit pairs (bits 2c..2c + 1 of byte 32h + l for value 128h + 32c
                // + l), 12 of 6-bit scales, d (see Candle's `BlockQ3K::to_float`).
                let (hm, qs, sc) = (&src[..32], &src[32..96], &src[96..108]);
                t[2 * r..2 * r + 2].copy_from_slice(&src[108..110]);
                for j in 0..16 {
                    // ggml's unpacking of the 12 bytes: the low four bits from bytes 0..8,
                    // the high two from bytes 8..12.
                    let (low, high) = match j {
                        0..4 => (sc[j] & 15, sc[8 + j] & 3),
                        4..8 => (sc[j] & 15, sc[8 + j - 4] >> 2 & 3),
                        8..12 => (sc[j - 8] >> 4, sc[8 + j - 8] >> 4 & 3),
                        _ => (sc[j - 8] >> 4, sc[8 + j - 12] >> 6),
                    };
                    t[q3k::SC + 16 * j + r] = ((low | high << 4) as i8 - 32) as u8;
                }
                for v in 0..QK_K {
                    let (half, c, l) = (v / 128, v % 128 / 32, v % 32);
                    let low = qs[32 * half + l] >> (2 * c) & 3;
                    let third = hm[l] >> (4 * half + c) & 1;
                    let (b, v) = (v / QK, v % QK);
                    let (g, i) = (v / 4, v % 4);
                    t[q3k::QL + b * 128 + (g / 4) * 64 + 4 * r + i] |= low << (2 * (g % 4));
                    put_fifth(&mut t[q3k::QH + b * 64..], v, third);
                }
            }
            Self::Q2K => {
                // Stored: 16 bytes of scale (low nibble) and minimum (high), 64 of bit
                // pairs as q3_K's, d, dmin (see Candle's `BlockQ2K::to_float`).
                let (sc, qs) = (&src[..16], &src[16..80]);
                t[2 * r..2 * r + 2].copy_from_slice(&src[80..82]);
                t[q2k::DMIN + 2 * r..][..2].copy_from_slice(&src[82..84]);
                for (j, &s) in sc.iter().enumerate() {
                    t[q2k::SC + 16 * j + r] = s;
                }
                for v in 0..QK_K {
                    let (half, c, l) = (v / 128, v % 128 / 32, v % 32);
                    let pair = qs[32 * half + l] >> (2 * c) & 3;
                    let (b, v) = (v / QK, v % QK);
                    let (g, i) = (v / 4, v % 4);
                    t[q2k::QL + b * 128 + (g / 4) * 64 + 4 * r + i] |= pair << (2 * (g % 4));
                }
            }
        }
    }
}

/// Sub-block `j`'s 6-bit scale and minimum from a q4_K block's 12 bytes (ggml's
/// `get_scale_min_k4`).
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Rows of `x` quantized for a product: in blocks of 32 as ggml's q8_0 for q8_0 and q4_0
/// weights, in super-blocks of 256 as its q8_K for the k-quants (as ggml multiplies them,
/// so that results track llama.cpp's to rounding).
enum XRows {
    Blocks(QRows),
    Super(SuperRows),
}

impl XRows {
    fn new(format: Format, x: &[f32], k: usize) -> Self {
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
struct SuperRows {
    /// `[m, k]`.
    q: Vec<i8>,
    /// `[m, k / 256]`.
    d: Vec<f32>,
    /// `[m, k / 16]`.
    sum: Vec<i32>,
    /// `[m, k / 32]`: the sums of 32 (exact in f32), for the two-column prefill kernels'
    /// minima (`x86::q4k_pair`).
    sum32: Vec<f32>,
    k: usize,
}

impl SuperRows {
    fn new(x: &[f32], k: usize) -> Self {
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
    fn sums32(&self, r: usize) -> &[f32] {
        &self.sum32[r * self.k / QK..][..self.k / QK]
    }

    /// Row `r`: its values, scales and sums of 16. (Inlined: the kernels look rows up
    /// per call, four rows of one tile column, and the call was 5% of a q5_K prefill.)
    #[inline(always)]
    fn row(&self, r: usize) -> (&[i8], &[f32], &[i32]) {
        (
            &self.q[r * self.k..][..self.k],
            &self.d[r * self.k / QK_K..][..self.k / QK_K],
            &self.sum[r * self.k / 16..][..self.k / 16],
        )
    }
}

crate::simd::dispatch!(
    /// Super-blocks of 256 values of `x` quantized as ggml's q8_K (see [`SuperRows`]),
    /// compiled for the vector width the CPU has (as `qmatvec::quantize_blocks`).
    pub(crate) quantize_super, quantize_super_impl,
    (x: &[f32], q: &mut [i8], d: &mut [f32], sum: &mut [i32]) -> ()
);

#[inline(always)]
fn quantize_super_impl(x: &[f32], q: &mut [i8], d: &mut [f32], sum: &mut [i32]) {
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
        // one that holds it: value by value this search was 40% of the quantizer.)
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
            // `qmatvec::quantize_blocks`).
            let r = iscale * v;
            *q = saturate_i8(r + 0.49999997f32.copysign(r));
        }
        *d = 1.0 / iscale;
        for (s, c) in sum.iter_mut().zip(qs.chunks_exact(16)) {
            *s = c.iter().map(|&v| v as i32).sum();
        }
    }
}

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

/// From this many packed bytes on, decoding reads the weights from memory rather than
/// from the last-level cache (32 MiB on the machine measured), and each tile's successor
/// is prefetched (see [`Packed::product`]). The unit tests' small matrices take that path.
const STREAMED_BYTES: usize = if cfg!(test) { 1 } else { 32 << 20 };

/// How a decoding thread asks for the weights it streams from memory before its kernels
/// read them: the whole next tile column at once (`column`), or the k-quant kernels each
/// super-block's successor an eighth at a time (`spread`). The column pays on AMD's Zen 5
/// (decoding 10-20% faster, docs/PERFORMANCE.md) and measured level on Zen 3; on an Intel
/// Ice Lake Xeon its 110-630 prefetches at once stall the thread (each holds a line fill
/// buffer until its line arrives: 28% of a GPT-2 q4_0 decoding profile on the loop issuing
/// them), decoding at 0.50x (q4_K_M) and 0.67x (q4_0) of the same build without them,
/// where the spread requests took the k-quants 1.24-1.31x faster than none (the legacy
/// formats' two streams gained nothing from them). So AMD CPUs take the column and others
/// the spread requests; the unit tests take both.
#[derive(Clone, Copy)]
struct Ahead {
    column: bool,
    spread: bool,
}

impl Ahead {
    fn here() -> Ahead {
        let amd = amd();
        Ahead {
            column: amd || cfg!(test),
            spread: !amd || cfg!(test),
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

impl Format {
    /// Whether `level` has kernels for this format. AVX2 has them for every format but
    /// q8_0, where the products through the blocks as stored spent as long reducing each
    /// block's sums across lanes as multiplying them (`qmatvec`: SmolLM-135M q4_0 decoded
    /// at 0.77× llama.cpp, which repacks q4_0 for AVX2 too), ran Candle's block product
    /// (the k-quants' decoding) or kept a repacked copy (Candle's q4_K and q6_K prefill).
    /// q8_0's values do not fit `vpmaddubsw`'s unsigned operand (and its decoding through
    /// `qmatvec` leads llama.cpp's).
    fn kernels(self, level: Level) -> bool {
        match level {
            Level::Avx512Vnni => true,
            Level::Avx2 => self != Self::Q8_0,
            Level::Scalar => false,
        }
    }
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
    /// with AVX-512 VNNI, all but q8_0 with AVX2 alone.
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

    /// A matrix `[n, k]` of a packed format (`None` for other formats) packed from its
    /// stored rows, which `read` fills 16 at a time (fewer for the last tile), in order: a
    /// loader can read them from a file with no buffer the size of the matrix. Packs
    /// whatever the CPU; [`Self::packs_here`] says whether the kernels will run.
    pub fn from_rows(
        dtype: GgmlDType,
        n: usize,
        k: usize,
        mut read: impl FnMut(&mut [u8]) -> Result<()>,
    ) -> Result<Option<Self>> {
        let Some(format) = Format::of(dtype) else {
            return Ok(None);
        };
        let values = format.values();
        if !k.is_multiple_of(values) {
            bail!("a {format:?} matrix [{n}, {k}]: rows are not whole blocks of {values}")
        }
        let nb = k / values;
        let (block, size) = (format.block_bytes(), format.tile_bytes());
        // Missing rows of the last tile: zero scales, and (q8_0, q4_0) operands that stand
        // for zero.
        let empty = match format {
            Format::Q8_0 => 128u8,
            Format::Q4_0 => 0x88,
            _ => 0,
        };
        let mut tiles = crate::memory::packed_weight_vec(n.div_ceil(TILE) * nb * size, empty);
        let mut rows = vec![0u8; TILE * nb * block];
        for (t, column) in tiles.chunks_exact_mut((nb * size).max(1)).enumerate() {
            let count = TILE.min(n - t * TILE);
            let rows = &mut rows[..count * nb * block];
            read(rows)?;
            for (b, tile) in column.chunks_exact_mut(size).enumerate() {
                if matches!(format, Format::Q8_0 | Format::Q4_0) {
                    tile[..SCALES].fill(0);
                } else if matches!(format, Format::Q5_0 | Format::Q4_1 | Format::Q5_1) {
                    tile.fill(0);
                }
                for r in 0..count {
                    format.pack_row(&rows[(r * nb + b) * block..][..block], tile, r);
                }
            }
        }
        Ok(Some(Self::holding(format, n, k, Tiles::Own(tiles))))
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
        // (49 152 logits for SmolLM) was 0.3% of a decoding step, on the calling thread.
        let mut ys: Vec<f32> = Vec::with_capacity(m * width);
        let out = SharedOut(ys.as_mut_ptr());
        // A prefill unpacks each column of five- and six-bit tiles once, for all its rows
        // of `x`: the kernels would or in the bit planes again for every four rows. (Four-
        // bit tiles take a mask or a shift per operand: unpacking them ahead measured the
        // same, and q8_0 tiles are their operands.) With AVX2 too: whole prefills of 512
        // tokens 1.06× (SmolLM-135M q4_K_M, its q5_0 and q6_K), 1.05× (GPT-2 124M q4_K_M),
        // 1.01× (GPT-2 q3_K_M), paired medians of 5 on a Zen 3 CPU.
        let planes = matches!(
            self.format,
            Format::Q5_0 | Format::Q5_1 | Format::Q5K | Format::Q6K | Format::Q3K
        );
        // With AVX-512 VNNI a prefill takes the tiles two columns at a time
        // (`x86::q4k_pair`), from their operands unpacked ahead: each value of `x` is
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
        let pair = level == Level::Avx512Vnni && m >= rows;
        let unpack = level >= Level::Avx2 && (planes || pair) && m >= UNPACK_ROWS;
        // Bytes of one column's operands.
        let per = if unpack { self.k * TILE } else { 0 };
        let need = if pair { 2 * per } else { per };
        // Each thread takes a contiguous range of tiles (read as two streams when decoding
        // the legacy formats, below). (Four
        // parts per thread, as the dense decoding products take, measured slower here:
        // SmolLM-135M decoding q4_K_M 188 → 183, q4_0 249 → 243, q8_0 157 → 151 tok/s,
        // medians of 5; each part restarts the stream and its prefetching.)
        let parts = ranges(t1 - t0, 4, (t1 - t0) * TILE * self.k);
        // Decoding a model larger than the cache reads each tile from memory once: the
        // hardware prefetchers alone kept 2 threads at 31-40 GB/s of a 47 GB/s floor
        // (1536 × 768 matrices, q6_K-q8_0), the kernels' unpacking slowing the stream.
        // Asking for the next tile while this one is worked on: 39-51 GB/s, and decoding
        // GPT-2 q4_0, q4_K_M, q3_K_M, SmolLM-135M q4_K_M, q5_K_M, q2_K faster in most
        // rounds (see docs/PERFORMANCE.md). Not for q8_0, whose plain bytes the hardware
        // streams well (mixed results), nor where the weights sit in the cache: there the
        // prefetches are pure cost (the built-in model in q4_K: 10-20% slower). That was
        // an AMD CPU; on Intel's the burst of prefetches stalls instead (`Ahead`).
        let stream = m < UNPACK_ROWS
            && self.format != Format::Q8_0
            && PACKED_BYTES.load(Ordering::Relaxed) >= STREAMED_BYTES;
        let ahead = Ahead::here();
        let spread = stream && m == 1 && ahead.spread;
        let pairs = m == 1
            && matches!(
                self.format,
                Format::Q8_0 | Format::Q4_0 | Format::Q5_0 | Format::Q4_1 | Format::Q5_1
            );
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
                    Some(b) => self.columns([a, b], &[], x, m, &cols, out, level, false),
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
                // Decoding through the legacy formats reads two columns of tiles together,
                // tile j of the range's first half beside tile j of its second: two streams
                // through memory (see `x86::legacy_rows`), which replace the prefetch below
                // (SmolLM-135M q4_0 with both 0.98×, with the streams alone 1.12×). The
                // k-quants' decoding kernels (two columns: 0.88–1.07×) and a prefill's
                // unpacked operands take the range in order: one column at a time, or
                // two neighbours (`pair`).
                let half = match pairs {
                    true => (hi - lo) / 2,
                    false => 0,
                };
                for j in 0..half {
                    let (a, b) = (lo + j, lo + half + j);
                    self.columns([t0 + a, t0 + b], &[], x, m, &cols, out, level, false);
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
                                    Level::Avx512Vnni => x86::unpack(self.format, tiles, ops),
                                    _ => x86::unpack_avx2(self.format, tiles, ops),
                                }
                            };
                        }
                    }
                    if count == 2 {
                        let ts = [t0 + t, t0 + t + 1];
                        self.columns(ts, ops, x, m, &cols, out, level, false);
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
        spread: bool,
    ) {
        let tiles = t.map(|t| self.tiles(t));
        let width = cols.len();
        // (Made once: each pass writes its rows. Zeroed per pass, it was a `memset` call
        // per four rows of `x`, 11% of a q5_K prefill.)
        let mut y = [[[0f32; TILE]; 4]; T];
        let mut r = 0;
        while r < m {
            // Up to four rows of `x` per pass over the tiles' blocks (from L1): four
            // independent sums in flight, each tile's loads shared. (Eight rows per pass
            // prefilled 10-20% slower: registers run out.)
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
                    // (A whole tile, as nearly all are, is one copy of a known size: a
                    // `memcpy` call per row and tile was 3% of a q5_K prefill.)
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
/// two columns at a time with AVX-512 VNNI (`x86::legacy_pair`; the k-quants from
/// [`UNPACK_ROWS`]). Against one column at a time (`examples/packed_prefill.rs`, GPT-2's
/// shapes, 1 thread, pairs of runs): 8 rows 0.78–0.93×, 16 rows 0.95–1.41×, 32 rows
/// 0.95–1.25× for q4_0 and q8_0, where q5_K measured 0.98–1.17× at 8 rows already.
const PAIR_ROWS_LEGACY: usize = 16;

thread_local! {
    /// A column of tiles' operands, unpacked: 512 bytes per block of 32 values (16 bytes
    /// per value of a row of the weight: 48 KiB for GPT-2's 3072-wide MLP output).
    static OPERANDS: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The decoding product's ranges of tile columns, taken by the team a unit at a time: a
/// thread runs its own range from the front, then takes what is left of the others from
/// their backs. One range per thread keeps each stream through memory whole (ranges cut
/// into more parts measured slower, see [`Packed::product`]), while a thread that started
/// late, or whose reads were slower, no longer holds the other up: in SmolLM-135M q8_0
/// decoding the caller had waited for the helper's last tiles 5% of its time (p90 5–7 µs
/// a product). With the legacy formats a unit is a pair of tile columns, `j` of the
/// range's first half beside `j` of its second (two streams, see `x86::legacy_rows`), and
/// an odd last column is its owner's; with the others, one tile column.
struct Units<'a> {
    parts: &'a [(usize, usize)],
    t0: usize,
    pairs: bool,
    /// Per range, its units not yet taken: front (high 32 bits) to back (low 32 bits).
    left: Vec<AtomicU64>,
}

impl<'a> Units<'a> {
    fn new(parts: &'a [(usize, usize)], t0: usize, pairs: bool) -> Self {
        let count = |(lo, hi): (usize, usize)| if pairs { (hi - lo) / 2 } else { hi - lo };
        Self {
            parts,
            t0,
            pairs,
            left: parts
                .iter()
                .map(|&r| AtomicU64::new(count(r) as u64))
                .collect(),
        }
    }

    /// Range `i`'s next unit from its front or its back, if any is left.
    fn take(&self, i: usize, front: bool) -> Option<usize> {
        let left = &self.left[i];
        let mut w = left.load(Ordering::Relaxed);
        loop {
            let (f, b) = (w >> 32, w & 0xffff_ffff);
            if f >= b {
                return None;
            }
            let (next, unit) = match front {
                true => ((f + 1) << 32 | b, f),
                false => (f << 32 | (b - 1), b - 1),
            };
            match left.compare_exchange_weak(w, next, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return Some(unit as usize),
                Err(now) => w = now,
            }
        }
    }

    /// Task `i`: range `i` from its front (then its odd column), then the other ranges'
    /// units left, from their backs. `tile(a, b, front)` multiplies one unit: tile column
    /// `a` (an absolute index), and `b` beside it for a pair.
    fn run(&self, i: usize, tile: impl Fn(usize, Option<usize>, bool)) {
        while let Some(j) = self.take(i, true) {
            self.unit(i, j, true, &tile);
        }
        let (lo, hi) = self.parts[i];
        if self.pairs && (hi - lo) % 2 == 1 {
            tile(self.t0 + hi - 1, None, true);
        }
        let n = self.parts.len();
        for o in (1..n).map(|s| (i + s) % n) {
            while let Some(j) = self.take(o, false) {
                self.unit(o, j, false, &tile);
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

/// The product's output, written by several threads at disjoint columns.
struct SharedOut(*mut f32);
// SAFETY: the threads write disjoint elements (see `Packed::product`), and the vector
// outlives them (`map_ranges` returns when they are done).
unsafe impl Sync for SharedOut {}

/// `y[c][j] = x row r + j · tile rows of column c`, for `rows` (1–4) rows of `x` and `T`
/// (1 or 2) columns of tiles, with the kernels of `level`; `ops` holds the columns'
/// operands unpacked by `x86::unpack` (`unpack_avx2` at the AVX2 level) one after the
/// other, or is empty. The legacy formats' kernel reads two columns together; the
/// k-quants' take them one after the other, but for two columns unpacked (a prefill's
/// with AVX-512 VNNI, `x86::q4k_pair`). With `spread`, the AVX-512 k-quant kernels ask
/// for each super-block's successor while they work on it (see `Ahead`).
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
    spread: bool,
) {
    #[cfg(target_arch = "x86_64")]
    if level == Level::Avx2 {
        if let XRows::Blocks(x) = x {
            // SAFETY: `level` is at most what the CPU has (`level()`); the kernels
            // check the lengths.
            unsafe {
                use x86::legacy_rows_avx2 as legacy;
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
                use x86::{q2k_rows_avx2 as q2k, q4k_rows_avx2 as q4k, q6k_rows_avx2 as q6k};
                macro_rules! by_rows {
                    ($kernel:ident, $($c:literal)? ; $($ops:ident)?) => {
                        for (tiles, y) in tiles.into_iter().zip(y) {
                            match rows {
                                1 => $kernel::<1 $(, $c)?>(tiles, $($ops,)? x, r, y),
                                2 => $kernel::<2 $(, $c)?>(tiles, $($ops,)? x, r, y),
                                3 => $kernel::<3 $(, $c)?>(tiles, $($ops,)? x, r, y),
                                _ => $kernel::<4 $(, $c)?>(tiles, $($ops,)? x, r, y),
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
    if level == Level::Avx512Vnni {
        // SAFETY: `level` is at most what the CPU has (`level()`); the kernels check
        // the lengths.
        unsafe {
            use x86::{legacy_rows as legacy, q2k_rows as q2k, q4k_rows as q4k, q6k_rows as q6k};
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
                    use x86::legacy_pair as pair;
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
                    by_rows!(legacy::<R, 8, false, T>(tiles, ops, x, r, y))
                }
                (Format::Q4_0, XRows::Blocks(x)) => {
                    by_rows!(legacy::<R, 4, false, T>(tiles, ops, x, r, y))
                }
                (Format::Q5_0, XRows::Blocks(x)) => {
                    by_rows!(legacy::<R, 5, false, T>(tiles, ops, x, r, y))
                }
                (Format::Q4_1, XRows::Blocks(x)) => {
                    by_rows!(legacy::<R, 4, true, T>(tiles, ops, x, r, y))
                }
                (Format::Q5_1, XRows::Blocks(x)) => {
                    by_rows!(legacy::<R, 5, true, T>(tiles, ops, x, r, y))
                }
                (format, XRows::Super(x)) if T == 2 && !ops.is_empty() => {
                    // Two columns' operands, unpacked ahead one after the other (a
                    // prefill's, see `Packed::product`).
                    use x86::{q2k_pair, q4k_pair, q6k_pair};
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
                (format, XRows::Super(x)) => {
                    for (tiles, y) in tiles.into_iter().zip(y) {
                        match format {
                            Format::Q4K => by_rows!(q4k::<R, false>(tiles, ops, x, r, y, spread)),
                            Format::Q5K => by_rows!(q4k::<R, true>(tiles, ops, x, r, y, spread)),
                            Format::Q6K => by_rows!(q6k::<R, false>(tiles, ops, x, r, y, spread)),
                            Format::Q3K => by_rows!(q6k::<R, true>(tiles, ops, x, r, y, spread)),
                            Format::Q2K => by_rows!(q2k::<R>(tiles, x, r, y, spread)),
                            _ => unreachable!("{format:?} weights with rows of x as q8_K"),
                        }
                    }
                }
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

/// [`tile_rows`] for one column, in scalar code.
fn scalar_rows(
    format: Format,
    tiles: &[u8],
    x: &XRows,
    r: usize,
    rows: usize,
    y: &mut [[f32; TILE]; 4],
) {
    let size = format.tile_bytes();
    let half = |t: &[u8], at: usize, row: usize| {
        f16::from_le_bytes([t[at + 2 * row], t[at + 2 * row + 1]]).to_f32()
    };
    for (j, y) in y.iter_mut().enumerate().take(rows) {
        *y = [0.0; TILE];
        for (b, tile) in tiles.chunks_exact(size).enumerate() {
            let values = format.values();
            for (row, y) in y.iter_mut().enumerate() {
                let d = half(tile, 0, row);
                let dot = |xq: &[i8], vs: std::ops::Range<usize>| -> i32 {
                    vs.map(|v| format.operand(tile, row, v) * xq[b * values + v] as i32)
                        .sum()
                };
                match x {
                    XRows::Blocks(x) => {
                        let (xq, xd, xs) = x.row(r + j);
                        let sum = dot(xq, 0..QK) - format.offset() * xs[b];
                        *y += sum as f32 * (d * xd[b]);
                        if matches!(format, Format::Q4_1 | Format::Q5_1) {
                            *y += half(tile, SCALES, row) * (xd[b] * xs[b] as f32);
                        }
                    }
                    XRows::Super(x) => {
                        let (xq, xd, xs) = x.row(r + j);
                        let xs = &xs[b * QK_K / 16..][..QK_K / 16];
                        let (mut sum, mut mins) = (0i32, 0i32);
                        if format == Format::Q2K {
                            for s in 0..16 {
                                let sc = tile[q2k::SC + 16 * s + row] as i32;
                                sum += (sc & 15) * dot(xq, 16 * s..16 * (s + 1));
                                mins += (sc >> 4) * xs[s];
                            }
                        } else if matches!(format, Format::Q4K | Format::Q5K) {
                            for s in 0..8 {
                                let sc = tile[q4k::SC + 16 * s + row] as i32;
                                let m = tile[q4k::MIN + 16 * s + row] as i32;
                                sum += sc * dot(xq, QK * s..QK * (s + 1));
                                mins += m * (xs[2 * s] + xs[2 * s + 1]);
                            }
                        } else {
                            // q6_K and q3_K: 16 signed scales at the same place.
                            let offset = format.offset();
                            for s in 0..16 {
                                let sc = tile[q6k::SC + 16 * s + row] as i8 as i32;
                                sum += sc * (dot(xq, 16 * s..16 * (s + 1)) - offset * xs[s]);
                            }
                        }
                        *y += d * xd[b] * sum as f32;
                        if matches!(format, Format::Q4K | Format::Q5K | Format::Q2K) {
                            // (q4k::DMIN == q2k::DMIN)
                            *y -= half(tile, q4k::DMIN, row) * xd[b] * mins as f32;
                        }
                    }
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{q2k, q3k, q4k, q6k, Format, QRows, SuperRows, QK, QK_K, SCALES, TILE};
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

    /// The eight operands of a block of 32 four-bit values laid out as a q4_0 tile's at
    /// `q`: `w[g]` holds values `4g..4g + 3` of each of the 16 rows.
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn q4_operands(q: *const u8) -> [__m512i; 8] {
        // SAFETY (caller): 256 readable bytes at `q`.
        unsafe {
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
        }
    }

    /// `s + Σ_g w[g] · x[4g..4g + 3]` per lane (row), for the values of `x` at `p` (four
    /// per `i32`), in two chains.
    #[target_feature(enable = "avx512f,avx512vnni")]
    #[inline]
    unsafe fn dot_groups(w: &[__m512i], p: *const i32, s: __m512i) -> __m512i {
        let (mut s0, mut s1) = (s, _mm512_setzero_si512());
        for g in (0..w.len()).step_by(2) {
            // SAFETY (caller): `w.len()` (even) values of 4 bytes at `p`.
            let (x0, x1) = unsafe { (p.add(g).read_unaligned(), p.add(g + 1).read_unaligned()) };
            s0 = _mm512_dpbusd_epi32(s0, w[g], _mm512_set1_epi32(x0));
            s1 = _mm512_dpbusd_epi32(s1, w[g + 1], _mm512_set1_epi32(x1));
        }
        _mm512_add_epi32(s0, s1)
    }

    /// Bit `g` of each of the 64 bytes at `p` or-ed into bit 4 of `w[g]`: the fifth bits
    /// of q5_0, q5_1 and q5_K in their layout (see `Format::operand`).
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn add_fifth_bits(w: &mut [__m512i; 8], p: *const u8) {
        // SAFETY (caller): 64 readable bytes at `p`.
        let v = unsafe { _mm512_loadu_si512(p.cast()) };
        // Shifts of 16-bit lanes: the mask keeps bit 4 of each byte, which came from the
        // same byte (shifts of at most 4 to the left and 3 to the right).
        let high = [
            _mm512_slli_epi16::<4>(v),
            _mm512_slli_epi16::<3>(v),
            _mm512_slli_epi16::<2>(v),
            _mm512_slli_epi16::<1>(v),
            v,
            _mm512_srli_epi16::<1>(v),
            _mm512_srli_epi16::<2>(v),
            _mm512_srli_epi16::<3>(v),
        ];
        let bit = _mm512_set1_epi8(0x10);
        for (w, high) in w.iter_mut().zip(high) {
            // w | (high & bit) in one instruction.
            *w = _mm512_ternarylogic_epi32::<0xf8>(*w, high, bit);
        }
    }

    /// The operands of sub-block `j` of a q4_K (`FIVE`: q5_K) tile at `tile`.
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn q4k_operands<const FIVE: bool>(tile: *const u8, j: usize) -> [__m512i; 8] {
        // SAFETY (caller): a whole tile at `tile`, j < 8.
        unsafe {
            let mut w = q4_operands(tile.add(q4k::QS + 256 * j));
            if FIVE {
                add_fifth_bits(&mut w, tile.add(q4k::BYTES + 64 * j));
            }
            w
        }
    }

    /// The six-bit operands of block `j` (of 32 values) of a q6_K tile at `tile`: the
    /// q4_0 layout's nibbles with two more bits or-ed in above them.
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn q6k_operands(tile: *const u8, j: usize) -> [__m512i; 8] {
        let bits = _mm512_set1_epi8(0x30);
        // SAFETY (caller): a whole tile at `tile`, j < 8.
        unsafe {
            let mut w = q4_operands(tile.add(q6k::QL + 256 * j));
            let qh = tile.add(q6k::QH + 128 * j);
            for (h, w) in w.chunks_exact_mut(4).enumerate() {
                // Bits 2f..2f + 1 of each byte go to bits 4..5 of group 4h + f.
                let v = _mm512_loadu_si512(qh.add(64 * h).cast());
                let high = [
                    _mm512_slli_epi16::<4>(v),
                    _mm512_slli_epi16::<2>(v),
                    v,
                    _mm512_srli_epi16::<2>(v),
                ];
                for (w, high) in w.iter_mut().zip(high) {
                    // w | (high & bits) in one instruction.
                    *w = _mm512_ternarylogic_epi32::<0xf8>(*w, high, bits);
                }
            }
            w
        }
    }

    /// The three-bit operands of block `j` (of 32 values) of a q3_K tile at `tile`: the two
    /// low bits of group `4h + f` at bits `2f..2f + 1` of the h-th 64 bytes, the third
    /// bit or-ed in from its plane.
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn q3k_operands(tile: *const u8, j: usize) -> [__m512i; 8] {
        let bit = _mm512_set1_epi8(0x04);
        // SAFETY (caller): a whole tile at `tile`, j < 8.
        unsafe {
            let mut w = bit_pairs(tile.add(q3k::QL + 128 * j));
            // Bit g of each byte to bit 2 of w[g] (16-bit shifts: the mask keeps bit 2 of
            // each byte, which came from the same byte).
            let v = _mm512_loadu_si512(tile.add(q3k::QH + 64 * j).cast());
            let high = [
                _mm512_slli_epi16::<2>(v),
                _mm512_slli_epi16::<1>(v),
                v,
                _mm512_srli_epi16::<1>(v),
                _mm512_srli_epi16::<2>(v),
                _mm512_srli_epi16::<3>(v),
                _mm512_srli_epi16::<4>(v),
                _mm512_srli_epi16::<5>(v),
            ];
            for (w, high) in w.iter_mut().zip(high) {
                // w | (high & bit) in one instruction.
                *w = _mm512_ternarylogic_epi32::<0xf8>(*w, high, bit);
            }
            w
        }
    }

    /// The eight operands of a block of 32 two-bit values at `p` laid out as q3_K's and
    /// q2_K's low bits: group `4h + f` at bits `2f..2f + 1` of the h-th 64 bytes.
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn bit_pairs(p: *const u8) -> [__m512i; 8] {
        let pair = _mm512_set1_epi8(0x03);
        // SAFETY (caller): 128 readable bytes at `p`.
        let (v0, v1) = unsafe {
            (
                _mm512_loadu_si512(p.cast()),
                _mm512_loadu_si512(p.add(64).cast()),
            )
        };
        [
            _mm512_and_si512(v0, pair),
            _mm512_and_si512(_mm512_srli_epi16::<2>(v0), pair),
            _mm512_and_si512(_mm512_srli_epi16::<4>(v0), pair),
            _mm512_and_si512(_mm512_srli_epi16::<6>(v0), pair),
            _mm512_and_si512(v1, pair),
            _mm512_and_si512(_mm512_srli_epi16::<2>(v1), pair),
            _mm512_and_si512(_mm512_srli_epi16::<4>(v1), pair),
            _mm512_and_si512(_mm512_srli_epi16::<6>(v1), pair),
        ]
    }

    /// The operands of a q4_0/q4_1 (`BITS` 4) or q5_0/q5_1 (5) tile whose nibbles start
    /// at `q`, or the bytes of a q8_0 tile's.
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn legacy_operands<const BITS: u8>(q: *const u8) -> [__m512i; 8] {
        // SAFETY (caller): the tile's values at `q` (256, 320 or 512 bytes).
        unsafe {
            match BITS {
                4 => q4_operands(q),
                5 => {
                    let mut w = q4_operands(q);
                    add_fifth_bits(&mut w, q.add(256));
                    w
                }
                _ => load8(q),
            }
        }
    }

    /// Eight operands stored one after another at `p`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn load8(p: *const u8) -> [__m512i; 8] {
        // SAFETY (caller): 512 readable bytes at `p`. (Written out: a closure would not
        // inherit the target features.)
        unsafe {
            [
                _mm512_loadu_si512(p.cast()),
                _mm512_loadu_si512(p.add(64).cast()),
                _mm512_loadu_si512(p.add(128).cast()),
                _mm512_loadu_si512(p.add(192).cast()),
                _mm512_loadu_si512(p.add(256).cast()),
                _mm512_loadu_si512(p.add(320).cast()),
                _mm512_loadu_si512(p.add(384).cast()),
                _mm512_loadu_si512(p.add(448).cast()),
            ]
        }
    }

    /// Every operand of one column of `format` tiles into `ops`, block after block of 32
    /// values (512 bytes each), as the kernels below would build them: unpacked once for
    /// all the rows of `x` of a prefill instead of once per four rows.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub unsafe fn unpack(format: Format, tiles: &[u8], ops: &mut [u8]) {
        let size = format.tile_bytes();
        let blocks = format.values() / QK;
        let nb = tiles.len() / size;
        assert!(ops.len() >= nb * blocks * 512);
        for b in 0..nb {
            for j in 0..blocks {
                // SAFETY: tile b lies in `tiles`; block (b, j)'s 512 bytes in `ops`.
                unsafe {
                    let tile = tiles.as_ptr().add(b * size);
                    let w = match format {
                        Format::Q4K => q4k_operands::<false>(tile, j),
                        Format::Q5K => q4k_operands::<true>(tile, j),
                        Format::Q6K => q6k_operands(tile, j),
                        Format::Q3K => q3k_operands(tile, j),
                        Format::Q2K => bit_pairs(tile.add(q2k::QL + 128 * j)),
                        Format::Q4_0 => legacy_operands::<4>(tile.add(SCALES)),
                        Format::Q5_0 => legacy_operands::<5>(tile.add(SCALES)),
                        Format::Q4_1 => legacy_operands::<4>(tile.add(2 * SCALES)),
                        Format::Q5_1 => legacy_operands::<5>(tile.add(2 * SCALES)),
                        Format::Q8_0 => legacy_operands::<8>(tile.add(SCALES)),
                    };
                    let at = ops.as_mut_ptr().add((b * blocks + j) * 512);
                    for (g, w) in w.iter().enumerate() {
                        _mm512_storeu_si512(at.add(64 * g).cast(), *w);
                    }
                }
            }
        }
    }

    /// The pointers to rows `r..r + R` of `x` (values, scales, sums of 16), checked to
    /// hold `blocks` super-blocks.
    /// (A loop, inlined: an `array::from_fn` closure stayed a call per row, 2-4% of a
    /// q5_K prefill.)
    #[inline(always)]
    fn super_rows<const R: usize>(x: &SuperRows, r: usize, blocks: usize) -> [XRow; R] {
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
    struct XRow {
        q: *const i8,
        d: *const f32,
        s: *const i32,
        /// Sums of 32.
        f: *const f32,
    }

    /// Sixteen bytes at `p` as 32-bit lanes, unsigned or (`SIGNED`) signed.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn lanes<const SIGNED: bool>(p: *const u8) -> __m512i {
        // SAFETY (caller): 16 readable bytes at `p`.
        let v = unsafe { _mm_loadu_si128(p.cast()) };
        if SIGNED {
            _mm512_cvtepi8_epi32(v)
        } else {
            _mm512_cvtepu8_epi32(v)
        }
    }

    /// Part `j` of 8 of the `size` bytes after `tile` (the next super-block's tile, or the
    /// next column's first), asked for ahead: a few lines per sub-block rather than a burst
    /// (see `Ahead`). A pointer past the matrix is only a hint: prefetches never fault.
    #[inline(always)]
    fn ahead(tile: *const u8, size: usize, j: usize) {
        let lines = size.div_ceil(64 * 8);
        for l in 0..lines {
            let p = tile.wrapping_add(size + 64 * (j * lines + l));
            // SAFETY: a prefetch is a hint, never a fault, whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast()) };
        }
    }

    /// `R` rows of `x` against one column of q4_K (or, `FIVE`, q5_K) tiles, as ggml's
    /// q4_K · q8_K: per
    /// sub-block and row of `x`, the eight `vpdpbusd` of a q4_0 block and one integer
    /// multiply by its scales; per super-block, the minima times the sums of `x` in
    /// integers too, then two multiply-adds.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
    pub unsafe fn q4k_rows<const R: usize, const FIVE: bool>(
        tiles: &[u8],
        ops: &[u8],
        x: &SuperRows,
        r: usize,
        y: &mut [[f32; TILE]; 4],
        spread: bool,
    ) {
        let size = if FIVE { q4k::Q5_BYTES } else { q4k::BYTES };
        let nb = tiles.len() / size;
        let xs = super_rows::<R>(x, r, nb);
        let pre = !ops.is_empty();
        assert!(!pre || ops.len() >= nb * 8 * 512);
        let mut acc = [_mm512_setzero_ps(); R];
        for b in 0..nb {
            // SAFETY: tile b is `size` readable bytes, its operands in `ops` when given;
            // super-block b of each row of `x` is in bounds (checked by `super_rows`).
            unsafe {
                let tile = tiles.as_ptr().add(b * size);
                let mut sums = [_mm512_setzero_si512(); R];
                let mut mins = [_mm512_setzero_si512(); R];
                for j in 0..8 {
                    if spread {
                        ahead(tile, size, j);
                    }
                    let sc = lanes::<false>(tile.add(q4k::SC + 16 * j));
                    let m = lanes::<false>(tile.add(q4k::MIN + 16 * j));
                    let w = match pre {
                        true => load8(ops.as_ptr().add((8 * b + j) * 512)),
                        false => q4k_operands::<FIVE>(tile, j),
                    };
                    for i in 0..R {
                        let x = xs[i];
                        let p = x.q.add(b * QK_K + QK * j).cast();
                        let s = dot_groups(&w, p, _mm512_setzero_si512());
                        sums[i] = _mm512_add_epi32(sums[i], _mm512_mullo_epi32(s, sc));
                        let xsum = *x.s.add(16 * b + 2 * j) + *x.s.add(16 * b + 2 * j + 1);
                        let xsum = _mm512_set1_epi32(xsum);
                        mins[i] = _mm512_add_epi32(mins[i], _mm512_mullo_epi32(m, xsum));
                    }
                }
                let d = _mm512_cvtph_ps(_mm256_loadu_si256(tile.cast()));
                let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(tile.add(q4k::DMIN).cast()));
                for i in 0..R {
                    let dx = _mm512_set1_ps(*xs[i].d.add(b));
                    let s = _mm512_cvtepi32_ps(sums[i]);
                    acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), s, acc[i]);
                    let m = _mm512_cvtepi32_ps(mins[i]);
                    acc[i] = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, dx), m, acc[i]);
                }
            }
        }
        for (y, acc) in y.iter_mut().zip(acc) {
            // SAFETY: 16 floats to a [f32; 16].
            unsafe { _mm512_storeu_ps(y.as_mut_ptr(), acc) };
        }
    }

    /// `s[c][i] += Σ_g w[c] group g · x[i] group g` over `groups` (of 4 values) of one
    /// block of 32: two columns' operands at `w` (64 bytes per group), rows of `x` at `x`
    /// (the block's first value). Each 4 bytes of `x` are broadcast into a register once
    /// for both columns (see [`q4k_pair`]).
    #[target_feature(enable = "avx512f,avx512vnni")]
    #[inline]
    unsafe fn pair_groups<const R: usize>(
        w: [*const u8; 2],
        x: [*const i8; R],
        groups: std::ops::Range<usize>,
        s: &mut [[__m512i; R]; 2],
    ) {
        for g in groups {
            // SAFETY (caller): the groups' operands at `w` and values at `x` are readable.
            unsafe {
                let w0 = _mm512_loadu_si512(w[0].add(64 * g).cast());
                let w1 = _mm512_loadu_si512(w[1].add(64 * g).cast());
                for i in 0..R {
                    let v = _mm512_set1_epi32(x[i].add(4 * g).cast::<i32>().read_unaligned());
                    s[0][i] = _mm512_dpbusd_epi32(s[0][i], w0, v);
                    s[1][i] = _mm512_dpbusd_epi32(s[1][i], w1, v);
                }
            }
        }
    }

    /// The two columns' sums of `R` rows into `y`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn store_pair<const R: usize>(y: [&mut [[f32; TILE]; 4]; 2], acc: [[__m512; R]; 2]) {
        for (y, acc) in y.into_iter().zip(acc) {
            for (y, acc) in y.iter_mut().zip(acc) {
                // SAFETY: 16 floats to a [f32; 16].
                unsafe { _mm512_storeu_ps(y.as_mut_ptr(), acc) };
            }
        }
    }

    /// `sums[c][i] += s[c][i] · sc[c] − m[c] · xsum[i]` in f32: a (half) sub-block's
    /// integer sums of two columns scaled, less its minima times the sums of `x`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn scale_pair<const R: usize>(
        s: &[[__m512i; R]; 2],
        (sc, m): ([__m512; 2], [__m512; 2]),
        xsum: [f32; R],
        sums: &mut [[__m512; R]; 2],
    ) {
        for i in 0..R {
            let xsum = _mm512_set1_ps(xsum[i]);
            for c in 0..2 {
                let v = _mm512_cvtepi32_ps(s[c][i]);
                sums[c][i] = _mm512_fmadd_ps(v, sc[c], sums[c][i]);
                sums[c][i] = _mm512_fnmadd_ps(m[c], xsum, sums[c][i]);
            }
        }
    }

    /// `acc[c][i] += sums[c][i] · d_x`: super-block `b`'s sums of two columns times each
    /// row's scale.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn add_scaled<const R: usize>(
        acc: &mut [[__m512; R]; 2],
        sums: &[[__m512; R]; 2],
        xs: &[XRow; R],
        b: usize,
    ) {
        for i in 0..R {
            // SAFETY (caller): super-block b of each row of `x` is in bounds.
            let dx = _mm512_set1_ps(unsafe { *xs[i].d.add(b) });
            for c in 0..2 {
                acc[c][i] = _mm512_fmadd_ps(sums[c][i], dx, acc[c][i]);
            }
        }
    }

    /// `R` rows of `x` against two columns of q4_K or q5_K tiles (of `size` bytes), from
    /// their operands unpacked ahead (a prefill's, `ops`), into `y` (zeroed). Each value
    /// of `x` is broadcast once for both columns: a `vpdpbusd` taking its broadcast from
    /// memory ran at half the rate of one taking it from a register (1 against 1.7-2 per
    /// cycle on an Ice Lake Xeon, whose two vector ports both run them). Per sub-block and
    /// row the sums take a conversion and a multiply-add by the scales as floats, the
    /// minima a multiply-add of the sum of 32 values of `x`: the integer multiplies of
    /// [`q4k_rows`] took two µops each of the ports every `vpdpbusd` needs. (Sums in f32
    /// within a super-block, where ggml's are integers: the same to rounding.)
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
    pub unsafe fn q4k_pair<const R: usize>(
        size: usize,
        tiles: [&[u8]; 2],
        ops: [&[u8]; 2],
        x: &SuperRows,
        r: usize,
        y: [&mut [[f32; TILE]; 4]; 2],
    ) {
        let nb = tiles[0].len() / size;
        assert!(tiles[1].len() >= nb * size);
        assert!(ops[0].len() >= nb * 8 * 512 && ops[1].len() >= nb * 8 * 512);
        let xs = super_rows::<R>(x, r, nb);
        let mut acc = [[_mm512_setzero_ps(); R]; 2];
        for b in 0..nb {
            // SAFETY: tile b of each column is `size` readable bytes and its operands
            // 8 · 512 bytes of `ops` (asserted); super-block b of each row of `x` is in
            // bounds (`super_rows`).
            unsafe {
                let tile = [
                    tiles[0].as_ptr().add(b * size),
                    tiles[1].as_ptr().add(b * size),
                ];
                let (mut d, mut dmin) = ([_mm512_setzero_ps(); 2], [_mm512_setzero_ps(); 2]);
                for c in 0..2 {
                    d[c] = _mm512_cvtph_ps(_mm256_loadu_si256(tile[c].cast()));
                    dmin[c] = _mm512_cvtph_ps(_mm256_loadu_si256(tile[c].add(q4k::DMIN).cast()));
                }
                let mut sums = [[_mm512_setzero_ps(); R]; 2];
                for j in 0..8 {
                    let mut sc = [_mm512_setzero_ps(); 2];
                    let mut m = [_mm512_setzero_ps(); 2];
                    for c in 0..2 {
                        let s = _mm512_cvtepi32_ps(lanes::<false>(tile[c].add(q4k::SC + 16 * j)));
                        sc[c] = _mm512_mul_ps(d[c], s);
                        let v = _mm512_cvtepi32_ps(lanes::<false>(tile[c].add(q4k::MIN + 16 * j)));
                        m[c] = _mm512_mul_ps(dmin[c], v);
                    }
                    let at = (8 * b + j) * 512;
                    let w = [ops[0].as_ptr().add(at), ops[1].as_ptr().add(at)];
                    let mut s = [[_mm512_setzero_si512(); R]; 2];
                    let x = xs.map(|x| x.q.add(b * QK_K + QK * j));
                    pair_groups(w, x, 0..8, &mut s);
                    let mut xsum = [0f32; R];
                    for i in 0..R {
                        xsum[i] = *xs[i].f.add(8 * b + j);
                    }
                    scale_pair(&s, (sc, m), xsum, &mut sums);
                }
                add_scaled(&mut acc, &sums, &xs, b);
            }
        }
        // SAFETY: this function enables AVX-512F, all that `store_pair` needs.
        unsafe { store_pair(y, acc) };
    }

    /// [`q4k_pair`] for q6_K (`Q3`: q3_K): two columns from operands unpacked ahead, each
    /// value of `x` broadcast once for both; per half sub-block (16 values, one scale) and
    /// row the sums start at the offset (32 or 4) times the half's sum of `x`, then take a
    /// conversion and a multiply-add by the scale as a float.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
    pub unsafe fn q6k_pair<const R: usize, const Q3: bool>(
        tiles: [&[u8]; 2],
        ops: [&[u8]; 2],
        x: &SuperRows,
        r: usize,
        y: [&mut [[f32; TILE]; 4]; 2],
    ) {
        let (size, offset) = if Q3 {
            (q3k::BYTES, 4)
        } else {
            (q6k::BYTES, 32)
        };
        let nb = tiles[0].len() / size;
        assert!(tiles[1].len() >= nb * size);
        assert!(ops[0].len() >= nb * 8 * 512 && ops[1].len() >= nb * 8 * 512);
        let xs = super_rows::<R>(x, r, nb);
        let mut acc = [[_mm512_setzero_ps(); R]; 2];
        for b in 0..nb {
            // SAFETY: as in `q4k_pair`.
            unsafe {
                let tile = [
                    tiles[0].as_ptr().add(b * size),
                    tiles[1].as_ptr().add(b * size),
                ];
                let mut d = [_mm512_setzero_ps(); 2];
                for c in 0..2 {
                    d[c] = _mm512_cvtph_ps(_mm256_loadu_si256(tile[c].cast()));
                }
                let mut sums = [[_mm512_setzero_ps(); R]; 2];
                for j in 0..8 {
                    let at = (8 * b + j) * 512;
                    let w = [ops[0].as_ptr().add(at), ops[1].as_ptr().add(at)];
                    for h in 0..2 {
                        // (The scales lie at the same place in both tiles.)
                        let mut sc = [_mm512_setzero_ps(); 2];
                        for c in 0..2 {
                            let s = lanes::<true>(tile[c].add(q6k::SC + 32 * j + 16 * h));
                            sc[c] = _mm512_mul_ps(d[c], _mm512_cvtepi32_ps(s));
                        }
                        let mut s = [[_mm512_setzero_si512(); R]; 2];
                        for i in 0..R {
                            let sum = *xs[i].s.add(16 * b + 2 * j + h);
                            let init = _mm512_set1_epi32(-offset * sum);
                            (s[0][i], s[1][i]) = (init, init);
                        }
                        let x = xs.map(|x| x.q.add(b * QK_K + QK * j));
                        pair_groups(w, x, 4 * h..4 * h + 4, &mut s);
                        for c in 0..2 {
                            for i in 0..R {
                                let v = _mm512_cvtepi32_ps(s[c][i]);
                                sums[c][i] = _mm512_fmadd_ps(v, sc[c], sums[c][i]);
                            }
                        }
                    }
                }
                add_scaled(&mut acc, &sums, &xs, b);
            }
        }
        // SAFETY: this function enables AVX-512F, all that `store_pair` needs.
        unsafe { store_pair(y, acc) };
    }

    /// [`q4k_pair`] for q2_K: per half sub-block (16 values) and row, the sums take the
    /// half's 4-bit scale and its minimum times the half's sum of `x`, as floats.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
    pub unsafe fn q2k_pair<const R: usize>(
        tiles: [&[u8]; 2],
        ops: [&[u8]; 2],
        x: &SuperRows,
        r: usize,
        y: [&mut [[f32; TILE]; 4]; 2],
    ) {
        let nb = tiles[0].len() / q2k::BYTES;
        assert!(tiles[1].len() >= nb * q2k::BYTES);
        assert!(ops[0].len() >= nb * 8 * 512 && ops[1].len() >= nb * 8 * 512);
        let xs = super_rows::<R>(x, r, nb);
        let low = _mm512_set1_epi32(15);
        let mut acc = [[_mm512_setzero_ps(); R]; 2];
        for b in 0..nb {
            // SAFETY: as in `q4k_pair`.
            unsafe {
                let tile = [
                    tiles[0].as_ptr().add(b * q2k::BYTES),
                    tiles[1].as_ptr().add(b * q2k::BYTES),
                ];
                let (mut d, mut dmin) = ([_mm512_setzero_ps(); 2], [_mm512_setzero_ps(); 2]);
                for c in 0..2 {
                    d[c] = _mm512_cvtph_ps(_mm256_loadu_si256(tile[c].cast()));
                    dmin[c] = _mm512_cvtph_ps(_mm256_loadu_si256(tile[c].add(q2k::DMIN).cast()));
                }
                let mut sums = [[_mm512_setzero_ps(); R]; 2];
                for j in 0..8 {
                    let at = (8 * b + j) * 512;
                    let w = [ops[0].as_ptr().add(at), ops[1].as_ptr().add(at)];
                    for h in 0..2 {
                        // Scale in the low nibble, minimum in the high one, a lane per row.
                        let (mut sc, mut m) = ([_mm512_setzero_ps(); 2], [_mm512_setzero_ps(); 2]);
                        for c in 0..2 {
                            let v = lanes::<false>(tile[c].add(q2k::SC + 32 * j + 16 * h));
                            let scale = _mm512_cvtepi32_ps(_mm512_and_si512(v, low));
                            sc[c] = _mm512_mul_ps(d[c], scale);
                            let min = _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(v));
                            m[c] = _mm512_mul_ps(dmin[c], min);
                        }
                        let mut s = [[_mm512_setzero_si512(); R]; 2];
                        let x = xs.map(|x| x.q.add(b * QK_K + QK * j));
                        pair_groups(w, x, 4 * h..4 * h + 4, &mut s);
                        let mut xsum = [0f32; R];
                        for i in 0..R {
                            xsum[i] = *xs[i].s.add(16 * b + 2 * j + h) as f32;
                        }
                        scale_pair(&s, (sc, m), xsum, &mut sums);
                    }
                }
                add_scaled(&mut acc, &sums, &xs, b);
            }
        }
        // SAFETY: this function enables AVX-512F, all that `store_pair` needs.
        unsafe { store_pair(y, acc) };
    }

    /// `R` rows of `x` against one column of q6_K (`Q3`: q3_K) tiles, as ggml's q6_K ·
    /// q8_K (q3_K · q8_K): per block of 32 and row of `x`, eight `vpdpbusd` in two halves
    /// of 16 values (each less the offset, 32 or 4, times the half's sum of `x`) and an
    /// integer multiply of each by its scales; per super-block one multiply-add. The
    /// operands are built once for the `R` rows.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
    pub unsafe fn q6k_rows<const R: usize, const Q3: bool>(
        tiles: &[u8],
        ops: &[u8],
        x: &SuperRows,
        r: usize,
        y: &mut [[f32; TILE]; 4],
        spread: bool,
    ) {
        // (The scales lie at the same place in both tiles: q6k::SC == q3k::SC.)
        let (size, offset) = if Q3 {
            (q3k::BYTES, 4)
        } else {
            (q6k::BYTES, 32)
        };
        let nb = tiles.len() / size;
        let xs = super_rows::<R>(x, r, nb);
        let pre = !ops.is_empty();
        assert!(!pre || ops.len() >= nb * 8 * 512);
        let mut acc = [_mm512_setzero_ps(); R];
        for b in 0..nb {
            // SAFETY: tile b is `size` readable bytes, its operands in `ops` when given;
            // super-block b of each row of `x` is in bounds (`super_rows`).
            unsafe {
                let tile = tiles.as_ptr().add(b * size);
                let mut sums = [_mm512_setzero_si512(); R];
                for j in 0..8 {
                    if spread {
                        ahead(tile, size, j);
                    }
                    let w = match (pre, Q3) {
                        (true, _) => load8(ops.as_ptr().add((8 * b + j) * 512)),
                        (false, true) => q3k_operands(tile, j),
                        (false, false) => q6k_operands(tile, j),
                    };
                    let sc_lo = lanes::<true>(tile.add(q6k::SC + 32 * j));
                    let sc_hi = lanes::<true>(tile.add(q6k::SC + 32 * j + 16));
                    for i in 0..R {
                        let x = xs[i];
                        let p = x.q.add(b * QK_K + QK * j).cast::<i32>();
                        let s = x.s.add(16 * b + 2 * j);
                        let lo = dot_groups(&w[..4], p, _mm512_set1_epi32(-offset * *s));
                        let hi =
                            dot_groups(&w[4..], p.add(4), _mm512_set1_epi32(-offset * *s.add(1)));
                        let sum = _mm512_add_epi32(
                            _mm512_mullo_epi32(lo, sc_lo),
                            _mm512_mullo_epi32(hi, sc_hi),
                        );
                        sums[i] = _mm512_add_epi32(sums[i], sum);
                    }
                }
                let d = _mm512_cvtph_ps(_mm256_loadu_si256(tile.cast()));
                for i in 0..R {
                    let dx = _mm512_set1_ps(*xs[i].d.add(b));
                    let s = _mm512_cvtepi32_ps(sums[i]);
                    acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), s, acc[i]);
                }
            }
        }
        for (y, acc) in y.iter_mut().zip(acc) {
            // SAFETY: 16 floats to a [f32; 16].
            unsafe { _mm512_storeu_ps(y.as_mut_ptr(), acc) };
        }
    }

    /// `R` rows of `x` against one column of q2_K tiles, as ggml's q2_K · q8_K: per block
    /// of 32 and row of `x`, eight `vpdpbusd` in two halves of 16 values, each multiplied
    /// by its 4-bit scale as an integer, and the halves' sums of `x` by their minima; per
    /// super-block two multiply-adds.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
    pub unsafe fn q2k_rows<const R: usize>(
        tiles: &[u8],
        x: &SuperRows,
        r: usize,
        y: &mut [[f32; TILE]; 4],
        spread: bool,
    ) {
        let nb = tiles.len() / q2k::BYTES;
        let xs = super_rows::<R>(x, r, nb);
        let low = _mm512_set1_epi32(15);
        let mut acc = [_mm512_setzero_ps(); R];
        for b in 0..nb {
            // SAFETY: tile b is `q2k::BYTES` readable bytes; super-block b of each row of
            // `x` is in bounds (checked by `super_rows`).
            unsafe {
                let tile = tiles.as_ptr().add(b * q2k::BYTES);
                let mut sums = [_mm512_setzero_si512(); R];
                let mut mins = [_mm512_setzero_si512(); R];
                for j in 0..8 {
                    if spread {
                        ahead(tile, q2k::BYTES, j);
                    }
                    let w = bit_pairs(tile.add(q2k::QL + 128 * j));
                    // Scale in the low nibble, minimum in the high one, a lane per row.
                    let s_lo = lanes::<false>(tile.add(q2k::SC + 32 * j));
                    let s_hi = lanes::<false>(tile.add(q2k::SC + 32 * j + 16));
                    let (sc_lo, sc_hi) = (_mm512_and_si512(s_lo, low), _mm512_and_si512(s_hi, low));
                    let (m_lo, m_hi) = (_mm512_srli_epi32::<4>(s_lo), _mm512_srli_epi32::<4>(s_hi));
                    for i in 0..R {
                        let x = xs[i];
                        let p = x.q.add(b * QK_K + QK * j).cast::<i32>();
                        let s = x.s.add(16 * b + 2 * j);
                        let lo = dot_groups(&w[..4], p, _mm512_setzero_si512());
                        let hi = dot_groups(&w[4..], p.add(4), _mm512_setzero_si512());
                        let sum = _mm512_add_epi32(
                            _mm512_mullo_epi32(lo, sc_lo),
                            _mm512_mullo_epi32(hi, sc_hi),
                        );
                        sums[i] = _mm512_add_epi32(sums[i], sum);
                        let m = _mm512_add_epi32(
                            _mm512_mullo_epi32(m_lo, _mm512_set1_epi32(*s)),
                            _mm512_mullo_epi32(m_hi, _mm512_set1_epi32(*s.add(1))),
                        );
                        mins[i] = _mm512_add_epi32(mins[i], m);
                    }
                }
                let d = _mm512_cvtph_ps(_mm256_loadu_si256(tile.cast()));
                let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(tile.add(q2k::DMIN).cast()));
                for i in 0..R {
                    let dx = _mm512_set1_ps(*xs[i].d.add(b));
                    let s = _mm512_cvtepi32_ps(sums[i]);
                    acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), s, acc[i]);
                    let m = _mm512_cvtepi32_ps(mins[i]);
                    acc[i] = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, dx), m, acc[i]);
                }
            }
        }
        for (y, acc) in y.iter_mut().zip(acc) {
            // SAFETY: 16 floats to a [f32; 16].
            unsafe { _mm512_storeu_ps(y.as_mut_ptr(), acc) };
        }
    }

    /// [`legacy_rows`] for a prefill: `R` rows of `x` against two columns of tiles from
    /// their operands unpacked ahead (`ops`), each value of `x` broadcast once into a
    /// register for both (as [`q4k_pair`]).
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
    pub unsafe fn legacy_pair<const R: usize, const BITS: u8, const MIN: bool>(
        tiles: [&[u8]; 2],
        ops: [&[u8]; 2],
        x: &QRows,
        r: usize,
        y: [&mut [[f32; TILE]; 4]; 2],
    ) {
        let head = if MIN { 2 * SCALES } else { SCALES };
        let (size, offset) = match (BITS, MIN) {
            (4, false) => (head + 256, 8),
            (5, false) => (head + 256 + 64, 16),
            (4, true) => (head + 256, 0),
            (5, true) => (head + 256 + 64, 0),
            _ => (head + 512, 128),
        };
        let nb = tiles[0].len() / size;
        assert!(tiles[1].len() >= nb * size);
        assert!(ops[0].len() >= nb * 512 && ops[1].len() >= nb * 512);
        let mut xq = [std::ptr::null::<i8>(); R];
        let mut xd = [std::ptr::null::<f32>(); R];
        let mut xs = [std::ptr::null::<i32>(); R];
        for j in 0..R {
            let (q, d, s) = x.row(r + j);
            assert!(q.len() >= nb * QK && d.len() >= nb && s.len() >= nb);
            (xq[j], xd[j], xs[j]) = (q.as_ptr(), d.as_ptr(), s.as_ptr());
        }
        let mut acc = [[_mm512_setzero_ps(); R]; 2];
        for b in 0..nb {
            // SAFETY: tile b of each column is `size` readable bytes and its operands 512
            // bytes of `ops`; block b of each row of `x` is in bounds (asserted above).
            unsafe {
                let tile = [
                    tiles[0].as_ptr().add(b * size),
                    tiles[1].as_ptr().add(b * size),
                ];
                let (mut d, mut m) = ([_mm512_setzero_ps(); 2], [_mm512_setzero_ps(); 2]);
                for c in 0..2 {
                    d[c] = _mm512_cvtph_ps(_mm256_loadu_si256(tile[c].cast()));
                    m[c] = _mm512_cvtph_ps(_mm256_loadu_si256(tile[c].add(SCALES).cast()));
                }
                let w = [ops[0].as_ptr().add(b * 512), ops[1].as_ptr().add(b * 512)];
                let mut s = [[_mm512_setzero_si512(); R]; 2];
                for i in 0..R {
                    // The operands' offset times the sum of `x`, shared by both columns.
                    let init = _mm512_set1_epi32(-offset * *xs[i].add(b));
                    (s[0][i], s[1][i]) = (init, init);
                }
                pair_groups(w, xq.map(|x| x.add(b * QK)), 0..8, &mut s);
                for i in 0..R {
                    let dx = _mm512_set1_ps(*xd[i].add(b));
                    let xsum = _mm512_set1_ps(*xd[i].add(b) * *xs[i].add(b) as f32);
                    for c in 0..2 {
                        let v = _mm512_cvtepi32_ps(s[c][i]);
                        acc[c][i] = _mm512_fmadd_ps(v, _mm512_mul_ps(d[c], dx), acc[c][i]);
                        if MIN {
                            acc[c][i] = _mm512_fmadd_ps(m[c], xsum, acc[c][i]);
                        }
                    }
                }
            }
        }
        // SAFETY: this function enables AVX-512F, all that `store_pair` needs.
        unsafe { store_pair(y, acc) };
    }

    /// `R` rows of `x` (from row `r`) against `T` columns of tiles of `BITS`-bit values
    /// (q8_0, q4_0 or q5_0; with `MIN`, q4_1 or q5_1). Per block, tile and row of `x`:
    /// eight `vpdpbusd` (in two chains), one conversion and one multiply-add (two with
    /// minima); each tile's operands are loaded (and unpacked) once for the `R` rows. Two
    /// columns are read block by block together, two streams through memory where one
    /// left the reads waiting on each other (decoding GPT-2 124M q8_0 +13%, SmolLM-135M
    /// +8%, paired rounds).
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
    pub unsafe fn legacy_rows<const R: usize, const BITS: u8, const MIN: bool, const T: usize>(
        tiles: [&[u8]; T],
        ops: &[u8],
        x: &QRows,
        r: usize,
        y: [&mut [[f32; TILE]; 4]; T],
    ) {
        // Bytes before the nibbles (the scales, and the minima), and per tile.
        let head = if MIN { 2 * SCALES } else { SCALES };
        let (size, offset) = match (BITS, MIN) {
            (4, false) => (head + 256, 8),
            (5, false) => (head + 256 + 64, 16),
            (4, true) => (head + 256, 0),
            (5, true) => (head + 256 + 64, 0),
            _ => (head + 512, 128),
        };
        let nb = tiles[0].len() / size;
        assert!(tiles.iter().all(|t| t.len() >= nb * size));
        // Operands unpacked ahead (a prefill's) come for one column.
        let pre = !ops.is_empty();
        assert!(!pre || (T == 1 && ops.len() >= nb * 512));
        let mut xq = [std::ptr::null::<i8>(); R];
        let mut xd = [std::ptr::null::<f32>(); R];
        let mut xs = [std::ptr::null::<i32>(); R];
        for j in 0..R {
            let (q, d, s) = x.row(r + j);
            assert!(q.len() >= nb * QK && d.len() >= nb && s.len() >= nb);
            (xq[j], xd[j], xs[j]) = (q.as_ptr(), d.as_ptr(), s.as_ptr());
        }
        let mut acc = [[_mm512_setzero_ps(); R]; T];
        for b in 0..nb {
            for (t, tiles) in tiles.iter().enumerate() {
                // SAFETY: tile b of each column is `size` readable bytes; block b of each
                // row of `x` is in bounds (asserted above).
                unsafe {
                    let tile = tiles.as_ptr().add(b * size);
                    let d = _mm512_cvtph_ps(_mm256_loadu_si256(tile.cast()));
                    let m = _mm512_cvtph_ps(_mm256_loadu_si256(tile.add(SCALES).cast()));
                    // w[g] pairs with values 4g..4g+3 of `x`'s block.
                    let w = match pre {
                        true => load8(ops.as_ptr().add(b * 512)),
                        false => legacy_operands::<BITS>(tile.add(head)),
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
                        let dx = *xd[j].add(b);
                        acc[t][j] =
                            _mm512_fmadd_ps(s, _mm512_mul_ps(d, _mm512_set1_ps(dx)), acc[t][j]);
                        if MIN {
                            let xsum = _mm512_set1_ps(dx * *xs[j].add(b) as f32);
                            acc[t][j] = _mm512_fmadd_ps(m, xsum, acc[t][j]);
                        }
                    }
                }
            }
        }
        for (y, acc) in y.into_iter().zip(acc) {
            for j in 0..R {
                // SAFETY: 16 floats to a [f32; 16].
                unsafe { _mm512_storeu_ps(y[j].as_mut_ptr(), acc[j]) };
            }
        }
    }
    /// Bit `g` of each byte of `plane` moved to bit 4, the others cleared: the fifth bits
    /// of group `g`'s operands (see `Format::operand`). (Shifts of 16-bit lanes: bit 4 of
    /// each byte comes from the same byte, for shifts of at most 4 left and 3 right.)
    #[target_feature(enable = "avx2")]
    #[inline]
    fn fifth_bits_avx2(plane: __m256i, g: usize) -> __m256i {
        let v = match g {
            0 => _mm256_slli_epi16::<4>(plane),
            1 => _mm256_slli_epi16::<3>(plane),
            2 => _mm256_slli_epi16::<2>(plane),
            3 => _mm256_slli_epi16::<1>(plane),
            4 => plane,
            5 => _mm256_srli_epi16::<1>(plane),
            6 => _mm256_srli_epi16::<2>(plane),
            _ => _mm256_srli_epi16::<3>(plane),
        };
        _mm256_and_si256(v, _mm256_set1_epi8(0x10))
    }

    /// Bit `g` of each byte of `plane` moved to bit 2, the others cleared: the third bits of
    /// group `g`'s q3_K operands (shifts as in [`fifth_bits_avx2`]: at most 2 left, 5 right).
    #[target_feature(enable = "avx2")]
    #[inline]
    fn third_bits_avx2(plane: __m256i, g: usize) -> __m256i {
        let v = match g {
            0 => _mm256_slli_epi16::<2>(plane),
            1 => _mm256_slli_epi16::<1>(plane),
            2 => plane,
            3 => _mm256_srli_epi16::<1>(plane),
            4 => _mm256_srli_epi16::<2>(plane),
            5 => _mm256_srli_epi16::<3>(plane),
            6 => _mm256_srli_epi16::<4>(plane),
            _ => _mm256_srli_epi16::<5>(plane),
        };
        _mm256_and_si256(v, _mm256_set1_epi8(0x04))
    }

    /// The bit planes of one half of a block for [`half_operands`]: the 32 bytes at `plane`
    /// (`BITS` 3 and 5), and at `plane + 64` (6).
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn half_planes<const BITS: u8>(plane: *const u8) -> [__m256i; 2] {
        // SAFETY (caller): as above.
        unsafe {
            match BITS {
                3 | 5 => [_mm256_loadu_si256(plane.cast()), _mm256_setzero_si256()],
                6 => [
                    _mm256_loadu_si256(plane.cast()),
                    _mm256_loadu_si256(plane.add(64).cast()),
                ],
                _ => [_mm256_setzero_si256(); 2],
            }
        }
    }

    /// The unsigned operands of groups `2c` and `2c + 1` of one half of a block (values
    /// `8c..8c + 3` and `8c + 4..8c + 7` of its eight rows), laid out as [`half_sums`]
    /// says, with the planes from [`half_planes`].
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn half_operands<const BITS: u8>(
        q: *const u8,
        planes: [__m256i; 2],
        c: usize,
    ) -> (__m256i, __m256i) {
        let mask = _mm256_set1_epi8(0x0f);
        // SAFETY (caller): 32 readable bytes at `q + 64c` (or `q + 64(c / 2)`).
        let (mut lo, mut hi) = unsafe {
            match BITS {
                2 | 3 => {
                    let v = _mm256_loadu_si256(q.add(64 * (c / 2)).cast());
                    let (l, h) = match c % 2 {
                        0 => (v, _mm256_srli_epi16::<2>(v)),
                        _ => (_mm256_srli_epi16::<4>(v), _mm256_srli_epi16::<6>(v)),
                    };
                    let pair = _mm256_set1_epi8(3);
                    (_mm256_and_si256(l, pair), _mm256_and_si256(h, pair))
                }
                _ => {
                    let v = _mm256_loadu_si256(q.add(64 * c).cast());
                    (
                        _mm256_and_si256(v, mask),
                        _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask),
                    )
                }
            }
        };
        if BITS == 3 {
            lo = _mm256_or_si256(lo, third_bits_avx2(planes[0], 2 * c));
            hi = _mm256_or_si256(hi, third_bits_avx2(planes[0], 2 * c + 1));
        }
        if BITS == 5 {
            lo = _mm256_or_si256(lo, fifth_bits_avx2(planes[0], 2 * c));
            hi = _mm256_or_si256(hi, fifth_bits_avx2(planes[0], 2 * c + 1));
        }
        if BITS == 6 {
            // Bits 2f..2f + 1 of plane c / 2 go to bits 4..5 of group 4(c / 2) + f.
            let (p, two) = (planes[c / 2], _mm256_set1_epi8(0x30));
            let (l, h) = match c % 2 {
                0 => (_mm256_slli_epi16::<4>(p), _mm256_slli_epi16::<2>(p)),
                _ => (p, _mm256_srli_epi16::<2>(p)),
            };
            lo = _mm256_or_si256(lo, _mm256_and_si256(l, two));
            hi = _mm256_or_si256(hi, _mm256_and_si256(h, two));
        }
        (lo, hi)
    }

    /// Every operand of one column of `format` tiles with bit planes (q5_0, q5_1, q5_K,
    /// q6_K, q3_K) into `ops`, 512 bytes per block of 32 values (per half, per group pair
    /// `c`, the two groups' 32 bytes), as [`half_operands`] builds them: unpacked once for
    /// all the rows of `x` of a prefill instead of once per four rows.
    #[target_feature(enable = "avx2")]
    pub unsafe fn unpack_avx2(format: Format, tiles: &[u8], ops: &mut [u8]) {
        let size = format.tile_bytes();
        let per_tile = format.values() / QK;
        assert!(ops.len() >= tiles.len() / size * per_tile * 512);
        for (b, tile) in tiles.chunks_exact(size).enumerate() {
            for j in 0..per_tile {
                // (q, plane) of this block of 32: where its low bits and its planes start.
                let (q, plane, bits) = match format {
                    Format::Q5_0 | Format::Q5_1 => {
                        let at = format.nibbles();
                        (at, at + 256, 5)
                    }
                    Format::Q5K => (q4k::QS + 256 * j, q4k::BYTES + 64 * j, 5),
                    Format::Q6K => (q6k::QL + 256 * j, q6k::QH + 128 * j, 6),
                    Format::Q3K => (q3k::QL + 128 * j, q3k::QH + 64 * j, 3),
                    _ => unreachable!("{format:?} tiles have no planes to unpack"),
                };
                for h in 0..2 {
                    let out = &mut ops[(b * per_tile + j) * 512 + 256 * h..][..256];
                    // SAFETY: the tile holds its values and planes at these offsets (half
                    // h: 32 bytes further); 256 bytes of `ops` at `out`.
                    unsafe {
                        let out = out.as_mut_ptr();
                        let (q, plane) = (
                            tile.as_ptr().add(q + 32 * h),
                            tile.as_ptr().add(plane + 32 * h),
                        );
                        for c in 0..4 {
                            let (lo, hi) = match bits {
                                3 => half_operands::<3>(q, half_planes::<3>(plane), c),
                                5 => half_operands::<5>(q, half_planes::<5>(plane), c),
                                _ => half_operands::<6>(q, half_planes::<6>(plane), c),
                            };
                            _mm256_storeu_si256(out.add(64 * c).cast(), lo);
                            _mm256_storeu_si256(out.add(64 * c + 32).cast(), hi);
                        }
                    }
                }
            }
        }
    }

    /// For each of `R` rows of `x` (a block of 32 values at `xp[j]`), the integer sums
    /// `Σ u · x` of one half of a tile's block (rows 0–7 or 8–15 in the eight lanes), its
    /// values 0–15 in the first vector and 16–31 in the second (`BITS` 2, 3 and 6, whose
    /// halves have their own scales) or all in the first (4, 5). The four-bit formats' low
    /// bits lie as a q4_0 tile's nibbles, this half's 32 bytes of each group's 64 at
    /// `q + 64c`; `BITS` 5 or-s in bit 4 from the 32 bytes at `plane` (q5_0's layout), 6
    /// bits 4–5 from those at `plane` and `plane + 64` (q6_K's). Two- and three-bit values
    /// lie as bit pairs, group `4h + f` at bits `2f..2f + 1` of the bytes at `q + 64h`, and 3
    /// or-s in bit 2 from `plane` (q3_K's). Per group of four values, `vpmaddubsw` of the
    /// unsigned operands by `x` (pairs of products: at most 2·15·127, 2·31·127, 2·63·127),
    /// summed in i16 over as many groups as cannot overflow (8, 4, 2) before a `vpmaddwd`
    /// into i32.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn half_sums<const R: usize, const BITS: u8>(
        q: *const u8,
        plane: *const u8,
        pre: *const u8,
        xp: [*const i8; R],
    ) -> [[__m256i; R]; 2] {
        let ones = _mm256_set1_epi16(1);
        let mut s32 = [[_mm256_setzero_si256(); R]; 2];
        let mut s16 = [_mm256_setzero_si256(); R];
        // SAFETY (caller): 32 readable bytes at `q + 64c` (c < 4), at `plane` (`BITS` 5)
        // and at `plane + 64` (6), or 256 at `pre` when it is not null; 32 values of `x` at
        // each `xp[j]`.
        unsafe {
            let planes = match pre.is_null() {
                true => half_planes::<BITS>(plane),
                false => [_mm256_setzero_si256(); 2],
            };
            for c in 0..4 {
                let (lo, hi) = match pre.is_null() {
                    true => half_operands::<BITS>(q, planes, c),
                    false => (
                        _mm256_loadu_si256(pre.add(64 * c).cast()),
                        _mm256_loadu_si256(pre.add(64 * c + 32).cast()),
                    ),
                };
                for j in 0..R {
                    let p = xp[j].add(8 * c).cast::<i32>();
                    let x0 = _mm256_set1_epi32(p.read_unaligned());
                    let x1 = _mm256_set1_epi32(p.add(1).read_unaligned());
                    s16[j] = _mm256_add_epi16(
                        s16[j],
                        _mm256_add_epi16(
                            _mm256_maddubs_epi16(lo, x0),
                            _mm256_maddubs_epi16(hi, x1),
                        ),
                    );
                }
                let flush = match BITS {
                    4 => c == 3,
                    6 => true,
                    _ => c % 2 == 1,
                };
                if flush {
                    let half = if matches!(BITS, 4 | 5) { 0 } else { c / 2 };
                    for j in 0..R {
                        let s = _mm256_madd_epi16(s16[j], ones);
                        s32[half][j] = _mm256_add_epi32(s32[half][j], s);
                        s16[j] = _mm256_setzero_si256();
                    }
                }
            }
        }
        s32
    }

    /// Eight bytes at `p` as 32-bit lanes, unsigned or (`SIGNED`) signed: one half's
    /// scales.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn lanes8<const SIGNED: bool>(p: *const u8) -> __m256i {
        // SAFETY (caller): 8 readable bytes at `p`.
        let v = unsafe { _mm_loadl_epi64(p.cast()) };
        if SIGNED {
            _mm256_cvtepi8_epi32(v)
        } else {
            _mm256_cvtepu8_epi32(v)
        }
    }

    /// [`q4k_rows`] for CPUs with AVX2 alone: per sub-block and row of `x`, a
    /// [`half_sums`] and an integer multiply by the scales; the minima times the sums of
    /// `x` per super-block in integers, then two multiply-adds. Halves of the tiles one
    /// after the other, as in [`legacy_rows_avx2`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn q4k_rows_avx2<const R: usize, const FIVE: bool>(
        tiles: &[u8],
        ops: &[u8],
        x: &SuperRows,
        r: usize,
        y: &mut [[f32; TILE]; 4],
    ) {
        let size = if FIVE { q4k::Q5_BYTES } else { q4k::BYTES };
        let nb = tiles.len() / size;
        let xs = super_rows::<R>(x, r, nb);
        assert!(ops.is_empty() || (FIVE && ops.len() >= nb * 8 * 512));
        for h in 0..2 {
            let mut acc = [_mm256_setzero_ps(); R];
            for b in 0..nb {
                // SAFETY: tile b is `size` readable bytes; super-block b of each row of
                // `x` is in bounds (checked by `super_rows`).
                unsafe {
                    let tile = tiles.as_ptr().add(b * size);
                    let mut sums = [_mm256_setzero_si256(); R];
                    let mut mins = [_mm256_setzero_si256(); R];
                    for j in 0..8 {
                        let xp = xs.map(|x| x.q.add(b * QK_K + QK * j));
                        let q = tile.add(q4k::QS + 256 * j + 32 * h);
                        let pre = match ops.is_empty() {
                            true => std::ptr::null(),
                            false => ops.as_ptr().add(512 * (8 * b + j) + 256 * h),
                        };
                        let plane = tile.add(q4k::BYTES + 64 * j + 32 * h);
                        let [s, _] = match FIVE {
                            true => half_sums::<R, 5>(q, plane, pre, xp),
                            false => half_sums::<R, 4>(q, std::ptr::null(), pre, xp),
                        };
                        let sc = lanes8::<false>(tile.add(q4k::SC + 16 * j + 8 * h));
                        let m = lanes8::<false>(tile.add(q4k::MIN + 16 * j + 8 * h));
                        for i in 0..R {
                            sums[i] = _mm256_add_epi32(sums[i], _mm256_mullo_epi32(s[i], sc));
                            let x = xs[i];
                            let xsum = *x.s.add(16 * b + 2 * j) + *x.s.add(16 * b + 2 * j + 1);
                            let xsum = _mm256_set1_epi32(xsum);
                            mins[i] = _mm256_add_epi32(mins[i], _mm256_mullo_epi32(m, xsum));
                        }
                    }
                    let d = _mm256_cvtph_ps(_mm_loadu_si128(tile.add(16 * h).cast()));
                    let dmin =
                        _mm256_cvtph_ps(_mm_loadu_si128(tile.add(q4k::DMIN + 16 * h).cast()));
                    for i in 0..R {
                        let dx = _mm256_set1_ps(*xs[i].d.add(b));
                        let s = _mm256_cvtepi32_ps(sums[i]);
                        acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), s, acc[i]);
                        let m = _mm256_cvtepi32_ps(mins[i]);
                        acc[i] = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, dx), m, acc[i]);
                    }
                }
            }
            for (y, acc) in y.iter_mut().zip(acc) {
                // SAFETY: 8 floats to the half of a [f32; 16].
                unsafe { _mm256_storeu_ps(y[8 * h..].as_mut_ptr(), acc) };
            }
        }
    }

    /// [`q6k_rows`] for CPUs with AVX2 alone, q6_K (or, `Q3`, q3_K): per block of 32 and
    /// row of `x`, the [`half_sums`] of its two halves of 16 values, each less the offset
    /// (32, 4) times the half's sum of `x` and multiplied by its scales as integers; per
    /// super-block one multiply-add.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn q6k_rows_avx2<const R: usize, const Q3: bool>(
        tiles: &[u8],
        ops: &[u8],
        x: &SuperRows,
        r: usize,
        y: &mut [[f32; TILE]; 4],
    ) {
        // (The scales lie at the same place in both tiles: q6k::SC == q3k::SC.)
        let (size, offset) = if Q3 {
            (q3k::BYTES, 4)
        } else {
            (q6k::BYTES, 32)
        };
        let nb = tiles.len() / size;
        let xs = super_rows::<R>(x, r, nb);
        assert!(ops.is_empty() || ops.len() >= nb * 8 * 512);
        for h in 0..2 {
            let mut acc = [_mm256_setzero_ps(); R];
            for b in 0..nb {
                // SAFETY: tile b is `size` readable bytes; super-block b of each row of `x`
                // is in bounds (checked by `super_rows`).
                unsafe {
                    let tile = tiles.as_ptr().add(b * size);
                    let mut sums = [_mm256_setzero_si256(); R];
                    for j in 0..8 {
                        let xp = xs.map(|x| x.q.add(b * QK_K + QK * j));
                        let pre = match ops.is_empty() {
                            true => std::ptr::null(),
                            false => ops.as_ptr().add(512 * (8 * b + j) + 256 * h),
                        };
                        let [lo, hi] = match Q3 {
                            true => half_sums::<R, 3>(
                                tile.add(q3k::QL + 128 * j + 32 * h),
                                tile.add(q3k::QH + 64 * j + 32 * h),
                                pre,
                                xp,
                            ),
                            false => half_sums::<R, 6>(
                                tile.add(q6k::QL + 256 * j + 32 * h),
                                tile.add(q6k::QH + 128 * j + 32 * h),
                                pre,
                                xp,
                            ),
                        };
                        let sc_lo = lanes8::<true>(tile.add(q6k::SC + 32 * j + 8 * h));
                        let sc_hi = lanes8::<true>(tile.add(q6k::SC + 32 * j + 16 + 8 * h));
                        for i in 0..R {
                            let s = xs[i].s.add(16 * b + 2 * j);
                            let lo = _mm256_add_epi32(lo[i], _mm256_set1_epi32(-offset * *s));
                            let hi =
                                _mm256_add_epi32(hi[i], _mm256_set1_epi32(-offset * *s.add(1)));
                            let sum = _mm256_add_epi32(
                                _mm256_mullo_epi32(lo, sc_lo),
                                _mm256_mullo_epi32(hi, sc_hi),
                            );
                            sums[i] = _mm256_add_epi32(sums[i], sum);
                        }
                    }
                    let d = _mm256_cvtph_ps(_mm_loadu_si128(tile.add(16 * h).cast()));
                    for i in 0..R {
                        let dx = _mm256_set1_ps(*xs[i].d.add(b));
                        let s = _mm256_cvtepi32_ps(sums[i]);
                        acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), s, acc[i]);
                    }
                }
            }
            for (y, acc) in y.iter_mut().zip(acc) {
                // SAFETY: 8 floats to the half of a [f32; 16].
                unsafe { _mm256_storeu_ps(y[8 * h..].as_mut_ptr(), acc) };
            }
        }
    }

    /// [`q2k_rows`] for CPUs with AVX2 alone: per block of 32 and row of `x`, the
    /// [`half_sums`] of its two halves of 16 values, each multiplied by its 4-bit scale as
    /// an integer, and the halves' sums of `x` by their minima; per super-block two
    /// multiply-adds.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn q2k_rows_avx2<const R: usize>(
        tiles: &[u8],
        x: &SuperRows,
        r: usize,
        y: &mut [[f32; TILE]; 4],
    ) {
        let nb = tiles.len() / q2k::BYTES;
        let xs = super_rows::<R>(x, r, nb);
        let low = _mm256_set1_epi32(15);
        for h in 0..2 {
            let mut acc = [_mm256_setzero_ps(); R];
            for b in 0..nb {
                // SAFETY: tile b is `q2k::BYTES` readable bytes; super-block b of each row
                // of `x` is in bounds (checked by `super_rows`).
                unsafe {
                    let tile = tiles.as_ptr().add(b * q2k::BYTES);
                    let mut sums = [_mm256_setzero_si256(); R];
                    let mut mins = [_mm256_setzero_si256(); R];
                    for j in 0..8 {
                        let xp = xs.map(|x| x.q.add(b * QK_K + QK * j));
                        let q = tile.add(q2k::QL + 128 * j + 32 * h);
                        let [lo, hi] = half_sums::<R, 2>(q, std::ptr::null(), std::ptr::null(), xp);
                        // Scale in the low nibble, minimum in the high one, a lane per row.
                        let s_lo = lanes8::<false>(tile.add(q2k::SC + 32 * j + 8 * h));
                        let s_hi = lanes8::<false>(tile.add(q2k::SC + 32 * j + 16 + 8 * h));
                        let (sc_lo, sc_hi) =
                            (_mm256_and_si256(s_lo, low), _mm256_and_si256(s_hi, low));
                        let (m_lo, m_hi) =
                            (_mm256_srli_epi32::<4>(s_lo), _mm256_srli_epi32::<4>(s_hi));
                        for i in 0..R {
                            let s = xs[i].s.add(16 * b + 2 * j);
                            let sum = _mm256_add_epi32(
                                _mm256_mullo_epi32(lo[i], sc_lo),
                                _mm256_mullo_epi32(hi[i], sc_hi),
                            );
                            sums[i] = _mm256_add_epi32(sums[i], sum);
                            let m = _mm256_add_epi32(
                                _mm256_mullo_epi32(m_lo, _mm256_set1_epi32(*s)),
                                _mm256_mullo_epi32(m_hi, _mm256_set1_epi32(*s.add(1))),
                            );
                            mins[i] = _mm256_add_epi32(mins[i], m);
                        }
                    }
                    let d = _mm256_cvtph_ps(_mm_loadu_si128(tile.add(16 * h).cast()));
                    let dmin =
                        _mm256_cvtph_ps(_mm_loadu_si128(tile.add(q2k::DMIN + 16 * h).cast()));
                    for i in 0..R {
                        let dx = _mm256_set1_ps(*xs[i].d.add(b));
                        let s = _mm256_cvtepi32_ps(sums[i]);
                        acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), s, acc[i]);
                        let m = _mm256_cvtepi32_ps(mins[i]);
                        acc[i] = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, dx), m, acc[i]);
                    }
                }
            }
            for (y, acc) in y.iter_mut().zip(acc) {
                // SAFETY: 8 floats to the half of a [f32; 16].
                unsafe { _mm256_storeu_ps(y[8 * h..].as_mut_ptr(), acc) };
            }
        }
    }

    /// [`legacy_rows`] for CPUs with AVX2 alone, q4_0 and q5_0 (or, `MIN`, q4_1 and q5_1)
    /// tiles, with [`half_sums`] in place of `vpdpbusd`. A half of a tile (rows 0–7 or
    /// 8–15: 32 bytes of each group's 64) is one register per row of `x`; the halves go
    /// one after the other over the whole column, the second from L1, so that four rows of
    /// `x` come near fitting the 16 registers.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn legacy_rows_avx2<
        const R: usize,
        const BITS: u8,
        const MIN: bool,
        const T: usize,
    >(
        tiles: [&[u8]; T],
        ops: &[u8],
        x: &QRows,
        r: usize,
        y: [&mut [[f32; TILE]; 4]; T],
    ) {
        let head = if MIN { 2 * SCALES } else { SCALES };
        let five = BITS == 5;
        let size = head + 256 + if five { 64 } else { 0 };
        let offset = match (MIN, five) {
            (true, _) => 0,
            (false, true) => 16,
            (false, false) => 8,
        };
        let nb = tiles[0].len() / size;
        assert!(tiles.iter().all(|t| t.len() >= nb * size));
        // Operands unpacked ahead (a prefill's) come for one column.
        assert!(ops.is_empty() || (T == 1 && five && ops.len() >= nb * 512));
        let mut xq = [std::ptr::null::<i8>(); R];
        let mut xd = [std::ptr::null::<f32>(); R];
        let mut xs = [std::ptr::null::<i32>(); R];
        for j in 0..R {
            let (q, d, s) = x.row(r + j);
            assert!(q.len() >= nb * QK && d.len() >= nb && s.len() >= nb);
            (xq[j], xd[j], xs[j]) = (q.as_ptr(), d.as_ptr(), s.as_ptr());
        }
        let mut y = y;
        for h in 0..2 {
            let mut acc = [[_mm256_setzero_ps(); R]; T];
            for b in 0..nb {
                for (t, tiles) in tiles.iter().enumerate() {
                    // SAFETY: tile b of each column is `size` readable bytes; block b of
                    // each row of `x` is in bounds (asserted above).
                    unsafe {
                        let tile = tiles.as_ptr().add(b * size);
                        let xp = xq.map(|q| q.add(b * QK));
                        let q = tile.add(head + 32 * h);
                        let pre = match ops.is_empty() {
                            true => std::ptr::null(),
                            false => ops.as_ptr().add(512 * b + 256 * h),
                        };
                        let [sums, _] = match five {
                            true => half_sums::<R, 5>(q, tile.add(head + 256 + 32 * h), pre, xp),
                            false => half_sums::<R, 4>(q, std::ptr::null(), pre, xp),
                        };
                        let d = _mm256_cvtph_ps(_mm_loadu_si128(tile.add(16 * h).cast()));
                        let m = match MIN {
                            true => {
                                _mm256_cvtph_ps(_mm_loadu_si128(tile.add(SCALES + 16 * h).cast()))
                            }
                            false => _mm256_setzero_ps(),
                        };
                        for j in 0..R {
                            let s = _mm256_add_epi32(
                                sums[j],
                                _mm256_set1_epi32(-offset * *xs[j].add(b)),
                            );
                            let dx = *xd[j].add(b);
                            acc[t][j] = _mm256_fmadd_ps(
                                _mm256_cvtepi32_ps(s),
                                _mm256_mul_ps(d, _mm256_set1_ps(dx)),
                                acc[t][j],
                            );
                            if MIN {
                                let xsum = _mm256_set1_ps(dx * *xs[j].add(b) as f32);
                                acc[t][j] = _mm256_fmadd_ps(m, xsum, acc[t][j]);
                            }
                        }
                    }
                }
            }
            for (y, acc) in y.iter_mut().zip(acc) {
                for j in 0..R {
                    // SAFETY: 8 floats to the half of a [f32; 16].
                    unsafe { _mm256_storeu_ps(y[j][8 * h..].as_mut_ptr(), acc[j]) };
                }
            }
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
        // As `qmatvec`'s test of the q8_0 quantizer, for q8_K's super-blocks.
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
            for level in [Level::Avx2, Level::Avx512Vnni] {
                if level > crate::quant::stored::level() || !p.format.kernels(level) {
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
                for level in [Level::Avx2, Level::Avx512Vnni] {
                    if level > crate::quant::stored::level() || !p.format.kernels(level) {
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

    #[test]
    fn other_formats_are_not_packed() {
        let w = Tensor::randn(0f32, 1.0, (16, 256), &Device::Cpu).unwrap();
        for dtype in [GgmlDType::Q8K, GgmlDType::Q8_1] {
            let q = QTensor::quantize(&w, dtype).unwrap();
            assert!(Packed::pack(&q).unwrap().is_none(), "{dtype:?}");
        }
    }
}
