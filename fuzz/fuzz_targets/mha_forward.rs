//! `MultiHeadAttention` driven by a caller who gets everything wrong: arbitrary
//! configurations, input ranks and sizes, dtypes and masks. Errors are fine; panics are
//! not.
#![no_main]

use arbitrary::Arbitrary;
use candle_core::{DType, Device, Tensor};
use libfuzzer_sys::fuzz_target;
use mha::{KvCache, Mask, MhaConfig, MultiHeadAttention, WeightLayout};

#[derive(Arbitrary, Debug)]
struct Input {
    d_model: u8,
    n_heads: u8,
    n_kv_heads: Option<u8>,
    kdim: Option<u8>,
    vdim: Option<u8>,
    bias: bool,
    dropout: f32,
    scale: Option<f64>,
    layout: u8,
    query: Vec<u8>,
    key: Option<Vec<u8>>,
    value: Option<Vec<u8>>,
    dtype: u8,
    causal: Option<usize>,
    padding: Option<(bool, Vec<u8>, u8)>,
    additive: Option<(Vec<u8>, f32)>,
    mode: u8,
    train: bool,
    fill: f32,
}

fn dtype(d: u8) -> DType {
    match d % 6 {
        0 => DType::F32,
        1 => DType::F16,
        2 => DType::BF16,
        3 => DType::F64,
        4 => DType::U8,
        _ => DType::U32,
    }
}

/// A tensor of the given (small) shape, rank ≤ 5, every element `fill`.
fn tensor(dims: &[u8], fill: f32, dt: DType) -> Option<Tensor> {
    let dims: Vec<usize> = dims.iter().take(5).map(|&d| (d % 9) as usize).collect();
    let t = Tensor::full(fill, dims, &Device::Cpu).ok()?;
    t.to_dtype(dt).ok()
}

fuzz_target!(|input: Input| {
    let cfg = MhaConfig {
        n_kv_heads: input.n_kv_heads.map(usize::from),
        kdim: input.kdim.map(usize::from),
        vdim: input.vdim.map(usize::from),
        bias: input.bias,
        dropout: input.dropout,
        scale: input.scale,
        ..MhaConfig::new(input.d_model as usize, input.n_heads as usize)
    };
    let layout = match input.layout % 3 {
        0 => WeightLayout::hf(),
        1 => WeightLayout::Gpt2Conv1d,
        _ => WeightLayout::TorchInProj,
    };
    let varmap = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let Ok(attn) = MultiHeadAttention::load(&cfg, &layout, vb) else {
        return;
    };
    let dt = dtype(input.dtype);
    let Some(q) = tensor(&input.query, input.fill, dt) else {
        return;
    };
    let k = input.key.as_deref().and_then(|d| tensor(d, input.fill, dt));
    let v = input
        .value
        .as_deref()
        .and_then(|d| tensor(d, input.fill, dt));
    let (k, v) = (k.as_ref().unwrap_or(&q), v.as_ref().unwrap_or(&q));
    let padding = input
        .padding
        .as_ref()
        .and_then(|(keep, dims, d)| Some((*keep, tensor(dims, 1.0, dtype(*d))?)));
    let additive = input
        .additive
        .as_ref()
        .and_then(|(dims, fill)| tensor(dims, *fill, dt));
    let mut mask = Mask {
        causal: input.causal,
        ..Mask::NONE
    };
    if let Some((keep, t)) = &padding {
        mask = if *keep {
            mask.with_keep(t)
        } else {
            mask.with_ignore(t)
        };
    }
    if let Some(a) = &additive {
        mask = mask.with_additive(a);
    }
    match input.mode % 3 {
        0 => {
            let _ = attn.forward(&q, k, v, &mask, input.train);
        }
        1 => {
            let _ = attn.forward_with_weights(&q, k, v, &mask, input.train);
        }
        _ => {
            let mut cache = KvCache::new(4);
            for _ in 0..3 {
                let _ = attn.forward_cached(&q, k, v, &mask, &mut cache);
            }
        }
    }
});
