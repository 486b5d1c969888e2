//! Loads a GPT-2 or Llama checkpoint (a Hugging Face directory or a nanoGPT `ckpt.pt`), writes it
//! back as a Hugging Face directory, and records our logits beside it, so that
//! `scripts/hf_roundtrip.py` can check that transformers reads the same model.
//!
//! `cargo run -p gpt-blocks --example resave -- SRC OUT`

use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use gpt_blocks::{load, save_dir, Logits};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let [_, src, out] = args.as_slice() else {
        bail!("usage: resave SRC OUT")
    };
    let (src, out) = (Path::new(src), Path::new(out));
    let model = load(src, DType::F32, &Device::Cpu)
        .with_context(|| format!("loading {}", src.display()))?;
    save_dir(&model, out)?;
    let cfg = model.config();
    let t = cfg.n_positions.min(16);
    let ids: Vec<u32> = (0..2 * t)
        .map(|i| ((i * 7 + 3) % cfg.vocab_size) as u32)
        .collect();
    let ids = Tensor::from_vec(ids, (2, t), &Device::Cpu)?;
    let logits = model.infer(&ids, None, None, Logits::All)?;
    let tensors = std::collections::HashMap::from([
        ("input_ids".to_string(), ids.to_dtype(DType::I64)?),
        ("logits".to_string(), logits),
    ]);
    candle_core::safetensors::save(&tensors, out.join("ours.safetensors"))?;
    println!("wrote {}", out.display());
    Ok(())
}
