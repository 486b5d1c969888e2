//! Llama and the families in its layout (Mistral, Qwen2): their tensor names, their
//! `config.json` read, and Llama's written.

use candle_core::{bail, Result};
use mha::{RopeConfig, RopeScaling};

use super::fields::{base, decimal, free_head_dim, layer_types, layer_windows, Fields};
use super::id::Family;
use super::names::{gguf, name, AttnNames, MlpNames, QkvLayout, TensorNames, NONE};
use crate::config::{Activation, GptConfig, NormKind, NormPlacement};

/// `model.layers.{i}.self_attn.q_proj`, SwiGLU's `gate_proj`/`up_proj`/`down_proj`.
pub(super) const NAMES: TensorNames = TensorNames {
    embed: name("model.embed_tokens", gguf::TOKEN_EMBD),
    positions: name("", gguf::POSITION_EMBD),
    layers: name("model.layers", gguf::BLK),
    attn_norm: name("input_layernorm", gguf::ATTN_NORM),
    attn: "self_attn",
    attn_proj: AttnNames {
        layout: QkvLayout::Separate,
        q: name("q_proj", gguf::ATTN_Q),
        k: name("k_proj", gguf::ATTN_K),
        v: name("v_proj", gguf::ATTN_V),
        qkv: name("", gguf::ATTN_QKV),
        o: name("o_proj", gguf::ATTN_OUTPUT),
        q_norm: name("q_norm", gguf::ATTN_Q_NORM),
        k_norm: name("k_norm", gguf::ATTN_K_NORM),
    },
    mlp_norm: name("post_attention_layernorm", gguf::FFN_NORM),
    attn_post_norm: NONE,
    mlp_post_norm: NONE,
    mlp: "mlp",
    mlp_proj: MlpNames {
        up: name("up_proj", gguf::FFN_UP),
        gate: Some(name("gate_proj", gguf::FFN_GATE)),
        down: name("down_proj", gguf::FFN_DOWN),
        conv1d: false,
    },
    final_norm: name("model.norm", gguf::OUTPUT_NORM),
    head: name("lm_head", gguf::OUTPUT),
    stored_fused: None,
    short_conv: None,
};

/// Reads the config of Llama, Mistral, Qwen2, or the Llama-layout part of the families
/// built on it (their own readers add the rest).
pub(super) fn read(family: Family, f: &Fields) -> Result<GptConfig> {
    let d = f.need("hidden_size")?;
    let h = f.need("num_attention_heads")?;
    let n_layer = f.need("num_hidden_layers")?;
    let (hd, head_dim) = free_head_dim(f, d, h)?;
    let attention_bias = f.bool("attention_bias")?.unwrap_or(false);
    // Qwen2 has q/k/v biases and none on o_proj, whatever the config says.
    let (qkv_bias, o_bias) = match family {
        Family::Qwen2 => (true, false),
        _ => (attention_bias, attention_bias),
    };
    let window = f.usize("sliding_window")?;
    let global = match family {
        // Mistral and Phi-3: every layer, when sliding_window is set.
        Family::Mistral | Family::Phi3 => 0,
        // Qwen2 and 3: from max_window_layers on, when use_sliding_window is set.
        Family::Qwen2 | Family::Qwen3 if f.bool("use_sliding_window")?.unwrap_or(false) => {
            f.usize("max_window_layers")?.unwrap_or(n_layer)
        }
        _ => n_layer,
    };
    // Qwen3 and SmolLM3 have no window unless use_sliding_window says so, whatever
    // sliding_window and layer_types say (transformers drops them).
    let sliding = f.bool("use_sliding_window")?.unwrap_or(false);
    let windows = match family {
        Family::Qwen3 | Family::SmolLm3 if !sliding => Vec::new(),
        _ => layer_windows(f, n_layer, window, global)?,
    };
    Ok(GptConfig {
        n_embd: d,
        n_layer,
        n_head: h,
        n_kv_head: Some(f.usize("num_key_value_heads")?.unwrap_or(h)),
        n_inner: Some(f.need("intermediate_size")?),
        activation_function: f.activation("hidden_act", Activation::Silu)?,
        layer_norm_epsilon: f.f64("rms_norm_eps")?.unwrap_or(1e-6),
        norm: NormKind::RmsNorm,
        head_dim,
        rope: Some(f.rope(hd, 1.0, None, None)?),
        gated_mlp: true,
        parallel_residual: false,
        attn_bias: qkv_bias,
        attn_out_bias: o_bias,
        mlp_bias: f.bool("mlp_bias")?.unwrap_or(false),
        windows,
        ..base(family, f, false)?
    })
}

