//! Which family a model belongs to, and the names the formats give it: `config.json`'s
//! `model_type` and GGUF's `general.architecture`.

use candle_core::{bail, Result};
use serde::{Deserialize, Serialize};

/// The checkpoint family, from `config.json`'s `model_type` (or a GGUF file's
/// `general.architecture`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Family {
    /// GPT-2 (`transformer.h.{i}`, fused Conv1D `c_attn`).
    #[default]
    Gpt2,
    /// Llama and the many models in its layout (SmolLM, TinyLlama, ...).
    Llama,
    /// Mistral: Llama's layout with sliding-window attention.
    Mistral,
    /// Qwen2 / Qwen2.5: Llama's layout with q/k/v biases.
    Qwen2,
    /// GPT-NeoX / Pythia: partial rotary, head-interleaved fused q/k/v, parallel residual.
    GptNeox,
    /// GPT-Neo: learned positions, global and local layers, unscaled scores.
    GptNeo,
    /// Qwen3: Llama's layout with an RMSNorm over each head of q and k, heads wider than
    /// `hidden / heads`.
    Qwen3,
    /// SmolLM3: Llama's layout with layers that do not rotate (NoPE).
    SmolLm3,
    /// OLMo 2: norms on the outputs of attention and MLP instead of their inputs, q/k
    /// RMSNorm over the whole projection.
    Olmo2,
    /// Granite 3: Llama's layout with multipliers on the embeddings, scores, residual
    /// branches and logits.
    Granite,
    /// Gemma 2: Gemma 3's blocks without the q/k norms, one rotation for every layer, and
    /// soft-capped attention scores.
    Gemma2,
    /// Gemma 3 (text): norms before and after attention and MLP (stored as `w` for
    /// `1 + w`), per-head q/k norms, GeGLU, scaled embeddings, local and global layers
    /// rotating at different bases, soft-capped logits.
    Gemma3,
    /// Phi-3 and Phi-4-mini: Llama's blocks stored with fused q/k/v and gate/up, partial
    /// rotary, LongRoPE.
    Phi3,
    /// LFM2: attention and gated short-convolution blocks in one stack.
    Lfm2,
}

impl Family {
    /// Every family, in the order of the README's table.
    pub const ALL: [Family; 14] = [
        Self::Gpt2,
        Self::Llama,
        Self::Mistral,
        Self::Qwen2,
        Self::GptNeox,
        Self::GptNeo,
        Self::Qwen3,
        Self::SmolLm3,
        Self::Olmo2,
        Self::Granite,
        Self::Gemma2,
        Self::Gemma3,
        Self::Phi3,
        Self::Lfm2,
    ];

    /// The `model_type` values read, in the order of the README's table.
    pub const SUPPORTED: [&'static str; 14] = [
        "gpt2",
        "llama",
        "mistral",
        "qwen2",
        "gpt_neox",
        "gpt_neo",
        "qwen3",
        "smollm3",
        "olmo2",
        "granite",
        "gemma2",
        "gemma3_text",
        "phi3",
        "lfm2",
    ];

    /// The family of a `model_type`.
    pub fn from_model_type(t: &str) -> Result<Self> {
        match Self::ALL.into_iter().find(|f| f.model_type() == t) {
            Some(f) => Ok(f),
            None => bail!(
                "config: model_type {t:?} is not supported (supported: {})",
                Self::SUPPORTED.join(", ")
            ),
        }
    }

    /// The `model_type` string.
    pub fn model_type(self) -> &'static str {
        match self {
            Self::Gpt2 => "gpt2",
            Self::Llama => "llama",
            Self::Mistral => "mistral",
            Self::Qwen2 => "qwen2",
            Self::GptNeox => "gpt_neox",
            Self::GptNeo => "gpt_neo",
            Self::Qwen3 => "qwen3",
            Self::SmolLm3 => "smollm3",
            Self::Olmo2 => "olmo2",
            Self::Granite => "granite",
            Self::Gemma2 => "gemma2",
            Self::Gemma3 => "gemma3_text",
            Self::Phi3 => "phi3",
            Self::Lfm2 => "lfm2",
        }
    }

    /// llama.cpp's architecture for the family, `None` where it has none. Mistral is
    /// llama.cpp's `llama` (a file of that architecture reads back as Llama).
    pub fn gguf_arch(self) -> Option<&'static str> {
        match self {
            Self::Gpt2 => Some("gpt2"),
            Self::Llama | Self::Mistral => Some("llama"),
            Self::Qwen2 => Some("qwen2"),
            Self::GptNeox => Some("gptneox"),
            Self::GptNeo => None,
            Self::Qwen3 => Some("qwen3"),
            Self::SmolLm3 => Some("smollm3"),
            Self::Olmo2 => Some("olmo2"),
            Self::Granite => Some("granite"),
            Self::Gemma2 => Some("gemma2"),
            Self::Gemma3 => Some("gemma3"),
            Self::Phi3 => Some("phi3"),
            Self::Lfm2 => Some("lfm2"),
        }
    }

    /// What the family's Hugging Face files store of each norm weight less what the norm
    /// multiplies by: Gemma's RMSNorm multiplies by `1 + w` (its GGUF files hold `1 + w`).
    pub(crate) fn norm_weight_shift(self) -> f64 {
        match self {
            Self::Gemma2 | Self::Gemma3 => 1.0,
            _ => 0.0,
        }
    }

    /// Whether llama.cpp's converter reorders each head's query and key rows for its
    /// rotation of adjacent pairs (its Llama-derived converters do); this model rotates
    /// halves, so the rows go back on loading and are reordered again on writing.
    pub(crate) fn gguf_permutes_qk(self) -> bool {
        matches!(
            self,
            Self::Llama | Self::Mistral | Self::SmolLm3 | Self::Granite
        )
    }

    /// The family a GGUF `general.architecture` runs as: the first that writes it.
    pub fn from_gguf_arch(arch: &str) -> Result<Self> {
        match Self::ALL.into_iter().find(|f| f.gguf_arch() == Some(arch)) {
            Some(f) => Ok(f),
            None => {
                let mut names: Vec<_> = Self::ALL.iter().filter_map(|f| f.gguf_arch()).collect();
                names.dedup();
                bail!(
                    "GGUF architecture {arch:?} is not supported (supported: {})",
                    names.join(", ")
                )
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_read_back() -> Result<()> {
        for f in Family::ALL {
            assert_eq!(Family::from_model_type(f.model_type())?, f);
        }
        assert_eq!(Family::SUPPORTED, Family::ALL.map(Family::model_type));
        assert_eq!(Family::from_gguf_arch("llama")?, Family::Llama);
        assert!(Family::from_gguf_arch("gpt_neo").is_err());
        Ok(())
    }
}
