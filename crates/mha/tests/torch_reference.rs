//! `mha` against PyTorch: `torch.nn.MultiheadAttention(batch_first=True)`, GPT-2's Conv1D
//! with `F.scaled_dot_product_attention`, `nn.Linear` projections with grouped-query SDPA,
//! and SDPA on heads directly. Fixtures: `scripts/mha_fixtures.py` (torch 2.15); the fused
//! kernel's gradients against `torch.autograd`: `scripts/grad_fixtures.py`.
//! Tolerance: f32, 1e-5 absolute + 1e-4 relative.

#[path = "../../kernels/tests/common/mod.rs"]
mod common;

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use common::assert_close;
use mha::{sdpa, sdpa_reference, Mask, MhaConfig, MultiHeadAttention, SdpaParams, WeightLayout};
use serde::Deserialize;

const ATOL: f32 = 1e-5;
const RTOL: f32 = 1e-4;

#[derive(Debug, Deserialize)]
struct Case {
    name: String,
    layout: String,
    d_model: usize,
    n_heads: usize,
    n_kv_heads: Option<usize>,
    kdim: Option<usize>,
    vdim: Option<usize>,
    bias: bool,
    causal: bool,
    self_attention: bool,
    has_weights: bool,
}

#[derive(Deserialize)]
struct Cases {
    cases: Vec<Case>,
}

struct Fixture {
    cases: Vec<Case>,
    tensors: HashMap<String, Tensor>,
}

impl Fixture {
    fn load() -> Fixture {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures");
        let json = std::fs::read_to_string(format!("{dir}/cases.json")).unwrap();
        let cases: Cases = serde_json::from_str(&json).unwrap();
        let tensors =
            candle_core::safetensors::load(format!("{dir}/mha_torch.safetensors"), &Device::Cpu)
                .unwrap();
        Fixture {
            cases: cases.cases,
            tensors,
        }
    }

    fn get(&self, case: &str, name: &str) -> Option<&Tensor> {
        self.tensors.get(&format!("{case}.{name}"))
    }

    fn req(&self, case: &str, name: &str) -> &Tensor {
        self.get(case, name)
            .unwrap_or_else(|| panic!("fixture lacks {case}.{name}"))
    }

    fn mask<'a>(&'a self, case: &Case) -> Mask<'a> {
        let mut mask = if case.causal {
            Mask::causal(0)
        } else {
            Mask::NONE
        };
        if let Some(kpm) = self.get(&case.name, "key_padding_mask") {
            mask = mask.with_ignore(kpm);
        }
        if let Some(am) = self.get(&case.name, "attn_mask") {
            mask = mask.with_additive(am);
        }
        mask
    }
}

fn layout(case: &Case) -> WeightLayout {
    match case.layout.as_str() {
        "torch_in_proj" => WeightLayout::TorchInProj,
        "gpt2" => WeightLayout::Gpt2Conv1d,
        "hf" => WeightLayout::hf(),
        "tutorial" => WeightLayout::tutorial(),
        other => panic!("unknown layout {other}"),
    }
}

#[test]
fn module_matches_pytorch() {
    let fx = Fixture::load();
    let mut checked = 0;
    for case in fx.cases.iter().filter(|c| c.layout != "functional") {
        let name = &case.name;
        let cfg = MhaConfig {
            n_kv_heads: case.n_kv_heads,
            kdim: case.kdim,
            vdim: case.vdim,
            bias: case.bias,
            ..MhaConfig::new(case.d_model, case.n_heads)
        };
        let vb = VarBuilder::from_tensors(fx.tensors.clone(), DType::F32, &Device::Cpu)
            .pp(name)
            .pp("w");
        let attn = MultiHeadAttention::load(&cfg, &layout(case), vb)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let q = fx.req(name, "query");
        // Self-attention passes one tensor three times, which takes the fused projection.
        let (k, v) = if case.self_attention {
            (q, q)
        } else {
            (fx.req(name, "key"), fx.req(name, "value"))
        };
        let mask = fx.mask(case);
        let expected = fx.req(name, "out");
        let out = attn.forward(q, k, v, &mask, false).unwrap();
        assert_close(&out, expected, ATOL, RTOL, &format!("{name}: output"));

        let (out_w, weights) = attn.forward_with_weights(q, k, v, &mask, false).unwrap();
        assert_close(
            &out_w,
            expected,
            ATOL,
            RTOL,
            &format!("{name}: output (weights path)"),
        );
        if case.has_weights {
            let want = fx.req(name, "weights");
            assert_close(
                &weights.per_head,
                want,
                ATOL,
                RTOL,
                &format!("{name}: weights"),
            );
            assert_close(
                &weights.averaged().unwrap(),
                &want.mean(1).unwrap(),
                ATOL,
                RTOL,
                &format!("{name}: averaged weights"),
            );
        }
        checked += 1;
    }
    assert_eq!(checked, 13, "every module case ran");
}

