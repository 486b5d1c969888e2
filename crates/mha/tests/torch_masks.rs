//! PyTorch's boolean `attn_mask` in every shape `mha` accepts, and a state dict saved with
//! `torch.save`, against `nn.MultiheadAttention(16, 4, batch_first=True)` (torch 2.15):
//! fixtures from `scripts/mha_torch_masks.py`, compared within 1e-5.

#[path = "../../kernels/tests/common/mod.rs"]
mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use common::assert_close;
use mha::{Mask, MhaConfig, MultiHeadAttention, WeightLayout};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn tensors() -> HashMap<String, Tensor> {
    candle_core::safetensors::load(fixture("torch_masks.safetensors"), &Device::Cpu).unwrap()
}

fn layer(vb: VarBuilder) -> MultiHeadAttention {
    MultiHeadAttention::load(&MhaConfig::new(16, 4), &WeightLayout::TorchInProj, vb).unwrap()
}

#[test]
fn boolean_masks_match_pytorch_in_every_shape() {
    let t = tensors();
    let vb = VarBuilder::from_tensors(t.clone(), DType::F32, &Device::Cpu);
    let attn = layer(vb.pp("layer"));
    let (q, kv) = (&t["query"], &t["key_value"]);
    for case in ["2d", "heads", "batch"] {
        let mask = Mask::NONE.with_disallowed(&t[&format!("mask_{case}")]);
        let got = attn.forward(q, kv, kv, &mask, false).unwrap();
        assert_close(&got, &t[&format!("out_{case}")], 1e-5, 1e-5, case);
    }
    let mask = Mask::NONE
        .with_disallowed(&t["mask_2d"])
        .with_ignore(&t["padding"]);
    let got = attn.forward(q, kv, kv, &mask, false).unwrap();
    assert_close(&got, &t["out_2d_padded"], 1e-5, 1e-5, "2d + key padding");
}

#[test]
fn a_torch_saved_state_dict_loads_through_from_pth() {
    let t = tensors();
    let vb =
        VarBuilder::from_pth(fixture("torch_state_dict.pt"), DType::F32, &Device::Cpu).unwrap();
    let attn = layer(vb);
    let q = &t["query"];
    let got = attn.forward(q, q, q, &Mask::NONE, false).unwrap();
    assert_close(
        &got,
        &t["out_self"],
        1e-5,
        1e-5,
        "self-attention from torch.save",
    );
}

/// Shapes that do not fit, a float tensor as a boolean mask, and a mask with one entry per
/// head but not per batch row are errors, not silent broadcasts.
#[test]
fn bad_boolean_masks_are_errors() {
    let t = tensors();
    let vb = VarBuilder::from_tensors(t.clone(), DType::F32, &Device::Cpu);
    let attn = layer(vb.pp("layer"));
    let (q, kv) = (&t["query"], &t["key_value"]);
    let dev = Device::Cpu;
    for (dims, dtype, needle) in [
        (vec![4usize, 5, 6], DType::U8, "must be [q_len, kv_len]"), // heads only, batch 2
        (vec![5, 5], DType::U8, "must be [q_len, kv_len]"),
        (vec![2, 1, 5, 6], DType::U8, "must be [q_len, kv_len]"),
        (vec![5, 6], DType::F32, "integer tensor"),
    ] {
        let m = Tensor::zeros(dims.as_slice(), dtype, &dev).unwrap();
        let err = attn
            .forward(q, kv, kv, &Mask::NONE.with_disallowed(&m), false)
            .unwrap_err()
            .to_string();
        assert!(err.contains(needle), "{dims:?}: {err}");
    }
}

