//! nanoGPT checkpoints: `ckpt.pt`, a PyTorch zip holding a pickle (`data.pkl`) with `model`
//! (a state dict with `nn.Linear` weights `[out, in]`, `_orig_mod.` before every name when
//! the model was compiled, no biases when trained with `bias=False`) and `model_args`
//! (the dimensions), and one zip entry per tensor storage.
//!
//! The file is treated as hostile: zip entries must be stored uncompressed (as
//! `torch.save` writes them, so nothing can expand), the pickle is dry-run before it is
//! unpickled ([`pickle`]), and every tensor's shape, dtype and byte range is checked
//! against the config and the zip entry before anything is allocated for it.

mod pickle;

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

use candle_core::pickle::{Object, Stack};
use candle_core::{bail, DType, Device, Result, Tensor};
use candle_nn::VarBuilder;

use crate::checkpoint::check;
use crate::checkpoint::io::path_err;
use crate::checkpoint::options::LoadOptions;
use crate::config::{Activation, GptConfig};
use crate::model::Gpt;

/// Largest `data.pkl` read: nanoGPT's holds names and shapes, a few KB.
const MAX_PICKLE_BYTES: u64 = 64 << 20;

/// An opened checkpoint: the zip, and the unpickled top-level dict.
struct Checkpoint {
    zip: zip::ZipArchive<BufReader<File>>,
    /// Prefix of the storage entries: `ckpt/data` for `ckpt/data.pkl`.
    data_dir: String,
    top: Vec<(Object, Object)>,
}

fn open(path: &Path) -> Result<Checkpoint> {
    let file = File::open(path).map_err(|e| path_err(path, e))?;
    let file_len = file.metadata().map_err(|e| path_err(path, e))?.len();
    let mut zip = zip::ZipArchive::new(BufReader::new(file))
        .map_err(|e| path_err(path, format!("not a PyTorch zip checkpoint: {e}")))?;
    for i in 0..zip.len() {
        let entry = zip.by_index_raw(i).map_err(|e| path_err(path, e))?;
        if entry.compression() != zip::CompressionMethod::Stored
            || entry.size() != entry.compressed_size()
            || entry.size() > file_len
        {
            bail!(
                "{}: zip entry {} is compressed or claims {} bytes; torch.save stores entries \
                 uncompressed",
                path.display(),
                entry.name().unwrap_or_default(),
                entry.size()
            )
        }
    }
    let pkl = zip
        .file_names()
        .filter_map(|n| n.ok().map(|n| n.into_owned()))
        .find(|n| n.ends_with("data.pkl"))
        .ok_or_else(|| path_err(path, "no data.pkl inside (not a PyTorch checkpoint)"))?;
    let mut bytes = Vec::new();
    {
        let entry = zip.by_name(&pkl).map_err(|e| path_err(path, e))?;
        if entry.size() > MAX_PICKLE_BYTES {
            bail!(
                "{}: data.pkl is {} bytes; refusing more than {MAX_PICKLE_BYTES}",
                path.display(),
                entry.size()
            )
        }
        entry
            .take(MAX_PICKLE_BYTES)
            .read_to_end(&mut bytes)
            .map_err(|e| path_err(path, e))?;
    }
    pickle::check(&bytes).map_err(|e| path_err(path, e))?;
    let mut stack = Stack::empty();
    stack
        .read_loop(&mut std::io::Cursor::new(&bytes))
        .map_err(|e| path_err(path, e))?;
    let Object::Dict(top) = stack.finalize().map_err(|e| path_err(path, e))? else {
        bail!("{}: the checkpoint is not a dict", path.display())
    };
    let data_dir = pkl.trim_end_matches(".pkl").to_string();
    Ok(Checkpoint { zip, data_dir, top })
}

impl Checkpoint {
    fn get(&self, key: &str) -> Option<&Object> {
        self.top
            .iter()
            .find(|(k, _)| matches!(k, Object::Unicode(s) if s == key))
            .map(|(_, v)| v)
    }
}

