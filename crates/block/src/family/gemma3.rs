//! Gemma 3 (`gemma3_text`): Llama's projections with a norm before and after each branch
//! (`input_layernorm`, `post_attention_layernorm`, `pre_feedforward_layernorm`,
//! `post_feedforward_layernorm`, stored as `w` for `1 + w`), an RMSNorm over each head of
//! q and k, GeGLU (`gelu_pytorch_tanh`), embeddings times `sqrt(hidden_size)`, scores
//! scaled by `query_pre_attn_scalar^-0.5`, local (windowed) and global layers by
//! `layer_types` or the hub's `sliding_window_pattern`, each kind with its own rotation
//! (`rope_parameters.{sliding,full}_attention`, or the hub's `rope_theta`,
//! `rope_local_base_freq` and `rope_scaling`, which applies to the global layers), and
//! soft-capped logits (`final_logit_softcapping`) and, when a file sets it, soft-capped
//! attention scores (`attn_logit_softcapping`, Gemma 2's). [`write`] writes Gemma 3's and
//! Gemma 2's files.

use candle_core::{bail, Result};
use mha::{QkNorm, RopeConfig};
use serde_json::{json, Map, Value};

use super::fields::{decimal, layer_types, layer_windows, Fields};
use super::id::Family;
use super::llama;
use super::names::{gguf, name, TensorNames};
use crate::config::{periodic_windows, Activation, GptConfig, NormPlacement};

/// Llama's names, with the sandwich norms.
pub(super) const NAMES: TensorNames = TensorNames {
    attn_norm: name("input_layernorm", gguf::ATTN_NORM),
    attn_post_norm: name("post_attention_layernorm", gguf::ATTN_POST_NORM),
    mlp_norm: name("pre_feedforward_layernorm", gguf::FFN_NORM),
    mlp_post_norm: name("post_feedforward_layernorm", gguf::FFN_POST_NORM),
    ..llama::NAMES
};

/// transformers' defaults for the global and local bases.
const GLOBAL_THETA: f64 = 1_000_000.0;
const LOCAL_THETA: f64 = 10_000.0;

/// Reads a Gemma 3 text `config.json`.
pub(super) fn read(f: &Fields) -> Result<GptConfig> {
    if f.bool("use_bidirectional_attention")?.unwrap_or(false) {
        bail!("config: use_bidirectional_attention (Gemma as an encoder) is not supported")
    }
    let cfg = llama::read(Family::Gemma3, f)?;
    let n = cfg.n_layer;
    let hd = cfg.head_dim();
    let window = f.usize("sliding_window")?.unwrap_or(4096);
    let windows = match f.get("layer_types") {
        Some(_) => layer_windows(f, n, Some(window), n)?,
        // transformers: layer i slides unless (i + 1) % p == 0.
        None => match f.usize("sliding_window_pattern")?.unwrap_or(6) {
            0 => bail!("config: sliding_window_pattern must be positive"),
            p => periodic_windows(p, n, window)?,
        },
    };
    let (global, local) = rope_params(f)?;
    let rope = |p: Map<String, Value>| -> Result<RopeConfig> {
        let obj: Map<String, Value> = [("rope_parameters".to_string(), Value::Object(p))]
            .into_iter()
            .collect();
        Fields { obj: &obj }.rope(hd, 1.0, None, None)
    };
    let scalar = f.f64("query_pre_attn_scalar")?.unwrap_or(256.0);
    if scalar <= 0.0 {
        bail!("config: query_pre_attn_scalar must be positive, got {scalar}")
    }
    Ok(GptConfig {
        activation_function: f.activation("hidden_activation", Activation::GeluNew)?,
        qk_norm: Some(QkNorm {
            per_head: true,
            eps: cfg.layer_norm_epsilon,
        }),
        norm_placement: NormPlacement::Sandwich,
        attn_scale: Some(scalar.powf(-0.5)),
        embedding_multiplier: (cfg.n_embd as f64).sqrt(),
        final_logit_softcapping: f.f64("final_logit_softcapping")?,
        attn_logit_softcapping: f.f64("attn_logit_softcapping")?,
        rope: Some(rope(global)?),
        rope_local: Some(rope(local)?),
        windows,
        tie_word_embeddings: f.bool("tie_word_embeddings")?.unwrap_or(true),
        ..cfg
    })
}

