//! GGUF files, llama.cpp's format: the metadata gives the family and its configuration,
//! llama.cpp's tensor names map onto the same blocks as every other format, and
//! block-quantized matrices (Q4_0 … Q8_0, Q2_K … Q6_K) stay quantized.
//!
//! Candle parses the file ([`gguf_file::Content`]); around it, everything a hostile file
//! could use is checked before a tensor is read: each tensor's element count (without
//! overflow), whole blocks per row, its byte range inside the file and clear of every other
//! tensor, and the total against the memory available. Candle's parser panics on a few
//! malformed headers (an alignment of 0 divides by zero); it runs behind a guard that turns
//! a panic into an error.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{bail, DType, Device, Result, Tensor};
use gpt_kernels::quant::Packed;
use mha::{MultiHeadAttention, Proj, QkvProj, RopeConfig, RopeScaling};

use crate::arena::FloatArena;
use crate::load::path_err;
use crate::{Activation, Block, Embedding, Family, Gpt, GptConfig, Mlp, Norm, NormKind};

/// The `general.architecture` values read, and the family each runs as.
const ARCHITECTURES: [(&str, Family); 4] = [
    ("llama", Family::Llama),
    ("qwen2", Family::Qwen2),
    ("gpt2", Family::Gpt2),
    ("gptneox", Family::GptNeox),
];

/// Where a GGUF file's bytes are read from: a file, or bytes in memory (a model built into
/// a binary).
enum Source {
    File(File),
    Bytes(std::io::Cursor<&'static [u8]>),
}

impl Read for Source {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Self::File(f) => f.read(buf),
            Self::Bytes(b) => b.read(buf),
        }
    }
}

impl Seek for Source {
    fn seek(&mut self, pos: SeekFrom) -> std::io::Result<u64> {
        match self {
            Self::File(f) => f.seek(pos),
            Self::Bytes(b) => b.seek(pos),
        }
    }
}

/// An opened GGUF file: its parsed header, checked against the file.
pub struct Gguf {
    path: PathBuf,
    file: Mutex<Source>,
    content: gguf_file::Content,
    /// The tensors read so far: a file with tensors the model never reads holds parts this
    /// loader does not know (Llama 3.1's `rope_freqs`, say), and is refused.
    read: Mutex<std::collections::HashSet<String>>,
}

impl std::fmt::Debug for Gguf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gguf")
            .field("path", &self.path)
            .field("tensors", &self.content.tensor_infos.len())
            .finish()
    }
}

/// The tokenizer a GGUF file describes in its `tokenizer.ggml.*` metadata, checked for
/// consistency (one score and one type per token, special ids inside the vocabulary).
#[derive(Debug, Clone, PartialEq)]
pub struct GgufVocab {
    /// `tokenizer.ggml.model`: `gpt2` (byte-level BPE) or `llama` (SentencePiece).
    pub model: String,
    /// `tokenizer.ggml.pre`: llama.cpp's name of the pre-tokenizer (`gpt-2`, `llama-bpe`,
    /// `qwen2`, ...).
    pub pre: Option<String>,
    /// Token texts, by id.
    pub tokens: Vec<String>,
    /// SentencePiece scores, by id.
    pub scores: Option<Vec<f32>>,
    /// llama.cpp's token types, by id: 1 normal, 2 unknown, 3 control, 4 user-defined,
    /// 5 unused, 6 byte.
    pub token_types: Option<Vec<i32>>,
    /// BPE merges, `"left right"`, highest priority first.
    pub merges: Option<Vec<String>>,
    /// Beginning of text.
    pub bos: Option<u32>,
    /// End of text.
    pub eos: Option<u32>,
    /// Unknown token.
    pub unk: Option<u32>,
    /// Padding.
    pub pad: Option<u32>,
    /// Whether encoding puts BOS first.
    pub add_bos: Option<bool>,
    /// Whether encoding puts EOS last.
    pub add_eos: Option<bool>,
    /// Whether SentencePiece text gets a leading space.
    pub add_space_prefix: Option<bool>,
    /// Whether SentencePiece drops leading, trailing and repeated spaces.
    pub remove_extra_whitespaces: Option<bool>,
}

/// Runs Candle's parser, turning a panic inside it into an error (the panic hook is
/// silenced meanwhile, so that the one line the user sees is the error).
fn guarded<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    std::panic::set_hook(hook);
    result.unwrap_or_else(|panic| {
        let msg = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        bail!("malformed GGUF header (the parser failed: {msg})")
    })
}

/// Reads a CPU tensor's blocks, from the file's current position, straight into the
/// vector that keeps them. Candle's reader reads the bytes into a buffer and copies them
/// into the blocks, so each tensor is briefly held twice, and the freed buffers stayed
/// resident: GPT-2 124M in q8_0 peaked at 209 MiB for 130 MiB of weights. `None` for a
/// format whose block size this does not know (the caller then uses Candle's reader). The
/// byte range was checked when the file was opened.
fn read_in_place(
    file: &mut impl Read,
    dtype: GgmlDType,
    shape: &[usize],
) -> Result<Option<QTensor>> {
    use candle_core::quantized::k_quants::*;
    use half::{bf16, f16};

    fn read<T: GgmlType + Send + Sync + 'static>(
        file: &mut impl Read,
        dtype: GgmlDType,
        shape: &[usize],
    ) -> Result<Option<QTensor>> {
        if std::mem::size_of::<T>() != dtype.type_size() {
            return Ok(None);
        }
        let elems: usize = shape.iter().product();
        let mut blocks = vec![T::zeros(); elems / dtype.block_size()];
        // SAFETY: every GGML block type is plain data (integers and halves, `repr(C)`
        // without padding: its size is the format's byte count, checked above), so any
        // bytes form valid blocks, and the slice covers exactly the vector's memory.
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(
                blocks.as_mut_ptr().cast::<u8>(),
                std::mem::size_of_val(blocks.as_slice()),
            )
        };
        file.read_exact(bytes)?;
        QTensor::new(QStorage::Cpu(Box::new(blocks)), shape).map(Some)
    }

    match dtype {
        GgmlDType::F32 => read::<f32>(file, dtype, shape),
        GgmlDType::F16 => read::<f16>(file, dtype, shape),
        GgmlDType::BF16 => read::<bf16>(file, dtype, shape),
        GgmlDType::Q4_0 => read::<BlockQ4_0>(file, dtype, shape),
        GgmlDType::Q4_1 => read::<BlockQ4_1>(file, dtype, shape),
        GgmlDType::Q5_0 => read::<BlockQ5_0>(file, dtype, shape),
        GgmlDType::Q5_1 => read::<BlockQ5_1>(file, dtype, shape),
        GgmlDType::Q8_0 => read::<BlockQ8_0>(file, dtype, shape),
        GgmlDType::Q8_1 => read::<BlockQ8_1>(file, dtype, shape),
        GgmlDType::Q2K => read::<BlockQ2K>(file, dtype, shape),
        GgmlDType::Q3K => read::<BlockQ3K>(file, dtype, shape),
        GgmlDType::Q4K => read::<BlockQ4K>(file, dtype, shape),
        GgmlDType::Q5K => read::<BlockQ5K>(file, dtype, shape),
        GgmlDType::Q6K => read::<BlockQ6K>(file, dtype, shape),
        GgmlDType::Q8K => read::<BlockQ8K>(file, dtype, shape),
    }
}

/// Bytes a tensor of `dims` elements takes in `dtype`, or why it cannot exist.
fn tensor_bytes(name: &str, dtype: GgmlDType, dims: &[usize]) -> Result<u64> {
    let count = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64))
        .filter(|&n| n <= 1 << 48);
    let Some(count) = count else {
        bail!("tensor {name}: {dims:?} is too many elements")
    };
    let bs = dtype.block_size() as u64;
    // Rows are whole blocks: the innermost dimension (ggml's ne0) divides into them.
    if dims.last().is_some_and(|&d| !(d as u64).is_multiple_of(bs)) {
        bail!("tensor {name}: rows of {dims:?} are not whole {dtype:?} blocks of {bs}")
    }
    Ok(count / bs * dtype.type_size() as u64)
}

