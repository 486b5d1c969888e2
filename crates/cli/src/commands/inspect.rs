//! `gpt inspect`: what a checkpoint holds.

use anyhow::Result;
use clap::Args;

use crate::args::{Format, ModelArgs};
use crate::model::{self, Loaded};

/// Options of `gpt inspect`.
#[derive(Debug, Clone, Args)]
pub struct InspectArgs {
    /// Output format.
    #[arg(long, value_enum, default_value = "text")]
    pub format: Format,
}

/// The part of the model a tensor belongs to, from the names every family uses.
fn part(name: &str) -> &'static str {
    if name.starts_with("lm_head.") || name.starts_with("embed_out.") {
        "lm_head"
    } else if name.contains("embed") || name.contains(".wte.") || name.contains(".wpe.") {
        "embeddings"
    } else if [".attn.", ".self_attn.", ".attention."]
        .iter()
        .any(|p| name.contains(p))
    {
        "attention"
    } else if name.contains(".mlp.") {
        "mlp"
    } else {
        "norms"
    }
}

/// What the family chose for each part, in words.
fn parts_of(cfg: &gpt_blocks::GptConfig) -> serde_json::Value {
    let positions = match &cfg.rope {
        None => "learned".to_string(),
        Some(r) => {
            let dims = r.rotary_dim.unwrap_or(cfg.head_dim());
            let scaling = match r.scaling {
                mha::RopeScaling::None => String::new(),
                mha::RopeScaling::Linear { factor } => format!(", linear scaling {factor}"),
                mha::RopeScaling::Llama3 { factor, .. } => format!(", llama3 scaling {factor}"),
                mha::RopeScaling::LongRope {
                    original_max_position_embeddings: old,
                    ..
                } => format!(", longrope past {old} positions"),
            };
            let nope: Vec<String> = (0..cfg.n_layer)
                .filter(|&i| cfg.layer_rope(i).is_none() && !cfg.is_conv(i))
                .map(|i| i.to_string())
                .collect();
            let nope = match nope.is_empty() {
                true => String::new(),
                false => format!("; layers {} without rotation", nope.join(", ")),
            };
            let local = match &cfg.rope_local {
                Some(l) => format!("; windowed layers at theta {}", l.theta),
                None => String::new(),
            };
            format!(
                "rotary (theta {}, {dims} of {} dims{scaling}{nope}{local})",
                r.theta,
                cfg.head_dim()
            )
        }
    };
    let windows: Vec<String> = (0..cfg.n_layer)
        .filter_map(|i| cfg.window(i).map(|w| format!("{i}:{w}")))
        .collect();
    serde_json::json!({
        "family": cfg.family.model_type(),
        "norm": format!("{:?}", cfg.norm),
        "positions": positions,
        "mlp": format!("{} {:?} of width {}", if cfg.gated_mlp { "gated" } else { "plain" }, cfg.activation_function, cfg.inner_dim()),
        "residual": if cfg.parallel_residual { "parallel" } else { "sequential" },
        "kv_heads": cfg.kv_heads(),
        "head_dim": cfg.head_dim(),
        "qk_norm": cfg.qk_norm.map(|n| if n.per_head { "RMSNorm per head" } else { "RMSNorm over the projection" }),
        "norm_placement": cfg.norm_placement,
        "multipliers": serde_json::json!({
            "embedding": cfg.embedding_multiplier,
            "attention_scale": cfg.attn_scale,
            "residual": cfg.residual_multiplier,
            "logits_divided_by": cfg.logits_scaling,
            "logit_soft_cap": cfg.final_logit_softcapping,
            "attention_soft_cap": cfg.attn_logit_softcapping,
        }),
        "local_attention_windows": windows,
        "short_convolution_layers": (0..cfg.n_layer)
            .filter(|&i| cfg.is_conv(i))
            .map(|i| format!("{i}:{} taps", cfg.conv_taps))
            .collect::<Vec<_>>(),
    })
}

/// Runs `gpt inspect`.
pub fn run(a: &InspectArgs, margs: &ModelArgs) -> Result<()> {
    let Loaded {
        model,
        tokenizer,
        chat,
        source,
    } = model::load(margs)?;
    // Names, formats and shapes only: a quantized file is listed without dequantizing it.
    let mut tensors = model.stored_tensors()?;
    // Blocks in numeric order: h.2 before h.10.
    let key = |n: &str| {
        let num: Option<usize> = n.split('.').find_map(|p| p.parse().ok());
        (num.unwrap_or(usize::MAX), n.to_string())
    };
    tensors.sort_by_key(|t| key(&t.name));
    let parts = ["embeddings", "attention", "mlp", "norms", "lm_head"];
    let counts: Vec<(&str, usize)> = parts
        .iter()
        .map(|&p| {
            let n = tensors
                .iter()
                .filter(|t| part(&t.name) == p)
                .map(|t| t.shape.iter().product::<usize>())
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
                "parts": parts_of(cfg),
                "tokenizer": tokenizer.as_ref().map(|t| t.vocab_size()),
                "chat_template": chat.is_own(),
                "quantized": model.is_quantized(),
                "tensors": tensors.iter().map(|t| serde_json::json!({
                    "name": t.name, "dtype": t.format, "shape": t.shape,
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
            let parts = parts_of(cfg);
            let heads = match cfg.kv_heads() {
                kv if kv == cfg.n_head => format!("{} heads", cfg.n_head),
                kv => format!("{} heads over {kv} key/value heads", cfg.n_head),
            };
            println!(
                "config: {}, {} layers, {heads}, width {}, context {}, vocabulary {}, tied head: {}",
                cfg.family.model_type(),
                cfg.n_layer,
                cfg.n_embd,
                cfg.n_positions,
                cfg.vocab_size,
                cfg.tie_word_embeddings
            );
            let windows = parts["local_attention_windows"]
                .as_array()
                .filter(|w| !w.is_empty())
                .map(|w| {
                    let list: Vec<_> = w.iter().filter_map(|x| x.as_str()).collect();
                    format!(", local attention (layer:window) {}", list.join(" "))
                })
                .unwrap_or_default();
            let convs = parts["short_convolution_layers"]
                .as_array()
                .filter(|w| !w.is_empty())
                .map(|w| {
                    let list: Vec<_> = w.iter().filter_map(|x| x.as_str()).collect();
                    format!(
                        ", gated short convolution instead of attention in layers {}",
                        list.join(", ")
                    )
                })
                .unwrap_or_default();
            println!(
                "parts: {} eps {}, positions {}, MLP {}, {} residual{windows}{convs}",
                cfg.norm_name(),
                cfg.layer_norm_epsilon,
                parts["positions"].as_str().unwrap_or_default(),
                parts["mlp"].as_str().unwrap_or_default(),
                parts["residual"].as_str().unwrap_or_default(),
            );
            match &tokenizer {
                Some(t) => println!("tokenizer: {} tokens", t.vocab_size()),
                None => println!("tokenizer: none (token ids only)"),
            }
            match chat.is_own() {
                true => println!("chat: the model's own template"),
                false => println!("chat: the plain format (the model has no template)"),
            }
            if model.is_quantized() {
                println!("matrix products: block-quantized (each matrix's format below)");
            }
            println!("\ntensors:");
            let width = tensors.iter().map(|t| t.name.len()).max().unwrap_or(0);
            for t in &tensors {
                println!("  {:<width$} {:<5} {:?}", t.name, t.format, t.shape);
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
