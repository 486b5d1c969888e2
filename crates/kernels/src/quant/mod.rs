//! GGUF's block-quantized formats on the CPU: matrices as stored ([`stored`]) and repacked
//! for this CPU's kernels ([`Packed`]), one file per instruction set with the scalar
//! reference beside them.

mod ahead;
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

use candle_core::quantized::GgmlDType;

/// A GGUF type by llama.cpp's name for it (`q4_K`, `q8_0`, `f16`), as its tools print it.
pub fn type_name(dtype: GgmlDType) -> &'static str {
    match dtype {
        GgmlDType::F32 => "f32",
        GgmlDType::F16 => "f16",
        GgmlDType::BF16 => "bf16",
        GgmlDType::Q4_0 => "q4_0",
        GgmlDType::Q4_1 => "q4_1",
        GgmlDType::Q5_0 => "q5_0",
        GgmlDType::Q5_1 => "q5_1",
        GgmlDType::Q8_0 => "q8_0",
        GgmlDType::Q8_1 => "q8_1",
        GgmlDType::Q2K => "q2_K",
        GgmlDType::Q3K => "q3_K",
        GgmlDType::Q4K => "q4_K",
        GgmlDType::Q5K => "q5_K",
        GgmlDType::Q6K => "q6_K",
        GgmlDType::Q8K => "q8_K",
    }
}
