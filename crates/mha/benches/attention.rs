//! Attention at GPT-2 small geometry: the fused CPU kernel against the reference path.
//!
//! `cargo bench -p mha --bench attention`; PyTorch's numbers for the same shapes come from
//! `scripts/bench_attention_torch.py`. Results: docs/PERFORMANCE.md.
#![allow(missing_docs)]

use candle_core::{DType, Device, Tensor};
use criterion::{criterion_group, BenchmarkId, Criterion};
use mha::{sdpa, sdpa_reference, Mask, MhaConfig, MultiHeadAttention, SdpaParams};

fn heads(b: usize, h: usize, t: usize, d: usize) -> Tensor {
    Tensor::randn(0f32, 1.0, (b, h, t, d), &Device::Cpu).unwrap()
}

fn bench_sdpa(c: &mut Criterion) {
    let mut group = c.benchmark_group("sdpa");
    group.sample_size(10);
    // (name, batch, q_len, kv_len, causal): heads 12 × 64 throughout.
    let shapes = [
        ("b1_t512", 1, 512, 512, false),
        ("b8_t128", 8, 128, 128, false),
        ("b1_t1024_causal", 1, 1024, 1024, true),
        ("decode_1_vs_1024", 1, 1, 1024, true),
    ];
    for (name, b, tq, tk, causal) in shapes {
        let (q, k, v) = (
            heads(b, 12, tq, 64),
            heads(b, 12, tk, 64),
            heads(b, 12, tk, 64),
        );
        let mask = if causal {
            Mask::causal(tk - tq)
        } else {
            Mask::NONE
        };
        let p = SdpaParams::inference(0.125);
        group.bench_function(BenchmarkId::new("fused", name), |bench| {
            bench.iter(|| sdpa(&q, &k, &v, &mask, &p).unwrap())
        });
        group.bench_function(BenchmarkId::new("reference", name), |bench| {
            bench.iter(|| sdpa_reference(&q, &k, &v, &mask, &p).unwrap())
        });
    }
    group.finish();
}

/// Decoding one token over a long cache with grouped-query heads (`mha::decode`): SmolLM's
/// 9 query heads over 3 key/value heads of 64, and Llama-3-8B's 32 over 8 of 128; and over
/// a short one, Qwen3-0.6B's 16 over 8 of 128 (`bench/gguf_compare.py` decodes after 16 to
/// 144 positions, where each call's fixed costs count); the cache in f32 (PyTorch's script
/// runs the same) and in f16 (`gpt`'s `--kv-dtype f16`).
fn bench_decode(c: &mut Criterion) {
    let mut group = c.benchmark_group("decode");
    group.sample_size(20);
    for (name, h, h_kv, d, tk) in [
        ("gqa_9_3_d64_t1024", 9, 3, 64, 1024),
        ("gqa_9_3_d64_t4096", 9, 3, 64, 4096),
        ("gqa_32_8_d128_t2048", 32, 8, 128, 2048),
        ("gqa_16_8_d128_t20", 16, 8, 128, 20),
        ("gqa_16_8_d128_t85", 16, 8, 128, 85),
    ] {
        let q = heads(1, h, 1, d);
        let (k, v) = (heads(1, h_kv, tk, d), heads(1, h_kv, tk, d));
        let p = SdpaParams::inference(1.0 / (d as f64).sqrt());
        let mask = Mask::causal(tk - 1);
        for dtype in [DType::F32, DType::F16] {
            let (k, v) = (k.to_dtype(dtype).unwrap(), v.to_dtype(dtype).unwrap());
            let id = BenchmarkId::new(format!("fused_{dtype:?}"), name);
            group.bench_function(id, |bench| {
                bench.iter(|| sdpa(&q, &k, &v, &mask, &p).unwrap())
            });
        }
    }
    group.finish();
}

fn bench_module(c: &mut Criterion) {
    let mut group = c.benchmark_group("mha_forward");
    group.sample_size(10);
    let vb = candle_nn::VarBuilder::zeros(DType::F32, &Device::Cpu);
    let attn = MultiHeadAttention::new(&MhaConfig::new(768, 12), vb).unwrap();
    for (b, t) in [(1, 512), (8, 128)] {
        let xs = Tensor::randn(0f32, 1.0, (b, t, 768), &Device::Cpu).unwrap();
        group.bench_function(BenchmarkId::new("causal", format!("b{b}_t{t}")), |bench| {
            bench.iter(|| {
                attn.forward(&xs, &xs, &xs, &Mask::causal(0), false)
                    .unwrap()
            })
        });
    }
    group.finish();
}

/// GPT-2's MLP activation on a 512-token prompt's hidden layer: the vectorised kernel
/// against Candle's tanh GELU and, as a yardstick, Candle's erf GELU.
fn bench_gelu(c: &mut Criterion) {
    let mut group = c.benchmark_group("gelu_512x3072");
    group.sample_size(20);
    let xs = Tensor::randn(0f32, 1.0, (512, 3072), &Device::Cpu).unwrap();
    group.bench_function("simd_tanh", |b| {
        b.iter(|| gpt_kernels::act::gelu_tanh(&xs).unwrap())
    });
    group.bench_function("candle_tanh", |b| b.iter(|| xs.gelu().unwrap()));
    group.bench_function("candle_erf", |b| b.iter(|| xs.gelu_erf().unwrap()));
    group.finish();
}

criterion_group!(benches, bench_sdpa, bench_decode, bench_module, bench_gelu);

/// Runs on a worker of rayon's pool, as `gpt` runs its commands (and as PyTorch's
/// callers take part in its OpenMP work): the kernels split from a thread that takes a
/// share, not from one that hands the work over and waits.
fn main() {
    rayon::scope(|_| benches());
    Criterion::default().configure_from_args().final_summary();
}
