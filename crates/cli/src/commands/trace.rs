//! `gpt trace`: one forward pass, step by step, with every tensor's shape.

use anyhow::{bail, Result};
use candle_core::{Tensor, D};
use clap::Args;
use gpt_blocks::NormPlacement;

use crate::args::{ModelArgs, PromptArgs};
use crate::model::{self, Loaded};
use crate::tokens;

/// Options of `gpt trace`.
#[derive(Debug, Clone, Args)]
pub struct TraceArgs {
    #[command(flatten)]
    pub prompt: PromptArgs,
    /// Show the inside of this block only (all blocks when absent).
    #[arg(long)]
    pub layer: Option<usize>,
}

/// `s` padded to `width` characters, or followed by one space where it is longer, so that
/// the next column never runs into it.
fn column(s: &str, width: usize) -> String {
    match s.chars().count() < width {
        true => format!("{s:<width$}"),
        false => format!("{s} "),
    }
}

fn shape(t: &Tensor) -> String {
    format!("{:?}", t.dims())
}

/// Runs `gpt trace`.
pub fn run(a: &TraceArgs, margs: &ModelArgs) -> Result<()> {
    let Loaded {
        model, tokenizer, ..
    } = model::load(margs)?;
    let cfg = model.config().clone();
    if cfg.norm_placement == NormPlacement::Post {
        bail!("trace follows blocks with a final norm; this model is post-norm (GPT-2's ln(x + f(x)))")
    }
    let ids = a.prompt.ids(tokenizer.as_ref())?;
    if ids.is_empty() || ids.len() > cfg.n_positions {
        bail!(
            "the prompt must have 1..={} tokens, got {}",
            cfg.n_positions,
            ids.len()
        )
    }
    tokens::check_ids(&ids, &model)?;
    if let Some(l) = a.layer {
        if l >= cfg.n_layer {
            bail!(
                "--layer {l} does not exist: the model has layers 0..{}",
                cfg.n_layer - 1
            )
        }
    }
    let (h, hk, d, f) = (cfg.n_head, cfg.kv_heads(), cfg.n_embd, cfg.inner_dim());
    let dk = cfg.head_dim();
    let s = ids.len();
    let dev = model.device().clone();
    let input = Tensor::new(ids.as_slice(), &dev)?.unsqueeze(0)?;
    let kv_note = if hk == h {
        String::new()
    } else {
        format!(", H_kv = {hk} key/value heads")
    };
    println!(
        "B = 1 sequence, S = {s} tokens, D = {d} (n_embd), H = {h} heads, d_k = {dk}{}{kv_note}, F = {f} (MLP), V = {}",
        if dk * h == d { " = D/H" } else { " (head_dim; H·d_k ≠ D)" },
        cfg.vocab_size
    );
    println!(
        "tokens: {:?}",
        tokens::token_texts(tokenizer.as_ref(), &ids)
    );
    println!(
        "input ids                               [B, S]           = {}",
        shape(&input)
    );
    let mut xs = model
        .wte()?
        .index_select(&input.flatten_all()?, 0)?
        .unsqueeze(0)?;
    println!(
        "token embedding E[ids]                  [B, S, D]        = {}",
        shape(&xs)
    );
    if cfg.embedding_multiplier != 1.0 {
        xs = xs.affine(cfg.embedding_multiplier, 0.0)?;
        println!(
            "{}[B, S, D]        = {}",
            column(
                &format!("· embedding multiplier {}", cfg.embedding_multiplier as f32),
                40
            ),
            shape(&xs)
        );
    }
    match model.wpe() {
        Some(wpe) => {
            xs = (&xs + wpe.narrow(0, 0, s)?.unsqueeze(0)?)?;
            println!(
                "+ position embedding wpe[0..S]          [B, S, D]        = {}",
                shape(&xs)
            );
        }
        None if (0..cfg.n_layer).all(|i| cfg.layer_rope(i).is_some()) => {
            println!("positions: rotary, applied to q and k in every block")
        }
        None => println!("positions: rotary, applied to q and k in the blocks that rotate"),
    }
    let rope = model.rope_tables(&Tensor::arange(0u32, s as u32, &dev)?.unsqueeze(0)?)?;
    for (i, block) in model.blocks().iter().enumerate() {
        let (ln_1, mixer, ln_2, mlp) = block.parts();
        let show = a.layer.is_none_or(|l| l == i);
        let say = |what: &str, dims: &str, t: &Tensor| {
            if show {
                println!("  {}{}= {}", column(what, 38), column(dims, 17), shape(t));
            }
        };
        if show {
            println!("block {i}:");
        }
        // OLMo 2 normalises the branches' outputs only; the others their inputs.
        let post_branch = cfg.norm_placement == NormPlacement::PostBranch;
        let x_ln = match post_branch {
            true => xs.clone(),
            false => {
                let x_ln = ln_1.forward(&xs)?;
                say(&format!("{}(x)", cfg.norm_name()), "[B, S, D]", &x_ln);
                x_ln
            }
        };
        let mut projected = match mixer {
            gpt_blocks::Mixer::ShortConv(conv) => short_conv(conv, &x_ln, &say)?,
            gpt_blocks::Mixer::Attention(attn) => {
                let [qp, kp, vp] = attn.qkv_proj();
                let (q, k, v) = (qp.forward(&x_ln)?, kp.forward(&x_ln)?, vp.forward(&x_ln)?);
                say("q = x·W_q", "[B, S, H·d_k]", &q);
                if hk != h {
                    say("k = x·W_k, v = x·W_v", "[B, S, H_kv·d_k]", &k);
                }
                let (q, k) = match attn.qk_norm() {
                    Some((qw, _)) => {
                        let (q, k) = attn.normalize_qk(&q, &k)?;
                        let over = match qw.dim(0)? == dk {
                            true => "each head",
                            false => "the whole projection",
                        };
                        say(&format!("q, k RMSNorm over {over}"), "[B, S, H·d_k]", &q);
                        (q, k)
                    }
                    None => (q, k),
                };
                let q4 = q.reshape((1, s, h, dk))?;
                say("q split into heads", "[B, S, H, d_k]", &q4);
                let q = q4.transpose(1, 2)?.contiguous()?;
                let k = k.reshape((1, s, hk, dk))?.transpose(1, 2)?.contiguous()?;
                let v = v.reshape((1, s, hk, dk))?.transpose(1, 2)?.contiguous()?;
                say("q, k, v with heads first", "[B, H, S, d_k]", &q);
                let (q, k) = match (attn.rope(), rope.get(attn.rope())) {
                    (Some(r), Some(tables)) => {
                        let (q, k) = (r.apply(&q, tables)?, r.apply(&k, tables)?);
                        let what = format!("q, k rotated (RoPE, {} of {dk} dims)", r.rotary_dim());
                        say(&what, "[B, H, S, d_k]", &q);
                        (q, k)
                    }
                    (None, _) if !rope.is_empty() => {
                        if show {
                            println!("  no rotation in this block (NoPE)");
                        }
                        (q, k)
                    }
                    _ => (q, k),
                };
                let (k, v) = (mha::repeat_kv(&k, h / hk)?, mha::repeat_kv(&v, h / hk)?);
                if hk != h {
                    say("k, v shared by groups of heads", "[B, H, S, d_k]", &k);
                }
                let scale = attn.config().softmax_scale();
                let scores = (q.matmul(&k.t()?)? * scale)?;
                say(
                    &format!("scores = q·kᵀ · {scale:.4}"),
                    "[B, H, S, S]",
                    &scores,
                );
                let scores = match attn.config().softcap {
                    Some(cap) => {
                        let capped = ((scores / cap)?.tanh()? * cap)?;
                        say(
                            &format!("soft cap: {cap}·tanh(scores / {cap})"),
                            "[B, H, S, S]",
                            &capped,
                        );
                        capped
                    }
                    None => scores,
                };
                let window = attn.config().window;
                let mask = mha::Mask {
                    window,
                    ..mha::Mask::causal(0)
                };
                let bias = mask.to_bias((1, h, s, s), &dev)?;
                let scores = match bias {
                    Some(b) => scores.broadcast_add(&b)?,
                    None => scores,
                };
                let weights = mha::masked_softmax(&scores)?;
                let what = match window {
                    Some(w) => format!("causal mask (window {w}), softmax"),
                    None => "causal mask, softmax over keys".to_string(),
                };
                say(&what, "[B, H, S, S]", &weights);
                let per_head = weights.matmul(&v)?;
                say("weights·v", "[B, H, S, d_k]", &per_head);
                let merged = per_head.transpose(1, 2)?.reshape((1, s, h * dk))?;
                say("heads merged back", "[B, S, H·d_k]", &merged);
                let projected = attn.out_proj().forward(&merged)?;
                say("output projection (W_o)", "[B, S, D]", &projected);
                projected
            }
        };
        let post = block.post_norms();
        let branch_norm = match (post_branch, post) {
            (true, _) => Some(ln_1),
            (false, Some((post_attn, _))) => Some(post_attn),
            _ => None,
        };
        if let Some(n) = branch_norm {
            projected = n.forward(&projected)?;
            say(
                &format!("{} of the output", cfg.norm_name()),
                "[B, S, D]",
                &projected,
            );
        }
        let m = cfg.residual_multiplier;
        if m != 1.0 {
            projected = projected.affine(m, 0.0)?;
            say(
                &format!("· residual multiplier {m}"),
                "[B, S, D]",
                &projected,
            );
        }
        // Parallel blocks feed the MLP the block's input, not the attention's output.
        let mlp_in = if block.is_parallel() {
            xs.clone()
        } else {
            xs = (&xs + &projected)?;
            let what = match mixer.attention() {
                Some(_) => "x + attention (residual)",
                None => "x + convolution (residual)",
            };
            say(what, "[B, S, D]", &xs);
            xs.clone()
        };
        let hid = match post_branch {
            true => mlp_in,
            false => {
                let hid = ln_2.forward(&mlp_in)?;
                say(&format!("{}(x)", cfg.norm_name()), "[B, S, D]", &hid);
                hid
            }
        };
        let (projections, _) = mlp.projections();
        let act = mlp.activation();
        let hid = match projections.as_slice() {
            [(gn, gate), (un, up), _] => {
                let g = act.apply(&gate.forward(&hid)?)?;
                say(&format!("{act:?}({gn}(x))"), "[B, S, F]", &g);
                let u = up.forward(&hid)?;
                say(&format!("{un}(x)"), "[B, S, F]", &u);
                let prod = (g * u)?;
                say("gate · up", "[B, S, F]", &prod);
                prod
            }
            [(un, up), _] => {
                let u = up.forward(&hid)?;
                say(&format!("MLP up ({un})"), "[B, S, F]", &u);
                let u = act.apply(&u)?;
                say(&format!("{act:?}"), "[B, S, F]", &u);
                u
            }
            _ => bail!("an MLP with {} projections", projections.len()),
        };
        let down = projections.last().map(|p| p.1);
        let Some(down) = down else {
            bail!("an MLP without projections")
        };
        let mut hid = down.forward(&hid)?;
        say(
            &format!("MLP down ({})", projections[projections.len() - 1].0),
            "[B, S, D]",
            &hid,
        );
        let branch_norm = match (post_branch, post) {
            (true, _) => Some(ln_2),
            (false, Some((_, post_mlp))) => Some(post_mlp),
            _ => None,
        };
        if let Some(n) = branch_norm {
            hid = n.forward(&hid)?;
            say(
                &format!("{} of the output", cfg.norm_name()),
                "[B, S, D]",
                &hid,
            );
        }
        if m != 1.0 {
            hid = hid.affine(m, 0.0)?;
            say(&format!("· residual multiplier {m}"), "[B, S, D]", &hid);
        }
        if block.is_parallel() {
            xs = ((&xs + projected)? + hid)?;
            say("x + attention + MLP (parallel)", "[B, S, D]", &xs);
        } else {
            xs = (&xs + hid)?;
            say("x + MLP (residual)", "[B, S, D]", &xs);
        }
    }
    if let Some(ln_f) = model.ln_f() {
        xs = ln_f.forward(&xs)?;
        println!(
            "final {:<34}[B, S, D]        = {}",
            cfg.norm_name(),
            shape(&xs)
        );
    }
    let mut logits = model.lm_head().forward(&xs)?;
    println!(
        "logits = x·W_headᵀ (LM head)            [B, S, V]        = {}",
        shape(&logits)
    );
    if cfg.logits_scaling != 1.0 {
        logits = logits.affine(1.0 / cfg.logits_scaling, 0.0)?;
        println!(
            "{}[B, S, V]        = {}",
            column(&format!("/ logits scaling {}", cfg.logits_scaling), 40),
            shape(&logits)
        );
    }
    if let Some(cap) = cfg.final_logit_softcapping {
        logits = gpt_blocks::softcap(&logits, cap)?;
        println!(
            "{}[B, S, V]        = {}",
            column(&format!("soft cap: {cap}·tanh(logits / {cap})"), 40),
            shape(&logits)
        );
    }
    let reference = model.infer(&input, None, None, gpt_blocks::Logits::All)?;
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
        tokens::token_texts(tokenizer.as_ref(), &[next])[0]
    );
    Ok(())
}

