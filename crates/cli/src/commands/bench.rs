//! `gpt bench`: prefill and decode speed, and peak memory.

use std::time::Instant;

use anyhow::{bail, Result};
use candle_core::Tensor;
use clap::Args;
use gpt_blocks::{argmax, Logits};

use crate::args::{Format, ModelArgs};
use crate::model::{self, Loaded};

/// Options of `gpt bench`.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 128)]
    pub prompt_len: usize,
    /// Tokens to decode after the prompt (greedy, with the KV cache).
    #[arg(long, default_value_t = 64)]
    pub new_tokens: usize,
    /// Sequences run together.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Timed repetitions; the median is reported.
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Also measure the memory-read floor (CPU only): after each decoding step, read a
    /// 256 MiB buffer on the decoding threads, and report that rate beside decoding's. Both
    /// then see the same machine, where a floor measured before or after the run may not
    /// (a shared machine's memory rate moves by seconds). What the reads evict from the
    /// caches slows decoding a little; the peak memory reported is the untimed first run's,
    /// before the buffer.
    #[arg(long)]
    pub read_floor: bool,
    /// Output format.
    #[arg(long, value_enum, default_value = "text")]
    pub format: Format,
}

/// Peak resident memory of this process (Linux), in bytes.
fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The greedy token of each row of `logits` `[b, 1, vocab]`, read where the model left
/// them, as `generate` reads them.
fn greedy(logits: &Tensor) -> Result<Vec<u32>> {
    let b = logits.dim(0)?;
    gpt_kernels::dense::with_f32_values(logits, |all| {
        Ok(all.chunks(all.len() / b.max(1)).map(argmax).collect())
    })
    .map_err(Into::into)
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// Runs `gpt bench`.
pub fn run(a: &BenchArgs, margs: &ModelArgs) -> Result<()> {
    let Loaded { model, source, .. } = model::load_for_inference(margs)?;
    let cfg = model.config();
    if a.prompt_len == 0 || a.batch == 0 || a.runs == 0 {
        bail!("--prompt-len, --batch and --runs must be at least 1")
    }
    if a.prompt_len + a.new_tokens > cfg.n_positions {
        bail!(
            "--prompt-len {} + --new-tokens {} exceed the model's context of {}",
            a.prompt_len,
            a.new_tokens,
            cfg.n_positions
        )
    }
    let dev = model.device().clone();
    if a.read_floor && !dev.is_cpu() {
        bail!("--read-floor measures the CPU's memory, and the model runs on {dev:?}")
    }
    // A fixed pseudo-random prompt.
    let ids: Vec<u32> = (0..a.batch * a.prompt_len)
        .map(|i| ((i as u64 * 2_654_435_761) % cfg.vocab_size as u64) as u32)
        .collect();
    let prompt = Tensor::from_vec(ids, (a.batch, a.prompt_len), &dev)?;
    let mut prefill = Vec::new();
    let mut decode = Vec::new();
    // Seconds of the timed runs' decoding in projections, in attention steps and in all,
    // where the `profile` feature times them.
    let mut split: Option<[f64; 3]> = None;
    // With --read-floor: the buffer (made after the untimed run), the peak memory before it,
    // and the timed runs' seconds spent reading it.
    let mut floor: Option<(gpt_kernels::floor::ReadFloor, Option<u64>)> = None;
    let mut floor_reads = std::time::Duration::ZERO;
    // One untimed run warms caches and the thread pool.
    for run in 0..=a.runs {
        if a.read_floor && run == 1 {
            let rss = peak_rss_bytes();
            floor = Some((gpt_kernels::floor::ReadFloor::new(), rss));
        }
        let mut cache = model.new_cache(a.prompt_len + a.new_tokens);
        let t0 = Instant::now();
        let logits = model.infer(&prompt, None, Some(&mut cache), Logits::Last)?;
        let mut next = greedy(&logits)?;
        // As `generate` does after its prefill (counted in the prefill's time).
        crate::alloc::release_freed_memory();
        let t1 = Instant::now();
        // (The prefill's parts.)
        gpt_kernels::profile::take();
        // The floor's reads in this run, left out of decoding's time.
        let mut reads = std::time::Duration::ZERO;
        for _ in 0..a.new_tokens {
            let input = Tensor::from_vec(next, (a.batch, 1), &dev)?;
            let logits = model.infer(&input, None, Some(&mut cache), Logits::Last)?;
            next = greedy(&logits)?;
            if let Some((f, _)) = &floor {
                reads += f.read();
            }
        }
        floor_reads += reads;
        let t2 = Instant::now() - reads;
        let parts = gpt_kernels::profile::take();
        if let (Some([(_, products, _), (_, attention, _)]), true) = (parts, run > 0) {
            let s = split.get_or_insert([0.0; 3]);
            s[0] += products.as_secs_f64();
            s[1] += attention.as_secs_f64();
            s[2] += (t2 - t1).as_secs_f64();
        }
        if run > 0 {
            prefill.push((a.batch * a.prompt_len) as f64 / (t1 - t0).as_secs_f64());
            if a.new_tokens > 0 {
                decode.push((a.batch * a.new_tokens) as f64 / (t2 - t1).as_secs_f64());
            }
        }
    }
    let prefill = median(prefill);
    let decode = if decode.is_empty() {
        0.0
    } else {
        median(decode)
    };
    let rss = match &floor {
        Some((_, before)) => *before,
        None => peak_rss_bytes(),
    };
    // Bytes per second of the floor's reads, where decoding ran.
    let read_rate = floor
        .as_ref()
        .filter(|_| a.new_tokens > 0)
        .map(|(f, _)| (f.bytes() * a.runs * a.new_tokens) as f64 / floor_reads.as_secs_f64());
    let threads = candle_core::utils::get_num_threads();
    // Milliseconds per decoding step: projections, attention, the rest.
    let steps = (a.runs * a.new_tokens).max(1) as f64;
    let split = split.map(|[p, at, all]| [p, at, all - p - at].map(|s| s * 1e3 / steps));
    match a.format {
        Format::Json => {
            let mut out = serde_json::json!({
                "model": source,
                "device": format!("{:?}", dev.location()),
                "dtype": format!("{:?}", model.dtype()).to_lowercase(),
                "threads": threads,
                "batch": a.batch,
                "prompt_len": a.prompt_len,
                "new_tokens": a.new_tokens,
                "runs": a.runs,
                "prefill_tokens_per_s": prefill,
                "decode_tokens_per_s": decode,
                "peak_rss_bytes": rss,
            });
            if let Some(rate) = read_rate {
                out["read_floor_bytes_per_s"] = serde_json::json!(rate);
            }
            if let Some([products, attention, rest]) = split {
                out["decode_ms_per_step"] = serde_json::json!({
                    "projections": products,
                    "attention": attention,
                    "rest": rest,
                });
            }
            println!("{out}")
        }
        Format::Text => {
            println!(
                "{source}: batch {}, prompt {} tokens, {} new tokens, {threads} threads (median of {} runs)",
                a.batch, a.prompt_len, a.new_tokens, a.runs
            );
            println!("prefill: {prefill:.1} tokens/s");
            println!("decode:  {decode:.1} tokens/s");
            if let Some(rate) = read_rate {
                println!("read floor: {:.1} GB/s between decoding steps", rate / 1e9);
            }
            if let Some([products, attention, rest]) = split {
                println!(
                    "decoding step: {products:.3} ms in projections, {attention:.3} ms in attention, {rest:.3} ms the rest"
                );
            }
            if let Some(r) = rss {
                println!("peak memory: {:.1} MiB", r as f64 / (1024.0 * 1024.0));
            }
        }
    }
    Ok(())
}
