//! Multi-head attention for [Candle](https://github.com/huggingface/candle), as PyTorch
//! users know it.
//!
//! - separate query, key and value inputs: self- and cross-attention, `kdim`/`vdim`;
//! - [`Mask`]: causal with an offset, key padding whose polarity is in its type, additive
//!   float masks, and any combination; fully masked rows give zeros, not NaN;
//! - dropout on the attention weights in training, repeatable under a seed;
//! - per-head attention weights on request;
//! - a caller-owned [`KvCache`] for incremental decoding;
//! - grouped-query and multi-query attention (`n_kv_heads`);
//! - rotary position embeddings ([`RopeConfig`]: theta, partial rotary, linear scaling) and
//!   local (sliding-window) attention, both understood by the fused kernel;
//! - the weight layouts people have: separate q/k/v/o linears, GPT-2's fused `c_attn`
//!   Conv1D, PyTorch's `in_proj_weight` ([`WeightLayout`]);
//! - a fused CPU kernel for inference, held to the plain differentiable path.
//!
//! ```
//! use candle_core::{DType, Device, Tensor};
//! use mha::{KvCache, Mask, MhaConfig, MultiHeadAttention};
//!
//! let dev = Device::Cpu;
//! let varmap = candle_nn::VarMap::new();
//! let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &dev);
//! // 8 query heads sharing 2 key/value heads.
//! let cfg = MhaConfig { n_kv_heads: Some(2), ..MhaConfig::new(64, 8) };
//! let attn = MultiHeadAttention::new(&cfg, vb)?;
//!
//! let xs = Tensor::randn(0f32, 1.0, (1, 6, 64), &dev)?; // [batch, seq, d_model]
//! let full = attn.forward(&xs, &xs, &xs, &Mask::causal(0), false)?;
//!
//! // The same, one token at a time through a KV cache.
//! let mut cache = KvCache::new(16);
//! let mut steps = Vec::new();
//! for t in 0..6 {
//!     let x = xs.narrow(1, t, 1)?;
//!     let mask = Mask::causal(cache.len());
//!     steps.push(attn.forward_cached(&x, &x, &x, &mask, &mut cache)?);
//! }
//! let stepped = Tensor::cat(&steps, 1)?;
//! let diff = (full - stepped)?.abs()?.max_all()?.to_scalar::<f32>()?;
//! assert!(diff < 1e-5);
//! # Ok::<(), candle_core::Error>(())
//! ```

mod attention;
mod cache;
mod config;
mod dropout;
pub mod kernel;
mod layout;
mod mask;
pub mod matvec;
mod rope;
mod simd;

pub use attention::{
    masked_softmax, repeat_kv, sdpa, sdpa_reference, AttnWeights, ForwardArgs, MultiHeadAttention,
    SdpaParams,
};
pub use cache::KvCache;
pub use config::MhaConfig;
pub use dropout::Dropout;
pub use layout::{neox_to_fused, Proj, QkvProj, WeightLayout};
pub use mask::{KeyPadding, Mask};
pub use rope::{Rope, RopeConfig, RopeScaling, RopeTables};

// The crate README's examples run as doctests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
