//! `gpt score`: how likely a text is under the model.

use std::path::PathBuf;

use anyhow::{bail, Result};
use candle_core::Tensor;
use clap::Args;
use gpt_blocks::{token_logprobs, Logits};

use crate::args::{self, Format, ModelArgs};
use crate::model::{self, Loaded};
use crate::tokens;

/// Options of `gpt score`.
#[derive(Debug, Clone, Args)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["text", "file", "ids"])))]
pub struct ScoreArgs {
    /// Text to score.
    #[arg(long)]
    pub text: Option<String>,
    /// File whose text to score (UTF-8).
    #[arg(long)]
    pub file: Option<PathBuf>,
    /// Token ids to score, e.g. 464,3290,318.
    #[arg(long)]
    pub ids: Option<String>,
    /// Sliding-window stride for texts longer than the context (default: half the context).
    #[arg(long)]
    pub stride: Option<usize>,
    /// Output format.
    #[arg(long, value_enum, default_value = "text")]
    pub format: Format,
}

/// Log-probability of each token after the first, windows of the context length sliding by
/// `stride`, each token scored once with as much context as its window gives (as
/// Hugging Face's perplexity guide does).
pub fn logprobs(model: &gpt_blocks::Gpt, ids: &[u32], stride: usize) -> Result<Vec<f32>> {
    let ctx = model.config().n_positions;
    let dev = model.device().clone();
    let mut out = Vec::with_capacity(ids.len().saturating_sub(1));
    let mut begin = 0;
    loop {
        let end = (begin + ctx).min(ids.len());
        let window = Tensor::new(&ids[begin..end], &dev)?.unsqueeze(0)?;
        let logits = model.infer(&window, None, None, Logits::All)?;
        // lp[j] is log p(ids[begin + j + 1] | ids[begin ..= begin + j]).
        let lp = token_logprobs(&logits, &window)?
            .squeeze(0)?
            .to_vec1::<f32>()?;
        let already = out.len(); // tokens 1..=already are scored
        let skip = (already + 1).saturating_sub(begin + 1);
        out.extend_from_slice(&lp[skip.min(lp.len())..]);
        if end == ids.len() {
            return Ok(out);
        }
        begin += stride;
    }
}

/// Runs `gpt score`.
pub fn run(a: &ScoreArgs, margs: &ModelArgs) -> Result<()> {
    let Loaded {
        model, tokenizer, ..
    } = model::load_for_inference(margs)?;
    let ids = match (&a.text, &a.file, &a.ids) {
        (Some(t), _, _) => tokens::encode(tokenizer.as_ref(), t)?,
        (_, Some(f), _) => tokens::encode(tokenizer.as_ref(), &args::read_text(f)?)?,
        (_, _, Some(ids)) => tokens::parse_ids(ids)?,
        _ => bail!("give --text, --file or --ids"),
    };
    if ids.len() < 2 {
        bail!(
            "scoring needs at least 2 tokens (the first is only context), got {}",
            ids.len()
        )
    }
    tokens::check_ids(&ids, &model)?;
    let ctx = model.config().n_positions;
    let stride = a.stride.unwrap_or((ctx / 2).max(1));
    if stride == 0 || stride > ctx {
        bail!("--stride must be in 1..={ctx}, got {stride}")
    }
    let lps = logprobs(&model, &ids, stride)?;
    let nll = -lps.iter().map(|&x| x as f64).sum::<f64>() / lps.len() as f64;
    match a.format {
        Format::Text => println!(
            "{} tokens, {} predicted: mean NLL {nll:.6} nats/token, perplexity {:.4}",
            ids.len(),
            lps.len(),
            nll.exp()
        ),
        Format::Json => println!(
            "{}",
            serde_json::json!({
                "tokens": ids.len(),
                "predicted": lps.len(),
                "nll": nll,
                "ppl": nll.exp(),
                "token_logprobs": lps,
            })
        ),
    }
    Ok(())
}
