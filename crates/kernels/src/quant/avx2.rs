//! The packed kernels for CPUs with AVX2 alone (`vpmaddubsw` on each half of a tile: rows
//! 0–7 and 8–15 in the eight lanes), every packed format.

use std::arch::x86_64::*;

use super::ahead::{ahead, Spread};
use super::format::{q2k, q3k, q4k, q6k, Format, QK, QK_K, SCALES, TILE};
use super::input::{super_rows, QRows, SuperRows, XRow};

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
pub(super) unsafe fn unpack_avx2(format: Format, tiles: &[u8], ops: &mut [u8]) {
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
                    _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_maddubs_epi16(hi, x1)),
                );
            }
            // (Four-bit operands, four rows of `x`: see `in_registers`. Five- and six-bit
            // ones measured no faster so.)
            if BITS == 4 && R == 4 {
                in_registers(&mut s16);
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

/// [`half_sums`] for q8_0 tiles: `Σ w · x` for one half of a block (group `g`'s 32
/// bytes at `q + 64g`, `g < 8`, each `w + 128`). The unsigned operands would overflow
/// `vpmaddubsw`'s 16-bit pairs (2·255·127), so, as ggml does, it takes the magnitudes
/// `|w|` (at most 128) by `x` with the sign of `w` (`x` is at most 127 in magnitude:
/// [`crate::quant::input`]): pairs of at most 2·128·127, added in i32 group by group.
/// (Splitting each operand into two nibbles instead, summed in i16 over the eight groups,
/// takes as many instructions and more registers: it measured 5–8% slower.)
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn half_sums8<const R: usize>(q: *const u8, xp: [*const i8; R]) -> [__m256i; R] {
    let (top, ones) = (_mm256_set1_epi8(-128), _mm256_set1_epi16(1));
    let mut s32 = [_mm256_setzero_si256(); R];
    // SAFETY (caller): 32 readable bytes at `q + 64g` (g < 8); 32 values of `x` at each
    // `xp[j]`.
    unsafe {
        for g in 0..8 {
            let w = _mm256_xor_si256(_mm256_loadu_si256(q.add(64 * g).cast()), top);
            let a = _mm256_abs_epi8(w);
            for j in 0..R {
                let x = _mm256_set1_epi32(xp[j].add(4 * g).cast::<i32>().read_unaligned());
                let p = _mm256_maddubs_epi16(a, _mm256_sign_epi8(x, w));
                s32[j] = _mm256_add_epi32(s32[j], _mm256_madd_epi16(p, ones));
            }
            // (Four rows of `x`: a prefill's passes, or four sequences decoded together; see
            // `in_registers`. Fewer rows' sums are left to the compiler's schedule: with the
            // block there, one sequence decoded at 0.58×, two at 0.88×, three at 0.93×.)
            if R == 4 {
                in_registers(&mut s32);
            }
        }
    }
    s32
}

/// Hands `R` (one to four) running sums through an empty `asm` block, once per group of a
/// block: no instruction, but each sum must be whole in its register there. Without it,
/// LLVM turned the sums of four rows of `x` into trees over a block's groups, hoisted the
/// groups' broadcasts of `x` ahead of them and spilled what no longer fit into the
/// registers; with it, the q8_0 products of a prefill ran 1.12× as fast, q4_0's 1.08×, and
/// four sequences decoded together 1.36× (docs/PERFORMANCE.md, "Quantized products").
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn in_registers<const R: usize>(s: &mut [__m256i; R]) {
    const { assert!(R >= 1 && R <= 4) };
    let at = |j: usize| j.min(R - 1);
    let (a, b, c, d) = (at(0), at(1), at(2), at(3));
    // SAFETY: the block is empty; it reads and writes nothing but its registers.
    unsafe {
        std::arch::asm!(
            "/* {0} {1} {2} {3} */",
            inout(ymm_reg) s[a],
            inout(ymm_reg) s[b],
            inout(ymm_reg) s[c],
            inout(ymm_reg) s[d],
            options(pure, nomem, nostack, preserves_flags)
        )
    };
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
/// `x` per super-block in integers, then two multiply-adds. A decoding product (one row
/// of `x`) takes both halves of each tile in one pass over the column, as
/// `legacy_rows_avx2` does: in two, the first pass's loads from memory overlapped only
/// half the arithmetic. Four rows take the halves one after the other (the
/// accumulators of both would not fit the registers).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q4k_rows_avx2<const R: usize, const FIVE: bool>(
    tiles: &[u8],
    ops: &[u8],
    x: &SuperRows,
    r: usize,
    y: &mut [[f32; TILE]; 4],
    spread: Spread,
) {
    let size = if FIVE { q4k::Q5_BYTES } else { q4k::BYTES };
    let nb = tiles.len() / size;
    let xs = super_rows::<R>(x, r, nb);
    assert!(ops.is_empty() || (FIVE && ops.len() >= nb * 8 * 512));
    // SAFETY: as this function's; `nb` tiles of `size` bytes, `xs` checked for `nb`.
    unsafe {
        if R == 1 {
            q4k_halves::<R, FIVE, 0, 2>(tiles, ops, xs, nb, y, spread);
        } else {
            q4k_halves::<R, FIVE, 0, 1>(tiles, ops, xs, nb, y, spread);
            q4k_halves::<R, FIVE, 1, 1>(tiles, ops, xs, nb, y, spread);
        }
    }
}

/// Halves `H0..H0 + NH` of one column of [`q4k_rows_avx2`]'s tiles, per sub-block
/// each in turn (the pass with the first half streams the column; a second finds it in
/// the cache).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q4k_halves<const R: usize, const FIVE: bool, const H0: usize, const NH: usize>(
    tiles: &[u8],
    ops: &[u8],
    xs: [XRow; R],
    nb: usize,
    y: &mut [[f32; TILE]; 4],
    spread: Spread,
) {
    let size = if FIVE { q4k::Q5_BYTES } else { q4k::BYTES };
    let mut acc = [[_mm256_setzero_ps(); R]; NH];
    for b in 0..nb {
        // SAFETY (caller): tile b is `size` readable bytes; super-block b of each row of
        // `x` is in bounds.
        unsafe {
            let tile = tiles.as_ptr().add(b * size);
            let mut sums = [[_mm256_setzero_si256(); R]; NH];
            let mut mins = [[_mm256_setzero_si256(); R]; NH];
            for j in 0..8 {
                if H0 == 0 {
                    ahead(tile, size, j, spread);
                }
                let xp = xs.map(|x| x.q.add(b * QK_K + QK * j));
                for k in 0..NH {
                    let h = H0 + k;
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
                        let sum = _mm256_mullo_epi32(s[i], sc);
                        sums[k][i] = _mm256_add_epi32(sums[k][i], sum);
                        let x = xs[i];
                        let xsum = *x.s.add(16 * b + 2 * j) + *x.s.add(16 * b + 2 * j + 1);
                        let min = _mm256_mullo_epi32(m, _mm256_set1_epi32(xsum));
                        mins[k][i] = _mm256_add_epi32(mins[k][i], min);
                    }
                }
            }
            for k in 0..NH {
                let h = H0 + k;
                let d = _mm256_cvtph_ps(_mm_loadu_si128(tile.add(16 * h).cast()));
                let dmin = _mm256_cvtph_ps(_mm_loadu_si128(tile.add(q4k::DMIN + 16 * h).cast()));
                for i in 0..R {
                    let dx = _mm256_set1_ps(*xs[i].d.add(b));
                    let s = _mm256_cvtepi32_ps(sums[k][i]);
                    acc[k][i] = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), s, acc[k][i]);
                    let m = _mm256_cvtepi32_ps(mins[k][i]);
                    acc[k][i] = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, dx), m, acc[k][i]);
                }
            }
        }
    }
    store_halves::<R, H0, NH>(y, acc);
}

