//! `config.json` read and written: the family from `model_type`, then its reader.

use candle_core::{bail, Result};
use serde_json::Value;

use super::fields::Fields;
use super::id::Family;
use super::{gemma2, gemma3, gpt2, granite, lfm2, llama, neo, neox, olmo2, phi3, qwen3, smollm3};
use crate::config::GptConfig;

impl GptConfig {
    /// Parses a `config.json` of any supported family (by its `model_type`; none is GPT-2)
    /// and checks it.
    pub fn from_json(json: &str) -> Result<Self> {
        let value: Value = serde_json::from_str(json)
            .map_err(|e| candle_core::Error::Msg(format!("config.json: {e}")))?;
        let family = match value.get("model_type") {
            None | Some(Value::Null) => Family::Gpt2,
            Some(Value::String(t)) => Family::from_model_type(t)?,
            Some(v) => bail!("config: model_type must be a string, got {v}"),
        };
        let Some(obj) = value.as_object() else {
            bail!("config.json: expected an object")
        };
        let f = Fields { obj };
        let cfg = match family {
            // GPT-2's fields are the config's own.
            Family::Gpt2 => return gpt2::read(value),
            Family::Llama | Family::Mistral | Family::Qwen2 => llama::read(family, &f)?,
            Family::GptNeox => neox::read(&f)?,
            Family::GptNeo => neo::read(&f)?,
            Family::Qwen3 => qwen3::read(&f)?,
            Family::SmolLm3 => smollm3::read(&f)?,
            Family::Olmo2 => olmo2::read(&f)?,
            Family::Granite => granite::read(&f)?,
            Family::Gemma2 => gemma2::read(&f)?,
            Family::Gemma3 => gemma3::read(&f)?,
            Family::Phi3 => phi3::read(&f)?,
            Family::Lfm2 => lfm2::read(&f)?,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// The configuration as a Hugging Face `config.json` text, with the fields
    /// `transformers` reads: GPT-2's, Llama's (`LlamaForCausalLM`) and its layout's
    /// families' (Mistral's, Qwen2's and Phi-3's among them), Gemma 2's, Gemma 3's and
    /// LFM2's. Other families (GPT-NeoX, GPT-Neo), and configs with what their
    /// family's file cannot say (windows in a Llama, partial rotary, different q/k/v and
    /// output biases), are refused: those files are read, not written, here.
    pub fn to_json(&self) -> Result<String> {
        let value = match self.family {
            Family::Gpt2 => gpt2::write(self)?,
            Family::Llama
            | Family::Mistral
            | Family::Qwen2
            | Family::Qwen3
            | Family::SmolLm3
            | Family::Olmo2
            | Family::Granite
            | Family::Phi3 => llama::write(self)?,
            Family::Gemma2 | Family::Gemma3 => gemma3::write(self)?,
            Family::Lfm2 => lfm2::write(self)?,
            other => bail!(
                "{} models are not saved as Hugging Face directories (GPT-2, Llama, Mistral, Qwen2, Qwen3, SmolLM3, OLMo 2, Granite, Phi-3, Gemma 2, Gemma 3 and LFM2 are)",
                other.model_type()
            ),
        };
        let text = serde_json::to_string_pretty(&value).map_err(candle_core::Error::wrap)?;
        // What is written must read back as this model: anything the fields cannot say
        // is refused here rather than saved wrong.
        if self.family != Family::Gpt2 && !Self::from_json(&text)?.same_model(self) {
            bail!(
                "this {} model has parts its config.json cannot express; it cannot be saved",
                self.family.model_type()
            )
        }
        Ok(text)
    }
}
