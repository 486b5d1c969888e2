//! GPT-2: its tensor names and its `config.json`, whose fields are [`GptConfig`]'s own.

use candle_core::{bail, Result};
use serde_json::Value;

use super::fields::decimal;
use super::names::{gguf, name, AttnNames, MlpNames, QkvLayout, TensorNames, NONE};
use crate::config::GptConfig;

/// `transformer.h.{i}.attn.c_attn` (a fused Conv1D), `mlp.c_fc`, `mlp.c_proj`.
pub(super) const NAMES: TensorNames = TensorNames {
    embed: name("transformer.wte", gguf::TOKEN_EMBD),
    positions: name("transformer.wpe", gguf::POSITION_EMBD),
    layers: name("transformer.h", gguf::BLK),
    attn_norm: name("ln_1", gguf::ATTN_NORM),
    attn: "attn",
    attn_proj: AttnNames {
        layout: QkvLayout::Conv1d,
        q: name("", gguf::ATTN_Q),
        k: name("", gguf::ATTN_K),
        v: name("", gguf::ATTN_V),
        qkv: name("c_attn", gguf::ATTN_QKV),
        o: name("c_proj", gguf::ATTN_OUTPUT),
        q_norm: NONE,
        k_norm: NONE,
    },
    mlp_norm: name("ln_2", gguf::FFN_NORM),
    attn_post_norm: NONE,
    mlp_post_norm: NONE,
    mlp: "mlp",
    mlp_proj: MlpNames {
        up: name("c_fc", gguf::FFN_UP),
        gate: None,
        down: name("c_proj", gguf::FFN_DOWN),
        conv1d: true,
    },
    final_norm: name("transformer.ln_f", gguf::OUTPUT_NORM),
    head: name("lm_head", gguf::OUTPUT),
    stored_fused: None,
    short_conv: None,
};

/// Reads a GPT-2 `config.json`. Old configs that give `n_ctx` but no `n_positions` are
/// read as they were meant.
pub(super) fn read(mut value: Value) -> Result<GptConfig> {
    if let Some(obj) = value.as_object_mut() {
        if !obj.contains_key("n_positions") {
            if let Some(n_ctx) = obj.get("n_ctx").cloned() {
                obj.insert("n_positions".into(), n_ctx);
            }
        }
    }
    let cfg: GptConfig = serde_json::from_value(value)
        .map_err(|e| candle_core::Error::Msg(format!("config.json: {e}")))?;
    cfg.validate()?;
    Ok(cfg)
}

/// GPT-2's `config.json` (`GPT2LMHeadModel`).
pub(super) fn write(cfg: &GptConfig) -> Result<Value> {
    let mut value = serde_json::to_value(cfg).map_err(candle_core::Error::wrap)?;
    let Some(obj) = value.as_object_mut() else {
        bail!("internal error: the config did not serialise to an object")
    };
    obj.insert(
        "architectures".into(),
        serde_json::json!(["GPT2LMHeadModel"]),
    );
    obj.insert("model_type".into(), serde_json::json!("gpt2"));
    obj.insert("n_ctx".into(), serde_json::json!(cfg.n_positions));
    for (key, p) in [
        ("resid_pdrop", cfg.resid_pdrop),
        ("embd_pdrop", cfg.embd_pdrop),
        ("attn_pdrop", cfg.attn_pdrop),
    ] {
        obj.insert(key.into(), decimal(p).into());
    }
    Ok(value)
}