/// PyTorch's `add_bias_kv` and `add_zero_attn`, alone and together: outputs and per-head
/// weights without a mask, with a boolean mask and key padding, and causal; the causal
/// case also decoded token by token through a KV cache (the added positions are not
/// cached: every step sees them once).
#[test]
fn add_bias_kv_and_add_zero_attn_match_pytorch() {
    let t = tensors();
    let vb = VarBuilder::from_tensors(t.clone(), DType::F32, &Device::Cpu);
    let (q, kv) = (&t["query"], &t["key_value"]);
    for (name, add_bias_kv, add_zero_attn) in [
        ("bkv", true, false),
        ("zero", false, true),
        ("both", true, true),
    ] {
        let cfg = MhaConfig {
            add_bias_kv,
            add_zero_attn,
            ..MhaConfig::new(16, 4)
        };
        let attn = MultiHeadAttention::load(&cfg, &WeightLayout::TorchInProj, vb.pp(name)).unwrap();
        let (out, w) = attn
            .forward_with_weights(q, kv, kv, &Mask::NONE, false)
            .unwrap();
        assert_close(&out, &t[&format!("{name}.out")], 1e-5, 1e-5, name);
        assert_close(
            &w.per_head,
            &t[&format!("{name}.weights")],
            1e-5,
            1e-5,
            name,
        );
        let mask = Mask::NONE
            .with_disallowed(&t["mask_2d"])
            .with_ignore(&t["padding"]);
        let got = attn.forward(q, kv, kv, &mask, false).unwrap();
        assert_close(&got, &t[&format!("{name}.out_masked")], 1e-5, 1e-5, name);
        let want = &t[&format!("{name}.out_causal")];
        let got = attn.forward(q, q, q, &Mask::causal(0), false).unwrap();
        assert_close(&got, want, 1e-5, 1e-5, &format!("{name} causal"));
        let mut cache = mha::KvCache::new(2);
        let steps: Vec<Tensor> = (0..q.dim(1).unwrap())
            .map(|i| {
                let x = q.narrow(1, i, 1).unwrap();
                let mask = Mask::causal(cache.len());
                attn.forward_cached(&x, &x, &x, &mask, &mut cache).unwrap()
            })
            .collect();
        let stepped = Tensor::cat(&steps, 1).unwrap();
        assert_close(&stepped, want, 1e-5, 1e-5, &format!("{name} cached"));
    }
    // The file and the config must agree.
    let plain = MhaConfig::new(16, 4);
    let err = MultiHeadAttention::load(&plain, &WeightLayout::TorchInProj, vb.pp("bkv"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("set `add_bias_kv: true`"), "{err}");
    let wants = MhaConfig {
        add_bias_kv: true,
        ..plain
    };
    let err = MultiHeadAttention::load(&wants, &WeightLayout::TorchInProj, vb.pp("layer"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("set `add_bias_kv: false`"), "{err}");
}

/// A 3-D float mask follows the same rule as the boolean one (PyTorch's float `attn_mask`
/// of `-inf`/0 gives what its boolean mask gives): `[b·h, q, k]` per head, `[b, q, k]` per
/// batch row, and a first dimension equal to the head count alone is an error.
#[test]
fn three_dimensional_float_masks_follow_the_same_rule() {
    let t = tensors();
    let vb = VarBuilder::from_tensors(t.clone(), DType::F32, &Device::Cpu);
    let attn = layer(vb.pp("layer"));
    let (q, kv) = (&t["query"], &t["key_value"]);
    let to_float = |m: &Tensor| {
        let zeros = Tensor::zeros(m.shape(), DType::F32, &Device::Cpu).unwrap();
        let inf = Tensor::full(f32::NEG_INFINITY, m.shape(), &Device::Cpu).unwrap();
        m.where_cond(&inf, &zeros).unwrap()
    };
    for case in ["heads", "batch"] {
        let additive = to_float(&t[&format!("mask_{case}")]);
        let got = attn
            .forward(q, kv, kv, &Mask::NONE.with_additive(&additive), false)
            .unwrap();
        assert_close(&got, &t[&format!("out_{case}")], 1e-5, 1e-5, case);
    }
    let per_head_only = Tensor::zeros((4, 5, 6), DType::F32, &Device::Cpu).unwrap();
    let err = attn
        .forward(q, kv, kv, &Mask::NONE.with_additive(&per_head_only), false)
        .unwrap_err()
        .to_string();
    assert!(err.contains("3-D additive mask"), "{err}");
}

/// The tests above on the paths a GPU takes (`GPT_GENERIC_PATHS=1`: the reference
/// attention and Candle's ops where the CPU kernels would run).
#[test]
fn every_test_on_the_generic_paths() {
    common::rerun_on_generic_paths("every_test_on_the_generic_paths", &[], 5);
}