/// The configuration of a parsed checkpoint, from its `model_args`.
fn config_of(path: &Path, ckpt: &Checkpoint) -> Result<GptConfig> {
    let Some(Object::Dict(args)) = ckpt.get("model_args") else {
        bail!(
            "{}: no model_args dict (not a nanoGPT checkpoint?)",
            path.display()
        )
    };
    let arg = |name: &str| {
        args.iter()
            .find(|(k, _)| matches!(k, Object::Unicode(s) if s == name))
            .map(|(_, v)| v)
    };
    let int = |name: &str| -> Result<usize> {
        match arg(name).and_then(as_int) {
            Some(v) if v > 0 && v <= u32::MAX as i64 => Ok(v as usize),
            _ => bail!(
                "{}: model_args[{name:?}] must be a positive integer, got {:?}",
                path.display(),
                arg(name)
            ),
        }
    };
    let dropout = match arg("dropout") {
        Some(Object::Float(p)) => *p as f32,
        Some(Object::Int(p)) => *p as f32,
        _ => 0.0,
    };
    let vocab_size = int("vocab_size")?;
    let cfg = GptConfig {
        vocab_size,
        n_positions: int("block_size")?,
        n_embd: int("n_embd")?,
        n_layer: int("n_layer")?,
        n_head: int("n_head")?,
        n_inner: None,
        // nanoGPT's MLP uses nn.GELU(): the exact form.
        activation_function: Activation::Gelu,
        resid_pdrop: dropout,
        embd_pdrop: dropout,
        attn_pdrop: dropout,
        tie_word_embeddings: true,
        // The GPT-2 tokenizer's end of text, when the vocabulary has it.
        bos_token_id: (vocab_size > 50256).then_some(50256),
        eos_token_id: (vocab_size > 50256).then_some(50256),
        ..GptConfig::gpt2()
    };
    cfg.validate().map_err(|e| path_err(path, e))?;
    Ok(cfg)
}

/// The model configuration a nanoGPT checkpoint was trained with.
pub fn nanogpt_config(path: &Path) -> Result<GptConfig> {
    config_of(path, &open(path)?)
}

fn as_int(o: &Object) -> Option<i64> {
    match o {
        Object::Int(i) => Some(*i as i64),
        Object::Long(l) => Some(*l),
        _ => None,
    }
}

fn as_dims(o: &Object) -> Option<Vec<usize>> {
    match o {
        Object::Tuple(v) => v
            .iter()
            .map(|x| as_int(x).and_then(|i| usize::try_from(i).ok()))
            .collect(),
        _ => None,
    }
}

/// Where a tensor's data lives: `_rebuild_tensor_v2(storage, offset, size, stride, ..)`.
#[derive(Debug)]
struct StoredTensor {
    key: String,
    dtype: DType,
    /// Storage length and offset into it, in elements.
    storage_len: usize,
    offset: usize,
    shape: Vec<usize>,
    stride: Vec<usize>,
}

/// Reads a pickled tensor, unwrapping `nn.Parameter`s; `None` if `o` is not one.
fn stored_tensor(o: &Object) -> Option<StoredTensor> {
    let Object::Reduce { callable, args } = o else {
        return None;
    };
    let (
        Object::Class {
            module_name,
            class_name,
        },
        Object::Tuple(args),
    ) = (&**callable, &**args)
    else {
        return None;
    };
    match (module_name.as_str(), class_name.as_str()) {
        ("torch._utils", "_rebuild_tensor_v2") => rebuild_tensor_v2(args),
        ("torch._utils", "_rebuild_parameter") => stored_tensor(args.first()?),
        // (func, type, func_args, state)
        ("torch._tensor", "_rebuild_from_type_v2") => match args.as_slice() {
            [Object::Class { class_name, .. }, _, Object::Tuple(a), ..]
                if class_name == "_rebuild_tensor_v2" =>
            {
                rebuild_tensor_v2(a)
            }
            _ => None,
        },
        _ => None,
    }
}

fn rebuild_tensor_v2(args: &[Object]) -> Option<StoredTensor> {
    let [Object::PersistentLoad(storage), offset, size, stride, ..] = args else {
        return None;
    };
    // ("storage", torch.FloatStorage, key, location, numel)
    let Object::Tuple(storage) = &**storage else {
        return None;
    };
    let [_, Object::Class { class_name, .. }, Object::Unicode(key), _, numel] = storage.as_slice()
    else {
        return None;
    };
    let dtype = match class_name.as_str() {
        "FloatStorage" => DType::F32,
        "HalfStorage" => DType::F16,
        "BFloat16Storage" => DType::BF16,
        "DoubleStorage" => DType::F64,
        _ => DType::U8, // refused later, with the name of the tensor
    };
    Some(StoredTensor {
        key: key.clone(),
        dtype,
        storage_len: usize::try_from(as_int(numel)?).ok()?,
        offset: usize::try_from(as_int(offset)?).ok()?,
        shape: as_dims(size)?,
        stride: as_dims(stride)?,
    })
}

/// nanoGPT's `nn.Linear` weights, stored `[out, in]`; GPT-2's Conv1D is `[in, out]`.
fn is_linear(name: &str) -> bool {
    [
        "attn.c_attn.weight",
        "attn.c_proj.weight",
        "mlp.c_fc.weight",
        "mlp.c_proj.weight",
    ]
    .iter()
    .any(|s| name.ends_with(s))
}

