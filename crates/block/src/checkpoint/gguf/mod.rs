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

mod build;
mod config;
mod read;
mod rope;
pub(crate) mod save;
pub(crate) mod vocab;

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::GgmlDType;
use candle_core::{bail, DType, Result};

use crate::checkpoint::io::path_err;
use crate::family::names::gguf;
use crate::family::Family;

/// Where a GGUF file's bytes are read from: a file, or bytes in memory (a model built into
/// a binary).
pub(super) enum Source {
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

/// Runs Candle's parser, turning a panic inside it into an error (the panic hook is
/// silenced meanwhile, so that the one line the user sees is the error).
pub(super) fn guarded<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
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

/// Bytes a tensor of `dims` elements takes in `dtype`, or why it cannot exist.
pub(super) fn tensor_bytes(name: &str, dtype: GgmlDType, dims: &[usize]) -> Result<u64> {
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
        // Candle reads the metadata a value at a time: a vocabulary of 262,144 tokens, its
        // scores and types, are a million small reads, each a system call on a bare file.
        let content = guarded(|| {
            gguf_file::Content::read(&mut std::io::BufReader::with_capacity(1 << 16, &mut file))
        })
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
                    && name.strip_suffix(".weight") != Some(gguf::POSITION_EMBD)
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

    pub(super) fn value(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
    }

    pub(super) fn uint(&self, key: &str) -> Result<Option<u64>> {
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
    pub(super) fn size(&self, key: &str) -> Result<Option<usize>> {
        match self.uint(key)? {
            Some(n) if n > u32::MAX as u64 => bail!("metadata {key} = {n} is too large"),
            other => Ok(other.map(|n| n as usize)),
        }
    }

    pub(super) fn need(&self, key: &str) -> Result<usize> {
        match self.size(key)? {
            None => bail!("metadata {key} is missing"),
            Some(0) => bail!("metadata {key} must be positive, got 0"),
            Some(n) => Ok(n),
        }
    }

    pub(super) fn float(&self, key: &str) -> Result<Option<f64>> {
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

    pub(super) fn string(&self, key: &str) -> Result<Option<&str>> {
        match self.value(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => bail!("metadata {key} must be a string, got {:?}", v.value_type()),
        }
    }

    pub(super) fn boolean(&self, key: &str) -> Result<Option<bool>> {
        match self.value(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => bail!("metadata {key} must be true or false, got {v:?}"),
        }
    }

    pub(super) fn array(&self, key: &str) -> Result<Option<&Vec<Value>>> {
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
        Ok((arch, Family::from_gguf_arch(arch)?))
    }

    pub(super) fn shape(&self, name: &str) -> Option<&[usize]> {
        self.content.tensor_infos.get(name).map(|i| i.shape.dims())
    }

    /// `tokenizer.chat_template`, when the file carries one.
    pub fn chat_template(&self) -> Result<Option<String>> {
        Ok(self.string("tokenizer.chat_template")?.map(str::to_string))
    }
}
