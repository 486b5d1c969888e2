//! `gpt convert`: write any model `gpt` loads as a GGUF file that llama.cpp loads, with its
//! tokenizer and chat template (a model trained with `gpt train` runs in llama.cpp, and a
//! GGUF file can be requantized).

use std::path::PathBuf;
use std::sync::LazyLock;

use anyhow::{bail, Context, Result};
use candle_core::quantized::GgmlDType;
use clap::builder::PossibleValue;
use clap::{Args, ValueEnum};

use crate::args::{ModelArgs, QuantizeArg};
use crate::model::{self, Loaded};
use crate::text::gguf_tokenizer;

/// The formats written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ToFormat {
    /// llama.cpp's GGUF.
    Gguf,
}

/// The matrices' format in the written file: f32, f16, or one of `--quantize`'s formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufType {
    /// 32-bit floats.
    F32,
    /// 16-bit floats.
    F16,
    /// Block-quantized.
    Quantized(QuantizeArg),
}

impl ValueEnum for GgufType {
    fn value_variants<'a>() -> &'a [Self] {
        // f32, f16, then `--quantize`'s values with their help.
        static VARIANTS: LazyLock<Vec<GgufType>> = LazyLock::new(|| {
            let quantized = QuantizeArg::value_variants().iter();
            [GgufType::F32, GgufType::F16]
                .into_iter()
                .chain(quantized.map(|&q| GgufType::Quantized(q)))
                .collect()
        });
        &VARIANTS
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        match self {
            GgufType::F32 => Some(PossibleValue::new("f32").help("32-bit floats")),
            GgufType::F16 => Some(PossibleValue::new("f16").help("16-bit floats")),
            GgufType::Quantized(q) => q.to_possible_value(),
        }
    }
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
    } = model::load(margs)?;
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
        GgufType::Quantized(q) => q.into(),
    };
    gpt_blocks::save_gguf(&model, &a.out, dtype, vocab.as_ref(), chat.own_template())
        .with_context(|| format!("writing {}", a.out.display()))?;
    let bytes = std::fs::metadata(&a.out)?.len();
    // The format as the user names it (`q4_k`).
    let kind = a.kind.to_possible_value().map(|v| v.get_name().to_owned());
    eprintln!(
        "{source} -> {} ({}, {:.1} MiB{})",
        a.out.display(),
        kind.unwrap_or_default(),
        bytes as f64 / (1 << 20) as f64,
        if vocab.is_some() {
            ", with its tokenizer"
        } else {
            ", no tokenizer"
        }
    );
    Ok(())
}
