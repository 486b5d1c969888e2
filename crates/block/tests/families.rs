//! Llama, Mistral, Qwen2, GPT-NeoX and GPT-Neo checkpoints against Hugging Face
//! transformers 5.23 (torch 2.15), on small random-weight models made by
//! `scripts/family_fixtures.py` (every parameter redrawn; GQA, MQA, untied heads, q/k/v
//! biases, partial rotary, linear RoPE scaling, parallel residual, sliding windows and
//! GPT-Neo's local layers exercised): logits within 1e-4 absolute, the loss within 1e-4
//! relative, greedy tokens identical (steps after a near-tie of the reference, top-two
//! margin < 1e-4, are not compared). Then, without a reference: cached decoding equals the
//! full pass within 1e-5, left-padded rows equal the rows alone, the older `config.json`
//! field names give the same model, quantized and half-precision models track f32, bad
//! configs are one-line errors that name the field, and training through every family but
//! GPT-NeoX has the gradients finite differences give.

#[path = "../../kernels/tests/common/mod.rs"]
mod common;
mod reference;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, IndexOp, Tensor};
use candle_nn::{VarBuilder, VarMap};
use common::{assert_close, max_abs_diff};
use gpt_blocks::{read_config, Gpt, GptCache, LoadOptions, Logits};

const MODELS: [&str; 16] = [
    "llama_gqa_bias",
    "llama_mqa_linear",
    "mistral_window",
    "qwen2_bias_window",
    "neox_parallel",
    "neox_sequential",
    "neo_local",
    "qwen3_qk_norm",
    "smollm3_nope",
    "olmo2_post_norm",
    "granite_multipliers",
    "gemma2_softcap",
    "gemma3_local_global",
    "phi3_window",
    "lfm2_hybrid",
    "lfm2_conv_bias",
];

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/families")
        .join(name)
}

fn expected(name: &str) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(fixture(name).join("expected.safetensors"), &Device::Cpu)
        .unwrap()
}

fn load(dir: &Path, dtype: DType) -> Gpt {
    gpt_blocks::load(dir, dtype, &Device::Cpu).unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

#[test]
fn logits_loss_and_greedy_tokens_match_transformers() {
    for name in MODELS {
        let model = load(&fixture(name), DType::F32);
        reference::matches_transformers(&model, &expected(name), 1e-4, name);
    }
}

/// LongRoPE (Phi-3's scaling) as transformers runs it: the short factors while a sequence
/// stays within the original context (8 here), the long ones once a forward pass reaches
/// past it (the full pass of 12 ids), the cosines and sines times the attention factor
/// (sqrt(1 + ln 8 / ln 8) for a context of 64 over 8); the greedy continuation crosses
/// from one to the other through the cache, as transformers' does. The hub's older fields
/// (`rope_scaling` `type: longrope`, a top-level `original_max_position_embeddings`) give
/// the same model. (Within a row, cached keys keep the factors they were rotated with, as
/// in transformers: cached decoding across the boundary is not the full pass, by design.)
#[test]
fn longrope_matches_transformers_below_and_beyond_the_original_context() {
    // Llama's layout, and Phi-4-mini's (fused projections, 0.75 of each head rotated).
    for name in ["llama_longrope", "phi4_longrope"] {
        longrope_matches(name);
    }
}

fn longrope_matches(name: &str) {
    let model = load(&fixture(name), DType::F32);
    let exp = expected(name);
    reference::matches_transformers(&model, &exp, 1e-4, name);
    let short = exp["input_ids"].narrow(1, 0, 8).unwrap();
    let got = model.infer(&short, None, None, Logits::All).unwrap();
    assert_close(
        &got,
        &exp["logits_short"],
        1e-4,
        0.0,
        "below the original context",
    );
    let long = model
        .infer(&exp["input_ids"], None, None, Logits::All)
        .unwrap();
    let first8 = long.narrow(1, 0, 8).unwrap();
    assert!(
        max_abs_diff(&first8, &exp["logits_short"]) > 1e-2,
        "{name}: the long factors must change the first positions' logits"
    );
    match &model.config().rope.as_ref().unwrap().scaling {
        mha::RopeScaling::LongRope {
            attention_factor, ..
        } => assert!((attention_factor - 2f64.sqrt()).abs() < 1e-12),
        other => panic!("{other:?}"),
    }
    let tmp = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixture(name).join("config.legacy.json"),
        tmp.path().join("config.json"),
    )
    .unwrap();
    std::fs::copy(
        fixture(name).join("model.safetensors"),
        tmp.path().join("model.safetensors"),
    )
    .unwrap();
    assert_eq!(load(tmp.path(), DType::F32).config(), model.config());
}

/// Prefill of part of the sequence, then one token at a time through the cache, equals
/// the full causal pass: the cache holds rotated keys, and windows slide past the prefill.
/// With q/k/v fused too ([`Gpt::fused`], as `gpt` runs them), whose decoding steps write
/// rotated keys into the cache in place.
#[test]
fn cached_decoding_equals_the_full_pass() {
    for (name, fuse) in MODELS.iter().flat_map(|&m| [(m, false), (m, true)]) {
        let model = load(&fixture(name), DType::F32);
        let model = if fuse { model.fused().unwrap() } else { model };
        let ids = &expected(name)["input_ids"];
        let full = model.infer(ids, None, None, Logits::All).unwrap();
        let stepped = stepped(&model, ids);
        assert_close(
            &stepped,
            &full,
            1e-5,
            1e-5,
            &format!("{name} (fused: {fuse}): cached decoding"),
        );
    }
}

