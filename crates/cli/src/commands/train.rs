//! `gpt train`: train a small GPT on text files.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
// Batches and initialisation replay exactly after a resume.
use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use clap::{Args, ValueEnum};
use gpt_blocks::{
    save_dir_as, write_atomic, Activation, AdamW, AdamWParams, Family, Gpt, GptConfig, NormKind,
    SplitMix64 as Rng,
};
use serde::{Deserialize, Serialize};
use tokenizers::Tokenizer;

use crate::args::{self, DtypeArg, ModelArgs};
use crate::model;
use crate::plot;
use crate::text::gguf_tokenizer;

/// The architecture `gpt train` builds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Arch {
    /// GPT-2: learned positions, LayerNorm, a GELU MLP of 4 × the width, one fused q/k/v
    /// projection, biases everywhere (saved as `GPT2LMHeadModel`).
    #[default]
    Gpt2,
    /// Llama: rotary positions, RMSNorm, a SwiGLU MLP, grouped-query heads with
    /// --n-kv-head, no biases (saved as `LlamaForCausalLM`).
    Llama,
}

/// Options of `gpt train`.
#[derive(Debug, Clone, Args, Serialize, Deserialize)]
pub struct TrainArgs {
    /// Text files to train on (UTF-8).
    #[arg(long, num_args = 1.., required = true)]
    pub data: Vec<PathBuf>,
    /// Output directory: the best model as a Hugging Face directory, the last checkpoint
    /// (for --resume) in OUT/checkpoint, loss.csv and loss.png.
    #[arg(long)]
    pub out: PathBuf,
    /// A tokenizer.json to use; without it a byte-level BPE tokenizer is trained on the data.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Vocabulary size of the trained tokenizer.
    #[arg(long, default_value_t = 2048)]
    pub vocab_size: usize,
    /// The model's architecture.
    #[arg(long, value_enum, default_value = "gpt2")]
    #[serde(default)]
    pub arch: Arch,
    /// Number of blocks.
    #[arg(long, default_value_t = 4)]
    pub n_layer: usize,
    /// Attention heads per block.
    #[arg(long, default_value_t = 4)]
    pub n_head: usize,
    /// Key/value heads (grouped-query attention; --arch llama): must divide --n-head.
    /// Default: --n-head.
    #[arg(long)]
    #[serde(default)]
    pub n_kv_head: Option<usize>,
    /// Model width.
    #[arg(long, default_value_t = 128)]
    pub n_embd: usize,
    /// Hidden width of the MLP. Default: 4 × --n-embd for GPT-2; for Llama's gated MLP
    /// (three matrices, not two) 8/3 × --n-embd rounded up to a multiple of 32, the same
    /// parameter count.
    #[arg(long)]
    #[serde(default)]
    pub n_inner: Option<usize>,
    /// RoPE base (--arch llama).
    #[arg(long)]
    #[serde(default)]
    pub rope_theta: Option<f64>,
    /// Context length in tokens.
    #[arg(long, default_value_t = 128)]
    pub block_size: usize,
    /// Sequences per step.
    #[arg(long, default_value_t = 16)]
    pub batch_size: usize,
    /// Optimiser steps in all (a resumed run continues up to this count).
    #[arg(long, default_value_t = 1000)]
    pub steps: usize,
    /// Peak learning rate.
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,
    /// Linear warm-up steps, then cosine decay to lr/10.
    #[arg(long, default_value_t = 100)]
    pub warmup: usize,
    /// AdamW weight decay (matrices only).
    #[arg(long, default_value_t = 0.1)]
    pub weight_decay: f64,
    /// Dropout on embeddings, attention weights and residual branches.
    #[arg(long, default_value_t = 0.1)]
    pub dropout: f32,
    /// Clip the gradient's global norm to this.
    #[arg(long, default_value_t = 1.0)]
    pub grad_clip: f64,
    /// Validation loss (and checkpoint) every this many steps.
    #[arg(long, default_value_t = 100)]
    pub eval_every: usize,
    /// Batches averaged for the validation loss.
    #[arg(long, default_value_t = 8)]
    pub eval_batches: usize,
    /// Share of the tokens held out for validation (the end of the data).
    #[arg(long, default_value_t = 0.1)]
    pub val_fraction: f64,
    /// Seed of initialisation, batches and dropout.
    #[arg(long, default_value_t = 1337)]
    pub seed: u64,
    /// Continue the run saved in this directory (its OUT/checkpoint), whether it started
    /// from a new model or from --model's.
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Stop at this step with a checkpoint, as an interruption would (--resume continues
    /// with the same schedule).
    #[arg(long)]
    pub stop_after: Option<usize>,
    /// Precision of the saved best model (the resume checkpoint is always f32).
    #[arg(long, value_enum, default_value = "f32")]
    pub save_dtype: DtypeArg,
    /// Hide the progress bar (log lines instead).
    #[arg(long)]
    pub quiet: bool,
}

/// What a checkpoint needs besides weights and optimizer moments.
#[derive(Debug, Serialize, Deserialize)]
struct TrainState {
    step: usize,
    best_val: f64,
    rng: u64,
    config: GptConfig,
    /// The model's Hugging Face `config.json`, for architectures other than GPT-2 (whose
    /// parts `config` does not carry); `config` still gives the dropouts and the seed.
    #[serde(default)]
    hf_config: Option<String>,
    /// Masks drawn by each dropout ([`Gpt::dropouts`]), so that a resumed run draws the
    /// masks an uninterrupted one would. (Checkpoints written before it was recorded lack
    /// it; their runs resume with fresh counts.)
    #[serde(default)]
    dropout_calls: Vec<u64>,
}

/// GPT-2's initialisation, drawn from `seed` (Candle's CPU generator cannot be seeded):
/// N(0, 0.02) for matrices and the token embedding, N(0, 0.01) for positions, residual
/// projections (GPT-2's `c_proj`, Llama's `o_proj` and `down_proj`) scaled by
/// 1/sqrt(2·n_layer) as in GPT-2 and nanoGPT, norms 1 (and LayerNorm's bias 0), biases 0.
fn init_weights(vars: &[(String, candle_core::Var)], cfg: &GptConfig, seed: u64) -> Result<()> {
    let mut rng = Rng(seed ^ 0x1A17);
    let mut normal = |n: usize, std: f64| -> Vec<f32> {
        (0..n)
            .map(|_| {
                // Box-Muller on two uniforms in (0, 1].
                let u1 = (rng.below(1 << 24) as f64 + 1.0) / (1u64 << 24) as f64;
                let u2 = rng.below(1 << 24) as f64 / (1u64 << 24) as f64;
                (std * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
            })
            .collect()
    };
    let resid = 0.02 / (2.0 * cfg.n_layer as f64).sqrt();
    for (name, var) in vars {
        let n = var.elem_count();
        let values = if name.ends_with(".bias") {
            vec![0f32; n]
        } else if name.contains(".ln_") || name.contains("norm") {
            vec![1f32; n]
        } else if name.ends_with("wpe.weight") {
            normal(n, 0.01)
        } else if ["c_proj.weight", "o_proj.weight", "down_proj.weight"]
            .iter()
            .any(|p| name.ends_with(p))
        {
            normal(n, resid)
        } else {
            normal(n, 0.02)
        };
        var.set(&Tensor::from_vec(values, var.shape(), var.device())?)?;
    }
    Ok(())
}

/// The model a new run trains, from the command line.
fn new_config(a: &TrainArgs, vocab_size: usize, eot: Option<u32>) -> Result<GptConfig> {
    let base = GptConfig {
        vocab_size,
        n_positions: a.block_size,
        n_embd: a.n_embd,
        n_layer: a.n_layer,
        n_head: a.n_head,
        n_inner: a.n_inner,
        resid_pdrop: a.dropout,
        embd_pdrop: a.dropout,
        attn_pdrop: a.dropout,
        bos_token_id: eot,
        eos_token_id: eot,
        seed: a.seed,
        ..GptConfig::gpt2()
    };
    Ok(match a.arch {
        Arch::Gpt2 => {
            if a.n_kv_head.is_some() || a.rope_theta.is_some() {
                bail!("--n-kv-head and --rope-theta are for --arch llama (GPT-2 has neither)")
            }
            base
        }
        Arch::Llama => {
            let theta = a.rope_theta.unwrap_or(10_000.0);
            if !(theta > 1.0 && theta.is_finite()) {
                bail!("--rope-theta must be a finite number above 1, got {theta}")
            }
            let kv = a.n_kv_head.unwrap_or(a.n_head);
            if kv == 0 || !a.n_head.is_multiple_of(kv) {
                bail!("--n-kv-head {kv} must divide --n-head {}", a.n_head)
            }
            let inner = a
                .n_inner
                .unwrap_or_else(|| (8 * a.n_embd).div_ceil(3).next_multiple_of(32));
            GptConfig {
                family: Family::Llama,
                model_type: Some(Family::Llama.model_type().into()),
                n_kv_head: Some(kv),
                n_inner: Some(inner),
                activation_function: Activation::Silu,
                norm: NormKind::RmsNorm,
                layer_norm_epsilon: 1e-5,
                rope: Some(mha::RopeConfig {
                    theta,
                    ..Default::default()
                }),
                gated_mlp: true,
                attn_bias: false,
                attn_out_bias: false,
                mlp_bias: false,
                ..base
            }
        }
    })
}

/// The model a checkpoint holds: its Hugging Face config (other architectures than
/// GPT-2), with the dropouts and seed of the run.
fn resumed_config(s: &TrainState) -> Result<GptConfig> {
    let Some(json) = &s.hf_config else {
        return Ok(s.config.clone());
    };
    Ok(GptConfig {
        resid_pdrop: s.config.resid_pdrop,
        embd_pdrop: s.config.embd_pdrop,
        attn_pdrop: s.config.attn_pdrop,
        seed: s.config.seed,
        ..GptConfig::from_json(json)?
    })
}

/// Trains a byte-level BPE tokenizer on `files` (GPT-2's scheme, `<|endoftext|>` special).
pub fn train_tokenizer(files: &[PathBuf], vocab_size: usize) -> Result<Tokenizer> {
    use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
    use tokenizers::models::TrainerWrapper;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::AddedToken;

    if vocab_size < 257 {
        bail!("--vocab-size must be at least 257 (256 bytes + <|endoftext|>), got {vocab_size}")
    }
    let mut tokenizer = Tokenizer::new(BPE::default());
    let byte_level = ByteLevel::new(false, true, true);
    tokenizer
        .with_pre_tokenizer(Some(byte_level))
        .with_decoder(Some(byte_level))
        .with_post_processor(Some(byte_level));
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(2)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .special_tokens(vec![AddedToken::from("<|endoftext|>", true)])
        .build()
        .into();
    let names = files.iter().map(|f| f.display().to_string()).collect();
    tokenizer
        .train_from_files(&mut trainer, names)
        .map_err(|e| anyhow!("training the tokenizer: {e}"))?;
    Ok(tokenizer)
}

/// Reads and tokenizes the data; documents are separated by `<|endoftext|>` when the
/// tokenizer has it.
fn tokenize(files: &[PathBuf], tokenizer: &Tokenizer) -> Result<Vec<u32>> {
    let eot = tokenizer.token_to_id("<|endoftext|>");
    let mut ids = Vec::new();
    for f in files {
        let bytes = std::fs::read(f).with_context(|| format!("reading {}", f.display()))?;
        let text = String::from_utf8(bytes)
            .map_err(|e| anyhow!("{}: not UTF-8 text ({e})", f.display()))?;
        // Paragraph by paragraph keeps the tokenizer's work small and parallel.
        let parts: Vec<&str> = text.split_inclusive("\n\n").collect();
        let encs = tokenizer
            .encode_batch(parts, false)
            .map_err(|e| anyhow!("tokenizing {}: {e}", f.display()))?;
        for e in encs {
            ids.extend_from_slice(e.get_ids());
        }
        ids.extend(eot);
    }
    Ok(ids)
}

fn batch(data: &[u32], b: usize, t: usize, rng: &mut Rng, dev: &Device) -> Result<Tensor> {
    let mut rows = Vec::with_capacity(b * t);
    for _ in 0..b {
        let start = rng.below(data.len() - t + 1);
        rows.extend_from_slice(&data[start..start + t]);
    }
    Ok(Tensor::from_vec(rows, (b, t), dev)?)
}

fn lr_at(step: usize, a: &TrainArgs) -> f64 {
    let min_lr = a.lr / 10.0;
    if step < a.warmup {
        return a.lr * (step + 1) as f64 / a.warmup as f64;
    }
    let progress = (step - a.warmup) as f64 / (a.steps.saturating_sub(a.warmup)).max(1) as f64;
    min_lr + 0.5 * (a.lr - min_lr) * (1.0 + (std::f64::consts::PI * progress.min(1.0)).cos())
}

fn val_loss(model: &Gpt, data: &[u32], a: &TrainArgs, dev: &Device) -> Result<f64> {
    // The same batches at every evaluation, so the numbers compare.
    let mut rng = Rng(a.seed ^ 0xE7A1);
    let mut total = 0.0;
    for _ in 0..a.eval_batches {
        let x = batch(data, a.batch_size, a.block_size, &mut rng, dev)?;
        total += model.loss(&x, false)?.to_scalar::<f32>()? as f64;
    }
    Ok(total / a.eval_batches as f64)
}

/// Writes the resume checkpoint: a directory written beside the old one and swapped in.
fn save_checkpoint(out: &Path, model: &Gpt, opt: &AdamW, state: &TrainState) -> Result<()> {
    let dir = out.join("checkpoint");
    let tmp = out.join("checkpoint.tmp");
    let old = out.join("checkpoint.old");
    let _ = std::fs::remove_dir_all(&tmp);
    save_dir_as(model, &tmp, DType::F32)?;
    candle_core::safetensors::save(&opt.state()?, tmp.join("optimizer.safetensors"))?;
    std::fs::write(tmp.join("state.json"), serde_json::to_string_pretty(state)?)?;
    let _ = std::fs::remove_dir_all(&old);
    if dir.exists() {
        std::fs::rename(&dir, &old)?;
    }
    std::fs::rename(&tmp, &dir)?;
    let _ = std::fs::remove_dir_all(&old);
    Ok(())
}

/// The checkpoint to resume from: `checkpoint`, or `checkpoint.old` if a swap was cut short.
fn checkpoint_dir(run: &Path) -> Result<PathBuf> {
    for name in ["checkpoint", "checkpoint.old"] {
        let d = run.join(name);
        if d.join("state.json").is_file() {
            return Ok(d);
        }
    }
    bail!(
        "{}: no checkpoint to resume from (expected {0}/checkpoint/state.json)",
        run.display()
    )
}

/// Runs `gpt train`.
pub fn run(a: &TrainArgs, margs: &ModelArgs) -> Result<()> {
    if margs.quantize.is_some() {
        bail!("--quantize is for inference: quantized products have no gradient, so training needs full-precision weights")
    }
    // Silently ignoring them would train something other than what was asked for.
    if margs.dtype.is_some_and(|d| d != DtypeArg::F32) || margs.kv_dtype.is_some() {
        bail!("gpt train computes in f32 (--save-dtype sets the saved model's precision); --dtype and --kv-dtype are for inference")
    }
    let dev = args::device(margs.device)?;
    if a.block_size < 2
        || a.batch_size == 0
        || a.steps == 0
        || a.eval_every == 0
        || a.eval_batches == 0
    {
        bail!("--block-size must be >= 2 and --batch-size, --steps, --eval-every, --eval-batches >= 1")
    }
    if !(0.0 < a.val_fraction && a.val_fraction < 1.0) {
        bail!("--val-fraction must be in (0, 1), got {}", a.val_fraction)
    }
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let resume = match &a.resume {
        Some(run) => {
            let dir = checkpoint_dir(run)?;
            let state: TrainState =
                serde_json::from_str(&std::fs::read_to_string(dir.join("state.json"))?)
                    .with_context(|| format!("{}/state.json", dir.display()))?;
            Some((dir, state))
        }
        None => None,
    };
    // Fine-tuning: the model --model names, with its tokenizer (a resumed run has both in
    // its checkpoint).
    let base = match (&margs.model, &resume) {
        (Some(_), None) => {
            if a.tokenizer.is_some() {
                bail!("--tokenizer with --model: a model is fine-tuned with its own tokenizer")
            }
            let loaded = model::load(margs)?;
            let Some(tokenizer) = loaded.tokenizer else {
                bail!(
                    "{}: no tokenizer.json beside the model to fine-tune with",
                    loaded.source
                )
            };
            Some((loaded.model, tokenizer))
        }
        _ => None,
    };
    // A model's tokenizer is trained with and saved as a `tokenizer.json`, so that the
    // directory written is the model as trained (a GGUF file's SentencePiece vocabulary
    // becomes the `tokenizer.json` transformers writes for it).
    let tokenizer = match (&base, &a.tokenizer, &resume) {
        (Some((_, t)), _, _) => gguf_tokenizer::json_tokenizer(t)?,
        (None, Some(p), _) => model::read_tokenizer_json(p)?,
        (None, None, Some(_)) => {
            let p = a
                .resume
                .as_ref()
                .map(|r| r.join("tokenizer.json"))
                .unwrap_or_default();
            model::read_tokenizer_json(&p)?
        }
        (None, None, None) => train_tokenizer(&a.data, a.vocab_size)?,
    };
    tokenizer
        .save(a.out.join("tokenizer.json"), false)
        .map_err(|e| anyhow!("saving tokenizer.json: {e}"))?;
    let ids = tokenize(&a.data, &tokenizer)?;
    let n_val = ((ids.len() as f64) * a.val_fraction) as usize;
    let (train, val) = ids.split_at(ids.len() - n_val);
    if train.len() <= a.block_size || val.len() <= a.block_size {
        bail!(
            "{} tokens of data are too few for --block-size {} (train {}, validation {})",
            ids.len(),
            a.block_size,
            train.len(),
            val.len()
        )
    }
    let eot = tokenizer.token_to_id("<|endoftext|>");
    let cfg = match &resume {
        Some((dir, s)) => {
            resumed_config(s).with_context(|| format!("{}/state.json", dir.display()))?
        }
        None => match &base {
            Some((model, _)) => {
                let cfg = GptConfig {
                    resid_pdrop: a.dropout,
                    embd_pdrop: a.dropout,
                    attn_pdrop: a.dropout,
                    seed: a.seed,
                    ..model.config().clone()
                };
                if a.block_size > cfg.n_positions {
                    bail!(
                        "--block-size {} exceeds the model's context of {} tokens",
                        a.block_size,
                        cfg.n_positions
                    )
                }
                // Refused before training rather than at the first save.
                cfg.to_json()?;
                cfg
            }
            None => new_config(a, tokenizer.get_vocab_size(true), eot)?,
        },
    };
    cfg.validate()?;
    let arch_family = match a.arch {
        Arch::Gpt2 => Family::Gpt2,
        Arch::Llama => Family::Llama,
    };
    // A fine-tuned model's architecture is its own, whatever --arch says.
    if cfg.family != arch_family && margs.model.is_none() {
        bail!(
            "the checkpoint holds a {} model; resume it with --arch {}",
            cfg.family.model_type(),
            cfg.family.model_type()
        )
    }
    let varmap = VarMap::new();
    let model = Gpt::new(&cfg, VarBuilder::from_varmap(&varmap, DType::F32, &dev))?;
    let named: Vec<(String, candle_core::Var)> = {
        let data = varmap
            .data()
            .lock()
            .map_err(|_| anyhow!("variable map poisoned"))?;
        let mut v: Vec<_> = data.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        v.sort_by(|x, y| x.0.cmp(&y.0));
        v
    };
    let mut opt = AdamW::new(
        named.clone(),
        AdamWParams {
            lr: a.lr,
            weight_decay: a.weight_decay,
            ..Default::default()
        },
    )?;
    // The same weights without gradient tracking (the tensors share storage with the
    // variables, so they see every update): evaluating through the variables would build
    // the autograd graph of a whole forward pass for nothing, and take the training paths.
    let eval_model = {
        let detached = named
            .iter()
            .map(|(name, var)| (name.clone(), var.as_detached_tensor()))
            .collect();
        Gpt::new(&cfg, VarBuilder::from_tensors(detached, DType::F32, &dev))?
    };
    let (mut step, mut best_val, mut rng) = (0, f64::INFINITY, Rng(a.seed));
    match base {
        Some((model, _)) => {
            let weights = gpt_blocks::parts_of_stored(&cfg, model.named_tensors()?)?;
            for (name, var) in &named {
                let t = weights
                    .get(name)
                    .ok_or_else(|| anyhow!("the model to fine-tune lacks {name}"))?;
                var.set(&t.to_dtype(DType::F32)?.to_device(&dev)?)?;
            }
        }
        None => init_weights(&named, &cfg, a.seed)?,
    }
    if let Some((dir, state)) = &resume {
        let weights = gpt_blocks::parts_of_stored(
            &cfg,
            candle_core::safetensors::load(dir.join("model.safetensors"), &dev)?,
        )?;
        for (name, var) in &named {
            let t = weights
                .get(name)
                .ok_or_else(|| anyhow!("{}: checkpoint lacks {name}", dir.display()))?;
            var.set(&t.to_dtype(DType::F32)?)?;
        }
        opt.load_state(&candle_core::safetensors::load(
            dir.join("optimizer.safetensors"),
            &dev,
        )?)?;
        (step, best_val, rng) = (state.step, state.best_val, Rng(state.rng));
        let dropouts = model.dropouts();
        match state.dropout_calls.len() {
            0 => {}
            n if n == dropouts.len() => {
                for (d, &calls) in dropouts.iter().zip(&state.dropout_calls) {
                    d.set_calls(calls);
                }
            }
            n => bail!(
                "{}/state.json: {n} dropout counts for a model with {} dropouts",
                dir.display(),
                dropouts.len()
            ),
        }
        eprintln!(
            "resuming {} at step {step} (best validation loss {best_val:.4})",
            dir.display()
        );
    }
    let n_params: usize = named.iter().map(|(_, v)| v.elem_count()).sum();
    eprintln!(
        "{n_params} parameters; {} training and {} validation tokens; vocabulary {}",
        train.len(),
        val.len(),
        cfg.vocab_size
    );
    let csv_path = a.out.join("loss.csv");
    let mut csv = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&csv_path)?;
    if step == 0 {
        csv.set_len(0)?;
        writeln!(csv, "step,train_loss,val_loss,lr,tokens_per_s,elapsed_s")?;
    }
    let bar = if a.quiet {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::new(a.steps as u64)
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:30} {pos}/{len} {msg} [{elapsed_precise} < {eta_precise}]",
        )
        .map_err(|e| anyhow!("{e}"))?,
    );
    bar.set_position(step as u64);
    let started = Instant::now();
    let tokens_per_step = (a.batch_size * a.block_size) as f64;
    let mut smoothed = None::<f64>;
    let mut last_val = f64::NAN;
    let last_step = a.stop_after.unwrap_or(a.steps).min(a.steps);
    // Seconds of each optimiser step (forward, backward, update), evaluations excluded.
    let mut step_secs = Vec::new();
    while step < last_step {
        let t0 = Instant::now();
        let lr = lr_at(step, a);
        opt.set_lr(lr);
        let x = batch(train, a.batch_size, a.block_size, &mut rng, &dev)?;
        // The step's graph and gradients are dropped before an evaluation runs.
        let loss_v = {
            let loss = model.loss(&x, true)?;
            let loss_v = loss.to_scalar::<f32>()? as f64;
            if !loss_v.is_finite() {
                bail!("the training loss became {loss_v} at step {step}; try a lower --lr")
            }
            let mut grads = loss.backward()?;
            drop(loss);
            opt.clip_grad_norm(&mut grads, a.grad_clip)?;
            opt.step(&grads)?;
            loss_v
        };
        step += 1;
        step_secs.push(t0.elapsed().as_secs_f64());
        let tok_s = tokens_per_step / t0.elapsed().as_secs_f64();
        smoothed = Some(smoothed.map_or(loss_v, |s| 0.9 * s + 0.1 * loss_v));
        let eval_now = step % a.eval_every == 0 || step == last_step;
        if eval_now {
            last_val = val_loss(&eval_model, val, a, &dev)?;
            writeln!(
                csv,
                "{step},{:.5},{last_val:.5},{lr:.6e},{tok_s:.0},{:.1}",
                smoothed.unwrap_or(loss_v),
                started.elapsed().as_secs_f64()
            )?;
            csv.flush()?;
            if last_val < best_val {
                best_val = last_val;
                save_dir_as(&model, &a.out, a.save_dtype.into())?;
            }
            let state = TrainState {
                step,
                best_val,
                rng: rng.0,
                config: cfg.clone(),
                hf_config: (cfg.family != Family::Gpt2)
                    .then(|| cfg.to_json())
                    .transpose()?,
                dropout_calls: model.dropouts().iter().map(|d| d.calls()).collect(),
            };
            save_checkpoint(&a.out, &model, &opt, &state)?;
            if a.quiet {
                eprintln!(
                    "step {step}: train {:.4} val {last_val:.4} ({tok_s:.0} tok/s)",
                    smoothed.unwrap_or(loss_v)
                );
            }
        }
        bar.set_message(format!(
            "loss {:.4} val {last_val:.4} {tok_s:.0} tok/s",
            smoothed.unwrap_or(loss_v)
        ));
        bar.set_position(step as u64);
    }
    bar.finish();
    // The first step pays for first-touch page faults and the allocator's growth.
    if step_secs.len() >= 2 {
        let secs: f64 = step_secs[1..].iter().sum();
        eprintln!(
            "{} steps: {:.0} tokens/s on average (the first step excluded)",
            step_secs.len(),
            tokens_per_step * (step_secs.len() - 1) as f64 / secs
        );
    }
    let rows = read_loss_csv(&csv_path)?;
    plot::loss_curve(&rows, &a.out.join("loss.png"))?;
    write_atomic(&a.out.join("train_args.json"), |p| {
        std::fs::write(p, serde_json::to_string_pretty(a).unwrap_or_default())
            .map_err(candle_core::Error::wrap)
    })?;
    eprintln!(
        "done: best validation loss {best_val:.4}; model in {}, curve in {}",
        a.out.display(),
        a.out.join("loss.png").display()
    );
    Ok(())
}

