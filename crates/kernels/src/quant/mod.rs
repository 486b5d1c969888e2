//! GGUF's block-quantized formats on the CPU: matrices as stored ([`stored`]) and repacked
//! for this CPU's kernels ([`packed`]).

pub mod packed;
pub mod stored;

pub use packed::Packed;
