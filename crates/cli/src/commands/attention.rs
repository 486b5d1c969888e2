//! `gpt attention`: see where each head looks.

use std::path::PathBuf;

use anyhow::{bail, Result};
use candle_core::{DType, Tensor};
use clap::Args;

use crate::args::{ModelArgs, PromptArgs};
use crate::model::{self, Loaded};
use crate::plot::{self, Heatmap};
use crate::tokens;

/// Options of `gpt attention`.
#[derive(Debug, Clone, Args)]
pub struct AttentionArgs {
    #[command(flatten)]
    pub prompt: PromptArgs,
    /// Block to show (from 0).
    #[arg(long, default_value_t = 0)]
    pub layer: usize,
    /// One head (from 0); all heads of the layer when absent.
    #[arg(long)]
    pub head: Option<usize>,
    /// Write a heatmap (.png or .svg) instead of printing to the terminal.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

const SHADES: [char; 10] = [' ', '.', ':', '-', '=', '+', '*', '#', '%', '@'];

fn print_matrix(title: &str, w: &[Vec<f32>], tokens: &[String]) {
    println!("{title} (rows: queries, columns: keys; darker is more)");
    let width = tokens
        .iter()
        .map(|t| t.chars().count())
        .max()
        .unwrap_or(1)
        .min(16);
    for (row, tok) in w.iter().zip(tokens) {
        let cells: String = row
            .iter()
            .map(|&x| SHADES[((x.clamp(0.0, 1.0) * 9.0).round()) as usize])
            .flat_map(|c| [c, c])
            .collect();
        let label: String = tok.chars().take(width).collect();
        println!("{label:>width$} |{cells}|");
    }
    println!();
}

/// Runs `gpt attention`.
pub fn run(a: &AttentionArgs, margs: &ModelArgs) -> Result<()> {
    let Loaded {
        model, tokenizer, ..
    } = model::load(margs)?;
    let cfg = model.config();
    let ids = a.prompt.ids(tokenizer.as_ref())?;
    if ids.is_empty() {
        bail!("the prompt encodes to no tokens")
    }
    tokens::check_ids(&ids, &model)?;
    if ids.len() > cfg.n_positions {
        bail!(
            "the prompt has {} tokens; the model's context is {}",
            ids.len(),
            cfg.n_positions
        )
    }
    if a.layer >= cfg.n_layer {
        bail!(
            "--layer {} does not exist: the model has layers 0..{}",
            a.layer,
            cfg.n_layer - 1
        )
    }
    if cfg.is_conv(a.layer) {
        let attending: Vec<String> = (0..cfg.n_layer.min(4096))
            .filter(|&i| !cfg.is_conv(i))
            .map(|i| i.to_string())
            .collect();
        bail!(
            "--layer {} is a short-convolution block, which has no attention weights (attention layers: {})",
            a.layer,
            attending.join(", ")
        )
    }
    if let Some(h) = a.head {
        if h >= cfg.n_head {
            bail!(
                "--head {h} does not exist: the model has heads 0..{}",
                cfg.n_head - 1
            )
        }
    }
    let input = Tensor::new(ids.as_slice(), model.device())?.unsqueeze(0)?;
    let (_, weights) = model.forward_with_weights(&input)?;
    // (n_head, t, t)
    let layer = weights[a.layer].squeeze(0)?.to_dtype(DType::F32)?;
    let heads: Vec<usize> = match a.head {
        Some(h) => vec![h],
        None => (0..cfg.n_head).collect(),
    };
    let tokens = tokens::token_texts(tokenizer.as_ref(), &ids);
    let maps: Vec<Heatmap> = heads
        .iter()
        .map(|&h| {
            Ok(Heatmap {
                title: format!("layer {} head {h}", a.layer),
                weights: layer.get(h)?.to_vec2::<f32>()?,
            })
        })
        .collect::<Result<_>>()?;
    match &a.out {
        Some(path) => {
            plot::attention_heatmaps(&maps, &tokens, path)?;
            eprintln!(
                "wrote {} ({} heatmap{})",
                path.display(),
                maps.len(),
                if maps.len() == 1 { "" } else { "s" }
            );
        }
        None => {
            for m in &maps {
                print_matrix(&m.title, &m.weights, &tokens);
            }
        }
    }
    Ok(())
}