/// The logits of `ids` `[b, t]` run through a cache: a prefill of 3 positions, then one
/// position a step.
fn stepped(model: &Gpt, ids: &Tensor) -> Tensor {
    let t = ids.dim(1).unwrap();
    let mut cache = GptCache::new(model.config(), 4);
    let mut steps = Vec::new();
    for (at, n) in std::iter::once((0, 3)).chain((3..t).map(|i| (i, 1))) {
        let part = ids.narrow(1, at, n).unwrap();
        steps.push(
            model
                .infer(&part, None, Some(&mut cache), Logits::All)
                .unwrap(),
        );
    }
    Tensor::cat(&steps, 1).unwrap()
}

/// A left-padded batch gives each row the logits of that row run alone (positions count
/// real tokens only, for learned and rotary positions alike).
#[test]
fn left_padded_rows_equal_rows_alone() {
    for name in MODELS {
        let model = load(&fixture(name), DType::F32);
        let ids = &expected(name)["input_ids"];
        let short = ids.i((1..2, 0..7)).unwrap();
        let long = ids.i((0..1, ..)).unwrap();
        let pad = 12 - 7;
        let padded = Tensor::cat(
            &[
                &Tensor::zeros((1, pad), DType::I64, &Device::Cpu).unwrap(),
                &short,
            ],
            1,
        )
        .unwrap();
        let batch = Tensor::cat(&[&long, &padded], 0).unwrap();
        let mut keep = vec![1u8; 24];
        keep[12..12 + pad].fill(0);
        let keep = Tensor::from_vec(keep, (2, 12), &Device::Cpu).unwrap();
        let got = model.infer(&batch, Some(&keep), None, Logits::All).unwrap();
        let alone = model.infer(&short, None, None, Logits::All).unwrap();
        let want_long = model.infer(&long, None, None, Logits::All).unwrap();
        assert_close(
            &got.i(0..1).unwrap(),
            &want_long,
            1e-5,
            1e-5,
            &format!("{name}: row 0"),
        );
        assert_close(
            &got.i((1..2, pad..)).unwrap(),
            &alone,
            1e-5,
            1e-5,
            &format!("{name}: padded row"),
        );
    }
}

/// Continuous batching: sequences of different lengths, each with its own cache, decoded
/// together in one batch (rows joining as they arrive) give each row the logits of that
/// sequence decoded alone; f32 within 1e-5, q8_0 (whose products quantize each row of
/// activations on its own) within 1e-4. GPT-2's learned positions and every rotary family.
#[test]
fn rows_with_their_own_caches_equal_rows_alone() {
    let tiny = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny");
    let dirs = MODELS.iter().map(|n| (n.to_string(), fixture(n)));
    for (name, dir) in dirs.chain([("gpt2".to_string(), tiny)]) {
        let f32_model = load(&dir, DType::F32);
        let q8 = f32_model.quantize(GgmlDType::Q8_0).unwrap();
        for (model, tol, what) in [(&f32_model, 1e-5, "f32"), (&q8, 1e-4, "q8_0")] {
            let vocab = model.config().vocab_size as u32;
            // Three sequences with prompts of 5, 2 and 7 tokens.
            let seqs: Vec<Vec<u32>> = [5usize, 2, 7]
                .iter()
                .enumerate()
                .map(|(s, &n)| {
                    (0..n as u32 + 6)
                        .map(|i| (i * 7 + s as u32 * 13 + 1) % vocab)
                        .collect()
                })
                .collect();
            let prompt = [5usize, 2, 7];
            let row = |ids: &[u32]| {
                Tensor::new(ids, &Device::Cpu)
                    .unwrap()
                    .unsqueeze(0)
                    .unwrap()
            };
            // Each alone: prefill, then one token at a time.
            let alone: Vec<Vec<Tensor>> = seqs
                .iter()
                .zip(prompt)
                .map(|(s, p)| {
                    let mut cache = GptCache::new(model.config(), 4);
                    model
                        .infer(&row(&s[..p]), None, Some(&mut cache), Logits::Last)
                        .unwrap();
                    (p..s.len())
                        .map(|i| {
                            model
                                .infer(&row(&s[i..=i]), None, Some(&mut cache), Logits::Last)
                                .unwrap()
                        })
                        .collect()
                })
                .collect();
            // Together: sequence 2 joins one step after the others.
            let mut caches: Vec<GptCache> =
                (0..3).map(|_| GptCache::new(model.config(), 4)).collect();
            let mut next = [0usize; 3];
            for step in 0..7 {
                let mut active = Vec::new();
                for s in 0..3 {
                    if s == 2 && step == 0 {
                        continue;
                    }
                    if caches[s].is_empty() {
                        model
                            .infer(
                                &row(&seqs[s][..prompt[s]]),
                                None,
                                Some(&mut caches[s]),
                                Logits::Last,
                            )
                            .unwrap();
                    }
                    if prompt[s] + next[s] < seqs[s].len() {
                        active.push(s);
                    }
                }
                let ids: Vec<u32> = active
                    .iter()
                    .map(|&s| seqs[s][prompt[s] + next[s]])
                    .collect();
                let ids = Tensor::from_vec(ids, (active.len(), 1), &Device::Cpu).unwrap();
                let mut rows: Vec<&mut GptCache> = caches
                    .iter_mut()
                    .enumerate()
                    .filter(|(s, _)| active.contains(s))
                    .map(|(_, c)| c)
                    .collect();
                let got = model.infer_rows(&ids, &mut rows, Logits::Last).unwrap();
                for (r, &s) in active.iter().enumerate() {
                    assert_close(
                        &got.i(r..r + 1).unwrap(),
                        &alone[s][next[s]],
                        tol,
                        tol,
                        &format!("{name} {what}: sequence {s}, step {step}"),
                    );
                    next[s] += 1;
                }
            }
            assert_eq!(
                next,
                [6, 6, 6],
                "{name}: every step of every sequence was compared"
            );
        }
    }
}

