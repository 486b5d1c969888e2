//! Nothing here: the workspace root exists for its tests in `tests/`.

// The workspace README's examples run as doctests.
#[doc = include_str!("../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

/// mha's CUDA attention kernel (`crates/mha/kernels/attention.cu`) compiled for the CPU
/// with the CUDA built-ins emulated (`tests/support/cuda_emulation.cpp`).
pub mod cuda_emulation {
    extern "C" {
        /// Runs the kernel's instance for `kind` (0 f32 throughout, 1 f32 queries with
        /// f16 keys and values, 2 the same with bf16, 3 all f16, 4 all bf16; half
        /// precision as 16-bit patterns) and head dimension `d`: with `decode` 0 the
        /// thread-per-query kernel over `(ceil(tq / 64), h, b)` blocks of 64 threads,
        /// with 1 the block-per-query one over `(tq, h, b)` blocks of 128. `strides`: nine
        /// element strides, q's, k's and v's for batch, head and position. Returns -1
        /// where there is no such instance.
        #[allow(clippy::too_many_arguments)]
        pub fn mha_attention_emulated(
            kind: i32,
            decode: i32,
            d: i32,
            q: *const std::ffi::c_void,
            k: *const std::ffi::c_void,
            v: *const std::ffi::c_void,
            out: *mut std::ffi::c_void,
            b: i32,
            h: i32,
            h_kv: i32,
            tq: i32,
            tk: i32,
            strides: *const i64,
            causal: i32,
            offset: i32,
            window: i32,
            scale: f32,
            softcap: f32,
        ) -> i32;
    }
}
