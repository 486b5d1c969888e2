//! Hugging Face checkpoints, any supported family: a directory with `config.json` and
//! `model.safetensors` (or shards listed in `model.safetensors.index.json`), names with or
//! without the family's root prefix; GPT-2 and Llama ones written.

mod files;
mod fused;
mod norm_shift;
mod save;
mod stored_fused;

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{bail, DType, Device, Result};
use candle_nn::VarBuilder;

pub use save::{save_dir, save_dir_as};
pub use stored_fused::parts_of_stored;

use super::check;
use super::io::path_err;
use super::options::LoadOptions;
use crate::config::GptConfig;
use crate::model::Gpt;
use files::FileTensors;

/// Buffers that old checkpoints carry and the model recomputes: GPT-2's and GPT-Neo's
/// causal masks, NeoX's, and the rotary frequencies.
fn is_ignored_buffer(name: &str) -> bool {
    [
        ".attn.bias",
        ".attn.masked_bias",
        ".attention.bias",
        ".attention.masked_bias",
        ".rotary_emb.inv_freq",
    ]
    .iter()
    .any(|b| name.ends_with(b))
}

/// Reads and checks `dir/config.json`.
pub fn read_config(dir: &Path) -> Result<GptConfig> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| path_err(&path, e))?;
    GptConfig::from_json(&text).map_err(|e| path_err(&path, e))
}

/// The safetensors files of a checkpoint directory: `model.safetensors`, or the shards
/// named by `model.safetensors.index.json`.
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(|e| path_err(&index, e))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| path_err(&index, e))?;
        let Some(map) = json.get("weight_map").and_then(|m| m.as_object()) else {
            bail!("{}: no weight_map object", index.display())
        };
        let mut files = BTreeSet::new();
        for file in map.values() {
            let Some(name) = file.as_str() else {
                bail!("{}: weight_map values must be file names", index.display())
            };
            // Shards live beside the index; refuse paths that leave the directory.
            if name.contains('/') || name.contains('\\') || name == ".." {
                bail!(
                    "{}: shard name {name:?} is not a plain file name",
                    index.display()
                )
            }
            files.insert(dir.join(name));
        }
        return Ok(files.into_iter().collect());
    }
    bail!(
        "{}: no model.safetensors or model.safetensors.index.json",
        dir.display()
    )
}

/// Checks the header of a checkpoint against `cfg` before anything is read: every dtype
/// is a float the model takes, every tensor the model needs is there with the shape the
/// config implies, and the model fits in memory as `dtype`. (The safetensors parser has
/// already checked each declared shape against its byte range.) Returns whether the names
/// carry the family's root prefix (`transformer.`, `model.`, `gpt_neox.`).
fn check_header<'a>(
    cfg: &GptConfig,
    tensors: impl Iterator<Item = (&'a str, safetensors::Dtype, &'a [usize])>,
    dtype: DType,
) -> Result<bool> {
    let mut shapes = HashMap::new();
    for (name, stored, shape) in tensors {
        if is_ignored_buffer(name) {
            continue;
        }
        files::model_dtype(name, stored)?;
        shapes.insert(name.to_string(), shape.to_vec());
    }
    let names = cfg.family.names();
    let (root, head) = (names.root(), format!("{}.weight", names.head.hf));
    let embed = format!("{}.weight", names.embed.hf);
    let bare_embed = embed.strip_prefix(&format!("{root}.")).unwrap_or(&embed);
    let prefixed = shapes.contains_key(&embed);
    if !prefixed && !shapes.contains_key(bare_embed) {
        bail!(
            "no token embedding ({embed} or {bare_embed}): not a {} checkpoint",
            cfg.family.model_type()
        )
    }
    if !prefixed {
        // Look bare names up under the names the model asks for.
        shapes = shapes
            .into_iter()
            .map(|(k, v)| match k == head {
                true => (k, v),
                false => (format!("{root}.{k}"), v),
            })
            .collect();
    }
    let shapes = stored_fused::expand_shapes(cfg, shapes)?;
    check::check_tensor_table(cfg, &shapes, dtype, false)?;
    Ok(prefixed)
}