/// The steps of LFM2's gated short convolution on `x` (`[B, S, D]`), each shown by `say`.
fn short_conv(
    conv: &gpt_blocks::ShortConv,
    x: &Tensor,
    say: &dyn Fn(&str, &str, &Tensor),
) -> Result<Tensor> {
    let (in_proj, taps, bias, out_proj) = conv.parts();
    let (_, s, d) = x.dims3()?;
    let bcx = in_proj.forward(x)?;
    say("B, C, x = x·W_in (split in three)", "[B, S, 3·D]", &bcx);
    let (b, c, xv) = (
        bcx.narrow(2, 0, d)?,
        bcx.narrow(2, d, d)?,
        bcx.narrow(2, 2 * d, d)?,
    );
    let h = (b * xv)?;
    say("h = B · x", "[B, S, D]", &h);
    let l = taps.dim(1)?;
    let padded = Tensor::cat(
        &[&Tensor::zeros((1, l - 1, d), h.dtype(), h.device())?, &h],
        1,
    )?;
    let mut y = Tensor::zeros((1, s, d), h.dtype(), h.device())?;
    for j in 0..l {
        let w = taps.narrow(1, j, 1)?.squeeze(1)?.to_dtype(h.dtype())?;
        y = (y + padded.narrow(1, j, s)?.broadcast_mul(&w)?)?;
    }
    if let Some(bias) = bias {
        y = y.broadcast_add(bias)?;
    }
    say(
        &format!("causal depthwise conv over {l} positions"),
        "[B, S, D]",
        &y,
    );
    let gated = (c * y)?;
    say("C · conv(h)", "[B, S, D]", &gated);
    let out = out_proj.forward(&gated)?;
    say("output projection (W_out)", "[B, S, D]", &out);
    Ok(out)
}
