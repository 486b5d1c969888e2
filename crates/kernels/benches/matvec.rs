//! Decoding-sized products (1 to 8 rows) at GPT-2 small geometry: `gpt_kernels::dense` against
//! Candle's `matmul` (the `gemm` crate). Each iteration runs the product over twelve
//! copies of the weight, as a 12-layer model does, so the weights come from memory and
//! not from the 32 MiB cache.
//!
//! `RAYON_NUM_THREADS=2 cargo bench -p mha --bench matvec`. Results: docs/PERFORMANCE.md.
#![allow(missing_docs)]

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::Module;
use candle_core::{Device, Tensor};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use gpt_kernels::dense::few_rows_matmul;
use gpt_kernels::quant::stored::qmatmul;
use gpt_kernels::quant::Packed;
use std::sync::Arc;

fn randn(shape: (usize, usize)) -> Tensor {
    Tensor::randn(0f32, 1.0, shape, &Device::Cpu).unwrap()
}

fn bench_matvec(c: &mut Criterion) {
    let mut group = c.benchmark_group("matvec");
    group.sample_size(20);
    // (name, in, out, copies, stored as nn.Linear [out, in] and used transposed)
    let shapes = [
        ("c_attn_768x2304", 768, 2304, 12, false),
        ("c_fc_768x3072", 768, 3072, 12, false),
        ("c_proj_3072x768", 3072, 768, 12, false),
        ("lm_head_768x50257", 768, 50257, 1, true),
    ];
    for (name, d_in, d_out, copies, linear) in shapes {
        let ws: Vec<Tensor> = (0..copies)
            .map(|_| {
                if linear {
                    randn((d_out, d_in)).t().unwrap()
                } else {
                    randn((d_in, d_out))
                }
            })
            .collect();
        let b = randn((1, d_out)).squeeze(0).unwrap();
        // Up to the row limit of each path (`MAX_ROWS_IN_OUT`, `MAX_ROWS`).
        let rows_list: &[usize] = if linear { &[1, 4, 8] } else { &[1, 2] };
        for &rows in rows_list {
            let xs = randn((rows, d_in));
            let id = format!("{name}/rows{rows}");
            group.bench_function(BenchmarkId::new("matvec", &id), |bench| {
                bench.iter(|| {
                    for w in &ws {
                        few_rows_matmul(&xs, w, Some(&b)).unwrap().unwrap();
                    }
                })
            });
            group.bench_function(BenchmarkId::new("matmul", &id), |bench| {
                bench.iter(|| {
                    for w in &ws {
                        xs.matmul(w).unwrap().broadcast_add(&b).unwrap();
                    }
                })
            });
        }
    }
    group.finish();
}

