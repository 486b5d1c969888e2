//! Buffers for model weights.

/// A vector of `len` copies of `value`, for a large buffer that lives as long as the model
/// and is read whole for every token (a weight matrix). On Linux its memory is marked for
/// transparent huge pages (`madvise(MADV_HUGEPAGE)`) before the first write, so that its
/// pages are 2 MiB where the system allows: streaming a matrix through 4 KiB pages misses
/// the TLB on every page. The rest of the process stays on small pages, where a huge page
/// would be mostly empty.
///
/// A matrix of 256 KiB or more also has the huge pages at its two ends made whole
/// (`MADV_COLLAPSE`, Linux 6.1 on; elsewhere nothing happens): a matrix smaller than a huge
/// page holds no whole one of its own. Quantized tiles take [`packed_weight_vec`] or
/// [`packed_weight_zeroed`] instead.
/// (Measured in docs/PERFORMANCE.md, "Memory".)
pub fn weight_vec<T: Copy>(len: usize, value: T) -> Vec<T> {
    let v = packed_weight_vec(len, value);
    let bytes = std::mem::size_of_val(v.as_slice());
    #[cfg(target_os = "linux")]
    if bytes >= COLLAPSE_MIN {
        collapse_huge_pages(v.as_ptr() as usize, bytes);
    }
    v
}

/// [`weight_vec`] without the collapsed end pages, for quantized tiles: their models are
/// small, and making each matrix's end pages whole would cost more memory, relative to
/// them, than the speed it buys (docs/PERFORMANCE.md, "Memory"). A model fused for
/// inference moves them into shared slabs instead ([`slab_bytes`]), where they fill whole
/// huge pages.
pub fn packed_weight_vec<T: Copy>(len: usize, value: T) -> Vec<T> {
    let mut v = Vec::with_capacity(len);
    #[cfg(target_os = "linux")]
    advise_huge_pages(v.as_ptr() as usize, len * std::mem::size_of::<T>());
    v.resize(len, value);
    v
}

/// [`packed_weight_vec`] of zeros, written by rayon's threads: the first write to each
/// page has the system zero it (in a virtual machine that costs more than packing the
/// weights into it), and the threads share that work. Written only after the advice, as
/// [`packed_weight_vec`] does: memory written before it stays on small pages (a
/// `vec![0; len]` from the allocator did, and decoding through a model's token table on
/// small pages ran 4–5% slower).
pub fn packed_weight_zeroed(len: usize) -> Vec<u8> {
    use rayon::prelude::*;
    let mut v = Vec::<u8>::with_capacity(len);
    #[cfg(target_os = "linux")]
    advise_huge_pages(v.as_ptr() as usize, len);
    v.spare_capacity_mut()[..len]
        .par_chunks_mut(1 << 21)
        .for_each(|c| c.fill(std::mem::MaybeUninit::new(0)));
    // SAFETY: the first `len` bytes were all written just above.
    unsafe { v.set_len(len) };
    v
}

/// The smallest buffer whose end pages [`weight_vec`] collapses: norms and biases (a few
/// KiB each, dozens of them) would each make a whole huge page resident.
#[cfg(target_os = "linux")]
const COLLAPSE_MIN: usize = 256 << 10;

/// Asks for huge pages on the whole 2 MiB pages inside `[start, start + bytes)`; a system
/// without them, or a range without a whole one, is left as it is.
#[cfg(target_os = "linux")]
fn advise_huge_pages(start: usize, bytes: usize) {
    const HUGE: usize = 1 << 21;
    let first = start.next_multiple_of(HUGE);
    let end = (start + bytes) / HUGE * HUGE;
    if end > first {
        // SAFETY: advice on whole pages of memory this process allocated and owns; the
        // kernel changes no contents and the result (unsupported, say) is only advisory.
        unsafe { libc::madvise(first as *mut libc::c_void, end - first, libc::MADV_HUGEPAGE) };
    }
}

