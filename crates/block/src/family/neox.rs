//! GPT-NeoX (Pythia): its tensor names and its `config.json`.

use candle_core::Result;

use super::fields::{base, head_dim, Fields};
use super::id::Family;
use super::names::{gguf, name, AttnNames, MlpNames, QkvLayout, TensorNames, NONE};
use crate::config::{Activation, GptConfig, NormKind};

/// `gpt_neox.layers.{i}.attention.query_key_value` (rows grouped by head), `embed_out`.
pub(super) const NAMES: TensorNames = TensorNames {
    embed: name("gpt_neox.embed_in", gguf::TOKEN_EMBD),
    positions: name("", gguf::POSITION_EMBD),
    layers: name("gpt_neox.layers", gguf::BLK),
    attn_norm: name("input_layernorm", gguf::ATTN_NORM),
    attn: "attention",
    attn_proj: AttnNames {
        layout: QkvLayout::HeadInterleaved,
        q: name("", gguf::ATTN_Q),
        k: name("", gguf::ATTN_K),
        v: name("", gguf::ATTN_V),
        qkv: name("query_key_value", gguf::ATTN_QKV),
        o: name("dense", gguf::ATTN_OUTPUT),
        q_norm: NONE,
        k_norm: NONE,
    },
    mlp_norm: name("post_attention_layernorm", gguf::FFN_NORM),
    attn_post_norm: NONE,
    mlp_post_norm: NONE,
    mlp: "mlp",
    mlp_proj: MlpNames {
        up: name("dense_h_to_4h", gguf::FFN_UP),
        gate: None,
        down: name("dense_4h_to_h", gguf::FFN_DOWN),
        conv1d: false,
    },
    final_norm: name("gpt_neox.final_layer_norm", gguf::OUTPUT_NORM),
    head: name("embed_out", gguf::OUTPUT),
    stored_fused: None,
    short_conv: None,
};

pub(super) fn read(f: &Fields) -> Result<GptConfig> {
    let d = f.need("hidden_size")?;
    let h = f.need("num_attention_heads")?;
    let hd = head_dim(f, ("hidden_size", d), ("num_attention_heads", h))?;
    let bias = f.bool("attention_bias")?.unwrap_or(true);
    Ok(GptConfig {
        n_embd: d,
        n_layer: f.need("num_hidden_layers")?,
        n_head: h,
        n_inner: Some(f.need("intermediate_size")?),
        activation_function: f.activation("hidden_act", Activation::Gelu)?,
        layer_norm_epsilon: f.f64("layer_norm_eps")?.unwrap_or(1e-5),
        norm: NormKind::LayerNorm,
        rope: Some(f.rope(hd, 0.25, Some("rotary_emb_base"), Some("rotary_pct"))?),
        gated_mlp: false,
        parallel_residual: f.bool("use_parallel_residual")?.unwrap_or(true),
        attn_bias: bias,
        attn_out_bias: bias,
        mlp_bias: true,
        ..base(Family::GptNeox, f, false)?
    })
}