/// `(step, train, val)` rows of a loss.csv.
pub fn read_loss_csv(path: &Path) -> Result<Vec<(f64, f64, f64)>> {
    let text = std::fs::read_to_string(path)?;
    let mut rows = Vec::new();
    for line in text.lines().skip(1) {
        let f: Vec<f64> = line.split(',').filter_map(|x| x.parse().ok()).collect();
        if f.len() >= 3 {
            rows.push((f[0], f[1], f[2]));
        }
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: TrainArgs,
    }

    /// Each tensor of a new model gets its part's initialisation, whatever the names.
    #[test]
    fn initialisation_follows_the_parts_in_both_architectures() -> Result<()> {
        for arch in ["gpt2", "llama"] {
            let cli = Cli::parse_from([
                "train",
                "--data",
                "x",
                "--out",
                "y",
                "--arch",
                arch,
                "--n-layer",
                "2",
                "--n-embd",
                "64",
                "--n-head",
                "4",
            ]);
            let cfg = new_config(&cli.args, 512, Some(0))?;
            let varmap = VarMap::new();
            Gpt::new(
                &cfg,
                VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
            )?;
            let named: Vec<_> = varmap
                .data()
                .lock()
                .map_err(|_| anyhow!("poisoned"))?
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            init_weights(&named, &cfg, 7)?;
            let resid = 0.02 / 4f64.sqrt(); // 0.02 / sqrt(2 · n_layer)
            let (mut norms, mut resids) = (0, 0);
            for (name, var) in &named {
                let v: Vec<f32> = var.as_tensor().flatten_all()?.to_vec1()?;
                let n = v.len() as f64;
                let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
                let std = (v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n).sqrt();
                let is_norm = name.contains("norm") || name.contains(".ln_");
                if name.ends_with(".bias") {
                    assert!(v.iter().all(|&x| x == 0.0), "{arch}: {name}");
                } else if is_norm {
                    assert!(v.iter().all(|&x| x == 1.0), "{arch}: {name}");
                    norms += 1;
                } else {
                    let want = if ["c_proj.weight", "o_proj.weight", "down_proj.weight"]
                        .iter()
                        .any(|p| name.ends_with(p))
                    {
                        resids += 1;
                        resid
                    } else if name.ends_with("wpe.weight") {
                        0.01
                    } else {
                        0.02
                    };
                    assert!(
                        (std / want - 1.0).abs() < 0.1,
                        "{arch}: {name} std {std} vs {want}"
                    );
                }
            }
            // Two norms per block and the final one; two residual projections per block.
            assert_eq!((norms, resids), (5, 4), "{arch}");
        }
        Ok(())
    }
}