/// A left-padded prefill of prompts of different lengths, its cache split into one cache
/// per row (`GptCache::split_left_padded`), then decoding them together with
/// `infer_rows`: every step equals that prompt run alone (f32, 1e-5).
#[test]
fn split_left_padded_prefill_equals_rows_alone() {
    let tiny = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny");
    let dirs = MODELS.iter().map(|n| (n.to_string(), fixture(n)));
    for (name, dir) in dirs.chain([("gpt2".to_string(), tiny)]) {
        let model = load(&dir, DType::F32);
        let vocab = model.config().vocab_size as u32;
        let lens = [5usize, 2, 7];
        let seqs: Vec<Vec<u32>> = lens
            .iter()
            .enumerate()
            .map(|(s, &n)| {
                (0..n as u32 + 4)
                    .map(|i| (i * 5 + s as u32 * 11 + 2) % vocab)
                    .collect()
            })
            .collect();
        let row = |ids: &[u32]| {
            Tensor::new(ids, &Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap()
        };
        let alone: Vec<Vec<Tensor>> = seqs
            .iter()
            .zip(lens)
            .map(|(s, p)| {
                let mut cache = GptCache::new(model.config(), 4);
                let mut out = vec![model
                    .infer(&row(&s[..p]), None, Some(&mut cache), Logits::Last)
                    .unwrap()];
                for i in p..s.len() {
                    out.push(
                        model
                            .infer(&row(&s[i..=i]), None, Some(&mut cache), Logits::Last)
                            .unwrap(),
                    );
                }
                out
            })
            .collect();
        let longest = 7;
        let mut ids = Vec::new();
        let mut keep = Vec::new();
        for (s, &n) in seqs.iter().zip(&lens) {
            ids.extend(std::iter::repeat_n(0u32, longest - n).chain(s[..n].iter().copied()));
            keep.extend(std::iter::repeat_n(0u8, longest - n).chain(std::iter::repeat_n(1u8, n)));
        }
        let ids = Tensor::from_vec(ids, (3, longest), &Device::Cpu).unwrap();
        let keep = Tensor::from_vec(keep, (3, longest), &Device::Cpu).unwrap();
        let mut batch = GptCache::new(model.config(), longest);
        let first = model
            .infer(&ids, Some(&keep), Some(&mut batch), Logits::Last)
            .unwrap();
        let mut caches = batch.split_left_padded(&lens, &[8, 8, 8]).unwrap();
        for s in 0..3 {
            assert_close(
                &first.i(s..s + 1).unwrap(),
                &alone[s][0],
                1e-5,
                1e-5,
                &format!("{name}: prefill {s}"),
            );
            assert_eq!(caches[s].len(), lens[s]);
        }
        for step in 0..4 {
            let next: Vec<u32> = (0..3).map(|s| seqs[s][lens[s] + step]).collect();
            let next = Tensor::from_vec(next, (3, 1), &Device::Cpu).unwrap();
            let mut rows: Vec<&mut GptCache> = caches.iter_mut().collect();
            let got = model.infer_rows(&next, &mut rows, Logits::Last).unwrap();
            for (s, steps) in alone.iter().enumerate() {
                assert_close(
                    &got.i(s..s + 1).unwrap(),
                    &steps[step + 1],
                    1e-5,
                    1e-5,
                    &format!("{name}: sequence {s}, step {step}"),
                );
            }
        }
        // Lengths that do not fit are an error, not a panic.
        assert!(batch.split_left_padded(&[8, 1, 1], &[8, 8, 8]).is_err());
        assert!(batch.split_left_padded(&[0, 1, 1], &[8, 8, 8]).is_err());
        assert!(batch.split_left_padded(&[1, 1], &[8, 8, 8]).is_err());
    }
}

/// The hub's older field names (top-level `rope_theta`/`rope_scaling`, NeoX's `rotary_pct`
/// and `rotary_emb_base`, Qwen2 and Qwen3 without `layer_types`, SmolLM3's
/// `no_rope_layer_interval` without `no_rope_layers`) read as the same model.
#[test]
fn legacy_config_fields_give_the_same_model() {
    let tmp = tempfile::tempdir().unwrap();
    for name in MODELS {
        let dir = tmp.path().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(
            fixture(name).join("config.legacy.json"),
            dir.join("config.json"),
        )
        .unwrap();
        std::fs::copy(
            fixture(name).join("model.safetensors"),
            dir.join("model.safetensors"),
        )
        .unwrap();
        let new = load(&fixture(name), DType::F32);
        let old = load(&dir, DType::F32);
        // The same window per layer, however the runs are written.
        let per_layer = |c: &gpt_blocks::GptConfig| gpt_blocks::GptConfig {
            windows: vec![((0..c.n_layer).map(|i| c.window(i)).collect(), 1)],
            no_rope: vec![(
                (0..c.n_layer).map(|i| c.layer_rope(i).is_none()).collect(),
                1,
            )],
            no_rope_every: None,
            conv_layers: vec![((0..c.n_layer).map(|i| c.is_conv(i)).collect(), 1)],
            ..c.clone()
        };
        assert_eq!(
            per_layer(new.config()),
            per_layer(old.config()),
            "{name}: configs differ"
        );
        let ids = &expected(name)["input_ids"];
        assert_close(
            &old.infer(ids, None, None, Logits::All).unwrap(),
            &new.infer(ids, None, None, Logits::All).unwrap(),
            0.0,
            0.0,
            &format!("{name}: legacy config logits"),
        );
    }
}

/// Quantized (q8_0) and half-precision models track f32, prefill and cached decoding.
#[test]
fn quantized_and_half_precision_track_f32() {
    for name in MODELS {
        let exp = expected(name);
        let ids = &exp["input_ids"];
        let want = load(&fixture(name), DType::F32)
            .infer(ids, None, None, Logits::All)
            .unwrap();
        let spread = common::flat(&want)
            .unwrap()
            .iter()
            .fold(0f32, |m, x| m.max(x.abs()));
        // Each variant's largest logit error as a share of the largest logit, and its
        // bound, above the largest measured over these models (q8_0 0.9-6.5e-2: it
        // rounds weights and activations to 8 bits; f16 1.2-3.1e-3; bf16 0.6-3.7e-2).
        // LFM2's convolution multiplies three projections (B·x·C), each rounded: q8_0
        // 8.1e-2 and bf16 5.1e-2 measured, bounds 1.5 times those.
        let lfm2 = name.starts_with("lfm2");
        let (q8, bf16) = if lfm2 { (0.12, 0.08) } else { (0.08, 0.04) };
        for (what, bound) in [("q8_0", q8), ("f16", 0.006), ("bf16", bf16)] {
            let model = match what {
                "q8_0" => load(&fixture(name), DType::F32)
                    .quantize(GgmlDType::Q8_0)
                    .unwrap(),
                "f16" => load(&fixture(name), DType::F16),
                _ => load(&fixture(name), DType::BF16),
            };
            let got = model.infer(ids, None, None, Logits::All).unwrap();
            let err = max_abs_diff(&got.to_dtype(DType::F32).unwrap(), &want) / spread;
            println!("{name}: {what} max logit error {err:.2e} of the largest logit {spread:.2}");
            assert!(
                err < bound,
                "{name}: {what} error {err} of the logits' range"
            );
            // Cached decoding in that precision matches its own full pass.
            let mut cache = GptCache::new(model.config(), 4);
            let first = model
                .infer(
                    &ids.narrow(1, 0, 6).unwrap(),
                    None,
                    Some(&mut cache),
                    Logits::All,
                )
                .unwrap();
            let next = model
                .infer(
                    &ids.narrow(1, 6, 6).unwrap(),
                    None,
                    Some(&mut cache),
                    Logits::All,
                )
                .unwrap();
            let stepped = Tensor::cat(&[first, next], 1)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap();
            let tol = if what == "q8_0" { 1e-4 } else { 2e-2 };
            assert_close(
                &stepped,
                &got.to_dtype(DType::F32).unwrap(),
                tol,
                tol,
                &format!("{name}: {what} cached"),
            );
        }
    }
}

#[test]
fn bad_configs_are_one_line_errors_naming_the_field() {
    use serde_json::json;
    // (fixture, JSON pointer of the field, new value (null removes it), words expected)
    let cases = [
        // head_dim given: 5 heads of 8 are a model, but not over 2 key/value heads.
        (
            "llama_gqa_bias",
            "/num_attention_heads",
            json!(5),
            "num_key_value_heads=2 must be positive and divide the 5 attention heads",
        ),
        (
            "llama_gqa_bias",
            "/num_key_value_heads",
            json!(3),
            "num_key_value_heads=3",
        ),
        (
            "llama_gqa_bias",
            "/hidden_size",
            json!(0),
            "hidden_size must be positive",
        ),
        (
            "llama_gqa_bias",
            "/intermediate_size",
            json!(null),
            "intermediate_size is missing",
        ),
        (
            "llama_gqa_bias",
            "/head_dim",
            json!(0),
            "head_dim must be positive",
        ),
        ("qwen3_qk_norm", "/head_dim", json!(-1), "head_dim"),
        (
            "gemma2_softcap",
            "/attn_logit_softcapping",
            json!(0.0),
            "attn_logit_softcapping must be a positive number",
        ),
        (
            "gemma2_softcap",
            "/attn_logit_softcapping",
            json!(-5),
            "attn_logit_softcapping must be a positive number",
        ),
        ("gemma2_softcap", "/sliding_window", json!(0), "window"),
        (
            "gemma2_softcap",
            "/use_bidirectional_attention",
            json!(true),
            "use_bidirectional_attention",
        ),
        (
            "qwen3_qk_norm",
            "/head_dim",
            json!(1u64 << 31),
            "head_dim=2147483648 and n_head=4",
        ),
        (
            "smollm3_nope",
            "/no_rope_layers",
            json!([1, 0, 1]),
            "no_rope_layers has 3 entries for num_hidden_layers=4",
        ),
        (
            "smollm3_nope",
            "/no_rope_layers",
            json!([1, 0, 2, 1]),
            "no_rope_layers entries must be 0 or 1",
        ),
        (
            "granite_multipliers",
            "/logits_scaling",
            json!(0.0),
            "logits_scaling must be a positive number",
        ),
        (
            "granite_multipliers",
            "/attention_multiplier",
            json!("big"),
            "attention_multiplier must be a number",
        ),
        (
            "granite_multipliers",
            "/residual_multiplier",
            json!(-0.5),
            "residual_multiplier must be a positive number",
        ),
        (
            "olmo2_post_norm",
            "/rms_norm_eps",
            json!(0.0),
            "layer_norm_epsilon must be positive",
        ),
        (
            "llama_gqa_bias",
            "/hidden_act",
            json!("mish"),
            "hidden_act \"mish\"",
        ),
        (
            "llama_gqa_bias",
            "/rope_parameters/rope_type",
            json!("yarn"),
            "rope_parameters type \"yarn\"",
        ),
        (
            "llama_gqa_bias",
            "/rope_parameters/rope_theta",
            json!(-1.0),
            "theta",
        ),
        (
            "llama_gqa_bias",
            "/rms_norm_eps",
            json!("small"),
            "rms_norm_eps",
        ),
        (
            "llama_gqa_bias",
            "/model_type",
            json!("mamba"),
            "model_type \"mamba\"",
        ),
        ("llama_gqa_bias", "/vocab_size", json!(-3), "vocab_size"),
        (
            "mistral_window",
            "/sliding_window",
            json!(0),
            "sliding_window",
        ),
        (
            "qwen2_bias_window",
            "/layer_types",
            json!(["full_attention"]),
            "layer_types",
        ),
        (
            "neox_parallel",
            "/rope_parameters/partial_rotary_factor",
            json!(1.5),
            "partial_rotary_factor",
        ),
        (
            "neox_parallel",
            "/use_parallel_residual",
            json!("yes"),
            "use_parallel_residual",
        ),
        (
            "neo_local",
            "/attention_types",
            json!([[["global", "sparse"], 1]]),
            "\"sparse\"",
        ),
        (
            "neo_local",
            "/attention_types",
            json!([[["global"], 1]]),
            "num_layers=2",
        ),
        ("neo_local", "/num_heads", json!(3), "num_heads=3"),
    ];
    for (name, field, value, needle) in cases {
        let text = std::fs::read_to_string(fixture(name).join("config.json")).unwrap();
        let mut config: serde_json::Value = serde_json::from_str(&text).unwrap();
        *config.pointer_mut(field).unwrap() = value;
        // The message itself: with RUST_BACKTRACE set, Candle wraps errors with a backtrace
        // (which `gpt` turns off for users).
        let err = match gpt_blocks::GptConfig::from_json(&config.to_string()).unwrap_err() {
            candle_core::Error::WithBacktrace { inner, .. } => inner.to_string(),
            e => e.to_string(),
        };
        assert!(
            err.contains(needle),
            "{name} {field}: {needle:?} not in {err:?}"
        );
        assert!(!err.contains('\n'), "{name} {field}: several lines: {err}");
    }
}

/// The error loading `dir` gives; loading it for inference must give the same.
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
    assert_eq!(
        first(&fused.unwrap_err().to_string()),
        first(&err),
        "{}",
        dir.display()
    );
    err
}

