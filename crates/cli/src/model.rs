//! The model `--model` names, loaded with its tokenizer and chat template: a Hugging Face
//! directory or `.safetensors` file, a GGUF file, a nanoGPT checkpoint, a hub id, or the
//! model built into the binary.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device};
use gpt_blocks::Gpt;

use crate::args::{device, ModelArgs};
use crate::text::chat_template::ChatTemplate;
use crate::text::tokenizer::Tokenizer;
use crate::text::{gguf_tokenizer, tokenizer_json};

/// The small model built into the binary (see `crates/cli/models/default/README.md`).
/// Its weights are `model.q5_0.gguf`, `gpt convert --type q5_0` of the directory's f16
/// `model.safetensors` (which transformers loads; the crate leaves it out, to stay under
/// crates.io's 10 MiB).
mod embedded {
    pub const GGUF: &[u8] = include_bytes!("../models/default/model.q5_0.gguf");
    pub const TOKENIZER: &[u8] = include_bytes!("../models/default/tokenizer.json");
}

/// A model ready to run, with its tokenizer when it has one.
pub struct Loaded {
    pub model: Gpt,
    pub tokenizer: Option<Tokenizer>,
    /// The model's chat template (or the plain format).
    pub chat: ChatTemplate,
    /// What was loaded, for messages.
    pub source: String,
}

fn tokenizer_file(path: &Path) -> Result<Option<Tokenizer>> {
    if !path.is_file() {
        return Ok(None);
    }
    read_tokenizer(path).map(Some)
}

/// Reads and parses a `tokenizer.json`, refusing files too large to be one before reading.
pub fn read_tokenizer(path: &Path) -> Result<Tokenizer> {
    read_tokenizer_json(path).map(Tokenizer::from)
}

/// As [`read_tokenizer`], the `tokenizers` crate's tokenizer itself.
pub fn read_tokenizer_json(path: &Path) -> Result<tokenizers::Tokenizer> {
    let len = std::fs::metadata(path)
        .with_context(|| path.display().to_string())?
        .len();
    if len > tokenizer_json::MAX_TOKENIZER_BYTES as u64 {
        bail!(
            "{}: {len} bytes is larger than any tokenizer.json ({} MB at most)",
            path.display(),
            tokenizer_json::MAX_TOKENIZER_BYTES >> 20
        )
    }
    let bytes = std::fs::read(path).with_context(|| path.display().to_string())?;
    tokenizer_json::parse(&bytes)
        .map_err(|e| anyhow!("{}: not a valid tokenizer.json: {e}", path.display()))
}

/// Loads what `--model` names (and checks its weights with `--check-weights`).
pub fn load(args: &ModelArgs) -> Result<Loaded> {
    load_with(args, false)
}

/// [`load`], with each block's q/k/v and gate/up projections fused into one product each
/// where they can share a matrix ([`gpt_blocks::Gpt::fused`]), for the commands that run
/// the model (`generate`, `score`, `bench`, `serve`, `chat`); those that show or save its
/// tensors by their checkpoint names load it as stored. GGUF files and Hugging Face
/// checkpoints: their loaders fuse each block as they read it (float matrices read side by
/// side, the fused ones views of them; quantized ones concatenated, the separate ones'
/// memory serving the next block). A nanoGPT checkpoint (GPT-2's fused layout already)
/// loads as stored.
pub fn load_for_inference(args: &ModelArgs) -> Result<Loaded> {
    load_with(args, true)
}

fn load_with(args: &ModelArgs, fuse: bool) -> Result<Loaded> {
    // Quantizing while loading keeps the f32 blocks from all being in memory at once;
    // checking the weights needs them unquantized, so that loads first and quantizes after.
    let opts = gpt_blocks::LoadOptions {
        dtype: args.dtype.map_or(DType::F32, Into::into),
        quantize: args
            .quantize
            .filter(|_| !args.check_weights)
            .map(Into::into),
        fused: fuse,
    };
    let mut loaded = load_unchecked(args, opts)?;
    if args.check_weights {
        loaded.model.check_weights()?;
    }
    if let Some(q) = args.quantize.filter(|_| !loaded.model.is_quantized()) {
        loaded.model = loaded.model.quantize(q.into())?;
    }
    // On the CPU a half-precision model computes in f32, its matrices kept in half precision
    // and widened as they are read (llama.cpp's way): Candle's CPU kernels convert each f16
    // element to f32 and back, and its f16 GEMM is several times slower than the f32 one.
    if gpt_kernels::cpu_kernels(loaded.model.device())
        && matches!(loaded.model.dtype(), DType::F16 | DType::BF16)
    {
        loaded.model = loaded.model.with_f32_activations()?;
    }
    if let Some(kv) = args.kv_dtype {
        loaded.model = loaded.model.with_kv_dtype(Some(kv.into()));
    }
    Ok(loaded)
}

