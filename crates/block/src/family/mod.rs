//! Model families as data: each family's file holds its table of tensor names (Hugging
//! Face's and llama.cpp's for every part) and its `config.json` reader, which turns the
//! family's fields into the family-free [`GptConfig`](crate::GptConfig). A family only
//! decides the parts and their names; one model runs them all.

mod fields;
mod gemma2;
mod gemma3;
mod gpt2;
mod granite;
pub(crate) mod id;
mod json;
mod lfm2;
mod llama;
pub(crate) mod names;
mod neo;
mod neox;
mod olmo2;
mod phi3;
mod qwen3;
mod smollm3;

pub use id::Family;

use names::TensorNames;

impl Family {
    /// Where the family keeps each tensor, in both formats.
    pub(crate) fn names(self) -> &'static TensorNames {
        match self {
            Self::Gpt2 => &gpt2::NAMES,
            Self::Llama
            | Self::Mistral
            | Self::Qwen2
            | Self::Qwen3
            | Self::SmolLm3
            | Self::Granite => &llama::NAMES,
            Self::Olmo2 => &olmo2::NAMES,
            Self::Gemma2 | Self::Gemma3 => &gemma3::NAMES,
            Self::Phi3 => &phi3::NAMES,
            Self::Lfm2 => &lfm2::NAMES,
            Self::GptNeox => &neox::NAMES,
            Self::GptNeo => &neo::NAMES,
        }
    }
}
