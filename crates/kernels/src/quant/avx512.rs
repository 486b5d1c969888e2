//! The packed kernels with AVX-512 (VNNI's `vpdpbusd`): one tile's 16 rows in the 16 lanes
//! of a register, four values of each row per 64-byte load (see [`super::packed`]).

use std::arch::x86_64::*;

use super::ahead::{ahead, Spread};
use super::format::{q2k, q3k, q4k, q6k, Format, QK, QK_K, SCALES, TILE};
use super::input::{super_rows, QRows, SuperRows, XRow};

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

/// The operands of a block of 32 four-bit values as [`q4_operands`] gives them, except
/// that each odd group (the high nibbles) stays in place: 16 times its value, one `and`
/// where the value itself takes a shift too. Decoding's kernels, whose unpacking competes
/// with the products for the vector units, sum the odd groups apart and shift their sum
/// back ([`dot_groups`] with `IN_PLACE`): exact, as it is a multiple of 16.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn q4_operands_in_place(q: *const u8) -> [__m512i; 8] {
    let (lo, hi) = (_mm512_set1_epi8(0x0f), _mm512_set1_epi8(0xf0u8 as i8));
    let mut w = [_mm512_setzero_si512(); 8];
    for (i, w) in w.chunks_exact_mut(2).enumerate() {
        // SAFETY (caller): 256 readable bytes at `q`.
        let v = unsafe { _mm512_loadu_si512(q.add(64 * i).cast()) };
        w[0] = _mm512_and_si512(v, lo);
        w[1] = _mm512_and_si512(v, hi);
    }
    w
}

