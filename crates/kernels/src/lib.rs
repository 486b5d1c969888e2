//! The CPU products under the models of `mha` and `gpt-blocks`, on Candle tensors:
//!
//! - [`Proj`]: the linear layer behind every matrix of a model, over dense weights (f32,
//!   f16, bf16, read as stored), Candle's block-quantized matrices, or a matrix repacked once
//!   for this CPU ([`quant::Packed`]), choosing the product by the number of rows;
//! - [`dense`]: products of few rows (decoding) and the prefill GEMM with its activation;
//! - [`quant`]: the GGUF block formats (q8_0, q4_0, q5_0, q4_1, q5_1, q2_K to q6_K) as stored
//!   and repacked, the AVX-512 VNNI and AVX2 kernels, and the scalar reference beside them;
//! - [`simd`]: the row kernels (dot, axpy, softmax pieces, activations) per instruction set;
//! - [`ops`] and [`act`]: LayerNorm, RMSNorm, linear, cross-entropy, SwiGLU and GELU as
//!   fused ops with their backward passes, for training;
//! - [`team`]: the helper threads of a decoding step; [`memory`]: weight buffers on huge
//!   pages; [`profile`]: where a decoding step's time goes (with the `profile` feature);
//!   [`floor`]: the memory-read rate that bounds decoding, measured between its steps;
//!   [`cpu_kernels`]: which devices take all this (the CPU, unless `GPT_GENERIC_PATHS=1`).
//!
//! Kernels are chosen at run time: the same binary runs on CPUs without AVX-512.
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use gpt_kernels::Proj;
//!
//! let dev = Device::Cpu;
//! let w_t = Tensor::randn(0f32, 1.0, (64, 32), &dev)?; // [in, out]
//! let proj = Proj::new(w_t.clone(), None);
//! let xs = Tensor::randn(0f32, 1.0, (2, 64), &dev)?;
//! let ys = proj.forward(&xs)?; // [2, 32]
//! let diff = (ys - xs.matmul(&w_t)?)?.abs()?.max_all()?.to_scalar::<f32>()?;
//! assert!(diff < 1e-4);
//! # Ok::<(), candle_core::Error>(())
//! ```

pub mod act;
pub mod dense;
pub mod floor;
pub mod memory;
pub mod ops;
mod paths;
pub mod profile;
mod proj;
pub mod quant;
mod shared;
pub mod simd;
pub mod storage;
pub mod team;

pub use dense::OutputAct;
pub use paths::cpu_kernels;
pub use proj::Proj;
