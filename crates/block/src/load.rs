//! Reading checkpoints in Hugging Face's layout, any supported family: a directory with
//! `config.json` and `model.safetensors` (or shards listed in
//! `model.safetensors.index.json`); writing GPT-2 ones.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use candle_core::quantized::GgmlDType;
use candle_core::{bail, DType, Device, Result, Tensor};
use candle_nn::VarBuilder;

use crate::family::TensorNames;
use crate::files::{self, FileTensors};
use crate::{check, Gpt, GptConfig};

/// What to load the weights as: a dtype for everything, and optionally a block-quantized
/// format for the matrix products (see [`Gpt::new_quantized`]). A plain [`DType`]
/// converts into it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadAs {
    /// The dtype of the embeddings, LayerNorms and biases (and of the matrix products
    /// when not quantized).
    pub dtype: DType,
    /// Quantize the matrix products' weights while loading.
    pub quantize: Option<GgmlDType>,
}

impl From<DType> for LoadAs {
    fn from(dtype: DType) -> Self {
        Self {
            dtype,
            quantize: None,
        }
    }
}

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

/// An error that names the file it is about.
pub(crate) fn path_err(path: &Path, e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("{}: {e}", path.display()))
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
    let names = TensorNames::of(cfg.family);
    let (root, head) = (names.root(), format!("{}.weight", names.head));
    let embed = format!("{}.weight", names.embed);
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
    check::check_tensor_table(cfg, &shapes, dtype, false)?;
    Ok(prefixed)
}

/// Names without the family's root prefix are looked up bare.
fn with_prefix_fallback<'a>(vb: VarBuilder<'a>, cfg: &GptConfig, prefixed: bool) -> VarBuilder<'a> {
    if prefixed {
        return vb;
    }
    let root = format!("{}.", TensorNames::of(cfg.family).root());
    vb.rename_f(move |name: &str| name.strip_prefix(&root).unwrap_or(name).to_string())
}

/// Loads a model from a `config.json` text and safetensors bytes held in memory (an
/// embedded model, say).
pub fn load_bytes(
    config_json: &str,
    weights: &[u8],
    load_as: impl Into<LoadAs>,
    device: &Device,
) -> Result<Gpt> {
    let LoadAs { dtype, quantize } = load_as.into();
    let cfg = GptConfig::from_json(config_json)?;
    let st = candle_core::safetensors::SliceSafetensors::new(weights)
        .map_err(|e| candle_core::Error::Msg(format!("not a valid safetensors buffer: {e}")))?;
    let views = st.tensors();
    let infos = views
        .iter()
        .map(|(n, v)| (n.as_str(), v.dtype(), v.shape()));
    let prefixed = check_header(&cfg, infos, dtype)?;
    let vb = VarBuilder::from_backend(Box::new(st), dtype, device.clone());
    Gpt::build(&cfg, with_prefix_fallback(vb, &cfg, prefixed), quantize)
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

/// Loads a model from a Hugging Face directory of any supported family, converting weights
/// to a dtype (or [`LoadAs`]).
pub fn load_dir(dir: &Path, load_as: impl Into<LoadAs>, device: &Device) -> Result<Gpt> {
    let cfg = read_config(dir)?;
    load_files(&cfg, &weight_files(dir)?, load_as, device)
}

/// Loads a model for `cfg` from safetensors files with or without the family's root prefix
/// (`transformer.`, `model.`, `gpt_neox.`).
pub fn load_files(
    cfg: &GptConfig,
    files: &[PathBuf],
    load_as: impl Into<LoadAs>,
    device: &Device,
) -> Result<Gpt> {
    let LoadAs { dtype, quantize } = load_as.into();
    cfg.validate()?;
    let (st, prefixed) = open(cfg, files, dtype)?;
    let vb = VarBuilder::from_backend(Box::new(st), dtype, device.clone());
    Gpt::build(cfg, with_prefix_fallback(vb, cfg, prefixed), quantize)
}

/// Writes `model` as a Hugging Face directory (`config.json`, `model.safetensors`) that
/// `transformers.AutoModelForCausalLM.from_pretrained` loads: GPT-2 models as
/// `GPT2LMHeadModel`, Llama models as `LlamaForCausalLM` (other families are refused, see
/// [`GptConfig::to_json`](crate::GptConfig::to_json)). Each file is written to a
/// temporary name and renamed, so an interrupted save never leaves a half-written file.
pub fn save_dir(model: &Gpt, dir: &Path) -> Result<()> {
    save_dir_as(model, dir, model.dtype())
}

/// As [`save_dir`], storing the weights as `dtype` (f16 halves the file).
pub fn save_dir_as(model: &Gpt, dir: &Path, dtype: DType) -> Result<()> {
    if model.config().norm_placement != crate::NormPlacement::Pre {
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

/// Writes through `write` to `path.tmp`, then renames it over `path`.
pub fn write_atomic(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    write(&tmp)?;
    std::fs::rename(&tmp, path).map_err(|e| path_err(path, e))
}
