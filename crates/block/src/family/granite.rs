//! Granite 3: Llama's tensor names and config, with four multipliers: on the token
//! embeddings (`embedding_multiplier`), the scores (`attention_multiplier`, in place of
//! `1/sqrt(head_dim)`), each branch's output (`residual_multiplier`) and the logits
//! (divided by `logits_scaling`).

use candle_core::Result;

use super::fields::Fields;
use super::id::Family;
use super::llama;
use crate::config::GptConfig;

/// Reads a Granite `config.json`.
pub(super) fn read(f: &Fields) -> Result<GptConfig> {
    let cfg = llama::read(Family::Granite, f)?;
    Ok(GptConfig {
        embedding_multiplier: f.f64("embedding_multiplier")?.unwrap_or(1.0),
        attn_scale: Some(f.f64("attention_multiplier")?.unwrap_or(1.0)),
        residual_multiplier: f.f64("residual_multiplier")?.unwrap_or(1.0),
        logits_scaling: f.f64("logits_scaling")?.unwrap_or(1.0),
        ..cfg
    })
}
