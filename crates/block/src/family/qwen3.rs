//! Qwen3: Llama's tensor names and config, with an RMSNorm over each head of the queries
//! and keys (`self_attn.q_norm`, `k_norm`, `[head_dim]`) and `head_dim` free of
//! `hidden_size / num_attention_heads` (Qwen3-0.6B: 16 heads of 128 over a width of 1024).

use candle_core::Result;
use mha::QkNorm;

use super::fields::Fields;
use super::id::Family;
use super::llama;
use crate::config::GptConfig;

/// Reads a Qwen3 `config.json`: Llama's fields, `attention_bias` on all four projections,
/// windows from `use_sliding_window` / `max_window_layers` / `layer_types`.
pub(super) fn read(f: &Fields) -> Result<GptConfig> {
    let cfg = llama::read(Family::Qwen3, f)?;
    Ok(GptConfig {
        qk_norm: Some(QkNorm {
            per_head: true,
            eps: cfg.layer_norm_epsilon,
        }),
        ..cfg
    })
}
