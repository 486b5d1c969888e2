//! The GPT model against Hugging Face transformers 5.23 (torch 2.15) on small random-weight
//! GPT-2 checkpoints made by `scripts/gpt2_fixtures.py`: logits within 1e-4 absolute (f32),
//! the loss within 1e-5 relative, greedy tokens identical (steps after a near-tie of the
//! reference, top-two margin < 1e-4, are not compared). Also: the other ways a checkpoint
//! comes (no `transformer.` prefix, sharded, saved by us) and bad checkpoints.

// The tolerance helpers live with the mha tests.
#[path = "../../kernels/tests/common/mod.rs"]
mod common;
mod reference;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use common::assert_close;
use gpt_blocks::{save_dir, Gpt, LoadOptions, Logits};

const MODELS: [&str; 3] = ["tiny", "inverse_layer_scale", "untied_exact_gelu"];

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn expected(name: &str) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(fixture(name).join("expected.safetensors"), &Device::Cpu)
        .unwrap()
}

fn load(dir: &Path) -> Gpt {
    gpt_blocks::load(dir, DType::F32, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

fn logits(model: &Gpt, ids: &Tensor) -> Tensor {
    model.infer(ids, None, None, Logits::All).unwrap()
}

#[test]
fn logits_loss_and_greedy_tokens_match_transformers() {
    for name in MODELS {
        reference::matches_transformers(&load(&fixture(name)), &expected(name), 1e-5, name);
    }
}

/// Writes `tensors` as a model directory beside `config.json` of `like`.
fn write_dir(dir: &Path, like: &str, tensors: &HashMap<String, Tensor>) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::copy(fixture(like).join("config.json"), dir.join("config.json")).unwrap();
    candle_core::safetensors::save(tensors, dir.join("model.safetensors")).unwrap();
}

fn fixture_tensors(name: &str) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(fixture(name).join("model.safetensors"), &Device::Cpu).unwrap()
}

#[test]
fn other_checkpoint_layouts_give_the_same_logits() {
    let name = "tiny";
    let exp = expected(name);
    let want = logits(&load(&fixture(name)), &exp["input_ids"]);
    let tmp = tempfile::tempdir().unwrap();

    // Keys without the `transformer.` prefix, plus the old `attn.bias` buffers.
    let mut bare: HashMap<String, Tensor> = fixture_tensors(name)
        .into_iter()
        .map(|(k, v)| (k.trim_start_matches("transformer.").to_string(), v))
        .collect();
    bare.insert(
        "h.0.attn.bias".into(),
        Tensor::ones((1, 1, 32, 32), DType::U8, &Device::Cpu).unwrap(),
    );
    let dir = tmp.path().join("bare");
    write_dir(&dir, name, &bare);
    assert_close(
        &logits(&load(&dir), &exp["input_ids"]),
        &want,
        0.0,
        0.0,
        "no prefix",
    );

    // Two shards and an index.
    let dir = tmp.path().join("sharded");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(fixture(name).join("config.json"), dir.join("config.json")).unwrap();
    let (mut a, mut b) = (HashMap::new(), HashMap::new());
    let mut weight_map = serde_json::Map::new();
    for (i, (k, v)) in fixture_tensors(name).into_iter().enumerate() {
        let shard = if i % 2 == 0 {
            "model-00001-of-00002.safetensors"
        } else {
            "model-00002-of-00002.safetensors"
        };
        weight_map.insert(k.clone(), shard.into());
        if i % 2 == 0 {
            a.insert(k, v)
        } else {
            b.insert(k, v)
        };
    }
    candle_core::safetensors::save(&a, dir.join("model-00001-of-00002.safetensors")).unwrap();
    candle_core::safetensors::save(&b, dir.join("model-00002-of-00002.safetensors")).unwrap();
    let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    assert_close(
        &logits(&load(&dir), &exp["input_ids"]),
        &want,
        0.0,
        0.0,
        "sharded",
    );

    // Saved by us, read back (tied and untied heads).
    for name in ["tiny", "untied_exact_gelu"] {
        let exp = expected(name);
        let model = load(&fixture(name));
        let dir = tmp.path().join(format!("saved-{name}"));
        save_dir(&model, &dir).unwrap();
        let names: Vec<String> =
            candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu)
                .unwrap()
                .into_keys()
                .collect();
        assert_eq!(
            names.len(),
            fixture_tensors(name).len(),
            "{name}: same tensor set as transformers writes"
        );
        assert!(names.iter().all(|n| fixture_tensors(name).contains_key(n)));
        assert_close(
            &logits(&load(&dir), &exp["input_ids"]),
            &logits(&model, &exp["input_ids"]),
            0.0,
            0.0,
            &format!("{name}: saved and reloaded"),
        );
    }

    // f16 weights track f32.
    let half = gpt_blocks::load(&fixture(name), DType::F16, &Device::Cpu).unwrap();
    let got = half
        .infer(&exp["input_ids"], None, None, Logits::All)
        .unwrap();
    assert_close(&got, &want, 2e-2, 2e-2, "f16");
}