/// `s + Σ_g w[g] · x[4g..4g + 3]` per lane (row), for the values of `x` at `p` (four
/// per `i32`), in two chains: the even groups' (with `s`) and the odd groups', which with
/// `IN_PLACE` hold 16 times their values ([`q4_operands_in_place`]).
#[target_feature(enable = "avx512f,avx512vnni")]
#[inline]
unsafe fn dot_groups<const IN_PLACE: bool>(w: &[__m512i], p: *const i32, s: __m512i) -> __m512i {
    let (mut s0, mut s1) = (s, _mm512_setzero_si512());
    for g in (0..w.len()).step_by(2) {
        // SAFETY (caller): `w.len()` (even) values of 4 bytes at `p`.
        let (x0, x1) = unsafe { (p.add(g).read_unaligned(), p.add(g + 1).read_unaligned()) };
        s0 = _mm512_dpbusd_epi32(s0, w[g], _mm512_set1_epi32(x0));
        s1 = _mm512_dpbusd_epi32(s1, w[g + 1], _mm512_set1_epi32(x1));
    }
    if IN_PLACE {
        s1 = _mm512_srai_epi32::<4>(s1);
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

/// [`q6k_operands`] with GFNI: each group's two high bits taken from the loaded bit pairs
/// to bits 4..5 by one affine transform of bytes (`vgf2p8affineqb`, a bit matrix), and
/// merged with the nibble by one select; where the shifts, masks and `or`s take 13
/// instructions for four groups, this takes 10.
#[target_feature(enable = "avx512f,avx512bw,gfni")]
#[inline]
unsafe fn q6k_operands_gfni(tile: *const u8, j: usize) -> [__m512i; 8] {
    // Output bit i of a byte is the parity of its AND with byte 7 - i of the matrix: bits
    // 2f and 2f + 1 (group 4h + f's pair) to bits 4 and 5, the rest 0.
    const fn pair(f: u32) -> i64 {
        ((1 << (2 * f)) << 24 | (2 << (2 * f)) << 16) as i64
    }
    let matrices = [
        _mm512_set1_epi64(pair(0)),
        _mm512_set1_epi64(pair(1)),
        _mm512_set1_epi64(pair(2)),
        _mm512_set1_epi64(pair(3)),
    ];
    let low = _mm512_set1_epi8(0x0f);
    let mut w = [_mm512_setzero_si512(); 8];
    // SAFETY (caller): a whole tile at `tile`, j < 8.
    unsafe {
        let (ql, qh) = (tile.add(q6k::QL + 256 * j), tile.add(q6k::QH + 128 * j));
        for h in 0..2 {
            let pairs = _mm512_loadu_si512(qh.add(64 * h).cast());
            for i in 0..2 {
                // Groups 4h + 2i (low nibbles) and 4h + 2i + 1 (high nibbles, shifted
                // down; the select drops what the 16-bit shift brings in above them).
                let v = _mm512_loadu_si512(ql.add(64 * (2 * h + i)).cast());
                for (k, nibbles) in [v, _mm512_srli_epi16::<4>(v)].into_iter().enumerate() {
                    let f = 2 * i + k;
                    let high = _mm512_gf2p8affine_epi64_epi8::<0>(pairs, matrices[f]);
                    // low ? nibbles : high, bit by bit.
                    w[4 * h + f] = _mm512_ternarylogic_epi32::<0xe4>(nibbles, high, low);
                }
            }
        }
    }
    w
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
pub(super) unsafe fn unpack(format: Format, tiles: &[u8], ops: &mut [u8]) {
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

/// `R` rows of `x` against `T` columns of q4_K (or, `FIVE`, q5_K) tiles, as ggml's
/// q4_K · q8_K: per sub-block and row of `x`, the eight `vpdpbusd` of a q4_0 block and
/// one integer multiply by its scales; per super-block, the minima times the sums of `x`
/// in integers too, then two multiply-adds. Two columns (decoding's two streams, see
/// `Packed::product`) are read super-block by super-block together; operands unpacked
/// ahead (a prefill's) come for one column.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
pub(super) unsafe fn q4k_rows<const R: usize, const FIVE: bool, const T: usize>(
    tiles: [&[u8]; T],
    ops: &[u8],
    x: &SuperRows,
    r: usize,
    y: [&mut [[f32; TILE]; 4]; T],
    spread: Spread,
) {
    let size = if FIVE { q4k::Q5_BYTES } else { q4k::BYTES };
    let nb = tiles[0].len() / size;
    assert!(tiles.iter().all(|t| t.len() >= nb * size));
    let xs = super_rows::<R>(x, r, nb);
    let pre = !ops.is_empty();
    assert!(!pre || (T == 1 && ops.len() >= nb * 8 * 512));
    let mut acc = [[_mm512_setzero_ps(); R]; T];
    for b in 0..nb {
        for (t, acc) in acc.iter_mut().enumerate() {
            // SAFETY: tile b of each column is `size` readable bytes, its operands in `ops`
            // when given; super-block b of each row of `x` is in bounds (`super_rows`).
            unsafe {
                let tile = tiles[t].as_ptr().add(b * size);
                let mut sums = [_mm512_setzero_si512(); R];
                let mut mins = [_mm512_setzero_si512(); R];
                for j in 0..8 {
                    ahead(tile, size, j, spread);
                    let sc = lanes::<false>(tile.add(q4k::SC + 16 * j));
                    let m = lanes::<false>(tile.add(q4k::MIN + 16 * j));
                    // (q5_K's fifth bits leave no room to keep the high nibbles in place.)
                    let in_place = !FIVE && !pre;
                    let w = match (pre, in_place) {
                        (true, _) => load8(ops.as_ptr().add((8 * b + j) * 512)),
                        (false, true) => q4_operands_in_place(tile.add(q4k::QS + 256 * j)),
                        (false, false) => q4k_operands::<FIVE>(tile, j),
                    };
                    for i in 0..R {
                        let x = xs[i];
                        let p = x.q.add(b * QK_K + QK * j).cast();
                        let zero = _mm512_setzero_si512();
                        let s = match in_place {
                            true => dot_groups::<true>(&w, p, zero),
                            false => dot_groups::<false>(&w, p, zero),
                        };
                        sums[i] = _mm512_add_epi32(sums[i], _mm512_mullo_epi32(s, sc));
                        let xsum = *x.s.add(16 * b + 2 * j) + *x.s.add(16 * b + 2 * j + 1);
                        let xsum = _mm512_set1_epi32(xsum);
                        mins[i] = _mm512_add_epi32(mins[i], _mm512_mullo_epi32(m, xsum));
                    }
                }
                add_with_minima(acc, &sums, &mins, tile, q4k::DMIN, &xs, b);
            }
        }
    }
    // SAFETY: this function enables AVX-512F, all that `store_rows` needs.
    unsafe { store_rows(y, acc) };
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

/// `acc[i] += d · dx_i · sums[i] − dmin · dx_i · mins[i]`: super-block `b` of a q4_K,
/// q5_K or q2_K tile (its scale `d` at the start, its minimum's `dmin` at byte `dmin_at`)
/// against row `i` of `x` (scale `dx_i`), from the integer sums and minima terms.
#[target_feature(enable = "avx512f,f16c")]
#[inline]
unsafe fn add_with_minima<const R: usize>(
    acc: &mut [__m512; R],
    sums: &[__m512i; R],
    mins: &[__m512i; R],
    tile: *const u8,
    dmin_at: usize,
    xs: &[XRow; R],
    b: usize,
) {
    // SAFETY (caller): the tile's 16 scales and 16 minima are readable; `b` is a
    // super-block of each row of `x` (`super_rows`).
    unsafe {
        let d = _mm512_cvtph_ps(_mm256_loadu_si256(tile.cast()));
        let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(tile.add(dmin_at).cast()));
        for i in 0..R {
            let dx = _mm512_set1_ps(*xs[i].d.add(b));
            let s = _mm512_cvtepi32_ps(sums[i]);
            acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), s, acc[i]);
            let m = _mm512_cvtepi32_ps(mins[i]);
            acc[i] = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, dx), m, acc[i]);
        }
    }
}