#[test]
fn bad_checkpoints_of_new_families_name_the_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, drop) in [
        ("llama_gqa_bias", "model.layers.1.self_attn.k_proj.bias"),
        (
            "neox_parallel",
            "gpt_neox.layers.0.attention.query_key_value.weight",
        ),
        ("neo_local", "transformer.h.1.attn.attention.out_proj.bias"),
    ] {
        let mut tensors =
            candle_core::safetensors::load(fixture(name).join("model.safetensors"), &Device::Cpu)
                .unwrap();
        tensors.remove(drop);
        let dir = tmp.path().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(fixture(name).join("config.json"), dir.join("config.json")).unwrap();
        candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).unwrap();
        let err = load_err(&dir);
        assert!(err.contains(drop), "{name}: {err}");
    }
    // A wrong shape: k_proj sized for 4 kv heads where the config says 2.
    let mut tensors = candle_core::safetensors::load(
        fixture("llama_gqa_bias").join("model.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    tensors.insert(
        "model.layers.0.self_attn.k_proj.weight".into(),
        Tensor::zeros((32, 32), DType::F32, &Device::Cpu).unwrap(),
    );
    let dir = tmp.path().join("shape");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(
        fixture("llama_gqa_bias").join("config.json"),
        dir.join("config.json"),
    )
    .unwrap();
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).unwrap();
    let err = load_err(&dir);
    assert!(
        err.contains("k_proj.weight") && err.contains("[16, 32]"),
        "{err}"
    );
}

