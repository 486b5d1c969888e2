//! Multi-head attention for [Candle](https://github.com/huggingface/candle), as PyTorch
//! users know it.
//!
//! - separate query, key and value inputs: self- and cross-attention, `kdim`/`vdim`;
//! - [`Mask`]: causal with an offset, key padding whose polarity is in its type, additive
//!   float masks, PyTorch's boolean `attn_mask`, and any combination; fully masked rows
//!   give zeros, not NaN;
//! - dropout on the attention weights in training, repeatable under a seed;
//! - per-head attention weights on request;
//! - a caller-owned [`KvCache`] for incremental decoding;
//! - grouped-query and multi-query attention (`n_kv_heads`);
//! - rotary position embeddings ([`RopeConfig`]: theta, partial rotary, linear scaling) and
//!   local (sliding-window) attention, both understood by the fused kernel;
//! - the weight layouts people have: separate q/k/v/o linears, GPT-2's fused `c_attn`
//!   Conv1D, PyTorch's `in_proj_weight` ([`WeightLayout`]);
//! - fused CPU kernels for inference and for training (a flash-attention backward pass
//!   that keeps no `q_len × kv_len` matrix), held to the plain differentiable path and to
//!   PyTorch (the CPU products under it are the `gpt-kernels` crate's).
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
//!
//! # From PyTorch
//!
//! A `torch.nn.MultiheadAttention(embed_dim=64, num_heads=8, batch_first=True)` saved with
//! `torch.save(layer.state_dict(), "mha.pt")` (or with safetensors' `save_file`) loads with
//! [`WeightLayout::TorchInProj`]; [`MhaConfig`]'s docs map every PyTorch argument, and a
//! file that does not fit the config is an error that says what to change.
//!
//! ```no_run
//! use candle_core::{DType, Device, Tensor};
//! use candle_nn::VarBuilder;
//! use mha::{Mask, MhaConfig, MultiHeadAttention, WeightLayout};
//!
//! let dev = Device::Cpu;
//! let vb = VarBuilder::from_pth("mha.pt", DType::F32, &dev)?;
//! // or: unsafe { VarBuilder::from_mmaped_safetensors(&["mha.safetensors"], DType::F32, &dev)? }
//! let attn = MultiHeadAttention::load(&MhaConfig::new(64, 8), &WeightLayout::TorchInProj, vb)?;
//! let x = Tensor::randn(0f32, 1.0, (2, 10, 64), &dev)?; // [batch, seq, embed_dim]
//! // PyTorch: attn(x, x, x, attn_mask=bool_mask, key_padding_mask=padding)
//! let bool_mask = Tensor::zeros((10, 10), DType::U8, &dev)?; // 1 = not allowed
//! let padding = Tensor::zeros((2, 10), DType::U8, &dev)?; // 1 = padding
//! let mask = Mask::NONE.with_disallowed(&bool_mask).with_ignore(&padding);
//! let y = attn.forward(&x, &x, &x, &mask, false)?; // [2, 10, 64]
//! # Ok::<(), candle_core::Error>(())
//! ```

mod attention;
mod cache;
mod config;
mod dropout;
pub mod flash;
mod layout;
mod mask;
mod qk_norm;
mod rope;
mod sdpa;

pub use attention::{AttnWeights, ForwardArgs, MultiHeadAttention};
pub use cache::KvCache;
pub use config::{MhaConfig, QkNorm};
pub use dropout::Dropout;
// The linear layer of the projections (the kernels crate's), for the callers that build them.
pub use gpt_kernels::{OutputAct, Proj};
pub use layout::{neox_to_fused, QkvProj, WeightLayout};
pub use mask::{KeyPadding, Mask};
pub use rope::{Rope, RopeConfig, RopeScaling, RopeTables};
pub use sdpa::{
    masked_softmax, repeat_kv, sdpa, sdpa_reference, sdpa_reference_softcapped, sdpa_softcapped,
    SdpaParams,
};

// The crate README's examples run as doctests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
