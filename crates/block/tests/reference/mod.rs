//! What the Hugging Face fixture tests check of each model: logits, loss, greedy tokens.
#![allow(dead_code)]

use std::collections::HashMap;

use candle_core::{DType, Tensor};
use gpt_blocks::{generate, GenerateOptions, Gpt, Logits, SamplingParams};

use crate::common::{assert_close, max_abs_diff};

/// The first row of an id tensor.
pub fn ids_of(t: &Tensor) -> Vec<u32> {
    t.to_dtype(DType::U32).unwrap().to_vec2::<u32>().unwrap()[0].clone()
}

/// Against transformers' outputs in `exp` (see the fixture scripts): logits within 1e-4
/// absolute, the loss of the first row within `loss_rtol`, and the greedy tokens equal up
/// to the reference's first near-tie (top-two margin < 1e-4).
pub fn matches_transformers(
    model: &Gpt,
    exp: &HashMap<String, Tensor>,
    loss_rtol: f32,
    name: &str,
) {
    let ids = &exp["input_ids"];
    let got = model.infer(ids, None, None, Logits::All).unwrap();
    println!(
        "{name}: max |logit diff| = {:e}",
        max_abs_diff(&got, &exp["logits"])
    );
    assert_close(&got, &exp["logits"], 1e-4, 0.0, &format!("{name}: logits"));

    let loss = model.loss(&ids.narrow(0, 0, 1).unwrap(), false).unwrap();
    let (loss, want) = (
        loss.to_scalar::<f32>().unwrap(),
        exp["loss"].to_scalar::<f32>().unwrap(),
    );
    assert!(
        ((loss - want) / want).abs() <= loss_rtol,
        "{name}: loss {loss} vs {want}"
    );

    let greedy = ids_of(&exp["greedy"]);
    let margins: Vec<f32> = exp["margins"].to_vec1().unwrap();
    let opts = GenerateOptions {
        max_new_tokens: greedy.len(),
        sampling: SamplingParams::default(),
        stop_tokens: vec![],
    };
    let ours = generate(model, &[ids_of(&exp["prompt"])], &opts, |_, _| true).unwrap();
    let comparable = margins
        .iter()
        .position(|&m| m < 1e-4)
        .unwrap_or(greedy.len());
    assert!(
        comparable >= 3,
        "{name}: the reference has a near-tie too early"
    );
    assert_eq!(
        ours[0][..comparable],
        greedy[..comparable],
        "{name}: greedy tokens"
    );
}
