//! Reading checkpoints in Hugging Face's layout, any supported family: a directory with
//! `config.json` and `model.safetensors` (or shards listed in
//! `model.safetensors.index.json`); writing GPT-2 ones.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use candle_core::quantized::GgmlDType;
use candle_core::{bail, DType, Device, Result, Tensor};
use candle_nn::VarBuilder;
use mha::{MultiHeadAttention, Proj, QkvProj, WeightLayout};

use crate::arena::FloatArena;
use crate::family::TensorNames;
use crate::files::{self, FileTensors};
use crate::{check, Block, Gpt, GptConfig, Mlp, Norm};

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
    let in_file = in_file(cfg, prefixed);
    vb.rename_f(move |name: &str| in_file(name))
}

/// The name a tensor the model asks for has in the files (`prefixed`: whether their names
/// carry the family's root prefix).
fn in_file(cfg: &GptConfig, prefixed: bool) -> impl Fn(&str) -> String + Send + Sync + 'static {
    let root = format!("{}.", TensorNames::of(cfg.family).root());
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

/// [`load_dir`] for inference: each block's q/k/v projections, and its gate and up
/// projections, computed as one product each ([`Gpt::fused`]), the fused matrices views of
/// the matrices as read rather than copies of them. On the CPU every block matrix is read,
/// in `load_as`'s dtype, into one buffer, in the order the blocks use them (q, k and v of a
/// block next to each other, then its output projection, gate and up next to each other,
/// then down), as [`crate::Gguf::load_fused`] reads a GGUF file's; quantized while loading
/// (`load_as.quantize`) or off the CPU, each block is fused as it is built. The model
/// computes what [`load_dir`]'s does, up to the summation order of the products.
pub fn load_dir_fused(dir: &Path, load_as: impl Into<LoadAs>, device: &Device) -> Result<Gpt> {
    let cfg = read_config(dir)?;
    load_files_fused(&cfg, &weight_files(dir)?, load_as, device)
}

/// [`load_files`] for inference, as [`load_dir_fused`].
pub fn load_files_fused(
    cfg: &GptConfig,
    files: &[PathBuf],
    load_as: impl Into<LoadAs>,
    device: &Device,
) -> Result<Gpt> {
    let LoadAs { dtype, quantize } = load_as.into();
    cfg.validate()?;
    let (st, prefixed) = open(cfg, files, dtype)?;
    let in_file = in_file(cfg, prefixed);
    let st = Arc::new(st);
    let arena = Arc::new(Mutex::new(FloatArena::default()));
    let backend = ArenaTensors {
        files: st.clone(),
        arena: arena.clone(),
    };
    let vb = VarBuilder::from_backend(Box::new(backend), dtype, device.clone());
    let model = Gpt::build_with(
        cfg,
        with_prefix_fallback(vb, cfg, prefixed),
        quantize,
        |i, vb| {
            // Read when the first block is built: after the token embedding, whose reading is
            // the load's largest moment and is better had before the blocks are all there.
            if i == 0 && quantize.is_none() && device.is_cpu() {
                *lock(&arena)? = block_matrices(&st, cfg, dtype, &in_file)?;
            }
            if lock(&arena)?.slots.is_empty() {
                let block = Block::new(cfg, i, vb)?;
                return match quantize {
                    Some(q) => block.quantize(q)?.fused(),
                    None => block.fused(),
                };
            }
            block_from_arena(cfg, i, vb, &arena, &in_file)
        },
        // A quantized head (a tied model's table too) read and packed row by row.
        |name| match (quantize, device.is_cpu()) {
            (Some(q), true) => Ok(st.packed_rows(&in_file(name), dtype, q)?.map(Arc::new)),
            _ => Ok(None),
        },
    )?;
    if let Some(name) = lock(&arena)?.slots.keys().next() {
        bail!("internal error: tensor {name} was read for a block but no block took it")
    }
    Ok(model)
}

