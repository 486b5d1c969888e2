//! PyTorch's boolean `attn_mask` in every shape `mha` accepts, and a state dict saved with
//! `torch.save`, against `nn.MultiheadAttention(16, 4, batch_first=True)` (torch 2.15):
//! fixtures from `scripts/mha_torch_masks.py`, compared within 1e-5.

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