/// Turns the 2 MiB pages that `[start, start + bytes)` touches into huge pages now,
/// copying what is already there (`MADV_COLLAPSE`: Linux 6.1 on, whatever the system's
/// THP mode; an older kernel refuses it and nothing changes).
#[cfg(target_os = "linux")]
fn collapse_huge_pages(start: usize, bytes: usize) {
    /// `MADV_COLLAPSE` from the kernel's `mman-common.h` (not in every libc's bindings).
    const MADV_COLLAPSE: libc::c_int = 25;
    const HUGE: usize = 1 << 21;
    let first = start / HUGE * HUGE;
    let end = (start + bytes).next_multiple_of(HUGE);
    // SAFETY: advice on mapped memory of this process; a collapse keeps every byte's
    // contents (neighbouring allocations in the end pages included) and only changes the
    // page size, and a refusal (unmapped gaps, an old kernel) is only advisory.
    unsafe { libc::madvise(first as *mut libc::c_void, end - first, MADV_COLLAPSE) };
}

/// Packed matrices side by side in shared mappings ([`slab_bytes`]).
#[cfg(unix)]
mod slab {
    #[cfg(target_os = "linux")]
    use super::advise_huge_pages;

    /// Bytes carved from a shared slab of huge pages ([`slab_bytes`]): a packed matrix's
    /// tiles, beside the model's other matrices with no gap between them.
    pub struct SlabBytes {
        slab: std::sync::Arc<Slab>,
        start: usize,
        len: usize,
    }

    /// One mapping of [`SLAB`] bytes or more, its whole 2 MiB pages advised as huge; unmapped
    /// when the last of its [`SlabBytes`] goes.
    struct Slab {
        ptr: *mut u8,
        len: usize,
    }

    // SAFETY: the slab is plain memory; each `SlabBytes` owns a disjoint range of it.
    unsafe impl Send for Slab {}
    unsafe impl Sync for Slab {}

    /// Bytes of one slab: 16 huge pages (a model's quantized layers span several).
    const SLAB: usize = 32 << 20;

    /// The slab new ranges are carved from, and how much of it is taken; held weakly, so that
    /// a slab whose matrices are all dropped is unmapped.
    static CURRENT: std::sync::Mutex<(std::sync::Weak<Slab>, usize)> =
        std::sync::Mutex::new((std::sync::Weak::new(), 0));

    impl Slab {
        /// A fresh anonymous mapping of at least `len` bytes (zeros, paged in on first touch),
        /// or `None` where the system refuses one.
        fn map(len: usize) -> Option<Slab> {
            const HUGE: usize = 1 << 21;
            let len = len.max(SLAB).next_multiple_of(HUGE);
            // SAFETY: an anonymous private mapping at an address of the kernel's choosing.
            let ptr = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len + HUGE,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if ptr == libc::MAP_FAILED {
                return None;
            }
            // Aligned to a huge page: the unaligned head and the tail beyond `len` go back.
            let (base, end) = (ptr as usize, ptr as usize + len + HUGE);
            let start = base.next_multiple_of(HUGE);
            // SAFETY: both ranges lie inside the mapping just made and hold nothing yet.
            unsafe {
                if start > base {
                    libc::munmap(base as *mut libc::c_void, start - base);
                }
                if end > start + len {
                    libc::munmap((start + len) as *mut libc::c_void, end - start - len);
                }
            }
            #[cfg(target_os = "linux")]
            advise_huge_pages(start, len);
            Some(Slab {
                ptr: start as *mut u8,
                len,
            })
        }
    }

    impl Drop for Slab {
        fn drop(&mut self) {
            // SAFETY: the mapping made in `map`, no longer referenced by any `SlabBytes`.
            unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
        }
    }

    impl SlabBytes {
        /// The bytes, to write.
        pub fn as_mut_slice(&mut self) -> &mut [u8] {
            // SAFETY: `start..start + len` lies in the slab and belongs to this value alone.
            unsafe { std::slice::from_raw_parts_mut(self.slab.ptr.add(self.start), self.len) }
        }
    }

    impl std::ops::Deref for SlabBytes {
        type Target = [u8];
        fn deref(&self) -> &[u8] {
            // SAFETY: as in `as_mut_slice`.
            unsafe { std::slice::from_raw_parts(self.slab.ptr.add(self.start), self.len) }
        }
    }