/// The rotation parameters of the global and the local layers, in transformers 5's form
/// (`rope_parameters` per layer type) whichever generation of fields the file has.
fn rope_params(f: &Fields) -> Result<(Map<String, Value>, Map<String, Value>)> {
    let object = |v: Option<&Value>, name: &str| -> Result<Option<Map<String, Value>>> {
        match v {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Object(m)) => Ok(Some(m.clone())),
            Some(v) => bail!("config: {name} must be an object, got {v}"),
        }
    };
    let params = object(f.get("rope_parameters"), "rope_parameters")?;
    let by_type = params
        .as_ref()
        .is_some_and(|p| p.contains_key("full_attention") || p.contains_key("sliding_attention"));
    let (mut global, mut local) = match (params, by_type) {
        (Some(p), true) => (
            object(p.get("full_attention"), "rope_parameters.full_attention")?,
            object(
                p.get("sliding_attention"),
                "rope_parameters.sliding_attention",
            )?,
        ),
        // Older files: one set of parameters (or rope_scaling) for the global layers.
        (p, _) => {
            let mut g = p.unwrap_or_default();
            if let Some(s) = object(f.get("rope_scaling"), "rope_scaling")? {
                g.extend(s);
            }
            (Some(g), None)
        }
    };
    let global_theta = f.f64("rope_theta")?.unwrap_or(GLOBAL_THETA);
    let local_theta = f.f64("rope_local_base_freq")?.unwrap_or(LOCAL_THETA);
    let fill = |m: &mut Option<Map<String, Value>>, theta: f64| {
        let m = m.get_or_insert_with(Map::new);
        m.entry("rope_theta").or_insert(theta.into());
        // rope_scaling's older "type" under the name rope_parameters uses.
        let kind = m.get("type").cloned().unwrap_or("default".into());
        m.entry("rope_type").or_insert(kind);
    };
    fill(&mut global, global_theta);
    fill(&mut local, local_theta);
    Ok((global.unwrap_or_default(), local.unwrap_or_default()))
}

/// The `config.json` of Gemma 3 (`Gemma3ForCausalLM`, transformers 5's fields: `layer_types`,
/// `rope_parameters` per layer type) or Gemma 2 (`Gemma2ForCausalLM`, one rotation). What
/// the fields cannot say (windows of two widths, a GELU other than the tanh form, ...) is
/// caught by [`GptConfig::to_json`]'s re-read and refused.
pub(super) fn write(cfg: &GptConfig) -> Result<Value> {
    let family = cfg.family;
    let (Some(rope), Some(scale)) = (&cfg.rope, cfg.attn_scale) else {
        bail!(
            "a {} model without rotary positions or a score scale cannot be saved",
            family.model_type()
        )
    };
    if cfg.activation_function != Activation::GeluNew {
        bail!(
            "a {} model with an MLP activation other than the tanh GELU cannot be saved",
            family.model_type()
        )
    }
    let windows: Vec<Option<usize>> = (0..cfg.n_layer).map(|l| cfg.window(l)).collect();
    let window = windows.iter().flatten().next().copied();
    // `attn_scale` is `query_pre_attn_scalar^-0.5`; the files' scalars are whole numbers
    // (a head width), written as such so that the re-read gives the same scale.
    let scalar = scale.powi(-2);
    let scalar = match (scalar.round() - scalar).abs() < 1e-9 * scalar {
        true => json!(scalar.round() as u64),
        false => json!(scalar),
    };
    let mut json = json!({
        "architectures": [match family {
            Family::Gemma2 => "Gemma2ForCausalLM",
            _ => "Gemma3ForCausalLM",
        }],
        "model_type": family.model_type(),
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.n_embd,
        "intermediate_size": cfg.inner_dim(),
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.kv_heads(),
        "head_dim": cfg.head_dim(),
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": cfg.n_positions,
        "rms_norm_eps": cfg.layer_norm_epsilon,
        "query_pre_attn_scalar": scalar,
        "sliding_window": window.unwrap_or(4096),
        "layer_types": layer_types(&windows),
        "final_logit_softcapping": cfg.final_logit_softcapping,
        "attn_logit_softcapping": cfg.attn_logit_softcapping,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attn_bias,
        "attention_dropout": decimal(cfg.attn_pdrop),
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": null,
    });
    match family {
        Family::Gemma2 => json["rope_parameters"] = llama::rope_json(rope),
        _ => {
            let local = cfg.rope_local.as_ref().unwrap_or(rope);
            json["rope_parameters"] = json!({
                "full_attention": llama::rope_json(rope),
                "sliding_attention": llama::rope_json(local),
            });
            json["use_bidirectional_attention"] = false.into();
        }
    }
    Ok(json)
}
