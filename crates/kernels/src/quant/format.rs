//! The GGUF block formats as the packed kernels lay them out: per format, the size of a
//! block and of a tile (16 rows × one block or super-block), where each part of a tile
//! starts, how a value becomes its kernel operand, and which instruction levels have kernels.

use candle_core::quantized::GgmlDType;
use half::f16;

use super::level::Level;

/// Rows per tile.
pub(super) const TILE: usize = 16;
/// Values per block of q8_0 and q4_0, and per block of the quantized rows of `x`.
pub(super) const QK: usize = 32;
/// Values per k-quant super-block.
pub(super) const QK_K: usize = 256;
/// Bytes of a tile's 16 f16 scales (and of q4_1/q5_1's 16 f16 minima after them).
pub(super) const SCALES: usize = 2 * TILE;

/// Where the parts of a q4_K or q5_K tile (16 rows × one super-block of 8 sub-blocks of
/// 32) start: 16 f16 `d`, 16 f16 `dmin`, the 6-bit scales and minima as bytes (`[8][16]`
/// each: one 16-byte load per sub-block), then each sub-block's nibbles laid out as a q4_0
/// tile's, then (q5_K) each sub-block's fifth bits laid out as a q5_0 tile's. 2368 bytes
/// (q5_K 2880) against the file's 2304 (2816): the scales unpacked from their 12 bytes.
pub(super) mod q4k {
    pub(crate) const DMIN: usize = 32;
    pub(crate) const SC: usize = 64;
    pub(crate) const MIN: usize = 192;
    pub(crate) const QS: usize = 320;
    pub(crate) const BYTES: usize = QS + 8 * 256;
    pub(crate) const Q5_BYTES: usize = BYTES + 8 * 64;
}

/// Where the parts of a q6_K tile (16 rows × one super-block of 16 sub-blocks of 16) start:
/// 16 f16 `d`, the signed 8-bit scales (`[16][16]`), the low four bits of each block of 32
/// laid out as a q4_0 tile's nibbles, then their high two bits, 128 bytes per block of 32:
/// bits `2f..2f + 1` of byte `64h + 4r + i` belong to value `4g + i` of row `r`, `g = 4h + f`.
/// The same 3360 bytes as the file's 16 blocks.
pub(super) mod q6k {
    pub(crate) const SC: usize = 32;
    pub(crate) const QL: usize = 288;
    pub(crate) const QH: usize = QL + 8 * 256;
    pub(crate) const BYTES: usize = QH + 8 * 128;
}

/// Where the parts of a q3_K tile (16 rows × one super-block of 16 sub-blocks of 16) start:
/// 16 f16 `d`, the signed 8-bit scales less 32 (`[16][16]`, as q6_K's), then per block of
/// 32 the low two bits of each value laid out as q6_K's high bit pairs (128 bytes), then
/// per block of 32 the third bits laid out as q5_0's fifth bits (64 bytes). 1824 bytes
/// against the file's 1760 (the scales unpacked from their 12 bytes).
pub(super) mod q3k {
    pub(crate) const SC: usize = 32;
    pub(crate) const QL: usize = 288;
    pub(crate) const QH: usize = QL + 8 * 128;
    pub(crate) const BYTES: usize = QH + 8 * 64;
}

/// Where the parts of a q2_K tile (16 rows × one super-block of 16 sub-blocks of 16) start:
/// 16 f16 `d`, 16 f16 `dmin`, the stored bytes of 4-bit scale and minimum (`[16][16]`, one
/// lane per row), then per block of 32 the values' bit pairs laid out as q3_K's. The same
/// 1344 bytes as the file's 16 blocks.
pub(super) mod q2k {
    pub(crate) const DMIN: usize = 32;
    pub(crate) const SC: usize = 64;
    pub(crate) const QL: usize = 320;
    pub(crate) const BYTES: usize = QL + 8 * 128;
}

