//! GPT-Neo: its tensor names and its `config.json` (global and local layers, learned
//! positions, unscaled scores). llama.cpp has no GPT-Neo architecture: no GGUF names.

use candle_core::{bail, Result};
use serde_json::Value;

use super::fields::{base, head_dim, Fields};
use super::id::Family;
use super::names::{name, AttnNames, MlpNames, QkvLayout, TensorNames, NONE};
use crate::config::{layers_covered, Activation, GptConfig, NormKind};

/// GPT-2's names, with `attn.attention.{q,k,v,out}_proj` as `nn.Linear`s.
pub(super) const NAMES: TensorNames = TensorNames {
    embed: name("transformer.wte", ""),
    positions: name("transformer.wpe", ""),
    layers: name("transformer.h", ""),
    attn_norm: name("ln_1", ""),
    attn: "attn.attention",
    attn_proj: AttnNames {
        layout: QkvLayout::Separate,
        q: name("q_proj", ""),
        k: name("k_proj", ""),
        v: name("v_proj", ""),
        qkv: name("", ""),
        o: name("out_proj", ""),
        q_norm: NONE,
        k_norm: NONE,
    },
    mlp_norm: name("ln_2", ""),
    attn_post_norm: NONE,
    mlp_post_norm: NONE,
    mlp: "mlp",
    mlp_proj: MlpNames {
        up: name("c_fc", ""),
        gate: None,
        down: name("c_proj", ""),
        conv1d: false,
    },
    final_norm: name("transformer.ln_f", ""),
    head: name("lm_head", ""),
    stored_fused: None,
    short_conv: None,
};

pub(super) fn read(f: &Fields) -> Result<GptConfig> {
    let d = f.need("hidden_size")?;
    let n_layer = f.need("num_layers")?;
    head_dim(f, ("hidden_size", d), ("num_heads", f.need("num_heads")?))?;
    let window = f.usize("window_size")?;
    // `attention_types`: [[["global", "local"], 12]] is 24 layers, kept as that run.
    let kind = |k: &Value| match (k.as_str(), window) {
        (Some("global"), _) => Ok(None),
        (Some("local"), Some(w)) => Ok(Some(w)),
        (Some("local"), None) => bail!("config: local attention layers need window_size"),
        _ => bail!("config: attention type {k} is not supported (global, local)"),
    };
    let windows: Vec<(Vec<Option<usize>>, usize)> = match f.get("attention_types") {
        None => Vec::new(),
        Some(Value::Array(groups)) => groups
            .iter()
            .map(|g| {
                let bad = || {
                    candle_core::Error::Msg(format!(
                        "config: attention_types entry {g} must be [[kinds...], repeat]"
                    ))
                };
                let pair = g.as_array().filter(|p| p.len() == 2).ok_or_else(bad)?;
                let kinds = pair[0]
                    .as_array()
                    .filter(|k| !k.is_empty())
                    .ok_or_else(bad)?;
                let times = pair[1].as_u64().ok_or_else(bad)?;
                let pattern = kinds.iter().map(kind).collect::<Result<_>>()?;
                Ok((pattern, usize::try_from(times).map_err(|_| bad())?))
            })
            .collect::<Result<_>>()?,
        Some(v) => bail!("config: attention_types must be a list, got {v}"),
    };
    let covered = layers_covered(&windows);
    if !windows.is_empty() && covered != Some(n_layer) {
        bail!(
            "config: attention_types describes {} layers but num_layers={n_layer}",
            covered.map_or("too many".to_string(), |n| n.to_string())
        )
    }
    Ok(GptConfig {
        n_embd: d,
        n_layer,
        n_head: f.need("num_heads")?,
        n_inner: f.usize("intermediate_size")?,
        activation_function: f.activation("activation_function", Activation::GeluNew)?,
        layer_norm_epsilon: f.f64("layer_norm_epsilon")?.unwrap_or(1e-5),
        norm: NormKind::LayerNorm,
        rope: None,
        gated_mlp: false,
        parallel_residual: false,
        // No bias on q/k/v, one on out_proj; the MLP's Linears have biases.
        attn_bias: false,
        attn_out_bias: true,
        mlp_bias: true,
        windows,
        // GPT-Neo does not scale the scores by 1/sqrt(head_dim).
        scale_attn_weights: false,
        ..base(Family::GptNeo, f, true)?
    })
}