impl Gguf {
    /// Opens and checks a GGUF file; reads no tensor yet.
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| path_err(path, e))?;
        let len = file.metadata().map_err(|e| path_err(path, e))?.len();
        Self::from_source(path, Source::File(file), len)
    }

    /// Opens and checks a GGUF file held in memory, such as one built into a binary with
    /// `include_bytes!`; `name` stands for its path in messages. Reads as [`Self::open`].
    pub fn from_bytes(name: &str, bytes: &'static [u8]) -> Result<Self> {
        let len = bytes.len() as u64;
        Self::from_source(
            Path::new(name),
            Source::Bytes(std::io::Cursor::new(bytes)),
            len,
        )
    }

    fn from_source(path: &Path, mut file: Source, len: u64) -> Result<Self> {
        let content = guarded(|| gguf_file::Content::read(&mut file))
            .map_err(|e| path_err(path, format!("not a valid GGUF file: {e}")))?;
        let gguf = Self {
            path: path.to_path_buf(),
            file: Mutex::new(file),
            content,
            read: Mutex::default(),
        };
        gguf.check_tensors(len)
            .map_err(|e| path_err(path, format!("not a valid GGUF file: {e}")))?;
        Ok(gguf)
    }

    /// Every tensor's byte range lies inside the file, clear of the others.
    fn check_tensors(&self, file_len: u64) -> Result<()> {
        let start = self.content.tensor_data_offset;
        // A file of metadata alone (llama.cpp's `--vocab-only` files) has no tensor data: its
        // aligned start may lie past the end.
        if start > file_len && !self.content.tensor_infos.is_empty() {
            bail!("the tensor data would start at byte {start}, past the end ({file_len})")
        }
        let mut ranges = Vec::with_capacity(self.content.tensor_infos.len());
        for (name, info) in &self.content.tensor_infos {
            let bytes = tensor_bytes(name, info.ggml_dtype, info.shape.dims())?;
            let end = info
                .offset
                .checked_add(bytes)
                .filter(|&e| e <= file_len - start);
            let Some(end) = end else {
                bail!(
                    "tensor {name}: {bytes} bytes at offset {} run past the end of the file",
                    info.offset
                )
            };
            ranges.push((info.offset, end, name));
        }
        ranges.sort();
        for w in ranges.windows(2) {
            if w[1].0 < w[0].1 {
                bail!("tensors {} and {} overlap", w[0].2, w[1].2)
            }
        }
        Ok(())
    }

    /// The file's metadata, as Candle parsed it.
    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.content.metadata
    }

    /// Each tensor's name, shape (PyTorch order: `[out, in]`) and format.
    pub fn tensors(&self) -> impl Iterator<Item = (&str, &[usize], GgmlDType)> {
        self.content
            .tensor_infos
            .iter()
            .map(|(n, i)| (n.as_str(), i.shape.dims(), i.ggml_dtype))
    }

    /// The precision the file's float matrices are stored in: f16 or bf16 when every
    /// matrix that is not block-quantized is (learned positions aside, which writers keep in
    /// f32), else f32.
    pub fn float_dtype(&self) -> DType {
        let floats: Vec<GgmlDType> = self
            .tensors()
            .filter(|(name, dims, t)| {
                dims.len() == 2
                    && *name != "position_embd.weight"
                    && matches!(t, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16)
            })
            .map(|(_, _, t)| t)
            .collect();
        match floats.first() {
            Some(&GgmlDType::F16) if floats.iter().all(|&t| t == GgmlDType::F16) => DType::F16,
            Some(&GgmlDType::BF16) if floats.iter().all(|&t| t == GgmlDType::BF16) => DType::BF16,
            _ => DType::F32,
        }
    }

    fn value(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
    }

    fn uint(&self, key: &str) -> Result<Option<u64>> {
        let v = match self.value(key) {
            None => return Ok(None),
            Some(v) => v,
        };
        let n = match v {
            Value::U8(x) => Some(*x as u64),
            Value::U16(x) => Some(*x as u64),
            Value::U32(x) => Some(*x as u64),
            Value::U64(x) => Some(*x),
            Value::I8(x) => u64::try_from(*x).ok(),
            Value::I16(x) => u64::try_from(*x).ok(),
            Value::I32(x) => u64::try_from(*x).ok(),
            Value::I64(x) => u64::try_from(*x).ok(),
            _ => None,
        };
        match n {
            Some(n) => Ok(Some(n)),
            None => bail!("metadata {key} must be a non-negative integer, got {v:?}"),
        }
    }

    /// A size below 2^32.
    fn size(&self, key: &str) -> Result<Option<usize>> {
        match self.uint(key)? {
            Some(n) if n > u32::MAX as u64 => bail!("metadata {key} = {n} is too large"),
            other => Ok(other.map(|n| n as usize)),
        }
    }

    fn need(&self, key: &str) -> Result<usize> {
        match self.size(key)? {
            None => bail!("metadata {key} is missing"),
            Some(0) => bail!("metadata {key} must be positive, got 0"),
            Some(n) => Ok(n),
        }
    }

    fn float(&self, key: &str) -> Result<Option<f64>> {
        let x = match self.value(key) {
            None => return Ok(None),
            // The shortest decimal that reads back as the same f32 (1e-6, not 9.99e-7).
            Some(Value::F32(x)) => x.to_string().parse().unwrap_or(*x as f64),
            Some(Value::F64(x)) => *x,
            Some(v) => bail!("metadata {key} must be a number, got {v:?}"),
        };
        if !x.is_finite() {
            bail!("metadata {key} must be finite, got {x}")
        }
        Ok(Some(x))
    }

    fn string(&self, key: &str) -> Result<Option<&str>> {
        match self.value(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => bail!("metadata {key} must be a string, got {:?}", v.value_type()),
        }
    }

    fn boolean(&self, key: &str) -> Result<Option<bool>> {
        match self.value(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => bail!("metadata {key} must be true or false, got {v:?}"),
        }
    }

    fn array(&self, key: &str) -> Result<Option<&Vec<Value>>> {
        match self.value(key) {
            None => Ok(None),
            Some(Value::Array(a)) => Ok(Some(a)),
            Some(v) => bail!("metadata {key} must be an array, got {:?}", v.value_type()),
        }
    }

    /// `general.architecture`, and the family it runs as.
    pub fn family(&self) -> Result<(&str, Family)> {
        let Some(arch) = self.string("general.architecture")? else {
            bail!("metadata general.architecture is missing")
        };
        match ARCHITECTURES.iter().find(|(a, _)| *a == arch) {
            Some((_, family)) => Ok((arch, *family)),
            None => {
                let names: Vec<_> = ARCHITECTURES.iter().map(|(a, _)| *a).collect();
                bail!(
                    "GGUF architecture {arch:?} is not supported (supported: {})",
                    names.join(", ")
                )
            }
        }
    }

    fn shape(&self, name: &str) -> Option<&[usize]> {
        self.content.tensor_infos.get(name).map(|i| i.shape.dims())
    }

    /// The model's configuration, from the metadata and the tensors present (biases, an
    /// untied head).
    pub fn config(&self) -> Result<GptConfig> {
        let (arch, family) = self.family()?;
        let key = |k: &str| format!("{arch}.{k}");
        let d = self.need(&key("embedding_length"))?;
        let n_head = self.need(&key("attention.head_count"))?;
        let n_layer = self.need(&key("block_count"))?;
        if d % n_head != 0 {
            bail!("metadata {arch}.attention.head_count={n_head} must divide {arch}.embedding_length={d}")
        }
        let head_dim = d / n_head;
        for k in ["attention.key_length", "attention.value_length"] {
            if let Some(n) = self.size(&key(k))? {
                if n != head_dim {
                    bail!("metadata {arch}.{k}={n} differs from embedding_length / head_count = {head_dim}; such models are not supported")
                }
            }
        }
        let Some(&[vocab, width]) = self.shape("token_embd.weight") else {
            bail!("tensor token_embd.weight is missing or not a matrix")
        };
        if width != d {
            bail!("token_embd.weight is [{vocab}, {width}] for embedding_length {d}")
        }
        let has = |n: &str| self.content.tensor_infos.contains_key(n);
        let rope = match family {
            Family::Gpt2 => None,
            _ => {
                let rotary = self.size(&key("rope.dimension_count"))?.unwrap_or(head_dim);
                if rotary == 0 || rotary > head_dim || rotary % 2 != 0 {
                    bail!("metadata {arch}.rope.dimension_count={rotary} must be even and in 2..={head_dim}")
                }
                let scaling = match self.string(&key("rope.scaling.type"))? {
                    // Llama 3.1+ keeps its scaling as per-frequency divisors.
                    None if has("rope_freqs.weight") => {
                        let theta = self.float(&key("rope.freq_base"))?.unwrap_or(10_000.0);
                        let factors = self
                            .qtensor("rope_freqs.weight", &[rotary / 2], &Device::Cpu)?
                            .dequantize(&Device::Cpu)?
                            .to_vec1::<f32>()?;
                        llama3_from_factors(&factors, theta, rotary)?
                    }
                    None | Some("none") => RopeScaling::None,
                    Some("linear") => match self.float(&key("rope.scaling.factor"))? {
                        Some(factor) if factor > 0.0 => RopeScaling::Linear { factor },
                        f => bail!("metadata {arch}.rope.scaling.factor must be > 0, got {f:?}"),
                    },
                    Some(t) => bail!("metadata {arch}.rope.scaling.type {t:?} is not supported (none and linear are)"),
                };
                Some(RopeConfig {
                    theta: self.float(&key("rope.freq_base"))?.unwrap_or(10_000.0),
                    rotary_dim: (rotary != head_dim).then_some(rotary),
                    scaling,
                })
            }
        };
        let eps_key = match family {
            Family::Llama | Family::Qwen2 => "attention.layer_norm_rms_epsilon",
            _ => "attention.layer_norm_epsilon",
        };
        let token = |k: &str| -> Result<Option<u32>> {
            Ok(self.uint(k)?.and_then(|n| u32::try_from(n).ok()))
        };
        let cfg = GptConfig {
            family,
            model_type: Some(family.model_type().into()),
            vocab_size: vocab,
            n_positions: self.need(&key("context_length"))?,
            n_embd: d,
            n_layer,
            n_head,
            n_kv_head: Some(
                self.size(&key("attention.head_count_kv"))?
                    .unwrap_or(n_head),
            ),
            n_inner: Some(self.need(&key("feed_forward_length"))?),
            layer_norm_epsilon: self.float(&key(eps_key))?.unwrap_or(1e-5),
            tie_word_embeddings: !has("output.weight"),
            bos_token_id: token("tokenizer.ggml.bos_token_id")?,
            eos_token_id: token("tokenizer.ggml.eos_token_id")?,
            resid_pdrop: 0.0,
            embd_pdrop: 0.0,
            attn_pdrop: 0.0,
            rope,
            ..GptConfig::gpt2()
        };
        let cfg = match family {
            Family::Llama | Family::Qwen2 => GptConfig {
                activation_function: Activation::Silu,
                norm: NormKind::RmsNorm,
                gated_mlp: true,
                attn_bias: has("blk.0.attn_q.bias"),
                attn_out_bias: has("blk.0.attn_output.bias"),
                mlp_bias: has("blk.0.ffn_up.bias"),
                ..cfg
            },
            // GPT-NeoX checkpoints (Pythia) use the exact GELU; llama.cpp computes its tanh
            // approximation instead.
            Family::GptNeox => GptConfig {
                activation_function: Activation::Gelu,
                norm: NormKind::LayerNorm,
                parallel_residual: self.boolean(&key("use_parallel_residual"))?.unwrap_or(true),
                attn_bias: true,
                attn_out_bias: true,
                mlp_bias: true,
                ..cfg
            },
            _ => cfg,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Drops the tokenizer's arrays (token texts, scores, types, merges) from the parsed
    /// metadata once a tokenizer is built from them: 50,257 strings and as many merges for
    /// GPT-2, 14 MiB as Candle parses them, that would otherwise stay beside the weights.
    /// [`Self::vocab`] fails afterwards.
    pub fn release_vocab(&mut self) {
        for key in [
            "tokenizer.ggml.tokens",
            "tokenizer.ggml.scores",
            "tokenizer.ggml.token_type",
            "tokenizer.ggml.merges",
        ] {
            self.content.metadata.remove(key);
        }
    }

    /// The tokenizer the metadata describes.
    pub fn vocab(&self) -> Result<GgufVocab> {
        let Some(model) = self.string("tokenizer.ggml.model")? else {
            bail!("the file carries no tokenizer (tokenizer.ggml.model is missing)")
        };
        let strings = |key: &str| -> Result<Option<Vec<String>>> {
            self.array(key)?
                .map(|a| {
                    a.iter()
                        .map(|v| match v {
                            Value::String(s) => Ok(s.clone()),
                            v => {
                                bail!("metadata {key} must hold strings, got {:?}", v.value_type())
                            }
                        })
                        .collect()
                })
                .transpose()
        };
        let Some(tokens) = strings("tokenizer.ggml.tokens")? else {
            bail!("metadata tokenizer.ggml.tokens is missing")
        };
        let n = tokens.len();
        // One entry per token, each converted by `f` (None: the wrong type).
        fn per_token<T>(
            g: &Gguf,
            key: &str,
            n: usize,
            f: impl Fn(&Value) -> Option<T>,
        ) -> Result<Option<Vec<T>>> {
            let Some(a) = g.array(key)? else {
                return Ok(None);
            };
            if a.len() != n {
                bail!("metadata {key} has {} entries for {n} tokens", a.len())
            }
            a.iter()
                .map(|v| match f(v) {
                    Some(x) => Ok(x),
                    None => bail!("metadata {key} holds a {:?}", v.value_type()),
                })
                .collect::<Result<Vec<_>>>()
                .map(Some)
        }
        let scores = per_token(self, "tokenizer.ggml.scores", n, |v| match v {
            Value::F32(x) => Some(*x),
            _ => None,
        })?;
        let token_types = per_token(self, "tokenizer.ggml.token_type", n, |v| match v {
            Value::I32(x) => Some(*x),
            Value::U32(x) => i32::try_from(*x).ok(),
            _ => None,
        })?;
        let id = |key: &str| -> Result<Option<u32>> {
            match self.uint(key)? {
                None => Ok(None),
                Some(i) if (i as usize) < n => Ok(Some(i as u32)),
                Some(i) => bail!("metadata {key} = {i} is outside the {n} tokens"),
            }
        };
        Ok(GgufVocab {
            model: model.to_string(),
            pre: self.string("tokenizer.ggml.pre")?.map(str::to_string),
            scores,
            token_types,
            merges: strings("tokenizer.ggml.merges")?,
            bos: id("tokenizer.ggml.bos_token_id")?,
            eos: id("tokenizer.ggml.eos_token_id")?,
            unk: id("tokenizer.ggml.unknown_token_id")?,
            pad: id("tokenizer.ggml.padding_token_id")?,
            add_bos: self.boolean("tokenizer.ggml.add_bos_token")?,
            add_eos: self.boolean("tokenizer.ggml.add_eos_token")?,
            add_space_prefix: self.boolean("tokenizer.ggml.add_space_prefix")?,
            remove_extra_whitespaces: self.boolean("tokenizer.ggml.remove_extra_whitespaces")?,
            tokens,
        })
    }

    /// `tokenizer.chat_template`, when the file carries one.
    pub fn chat_template(&self) -> Result<Option<String>> {
        Ok(self.string("tokenizer.chat_template")?.map(str::to_string))
    }

    /// The tensor `name`, checked to have `shape` (PyTorch order) and marked as read, with
    /// the file positioned at its first byte.
    fn claim(
        &self,
        name: &str,
        shape: &[usize],
    ) -> Result<(&gguf_file::TensorInfo, std::sync::MutexGuard<'_, Source>)> {
        let Some(info) = self.content.tensor_infos.get(name) else {
            bail!("tensor {name} is missing")
        };
        if info.shape.dims() != shape {
            bail!(
                "tensor {name} has shape {:?}, the config needs {shape:?}",
                info.shape.dims()
            )
        }
        let poisoned = || candle_core::Error::Msg("the GGUF file's lock is poisoned".into());
        self.read
            .lock()
            .map_err(|_| poisoned())?
            .insert(name.to_string());
        let mut file = self.file.lock().map_err(|_| poisoned())?;
        file.seek(SeekFrom::Start(
            self.content.tensor_data_offset + info.offset,
        ))?;
        Ok((info, file))
    }

    /// Reads one tensor, checking its shape (PyTorch order).
    fn qtensor(&self, name: &str, shape: &[usize], device: &Device) -> Result<QTensor> {
        let (info, mut file) = self.claim(name, shape)?;
        if device.is_cpu() {
            if let Some(q) = read_in_place(&mut *file, info.ggml_dtype, shape)? {
                return Ok(q);
            }
        }
        info.read(&mut *file, self.content.tensor_data_offset, device)
    }

    /// A block-quantized matrix packed for this CPU's kernels straight from the
    /// file, 16 rows at a time (no buffer or `QTensor` the size of the matrix beside it), or
    /// `None` when the tensor is of another format, the device not the CPU or the CPU
    /// without the kernels (the caller then reads a `QTensor`). Checks as [`Self::qtensor`].
    fn packed(&self, name: &str, shape: &[usize], device: &Device) -> Result<Option<Packed>> {
        let info = self.content.tensor_infos.get(name);
        let (&[n, k], Some(info)) = (shape, info) else {
            return Ok(None);
        };
        if !device.is_cpu() || !Packed::packs_here(info.ggml_dtype) {
            return Ok(None);
        }
        let (info, mut file) = self.claim(name, shape)?;
        // The byte range was checked when the file was opened.
        Packed::from_rows(info.ggml_dtype, n, k, |rows| Ok(file.read_exact(rows)?))
    }

    /// The format `name` is stored in, if the file has it.
    fn stored(&self, name: &str) -> Option<GgmlDType> {
        self.content.tensor_infos.get(name).map(|i| i.ggml_dtype)
    }

    /// A norm weight, bias or embedding, dequantized to `dtype`.
    fn dense(&self, name: &str, shape: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
        if let Some(t) = self.float_in_place(name, shape, dtype, device)? {
            return Ok(t);
        }
        float_tensor(&self.qtensor(name, shape, device)?, dtype, device)
    }

    /// A CPU tensor stored as f32, f16 or bf16 and wanted in that precision, read straight
    /// into the vector the tensor keeps; `None` otherwise (the caller goes through a
    /// `QTensor`, which a float tensor would copy: GPT-2's f16 table, 74 MiB, was held
    /// twice for a moment, and the allocator keeps what it once held).
    fn float_in_place(
        &self,
        name: &str,
        shape: &[usize],
        dtype: DType,
        device: &Device,
    ) -> Result<Option<Tensor>> {
        if !device.is_cpu() || self.stored(name).and_then(stored_float) != Some(dtype) {
            return Ok(None);
        }
        let (_, mut file) = self.claim(name, shape)?;
        // The byte range was checked when the file was opened.
        crate::files::read_floats(&mut *file, dtype, dtype, shape).map(Some)
    }

    /// The model, with block-quantized matrices kept as they are stored and everything else
    /// (f32/f16/bf16 matrices, norms, biases, embeddings) in `dtype`; except that with f32
    /// on the CPU, f16 and bf16 matrices (the token table among them) stay as stored and are
    /// widened as the products read them: the same results as f32 weights, at half the
    /// memory and bytes read (see [`Gpt::with_f32_activations`]).
    pub fn load(&self, dtype: DType, device: &Device) -> Result<Gpt> {
        self.load_blocks(dtype, device, false)
    }

    /// [`Gguf::load`], each block's q/k/v and gate/up projections fused into one product
    /// each as it is loaded ([`Gpt::fused`], for inference): the block's separate matrices
    /// are freed at once and their memory serves the next block's, where fusing the
    /// loaded model would hold them all until the allocator returns them. Float (f32, f16,
    /// bf16) block matrices are read side by side into one buffer first, each a view of it,
    /// the fused ones views spanning their parts: nothing is copied.
    pub fn load_fused(&self, dtype: DType, device: &Device) -> Result<Gpt> {
        self.load_blocks(dtype, device, true)
    }

    fn load_blocks(&self, dtype: DType, device: &Device, fuse: bool) -> Result<Gpt> {
        let cfg = self.config()?;
        self.check_memory(&cfg, dtype, device)?;
        let matrix = |t: GgmlDType| matrix_dtype(t, dtype, device);
        let (v, d, inner) = (cfg.vocab_size, cfg.n_embd, cfg.inner_dim());
        let hd = d / cfg.n_head;
        let kv = cfg.kv_heads() * hd;
        let bias = |name: String, len: usize, on: bool| -> Result<Option<Tensor>> {
            match on {
                true => Ok(Some(self.dense(&name, &[len], dtype, device)?)),
                false => Ok(None),
            }
        };
        // llama.cpp's Llama rotates adjacent pairs, so its converter reorders each head's
        // query and key rows; this model rotates halves, so the rows go back.
        let unpermute = |heads: usize| cfg.family == Family::Llama && heads > 0;
        // A projection's bias, its rows in the order the matrix's are put in.
        let proj_bias = |stem: &str, d_out: usize, has_bias: bool, heads: usize| {
            let b = bias(format!("{stem}.bias"), d_out, has_bias)?;
            match (b, unpermute(heads)) {
                (Some(b), true) => Ok(Some(select_rows(&b, &rotary_order(d_out, heads, false)?)?)),
                (b, _) => Ok::<_, candle_core::Error>(b),
            }
        };
        let arena = std::cell::RefCell::new(match fuse {
            true => self.float_arena(&cfg, dtype, device)?,
            false => FloatArena::default(),
        });
        // Matrices read side by side (`parts`: stem, rows, rotary heads) as one projection,
        // the view `w` of them, with their biases concatenated.
        let side_by_side = |w: Tensor, parts: &[(String, usize, usize)], has_bias: bool| {
            let b = match has_bias {
                true => {
                    let bs = parts
                        .iter()
                        .map(|(stem, rows, heads)| proj_bias(stem, *rows, true, *heads))
                        .collect::<Result<Vec<_>>>()?;
                    Some(Tensor::cat(
                        &bs.into_iter().flatten().collect::<Vec<_>>(),
                        0,
                    )?)
                }
                false => None,
            };
            Proj::from_linear(&w, b)
        };
        let arena_take = |parts: &[(String, usize, usize)], cols: usize| {
            let names: Vec<_> = parts
                .iter()
                .map(|(stem, rows, _)| (format!("{stem}.weight"), [*rows, cols]))
                .collect();
            arena.borrow_mut().take(&names)
        };
        let proj = |stem: String, (d_out, d_in): (usize, usize), has_bias: bool, heads: usize| {
            let name = format!("{stem}.weight");
            if !unpermute(heads) {
                if let Some(packed) = self.packed(&name, &[d_out, d_in], device)? {
                    let b = bias(format!("{stem}.bias"), d_out, has_bias)?;
                    return Ok(Proj::from_packed(Arc::new(packed), b));
                }
            }
            let b = proj_bias(&stem, d_out, has_bias, heads)?;
            if let Some(w) = arena.borrow_mut().take(&[(name.clone(), [d_out, d_in])])? {
                return Proj::from_linear(&w, b);
            }
            let order = match unpermute(heads) {
                true => Some(rotary_order(d_out, heads, false)?),
                false => None,
            };
            if let Some(t) = self.stored(&name).filter(|&t| stored_float(t).is_some()) {
                let mut w = self.dense(&name, &[d_out, d_in], matrix(t), device)?;
                if let Some(order) = &order {
                    w = select_rows(&w, order)?;
                }
                return Proj::from_linear(&w, b);
            }
            let mut w = self.qtensor(&name, &[d_out, d_in], device)?;
            if order.is_some() {
                w = rotary_rows(&w, heads)?;
            }
            Proj::from_qtensor(Arc::new(w), b, dtype)
        };
        let norm = |name: &str| -> Result<Norm> {
            let w = self.dense(&format!("{name}.weight"), &[d], dtype, device)?;
            let b = bias(format!("{name}.bias"), d, cfg.norm == NormKind::LayerNorm)?;
            Norm::from_tensors(cfg.norm, w, b, cfg.layer_norm_epsilon)
        };
        // The largest matrices first: the bytes read and the tensor made of them are both
        // held for a moment, and early on the rest of the model is not there beside them
        // (GPT-2 124M's q8_0 table is 41 MB; read last, it raised decoding's peak RSS).
        let (wte, lm_head) = match self.packed("token_embd.weight", &[v, d], device)? {
            // A table packed for this CPU (q8_0, q4_0, q4_K, q6_K): looked up row by row, and a tied head
            // multiplies by the same tiles.
            Some(packed) => {
                let table = Arc::new(packed);
                let head = match cfg.tie_word_embeddings {
                    true => Proj::from_packed(table.clone(), None),
                    false => proj("output".into(), (v, d), false, 0)?,
                };
                (Embedding::Packed { table, dtype }, head)
            }
            None => {
                const TABLE: &str = "token_embd.weight";
                let wte = match self.stored(TABLE).filter(|&t| stored_float(t).is_some()) {
                    // A float table; in half precision under f32 activations.
                    Some(t) => {
                        let table = self.dense(TABLE, &[v, d], matrix(t), device)?;
                        match table.dtype() == dtype {
                            true => Embedding::Dense(table),
                            false => Embedding::Half { table, dtype },
                        }
                    }
                    // A quantized table stays one quantized copy: rows are dequantized on
                    // lookup, and a tied head multiplies by the same blocks.
                    None => Embedding::Quantized {
                        table: Arc::new(self.qtensor(TABLE, &[v, d], device)?),
                        dtype,
                        device: device.clone(),
                    },
                };
                let head = match (&wte, cfg.tie_word_embeddings) {
                    // A dense table is the head's weight too (one copy, as for safetensors).
                    (Embedding::Dense(t) | Embedding::Half { table: t, .. }, true) => {
                        Proj::from_linear(t, None)?
                    }
                    (Embedding::Quantized { table, .. }, true) => {
                        Proj::from_qtensor(table.clone(), None, dtype)?
                    }
                    (Embedding::Packed { table, .. }, true) => {
                        Proj::from_packed(table.clone(), None)
                    }
                    (_, false) => proj("output".into(), (v, d), false, 0)?,
                };
                (wte, head)
            }
        };
        // Grown block by block: a file claiming a billion blocks stops at the first missing.
        let mut blocks = Vec::new();
        for i in 0..cfg.n_layer {
            let blk = |part: &str| format!("blk.{i}.{part}");
            let attn_cfg = Block::attn_config(&cfg, i);
            let qkv_parts = [
                (blk("attn_q"), d, cfg.n_head),
                (blk("attn_k"), kv, cfg.kv_heads()),
                (blk("attn_v"), kv, 0),
            ];
            let qkv = if self.shape(&blk("attn_qkv.weight")).is_some() {
                QkvProj::Fused(proj(blk("attn_qkv"), (d + 2 * kv, d), cfg.attn_bias, 0)?)
            } else if let Some(w) = arena_take(&qkv_parts, d)? {
                // q, k and v side by side as read: the fused projection is a view of them.
                QkvProj::Fused(side_by_side(w, &qkv_parts, cfg.attn_bias)?)
            } else {
                QkvProj::Separate([
                    proj(blk("attn_q"), (d, d), cfg.attn_bias, cfg.n_head)?,
                    proj(blk("attn_k"), (kv, d), cfg.attn_bias, cfg.kv_heads())?,
                    proj(blk("attn_v"), (kv, d), cfg.attn_bias, 0)?,
                ])
            };
            let o = proj(blk("attn_output"), (d, d), cfg.attn_out_bias, 0)?;
            let attn = MultiHeadAttention::from_projections(&attn_cfg, qkv, o)
                .map_err(|e| candle_core::Error::Msg(format!("block {i}: {e}")))?;
            let gate_up_parts = [(blk("ffn_gate"), inner, 0), (blk("ffn_up"), inner, 0)];
            let gate_up = match cfg.gated_mlp {
                true => arena_take(&gate_up_parts, d)?,
                false => None,
            };
            let mlp = match gate_up {
                // Gate and up side by side as read: the fused projection is a view of them.
                Some(w) => {
                    let gate_up = side_by_side(w, &gate_up_parts, cfg.mlp_bias)?;
                    let down = proj(blk("ffn_down"), (d, inner), cfg.mlp_bias, 0)?;
                    Mlp::from_gate_up(&cfg, gate_up, down)?
                }
                None => {
                    let gate = match cfg.gated_mlp {
                        true => Some(proj(blk("ffn_gate"), (inner, d), cfg.mlp_bias, 0)?),
                        false => None,
                    };
                    let up = proj(blk("ffn_up"), (inner, d), cfg.mlp_bias, 0)?;
                    let down = proj(blk("ffn_down"), (d, inner), cfg.mlp_bias, 0)?;
                    Mlp::from_projections(&cfg, up, gate, down)?
                }
            };
            let (ln_1, ln_2) = (norm(&blk("attn_norm"))?, norm(&blk("ffn_norm"))?);
            let block = Block::from_parts(&cfg, i, ln_1, attn, ln_2, mlp)?;
            blocks.push(if fuse { block.fused()? } else { block });
        }
        let wpe = match cfg.rope {
            Some(_) => None,
            None => {
                Some(self.dense("position_embd.weight", &[cfg.n_positions, d], dtype, device)?)
            }
        };
        let ln_f = Some(norm("output_norm")?);
        let model = Gpt::from_parts(&cfg, wte, wpe, blocks, ln_f, lm_head)?;
        let mut read = self
            .read
            .lock()
            .map_err(|_| candle_core::Error::Msg("the GGUF file's lock is poisoned".into()))?;
        // Read into the arena but taken by no block (a gate in an ungated model, say): unused.
        for name in arena.borrow().slots.keys() {
            read.remove(name);
        }
        let mut unused: Vec<&str> = self
            .content
            .tensor_infos
            .keys()
            .map(String::as_str)
            .filter(|n| !read.contains(*n))
            .collect();
        unused.sort_unstable();
        if let Some(first) = unused.first() {
            bail!(
                "tensor {first} ({} unread in all) is not part of a {arch} model as this loader knows it; running without it would give wrong results",
                unused.len(),
                arch = self.family()?.0
            )
        }
        Ok(model)
    }

    /// Refuses a model that cannot fit: the stored tensors, block-quantized ones as stored,
    /// the others as [`Self::load`] keeps them.
    fn check_memory(&self, cfg: &GptConfig, dtype: DType, device: &Device) -> Result<()> {
        let mut need = 0u64;
        for (name, dims, ggml) in self.tensors() {
            let stored = tensor_bytes(name, ggml, dims)?;
            let elems: u64 = dims.iter().map(|&x| x as u64).product();
            need += match ggml {
                GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 if dims.len() == 2 => {
                    elems * matrix_dtype(ggml, dtype, device).size_in_bytes() as u64
                }
                GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 => {
                    elems * dtype.size_in_bytes() as u64
                }
                _ => stored,
            };
        }
        if let Some(avail) = crate::available_memory() {
            if need > avail {
                bail!(
                    "the model needs {} MiB as {dtype:?} ({} layers), more than the {} MiB of memory available",
                    need >> 20,
                    cfg.n_layer,
                    avail >> 20
                )
            }
        }
        Ok(())
    }
}

impl Gguf {
    /// The [`FloatArena`] of a model loaded in `dtype` for inference: every block matrix
    /// kept as stored (f32, f16 or bf16 as [`matrix_dtype`] wants it), llama.cpp's rotary
    /// rows of a Llama's q and k put back in Hugging Face's order. Empty off the CPU.
    fn float_arena(&self, cfg: &GptConfig, dtype: DType, device: &Device) -> Result<FloatArena> {
        const PARTS: [&str; 8] = [
            "attn_qkv",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
        ];
        let mut arena = FloatArena::default();
        if !device.is_cpu() {
            return Ok(arena);
        }
        let (d, inner) = (cfg.n_embd, cfg.inner_dim());
        let kv = cfg.kv_heads() * (d / cfg.n_head.max(1));
        // (block, place in the block, name, [rows, cols], rotary heads to reorder, dtype),
        // from the file's own tensors: a file claiming a billion blocks lists no more.
        let mut mats = Vec::new();
        for (name, dims, t) in self.tensors() {
            let Some((i, part)) = name
                .strip_prefix("blk.")
                .and_then(|n| n.strip_suffix(".weight"))
                .and_then(|n| n.split_once('.'))
            else {
                continue;
            };
            let (Ok(i), Some(place)) = (i.parse::<usize>(), PARTS.iter().position(|&p| p == part))
            else {
                continue;
            };
            if i >= cfg.n_layer {
                continue;
            }
            let (2, Some(stored)) = (dims.len(), stored_float(t)) else {
                continue;
            };
            if stored != matrix_dtype(t, dtype, device) {
                continue;
            }
            // The shape the blocks need (checked against the stored one as it is read).
            let [rows, cols] = match part {
                "attn_qkv" => [d + 2 * kv, d],
                "attn_q" | "attn_output" => [d, d],
                "attn_k" | "attn_v" => [kv, d],
                "ffn_gate" | "ffn_up" => [inner, d],
                _ => [d, inner],
            };
            let heads = match (cfg.family, part) {
                (Family::Llama, "attn_q") => cfg.n_head,
                (Family::Llama, "attn_k") => cfg.kv_heads(),
                _ => 0,
            };
            mats.push((i, place, name.to_string(), [rows, cols], heads, stored));
        }
        mats.sort_unstable_by_key(|m| (m.0, m.1));
        for want in [DType::F32, DType::F16, DType::BF16] {
            let group: Vec<_> = mats.iter().filter(|m| m.5 == want).collect();
            if group.is_empty() {
                continue;
            }
            let parts: Vec<_> = group.iter().map(|m| (m.2.as_str(), m.3, m.4)).collect();
            let buf = match want {
                DType::F32 => self.read_arena::<f32>(&parts)?,
                DType::F16 => self.read_arena::<half::f16>(&parts)?,
                _ => self.read_arena::<half::bf16>(&parts)?,
            };
            let mut at = 0;
            for (name, [rows, cols], _) in parts {
                arena
                    .slots
                    .insert(name.to_string(), (buf.clone(), at, [rows, cols]));
                at += rows * cols;
            }
        }
        Ok(arena)
    }

    /// `parts` (`(name, [rows, cols], rotary heads or 0)`) read one after the other into one
    /// weight buffer, a 1-D tensor; a part stored in another shape is an error.
    fn read_arena<T: candle_core::WithDType>(
        &self,
        parts: &[(&str, [usize; 2], usize)],
    ) -> Result<Tensor> {
        let total = parts.iter().map(|(_, [r, c], _)| r * c).sum();
        let mut data = gpt_kernels::memory::weight_vec(total, T::zero());
        let mut at = 0;
        for &(name, [rows, cols], heads) in parts {
            let slot = &mut data[at..at + rows * cols];
            {
                // The byte range was checked when the file was opened.
                let (_, mut file) = self.claim(name, &[rows, cols])?;
                crate::files::read_into(&mut *file, slot)?;
            }
            if heads > 0 {
                // llama.cpp's rotary rows back in Hugging Face's order, as `select_rows`.
                let read = slot.to_vec();
                for (dst, src) in rotary_order(rows, heads, false)?.into_iter().enumerate() {
                    slot[dst * cols..(dst + 1) * cols]
                        .copy_from_slice(&read[src * cols..(src + 1) * cols]);
                }
            }
            at += rows * cols;
        }
        Tensor::from_vec(data, total, &Device::Cpu)
    }
}

/// The dtype a float matrix stored as `t` is kept in when the model computes in `dtype`:
/// half precision stays half on the CPU under f32 activations, anything else is `dtype`.
fn matrix_dtype(t: GgmlDType, dtype: DType, device: &Device) -> DType {
    match (t, dtype) {
        (GgmlDType::F16, DType::F32) if device.is_cpu() => DType::F16,
        (GgmlDType::BF16, DType::F32) if device.is_cpu() => DType::BF16,
        _ => dtype,
    }
}

/// The dtype a float GGUF tensor is stored in; `None` for block formats.
fn stored_float(t: GgmlDType) -> Option<DType> {
    match t {
        GgmlDType::F32 => Some(DType::F32),
        GgmlDType::F16 => Some(DType::F16),
        GgmlDType::BF16 => Some(DType::BF16),
        _ => None,
    }
}

/// A float tensor in `dtype`: its bytes as they are when the formats agree (dequantizing
/// goes through f32, a transient 4 bytes an element: an f16 GPT-2's embedding alone made
/// that 150 MiB), else dequantized and converted.
fn float_tensor(q: &QTensor, dtype: DType, device: &Device) -> Result<Tensor> {
    if stored_float(q.dtype()) == Some(dtype) && device.is_cpu() {
        return Tensor::from_raw_buffer(&q.data()?, dtype, q.shape().dims(), device);
    }
    q.dequantize(device)?.to_dtype(dtype)
}

/// The inverse frequencies of `dim` rotated features, in f32 as transformers computes them.
fn inv_freqs(theta: f64, dim: usize) -> Vec<f32> {
    (0..dim / 2)
        .map(|i| 1.0 / (theta as f32).powf((2 * i) as f32 / dim as f32))
        .collect()
}

/// Llama 3's scaling from the per-frequency divisors llama.cpp stores (`rope_freqs`):
/// `factor` is the lowest frequency's divisor, and the blend between the bands is linear in
/// `1/wavelength`, so two of its points fix it (with `high - low = 1`; one point or none
/// leave a range, and any value in it gives the same divisors). The result is checked
/// against every stored divisor; anything else is refused.
fn llama3_from_factors(factors: &[f32], theta: f64, dim: usize) -> Result<RopeScaling> {
    let freqs = inv_freqs(theta, dim);
    let bad = || {
        candle_core::Error::Msg(
            "tensor rope_freqs.weight does not follow Llama 3's frequency scaling; other scalings are not supported".into(),
        )
    };
    let (Some(&factor), true) = (factors.last(), factors.len() == freqs.len()) else {
        return Err(bad());
    };
    if !(factor.is_finite() && factor >= 1.0) {
        return Err(bad());
    }
    let close = |a: f32, b: f32| (a - b).abs() <= 1e-5 * b.abs().max(1.0);
    if factors.iter().all(|&f| close(f, 1.0)) {
        return Ok(RopeScaling::None);
    }
    // (1 / wavelength, blend) of each frequency between the bands.
    let x = |i: usize| freqs[i] as f64 / (2.0 * std::f64::consts::PI);
    let blend = |f: f32| (1.0 / f as f64 - 1.0 / factor as f64) / (1.0 - 1.0 / factor as f64);
    let medium: Vec<usize> = (0..factors.len())
        .filter(|&i| !close(factors[i], 1.0) && !close(factors[i], factor))
        .collect();
    // blend = a / wavelength + b
    let (a, b) = match medium.as_slice() {
        [first, .., last] => {
            let (s0, s1) = (blend(factors[*first]), blend(factors[*last]));
            let a = (s1 - s0) / (x(*last) - x(*first));
            (a, s0 - a * x(*first))
        }
        [m] if *m > 0 && *m + 1 < factors.len() => {
            let s = blend(factors[*m]);
            let a = ((1.0 - s) / (x(m - 1) - x(*m))).max(s / (x(*m) - x(m + 1)));
            (a, s - a * x(*m))
        }
        [] => match (1..factors.len()).find(|&k| !close(factors[k], 1.0)) {
            Some(k) => {
                let a = 1.0 / (x(k - 1) - x(k));
                (a, -a * x(k))
            }
            None => return Err(bad()),
        },
        _ => return Err(bad()),
    };
    let scaling = RopeScaling::Llama3 {
        factor: factor as f64,
        low_freq_factor: -b,
        high_freq_factor: 1.0 - b,
        original_max_position_embeddings: a,
    };
    let ok = RopeConfig {
        scaling,
        ..Default::default()
    }
    .validate(2)
    .is_ok()
        && freqs
            .iter()
            .zip(factors)
            .all(|(&f, &div)| close(scaling.apply(f) * div / f, 1.0));
    match ok {
        true => Ok(scaling),
        false => Err(bad()),
    }
}

/// The order of the rows of `[heads·hd, ..]` q/k weights between Hugging Face's rotary
/// layout (halves) and llama.cpp's (adjacent pairs): output row `r` is input row
/// `order[r]`. llama.cpp's converter writes row `(j, i)` of each `[2, hd/2]` head at
/// `2·i + j`; `to_llama` goes that way, else back.
fn rotary_order(rows: usize, heads: usize, to_llama: bool) -> Result<Vec<usize>> {
    let hd = rows / heads.max(1);
    if heads == 0 || !rows.is_multiple_of(heads) || !hd.is_multiple_of(2) {
        bail!("{rows} rows cannot be split into {heads} rotary heads")
    }
    Ok((0..rows)
        .map(|r| {
            let (h, p) = (r / hd, r % hd);
            h * hd
                + match to_llama {
                    true => (p % 2) * (hd / 2) + p / 2,
                    false => 2 * (p % (hd / 2)) + p / (hd / 2),
                }
        })
        .collect())
}

/// Rows of a dense tensor in `order`.
fn select_rows(t: &Tensor, order: &[usize]) -> Result<Tensor> {
    let idx: Vec<u32> = order.iter().map(|&r| r as u32).collect();
    t.index_select(&Tensor::new(idx, t.device())?, 0)
}

/// Reorders the rows of an `[heads·hd, in]` matrix (any format: rows are whole blocks)
/// from llama.cpp's rotary layout back to Hugging Face's.
fn rotary_rows(w: &QTensor, heads: usize) -> Result<QTensor> {
    let (rows, cols) = w.shape().dims2()?;
    let order = rotary_order(rows, heads, false)?;
    let row_bytes = cols / w.dtype().block_size() * w.dtype().type_size();
    let data = w.data()?;
    let mut out = Vec::with_capacity(data.len());
    for src in order {
        out.extend_from_slice(&data[src * row_bytes..(src + 1) * row_bytes]);
    }
    let storage = QStorage::from_data(std::borrow::Cow::Owned(out), &w.device(), w.dtype())?;
    QTensor::new(storage, (rows, cols))
}

/// Loads a GGUF file's model (see [`Gguf::load`]).
pub fn load_gguf(path: &Path, dtype: DType, device: &Device) -> Result<Gpt> {
    let gguf = Gguf::open(path)?;
    gguf.load(dtype, device).map_err(|e| path_err(path, e))
}

/// llama.cpp's `general.file_type` of a model whose matrices are `dtype`.
fn file_type(dtype: GgmlDType) -> u32 {
    match dtype {
        GgmlDType::F32 => 0,
        GgmlDType::F16 => 1,
        GgmlDType::Q4_0 => 2,
        GgmlDType::Q4_1 => 3,
        GgmlDType::Q8_0 => 7,
        GgmlDType::Q5_0 => 8,
        GgmlDType::Q5_1 => 9,
        GgmlDType::Q2K => 10,
        GgmlDType::Q3K => 12,
        GgmlDType::Q4K => 15,
        GgmlDType::Q5K => 17,
        GgmlDType::Q6K => 18,
        GgmlDType::BF16 => 32,
        GgmlDType::Q8_1 | GgmlDType::Q8K => 7,
    }
}

/// Writes `model` as a GGUF file that llama.cpp loads: its tensor names, its metadata for
/// the family, matrices in `dtype` (those whose rows are not whole blocks of it in a
/// k-quant's fallback, else f16, as llama.cpp's quantizer falls back; see
/// [`Proj::quantized_as`]), norms, biases and learned positions in f32, and the
/// tokenizer (`vocab`) and chat template when given. Llama's query and key rows are put in
/// llama.cpp's rotary order. Written to a temporary name and renamed.
///
/// Families and options llama.cpp cannot express are refused: GPT-Neo, sliding windows,
/// post-norm blocks, GPT-2 without its tanh GELU or with per-layer score scaling.
pub fn save_gguf(
    model: &Gpt,
    path: &Path,
    dtype: GgmlDType,
    vocab: Option<&GgufVocab>,
    chat_template: Option<&str>,
) -> Result<()> {
    let cfg = model.config();
    let Some(&(arch, _)) = ARCHITECTURES
        .iter()
        .find(|(_, f)| *f == cfg.family || (cfg.family == Family::Mistral && *f == Family::Llama))
    else {
        bail!(
            "llama.cpp's GGUF has no {} architecture",
            cfg.family.model_type()
        )
    };
    if (0..cfg.n_layer.min(4096)).any(|i| cfg.window(i).is_some()) {
        bail!("llama.cpp's {arch} architecture has no sliding-window attention")
    }
    if cfg.norm_placement != crate::NormPlacement::Pre || cfg.scale_attn_by_inverse_layer_idx {
        bail!("llama.cpp's {arch} architecture has pre-norm blocks and plain 1/sqrt(d) scores only")
    }
    if cfg.family == Family::Gpt2 && cfg.activation_function != Activation::GeluNew {
        bail!(
            "llama.cpp's gpt2 architecture uses the tanh GELU (gelu_new), not {:?}",
            cfg.activation_function
        )
    }
    let dev = Device::Cpu;
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let mut dense = |name: String, t: &Tensor| -> Result<()> {
        let t = t.to_device(&dev)?.to_dtype(DType::F32)?.contiguous()?;
        tensors.push((name, QTensor::quantize(&t, GgmlDType::F32)?));
        Ok(())
    };
    // A matrix `[out, in]` in `dtype`, or where its rows are not whole blocks of it a
    // k-quant's fallback (as llama.cpp's quantizer), else f16.
    let matrix = |w: &Tensor| -> Result<QTensor> {
        let w = w.to_device(&dev)?.to_dtype(DType::F32)?.contiguous()?;
        let q = Proj::quantized_as(dtype, w.dim(1)?).unwrap_or(GgmlDType::F16);
        QTensor::quantize(&w, q)
    };
    let mut matrices: Vec<(String, QTensor)> = Vec::new();
    let mut proj = |name: String, p: &Proj, heads: usize| -> Result<Option<(String, Tensor)>> {
        // [in, out] -> [out, in]
        let mut w = p.weight_t()?.t()?.contiguous()?;
        let mut b = p.bias().cloned();
        if heads > 0 && cfg.family != Family::Qwen2 && arch == "llama" {
            let order = rotary_order(w.dim(0)?, heads, true)?;
            w = select_rows(&w, &order)?;
            b = b.map(|b| select_rows(&b, &order)).transpose()?;
        }
        matrices.push((format!("{name}.weight"), matrix(&w)?));
        Ok(b.map(|b| (format!("{name}.bias"), b)))
    };
    let mut biases: Vec<(String, Tensor)> = Vec::new();
    let norm = |biases: &mut Vec<(String, Tensor)>, name: &str, n: &Norm| {
        biases.push((format!("{name}.weight"), n.weight().clone()));
        if let Some(b) = n.bias() {
            biases.push((format!("{name}.bias"), b.clone()));
        }
    };
    for (i, block) in model.blocks().iter().enumerate() {
        let blk = |part: &str| format!("blk.{i}.{part}");
        let (ln_1, attn, ln_2, mlp) = block.parts();
        norm(&mut biases, &blk("attn_norm"), ln_1);
        norm(&mut biases, &blk("ffn_norm"), ln_2);
        let mut parts = Vec::new();
        match attn.fused_qkv() {
            Some(qkv) => parts.push(proj(blk("attn_qkv"), qkv, 0)?),
            None => {
                let [q, k, v] = attn.qkv_proj();
                parts.push(proj(blk("attn_q"), q, cfg.n_head)?);
                parts.push(proj(blk("attn_k"), k, cfg.kv_heads())?);
                parts.push(proj(blk("attn_v"), v, 0)?);
            }
        }
        parts.push(proj(blk("attn_output"), attn.out_proj(), 0)?);
        let (up, gate, down) = mlp.parts();
        if let Some(g) = gate {
            parts.push(proj(blk("ffn_gate"), g, 0)?);
        }
        parts.push(proj(blk("ffn_up"), up, 0)?);
        parts.push(proj(blk("ffn_down"), down, 0)?);
        biases.extend(parts.into_iter().flatten());
    }
    if let Some(ln_f) = model.ln_f() {
        norm(&mut biases, "output_norm", ln_f);
    }
    if !cfg.tie_word_embeddings {
        proj("output".into(), model.lm_head(), 0)?;
    }
    matrices.push(("token_embd.weight".into(), matrix(&model.wte()?)?));
    if let Some(wpe) = model.wpe() {
        dense("position_embd.weight".into(), wpe)?;
    }
    if let Some(
        rope @ RopeConfig {
            scaling: RopeScaling::Llama3 { .. },
            ..
        },
    ) = cfg.rope
    {
        // llama.cpp reads Llama 3's scaling as one divisor per frequency.
        let dim = rope.rotary_dim.unwrap_or(cfg.n_embd / cfg.n_head);
        let divisors: Vec<f32> = inv_freqs(rope.theta, dim)
            .into_iter()
            .map(|f| f / rope.scaling.apply(f))
            .collect();
        dense("rope_freqs.weight".into(), &Tensor::new(divisors, &dev)?)?;
    }
    for (name, t) in &biases {
        dense(name.clone(), t)?;
    }
    tensors.extend(matrices);

    let key = |k: &str| format!("{arch}.{k}");
    let u32v = |n: usize| -> Result<Value> {
        u32::try_from(n)
            .map(Value::U32)
            .map_err(|_| candle_core::Error::Msg(format!("{n} does not fit a GGUF u32")))
    };
    let head_dim = cfg.n_embd / cfg.n_head;
    let mut meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        (
            "general.name".into(),
            Value::String(cfg.family.model_type().into()),
        ),
        ("general.file_type".into(), Value::U32(file_type(dtype))),
        (key("context_length"), u32v(cfg.n_positions)?),
        (key("embedding_length"), u32v(cfg.n_embd)?),
        (key("block_count"), u32v(cfg.n_layer)?),
        (key("feed_forward_length"), u32v(cfg.inner_dim())?),
        (key("attention.head_count"), u32v(cfg.n_head)?),
        (key("attention.head_count_kv"), u32v(cfg.kv_heads())?),
    ];
    let eps = Value::F32(cfg.layer_norm_epsilon as f32);
    match cfg.norm {
        NormKind::RmsNorm => meta.push((key("attention.layer_norm_rms_epsilon"), eps)),
        NormKind::LayerNorm => meta.push((key("attention.layer_norm_epsilon"), eps)),
    }
    if let Some(rope) = cfg.rope {
        meta.push((key("rope.freq_base"), Value::F32(rope.theta as f32)));
        meta.push((
            key("rope.dimension_count"),
            u32v(rope.rotary_dim.unwrap_or(head_dim))?,
        ));
        if let RopeScaling::Linear { factor } = rope.scaling {
            meta.push((key("rope.scaling.type"), Value::String("linear".into())));
            meta.push((key("rope.scaling.factor"), Value::F32(factor as f32)));
        }
    }
    if cfg.family == Family::GptNeox {
        meta.push((
            key("use_parallel_residual"),
            Value::Bool(cfg.parallel_residual),
        ));
    }
    match vocab {
        Some(v) => meta.extend(vocab_metadata(v)?),
        // Without a tokenizer the special ids still belong to the model.
        None => {
            let ids = [("bos", cfg.bos_token_id), ("eos", cfg.eos_token_id)];
            for (name, id) in ids {
                if let Some(id) = id {
                    meta.push((format!("tokenizer.ggml.{name}_token_id"), Value::U32(id)));
                }
            }
        }
    }
    if let Some(t) = chat_template {
        meta.push(("tokenizer.chat_template".into(), Value::String(t.into())));
    }
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
    crate::write_atomic(path, |tmp| {
        let mut file = std::io::BufWriter::new(File::create(tmp).map_err(|e| path_err(tmp, e))?);
        gguf_file::write(&mut file, &meta_refs, &tensor_refs)?;
        std::io::Write::flush(&mut file).map_err(|e| path_err(tmp, e))
    })
}