fn load_unchecked(args: &ModelArgs, opts: gpt_blocks::LoadOptions) -> Result<Loaded> {
    let dev = device(args.device)?;
    let plain = || ChatTemplate::new(None, None, None);
    let Some(spec) = &args.model else {
        let gguf = gpt_blocks::Gguf::from_bytes("built-in model", embedded::GGUF)?;
        let model = gguf_model(&gguf, args.dtype.map(Into::into), &dev, opts)
            .context("the built-in model")?;
        let tokenizer = tokenizer_json::parse(embedded::TOKENIZER)
            .map(Tokenizer::from)
            .map_err(|e| anyhow!("the built-in tokenizer: {e}"))?;
        return Ok(Loaded {
            model,
            tokenizer: Some(tokenizer),
            chat: plain(),
            source: "built-in model".into(),
        });
    };
    let loaded = |model, tokenizer, chat| Loaded {
        model,
        tokenizer,
        chat,
        source: spec.clone(),
    };
    let path = PathBuf::from(spec);
    if path.is_dir() {
        let model = gpt_blocks::load(&path, opts, &dev)?;
        let tokenizer = tokenizer_file(&path.join("tokenizer.json"))?;
        return Ok(loaded(model, tokenizer, ChatTemplate::from_dir(&path)?));
    }
    if path.is_file() {
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        if ext == "gguf" {
            let dtype = args.dtype.map(Into::into);
            return load_gguf(&path, dtype, &dev, opts).map(|(m, t, c)| loaded(m, t, c));
        }
        if ext == "pt" {
            let model = gpt_blocks::load(&path, opts, &dev)?;
            let tokenizer = tokenizer_file(&path.with_file_name("tokenizer.json"))?;
            return Ok(loaded(model, tokenizer, plain()));
        }
        if let Some(dir) = path.parent().filter(|_| ext == "safetensors") {
            let model = gpt_blocks::load(&path, opts, &dev)?;
            let tokenizer = tokenizer_file(&dir.join("tokenizer.json"))?;
            return Ok(loaded(model, tokenizer, ChatTemplate::from_dir(dir)?));
        }
        bail!("{spec}: expected a model directory, a .gguf file, a .safetensors file or a nanoGPT .pt checkpoint")
    }
    // Not a local path: a hub id such as `gpt2` or `openai-community/gpt2`.
    check_hub_id(spec)?;
    let dir = hub_download(spec, true)?;
    let model = gpt_blocks::load(&dir, opts, &dev)?;
    let tokenizer = tokenizer_file(&dir.join("tokenizer.json"))?;
    Ok(loaded(model, tokenizer, ChatTemplate::from_dir(&dir)?))
}

/// A GGUF file's model, the tokenizer its metadata describes, and its chat template.
/// Quantized matrices stay as stored; `--quantize` applies to those stored in full precision.
/// Without `--dtype`, the rest loads in the precision the file's float matrices have (on the
/// CPU: f32, with f16/bf16 matrices kept as stored; see [`gpt_blocks::Gguf::load`]).
fn load_gguf(
    path: &Path,
    dtype: Option<DType>,
    dev: &Device,
    opts: gpt_blocks::LoadOptions,
) -> Result<(Gpt, Option<Tokenizer>, ChatTemplate)> {
    let mut gguf = gpt_blocks::Gguf::open(path)?;
    let text = gguf_text(&gguf, path);
    // The weights come after the tokenizer, whose building leaves freed memory behind (the
    // parsed vocabulary and temporaries): it is returned to the OS first (`gpt` keeps freed
    // memory otherwise, for training), so it does not add to the weights' peak. The model's own
    // errors still come first: a file broken in both is reported by what breaks the model.
    gguf.release_vocab();
    // SAFETY: a plain call into mimalloc: return the pages freed so far to the OS.
    unsafe { libmimalloc_sys::mi_collect(true) };
    let model = gguf_model(&gguf, dtype, dev, opts).with_context(|| path.display().to_string())?;
    let (tokenizer, chat) = text?;
    Ok((model, tokenizer, chat))
}

/// The tokenizer a GGUF file's metadata describes (none when it carries no tokenizer) and
/// its chat template.
fn gguf_text(gguf: &gpt_blocks::Gguf, path: &Path) -> Result<(Option<Tokenizer>, ChatTemplate)> {
    let name =
        |id: Option<u32>, tokens: &[String]| id.and_then(|i| tokens.get(i as usize).cloned());
    let (tokenizer, bos, eos) = match gguf.vocab() {
        Ok(v) => {
            let tok = gguf_tokenizer::from_vocab(&v)
                .with_context(|| format!("{}: its tokenizer", path.display()))?;
            (Some(tok), name(v.bos, &v.tokens), name(v.eos, &v.tokens))
        }
        // A file without tokenizer metadata still runs on token ids.
        Err(_) if !gguf.metadata().contains_key("tokenizer.ggml.model") => (None, None, None),
        Err(e) => return Err(e).with_context(|| path.display().to_string()),
    };
    let template = gguf
        .chat_template()
        .with_context(|| path.display().to_string())?;
    Ok((tokenizer, ChatTemplate::new(template, bos, eos)))
}