/// Loads a nanoGPT `ckpt.pt` (GPT-2's fused q/k/v already; [`LoadOptions::fused`] changes
/// nothing).
pub fn load_nanogpt(path: &Path, opts: impl Into<LoadOptions>, device: &Device) -> Result<Gpt> {
    let LoadOptions {
        dtype,
        quantize,
        fused,
    } = opts.into();
    let mut ckpt = open(path)?;
    let cfg = config_of(path, &ckpt)?;
    let Some(Object::Dict(state)) = ckpt.get("model") else {
        bail!("{}: no model state dict", path.display())
    };
    let mut stored = HashMap::new();
    for (name, value) in state {
        let Object::Unicode(name) = name else {
            bail!("{}: a state dict key is not a string", path.display())
        };
        let name = name.strip_prefix("_orig_mod.").unwrap_or(name);
        if name.ends_with(".attn.bias") || name == "lm_head.weight" {
            // The causal-mask buffer, and the head tied to `wte`.
            continue;
        }
        let Some(t) = stored_tensor(value) else {
            bail!("{}: model[{name:?}] is not a tensor", path.display())
        };
        stored.insert(name.to_string(), t);
    }
    // Shapes in GPT-2's layout, checked against the config before anything is read.
    let shapes = stored
        .iter()
        .map(|(name, t)| {
            let mut shape = t.shape.clone();
            if is_linear(name) {
                shape.reverse();
            }
            (name.clone(), shape)
        })
        .collect();
    check::check_tensor_table(&cfg, &shapes, dtype, true).map_err(|e| path_err(path, e))?;

    let mut tensors = HashMap::new();
    let mut missing_biases = Vec::new();
    check::for_each_tensor(&cfg, |t| {
        match stored.get(t.name) {
            Some(s) => {
                let x = read_tensor(&mut ckpt, path, t.name, s)?;
                let x = if is_linear(t.name) {
                    x.t()?.contiguous()?
                } else {
                    x
                };
                tensors.insert(t.name.to_string(), x);
            }
            // bias=False: the missing biases are zeros.
            None => missing_biases.push((t.name.to_string(), t.shape[0])),
        }
        Ok(())
    })?;
    for (name, len) in missing_biases {
        tensors.insert(name, Tensor::zeros(len, DType::F32, &Device::Cpu)?);
    }
    let vb = VarBuilder::from_tensors(tensors, dtype, device);
    Gpt::build(&cfg, vb, quantize, fused).map_err(|e| path_err(path, e))
}

/// Reads one tensor's bytes after checking them against its zip entry.
fn read_tensor(ckpt: &mut Checkpoint, path: &Path, name: &str, t: &StoredTensor) -> Result<Tensor> {
    if !matches!(t.dtype, DType::F32 | DType::F16 | DType::BF16 | DType::F64) {
        bail!(
            "{}: tensor {name} is not stored as f32, f16, bf16 or f64",
            path.display()
        )
    }
    // Row-major strides only: nanoGPT's weights are contiguous.
    let mut expected = vec![1usize; t.shape.len()];
    for i in (0..t.shape.len().saturating_sub(1)).rev() {
        expected[i] = expected[i + 1].saturating_mul(t.shape[i + 1]);
    }
    if t.stride != expected && t.shape.iter().product::<usize>() > 1 {
        bail!(
            "{}: tensor {name} is not contiguous (strides {:?})",
            path.display(),
            t.stride
        )
    }
    let numel: usize = t.shape.iter().product(); // bounded: the shape matched the config
    let size = t.dtype.size_in_bytes();
    let entry_name = format!("{}/{}", ckpt.data_dir, t.key);
    let mut entry = ckpt
        .zip
        .by_name(&entry_name)
        .map_err(|e| path_err(path, format!("tensor {name}: storage {entry_name}: {e}")))?;
    let end = t.offset.checked_add(numel);
    let fits = end.is_some_and(|end| {
        end <= t.storage_len && (end as u128) * (size as u128) <= entry.size() as u128
    });
    if !fits {
        bail!(
            "{}: tensor {name} reads past the end of its storage ({} bytes)",
            path.display(),
            entry.size()
        )
    }
    std::io::copy(
        &mut (&mut entry).take((t.offset * size) as u64),
        &mut std::io::sink(),
    )
    .map_err(|e| path_err(path, e))?;
    let mut bytes = vec![0u8; numel * size];
    entry
        .read_exact(&mut bytes)
        .map_err(|e| path_err(path, e))?;
    Tensor::from_raw_buffer(&bytes, t.dtype, &t.shape, &Device::Cpu)
}
