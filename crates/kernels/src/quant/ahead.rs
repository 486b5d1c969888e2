//! Requests for the weights a decoding kernel streams from memory, made while it works on
//! the tile before them: spread over the tile's sub-blocks, a few lines each, rather than
//! a burst (see `Ahead` in `packed.rs`), so that the reads overlap the arithmetic.

use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};

/// Part `j` of 8 of the `size` bytes after `tile` (the next super-block's tile, or the
/// next column's first), asked for into the first-level cache. A pointer past the matrix
/// is only a hint: prefetches never fault.
#[inline(always)]
pub(super) fn ahead(tile: *const u8, size: usize, j: usize) {
    let lines = size.div_ceil(64 * 8);
    for l in 0..lines {
        let p = tile.wrapping_add(size + 64 * (j * lines + l));
        // SAFETY: a prefetch is a hint, never a fault, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast()) };
    }
}