#[test]
fn sdpa_matches_pytorch_on_both_paths() {
    let fx = Fixture::load();
    let mut checked = 0;
    for case in fx.cases.iter().filter(|c| c.layout == "functional") {
        let name = &case.name;
        let (q, k, v) = (fx.req(name, "q"), fx.req(name, "k"), fx.req(name, "v"));
        let scale = 1.0 / (q.dim(3).unwrap() as f64).sqrt();
        let mask = fx.mask(case);
        let expected = fx.req(name, "out");
        let p = SdpaParams::inference(scale);
        let (fast, _) = sdpa(q, k, v, &mask, &p).unwrap();
        assert_close(&fast, expected, ATOL, RTOL, &format!("{name}: sdpa"));
        let (slow, _) = sdpa_reference(q, k, v, &mask, &p).unwrap();
        assert_close(
            &slow,
            expected,
            ATOL,
            RTOL,
            &format!("{name}: sdpa_reference"),
        );
        checked += 1;
    }
    assert_eq!(checked, 4, "every functional case ran");
}

/// The differentiable fused kernel's output and gradients (`torch.autograd` of
/// `sum(sdpa(q, k, v) * w)`, computed in f64) for GQA, cross-attention with key padding, a
/// causal offset and a sliding window, with sizes that cross the kernel's blocks.
#[test]
fn fused_attention_gradients_match_pytorch() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures");
    let t =
        candle_core::safetensors::load(format!("{dir}/attention_grads.safetensors"), &Device::Cpu)
            .unwrap();
    // name, causal, window
    for (name, causal, window) in [
        ("causal_gqa", true, None),
        ("cross_padded", false, None),
        ("window", true, Some(20)),
        ("offset_padded", true, None),
    ] {
        let get = |k: &str| t[&format!("{name}.{k}")].clone();
        let (q, k, v) = (get("q"), get("k"), get("v"));
        let (tq, tk) = (q.dim(2).unwrap(), k.dim(2).unwrap());
        let keep = get("keep");
        let mut mask = if causal {
            Mask::causal(tk - tq)
        } else {
            Mask::NONE
        }
        .with_keep(&keep);
        mask.window = window;
        let vars = [&q, &k, &v].map(|x| candle_core::Var::from_tensor(x).unwrap());
        let scale = 1.0 / (q.dim(3).unwrap() as f64).sqrt();
        let out =
            mha::flash::flash_attn_cpu_train(&vars[0], &vars[1], &vars[2], &mask, scale, None)
                .unwrap();
        assert_close(&out, &get("out"), ATOL, RTOL, &format!("{name}: output"));
        let grads = (&out * get("w"))
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        for (var, key) in vars.iter().zip(["dq", "dk", "dv"]) {
            let g = grads.get(var.as_tensor()).unwrap();
            assert_close(g, &get(key), ATOL, RTOL, &format!("{name}: {key}"));
        }
    }
}

/// The tests above on the paths a GPU takes (`GPT_GENERIC_PATHS=1`: the reference
/// attention and Candle's ops where the CPU kernels would run).
#[test]
fn every_test_on_the_generic_paths() {
    common::rerun_on_generic_paths("every_test_on_the_generic_paths", &[], 3);
}