/// Each column's `R` sums into its first `R` rows of `y`.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn store_rows<const R: usize, const T: usize>(
    y: [&mut [[f32; TILE]; 4]; T],
    acc: [[__m512; R]; T],
) {
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
pub(super) unsafe fn q4k_pair<const R: usize>(
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
    // SAFETY: this function enables AVX-512F, all that `store_rows` needs.
    unsafe { store_rows(y, acc) };
}

/// [`q4k_pair`] for q6_K (`Q3`: q3_K): two columns from operands unpacked ahead, each
/// value of `x` broadcast once for both; per half sub-block (16 values, one scale) and
/// row the sums start at the offset (32 or 4) times the half's sum of `x`, then take a
/// conversion and a multiply-add by the scale as a float.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
pub(super) unsafe fn q6k_pair<const R: usize, const Q3: bool>(
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
    // SAFETY: this function enables AVX-512F, all that `store_rows` needs.
    unsafe { store_rows(y, acc) };
}

/// [`q4k_pair`] for q2_K: per half sub-block (16 values) and row, the sums take the
/// half's 4-bit scale and its minimum times the half's sum of `x`, as floats.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
pub(super) unsafe fn q2k_pair<const R: usize>(
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
    // SAFETY: this function enables AVX-512F, all that `store_rows` needs.
    unsafe { store_rows(y, acc) };
}

/// Defines [`q6k_rows`] and [`q6k_rows_gfni`]: one kernel, built for two sets of
/// target features (a function's features cannot depend on a generic parameter), each
/// with the operands that its features allow.
macro_rules! q6k_rows {
    ($(#[$doc:meta])* $name:ident, $features:literal, $operands:ident) => {
        $(#[$doc])*
        #[target_feature(enable = $features)]
        pub(super) unsafe fn $name<const R: usize, const Q3: bool, const T: usize>(
            tiles: [&[u8]; T],
            ops: &[u8],
            x: &SuperRows,
            r: usize,
            y: [&mut [[f32; TILE]; 4]; T],
            spread: Spread,
        ) {
            // (The scales lie at the same place in both tiles: q6k::SC == q3k::SC.)
            let (size, offset) = if Q3 {
                (q3k::BYTES, 4)
            } else {
                (q6k::BYTES, 32)
            };
            let nb = tiles[0].len() / size;
            assert!(tiles.iter().all(|t| t.len() >= nb * size));
            let xs = super_rows::<R>(x, r, nb);
            let pre = !ops.is_empty();
            assert!(!pre || (T == 1 && ops.len() >= nb * 8 * 512));
            let mut acc = [[_mm512_setzero_ps(); R]; T];
            for b in 0..nb {
                for (t, acc) in acc.iter_mut().enumerate() {
                    // SAFETY: tile b of each column is `size` readable bytes, its operands
                    // in `ops` when given; super-block b of each row of `x` is in bounds
                    // (`super_rows`).
                    unsafe {
                        let tile = tiles[t].as_ptr().add(b * size);
                        let mut sums = [_mm512_setzero_si512(); R];
                        for j in 0..8 {
                            ahead(tile, size, j, spread);
                            let w = match (pre, Q3) {
                                (true, _) => load8(ops.as_ptr().add((8 * b + j) * 512)),
                                (false, true) => q3k_operands(tile, j),
                                (false, false) => $operands(tile, j),
                            };
                            let sc_lo = lanes::<true>(tile.add(q6k::SC + 32 * j));
                            let sc_hi = lanes::<true>(tile.add(q6k::SC + 32 * j + 16));
                            for i in 0..R {
                                let x = xs[i];
                                let p = x.q.add(b * QK_K + QK * j).cast::<i32>();
                                let s = x.s.add(16 * b + 2 * j);
                                let lo =
                                    dot_groups::<false>(&w[..4], p, _mm512_set1_epi32(-offset * *s));
                                let hi = dot_groups::<false>(
                                    &w[4..],
                                    p.add(4),
                                    _mm512_set1_epi32(-offset * *s.add(1)),
                                );
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
            }
            // SAFETY: this function enables AVX-512F, all that `store_rows` needs.
            unsafe { store_rows(y, acc) };
        }
    };
}

q6k_rows!(
    /// `R` rows of `x` against `T` columns of q6_K (`Q3`: q3_K) tiles, as ggml's q6_K ·
    /// q8_K (q3_K · q8_K): per block of 32 and row of `x`, eight `vpdpbusd` in two halves
    /// of 16 values (each less the offset, 32 or 4, times the half's sum of `x`) and an
    /// integer multiply of each by its scales; per super-block one multiply-add. The
    /// operands are built once for the `R` rows. Columns as in [`q4k_rows`].
    q6k_rows,
    "avx512f,avx512bw,avx512vnni,f16c",
    q6k_operands
);

q6k_rows!(
    /// [`q6k_rows`] with GFNI, for q6_K: its operands by [`q6k_operands_gfni`].
    q6k_rows_gfni,
    "avx512f,avx512bw,avx512vnni,f16c,gfni",
    q6k_operands_gfni
);

/// `R` rows of `x` against `T` columns of q2_K tiles, as ggml's q2_K · q8_K: per block
/// of 32 and row of `x`, eight `vpdpbusd` in two halves of 16 values, each multiplied
/// by its 4-bit scale as an integer, and the halves' sums of `x` by their minima; per
/// super-block two multiply-adds. Columns as in [`q4k_rows`].
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
pub(super) unsafe fn q2k_rows<const R: usize, const T: usize>(
    tiles: [&[u8]; T],
    x: &SuperRows,
    r: usize,
    y: [&mut [[f32; TILE]; 4]; T],
    spread: Spread,
) {
    let nb = tiles[0].len() / q2k::BYTES;
    assert!(tiles.iter().all(|t| t.len() >= nb * q2k::BYTES));
    let xs = super_rows::<R>(x, r, nb);
    let low = _mm512_set1_epi32(15);
    let mut acc = [[_mm512_setzero_ps(); R]; T];
    for b in 0..nb {
        for (t, acc) in acc.iter_mut().enumerate() {
            // SAFETY: tile b of each column is `q2k::BYTES` readable bytes; super-block b of
            // each row of `x` is in bounds (checked by `super_rows`).
            unsafe {
                let tile = tiles[t].as_ptr().add(b * q2k::BYTES);
                let mut sums = [_mm512_setzero_si512(); R];
                let mut mins = [_mm512_setzero_si512(); R];
                for j in 0..8 {
                    ahead(tile, q2k::BYTES, j, spread);
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
                        let lo = dot_groups::<false>(&w[..4], p, _mm512_setzero_si512());
                        let hi = dot_groups::<false>(&w[4..], p.add(4), _mm512_setzero_si512());
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
                add_with_minima(acc, &sums, &mins, tile, q2k::DMIN, &xs, b);
            }
        }
    }
    // SAFETY: this function enables AVX-512F, all that `store_rows` needs.
    unsafe { store_rows(y, acc) };
}

/// [`legacy_rows`] for a prefill: `R` rows of `x` against two columns of tiles from
/// their operands unpacked ahead (`ops`), each value of `x` broadcast once into a
/// register for both (as [`q4k_pair`]).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
pub(super) unsafe fn legacy_pair<const R: usize, const BITS: u8, const MIN: bool>(
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
    // SAFETY: this function enables AVX-512F, all that `store_rows` needs.
    unsafe { store_rows(y, acc) };
}

/// How many tiles ahead of the one being read [`legacy_rows`] asks for the next, with
/// `spread` (docs/PERFORMANCE.md, "Quantized products").
const AHEAD_TILES: usize = 4;

/// `R` rows of `x` (from row `r`) against `T` columns of tiles of `BITS`-bit values
/// (q8_0, q4_0 or q5_0; with `MIN`, q4_1 or q5_1). Per block, tile and row of `x`:
/// eight `vpdpbusd` (in two chains), one conversion and one multiply-add (two with
/// minima); each tile's operands are loaded (and unpacked) once for the `R` rows. Two
/// columns are read block by block together, two streams through memory where one left
/// the reads waiting on each other. With `spread`, each column's tile [`AHEAD_TILES`]
/// blocks on is asked for as this one is read (see `Packed::product`).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
pub(super) unsafe fn legacy_rows<
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
    spread: bool,
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
                if spread {
                    // Past the column's end this only asks for bytes never read: a
                    // prefetch never faults.
                    let ahead = tile.wrapping_add(AHEAD_TILES * size);
                    for l in (0..size).step_by(64) {
                        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(l).cast());
                    }
                }
                let d = _mm512_cvtph_ps(_mm256_loadu_si256(tile.cast()));
                let m = _mm512_cvtph_ps(_mm256_loadu_si256(tile.add(SCALES).cast()));
                // w[g] pairs with values 4g..4g+3 of `x`'s block; q4_0's and q4_1's odd
                // groups in place (16 times their values) where unpacked here.
                let in_place = BITS == 4 && !pre;
                let w = match (pre, in_place) {
                    (true, _) => load8(ops.as_ptr().add(b * 512)),
                    (false, true) => q4_operands_in_place(tile.add(head)),
                    (false, false) => legacy_operands::<BITS>(tile.add(head)),
                };
                for j in 0..R {
                    let p = xq[j].add(b * QK).cast::<i32>();
                    let init = _mm512_set1_epi32(-offset * *xs[j].add(b));
                    let s = match in_place {
                        true => dot_groups::<true>(&w, p, init),
                        false => dot_groups::<false>(&w, p, init),
                    };
                    let s = _mm512_cvtepi32_ps(s);
                    let dx = *xd[j].add(b);
                    acc[t][j] = _mm512_fmadd_ps(s, _mm512_mul_ps(d, _mm512_set1_ps(dx)), acc[t][j]);
                    if MIN {
                        let xsum = _mm512_set1_ps(dx * *xs[j].add(b) as f32);
                        acc[t][j] = _mm512_fmadd_ps(m, xsum, acc[t][j]);
                    }
                }
            }
        }
    }
    // SAFETY: this function enables AVX-512F, all that `store_rows` needs.
    unsafe { store_rows(y, acc) };
}
