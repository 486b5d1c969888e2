//! Phi-3 and Phi-4-mini (`phi3`): Llama's blocks, stored with q, k and v fused
//! (`self_attn.qkv_proj`, rows `[q | k | v]`) and the gate and up projections fused
//! (`mlp.gate_up_proj`, rows `[gate | up]`), read apart; a sliding window on every layer
//! when `sliding_window` is set (as Mistral's); partial rotary
//! (`partial_rotary_factor`, Phi-4-mini's 0.75) and LongRoPE scaling (`longrope`/`su`).

use candle_core::Result;

use super::fields::Fields;
use super::id::Family;
use super::llama;
use super::names::{StoredFused, TensorNames};
use crate::config::GptConfig;

/// Llama's names, with the fused projections as stored.
pub(super) const NAMES: TensorNames = TensorNames {
    stored_fused: Some(StoredFused {
        qkv: "qkv_proj",
        gate_up: "gate_up_proj",
    }),
    ..llama::NAMES
};

/// Reads a Phi-3 `config.json`.
pub(super) fn read(f: &Fields) -> Result<GptConfig> {
    llama::read(Family::Phi3, f)
}
