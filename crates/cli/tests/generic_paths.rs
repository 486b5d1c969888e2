//! The paths a GPU takes, checked on the CPU: with `GPT_GENERIC_PATHS=1` every tensor runs
//! Candle's generic ops where our CPU kernels would (attention by the reference path,
//! Candle's norms, rotations and quantized products, a cache in the activations' dtype),
//! as on a CUDA or Metal device; through the `gpt` binary here, and in the family,
//! Hugging Face and PyTorch tests, which run themselves again so. On every fixture
//! model, against the CPU kernels (which the family tests hold to transformers and
//! llama.cpp): per-token log-probabilities of a fixed sequence within 1e-5 on float models
//! (measured: at most 2.4e-6) and 1e-1 on quantized files, whose generic products round the
//! activations to 8 bits otherwise than ours (measured: up to 3.4e-2; the CPU's q8_0 files
//! are 3.2–5.0e-2 from their f32 ones); and greedy tokens after a cached decoding equal on
//! float models.

use std::path::{Path, PathBuf};
use std::time::Duration;

use assert_cmd::Command;

fn models() -> Vec<Option<PathBuf>> {
    let fix = Path::new(env!("CARGO_MANIFEST_DIR")).join("../block/tests/fixtures");
    let mut models = vec![
        None,
        Some(fix.join("tiny")),
        Some(fix.join("inverse_layer_scale")),
    ];
    let mut families: Vec<PathBuf> = std::fs::read_dir(fix.join("families"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("config.json").exists())
        .collect();
    families.sort();
    assert!(families.len() >= 19, "family fixtures: {}", families.len());
    models.extend(families.into_iter().map(Some));
    for f in ["llama.f32", "qwen2.q8_0", "gpt2.q8_0", "llama_wide.q4_k_m"] {
        models.push(Some(fix.join(format!("gguf/{f}.gguf"))));
    }
    models
}

fn run(model: &Option<PathBuf>, generic: bool, args: &[&str]) -> serde_json::Value {
    let mut cmd = Command::cargo_bin("gpt").unwrap();
    if let Some(m) = model {
        cmd.arg("--model").arg(m);
    }
    let out = cmd
        .args(["--device", "cpu"])
        .args(args)
        .args(["--format", "json"])
        .env("GPT_GENERIC_PATHS", if generic { "1" } else { "0" })
        .timeout(Duration::from_secs(60))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{model:?} {args:?} (generic {generic}): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn generic_paths_give_what_the_cpu_kernels_give() {
    let ids: Vec<String> = (1..=20).map(|i| i.to_string()).collect();
    let ids = ids.join(",");
    let mut report = Vec::new();
    for model in models() {
        let name = model
            .as_ref()
            .map_or("built-in".into(), |m| m.display().to_string());
        // The built-in model is a q5_0 file.
        let quantized = model.is_none() || name.contains(".q");
        let score = |generic| run(&model, generic, &["score", "--ids", &ids]);
        let (ours, generic) = (score(false), score(true));
        let lp = |v: &serde_json::Value| -> Vec<f64> {
            v["token_logprobs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect()
        };
        let (a, b) = (lp(&ours), lp(&generic));
        assert_eq!(a.len(), 19, "{name}");
        let diff = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max);
        let tol = if quantized { 1e-1 } else { 1e-5 };
        assert!(
            diff <= tol,
            "{name}: log-probabilities differ by {diff:e} (tolerance {tol:e})"
        );
        report.push(format!("{name}: {diff:.1e}"));
        if !quantized {
            let gen = |generic| {
                run(
                    &model,
                    generic,
                    &[
                        "generate",
                        "--prompt-ids",
                        "1,2,3,4,5,6",
                        "--max-new-tokens",
                        "8",
                        "--temperature",
                        "0",
                    ],
                )["new_ids"]
                    .clone()
            };
            assert_eq!(gen(false), gen(true), "{name}: greedy tokens");
        }
    }
    println!("{}", report.join("\n"));
}