/// `named_tensors` gives back every tensor of the checkpoint under its own name and
/// value (NeoX's per-head q/k/v grouping restored), and keys without the root prefix load.
#[test]
fn named_tensors_round_trip_and_bare_names_load() {
    let tmp = tempfile::tempdir().unwrap();
    for name in MODELS {
        let stored =
            candle_core::safetensors::load(fixture(name).join("model.safetensors"), &Device::Cpu)
                .unwrap();
        let model = load(&fixture(name), DType::F32);
        let named = model.named_tensors().unwrap();
        let mut a: Vec<_> = stored.keys().collect();
        let mut b: Vec<_> = named.keys().collect();
        a.sort();
        b.sort();
        assert_eq!(a, b, "{name}: tensor names");
        for (k, v) in &stored {
            // Gemma's norms are held as `1 + w`: w back within f32's rounding of 1 + w.
            let tol = match name.starts_with("gemma") && k.ends_with("norm.weight") {
                true => f32::EPSILON,
                false => 0.0,
            };
            assert_close(&named[k], v, tol, 0.0, &format!("{name}: {k}"));
        }
        // Without the root prefix (`model.`, `gpt_neox.`, `transformer.`).
        let in_a_block = a.iter().find(|k| k.contains(".0.")).unwrap();
        let root = in_a_block.split('.').next().unwrap().to_string();
        let bare: HashMap<String, Tensor> = stored
            .into_iter()
            .map(|(k, v)| {
                (
                    k.strip_prefix(&format!("{root}."))
                        .unwrap_or(&k)
                        .to_string(),
                    v,
                )
            })
            .collect();
        let dir = tmp.path().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(fixture(name).join("config.json"), dir.join("config.json")).unwrap();
        candle_core::safetensors::save(&bare, dir.join("model.safetensors")).unwrap();
        let ids = &expected(name)["input_ids"];
        assert_close(
            &load(&dir, DType::F32)
                .infer(ids, None, None, Logits::All)
                .unwrap(),
            &model.infer(ids, None, None, Logits::All).unwrap(),
            0.0,
            0.0,
            &format!("{name}: bare names"),
        );
    }
}

