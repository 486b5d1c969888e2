//! The fused training ops against PyTorch: LayerNorm, RMSNorm, linear, the tanh GELU and
//! next-token cross-entropy, outputs and gradients against `torch.autograd`
//! (`scripts/grad_fixtures.py`, torch 2.15). Tolerance: f32, 1e-5 absolute + 1e-4 relative.

mod common;

use candle_core::{Device, Tensor};
use common::assert_close;

const ATOL: f32 = 1e-5;
const RTOL: f32 = 1e-4;

/// `gpt_kernels::ops` (LayerNorm, RMSNorm, linear with bias, next-token cross-entropy) and the tanh GELU:
/// outputs and gradients of every input against `torch.autograd` (computed in f64).
#[test]
fn training_ops_match_pytorch() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures");
    let t = candle_core::safetensors::load(format!("{dir}/op_grads.safetensors"), &Device::Cpu)
        .unwrap();
    let var = |k: &str| candle_core::Var::from_tensor(&t[k]).unwrap();
    let check = |prefix: &str, out: &Tensor, inputs: &[(&str, &candle_core::Var)]| {
        assert_close(
            out,
            &t[&format!("{prefix}.out")],
            ATOL,
            RTOL,
            &format!("{prefix}: output"),
        );
        let grads = (out * &t[&format!("{prefix}.w")])
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        for (name, v) in inputs {
            let g = grads.get(v.as_tensor()).unwrap();
            let key = format!("{prefix}.d{name}");
            assert_close(g, &t[&key], ATOL, RTOL, &key);
        }
    };

    let (x, w, b) = (
        var("layer_norm.x"),
        var("layer_norm.weight"),
        var("layer_norm.bias"),
    );
    let out = gpt_kernels::ops::layer_norm(&x, &w, &b, 1e-5).unwrap();
    check(
        "layer_norm",
        &out,
        &[("x", &x), ("weight", &w), ("bias", &b)],
    );

    // PyTorch's [out, in] weight, read transposed in place.
    let (x, w, b) = (var("linear.x"), var("linear.weight"), var("linear.bias"));
    let out = gpt_kernels::ops::linear(&x, &w.t().unwrap(), &b).unwrap();
    check("linear", &out, &[("x", &x), ("weight", &w), ("bias", &b)]);

    let x = var("gelu.x");
    let out = gpt_kernels::act::gelu_tanh(&x).unwrap();
    check("gelu", &out, &[("x", &x)]);

    let (x, w) = (var("rms_norm.x"), var("rms_norm.weight"));
    let out = gpt_kernels::ops::rms_norm(&x, &w, 1e-6).unwrap();
    check("rms_norm", &out, &[("x", &x), ("weight", &w)]);

    let logits = var("cross_entropy.logits");
    let out = gpt_kernels::ops::next_token_cross_entropy(&logits, &t["cross_entropy.ids"]).unwrap();
    check("cross_entropy", &out, &[("logits", &logits)]);
}
