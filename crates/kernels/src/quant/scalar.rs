//! The scalar reference of the packed kernels: the same arithmetic on the same tiles, one
//! value at a time. The tests hold the AVX-512 and AVX2 kernels, and the packing, to it.

use half::f16;

use super::format::{q2k, q4k, q6k, Format, QK, QK_K, SCALES, TILE};
use super::input::XRows;

/// [`tile_rows`] for one column, in scalar code.
pub(super) fn scalar_rows(
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