/// The same products with block-quantized weights (`[out, in]`, as GGUF stores them):
/// `gpt_kernels::quant` (the repacked tiles `Proj` uses where the CPU has AVX2 or AVX-512
/// VNNI) and `gpt_kernels::quant::stored` (the stored layout's scalar products, used
/// elsewhere) against Candle's `QMatMul` (which repacks q8_0 matrices whose input width is a multiple of 256 for its own AVX-512 VNNI
/// kernel, keeping the copy). Throughput is in weight bytes read per second. Run it on the pool
/// (`Proj` is called from a worker in `gpt`): calls from outside pay a wake-up each.
fn bench_qmatvec(c: &mut Criterion) {
    // Each iteration runs on the pool (one hand-over per iteration, not per product).
    let pool = rayon::ThreadPoolBuilder::new().build().unwrap();
    let mut group = c.benchmark_group("qmatvec");
    group.sample_size(20);
    let shapes = [
        ("c_attn_768x2304", 768, 2304, 12),
        ("c_fc_768x3072", 768, 3072, 12),
        ("c_proj_3072x768", 3072, 768, 12),
        ("smollm_mlp_576x1536", 576, 1536, 30),
        ("lm_head_768x50257", 768, 50257, 1),
    ];
    let dtypes = [
        GgmlDType::Q8_0,
        GgmlDType::Q4_0,
        GgmlDType::Q5_0,
        GgmlDType::Q4K,
        GgmlDType::Q5K,
        GgmlDType::Q6K,
    ];
    for dtype in dtypes {
        for (name, d_in, d_out, copies) in shapes {
            if d_in % dtype.block_size() != 0 {
                continue;
            }
            let ws: Vec<Arc<QTensor>> = (0..copies)
                .map(|_| Arc::new(QTensor::quantize(&randn((d_out, d_in)), dtype).unwrap()))
                .collect();
            let bytes: usize = ws.iter().map(|w| w.storage_size_in_bytes()).sum();
            let candle: Vec<QMatMul> = ws
                .iter()
                .map(|w| QMatMul::from_arc(w.clone()).unwrap())
                .collect();
            let packed: Vec<Packed> = ws.iter().filter_map(|w| Packed::new(w).unwrap()).collect();
            for rows in [1, 4, 16] {
                let xs = randn((rows, d_in));
                let id = format!("{dtype:?}/{name}/rows{rows}");
                group.throughput(Throughput::Bytes(bytes as u64));
                let x: Vec<f32> = xs.flatten_all().unwrap().to_vec1().unwrap();
                if !packed.is_empty() {
                    group.bench_function(BenchmarkId::new("packed", &id), |bench| {
                        bench.iter(|| {
                            pool.install(|| {
                                for w in &packed {
                                    w.matmul(&x, rows, 0..d_out).unwrap();
                                }
                            })
                        })
                    });
                }
                if gpt_kernels::quant::stored::supported(&ws[0]) {
                    group.bench_function(BenchmarkId::new("qmatvec", &id), |bench| {
                        bench.iter(|| {
                            pool.install(|| {
                                for w in &ws {
                                    qmatmul(&xs, w, 0..d_out).unwrap().unwrap();
                                }
                            })
                        })
                    });
                }
                group.bench_function(BenchmarkId::new("candle", &id), |bench| {
                    bench.iter(|| {
                        pool.install(|| {
                            for w in &candle {
                                w.forward(&xs).unwrap();
                            }
                        })
                    })
                });
            }
        }
    }
    group.finish();
}

/// A prefill's products with block-quantized weights: ours packed (`Packed::matmul`, where
/// this CPU has kernels for the format) against each task dequantizing its span for the f32
/// GEMM (`quant::stored::prefill_dequantized`) and Candle's `QMatMul` (its repacked kernels for
/// q4_K and q6_K, and q8_0 with VNNI, keep a copy beside the blocks). Throughput is in
/// multiply-adds per second (`elements`). `cargo bench -p mha --bench matvec -- prefill`.
fn bench_prefill(c: &mut Criterion) {
    let pool = rayon::ThreadPoolBuilder::new().build().unwrap();
    let mut group = c.benchmark_group("prefill");
    group.sample_size(10);
    let rows = 512;
    let dtypes = [
        GgmlDType::Q8_0,
        GgmlDType::Q4_0,
        GgmlDType::Q5_0,
        GgmlDType::Q4K,
        GgmlDType::Q5K,
        GgmlDType::Q6K,
        GgmlDType::Q3K,
    ];
    for dtype in dtypes {
        for (name, d_in, d_out) in [("c_fc_768x3072", 768, 3072), ("c_proj_3072x768", 3072, 768)] {
            let w = QTensor::quantize(&randn((d_out, d_in)), dtype).unwrap();
            let xs = randn((rows, d_in));
            let x: Vec<f32> = xs.flatten_all().unwrap().to_vec1().unwrap();
            let id = format!("{dtype:?}/{name}/rows{rows}");
            group.throughput(Throughput::Elements((rows * d_in * d_out) as u64));
            if let Some(packed) = Packed::new(&w).unwrap() {
                group.bench_function(BenchmarkId::new("packed", &id), |bench| {
                    bench.iter(|| pool.install(|| packed.matmul(&x, rows, 0..d_out).unwrap()))
                });
            }
            group.bench_function(BenchmarkId::new("dequantized", &id), |bench| {
                bench.iter(|| {
                    pool.install(|| {
                        gpt_kernels::quant::stored::prefill_dequantized(&xs, &w, 0..d_out).unwrap()
                    })
                })
            });
            let qm = QMatMul::from_qtensor(
                QTensor::quantize(&w.dequantize(&Device::Cpu).unwrap(), dtype).unwrap(),
            )
            .unwrap();
            group.bench_function(BenchmarkId::new("candle", &id), |bench| {
                bench.iter(|| qm.forward(&xs).unwrap())
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench_matvec, bench_qmatvec, bench_prefill);
criterion_main!(benches);