/// The accumulators of halves `H0..H0 + NH` into their places in `y`.
#[target_feature(enable = "avx2")]
#[inline]
fn store_halves<const R: usize, const H0: usize, const NH: usize>(
    y: &mut [[f32; TILE]; 4],
    acc: [[__m256; R]; NH],
) {
    for (k, acc) in acc.into_iter().enumerate() {
        for (y, acc) in y.iter_mut().zip(acc) {
            // SAFETY: 8 floats to the half of a [f32; 16].
            unsafe { _mm256_storeu_ps(y[8 * (H0 + k)..].as_mut_ptr(), acc) };
        }
    }
}

/// [`q6k_rows`] for CPUs with AVX2 alone, q6_K (or, `Q3`, q3_K): per block of 32 and
/// row of `x`, the [`half_sums`] of its two halves of 16 values, each less the offset
/// (32, 4) times the half's sum of `x` and multiplied by its scales as integers; per
/// super-block one multiply-add. Halves in one pass or two, as in [`q4k_rows_avx2`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q6k_rows_avx2<const R: usize, const Q3: bool>(
    tiles: &[u8],
    ops: &[u8],
    x: &SuperRows,
    r: usize,
    y: &mut [[f32; TILE]; 4],
    spread: Spread,
) {
    let size = if Q3 { q3k::BYTES } else { q6k::BYTES };
    let nb = tiles.len() / size;
    let xs = super_rows::<R>(x, r, nb);
    assert!(ops.is_empty() || ops.len() >= nb * 8 * 512);
    // SAFETY: as this function's; `nb` tiles of `size` bytes, `xs` checked for `nb`.
    unsafe {
        if R == 1 {
            q6k_halves::<R, Q3, 0, 2>(tiles, ops, xs, nb, y, spread);
        } else {
            q6k_halves::<R, Q3, 0, 1>(tiles, ops, xs, nb, y, spread);
            q6k_halves::<R, Q3, 1, 1>(tiles, ops, xs, nb, y, spread);
        }
    }
}

