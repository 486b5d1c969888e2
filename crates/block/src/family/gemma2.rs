//! Gemma 2 (`gemma2`): Gemma 3's blocks (sandwich norms stored as `w` for `1 + w`, GeGLU,
//! `sqrt(hidden_size)` embeddings, `query_pre_attn_scalar`, soft-capped logits) without
//! the q/k norms, every layer rotating alike (`rope_theta`), local (windowed) and global
//! layers alternating (`layer_types`, else every even layer slides), and attention scores
//! soft-capped (`attn_logit_softcapping`). Its file is written by Gemma 3's writer
//! (`gemma3::write`), which knows both.

use candle_core::{bail, Result};

use super::fields::{layer_windows, Fields};
use super::id::Family;
use super::llama;
use crate::config::{periodic_windows, Activation, GptConfig, NormPlacement};

/// Reads a Gemma 2 `config.json`.
pub(super) fn read(f: &Fields) -> Result<GptConfig> {
    if f.bool("use_bidirectional_attention")?.unwrap_or(false) {
        bail!("config: use_bidirectional_attention (Gemma as an encoder) is not supported")
    }
    let cfg = llama::read(Family::Gemma2, f)?;
    let n = cfg.n_layer;
    let window = f.usize("sliding_window")?.unwrap_or(4096);
    let windows = match f.get("layer_types") {
        Some(_) => layer_windows(f, n, Some(window), n)?,
        // transformers: layer i slides unless (i + 1) % 2 == 0.
        None => periodic_windows(2, n, window)?,
    };
    let scalar = f.f64("query_pre_attn_scalar")?.unwrap_or(256.0);
    if scalar <= 0.0 {
        bail!("config: query_pre_attn_scalar must be positive, got {scalar}")
    }
    Ok(GptConfig {
        activation_function: f.activation("hidden_activation", Activation::GeluNew)?,
        norm_placement: NormPlacement::Sandwich,
        attn_scale: Some(scalar.powf(-0.5)),
        embedding_multiplier: (cfg.n_embd as f64).sqrt(),
        final_logit_softcapping: f.f64("final_logit_softcapping")?,
        attn_logit_softcapping: f.f64("attn_logit_softcapping")?,
        windows,
        tie_word_embeddings: f.bool("tie_word_embeddings")?.unwrap_or(true),
        ..cfg
    })
}