/// What `--model` names, for text alone: its tokenizer and chat template, and where they
/// came from; no weights are read (a GGUF file of metadata alone will do).
pub fn load_text(args: &ModelArgs) -> Result<(Option<Tokenizer>, ChatTemplate, String)> {
    let plain = || ChatTemplate::new(None, None, None);
    let Some(spec) = &args.model else {
        let tokenizer = tokenizer_json::parse(embedded::TOKENIZER)
            .map(Tokenizer::from)
            .map_err(|e| anyhow!("the built-in tokenizer: {e}"))?;
        return Ok((Some(tokenizer), plain(), "built-in model".into()));
    };
    let path = PathBuf::from(spec);
    let dir_text = |dir: &Path| -> Result<(Option<Tokenizer>, ChatTemplate, String)> {
        let tokenizer = tokenizer_file(&dir.join("tokenizer.json"))?;
        Ok((tokenizer, ChatTemplate::from_dir(dir)?, spec.clone()))
    };
    if path.is_dir() {
        return dir_text(&path);
    }
    if path.is_file() {
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        return match (ext, path.parent()) {
            ("gguf", _) => {
                let gguf = gpt_blocks::Gguf::open(&path)?;
                let (tokenizer, chat) = gguf_text(&gguf, &path)?;
                Ok((tokenizer, chat, spec.clone()))
            }
            ("pt", _) => Ok((
                tokenizer_file(&path.with_file_name("tokenizer.json"))?,
                plain(),
                spec.clone(),
            )),
            ("safetensors", Some(dir)) => dir_text(dir),
            _ => bail!("{spec}: expected a model directory, a .gguf file, a .safetensors file or a nanoGPT .pt checkpoint"),
        };
    }
    check_hub_id(spec)?;
    dir_text(&hub_download(spec, false)?)
}

/// Refuses what cannot be a hub id (a path that does not exist).
fn check_hub_id(spec: &str) -> Result<()> {
    if spec.starts_with('.')
        || spec.starts_with('/')
        || spec.matches('/').count() > 1
        || spec.contains('\\')
    {
        bail!("{spec}: no such file or directory")
    }
    Ok(())
}

/// A GGUF file's model (see [`load_gguf`] for `dtype`).
fn gguf_model(
    gguf: &gpt_blocks::Gguf,
    dtype: Option<DType>,
    dev: &Device,
    opts: gpt_blocks::LoadOptions,
) -> candle_core::Result<Gpt> {
    let dtype = match dtype {
        Some(dtype) => dtype,
        None if gpt_kernels::cpu_kernels(dev) => DType::F32,
        None => gguf.float_dtype(),
    };
    gguf.load(gpt_blocks::LoadOptions { dtype, ..opts }, dev)
}

/// Fetches a model's files from the Hugging Face hub into its cache (its weights only with
/// `weights`); returns the directory.
#[cfg(feature = "hub")]
fn hub_download(id: &str, weights: bool) -> Result<PathBuf> {
    let offline = |e: &dyn std::fmt::Display| {
        anyhow!(
            "could not fetch {id:?} from the Hugging Face hub ({e}); \
             to run a local checkpoint pass its directory: --model DIR"
        )
    };
    if std::env::var_os("HF_HOME").is_none() && std::env::var_os("HOME").is_none() {
        bail!("{id}: not a local path, and neither HF_HOME nor HOME is set for the Hugging Face cache")
    }
    // HF_HOME and HF_ENDPOINT are honoured; files already in the cache are not fetched again.
    let api = hf_hub::api::sync::ApiBuilder::from_env()
        .with_progress(false)
        .build()
        .map_err(|e| offline(&e))?;
    let repo = api.model(id.to_string());
    let config = repo.get("config.json").map_err(|e| offline(&e))?;
    let dir = config
        .parent()
        .ok_or_else(|| anyhow!("hub cache path without a parent"))?
        .to_path_buf();
    if weights && repo.get("model.safetensors").is_err() {
        let index = repo
            .get("model.safetensors.index.json")
            .map_err(|e| offline(&e))?;
        let text = std::fs::read_to_string(&index)?;
        let json: serde_json::Value = serde_json::from_str(&text)?;
        let mut shards: Vec<String> = json["weight_map"]
            .as_object()
            .map(|m| {
                m.values()
                    .filter_map(|v| v.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default();
        shards.sort();
        shards.dedup();
        for shard in shards {
            repo.get(&shard).map_err(|e| offline(&e))?;
        }
    }
    // Optional: a model without a tokenizer still runs on token ids, one without a chat
    // template chats in the plain format.
    let _ = repo.get("tokenizer.json");
    let _ = repo.get("tokenizer_config.json");
    let _ = repo.get("chat_template.jinja");
    Ok(dir)
}

#[cfg(not(feature = "hub"))]
fn hub_download(id: &str, _weights: bool) -> Result<PathBuf> {
    bail!("{id}: no such directory, and this gpt was built without hub support (feature `hub`)")
}
