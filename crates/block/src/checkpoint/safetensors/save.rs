//! A model written as a Hugging Face directory: the `config.json` of GPT-2, Llama, a
//! family in Llama's layout (Qwen3, SmolLM3, OLMo 2, Granite, Phi-3), Gemma 2 and 3 or
//! LFM2, and `model.safetensors`.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{bail, DType, Result, Tensor};

use crate::checkpoint::io::{path_err, write_atomic};
use crate::config::NormPlacement;
use crate::model::Gpt;

/// Writes `model` as a Hugging Face directory (`config.json`, `model.safetensors`) that
/// `transformers.AutoModelForCausalLM.from_pretrained` loads: GPT-2 models as
/// `GPT2LMHeadModel`, Llama models as `LlamaForCausalLM`, Qwen3, SmolLM3, OLMo 2,
/// Granite, Phi-3, Gemma 2, Gemma 3 and LFM2 as their own classes (other families are
/// refused, see [`GptConfig::to_json`](crate::GptConfig::to_json)). Each file is written
/// to a temporary name and renamed, so an interrupted save never leaves a half-written
/// file.
pub fn save_dir(model: &Gpt, dir: &Path) -> Result<()> {
    save_dir_as(model, dir, model.dtype())
}

/// As [`save_dir`], storing the weights as `dtype` (f16 halves the file).
pub fn save_dir_as(model: &Gpt, dir: &Path, dtype: DType) -> Result<()> {
    if model.config().norm_placement == NormPlacement::Post {
        // transformers would read the file as a pre-norm model and silently differ.
        bail!("post-norm models have no Hugging Face layout; only pre-norm models can be saved")
    }
    // Refuse what cannot be written before anything is.
    let json = model.config().to_json()?;
    std::fs::create_dir_all(dir).map_err(|e| path_err(dir, e))?;
    let tensors: HashMap<String, Tensor> = model
        .named_tensors()?
        .into_iter()
        .map(|(k, v)| Ok((k, v.to_dtype(dtype)?.contiguous()?)))
        .collect::<Result<_>>()?;
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let weights = dir.join("model.safetensors");
    write_atomic(&weights, |tmp| {
        safetensors::serialize_to_file(&tensors, Some(metadata), tmp)
            .map_err(candle_core::Error::wrap)
    })?;
    let config = dir.join("config.json");
    write_atomic(&config, |tmp| {
        std::fs::write(tmp, &json).map_err(|e| path_err(tmp, e))
    })
}
