//! `gpt convert`: write any model `gpt` loads as a GGUF file that llama.cpp loads, with its
//! tokenizer and chat template (a model trained with `gpt train` runs in llama.cpp, and a
//! GGUF file can be requantized).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::quantized::GgmlDType;
use clap::{Args, ValueEnum};

use crate::common::{self, Loaded, ModelArgs};
use crate::gguf_tokenizer;

/// The formats written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ToFormat {
    /// llama.cpp's GGUF.
    Gguf,
}

/// The matrices' format in the written file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum GgufType {
    /// 32-bit floats.
    F32,
    /// 16-bit floats.
    F16,
    /// 8-bit blocks of 32 (8.5 bits per weight).
    #[value(name = "q8_0")]
    Q8_0,
    /// 4-bit blocks of 32 (4.5 bits per weight).
    #[value(name = "q4_0")]
    Q4_0,
    /// 5-bit blocks of 32 (5.5 bits per weight).
    #[value(name = "q5_0")]
    Q5_0,
    /// llama.cpp's 4-bit k-quant (4.5 bits per weight; rows that are not whole
    /// super-blocks of 256 take q5_0).
    #[value(name = "q4_k")]
    Q4K,
    /// The 5-bit k-quant (5.5 bits per weight; else q5_1).
    #[value(name = "q5_k")]
    Q5K,
    /// The 6-bit k-quant (6.56 bits per weight; else q8_0).
    #[value(name = "q6_k")]
    Q6K,
}

/// Options of `gpt convert`.
#[derive(Debug, Clone, Args)]
pub struct ConvertArgs {
    /// Output format.
    #[arg(long, value_enum, default_value = "gguf")]
    pub to: ToFormat,
    /// The file to write.
    #[arg(long)]
    pub out: PathBuf,
    /// Format of the matrices (rows that are not whole blocks of it are written in a
    /// k-quant's fallback, else f16).
    #[arg(long = "type", value_enum, default_value = "f16")]
    pub kind: GgufType,
}

/// Runs `gpt convert`.
pub fn run(a: &ConvertArgs, margs: &ModelArgs) -> Result<()> {
    if margs.quantize.is_some() {
        bail!("--quantize does not apply to gpt convert; choose the written format with --type")
    }
    let Loaded {
        model,
        tokenizer,
        chat,
        source,
    } = common::load(margs)?;
    let cfg = model.config();
    let vocab = match &tokenizer {
        Some(tok) => Some(
            gguf_tokenizer::to_vocab(tok, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
                .context("the tokenizer")?,
        ),
        None => None,
    };
    let dtype = match a.kind {
        GgufType::F32 => GgmlDType::F32,
        GgufType::F16 => GgmlDType::F16,
        GgufType::Q8_0 => GgmlDType::Q8_0,
        GgufType::Q4_0 => GgmlDType::Q4_0,
        GgufType::Q5_0 => GgmlDType::Q5_0,
        GgufType::Q4K => GgmlDType::Q4K,
        GgufType::Q5K => GgmlDType::Q5K,
        GgufType::Q6K => GgmlDType::Q6K,
    };
    gpt_blocks::save_gguf(&model, &a.out, dtype, vocab.as_ref(), chat.own_template())
        .with_context(|| format!("writing {}", a.out.display()))?;
    let bytes = std::fs::metadata(&a.out)?.len();
    eprintln!(
        "{source} -> {} ({:?}, {:.1} MiB{})",
        a.out.display(),
        a.kind,
        bytes as f64 / (1 << 20) as f64,
        if vocab.is_some() {
            ", with its tokenizer"
        } else {
            ", no tokenizer"
        }
    );
    Ok(())
}