fn lock(arena: &Mutex<FloatArena>) -> Result<std::sync::MutexGuard<'_, FloatArena>> {
    arena
        .lock()
        .map_err(|_| candle_core::Error::Msg("the weight buffer's lock is poisoned".into()))
}

/// The files' block matrices read into one buffer of `dtype` ([`FloatArena`]), in the order
/// the blocks use them; keyed by their names in the files. A GPT-NeoX `query_key_value`
/// is left out: its rows are regrouped into a copy as it loads.
fn block_matrices(
    st: &FileTensors,
    cfg: &GptConfig,
    dtype: DType,
    in_file: &dyn Fn(&str) -> String,
) -> Result<FloatArena> {
    let names = TensorNames::of(cfg.family);
    let (attn, mlp) = (names.attn, names.mlp_prefix);
    let mut order = Vec::new(); // the parts of a block, in the order they are read
    match TensorNames::attn_layout(cfg.family) {
        WeightLayout::Separate { q, k, v, o } => {
            order.extend([q, k, v, o].map(|p| format!("{attn}.{p}.weight")))
        }
        WeightLayout::HeadInterleavedQkv { o, .. } => order.push(format!("{attn}.{o}.weight")),
        WeightLayout::Gpt2Conv1d => {
            order.extend(["c_attn", "c_proj"].map(|p| format!("{attn}.{p}.weight")))
        }
        WeightLayout::TorchInProj => {}
    }
    let m = names.mlp;
    for p in m.gate.into_iter().chain([m.up, m.down]) {
        order.push(format!("{mlp}.{p}.weight"));
    }
    let shapes: HashMap<&str, &[usize]> = st.infos().map(|(n, _, s)| (n, s)).collect();
    let mut parts = Vec::new();
    for i in 0..cfg.n_layer {
        for part in &order {
            let name = in_file(&format!("{}.{i}.{part}", names.layers));
            // Shapes were checked against the config when the files were opened.
            if let Some(&&[rows, cols]) = shapes.get(name.as_str()) {
                parts.push((name, [rows, cols]));
            }
        }
    }
    let mut arena = FloatArena::default();
    if parts.is_empty() {
        return Ok(arena);
    }
    let list: Vec<_> = parts.iter().map(|(n, s)| (n.as_str(), *s)).collect();
    let buf = st.read_arena(&list, dtype)?;
    let mut at = 0;
    for (name, [rows, cols]) in parts {
        arena.slots.insert(name, (buf.clone(), at, [rows, cols]));
        at += rows * cols;
    }
    Ok(arena)
}

