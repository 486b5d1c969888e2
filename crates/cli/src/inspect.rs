//! `gpt inspect`: what a checkpoint holds.

use anyhow::Result;
use clap::Args;

use crate::common::{self, Format, Loaded, ModelArgs};

/// Options of `gpt inspect`.
#[derive(Debug, Clone, Args)]
pub struct InspectArgs {
    /// Output format.
    #[arg(long, value_enum, default_value = "text")]
    pub format: Format,
}

/// The part of the model a tensor belongs to.
fn part(name: &str) -> &'static str {
    if name.contains(".wte.") || name.contains(".wpe.") {
        "embeddings"
    } else if name.contains(".attn.") {
        "attention"
    } else if name.contains(".mlp.") {
        "mlp"
    } else if name.contains(".ln_") {
        "norms"
    } else {
        "lm_head"
    }
}

/// Runs `gpt inspect`.
pub fn run(a: &InspectArgs, margs: &ModelArgs) -> Result<()> {
    let Loaded {
        model,
        tokenizer,
        source,
    } = common::load(margs)?;
    let mut tensors: Vec<_> = model.named_tensors()?.into_iter().collect();
    // Blocks in numeric order: h.2 before h.10.
    let key = |n: &str| {
        let num: Option<usize> = n.split('.').find_map(|p| p.parse().ok());
        (num.unwrap_or(usize::MAX), n.to_string())
    };
    tensors.sort_by_key(|(n, _)| key(n));
    let parts = ["embeddings", "attention", "mlp", "norms", "lm_head"];
    let counts: Vec<(&str, usize)> = parts
        .iter()
        .map(|&p| {
            let n = tensors
                .iter()
                .filter(|(name, _)| part(name) == p)
                .map(|(_, t)| t.elem_count())
                .sum();
            (p, n)
        })
        .collect();
    let total: usize = counts.iter().map(|c| c.1).sum();
    let cfg = model.config();
    match a.format {
        Format::Json => {
            let obj = serde_json::json!({
                "source": source,
                "config": cfg,
                "tokenizer": tokenizer.as_ref().map(|t| t.get_vocab_size(true)),
                "tensors": tensors.iter().map(|(n, t)| serde_json::json!({
                    "name": n, "dtype": format!("{:?}", t.dtype()).to_lowercase(), "shape": t.dims(),
                })).collect::<Vec<_>>(),
                "parameters": counts
                    .iter()
                    .map(|(p, n)| (p.to_string(), serde_json::json!(n)))
                    .chain([("total".to_string(), serde_json::json!(total))])
                    .collect::<serde_json::Map<_, _>>(),
            });
            println!("{obj}");
        }
        Format::Text => {
            println!("model: {source}");
            println!(
                "config: {} layers, {} heads, width {}, context {}, vocabulary {}, {:?}, LayerNorm eps {}, tied head: {}",
                cfg.n_layer,
                cfg.n_head,
                cfg.n_embd,
                cfg.n_positions,
                cfg.vocab_size,
                cfg.activation_function,
                cfg.layer_norm_epsilon,
                cfg.tie_word_embeddings
            );
            match &tokenizer {
                Some(t) => println!("tokenizer: {} tokens", t.get_vocab_size(true)),
                None => println!("tokenizer: none (token ids only)"),
            }
            println!("\ntensors:");
            for (n, t) in &tensors {
                println!(
                    "  {n:<40} {:<5} {:?}",
                    format!("{:?}", t.dtype()).to_lowercase(),
                    t.dims()
                );
            }
            println!("\nparameters:");
            for (p, n) in &counts {
                println!(
                    "  {p:<11} {n:>12}  ({:.1}%)",
                    100.0 * *n as f64 / total.max(1) as f64
                );
            }
            println!("  {:<11} {total:>12}", "total");
        }
    }
    Ok(())
}
