//! nanoGPT checkpoints: `ckpt.pt`, a PyTorch pickle holding `model` (a state dict with
//! `nn.Linear` weights `[out, in]`, `_orig_mod.` before every name when the model was
//! compiled, no biases when trained with `bias=False`) and `model_args` (the dimensions).

use std::collections::HashMap;
use std::io::BufReader;
use std::path::Path;

use candle_core::pickle::{Object, Stack};
use candle_core::{bail, DType, Device, Result, Tensor};
use candle_nn::VarBuilder;

use crate::{Activation, Gpt, GptConfig};

fn err(path: &Path, e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("{}: {e}", path.display()))
}

/// The `model_args` dict of a nanoGPT checkpoint, as integers, floats and booleans.
fn model_args(path: &Path) -> Result<HashMap<String, Object>> {
    let file = std::fs::File::open(path).map_err(|e| err(path, e))?;
    let mut zip = zip::ZipArchive::new(BufReader::new(file))
        .map_err(|e| err(path, format!("not a PyTorch zip checkpoint: {e}")))?;
    let pkl = zip
        .file_names()
        .filter_map(|n| n.ok().map(|n| n.into_owned()))
        .find(|n| n.ends_with("data.pkl"))
        .ok_or_else(|| err(path, "no data.pkl inside"))?;
    let reader = zip.by_name(&pkl).map_err(|e| err(path, e))?;
    let mut stack = Stack::empty();
    stack
        .read_loop(&mut BufReader::new(reader))
        .map_err(|e| err(path, e))?;
    let Object::Dict(top) = stack.finalize().map_err(|e| err(path, e))? else {
        bail!("{}: the checkpoint is not a dict", path.display())
    };
    let Some((_, Object::Dict(args))) = top
        .into_iter()
        .find(|(k, _)| *k == Object::Unicode("model_args".into()))
    else {
        bail!(
            "{}: no model_args dict (not a nanoGPT checkpoint?)",
            path.display()
        )
    };
    Ok(args
        .into_iter()
        .filter_map(|(k, v)| match k {
            Object::Unicode(k) => Some((k, v)),
            _ => None,
        })
        .collect())
}

/// The model configuration a nanoGPT checkpoint was trained with.
pub fn nanogpt_config(path: &Path) -> Result<GptConfig> {
    let args = model_args(path)?;
    let int = |name: &str| -> Result<usize> {
        match args.get(name) {
            Some(Object::Int(v)) if *v > 0 => Ok(*v as usize),
            Some(Object::Long(v)) if *v > 0 => Ok(*v as usize),
            other => bail!(
                "{}: model_args[{name:?}] must be a positive integer, got {other:?}",
                path.display()
            ),
        }
    };
    let dropout = match args.get("dropout") {
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
    cfg.validate().map_err(|e| err(path, e))?;
    Ok(cfg)
}

/// Loads a nanoGPT `ckpt.pt`.
pub fn load_nanogpt(path: &Path, dtype: DType, device: &Device) -> Result<Gpt> {
    let cfg = nanogpt_config(path)?;
    let state =
        candle_core::pickle::read_all_with_key(path, Some("model")).map_err(|e| err(path, e))?;
    let mut tensors = HashMap::new();
    for (name, t) in state {
        let name = name.strip_prefix("_orig_mod.").unwrap_or(&name).to_string();
        if name.ends_with(".attn.bias") || name == "lm_head.weight" {
            // The causal-mask buffer, and the head tied to `wte`.
            continue;
        }
        let linear = [
            "attn.c_attn.weight",
            "attn.c_proj.weight",
            "mlp.c_fc.weight",
            "mlp.c_proj.weight",
        ]
        .iter()
        .any(|s| name.ends_with(s));
        // nn.Linear [out, in] -> GPT-2 Conv1D [in, out].
        let t = if linear { t.t()?.contiguous()? } else { t };
        tensors.insert(name, t);
    }
    // bias=False: the missing biases are zeros.
    let d = cfg.n_embd;
    let mut zeros = |name: String, len: usize| -> Result<()> {
        if let std::collections::hash_map::Entry::Vacant(e) = tensors.entry(name) {
            e.insert(Tensor::zeros(len, DType::F32, &Device::Cpu)?);
        }
        Ok(())
    };
    for i in 0..cfg.n_layer {
        let p = format!("transformer.h.{i}");
        zeros(format!("{p}.ln_1.bias"), d)?;
        zeros(format!("{p}.ln_2.bias"), d)?;
        zeros(format!("{p}.attn.c_attn.bias"), 3 * d)?;
        zeros(format!("{p}.attn.c_proj.bias"), d)?;
        zeros(format!("{p}.mlp.c_fc.bias"), 4 * d)?;
        zeros(format!("{p}.mlp.c_proj.bias"), d)?;
    }
    zeros("transformer.ln_f.bias".into(), d)?;
    let vb = VarBuilder::from_tensors(tensors, dtype, device);
    Gpt::new(&cfg, vb).map_err(|e| err(path, e))
}
