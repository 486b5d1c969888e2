//! The arguments subcommands share (the model and where it runs, a prompt, sampling,
//! output format, truncation) and reading the files they name.

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device};
use clap::{Args, ValueEnum};
use gpt_blocks::SamplingParams;

use crate::text::tokenizer::Tokenizer;
use crate::tokens::{encode, parse_ids};

/// Where the computation runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DeviceArg {
    /// CUDA, then Metal, then CPU, as built.
    Auto,
    /// The CPU.
    Cpu,
    /// The first CUDA GPU (build with `--features cuda`).
    Cuda,
    /// The Metal GPU (build with `--features metal`).
    Metal,
}

/// Weight precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DtypeArg {
    /// 32-bit floats.
    F32,
    /// 16-bit floats.
    F16,
    /// bfloat16.
    Bf16,
}

impl From<DtypeArg> for DType {
    fn from(d: DtypeArg) -> Self {
        match d {
            DtypeArg::F32 => DType::F32,
            DtypeArg::F16 => DType::F16,
            DtypeArg::Bf16 => DType::BF16,
        }
    }
}

/// Block-quantized weights for the matrix products (Candle's GGML formats).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum QuantizeArg {
    /// 8-bit, blocks of 32 with an f16 scale: 8.5 bits per weight.
    #[value(name = "q8_0")]
    Q8_0,
    /// 4-bit, blocks of 32 with an f16 scale: 4.5 bits per weight.
    #[value(name = "q4_0")]
    Q4_0,
    /// 5-bit, blocks of 32 with an f16 scale: 5.5 bits per weight.
    #[value(name = "q5_0")]
    Q5_0,
    /// llama.cpp's 4-bit k-quant, super-blocks of 256 with 6-bit scales and minima per 32:
    /// 4.5 bits per weight (matrices whose rows are not whole super-blocks take q5_0).
    #[value(name = "q4_k")]
    Q4K,
    /// The 5-bit k-quant: 5.5 bits per weight (else q5_1).
    #[value(name = "q5_k")]
    Q5K,
    /// The 6-bit k-quant, 8-bit scales per 16: 6.56 bits per weight (else q8_0).
    #[value(name = "q6_k")]
    Q6K,
}

impl From<QuantizeArg> for candle_core::quantized::GgmlDType {
    fn from(q: QuantizeArg) -> Self {
        match q {
            QuantizeArg::Q8_0 => Self::Q8_0,
            QuantizeArg::Q4_0 => Self::Q4_0,
            QuantizeArg::Q5_0 => Self::Q5_0,
            QuantizeArg::Q4K => Self::Q4K,
            QuantizeArg::Q5K => Self::Q5K,
            QuantizeArg::Q6K => Self::Q6K,
        }
    }
}

/// Output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// For people.
    Text,
    /// One JSON object per line, for scripts.
    Json,
}

/// Options of every subcommand that runs a model.
#[derive(Debug, Clone, Args)]
pub struct ModelArgs {
    /// A Hugging Face model directory (GPT-2, Llama, Mistral, Qwen2, Qwen3, SmolLM3, OLMo 2,
    /// Granite, Gemma 2, Gemma 3, Phi-3/Phi-4-mini, LFM2, GPT-NeoX or GPT-Neo), a GGUF file (llama, qwen2, qwen3, smollm3,
    /// olmo2, granite, gemma2, gemma3, phi3, lfm2, gpt2, gptneox), a nanoGPT ckpt.pt, or a model id on the Hugging Face hub
    /// (e.g. openai-community/gpt2).
    /// Default: the small model built into gpt.
    #[arg(long, global = true)]
    pub model: Option<String>,
    /// Device to run on.
    #[arg(long, value_enum, default_value = "auto", global = true)]
    pub device: DeviceArg,
    /// Weight precision (default: f32; a GGUF file whose matrices are stored in f16 or bf16
    /// keeps them so). On the CPU, f16 and bf16 models compute in f32.
    #[arg(long, value_enum, global = true)]
    pub dtype: Option<DtypeArg>,
    /// Precision of the KV cache (default: a half-precision model's own, else the
    /// activations').
    #[arg(long, value_enum, global = true)]
    pub kv_dtype: Option<DtypeArg>,
    /// Check every weight for NaN and Inf after loading.
    #[arg(long, global = true)]
    pub check_weights: bool,
    /// Quantize the weights of every matrix product after loading (embeddings and norms
    /// stay in --dtype).
    #[arg(long, value_enum, global = true)]
    pub quantize: Option<QuantizeArg>,
}

/// One prompt, as text or as token ids.
#[derive(Debug, Clone, Args)]
pub struct PromptArgs {
    /// Prompt text.
    #[arg(long, required_unless_present = "prompt_ids")]
    pub prompt: Option<String>,
    /// The prompt as token ids, e.g. 464,3290,318.
    #[arg(long, conflicts_with = "prompt")]
    pub prompt_ids: Option<String>,
}

impl PromptArgs {
    /// The prompt's token ids.
    pub fn ids(&self, tokenizer: Option<&Tokenizer>) -> Result<Vec<u32>> {
        match (&self.prompt, &self.prompt_ids) {
            (_, Some(ids)) => parse_ids(ids),
            (Some(p), None) => encode(tokenizer, p),
            (None, None) => bail!("give --prompt or --prompt-ids"),
        }
    }
}

/// Picks the device; asking for one this binary was not built for says how to build it.
pub fn device(arg: DeviceArg) -> Result<Device> {
    match arg {
        DeviceArg::Cpu => Ok(Device::Cpu),
        DeviceArg::Cuda => {
            if cfg!(feature = "cuda") {
                Device::new_cuda(0).context("opening CUDA device 0")
            } else {
                bail!("this gpt was built without CUDA; rebuild with `cargo build --release --features cuda`")
            }
        }
        DeviceArg::Metal => {
            if cfg!(feature = "metal") {
                Device::new_metal(0).context("opening the Metal device")
            } else {
                bail!("this gpt was built without Metal; rebuild with `cargo build --release --features metal`")
            }
        }
        DeviceArg::Auto => {
            if cfg!(feature = "cuda") {
                if let Ok(d) = Device::new_cuda(0) {
                    return Ok(d);
                }
            }
            if cfg!(feature = "metal") {
                if let Ok(d) = Device::new_metal(0) {
                    return Ok(d);
                }
            }
            Ok(Device::Cpu)
        }
    }
}

/// How tokens are picked (`gpt generate`, `gpt chat`).
#[derive(Debug, Clone, Args)]
pub struct SamplingArgs {
    /// Softmax temperature; 0 is greedy (ties to the lowest id).
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f64,
    /// Sample only among the k most likely tokens.
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Sample only among the most likely tokens that make up probability p, in (0, 1].
    #[arg(long)]
    pub top_p: Option<f64>,
    /// Penalty on tokens already present (1 is off).
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Seed of the sampling.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
}

impl SamplingArgs {
    /// The checked parameters.
    pub fn params(&self) -> Result<SamplingParams> {
        let p = SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            repeat_penalty: self.repeat_penalty,
            seed: self.seed,
        };
        p.validate()?;
        Ok(p)
    }
}

/// Reads a UTF-8 text file, naming the first invalid byte when it is not one.
pub fn read_text(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    String::from_utf8(bytes).map_err(|e| {
        anyhow!(
            "{}: not UTF-8 text (invalid byte at offset {})",
            path.display(),
            e.utf8_error().valid_up_to()
        )
    })
}