/// Halves `H0..H0 + NH` of one column of [`q6k_rows_avx2`]'s tiles (as
/// [`q4k_halves`]).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q6k_halves<const R: usize, const Q3: bool, const H0: usize, const NH: usize>(
    tiles: &[u8],
    ops: &[u8],
    xs: [XRow; R],
    nb: usize,
    y: &mut [[f32; TILE]; 4],
    spread: Spread,
) {
    // (The scales lie at the same place in both tiles: q6k::SC == q3k::SC.)
    let (size, offset) = if Q3 {
        (q3k::BYTES, 4)
    } else {
        (q6k::BYTES, 32)
    };
    let mut acc = [[_mm256_setzero_ps(); R]; NH];
    for b in 0..nb {
        // SAFETY (caller): tile b is `size` readable bytes; super-block b of each row of
        // `x` is in bounds.
        unsafe {
            let tile = tiles.as_ptr().add(b * size);
            let mut sums = [[_mm256_setzero_si256(); R]; NH];
            for j in 0..8 {
                if H0 == 0 {
                    ahead(tile, size, j, spread);
                }
                let xp = xs.map(|x| x.q.add(b * QK_K + QK * j));
                for (k, sums) in sums.iter_mut().enumerate() {
                    let h = H0 + k;
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
                        let hi = _mm256_add_epi32(hi[i], _mm256_set1_epi32(-offset * *s.add(1)));
                        let sum = _mm256_add_epi32(
                            _mm256_mullo_epi32(lo, sc_lo),
                            _mm256_mullo_epi32(hi, sc_hi),
                        );
                        sums[i] = _mm256_add_epi32(sums[i], sum);
                    }
                }
            }
            for (k, sums) in sums.iter().enumerate() {
                let d = _mm256_cvtph_ps(_mm_loadu_si128(tile.add(16 * (H0 + k)).cast()));
                for i in 0..R {
                    let dx = _mm256_set1_ps(*xs[i].d.add(b));
                    let s = _mm256_cvtepi32_ps(sums[i]);
                    acc[k][i] = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), s, acc[k][i]);
                }
            }
        }
    }
    store_halves::<R, H0, NH>(y, acc);
}

/// [`q2k_rows`] for CPUs with AVX2 alone: per block of 32 and row of `x`, the
/// [`half_sums`] of its two halves of 16 values, each multiplied by its 4-bit scale as
/// an integer, and the halves' sums of `x` by their minima; per super-block two
/// multiply-adds. Halves in one pass or two, as in [`q4k_rows_avx2`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q2k_rows_avx2<const R: usize>(
    tiles: &[u8],
    x: &SuperRows,
    r: usize,
    y: &mut [[f32; TILE]; 4],
    spread: Spread,
) {
    let nb = tiles.len() / q2k::BYTES;
    let xs = super_rows::<R>(x, r, nb);
    // SAFETY: as this function's; `nb` tiles, `xs` checked for `nb`.
    unsafe {
        if R == 1 {
            q2k_halves::<R, 0, 2>(tiles, xs, nb, y, spread);
        } else {
            q2k_halves::<R, 0, 1>(tiles, xs, nb, y, spread);
            q2k_halves::<R, 1, 1>(tiles, xs, nb, y, spread);
        }
    }
}