/// Names without the family's root prefix are looked up bare.
pub(super) fn with_prefix_fallback<'a>(
    vb: VarBuilder<'a>,
    cfg: &GptConfig,
    prefixed: bool,
) -> VarBuilder<'a> {
    if prefixed {
        return vb;
    }
    let in_file = in_file(cfg, prefixed);
    vb.rename_f(move |name: &str| in_file(name))
}

/// The name a tensor the model asks for has in the files (`prefixed`: whether their names
/// carry the family's root prefix).
pub(super) fn in_file(
    cfg: &GptConfig,
    prefixed: bool,
) -> impl Fn(&str) -> String + Send + Sync + 'static {
    let root = format!("{}.", cfg.family.names().root());
    move |name: &str| match prefixed {
        true => name.to_string(),
        false => name.strip_prefix(&root).unwrap_or(name).to_string(),
    }
}

/// Loads a model from a `config.json` text and safetensors bytes held in memory (an
/// embedded model, say).
pub fn load_bytes(
    config_json: &str,
    weights: &[u8],
    opts: impl Into<LoadOptions>,
    device: &Device,
) -> Result<Gpt> {
    let LoadOptions {
        dtype,
        quantize,
        fused,
    } = opts.into();
    let cfg = GptConfig::from_json(config_json)?;
    let st = candle_core::safetensors::SliceSafetensors::new(weights)
        .map_err(|e| candle_core::Error::Msg(format!("not a valid safetensors buffer: {e}")))?;
    let views = st.tensors();
    let infos = views
        .iter()
        .map(|(n, v)| (n.as_str(), v.dtype(), v.shape()));
    let prefixed = check_header(&cfg, infos, dtype)?;
    let vb = VarBuilder::from_backend(
        norm_shift::for_family(&cfg, stored_fused::for_family(&cfg, Box::new(st))),
        dtype,
        device.clone(),
    );
    Gpt::build(
        &cfg,
        with_prefix_fallback(vb, &cfg, prefixed),
        quantize,
        fused,
    )
}

/// Opens the files and checks their headers against `cfg`. Returns the opened files and
/// whether the names carry the `transformer.` prefix.
fn open(cfg: &GptConfig, files: &[PathBuf], dtype: DType) -> Result<(FileTensors, bool)> {
    for f in files {
        if !f.is_file() {
            bail!("{}: weight file not found", f.display())
        }
    }
    let st = FileTensors::open(files)?;
    let prefixed = check_header(cfg, st.infos(), dtype).map_err(|e| {
        let names: Vec<_> = files.iter().map(|f| f.display().to_string()).collect();
        candle_core::Error::Msg(format!("{}: {e}", names.join(", ")))
    })?;
    Ok((st, prefixed))
}

/// Loads a model from a Hugging Face directory of any supported family.
pub(crate) fn load_dir(dir: &Path, opts: LoadOptions, device: &Device) -> Result<Gpt> {
    let cfg = read_config(dir)?;
    load_files(&cfg, &weight_files(dir)?, opts, device)
}

/// Loads a model for `cfg` from safetensors files with or without the family's root prefix
/// (`transformer.`, `model.`, `gpt_neox.`).
pub fn load_files(
    cfg: &GptConfig,
    files: &[PathBuf],
    opts: impl Into<LoadOptions>,
    device: &Device,
) -> Result<Gpt> {
    let opts = opts.into();
    cfg.validate()?;
    let (st, prefixed) = open(cfg, files, opts.dtype)?;
    if opts.fused {
        return fused::load(cfg, st, prefixed, opts, device);
    }
    let backend = norm_shift::for_family(cfg, stored_fused::for_family(cfg, Box::new(st)));
    let vb = VarBuilder::from_backend(backend, opts.dtype, device.clone());
    Gpt::build(
        cfg,
        with_prefix_fallback(vb, cfg, prefixed),
        opts.quantize,
        false,
    )
}