/// The fixture's model with its weights in variables of `dtype`, as training holds them.
fn trainable(name: &str, dtype: DType) -> (Vec<(String, candle_core::Var)>, Gpt) {
    let dir = fixture(name);
    let cfg = read_config(&dir).unwrap();
    let varmap = VarMap::new();
    let gpt = Gpt::new(&cfg, VarBuilder::from_varmap(&varmap, dtype, &Device::Cpu)).unwrap();
    let weights =
        candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut vars = common::vars_of(&varmap);
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    // Phi-3 stores q/k/v and gate/up fused: a part is its rows of the stored tensor.
    let hd = cfg.head_dim();
    let (q, kv, inner) = (cfg.n_head * hd, cfg.kv_heads() * hd, cfg.inner_dim());
    let fused = [
        ("q_proj", "qkv_proj", 0, q),
        ("k_proj", "qkv_proj", q, kv),
        ("v_proj", "qkv_proj", q + kv, kv),
        ("gate_proj", "gate_up_proj", 0, inner),
        ("up_proj", "gate_up_proj", inner, inner),
    ];
    let part = |n: &str| {
        fused.iter().find_map(|(part, stored, first, rows)| {
            let w = weights.get(&n.replace(&format!(".{part}."), &format!(".{stored}.")))?;
            n.contains(&format!(".{part}."))
                .then(|| w.narrow(0, *first, *rows).unwrap())
        })
    };
    for (n, var) in &vars {
        let w = weights
            .get(n)
            .cloned()
            .or_else(|| part(n))
            .unwrap_or_else(|| panic!("{name}: no {n} in the file"));
        var.set(&w.to_dtype(dtype).unwrap()).unwrap();
    }
    (vars, gpt)
}

const TRAIN_IDS: [[u32; 10]; 2] = [
    [1, 5, 2, 9, 3, 3, 7, 8, 1, 2],
    [4, 0, 10, 7, 6, 1, 2, 3, 4, 5],
];

/// Training through every family but GPT-NeoX (whose fused, head-interleaved q/k/v rows
/// are regrouped at load, for inference): RoPE (partial and scaled), RMSNorm, SwiGLU,
/// grouped and multi-query heads, q/k/v biases, sliding and local windows, untied heads,
/// Phi-3's partial rotary, Gemma's sandwich norms and soft caps, LFM2's convolutions.
/// The loss's gradient in f64 against central finite differences.
#[test]
fn gradients_match_finite_differences_in_the_trainable_families() {
    let ids = Tensor::new(&TRAIN_IDS, &Device::Cpu).unwrap();
    // Phi-3's files store q/k/v and gate/up fused; `trainable` reads them apart.
    for name in MODELS.iter().filter(|n| !n.starts_with("neox")) {
        let (vars, gpt) = trainable(name, DType::F64);
        let loss = gpt.loss(&ids, true).unwrap();
        assert_eq!(loss.dtype(), DType::F64, "{name}: the loss keeps f64");
        let grads = loss.backward().unwrap();
        let value = || gpt.loss(&ids, true)?.to_scalar::<f64>();
        let checked = common::check_gradients(&vars, &grads, 3, 1e-4, value).unwrap();
        assert!(checked >= 2 * vars.len(), "{name}: {checked} coordinates");
    }
}

/// The f32 training path on the CPU (fused RMSNorm, attention with its own backward, fused
/// cross-entropy) gives the gradients the f64 path gives, for the same weights.
#[test]
fn f32_training_kernels_track_f64_in_every_family() {
    let ids = Tensor::new(&TRAIN_IDS, &Device::Cpu).unwrap();
    for name in MODELS.iter().filter(|n| !n.starts_with("neox")) {
        let (vars32, gpt32) = trainable(name, DType::F32);
        let (vars64, gpt64) = trainable(name, DType::F64);
        let (loss32, loss64) = (
            gpt32.loss(&ids, true).unwrap(),
            gpt64.loss(&ids, true).unwrap(),
        );
        let l64 = loss64.to_dtype(DType::F32).unwrap();
        assert_close(&loss32, &l64, 0.0, 1e-5, &format!("{name}: loss"));
        let (g32, g64) = (loss32.backward().unwrap(), loss64.backward().unwrap());
        for ((n, v32), (_, v64)) in vars32.iter().zip(&vars64) {
            let want = g64.get(v64).unwrap().to_dtype(DType::F32).unwrap();
            let got = g32.get(v32).unwrap();
            assert_close(got, &want, 1e-5, 1e-4, &format!("{name}: d loss / d {n}"));
        }
    }
}

