//! A prefill's packed products (`gpt_kernels::quant::Packed::matmul`) on GPT-2 124M's shapes,
//! the fastest of 15 runs each: the kernel-level check behind docs/PERFORMANCE.md's
//! prefill numbers, steadier than whole prefills on a shared machine. To compare two
//! builds, copy each binary aside and alternate them.
//!
//! `cargo run --release -p gpt-kernels --example packed_prefill -- [q8_0|q4_0|q5_0|q4k|q5k|q6k|q3k|q2k] [rows]`
//! (threads from `T`, default 2).

use anyhow::{bail, Result};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use gpt_kernels::quant::Packed;
use std::time::Instant;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let dtype = match args.get(1).map_or("q5k", |s| s.as_str()) {
        "q8_0" => GgmlDType::Q8_0,
        "q4_0" => GgmlDType::Q4_0,
        "q5_0" => GgmlDType::Q5_0,
        "q4k" => GgmlDType::Q4K,
        "q5k" => GgmlDType::Q5K,
        "q6k" => GgmlDType::Q6K,
        "q3k" => GgmlDType::Q3K,
        "q2k" => GgmlDType::Q2K,
        other => bail!("unknown format {other}"),
    };
    let m: usize = args.get(2).map_or(Ok(512), |s| s.parse())?;
    let threads = std::env::var("T").map_or(Ok(2), |s| s.parse())?;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()?;
    let mut total = 0.0;
    // (k, n): the attention's q/k/v and output, the MLP's two.
    for (k, n) in [(768, 2304), (768, 768), (768, 3072), (3072, 768)] {
        let w = Tensor::randn(0f32, 1., (n, k), &Device::Cpu)?;
        let Some(packed) = Packed::new(&QTensor::quantize(&w, dtype)?)? else {
            bail!("{dtype:?} has no packed kernels on this CPU")
        };
        let x: Vec<f32> = Tensor::randn(0f32, 1., (m, k), &Device::Cpu)?
            .flatten_all()?
            .to_vec1()?;
        let mut best = f64::MAX;
        for _ in 0..15 {
            let t = Instant::now();
            std::hint::black_box(pool.install(|| packed.matmul(&x, m, 0..n))?);
            best = best.min(t.elapsed().as_secs_f64());
        }
        total += best;
        print!("{k}x{n}: {:.1} GMAC/s  ", (m * k * n) as f64 / best / 1e9);
    }
    println!("total {:.2} ms", total * 1e3);
    Ok(())
}
