//! GGUF's block-quantized formats on the CPU: matrices as stored ([`stored`]) and repacked
//! for this CPU's kernels ([`Packed`]), one file per instruction set with the scalar
//! reference beside them.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod format;
mod input;
mod level;
pub mod packed;
mod scalar;
pub mod stored;

pub use packed::Packed;
