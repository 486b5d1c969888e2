//! Transformer blocks and one decoder model for fourteen checkpoint families on
//! [Candle](https://github.com/huggingface/candle), built on the `mha` attention crate.
//!
//! - [`Block`]: norms (LayerNorm or RMSNorm, before and/or after each part), attention
//!   (rotary or not, global or local, q/k norms, soft-capped scores) or a gated short
//!   convolution (LFM2), an MLP (plain or gated), residuals in sequence or in parallel,
//!   dropout;
//! - [`Gpt`]: embeddings, blocks, final norm, tied or separate LM head; training mode with
//!   dropout and a next-token loss (every family but GPT-NeoX, whose fused q/k/v rows are
//!   regrouped at load), cached decoding, left-padded batches. The [`Family`]
//!   (GPT-2, Llama, Mistral, Qwen2, Qwen3, SmolLM3, OLMo 2, Granite, Gemma 2, Gemma 3,
//!   Phi-3/Phi-4-mini, LFM2, GPT-NeoX, GPT-Neo) decides the parts and the tensor names,
//!   nothing else;
//! - [`load()`]: any checkpoint by its path, with [`LoadOptions`] (dtype, quantized while
//!   loading, fused for inference):
//!   - Hugging Face directories of any family (`config.json` in either generation of field
//!     names + safetensors, sharded or not, with or without the root prefix);
//!     [`save_dir`]: GPT-2 and Llama directories;
//!   - llama.cpp's GGUF files (gpt2, llama, qwen2, qwen3, smollm3, olmo2, granite, gemma2,
//!     gemma3, phi3, lfm2, gptneox; [`Gguf`]), block-quantized
//!     matrices kept as stored, the tokenizer's metadata checked ([`GgufVocab`]);
//!     [`save_gguf`]: any model as a GGUF file llama.cpp runs;
//!   - nanoGPT `ckpt.pt` checkpoints;
//! - [`generate()`]: greedy and sampled generation (temperature, top-k, top-p, repeat
//!   penalty), reproducible under a seed.
//!
//! ```
//! use gpt_blocks::{generate, GenerateOptions, Gpt, GptConfig, Logits, SamplingParams};
//! use candle_core::{DType, Device, Tensor};
//!
//! let cfg = GptConfig { vocab_size: 100, n_positions: 32, n_embd: 32, n_layer: 2, n_head: 4,
//!                       ..GptConfig::gpt2() };
//! let varmap = candle_nn::VarMap::new();
//! let model = Gpt::new(&cfg, candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu))?;
//!
//! let ids = Tensor::new(&[[1u32, 2, 3, 4]], &Device::Cpu)?;
//! let logits = model.infer(&ids, None, None, Logits::All)?;
//! assert_eq!(logits.dims(), &[1, 4, 100]);
//!
//! let opts = GenerateOptions { max_new_tokens: 5, sampling: SamplingParams::default(), stop_tokens: vec![] };
//! let new = generate(&model, &[vec![1, 2, 3]], &opts, |_, _| true)?;
//! assert_eq!(new[0].len(), 5);
//! # Ok::<(), candle_core::Error>(())
//! ```

mod checkpoint;
mod config;
mod family;
pub mod generate;
mod model;
mod optim;
mod parts;

pub use checkpoint::check::available_memory;
pub use checkpoint::gguf::save::save_gguf;
pub use checkpoint::gguf::vocab::GgufVocab;
pub use checkpoint::gguf::Gguf;
pub use checkpoint::io::write_atomic;
pub use checkpoint::load::load;
pub use checkpoint::nanogpt::{load_nanogpt, nanogpt_config};
pub use checkpoint::options::LoadOptions;
pub use checkpoint::safetensors::{
    load_bytes, load_files, parts_of_stored, read_config, save_dir, save_dir_as, weight_files,
};
pub use config::{Activation, GptConfig, NormKind, NormPlacement};
pub use family::Family;
pub use generate::{
    argmax, generate, generate_steered, left_padded, GenerateOptions, Sampler, SamplingParams,
    SplitMix64, Steer,
};
pub use model::{
    next_token_loss, softcap, token_logprobs, Embedding, Gpt, GptCache, Logits, RopeSet,
    StoredTensor,
};
pub use optim::{AdamW, AdamWParams};
pub use parts::block::Block;
pub use parts::mixer::Mixer;
pub use parts::mlp::Mlp;
pub use parts::norm::{LayerNorm, Norm, RmsNorm};
pub use parts::short_conv::ShortConv;

// The crate README's examples run as doctests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