/// Block `i` of a model loaded for inference, its matrices views of `arena`: q/k/v and
/// gate/up, read side by side, become one projection each with no copy.
fn block_from_arena(
    cfg: &GptConfig,
    i: usize,
    vb: VarBuilder,
    arena: &Mutex<FloatArena>,
    in_file: &dyn Fn(&str) -> String,
) -> Result<Block> {
    let names = TensorNames::of(cfg.family);
    let (d, inner) = (cfg.n_embd, cfg.inner_dim());
    let kv = cfg.kv_heads() * (d / cfg.n_head);
    // `(prefix, rows)` under `vb` read side by side: one `[Σ rows, cols]` view.
    // (The lock is held only here: the VarBuilder's reads take it too.)
    let span = |vb: &VarBuilder, parts: &[(&str, usize)], cols: usize| {
        let parts: Vec<_> = parts
            .iter()
            .map(|(p, rows)| {
                (
                    in_file(&format!("{}.{p}.weight", vb.prefix())),
                    [*rows, cols],
                )
            })
            .collect();
        lock(arena)?.take(&parts)
    };
    let biases = |vb: &VarBuilder, parts: &[(&str, usize)], on: bool| -> Result<Option<Tensor>> {
        if !on {
            return Ok(None);
        }
        let bs = parts
            .iter()
            .map(|(p, rows)| vb.pp(p).get(*rows, "bias"))
            .collect::<Result<Vec<_>>>()?;
        Ok(Some(Tensor::cat(&bs, 0)?))
    };
    let linear = |vb: VarBuilder, (d_out, d_in): (usize, usize), bias: bool| -> Result<Proj> {
        let b = match bias {
            true => Some(vb.get(d_out, "bias")?),
            false => None,
        };
        Proj::from_linear(&vb.get((d_out, d_in), "weight")?, b)
    };
    let attn_cfg = Block::attn_config(cfg, i);
    let layout = TensorNames::attn_layout(cfg.family);
    let a = vb.pp(names.attn);
    let qkv = match &layout {
        WeightLayout::Separate { q, k, v, .. } => {
            let parts = [(q.as_str(), d), (k.as_str(), kv), (v.as_str(), kv)];
            span(&a, &parts, d)?.map(|w| (w, parts))
        }
        _ => None,
    };
    let attn = match (qkv, &layout) {
        (Some((w, parts)), WeightLayout::Separate { o, .. }) => {
            let qkv = Proj::from_linear(&w, biases(&a, &parts, cfg.attn_bias)?)?;
            let o = linear(a.pp(o), (d, d), cfg.attn_out_bias)?;
            MultiHeadAttention::from_projections(&attn_cfg, QkvProj::Fused(qkv), o)?
        }
        _ => MultiHeadAttention::load(&attn_cfg, &layout, a)?.fused()?,
    };
    let m = vb.pp(names.mlp_prefix);
    let gate_up = match names.mlp.gate.filter(|_| cfg.gated_mlp) {
        Some(gate) => {
            let parts = [(gate, inner), (names.mlp.up, inner)];
            span(&m, &parts, d)?.map(|w| (w, parts))
        }
        None => None,
    };
    let mlp = match gate_up {
        Some((w, parts)) => {
            let gate_up = Proj::from_linear(&w, biases(&m, &parts, cfg.mlp_bias)?)?;
            let down = linear(m.pp(names.mlp.down), (d, inner), cfg.mlp_bias)?;
            Mlp::from_gate_up(cfg, gate_up, down)?
        }
        None => Mlp::new(cfg, m)?.fused()?,
    };
    let eps = cfg.layer_norm_epsilon;
    let ln_1 = Norm::new(cfg.norm, d, eps, vb.pp(names.attn_norm))?;
    let ln_2 = Norm::new(cfg.norm, d, eps, vb.pp(names.mlp_norm))?;
    Block::from_parts(cfg, i, ln_1, attn, ln_2, mlp)
}

/// The files' tensors, a block's matrices served as views of the [`FloatArena`] they were
/// read into (each taken out as it is served).
struct ArenaTensors {
    files: Arc<FileTensors>,
    arena: Arc<Mutex<FloatArena>>,
}

impl ArenaTensors {
    fn load(
        &self,
        name: &str,
        shape: Option<&[usize]>,
        dtype: DType,
        dev: &Device,
    ) -> Result<Tensor> {
        let mut arena = lock(&self.arena)?;
        let Some(&(_, _, stored)) = arena.slots.get(name) else {
            drop(arena);
            return self.files.load(name, dtype, dev);
        };
        let want = match shape {
            Some(&[rows, cols]) => [rows, cols],
            Some(other) => bail!("tensor {name} is {stored:?}, expected {other:?}"),
            None => stored,
        };
        match arena.take(&[(name.to_string(), want)])? {
            Some(w) => w.to_dtype(dtype)?.to_device(dev),
            None => bail!("cannot find tensor {name}"),
        }
    }
}

impl candle_nn::var_builder::SimpleBackend for ArenaTensors {
    fn get(
        &self,
        s: candle_core::Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> Result<Tensor> {
        let t = self.load(name, Some(s.dims()), dtype, dev)?;
        if t.shape() != &s {
            bail!("tensor {name} is {:?}, expected {:?}", t.dims(), s.dims())
        }
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> Result<Tensor> {
        self.load(name, None, dtype, dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.files.contains_tensor(name)
    }
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