#[test]
fn training_gpt_neox_is_refused_with_the_reason() {
    let cfg = read_config(&fixture("neox_parallel")).unwrap();
    let varmap = VarMap::new();
    let err = Gpt::new(
        &cfg,
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("for inference"), "{err}");
    assert!(!err.contains("bias"), "a misleading hint: {err}");
}

/// Llama's configs, those of the families in its layout (Mistral, Qwen2, Qwen3, SmolLM3,
/// OLMo 2, Granite, Phi-3 with q/k/v and gate/up fused again), Gemma 2's and 3's (norms written back as `w`
/// for `1 + w`) and LFM2's are written as transformers reads them (`scripts/hf_roundtrip.py` loads the
/// written directories in transformers) and read back as the same model; what a family's
/// file cannot express is refused before anything is written.
#[test]
fn llama_configs_round_trip_and_others_are_refused() {
    for name in [
        "llama_gqa_bias",
        "llama_mqa_linear",
        "qwen3_qk_norm",
        "smollm3_nope",
        "olmo2_post_norm",
        "granite_multipliers",
        "gemma2_softcap",
        "gemma3_local_global",
        "lfm2_hybrid",
        "lfm2_conv_bias",
        "phi3_window",
        "phi4_longrope",
        "mistral_window",
        "qwen2_bias_window",
    ] {
        let model = load(&fixture(name), DType::F32);
        let dir =
            std::env::temp_dir().join(format!("gpt-blocks-save-{name}-{}", std::process::id()));
        gpt_blocks::save_dir(&model, &dir).unwrap();
        let again = load(&dir, DType::F32);
        assert!(again.config().same_model(model.config()), "{name}");
        let ids = Tensor::new(&TRAIN_IDS, &Device::Cpu).unwrap();
        let (a, b) = (
            model.infer(&ids, None, None, Logits::All).unwrap(),
            again.infer(&ids, None, None, Logits::All).unwrap(),
        );
        assert_eq!(max_abs_diff(&a, &b), 0.0, "{name}: logits after saving");
        std::fs::remove_dir_all(&dir).unwrap();
    }
    for name in ["neox_parallel", "neo_local"] {
        let dir =
            std::env::temp_dir().join(format!("gpt-blocks-save-{name}-{}", std::process::id()));
        let err = gpt_blocks::save_dir(&load(&fixture(name), DType::F32), &dir)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("are not saved") || err.contains("cannot be saved"),
            "{name}: {err}"
        );
        assert!(!dir.exists(), "{name}: nothing is written");
    }
    // A Llama-family model with a window has no Llama file.
    let mut cfg = read_config(&fixture("mistral_window")).unwrap();
    cfg.family = gpt_blocks::Family::Llama;
    let err = cfg.to_json().unwrap_err().to_string();
    assert!(err.contains("cannot express"), "{err}");
}