/// Halves `H0..H0 + NH` of one column of [`q2k_rows_avx2`]'s tiles (as
/// [`q4k_halves`]).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q2k_halves<const R: usize, const H0: usize, const NH: usize>(
    tiles: &[u8],
    xs: [XRow; R],
    nb: usize,
    y: &mut [[f32; TILE]; 4],
    spread: Spread,
) {
    let low = _mm256_set1_epi32(15);
    let mut acc = [[_mm256_setzero_ps(); R]; NH];
    for b in 0..nb {
        // SAFETY (caller): tile b is `q2k::BYTES` readable bytes; super-block b of each
        // row of `x` is in bounds.
        unsafe {
            let tile = tiles.as_ptr().add(b * q2k::BYTES);
            let mut sums = [[_mm256_setzero_si256(); R]; NH];
            let mut mins = [[_mm256_setzero_si256(); R]; NH];
            for j in 0..8 {
                if H0 == 0 {
                    ahead(tile, q2k::BYTES, j, spread);
                }
                let xp = xs.map(|x| x.q.add(b * QK_K + QK * j));
                for k in 0..NH {
                    let h = H0 + k;
                    let q = tile.add(q2k::QL + 128 * j + 32 * h);
                    let [lo, hi] = half_sums::<R, 2>(q, std::ptr::null(), std::ptr::null(), xp);
                    // Scale in the low nibble, minimum in the high one, a lane per row.
                    let s_lo = lanes8::<false>(tile.add(q2k::SC + 32 * j + 8 * h));
                    let s_hi = lanes8::<false>(tile.add(q2k::SC + 32 * j + 16 + 8 * h));
                    let (sc_lo, sc_hi) = (_mm256_and_si256(s_lo, low), _mm256_and_si256(s_hi, low));
                    let (m_lo, m_hi) = (_mm256_srli_epi32::<4>(s_lo), _mm256_srli_epi32::<4>(s_hi));
                    for i in 0..R {
                        let s = xs[i].s.add(16 * b + 2 * j);
                        let sum = _mm256_add_epi32(
                            _mm256_mullo_epi32(lo[i], sc_lo),
                            _mm256_mullo_epi32(hi[i], sc_hi),
                        );
                        sums[k][i] = _mm256_add_epi32(sums[k][i], sum);
                        let m = _mm256_add_epi32(
                            _mm256_mullo_epi32(m_lo, _mm256_set1_epi32(*s)),
                            _mm256_mullo_epi32(m_hi, _mm256_set1_epi32(*s.add(1))),
                        );
                        mins[k][i] = _mm256_add_epi32(mins[k][i], m);
                    }
                }
            }
            for k in 0..NH {
                let h = H0 + k;
                let d = _mm256_cvtph_ps(_mm_loadu_si128(tile.add(16 * h).cast()));
                let dmin = _mm256_cvtph_ps(_mm_loadu_si128(tile.add(q2k::DMIN + 16 * h).cast()));
                for i in 0..R {
                    let dx = _mm256_set1_ps(*xs[i].d.add(b));
                    let s = _mm256_cvtepi32_ps(sums[k][i]);
                    acc[k][i] = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), s, acc[k][i]);
                    let m = _mm256_cvtepi32_ps(mins[k][i]);
                    acc[k][i] = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, dx), m, acc[k][i]);
                }
            }
        }
    }
    store_halves::<R, H0, NH>(y, acc);
}

/// [`legacy_rows`] for CPUs with AVX2 alone, q8_0, q4_0 and q5_0 (or, `MIN`, q4_1 and
/// q5_1) tiles, with [`half_sums`] ([`half_sums8`] for q8_0) in place of `vpdpbusd`. A
/// half of a tile (rows 0–7 or 8–15: 32 bytes of each group's 64) is one register per
/// row of `x`; the halves go
/// one after the other over the whole column, the second from L1, so that four rows of
/// `x` come near fitting the 16 registers.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn legacy_rows_avx2<
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
    let size = match BITS {
        8 => head + 512,
        _ => head + 256 + if five { 64 } else { 0 },
    };
    let offset = match (MIN, BITS) {
        (true, _) => 0,
        // (q8_0's sums are of the values themselves.)
        (false, 8) => 0,
        (false, 5) => 16,
        (false, _) => 8,
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
    // A decoding product (one row of `x`) takes both halves in one pass over the tiles,
    // which it reads from memory: a second pass found them in the second- (not the
    // first-) level cache. A prefill's four rows take the halves one after the other
    // (the accumulators of both would not fit the registers).
    let one_pass = R == 1;
    for pass in 0..if one_pass { 1 } else { 2 } {
        let halves = if one_pass { 0..2 } else { pass..pass + 1 };
        let mut acc = [[[_mm256_setzero_ps(); R]; 2]; T];
        for b in 0..nb {
            for (t, tiles) in tiles.iter().enumerate() {
                for h in halves.clone() {
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
                        let sums = match BITS {
                            8 => half_sums8::<R>(q, xp),
                            5 => half_sums::<R, 5>(q, tile.add(head + 256 + 32 * h), pre, xp)[0],
                            _ => half_sums::<R, 4>(q, std::ptr::null(), pre, xp)[0],
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
                            acc[t][h][j] = _mm256_fmadd_ps(
                                _mm256_cvtepi32_ps(s),
                                _mm256_mul_ps(d, _mm256_set1_ps(dx)),
                                acc[t][h][j],
                            );
                            if MIN {
                                let xsum = _mm256_set1_ps(dx * *xs[j].add(b) as f32);
                                acc[t][h][j] = _mm256_fmadd_ps(m, xsum, acc[t][h][j]);
                            }
                        }
                    }
                }
            }
        }
        for (y, acc) in y.iter_mut().zip(acc) {
            for h in halves.clone() {
                for j in 0..R {
                    // SAFETY: 8 floats to the half of a [f32; 16].
                    unsafe { _mm256_storeu_ps(y[j][8 * h..].as_mut_ptr(), acc[h][j]) };
                }
            }
        }
    }
}
