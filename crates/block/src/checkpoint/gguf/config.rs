//! The model's configuration from a GGUF file's metadata (`{arch}.*` keys, as llama.cpp
//! reads them per architecture) and from the tensors present (biases, an untied head).

use candle_core::{bail, Device, Result};
use mha::{RopeConfig, RopeScaling};

use super::rope::llama3_from_factors;
use super::Gguf;
use crate::config::{periodic_windows, Activation, GptConfig, NormKind, NormPlacement};
use crate::family::names::gguf;
use crate::family::Family;

impl Gguf {
    /// The model's configuration, from the metadata and the tensors present (biases, an
    /// untied head).
    pub fn config(&self) -> Result<GptConfig> {
        let (arch, family) = self.family()?;
        let key = |k: &str| format!("{arch}.{k}");
        let d = self.need(&key("embedding_length"))?;
        let n_head = self.need(&key("attention.head_count"))?;
        let n_layer = self.need(&key("block_count"))?;
        // Heads may be wider than embedding_length / head_count (Qwen3, Gemma): key_length
        // says so; keys and values of different widths are not supported.
        let head_dim = match self.size(&key("attention.key_length"))? {
            Some(0) => bail!("metadata {arch}.attention.key_length must be positive"),
            Some(n) => n,
            None if d % n_head != 0 => bail!("metadata {arch}.attention.head_count={n_head} must divide {arch}.embedding_length={d}"),
            None => d / n_head,
        };
        if let Some(n) = self.size(&key("attention.value_length"))? {
            if n != head_dim {
                bail!("metadata {arch}.attention.value_length={n} differs from the key length {head_dim}; such models are not supported")
            }
        }
        let n = family.names();
        let weight = |name: &str| format!("{name}.weight");
        let table = weight(n.embed.gguf);
        let Some(&[vocab, width]) = self.shape(&table) else {
            bail!("tensor {table} is missing or not a matrix")
        };
        if width != d {
            bail!("{table} is [{vocab}, {width}] for embedding_length {d}")
        }
        let has = |name: &str| self.content.tensor_infos.contains_key(name);
        // Whether block 0's `part` has a bias: the biases of every block, as llama.cpp reads.
        let bias = |part| format!("{}.bias", n.gguf_block(0, part));
        let rope = match family {
            Family::Gpt2 => None,
            _ => {
                let rotary = self.size(&key("rope.dimension_count"))?.unwrap_or(head_dim);
                if rotary == 0 || rotary > head_dim || rotary % 2 != 0 {
                    bail!("metadata {arch}.rope.dimension_count={rotary} must be even and in 2..={head_dim}")
                }
                let factors = |name: &str| -> Result<Vec<f64>> {
                    let t = self.qtensor(&weight(name), &[rotary / 2], &Device::Cpu)?;
                    Ok(t.dequantize(&Device::Cpu)?
                        .to_vec1::<f32>()?
                        .into_iter()
                        .map(f64::from)
                        .collect())
                };
                let scaling = match self.string(&key("rope.scaling.type"))? {
                    // Phi-3's LongRoPE: a divisor per frequency for short and long contexts.
                    None if has(&weight(gguf::ROPE_FACTORS_LONG)) => RopeScaling::LongRope {
                        short_factor: factors(gguf::ROPE_FACTORS_SHORT)?,
                        long_factor: factors(gguf::ROPE_FACTORS_LONG)?,
                        original_max_position_embeddings: self
                            .need(&key("rope.scaling.original_context_length"))?,
                        attention_factor: self
                            .float(&key("rope.scaling.attn_factor"))?
                            .unwrap_or(1.0),
                    },
                    // Llama 3.1+ keeps its scaling as per-frequency divisors.
                    None if has(&weight(gguf::ROPE_FREQS)) => {
                        let theta = self.float(&key("rope.freq_base"))?.unwrap_or(10_000.0);
                        let factors = self
                            .qtensor(&weight(gguf::ROPE_FREQS), &[rotary / 2], &Device::Cpu)?
                            .dequantize(&Device::Cpu)?
                            .to_vec1::<f32>()?;
                        llama3_from_factors(&factors, theta, rotary)?
                    }
                    None | Some("none") => RopeScaling::None,
                    Some("linear") => match self.float(&key("rope.scaling.factor"))? {
                        Some(factor) if factor > 0.0 => RopeScaling::Linear { factor },
                        f => bail!("metadata {arch}.rope.scaling.factor must be > 0, got {f:?}"),
                    },
                    Some(t) => bail!("metadata {arch}.rope.scaling.type {t:?} is not supported (none and linear are)"),
                };
                Some(RopeConfig {
                    theta: self.float(&key("rope.freq_base"))?.unwrap_or(10_000.0),
                    rotary_dim: (rotary != head_dim).then_some(rotary),
                    scaling,
                })
            }
        };
        let llama_layout = matches!(
            family,
            Family::Llama
                | Family::Mistral
                | Family::Qwen2
                | Family::Qwen3
                | Family::SmolLm3
                | Family::Olmo2
                | Family::Granite
                | Family::Gemma2
                | Family::Gemma3
                | Family::Lfm2
                | Family::Phi3
        );
        let eps_key = match llama_layout {
            true => "attention.layer_norm_rms_epsilon",
            false => "attention.layer_norm_epsilon",
        };
        let token = |k: &str| -> Result<Option<u32>> {
            Ok(self.uint(k)?.and_then(|n| u32::try_from(n).ok()))
        };
        let cfg = GptConfig {
            family,
            model_type: Some(family.model_type().into()),
            vocab_size: vocab,
            n_positions: self.need(&key("context_length"))?,
            n_embd: d,
            n_layer,
            n_head,
            n_kv_head: Some(self.kv_heads(arch, n_head, n_layer)?.0),
            n_inner: Some(self.need(&key("feed_forward_length"))?),
            layer_norm_epsilon: self.float(&key(eps_key))?.unwrap_or(1e-5),
            tie_word_embeddings: !has(&weight(n.head.gguf)),
            bos_token_id: token("tokenizer.ggml.bos_token_id")?,
            eos_token_id: token("tokenizer.ggml.eos_token_id")?,
            resid_pdrop: 0.0,
            embd_pdrop: 0.0,
            attn_pdrop: 0.0,
            rope,
            head_dim: (n_head * head_dim != d).then_some(head_dim),
            ..GptConfig::gpt2()
        };
        let cfg = match family {
            _ if llama_layout => GptConfig {
                activation_function: Activation::Silu,
                norm: NormKind::RmsNorm,
                gated_mlp: true,
                attn_bias: has(&bias(n.attn_proj.q)),
                attn_out_bias: has(&bias(n.attn_proj.o)),
                mlp_bias: has(&bias(n.mlp_proj.up)),
                ..cfg
            },
            // GPT-NeoX checkpoints (Pythia) use the exact GELU; llama.cpp computes its tanh
            // approximation instead.
            Family::GptNeox => GptConfig {
                activation_function: Activation::Gelu,
                norm: NormKind::LayerNorm,
                parallel_residual: self.boolean(&key("use_parallel_residual"))?.unwrap_or(true),
                attn_bias: true,
                attn_out_bias: true,
                mlp_bias: true,
                ..cfg
            },
            _ => cfg,
        };
        let eps = cfg.layer_norm_epsilon;
        let qk_norm = |per_head| Some(mha::QkNorm { per_head, eps });
        let cfg = match family {
            Family::Qwen3 => GptConfig {
                qk_norm: qk_norm(true),
                ..cfg
            },
            Family::Olmo2 => GptConfig {
                qk_norm: qk_norm(false),
                norm_placement: NormPlacement::PostBranch,
                ..cfg
            },
            // llama.cpp's SmolLM3 leaves out the rotation in every fourth layer, a step it
            // fixes rather than reads (the hub's models all have it).
            Family::SmolLm3 => GptConfig {
                no_rope_every: Some(4),
                ..cfg
            },
            Family::Granite => {
                let scale = |k: &str| -> Result<Option<f64>> {
                    Ok(self.float(&key(k))?.filter(|&x| x != 0.0))
                };
                GptConfig {
                    embedding_multiplier: scale("embedding_scale")?.unwrap_or(1.0),
                    residual_multiplier: scale("residual_scale")?.unwrap_or(1.0),
                    attn_scale: scale("attention.scale")?,
                    logits_scaling: scale("logit_scale")?.unwrap_or(1.0),
                    ..cfg
                }
            }
            Family::Gemma2 => self.gemma(arch, cfg, 2)?,
            Family::Gemma3 => self.gemma(arch, cfg, 3)?,
            // LFM2 as llama.cpp runs it: a layer without key/value heads is a short
            // convolution of `shortconv.l_cache` taps (no biases); per-head q/k norms.
            Family::Lfm2 => {
                let (_, conv_layers) = self.kv_heads(arch, n_head, n_layer)?;
                GptConfig {
                    qk_norm: Some(mha::QkNorm {
                        per_head: true,
                        eps: cfg.layer_norm_epsilon,
                    }),
                    conv_layers,
                    conv_taps: self.need(&key("shortconv.l_cache"))?,
                    ..cfg
                }
            }
            _ => cfg,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// The key/value heads of the attention layers, and which layers have none (LFM2's
    /// convolution layers, as runs): `attention.head_count_kv` is one number, or one per
    /// layer (0 for a layer without attention) where llama.cpp's hybrid models keep it.
    fn kv_heads(
        &self,
        arch: &str,
        n_head: usize,
        n_layer: usize,
    ) -> Result<(usize, crate::config::Runs<bool>)> {
        let k = format!("{arch}.attention.head_count_kv");
        let Some(candle_core::quantized::gguf_file::Value::Array(per_layer)) = self.value(&k)
        else {
            return Ok((self.size(&k)?.unwrap_or(n_head), Vec::new()));
        };
        if arch != "lfm2" {
            bail!("metadata {k}: per-layer key/value heads are not supported for {arch}")
        }
        if per_layer.len() != n_layer {
            bail!(
                "metadata {k} has {} entries for {n_layer} layers",
                per_layer.len()
            )
        }
        let counts = per_layer
            .iter()
            // The converter writes Python ints as i32.
            .map(|v| match (v.to_u64(), v.to_i32()) {
                (Ok(n), _) if n <= u32::MAX as u64 => Ok(n as usize),
                (_, Ok(n)) if n >= 0 => Ok(n as usize),
                _ => bail!("metadata {k} must hold non-negative integers"),
            })
            .collect::<Result<Vec<usize>>>()?;
        let mut kv = counts.iter().copied().filter(|&n| n > 0);
        let first = kv.next().unwrap_or(n_head);
        if kv.any(|n| n != first) {
            bail!("metadata {k}: attention layers with different key/value head counts are not supported")
        }
        Ok((first, vec![(counts.iter().map(|&n| n == 0).collect(), 1)]))
    }

    /// Gemma 3 as llama.cpp runs it: GeGLU, sandwich norms (their weights stored as the
    /// factors, `1 + w`), per-head q/k norms, embeddings times `sqrtf(embedding_length)`,
    /// scores times `1/sqrtf(key_length)` (`embedding_length / head_count` for the 62-layer
    /// 27B, which llama.cpp fixes by its layer count), windowed layers by
    /// `attention.sliding_window_pattern` (a flag per layer, or a period whose last layer
    /// is global; 6 when absent) rotating at `rope.freq_base_swa` (10000 when absent),
    /// soft-capped logits.
    ///
    /// Gemma 2 (`generation` 2) as llama.cpp reads it: no q/k norms, a window of 4096 when
    /// absent, a period of 2, every layer at one base unless `rope.freq_base_swa` is given,
    /// the attention scores soft-capped by `attn_logit_softcapping`, and the 27B rule for the
    /// score scale at 46 layers.
    fn gemma(&self, arch: &str, cfg: GptConfig, generation: u8) -> Result<GptConfig> {
        let key = |k: &str| format!("{arch}.{k}");
        let n = cfg.n_layer;
        let gemma2 = generation == 2;
        let sliding = match (self.size(&key("attention.sliding_window"))?, gemma2) {
            (None, true) => Some(4096),
            (w, _) => w,
        };
        let windows = match sliding {
            None | Some(0) => Vec::new(),
            Some(w) => match self.value(&key("attention.sliding_window_pattern")) {
                Some(candle_core::quantized::gguf_file::Value::Array(flags)) => {
                    if flags.len() != n {
                        bail!("metadata {arch}.attention.sliding_window_pattern has {} entries for {n} layers", flags.len())
                    }
                    let pattern = flags
                        .iter()
                        .map(|f| match f.to_bool() {
                            Ok(true) => Ok(Some(w)),
                            Ok(false) => Ok(None),
                            Err(_) => bail!("metadata {arch}.attention.sliding_window_pattern must hold booleans"),
                        })
                        .collect::<Result<Vec<_>>>()?;
                    vec![(pattern, 1)]
                }
                _ => {
                    let p = self
                        .size(&key("attention.sliding_window_pattern"))?
                        .unwrap_or(if gemma2 { 2 } else { 6 });
                    // llama.cpp's set_swa_pattern: every layer windowed for a period of 0.
                    periodic_windows(if p == 0 { usize::MAX } else { p }, n, w)?
                }
            },
        };
        let swa_theta = match (self.float(&key("rope.freq_base_swa"))?, gemma2) {
            (Some(t), _) => Some(t),
            (None, true) => None, // the global base
            (None, false) => Some(10_000.0),
        };
        let rope = match swa_theta {
            Some(theta) => cfg.rope.as_ref().map(|r| RopeConfig {
                theta,
                scaling: RopeScaling::None,
                ..r.clone()
            }),
            None => None,
        };
        let head_dim = match (n, gemma2) {
            (62, false) | (46, true) => cfg.n_embd / cfg.n_head.max(1),
            _ => cfg.head_dim(),
        };
        let cap =
            |k: &str| -> Result<Option<f64>> { Ok(self.float(&key(k))?.filter(|&c| c != 0.0)) };
        Ok(GptConfig {
            activation_function: Activation::GeluNew,
            qk_norm: (!gemma2).then_some(mha::QkNorm {
                per_head: true,
                eps: cfg.layer_norm_epsilon,
            }),
            attn_logit_softcapping: match gemma2 {
                true => cap("attn_logit_softcapping")?,
                false => None,
            },
            norm_placement: NormPlacement::Sandwich,
            embedding_multiplier: (cfg.n_embd as f32).sqrt() as f64,
            attn_scale: Some((1.0 / (head_dim as f32).sqrt()) as f64),
            final_logit_softcapping: cap("final_logit_softcapping")?,
            rope_local: rope,
            windows,
            ..cfg
        })
    }
}
