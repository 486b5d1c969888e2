//! LFM2 (LiquidAI's on-device models, `lfm2`): a hybrid stack whose blocks mix tokens by
//! grouped-query attention (per-head q/k RMSNorm `q_layernorm`/`k_layernorm`, `out_proj`)
//! or by a gated short convolution (`conv.in_proj`, `conv.conv`, `conv.out_proj`), by
//! `layer_types` (`full_attention`, `conv`) or the hub's `full_attn_idxs`; each block's
//! norms are `operator_norm` and `ffn_norm`, its SwiGLU `feed_forward.w1`/`w3`/`w2`
//! (the width adjusted as `block_auto_adjust_ff_dim` says), the final norm
//! `model.embedding_norm`.

use candle_core::{bail, Result};
use mha::QkNorm;
use serde_json::{json, Value};

use super::fields::{base, free_head_dim, Fields};
use super::id::Family;
use super::llama;
use super::names::{gguf, name, AttnNames, MlpNames, ShortConvNames, TensorNames};
use crate::config::{Activation, GptConfig, NormKind};

pub(super) const NAMES: TensorNames = TensorNames {
    attn_norm: name("operator_norm", gguf::ATTN_NORM),
    attn_proj: AttnNames {
        o: name("out_proj", gguf::ATTN_OUTPUT),
        q_norm: name("q_layernorm", gguf::ATTN_Q_NORM),
        k_norm: name("k_layernorm", gguf::ATTN_K_NORM),
        ..llama::NAMES.attn_proj
    },
    mlp_norm: name("ffn_norm", gguf::FFN_NORM),
    mlp: "feed_forward",
    mlp_proj: MlpNames {
        up: name("w3", gguf::FFN_UP),
        gate: Some(name("w1", gguf::FFN_GATE)),
        down: name("w2", gguf::FFN_DOWN),
        conv1d: false,
    },
    final_norm: name("model.embedding_norm", "token_embd_norm"),
    short_conv: Some(ShortConvNames {
        module: "conv",
        in_proj: name("in_proj", gguf::SHORTCONV_IN_PROJ),
        conv: name("conv", gguf::SHORTCONV_CONV),
        out_proj: name("out_proj", gguf::SHORTCONV_OUT_PROJ),
    }),
    ..llama::NAMES
};

/// Reads an LFM2 `config.json`.
pub(super) fn read(f: &Fields) -> Result<GptConfig> {
    let d = f.need("hidden_size")?;
    let h = f.need("num_attention_heads")?;
    let n_layer = f.need("num_hidden_layers")?;
    let (hd, head_dim) = free_head_dim(f, d, h)?;
    let conv_layers = match f.get("layer_types") {
        Some(Value::Array(types)) => {
            if types.len() != n_layer {
                bail!(
                    "config: layer_types has {} entries for num_hidden_layers={n_layer}",
                    types.len()
                )
            }
            let pattern = types
                .iter()
                .map(|t| match t.as_str() {
                    Some("conv") => Ok(true),
                    Some("full_attention") => Ok(false),
                    _ => bail!(
                        "config: layer_types entry {t} is not supported (full_attention, conv)"
                    ),
                })
                .collect::<Result<Vec<bool>>>()?;
            vec![(pattern, 1)]
        }
        Some(v) => bail!("config: layer_types must be a list, got {v}"),
        // transformers: every layer attends unless full_attn_idxs lists some.
        None => match f.get("full_attn_idxs") {
            None => Vec::new(),
            Some(Value::Array(idxs)) => {
                let mut at = idxs
                    .iter()
                    .map(|i| match i.as_u64() {
                        Some(i) if i < n_layer as u64 => Ok(i as usize),
                        _ => {
                            bail!("config: full_attn_idxs entry {i} is not a layer below {n_layer}")
                        }
                    })
                    .collect::<Result<Vec<usize>>>()?;
                at.sort_unstable();
                at.dedup();
                // As runs: the convolution blocks between attention blocks, so that a
                // config claiming many layers costs only its list.
                let mut runs = Vec::new();
                let mut next = 0;
                for i in at {
                    if i > next {
                        runs.push((vec![true], i - next));
                    }
                    runs.push((vec![false], 1));
                    next = i + 1;
                }
                if n_layer > next {
                    runs.push((vec![true], n_layer - next));
                }
                runs
            }
            Some(v) => bail!("config: full_attn_idxs must be a list, got {v}"),
        },
    };
    let taps = f.usize("conv_L_cache")?.unwrap_or(3);
    let eps = f.f64("norm_eps")?.unwrap_or(1e-5);
    Ok(GptConfig {
        n_embd: d,
        n_layer,
        n_head: h,
        n_kv_head: Some(f.usize("num_key_value_heads")?.unwrap_or(h)),
        n_inner: Some(ff_width(f)?),
        activation_function: Activation::Silu,
        layer_norm_epsilon: eps,
        norm: NormKind::RmsNorm,
        head_dim,
        qk_norm: Some(QkNorm {
            per_head: true,
            eps,
        }),
        rope: Some(f.rope(hd, 1.0, None, None)?),
        gated_mlp: true,
        attn_bias: false,
        attn_out_bias: false,
        mlp_bias: false,
        conv_layers,
        conv_taps: taps,
        conv_bias: f.bool("conv_bias")?.unwrap_or(false),
        // The hub's older files say tie_embedding.
        ..base(Family::Lfm2, f, f.bool("tie_embedding")?.unwrap_or(true))?
    })
}