/// Loaded for inference (`LoadOptions::for_inference`, as `gpt` runs a checkpoint), a
/// model computes what the plain load's does: f32, f16 and bf16 read from the f32 files (converted as they
/// are read), and q8_0 quantized while loading; q/k/v and gate/up are one projection each
/// where the family stores them apart, holding the stored weights bit for bit; a full pass
/// and cached decoding. On the CPU every block matrix is a view of one buffer, each right
/// after the one before in the order the blocks use them (GPT-NeoX's q/k/v, regrouped into
/// a copy, aside), so fusing copied nothing.
#[test]
fn loading_for_inference_fuses_in_place_and_computes_the_same() {
    let dirs: Vec<PathBuf> = MODELS
        .iter()
        .map(|m| fixture(m))
        .chain([Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny")])
        .collect();
    for dir in &dirs {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let family = read_config(dir).unwrap().family;
        let regrouped = family == gpt_blocks::Family::GptNeox;
        let gated = read_config(dir).unwrap().gated_mlp;
        let cases = [
            (DType::F32, None, 1e-5),
            (DType::F16, None, 1e-4),
            (DType::BF16, None, 1e-4),
            (DType::F32, Some(GgmlDType::Q8_0), 1e-5),
        ];
        for (dtype, quantize, tol) in cases {
            let what = format!("{name}, {dtype:?}, {quantize:?}");
            let opts = LoadOptions {
                dtype,
                quantize,
                fused: false,
            };
            let plain = gpt_blocks::load(dir, opts, &Device::Cpu).unwrap();
            let fused = gpt_blocks::load(dir, opts.for_inference(), &Device::Cpu)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            // Fused wherever `Gpt::fused` fuses (quantized parts whose row tiles would not
            // line up stay apart: an MQA's 8-row keys).
            let after = plain.clone().fused().unwrap();
            // The first attention block (LFM2's first may be a convolution).
            let fusions = |m: &Gpt| {
                let block = m.blocks().iter().find(|b| b.attention().is_some()).unwrap();
                let (_, mixer, _, mlp) = block.parts();
                let attn = mixer.attention().unwrap();
                (attn.fused_qkv().is_some(), mlp.fused_gate_up().is_some())
            };
            assert_eq!(fusions(&fused), fusions(&after), "{what}: what is fused");
            if quantize.is_none() {
                assert_eq!(fusions(&fused), (true, gated), "{what}: what is fused");
            }
            // The quantized head (a tied model's table too), read and packed row by row,
            // holds what quantizing the whole matrix gives.
            assert_eq!(
                fused.lm_head().packed().is_some(),
                plain.lm_head().packed().is_some(),
                "{what}: head packed"
            );
            let head = |m: &Gpt| {
                m.lm_head()
                    .weight_t()
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap()
            };
            assert_close(
                &head(&fused),
                &head(&plain),
                0.0,
                0.0,
                &format!("{what}: head"),
            );
            let table = |m: &Gpt| m.wte().unwrap().to_dtype(DType::F32).unwrap();
            assert_close(
                &table(&fused),
                &table(&plain),
                0.0,
                0.0,
                &format!("{what}: table"),
            );
            if quantize.is_none() {
                // The parts hold the stored weights, fused or not.
                let (named, plain_named) = (fused.named_tensors(), plain.named_tensors());
                let (named, plain_named) = (named.unwrap(), plain_named.unwrap());
                assert_eq!(named.len(), plain_named.len(), "{what}");
                for (n, t) in &plain_named {
                    let f32 = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
                    assert_close(&f32(&named[n]), &f32(t), 0.0, 0.0, &format!("{what}: {n}"));
                }
                // Converted as read, to what Candle's `to_dtype` makes of the f32 weights.
                let f32_named = load(dir, DType::F32).named_tensors().unwrap();
                // Gemma's norms are held as their factors `1 + w`: rounded as those.
                let gemma = [gpt_blocks::Family::Gemma2, gpt_blocks::Family::Gemma3];
                let shift = match gemma.contains(&family) {
                    true => 1.0,
                    false => 0.0,
                };
                for (n, t) in &f32_named {
                    let s = if n.ends_with("norm.weight") {
                        shift
                    } else {
                        0.0
                    };
                    let want = t.affine(1.0, s).unwrap().to_dtype(dtype).unwrap();
                    let want = want.to_dtype(DType::F32).unwrap().affine(1.0, -s).unwrap();
                    let got = named[n].to_dtype(DType::F32).unwrap();
                    assert_close(&got, &want, 0.0, 0.0, &format!("{what}: {n} converted"));
                }
                views_of_one_buffer(&fused, !regrouped, &what);
            }
            // Half precision computes in f32 on the CPU, as `gpt` runs it.
            let run = |m: &Gpt| match dtype {
                DType::F32 => m.clone(),
                _ => m.with_f32_activations().unwrap(),
            };
            let (plain, fused) = (run(&plain), run(&fused));
            let exp = dir.join("expected.safetensors");
            let ids = &candle_core::safetensors::load(exp, &Device::Cpu).unwrap()["input_ids"];
            let want = plain.infer(ids, None, None, Logits::All).unwrap();
            let got = fused.infer(ids, None, None, Logits::All).unwrap();
            assert_close(&got, &want, tol, tol, &format!("{what}: full pass"));
            let stepped = stepped(&fused, ids);
            assert_close(
                &stepped,
                &want,
                tol,
                tol,
                &format!("{what}: cached decoding"),
            );
        }
    }
}

/// Every block matrix of `model` (q/k/v fused where `qkv`, the output projection, gate/up
/// or up, down) is a view of one CPU buffer, each right after the one before.
fn views_of_one_buffer(model: &Gpt, qkv: bool, what: &str) {
    let mut spans = Vec::new(); // (buffer, first element, elements)
    for block in model.blocks() {
        let (_, mixer, _, mlp) = block.parts();
        let (up, _, down) = mlp.parts();
        let mixing: Vec<&mha::Proj> = match mixer {
            gpt_blocks::Mixer::Attention(attn) => {
                let fused_qkv = attn.fused_qkv().filter(|_| qkv);
                fused_qkv.into_iter().chain([attn.out_proj()]).collect()
            }
            gpt_blocks::Mixer::ShortConv(conv) => {
                let (in_proj, _, _, out_proj) = conv.parts();
                vec![in_proj, out_proj]
            }
        };
        let projs = mixing
            .into_iter()
            .chain([mlp.fused_gate_up().unwrap_or(up), down]);
        for p in projs {
            let w = p.weight_t().unwrap();
            let (storage, layout) = w.storage_and_layout();
            let candle_core::Storage::Cpu(cpu) = &*storage else {
                panic!("{what}: not on the CPU")
            };
            let buffer = match w.dtype() {
                DType::F32 => cpu.as_slice::<f32>().unwrap().as_ptr() as usize,
                DType::F16 => cpu.as_slice::<half::f16>().unwrap().as_ptr() as usize,
                _ => cpu.as_slice::<half::bf16>().unwrap().as_ptr() as usize,
            };
            spans.push((buffer, layout.start_offset(), w.elem_count()));
        }
    }
    for (i, pair) in spans.windows(2).enumerate() {
        assert_eq!(
            pair[0].0,
            pair[1].0,
            "{what}: matrix {} in another buffer",
            i + 1
        );
        assert_eq!(
            pair[0].1 + pair[0].2,
            pair[1].1,
            "{what}: matrix {} not right after the one before",
            i + 1
        );
    }
}

/// Every test above on the paths a GPU takes (`GPT_GENERIC_PATHS=1`: the reference
/// attention, Candle's norms, rotations and products, the cache in the activations' dtype,
/// the per-row loop of `infer_rows`): each family against transformers, cached decoding,
/// padding, rows of different lengths. Not the test of how the CPU lays fused matrices
/// out in memory, which is the CPU's alone.
#[test]
fn every_test_on_the_generic_paths() {
    common::rerun_on_generic_paths(
        "every_test_on_the_generic_paths",
        &["loading_for_inference_fuses_in_place"],
        14,
    );
}
