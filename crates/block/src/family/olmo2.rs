//! OLMo 2: Llama's projections, with the norms on the outputs of attention and MLP
//! (`post_attention_layernorm`, `post_feedforward_layernorm`) instead of their inputs, and
//! an RMSNorm over the whole query and key projections (`q_norm` `[n_heads · head_dim]`,
//! `k_norm` `[n_kv_heads · head_dim]`).

use candle_core::Result;
use mha::QkNorm;

use super::fields::Fields;
use super::id::Family;
use super::llama;
use super::names::{gguf, name, TensorNames};
use crate::config::{GptConfig, NormPlacement};

/// Llama's names, the block's two norms after attention and MLP.
pub(super) const NAMES: TensorNames = TensorNames {
    attn_norm: name("post_attention_layernorm", gguf::ATTN_POST_NORM),
    mlp_norm: name("post_feedforward_layernorm", gguf::FFN_POST_NORM),
    ..llama::NAMES
};

/// Reads an OLMo 2 `config.json`.
pub(super) fn read(f: &Fields) -> Result<GptConfig> {
    let cfg = llama::read(Family::Olmo2, f)?;
    Ok(GptConfig {
        qk_norm: Some(QkNorm {
            per_head: false,
            eps: cfg.layer_norm_epsilon,
        }),
        norm_placement: NormPlacement::PostBranch,
        ..cfg
    })
}