/// The MLP's width as transformers' `Lfm2MLP` derives it: `intermediate_size` (or the
/// hub's `block_ff_dim`), with `block_auto_adjust_ff_dim`: two thirds of it, times
/// `block_ffn_dim_multiplier`, rounded up to a multiple of `block_multiple_of`.
fn ff_width(f: &Fields) -> Result<usize> {
    let size = match f.usize("intermediate_size")? {
        Some(n) => n,
        None => f.need("block_ff_dim")?,
    };
    if !f.bool("block_auto_adjust_ff_dim")?.unwrap_or(true) {
        return Ok(size);
    }
    let mut width = (2 * size / 3) as f64;
    // Absent: 1; null: no multiplier and no rounding (transformers' `is not None`).
    let multiplier = match f.obj.get("block_ffn_dim_multiplier") {
        None => Some(1.0),
        Some(_) => f.f64("block_ffn_dim_multiplier")?,
    };
    if let Some(m) = multiplier {
        if m <= 0.0 {
            bail!("config: block_ffn_dim_multiplier must be positive, got {m}")
        }
        let multiple = f.usize("block_multiple_of")?.unwrap_or(256);
        if multiple == 0 {
            bail!("config: block_multiple_of must be positive")
        }
        let w = (m * width) as usize;
        width = w.div_ceil(multiple).saturating_mul(multiple) as f64;
    }
    match width as usize {
        0 => bail!("config: the MLP width derived from intermediate_size={size} is 0"),
        w => Ok(w),
    }
}

/// The `config.json` of an LFM2 model (`Lfm2ForCausalLM`): `layer_types`, the MLP's width as
/// it is (`block_auto_adjust_ff_dim` false), the convolution's taps and bias. What the
/// fields cannot say (windows, a head width other than `hidden_size / heads`, ...) is
/// caught by [`GptConfig::to_json`]'s re-read and refused.
pub(super) fn write(cfg: &GptConfig) -> Result<Value> {
    let Some(rope) = &cfg.rope else {
        bail!("an lfm2 model without rotary positions cannot be saved")
    };
    let types: Vec<&str> = (0..cfg.n_layer)
        .map(|l| match cfg.is_conv(l) {
            true => "conv",
            false => "full_attention",
        })
        .collect();
    Ok(json!({
        "architectures": ["Lfm2ForCausalLM"],
        "model_type": "lfm2",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.n_embd,
        "intermediate_size": cfg.inner_dim(),
        "block_auto_adjust_ff_dim": false,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.kv_heads(),
        "max_position_embeddings": cfg.n_positions,
        "norm_eps": cfg.layer_norm_epsilon,
        "conv_bias": cfg.conv_bias,
        "conv_L_cache": cfg.conv_taps,
        "layer_types": types,
        "rope_parameters": llama::rope_json(rope),
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": null,
    }))
}