/// The error loading `dir` gives; loading it for inference (as `gpt` runs a checkpoint)
/// must give the same.
fn load_err(dir: &Path) -> String {
    let err = gpt_blocks::load(dir, DType::F32, &Device::Cpu)
        .unwrap_err()
        .to_string();
    let fused = gpt_blocks::load(
        dir,
        LoadOptions::new(DType::F32).for_inference(),
        &Device::Cpu,
    );
    // (The first line: with RUST_BACKTRACE set, Candle appends where each error arose.)
    let first = |e: &str| e.lines().next().unwrap_or("").to_string();
    assert_eq!(first(&fused.unwrap_err().to_string()), first(&err));
    err
}

#[test]
fn bad_checkpoints_are_errors_that_name_the_problem() {
    let tmp = tempfile::tempdir().unwrap();
    let name = "tiny";
    let good = fixture_tensors(name);

    let mut missing = good.clone();
    missing.remove("transformer.h.1.mlp.c_fc.weight");
    let dir = tmp.path().join("missing");
    write_dir(&dir, name, &missing);
    let err = load_err(&dir);
    assert!(err.contains("h.1.mlp.c_fc.weight"), "{err}");

    let mut wrong_shape = good.clone();
    wrong_shape.insert(
        "transformer.h.0.attn.c_attn.weight".into(),
        Tensor::zeros((96, 32), DType::F32, &Device::Cpu).unwrap(),
    );
    let dir = tmp.path().join("shape");
    write_dir(&dir, name, &wrong_shape);
    let err = load_err(&dir);
    assert!(err.contains("c_attn.weight") && err.contains("96"), "{err}");

    let mut wrong_dtype = good.clone();
    wrong_dtype.insert(
        "transformer.ln_f.weight".into(),
        Tensor::zeros(32, DType::I64, &Device::Cpu).unwrap(),
    );
    let dir = tmp.path().join("dtype");
    write_dir(&dir, name, &wrong_dtype);
    let err = load_err(&dir);
    assert!(err.contains("ln_f.weight") && err.contains("I64"), "{err}");

    let dir = tmp.path().join("truncated");
    write_dir(&dir, name, &good);
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    std::fs::write(dir.join("model.safetensors"), &bytes[..bytes.len() / 2]).unwrap();
    let err = load_err(&dir);
    assert!(err.contains("not a valid safetensors file"), "{err}");

    let dir = tmp.path().join("heads");
    write_dir(&dir, name, &good);
    let cfg = std::fs::read_to_string(dir.join("config.json"))
        .unwrap()
        .replace("\"n_head\": 4", "\"n_head\": 5");
    std::fs::write(dir.join("config.json"), cfg).unwrap();
    let err = load_err(&dir);
    assert!(
        err.contains("n_head=5") && err.contains("n_embd=32"),
        "{err}"
    );

    let dir = tmp.path().join("activation");
    write_dir(&dir, name, &good);
    let cfg = std::fs::read_to_string(dir.join("config.json"))
        .unwrap()
        .replace("gelu_new", "mish");
    std::fs::write(dir.join("config.json"), cfg).unwrap();
    let err = load_err(&dir);
    assert!(err.contains("mish"), "{err}");

    let err = load_err(&tmp.path().join("nowhere"));
    assert!(err.contains("config.json"), "{err}");
}

/// A nanoGPT `ckpt.pt` (compiled-model prefix, `nn.Linear` layout, `bias=False`) against
/// the same weights in transformers with zero biases.
#[test]
fn nanogpt_checkpoint_matches_transformers() {
    let exp = expected("nanogpt");
    let model = gpt_blocks::load_nanogpt(
        &fixture("nanogpt").join("ckpt.pt"),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    assert_eq!(model.config().n_head, 2);
    let got = logits(&model, &exp["input_ids"]);
    assert_close(&got, &exp["logits"], 1e-4, 0.0, "nanoGPT logits");
    let err = gpt_blocks::load_nanogpt(
        &fixture("tiny").join("model.safetensors"),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("not a PyTorch zip checkpoint"), "{err}");
}

/// The tests above on the paths a GPU takes (`GPT_GENERIC_PATHS=1`).
#[test]
fn every_test_on_the_generic_paths() {
    common::rerun_on_generic_paths("every_test_on_the_generic_paths", &[], 4);
}
