//! How fast decoding's packed products stream their weights, against the read floor of
//! `gpt bench --read-floor` ([`ReadFloor`]: a sum of memory on huge pages, read by the
//! threads the products run on) in the same process, alternating. `layers` runs the products
//! of 28 layers of Qwen3-0.6B's width (fused gate/up, down, fused q/k/v, o), each a few
//! megabytes, as a decoding step does; `hot` one layer of them, repeated from the last-
//! level cache (the kernels' own rate, memory out of the way); `head` one product over a
//! 262,144 × 640 matrix (Gemma-3-270M's tied head). `sizes` runs products of 512 to 16,384 rows of 1,024 (about
//! 240 MB of each size) and fits each round's times per product as a fixed cost plus bytes
//! over a rate: what a product costs beyond streaming its weights. docs/PERFORMANCE.md
//! ("Quantized products", "Where decoding's time goes") has results.
//!
//! `cargo run --release -p gpt-kernels --example decode_stream -- [q4_0|q8_0|q2_k|q3_k|q4_k|q5_k|q6_k] [layers|hot|head|sizes]`

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Result, Tensor};
use gpt_kernels::floor::ReadFloor;
use gpt_kernels::quant::Packed;
use std::time::Instant;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let dtype = match args.get(1).map(String::as_str) {
        Some("q8_0") => GgmlDType::Q8_0,
        Some("q4_k") => GgmlDType::Q4K,
        Some("q6_k") => GgmlDType::Q6K,
        Some("q5_k") => GgmlDType::Q5K,
        Some("q3_k") => GgmlDType::Q3K,
        Some("q2_k") => GgmlDType::Q2K,
        _ => GgmlDType::Q4_0,
    };
    if args.get(2).map(String::as_str) == Some("sizes") {
        return sizes(dtype);
    }
    let hot = args.get(2).map(String::as_str) == Some("hot");
    let shapes: Vec<(usize, usize)> = match args.get(2).map(String::as_str) {
        // (Rows of the k-quants are whole super-blocks of 256 values.)
        Some("head") if dtype.block_size() == 256 => vec![(262144, 768)],
        Some("head") => vec![(262144, 640)],
        // One layer, a few megabytes: read from the last-level cache after the first
        // repetition, so its rate is the kernels' own with memory out of the way.
        Some("hot") => vec![(6144, 1024), (1024, 3072), (4096, 1024), (1024, 2048)],
        _ => [(6144, 1024), (1024, 3072), (4096, 1024), (1024, 2048)].repeat(28),
    };
    let mut ws = Vec::new();
    let mut bytes = 0;
    for &(n, k) in &shapes {
        let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu)?;
        let Some(p) = Packed::new(&QTensor::quantize(&w, dtype)?)? else {
            candle_core::bail!("{dtype:?} has no packed kernels on this CPU")
        };
        bytes += p.size_in_bytes();
        ws.push((p, vec![0.5f32; k]));
    }
    let reads = ReadFloor::new();
    println!("{dtype:?}, {:.0} MB of weights", bytes as f64 / 1e6);
    for round in 0..6 {
        let floor = reads.bytes() as f64 / reads.read().as_secs_f64();
        let t1 = Instant::now();
        // (One layer as many times as `layers` runs its 28.)
        let reps = if hot { 6 * 28 } else { 6 };
        for _ in 0..reps {
            for (w, x) in &ws {
                let (n, _) = w.dims();
                std::hint::black_box(w.matmul(x, 1, 0..n)?);
            }
        }
        let rate = (bytes * reps) as f64 / t1.elapsed().as_secs_f64();
        println!(
            "round {round}: sum {:.1} GB/s, products {:.1} GB/s: {:.3} of the sum",
            floor / 1e9,
            rate / 1e9,
            rate / floor,
        );
    }
    Ok(())
}

/// Products of each of a few sizes, alternating with the sum; then, over the medians of
/// each size's time per product, the least-squares fit `time = fixed + bytes / rate` (a
/// round disturbed by another process moves a median little, where it would throw a
/// round's own fit far off).
fn sizes(dtype: GgmlDType) -> Result<()> {
    let rows = [512usize, 1024, 2048, 4096, 16384];
    let mut sets = Vec::new();
    for &n in &rows {
        let mut ws = Vec::new();
        // About 240 MB of each size, far beyond the caches.
        for _ in 0..(245760 / n) {
            let w = Tensor::randn(0f32, 1.0, (n, 1024), &Device::Cpu)?;
            let Some(p) = Packed::new(&QTensor::quantize(&w, dtype)?)? else {
                candle_core::bail!("{dtype:?} has no packed kernels on this CPU")
            };
            ws.push(p);
        }
        sets.push(ws);
    }
    let x = vec![0.5f32; 1024];
    let reads = ReadFloor::new();
    println!("{dtype:?}: microseconds per product of n rows of 1,024");
    // Per size, its seconds per product in each round.
    let mut times = vec![Vec::new(); rows.len()];
    let mut floors = Vec::new();
    for round in 0..9 {
        floors.push(reads.bytes() as f64 / reads.read().as_secs_f64());
        for (ws, times) in sets.iter().zip(&mut times) {
            let t1 = Instant::now();
            for w in ws {
                let (n, _) = w.dims();
                std::hint::black_box(w.matmul(&x, 1, 0..n)?);
            }
            times.push(t1.elapsed().as_secs_f64() / ws.len() as f64);
        }
        let each: Vec<String> = rows
            .iter()
            .zip(&times)
            .map(|(n, t)| format!("{n}: {:.1}", t[round] * 1e6))
            .collect();
        let floor = floors[round] / 1e9;
        println!("round {round}: sum {floor:.1} GB/s; {}", each.join(", "));
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let points: Vec<(f64, f64)> = sets
        .iter()
        .zip(&mut times)
        .map(|(ws, t)| (ws[0].size_in_bytes() as f64, median(t)))
        .collect();
    let m = points.len() as f64;
    let (mx, my) = points
        .iter()
        .fold((0.0, 0.0), |(sx, sy), &(x, y)| (sx + x / m, sy + y / m));
    let sxy: f64 = points.iter().map(|&(x, y)| (x - mx) * (y - my)).sum();
    let sxx: f64 = points.iter().map(|&(x, _)| (x - mx) * (x - mx)).sum();
    let slope = sxy / sxx;
    println!(
        "medians: sum {:.1} GB/s; fixed {:.2} us a product, rate {:.1} GB/s",
        median(&mut floors) / 1e9,
        (my - slope * mx) * 1e6,
        1.0 / slope / 1e9
    );
    Ok(())
}
