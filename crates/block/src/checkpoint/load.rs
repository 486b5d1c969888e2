//! The one entry point: a checkpoint of any format by its path.

use std::path::Path;

use candle_core::{bail, Device, Result};

use super::gguf::Gguf;
use super::io::path_err;
use super::nanogpt::load_nanogpt;
use super::options::LoadOptions;
use super::safetensors::{load_dir, load_files, read_config};
use crate::model::Gpt;

/// Loads the model at `path`, by what it is:
/// - a Hugging Face directory (`config.json` and `model.safetensors`, or the shards its
///   index names) of any supported family;
/// - a `.safetensors` file, its `config.json` beside it;
/// - a `.gguf` file, llama.cpp's format ([`Gguf::load`]);
/// - a nanoGPT `.pt` checkpoint.
///
/// ```no_run
/// use candle_core::{DType, Device};
/// use gpt_blocks::LoadOptions;
///
/// let opts = LoadOptions::new(DType::F32).for_inference();
/// let model = gpt_blocks::load("path/to/SmolLM2-135M".as_ref(), opts, &Device::Cpu)?;
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn load(path: &Path, opts: impl Into<LoadOptions>, device: &Device) -> Result<Gpt> {
    let opts = opts.into();
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    if path.is_dir() || (!path.exists() && ext.is_empty()) {
        // A missing directory is reported by the file it lacks (`config.json`).
        return load_dir(path, opts, device);
    }
    if !path.is_file() {
        bail!("{}: no such file", path.display())
    }
    match ext {
        "gguf" => Gguf::open(path)?
            .load(opts, device)
            .map_err(|e| path_err(path, e)),
        "pt" => load_nanogpt(path, opts, device),
        "safetensors" => {
            let dir = path.parent().unwrap_or(Path::new("."));
            let cfg = read_config(dir)?;
            load_files(&cfg, std::slice::from_ref(&path.to_path_buf()), opts, device)
        }
        _ => bail!(
            "{}: expected a model directory, a .gguf file, a .safetensors file or a nanoGPT .pt checkpoint",
            path.display()
        ),
    }
}
