//! `gpt trace`: one forward pass, step by step, with every tensor's shape.

use anyhow::{bail, Result};
use block::NormPlacement;
use candle_core::{Tensor, D};
use clap::Args;

use crate::common::{self, Loaded, ModelArgs, PromptArgs};

/// Options of `gpt trace`.
#[derive(Debug, Clone, Args)]
pub struct TraceArgs {
    #[command(flatten)]
    pub prompt: PromptArgs,
    /// Show the inside of this block only (all blocks when absent).
    #[arg(long)]
    pub layer: Option<usize>,
}

fn shape(t: &Tensor) -> String {
    format!("{:?}", t.dims())
}

/// Runs `gpt trace`.
pub fn run(a: &TraceArgs, margs: &ModelArgs) -> Result<()> {
    let Loaded {
        model, tokenizer, ..
    } = common::load(margs)?;
    let cfg = model.config().clone();
    if cfg.norm_placement != NormPlacement::Pre {
        bail!("trace follows GPT-2's pre-norm blocks; this model is post-norm")
    }
    let ids = a.prompt.ids(tokenizer.as_ref())?;
    if ids.is_empty() || ids.len() > cfg.n_positions {
        bail!(
            "the prompt must have 1..={} tokens, got {}",
            cfg.n_positions,
            ids.len()
        )
    }
    common::check_ids(&ids, &model)?;
    if let Some(l) = a.layer {
        if l >= cfg.n_layer {
            bail!(
                "--layer {l} does not exist: the model has layers 0..{}",
                cfg.n_layer - 1
            )
        }
    }
    let (h, d) = (cfg.n_head, cfg.n_embd);
    let dk = d / h;
    let s = ids.len();
    let dev = model.device().clone();
    let input = Tensor::new(ids.as_slice(), &dev)?.unsqueeze(0)?;
    println!(
        "B = 1 sequence, S = {s} tokens, D = {d} (n_embd), H = {h} heads, d_k = D/H = {dk}, V = {}",
        cfg.vocab_size
    );
    println!(
        "tokens: {:?}",
        common::token_texts(tokenizer.as_ref(), &ids)
    );
    println!(
        "input ids                               [B, S]        = {}",
        shape(&input)
    );
    let tok = model
        .wte()
        .index_select(&input.flatten_all()?, 0)?
        .unsqueeze(0)?;
    let pos = model.wpe().narrow(0, 0, s)?.unsqueeze(0)?;
    let mut xs = (&tok + &pos)?;
    println!(
        "token embedding wte[ids]                [B, S, D]     = {}",
        shape(&tok)
    );
    println!(
        "+ position embedding wpe[0..S]          [B, S, D]     = {}",
        shape(&xs)
    );
    let mask = mha::Mask::causal(0);
    for (i, block) in model.blocks().iter().enumerate() {
        let (ln_1, attn, ln_2, mlp) = block.parts();
        let show = a.layer.is_none_or(|l| l == i);
        let say = |what: &str, dims: &str, t: &Tensor| {
            if show {
                println!("  {what:<38}{dims:<14}= {}", shape(t));
            }
        };
        if show {
            println!("block {i}:");
        }
        let x_ln = ln_1.forward(&xs)?;
        say("ln_1(x)", "[B, S, D]", &x_ln);
        let [qp, kp, vp] = attn.qkv_proj();
        let (q, k, v) = (qp.forward(&x_ln)?, kp.forward(&x_ln)?, vp.forward(&x_ln)?);
        say("q = x·W_q (c_attn, first third)", "[B, S, D]", &q);
        let split = |t: &Tensor| t.reshape((1, s, h, dk));
        let q4 = split(&q)?;
        say("q split into heads", "[B, S, H, d_k]", &q4);
        let q = q4.transpose(1, 2)?.contiguous()?;
        let k = split(&k)?.transpose(1, 2)?.contiguous()?;
        let v = split(&v)?.transpose(1, 2)?.contiguous()?;
        say("q, k, v with heads first", "[B, H, S, d_k]", &q);
        let scale = attn.config().softmax_scale();
        let scores = (q.matmul(&k.t()?)? * scale)?;
        say(
            &format!("scores = q·kᵀ · {scale:.4}"),
            "[B, H, S, S]",
            &scores,
        );
        let bias = mask.to_bias((1, h, s, s), &dev)?;
        let scores = match bias {
            Some(b) => scores.broadcast_add(&b)?,
            None => scores,
        };
        let weights = mha::masked_softmax(&scores)?;
        say("causal mask, softmax over keys", "[B, H, S, S]", &weights);
        let per_head = weights.matmul(&v)?;
        say("weights·v", "[B, H, S, d_k]", &per_head);
        let merged = per_head.transpose(1, 2)?.reshape((1, s, d))?;
        say("heads merged back", "[B, S, D]", &merged);
        let projected = attn.out_proj().forward(&merged)?;
        say("output projection (c_proj)", "[B, S, D]", &projected);
        xs = (&xs + projected)?;
        say("x + attention (residual)", "[B, S, D]", &xs);
        let hid = ln_2.forward(&xs)?;
        say("ln_2(x)", "[B, S, D]", &hid);
        let [(_, fc), (_, proj)] = mlp.projections();
        let hid = fc.forward(&hid)?;
        say("MLP up (c_fc)", "[B, S, 4D]", &hid);
        let hid = cfg.activation_function.apply(&hid)?;
        say(
            &format!("{:?}", cfg.activation_function),
            "[B, S, 4D]",
            &hid,
        );
        let hid = proj.forward(&hid)?;
        say("MLP down (c_proj)", "[B, S, D]", &hid);
        xs = (&xs + hid)?;
        say("x + MLP (residual)", "[B, S, D]", &xs);
    }
    if let Some(ln_f) = model.ln_f() {
        xs = ln_f.forward(&xs)?;
        println!(
            "final LayerNorm ln_f                    [B, S, D]     = {}",
            shape(&xs)
        );
    }
    let logits = model.lm_head().forward(&xs)?;
    println!(
        "logits = x·wteᵀ (LM head)               [B, S, V]     = {}",
        shape(&logits)
    );
    let reference = model.infer(&input, None, None, block::Logits::All)?;
    let diff = (&logits - &reference)?
        .abs()?
        .max_all()?
        .to_scalar::<f32>()?;
    let next = logits
        .get(0)?
        .get(s - 1)?
        .argmax(D::Minus1)?
        .to_scalar::<u32>()?;
    println!("check: this trace equals the model's forward pass (max |difference| {diff:.2e})");
    println!(
        "most likely next token: {next} {:?}",
        common::token_texts(tokenizer.as_ref(), &[next])[0]
    );
    Ok(())
}