/// The formats packed here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Format {
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
    pub(super) fn of(dtype: GgmlDType) -> Option<Self> {
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

    /// The GGUF type.
    pub(super) fn dtype(self) -> GgmlDType {
        match self {
            Self::Q8_0 => GgmlDType::Q8_0,
            Self::Q4_0 => GgmlDType::Q4_0,
            Self::Q5_0 => GgmlDType::Q5_0,
            Self::Q4_1 => GgmlDType::Q4_1,
            Self::Q5_1 => GgmlDType::Q5_1,
            Self::Q4K => GgmlDType::Q4K,
            Self::Q5K => GgmlDType::Q5K,
            Self::Q6K => GgmlDType::Q6K,
            Self::Q3K => GgmlDType::Q3K,
            Self::Q2K => GgmlDType::Q2K,
        }
    }

    /// Values of a row in one stored block (and so in one tile).
    pub(super) fn values(self) -> usize {
        match self {
            Self::Q8_0 | Self::Q4_0 | Self::Q5_0 | Self::Q4_1 | Self::Q5_1 => QK,
            Self::Q4K | Self::Q5K | Self::Q6K | Self::Q3K | Self::Q2K => QK_K,
        }
    }

    /// Bytes of one row's stored block.
    pub(super) fn block_bytes(self) -> usize {
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
    pub(super) fn tile_bytes(self) -> usize {
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
    pub(super) fn offset(self) -> i32 {
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
    pub(super) fn nibbles(self) -> usize {
        match self {
            Self::Q4_1 | Self::Q5_1 => 2 * SCALES,
            _ => SCALES,
        }
    }

    /// Where value `v` of row `r` sits in a q8_0 or q4_0 tile's values, and whether in the
    /// high nibble (q4_0; the k-quants lay out their four-bit parts per 32 values the same).
    pub(super) fn place(self, r: usize, v: usize) -> (usize, bool) {
        match self {
            Self::Q8_0 => ((v / 4) * 4 * TILE + 4 * r + v % 4, false),
            _ => ((v / 8) * 4 * TILE + 4 * r + v % 4, v % 8 >= 4),
        }
    }

    /// The unsigned operand (value plus offset) of value `v` of row `r` in tile `t`.
    pub(super) fn operand(self, t: &[u8], r: usize, v: usize) -> i32 {
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
    pub(super) fn dequantize(self, t: &[u8], r: usize, out: &mut [f32]) {
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
    pub(super) fn pack_row(self, src: &[u8], t: &mut [u8], r: usize) {
        // Fifth bit `bit` of value `v` (of a block of 32) into the bit layout at `q`.
        let put_fifth = |q: &mut [u8], v: usize, bit: u8| q[4 * r + v % 4] |= bit << (v / 4);
        match self {
            Self::Q8_0 => {
                t[2 * r..2 * r + 2].copy_from_slice(&src[..2]);
                // Values 4g..4g + 3 at 64g + 4r (see `place`).
                for (g, four) in src[2..2 + QK].chunks_exact(4).enumerate() {
                    let at = SCALES + g * 4 * TILE + 4 * r;
                    for (dst, &q) in t[at..at + 4].iter_mut().zip(four) {
                        *dst = q ^ 0x80;
                    }
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
                put_nibbles(&mut t[at..], r, |v| match v < 16 {
                    true => qs[v] & 15,
                    false => qs[v - 16] >> 4,
                });
                if five {
                    put_fifths(&mut t[at + 256..], r, |v| (qh >> v & 1) as u8);
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
                    // Block b's value v: bit b of byte v.
                    for b in 0..QK_K / QK {
                        put_fifths(&mut t[q4k::BYTES + b * 64..], r, |v| qh[v] >> b & 1);
                    }
                }
                for j in 0..8 {
                    let (sc, m) = scale_min_k4(j, scales);
                    t[q4k::SC + 16 * j + r] = sc;
                    t[q4k::MIN + 16 * j + r] = m;
                }
                // Block b of 32 values: the low nibbles of bytes 32(b / 2).. for even b,
                // the high ones for odd b.
                for b in 0..QK_K / QK {
                    let (bytes, shift) = (&qs[32 * (b / 2)..][..32], 4 * (b % 2));
                    put_nibbles(&mut t[q4k::QS + b * 256..], r, |v| bytes[v] >> shift & 15);
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
                // Block b of 32 values is run b % 4 of half b / 4: value l's low four bits
                // from byte 64·half + 32·(run % 2) + l (the high nibble for runs 2 and 3),
                // its high two from bits 2·run of byte 32·half + l.
                for b in 0..QK_K / QK {
                    let (half, run) = (b / 4, b % 4);
                    let low = &ql[64 * half + 32 * (run % 2)..][..32];
                    let high = &qh[32 * half..][..32];
                    let shift = 4 * (run / 2);
                    put_nibbles(&mut t[q6k::QL + b * 256..], r, |v| low[v] >> shift & 15);
                    // Bits 2f..2f + 1 of byte 64h + 4r + i: value 4(4h + f) + i.
                    for h in 0..2 {
                        for i in 0..4 {
                            let mut byte = 0;
                            for f in 0..4 {
                                let v = 4 * (4 * h + f) + i;
                                byte |= (high[v] >> (2 * run) & 3) << (2 * f);
                            }
                            t[q6k::QH + b * 128 + h * 64 + 4 * r + i] = byte;
                        }
                    }
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

/// Row `r`'s 32 four-bit values `nib(0..32)` of one block written into the nibble layout
/// at `q` (see [`Format::place`]): values 8g..8g + 3 in the low nibbles of bytes
/// 64g + 4r.., 8g + 4..8g + 7 in their high ones, each byte written whole.
#[inline(always)]
fn put_nibbles(q: &mut [u8], r: usize, nib: impl Fn(usize) -> u8) {
    for g in 0..QK / 8 {
        let at = g * 4 * TILE + 4 * r;
        for (i, byte) in q[at..at + 4].iter_mut().enumerate() {
            *byte = nib(8 * g + i) | nib(8 * g + 4 + i) << 4;
        }
    }
}

/// Row `r`'s 32 single bits `bit(0..32)` of one block written into the bit layout at `q`
/// (the fifth bits of q5_0, q5_1 and q5_K): bit `v` as bit `v / 4` of byte `4r + v % 4`,
/// each byte written whole.
#[inline(always)]
fn put_fifths(q: &mut [u8], r: usize, bit: impl Fn(usize) -> u8) {
    for (i, byte) in q[4 * r..4 * r + 4].iter_mut().enumerate() {
        *byte = (0..QK / 4).fold(0, |acc, g| acc | bit(4 * g + i) << g);
    }
}

/// Sub-block `j`'s 6-bit scale and minimum from a q4_K block's 12 bytes (ggml's
/// `get_scale_min_k4`).
pub(super) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

impl Format {
    /// Whether `level` has kernels for this format: AVX-512 VNNI and AVX2 for every one.
    /// SIMD products through the blocks as stored spent as long reducing each block's sums
    /// across lanes as multiplying them (slower than llama.cpp, which repacks q4_0 for AVX2
    /// too), Candle's block product (the k-quants' decoding) was slower still, and Candle's
    /// q4_K and q6_K prefill kept a repacked copy beside the blocks.
    pub(super) fn kernels(self, level: Level) -> bool {
        match level {
            Level::Avx512Gfni | Level::Avx512Vnni | Level::Avx2 => true,
            Level::Scalar => false,
        }
    }
}
