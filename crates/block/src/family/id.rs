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
}

impl Family {
    /// Every family, in the order of the README's table.
    pub const ALL: [Family; 6] = [
        Self::Gpt2,
        Self::Llama,
        Self::Mistral,
        Self::Qwen2,
        Self::GptNeox,
        Self::GptNeo,
    ];

    /// The `model_type` values read, in the order of the README's table.
    pub const SUPPORTED: [&'static str; 6] =
        ["gpt2", "llama", "mistral", "qwen2", "gpt_neox", "gpt_neo"];

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
        }
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
