//! Buffers for model weights.

/// A vector of `len` copies of `value`, for a large buffer that lives as long as the model
/// and is read whole for every token (a weight matrix). On Linux its memory is marked for
/// transparent huge pages (`madvise(MADV_HUGEPAGE)`, before the first write, so the pages
/// are 2 MiB from the start where the system allows it): streaming a matrix through
/// 4 KiB pages misses the TLB every page. The rest of the process stays on small pages,
/// where a huge page would be mostly empty. Measured on GPT-2 124M f16 decoding (2 threads,
/// alternating runs, medians of 8): the same speed as an allocator that puts the whole
/// heap on huge pages, 4–7% above small pages, at 31 MiB less peak memory than the former.
pub fn weight_vec<T: Copy>(len: usize, value: T) -> Vec<T> {
    let mut v = Vec::with_capacity(len);
    #[cfg(target_os = "linux")]
    advise_huge_pages(v.as_ptr() as usize, len * std::mem::size_of::<T>());
    v.resize(len, value);
    v
}

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