/// The `tokenizer.ggml.*` entries of `v`.
fn vocab_metadata(v: &GgufVocab) -> Result<Vec<(String, Value)>> {
    let strings = |xs: &[String]| Value::Array(xs.iter().cloned().map(Value::String).collect());
    let mut meta = vec![
        (
            "tokenizer.ggml.model".to_string(),
            Value::String(v.model.clone()),
        ),
        ("tokenizer.ggml.tokens".to_string(), strings(&v.tokens)),
    ];
    if let Some(pre) = &v.pre {
        meta.push(("tokenizer.ggml.pre".into(), Value::String(pre.clone())));
    }
    if let Some(types) = &v.token_types {
        let types = types.iter().map(|&t| Value::I32(t)).collect();
        meta.push(("tokenizer.ggml.token_type".into(), Value::Array(types)));
    }
    if let Some(scores) = &v.scores {
        let scores = scores.iter().map(|&s| Value::F32(s)).collect();
        meta.push(("tokenizer.ggml.scores".into(), Value::Array(scores)));
    }
    if let Some(merges) = &v.merges {
        meta.push(("tokenizer.ggml.merges".into(), strings(merges)));
    }
    let ids = [
        ("bos_token_id", v.bos),
        ("eos_token_id", v.eos),
        ("unknown_token_id", v.unk),
        ("padding_token_id", v.pad),
    ];
    for (name, id) in ids {
        if let Some(id) = id {
            meta.push((format!("tokenizer.ggml.{name}"), Value::U32(id)));
        }
    }
    let flags = [
        ("add_bos_token", v.add_bos),
        ("add_eos_token", v.add_eos),
        ("add_space_prefix", v.add_space_prefix),
        ("remove_extra_whitespaces", v.remove_extra_whitespaces),
    ];
    for (name, flag) in flags {
        if let Some(b) = flag {
            meta.push((format!("tokenizer.ggml.{name}"), Value::Bool(b)));
        }
    }
    Ok(meta)
}
