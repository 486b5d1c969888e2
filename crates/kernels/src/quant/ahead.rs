//! Requests for the weights a decoding kernel streams from memory, made while it works on
//! the tile before them: spread over the tile's sub-blocks, a few lines each, rather than
//! a burst (see `Ahead` in `packed.rs`), so that the reads overlap the arithmetic.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};

/// Whether and how far a k-quant kernel asks ahead for the tiles it streams.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Spread {
    /// No requests (the weights sit in the cache, or the hardware prefetchers suffice).
    Off,
    /// The next tile, into the first-level cache.
    Next,
    /// The tile [`FAR`] on, into the second-level cache: more reads in flight where one
    /// tile ahead is too near for the memory's latency (a Zen 4, `Ahead` in `packed.rs`);
    /// and the tile [`NEAR`] on, by then in the second level, into the first.
    Far,
}

/// How many tiles on [`Spread::Far`] asks into the second-level cache.
#[cfg(target_arch = "x86_64")]
pub(super) const FAR: usize = 4;

/// How many tiles on [`Spread::Far`] asks into the first-level cache: the kernels' loads
/// of a tile from the second level waited too (on a Zen 4 q6_K's head-sized product read
/// 0.92–0.96 of the read floor with these requests, 0.87–0.93 without; docs/PERFORMANCE.md,
/// "Quantized products").
#[cfg(target_arch = "x86_64")]
const NEAR: usize = 2;

/// Part `j` of 8 of a tile's `size` bytes as `spread` says: the tile after `tile` (the
/// next super-block's, or the next column's first) or the ones [`FAR`] and [`NEAR`] on. A
/// pointer past the matrix is only a hint: prefetches never fault.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn ahead(tile: *const u8, size: usize, j: usize, spread: Spread) {
    let tiles = match spread {
        Spread::Off => return,
        Spread::Next => 1,
        Spread::Far => FAR,
    };
    let lines = size.div_ceil(64 * 8);
    for l in 0..lines {
        let p = tile.wrapping_add(tiles * size + 64 * (j * lines + l));
        // SAFETY: a prefetch is a hint, never a fault, whatever the address.
        unsafe {
            match spread {
                Spread::Far => {
                    _mm_prefetch::<_MM_HINT_T1>(p.cast());
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_sub((FAR - NEAR) * size).cast());
                }
                _ => _mm_prefetch::<_MM_HINT_T0>(p.cast()),
            }
        }
    }
}
