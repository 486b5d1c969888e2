//! How `gpt` holds memory: mimalloc as the allocator, its arenas committed page by page,
//! freed memory handed back to the OS after a prefill and kept in training. The
//! measurements behind each choice are in docs/PERFORMANCE.md ("Memory").

// glibc hands large freed buffers back to the OS, so every big temporary is faulted in
// again on the next op; mimalloc keeps them.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's `mi_option_arena_eager_commit` (its place in `mi_option_e`, the same in
/// mimalloc 2 and 3).
#[cfg(target_os = "linux")]
const MI_OPTION_ARENA_EAGER_COMMIT: libmimalloc_sys::mi_option_t = 4;

/// Commits mimalloc's arenas page by page as they are used. By default it commits each
/// arena whole where the OS overcommits, and marks it for transparent huge pages: every
/// 2 MiB region the heap touches then takes 2 MiB of memory, where the weights (the only
/// data that gains from huge pages) ask for them themselves
/// (`gpt_kernels::memory::weight_vec`). Runs from `.init_array`, before Rust's runtime
/// allocates anything: the first arena is reserved by the first allocation, with the
/// setting of that moment. MIMALLOC_ARENA_EAGER_COMMIT in the environment still wins.
#[cfg(target_os = "linux")]
#[used]
#[link_section = ".init_array"]
static LAZY_ARENAS: extern "C" fn() = {
    extern "C" fn lazy_arenas() {
        // SAFETY: `getenv` with a NUL-terminated name (no allocation, nothing else runs
        // yet), then a plain call on mimalloc's option table.
        unsafe {
            if libc::getenv(c"MIMALLOC_ARENA_EAGER_COMMIT".as_ptr()).is_null() {
                libmimalloc_sys::mi_option_set(MI_OPTION_ARENA_EAGER_COMMIT, 0);
            }
        }
    }
    lazy_arenas
};

/// Hands the memory freed since the last call back to the OS now, rather than after
/// mimalloc's purge delay: called after a prefill, whose temporaries are tens of MiB
/// against a decoding step's few KiB. Kept, they would stay in the process's memory for
/// the decoding that follows, and the next prefill's sizes reuse only part of them, so
/// peaks would grow from prefill to prefill. Not in training, which keeps freed memory on
/// purpose ([`keep_freed_memory`]).
pub(crate) fn release_freed_memory() {
    // SAFETY: a plain FFI call; mimalloc collects the calling thread's heap and purges
    // the free pages of its arenas.
    unsafe { libmimalloc_sys::mi_collect(true) }
}

/// mimalloc's `mi_option_purge_delay` (its place in `mi_option_e`, the same in mimalloc 2
/// and 3; libmimalloc-sys does not name it) and its documented defaults: 10 ms in
/// mimalloc 2, 1000 ms in mimalloc 3 (what libmimalloc-sys 0.1.49 builds).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;
const MI_DEFAULT_PURGE_DELAYS: [std::os::raw::c_long; 2] = [10, 1000];

/// Training keeps freed memory for reuse instead of returning it to the OS once it has
/// been free for the purge delay: a step frees and reallocates hundreds of large
/// temporaries, and returned ones would fault in again. The cost is that the process
/// keeps its peak memory until it exits, which inference need not pay.
/// MIMALLOC_PURGE_DELAY in the environment still wins.
pub(crate) fn keep_freed_memory() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
        return;
    }
    // SAFETY: plain FFI calls on mimalloc's option table. The default is checked first, so
    // a future mimalloc that numbers its options differently is left alone.
    unsafe {
        let delay = libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY);
        if MI_DEFAULT_PURGE_DELAYS.contains(&delay) {
            libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1);
        }
    }
}