/// The `config.json` of Llama or a family in its layout that adds fields (Qwen3's q/k
/// norms and windows, SmolLM3's `no_rope_layers`, OLMo 2's norms after the branches,
/// Granite's multipliers, Phi-3's window, partial rotary and LongRoPE context, Mistral's
/// window, Qwen2's biases and windowed layers), refusing what its fields cannot express.
pub(super) fn write(cfg: &GptConfig) -> Result<serde_json::Value> {
    let family = cfg.family;
    let Some(rope) = &cfg.rope else {
        bail!(
            "a {} model without rotary positions cannot be saved",
            family.model_type()
        )
    };
    let head_dim = cfg.head_dim();
    let windows: Vec<Option<usize>> = (0..cfg.n_layer).map(|l| cfg.window(l)).collect();
    let window = windows.iter().flatten().next().copied();
    let one_window = windows.iter().flatten().all(|&w| Some(w) == window);
    let qk = cfg.qk_norm.map(|n| n.per_head);
    let fits = cfg.norm == NormKind::RmsNorm
        && match family {
            Family::Qwen3 => qk == Some(true) && one_window,
            Family::Qwen2 => qk.is_none() && one_window,
            // Mistral and Phi-3: one window on every layer, or none.
            Family::Mistral | Family::Phi3 => qk.is_none() && windows.iter().all(|w| *w == window),
            Family::Olmo2 => qk == Some(false) && window.is_none(),
            _ => qk.is_none() && window.is_none(),
        }
        && (family == Family::SmolLm3 || (cfg.no_rope.is_empty() && cfg.no_rope_every.is_none()))
        && (family == Family::Granite
            || (cfg.attn_scale.is_none()
                && [
                    cfg.embedding_multiplier,
                    cfg.residual_multiplier,
                    cfg.logits_scaling,
                ] == [1.0; 3]))
        && cfg.gated_mlp
        && !cfg.parallel_residual
        && cfg.norm_placement
            == match family {
                Family::Olmo2 => NormPlacement::PostBranch,
                _ => NormPlacement::Pre,
            }
        && match family {
            // Qwen2: biases on q, k and v, none on the output, whatever the file says.
            Family::Qwen2 => cfg.attn_bias && !cfg.attn_out_bias,
            _ => cfg.attn_bias == cfg.attn_out_bias,
        }
        && (family == Family::Phi3 || rope.rotary_dim.is_none_or(|r| r == head_dim))
        && cfg.rope_local.is_none()
        && cfg.final_logit_softcapping.is_none()
        && cfg.attn_logit_softcapping.is_none()
        && !cfg.scale_attn_by_inverse_layer_idx
        && cfg.scale_attn_weights;
    if !fits {
        bail!("this model has parts the {} config.json cannot express (windows, partial rotary, LayerNorm, an ungated MLP, parallel residuals, unequal attention biases, q/k norms, layers without rotation or multipliers where the family has none); it cannot be saved", family.model_type())
    }
    let mut params = rope_json(rope);
    if let Some(r) = rope.rotary_dim.filter(|&r| r != head_dim) {
        params["partial_rotary_factor"] = (r as f64 / head_dim as f64).into();
    }
    let arch = match family {
        Family::Qwen3 => "Qwen3ForCausalLM",
        Family::SmolLm3 => "SmolLM3ForCausalLM",
        Family::Olmo2 => "Olmo2ForCausalLM",
        Family::Granite => "GraniteForCausalLM",
        Family::Phi3 => "Phi3ForCausalLM",
        Family::Mistral => "MistralForCausalLM",
        Family::Qwen2 => "Qwen2ForCausalLM",
        _ => "LlamaForCausalLM",
    };
    let mut json = serde_json::json!({
        "architectures": [arch],
        "model_type": family.model_type(),
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.n_embd,
        "intermediate_size": cfg.inner_dim(),
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.kv_heads(),
        "head_dim": head_dim,
        "hidden_act": cfg.activation_function,
        "max_position_embeddings": cfg.n_positions,
        "rms_norm_eps": cfg.layer_norm_epsilon,
        "rope_parameters": params,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attn_bias,
        "mlp_bias": cfg.mlp_bias,
        "attention_dropout": decimal(cfg.attn_pdrop),
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        // Not kept here; null rather than a family default past a small vocabulary
        // (SmolLM3's 128004).
        "pad_token_id": null,
    });
    match family {
        Family::Qwen2 | Family::Qwen3 => {
            json["use_sliding_window"] = window.is_some().into();
            if let Some(w) = window {
                json["sliding_window"] = w.into();
                json["layer_types"] = layer_types(&windows).into();
            }
        }
        Family::SmolLm3 => {
            // 1 for a layer that rotates.
            let flags: Vec<u8> = (0..cfg.n_layer)
                .map(|l| u8::from(cfg.layer_rope(l).is_some()))
                .collect();
            json["no_rope_layers"] = flags.into();
        }
        Family::Mistral => json["sliding_window"] = window.into(),
        Family::Phi3 => {
            json["sliding_window"] = window.into();
            if let RopeScaling::LongRope {
                original_max_position_embeddings,
                ..
            } = rope.scaling
            {
                json["original_max_position_embeddings"] = original_max_position_embeddings.into();
            }
        }
        Family::Granite => {
            json["embedding_multiplier"] = cfg.embedding_multiplier.into();
            json["attention_multiplier"] = cfg.attn_scale.unwrap_or(1.0).into();
            json["residual_multiplier"] = cfg.residual_multiplier.into();
            json["logits_scaling"] = cfg.logits_scaling.into();
        }
        _ => {}
    }
    Ok(json)
}

/// A rotation as transformers 5's `rope_parameters` (`rope_theta`, `rope_type` and the
/// scaling's own fields).
pub(super) fn rope_json(rope: &RopeConfig) -> serde_json::Value {
    let mut params = serde_json::json!({ "rope_theta": rope.theta, "rope_type": "default" });
    match &rope.scaling {
        RopeScaling::None => {}
        RopeScaling::LongRope {
            short_factor,
            long_factor,
            original_max_position_embeddings,
            attention_factor,
        } => {
            params["rope_type"] = "longrope".into();
            params["short_factor"] = short_factor.clone().into();
            params["long_factor"] = long_factor.clone().into();
            params["original_max_position_embeddings"] = (*original_max_position_embeddings).into();
            params["attention_factor"] = (*attention_factor).into();
        }
        RopeScaling::Linear { factor } => {
            params["rope_type"] = "linear".into();
            params["factor"] = (*factor).into();
        }
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            params["rope_type"] = "llama3".into();
            params["factor"] = (*factor).into();
            params["low_freq_factor"] = (*low_freq_factor).into();
            params["high_freq_factor"] = (*high_freq_factor).into();
            params["original_max_position_embeddings"] = (*original_max_position_embeddings).into();
        }
    }
    params
}