    impl Drop for SlabBytes {
        /// The range's whole pages go back to the system now; the slab itself when its last
        /// range goes.
        fn drop(&mut self) {
            const PAGE: usize = 4096;
            let start = (self.slab.ptr as usize + self.start).next_multiple_of(PAGE);
            let end = (self.slab.ptr as usize + self.start + self.len) / PAGE * PAGE;
            if end > start {
                // SAFETY: whole pages of this range, which nothing reads after this.
                unsafe {
                    libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED)
                };
            }
        }
    }

    /// `len` zero bytes side by side with the previous ranges of the current slab (a new slab
    /// when they do not fit), 64-byte aligned: the packed matrices of a model then fill whole
    /// huge pages, where each of its own allocations (a small model's matrices are a few MiB or
    /// less) held none, and the pages they share hold no gaps or freed neighbours to make
    /// resident. `None` where the system gives no mapping.
    pub fn slab_bytes(len: usize) -> Option<SlabBytes> {
        let mut current = CURRENT.lock().unwrap_or_else(|e| e.into_inner());
        let (weak, used) = &mut *current;
        let start = used.next_multiple_of(64);
        let slab = match weak.upgrade() {
            Some(slab) if start + len <= slab.len => slab,
            _ => {
                let slab = std::sync::Arc::new(Slab::map(len)?);
                *weak = std::sync::Arc::downgrade(&slab);
                *used = 0;
                return Some(carve(slab, 0, len, used));
            }
        };
        Some(carve(slab, start, len, used))
    }

    fn carve(slab: std::sync::Arc<Slab>, start: usize, len: usize, used: &mut usize) -> SlabBytes {
        *used = start + len;
        SlabBytes { slab, start, len }
    }
}
#[cfg(unix)]
pub use slab::{slab_bytes, SlabBytes};

#[cfg(test)]
mod tests {
    use super::*;

    /// Slab ranges are zeroed, 64-byte aligned and disjoint: writing one leaves the
    /// others as they were, dropping one leaves the others' bytes, and a range larger than
    /// a slab gets one of its own.
    #[cfg(unix)]
    #[test]
    fn slab_ranges_are_disjoint() {
        let mut ranges: Vec<SlabBytes> = [1000, 4096, 77, 3 << 20, 5, 40 << 20, 123_457]
            .into_iter()
            .map(|len| slab_bytes(len).expect("a mapping"))
            .collect();
        for (i, r) in ranges.iter_mut().enumerate() {
            assert_eq!(r.as_ptr() as usize % 64, 0);
            assert!(r.iter().all(|&b| b == 0), "range {i} not zeroed");
            r.as_mut_slice().fill(i as u8 + 1);
        }
        ranges.remove(2);
        ranges.remove(0);
        for r in &ranges {
            let first = r[0];
            assert!(first != 0 && r.iter().all(|&b| b == first));
        }
    }

    #[test]
    fn weight_vec_holds_len_copies_of_value() {
        for len in [0, 1, 4095, (4 << 20) + 3] {
            let v = weight_vec(len, 0x88u8);
            assert_eq!(v.len(), len);
            assert!(v.iter().all(|&b| b == 0x88));
        }
        let v = weight_vec(3 << 20, half::f16::from_f32(-1.5));
        assert!(v.iter().all(|x| x.to_f32() == -1.5));
    }

    /// Collapsing a matrix's end pages copies whatever shares them: buffers allocated
    /// around matrices keep their bytes.
    #[test]
    fn weight_vec_keeps_its_neighbours_bytes() {
        let mut kept = Vec::new();
        let mut weights = Vec::new();
        for i in 0..8u8 {
            kept.push(vec![
                i.wrapping_mul(37) | 1;
                (100 << 10) + i as usize * 4099
            ]);
            weights.push(weight_vec((300 << 10) + i as usize * 8191, i));
        }
        for (i, (k, w)) in kept.iter().zip(&weights).enumerate() {
            assert!(k.iter().all(|&b| b == (i as u8).wrapping_mul(37) | 1));
            assert!(w.iter().all(|&b| b == i as u8));
        }
    }
}
