//! Behaviour of the GPT model for any weights: cached decoding, padded batches, training,
//! gradients, post-norm blocks, sampling, and bad inputs.

// The tolerance helpers live with the mha tests.
#[path = "../../kernels/tests/common/mod.rs"]
mod common;

use candle_core::{DType, Device, ModuleT, Result, Tensor};
use candle_nn::{Optimizer, VarBuilder, VarMap};
use common::assert_close;
use gpt_blocks::{
    generate, GenerateOptions, Gpt, GptCache, GptConfig, Logits, NormPlacement, Sampler,
    SamplingParams,
};

const DEV: Device = Device::Cpu;

fn tiny(placement: NormPlacement) -> GptConfig {
    GptConfig {
        vocab_size: 50,
        n_positions: 40,
        n_embd: 16,
        n_layer: 2,
        n_head: 4,
        norm_placement: placement,
        ..GptConfig::gpt2()
    }
}

/// A model with random weights, biases and norms included.
fn model(cfg: &GptConfig, dtype: DType) -> (VarMap, Gpt) {
    let varmap = VarMap::new();
    let gpt = Gpt::new(cfg, VarBuilder::from_varmap(&varmap, dtype, &DEV)).unwrap();
    for (name, var) in varmap.data().lock().unwrap().iter() {
        if name.contains("bias") || name.contains("ln") {
            let noise = (Tensor::randn(0f32, 0.1, var.shape(), &DEV)
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
                + var.as_tensor())
            .unwrap();
            var.set(&noise).unwrap();
        }
    }
    (varmap, gpt)
}

/// [`model`]'s weights drawn from a fixed seed instead: GPT-2's initialisation (N(0, 0.02)
/// matrices, unit norms, zero biases) plus `model`'s N(0, 0.1) noise on norms and biases.
/// For bounds that hold for most draws but not all (a quantization error: over random
/// draws q8_0's error is 0.6–2% of the logits' range), so that every run on every machine
/// checks the same model.
fn seeded_model(cfg: &GptConfig) -> Result<(VarMap, Gpt)> {
    use proptest::prelude::RngExt;
    use proptest::test_runner::{RngAlgorithm, TestRng};
    let (varmap, gpt) = model(cfg, DType::F32);
    let mut rng = TestRng::deterministic_rng(RngAlgorithm::ChaCha);
    let vars = varmap.data().lock().unwrap();
    let mut names: Vec<&String> = vars.keys().collect();
    names.sort();
    for name in names {
        let var = &vars[name];
        let (mean, stdev) = match (name.contains("bias"), name.contains("ln")) {
            (true, _) => (0.0, 0.1),
            (false, true) => (1.0, 0.1),
            (false, false) => (0.0, 0.02),
        };
        // Box–Muller on two uniform draws.
        let values: Vec<f32> = (0..var.elem_count())
            .map(|_| {
                let (u, v): (f64, f64) = (rng.random(), rng.random());
                let z = (-2.0 * (1.0 - u).ln()).sqrt() * (std::f64::consts::TAU * v).cos();
                (mean + stdev * z) as f32
            })
            .collect();
        var.set(&Tensor::from_vec(values, var.shape(), &DEV)?)?;
    }
    drop(vars);
    Ok((varmap, gpt))
}

fn ids(rows: &[&[u32]]) -> Tensor {
    let t = rows[0].len();
    Tensor::from_vec(rows.concat(), (rows.len(), t), &DEV).unwrap()
}

#[test]
fn cached_decoding_equals_full_pass() -> Result<()> {
    for placement in [NormPlacement::Pre, NormPlacement::Post] {
        let cfg = tiny(placement);
        let (_vm, gpt) = model(&cfg, DType::F32);
        let seq = ids(&[
            &[3, 14, 15, 9, 26, 5, 35, 8, 9, 7],
            &[2, 7, 18, 28, 18, 28, 45, 9, 0, 4],
        ]);
        let full = gpt.infer(&seq, None, None, Logits::All)?;
        let mut cache = GptCache::new(&cfg, 4);
        let mut parts =
            vec![gpt.infer(&seq.narrow(1, 0, 4)?, None, Some(&mut cache), Logits::All)?];
        for t in 4..10 {
            parts.push(gpt.infer(&seq.narrow(1, t, 1)?, None, Some(&mut cache), Logits::Last)?);
        }
        assert_close(
            &Tensor::cat(&parts, 1)?,
            &full,
            1e-5,
            1e-4,
            &format!("{placement:?}"),
        );
    }
    Ok(())
}

/// Decoding after truncating the cache equals decoding from a cache that never held the
/// forgotten positions: what was appended past the cut is overwritten, not read. (The
/// server undoes a failed step so.) The cache starts small, so the wrong continuation also
/// grows its storage past the cut.
#[test]
fn truncated_cache_decodes_as_if_never_extended() -> Result<()> {
    let cfg = tiny(NormPlacement::Pre);
    let (_vm, gpt) = model(&cfg, DType::F32);
    let seq = ids(&[&[3, 14, 15, 9, 26, 5, 35, 8]]);
    let wrong = ids(&[&[40, 41, 42, 43, 44, 45]]);
    let mut clean = GptCache::new(&cfg, 2);
    gpt.infer(&seq.narrow(1, 0, 5)?, None, Some(&mut clean), Logits::All)?;
    let want = gpt.infer(&seq.narrow(1, 5, 3)?, None, Some(&mut clean), Logits::All)?;
    let mut cut = GptCache::new(&cfg, 2);
    gpt.infer(&seq.narrow(1, 0, 5)?, None, Some(&mut cut), Logits::All)?;
    gpt.infer(&wrong, None, Some(&mut cut), Logits::All)?;
    assert_eq!(cut.len(), 11);
    cut.truncate(5);
    assert_eq!(cut.len(), 5);
    cut.truncate(9); // not below the length: nothing changes
    assert_eq!(cut.len(), 5);
    let got = gpt.infer(&seq.narrow(1, 5, 3)?, None, Some(&mut cut), Logits::All)?;
    assert_close(&got, &want, 0.0, 0.0, "after truncate");
    Ok(())
}

#[test]
fn padded_batch_rows_equal_rows_run_alone() -> Result<()> {
    let cfg = tiny(NormPlacement::Pre);
    let (_vm, gpt) = model(&cfg, DType::F32);
    let prompts: Vec<Vec<u32>> = vec![vec![1, 2, 3, 4, 5, 6, 7], vec![9, 8], vec![30]];
    // Last-position logits of the padded prefill equal each prompt's own.
    let longest = 7;
    let mut flat = Vec::new();
    let mut keep = Vec::new();
    for p in &prompts {
        flat.extend(std::iter::repeat_n(0u32, longest - p.len()).chain(p.iter().copied()));
        keep.extend(
            std::iter::repeat_n(0u8, longest - p.len()).chain(std::iter::repeat_n(1, p.len())),
        );
    }
    let batch = Tensor::from_vec(flat, (3, longest), &DEV)?;
    let keep = Tensor::from_vec(keep, (3, longest), &DEV)?;
    let padded = gpt.infer(&batch, Some(&keep), None, Logits::Last)?;
    for (i, p) in prompts.iter().enumerate() {
        let alone = gpt.infer(&ids(&[p]), None, None, Logits::Last)?;
        assert_close(
            &padded.narrow(0, i, 1)?,
            &alone,
            1e-5,
            1e-4,
            &format!("row {i}"),
        );
    }
    // And generation, greedy and sampled.
    for sampling in [
        SamplingParams::default(),
        SamplingParams {
            temperature: 0.9,
            top_k: Some(20),
            top_p: Some(0.9),
            seed: 5,
            ..Default::default()
        },
    ] {
        let opts = GenerateOptions {
            max_new_tokens: 12,
            sampling,
            stop_tokens: vec![],
        };
        let together = generate(&gpt, &prompts, &opts, |_, _| true)?;
        for (i, p) in prompts.iter().enumerate() {
            let alone = generate(&gpt, std::slice::from_ref(p), &opts, |_, _| true)?;
            assert_eq!(together[i], alone[0], "row {i}, {:?}", opts.sampling);
        }
    }
    Ok(())
}

#[test]
fn generation_stops_and_sampling_repeats_under_a_seed() -> Result<()> {
    let cfg = tiny(NormPlacement::Pre);
    let (_vm, gpt) = model(&cfg, DType::F32);
    let sampling = SamplingParams {
        temperature: 1.0,
        seed: 11,
        ..Default::default()
    };
    let opts = GenerateOptions {
        max_new_tokens: 20,
        sampling: sampling.clone(),
        stop_tokens: vec![],
    };
    let a = generate(&gpt, &[vec![1, 2]], &opts, |_, _| true)?;
    let b = generate(&gpt, &[vec![1, 2]], &opts, |_, _| true)?;
    assert_eq!(a, b);
    let other = GenerateOptions {
        sampling: SamplingParams {
            seed: 12,
            ..sampling
        },
        ..opts.clone()
    };
    assert_ne!(a, generate(&gpt, &[vec![1, 2]], &other, |_, _| true)?);
    // A stop token ends the row, and is kept.
    let stop = a[0][3];
    let first = a[0].iter().position(|&t| t == stop).unwrap();
    let stopped = generate(
        &gpt,
        &[vec![1, 2]],
        &GenerateOptions {
            stop_tokens: vec![stop],
            ..opts.clone()
        },
        |_, _| true,
    )?;
    assert_eq!(stopped[0], a[0][..=first]);
    // The callback can end a row.
    let mut seen = 0;
    let cut = generate(&gpt, &[vec![1, 2]], &opts, |_, _| {
        seen += 1;
        seen < 4
    })?;
    assert_eq!(cut[0].len(), 4);
    Ok(())
}

/// Sampled frequencies match `softmax(logits / T)` (within 0.015 over 40,000 draws, about
/// six standard deviations), with and without top-k truncation; a `-inf` logit is never
/// drawn and `top_p = 1` cuts nothing.
#[test]
fn sampler_draws_from_the_softmax() -> Result<()> {
    let logits = [0.5f32, 2.0, f32::NEG_INFINITY, 1.0, 1.5];
    let t = 0.7;
    let want = |keep: &[usize]| -> Vec<f64> {
        let z: f64 = keep.iter().map(|&i| (logits[i] as f64 / t).exp()).sum();
        (0..logits.len())
            .map(|i| match keep.contains(&i) {
                true => (logits[i] as f64 / t).exp() / z,
                false => 0.0,
            })
            .collect()
    };
    for (top_k, top_p, keep) in [
        (None, None, vec![0, 1, 3, 4]),
        (None, Some(1.0), vec![0, 1, 3, 4]),
        (Some(2), None, vec![1, 4]),
    ] {
        let mut s = Sampler::new(SamplingParams {
            temperature: t,
            top_k,
            top_p,
            seed: 11,
            ..Default::default()
        })?;
        let n = 40_000;
        let mut counts = [0usize; 5];
        for _ in 0..n {
            counts[s.sample(&logits, &[])? as usize] += 1;
        }
        assert_eq!(counts[2], 0);
        for (i, w) in want(&keep).iter().enumerate() {
            let got = counts[i] as f64 / n as f64;
            assert!(
                (got - w).abs() < 0.015,
                "top_k {top_k:?}: token {i} drawn {got}, softmax {w}"
            );
        }
    }
    Ok(())
}

#[test]
fn sampler_follows_its_parameters() -> Result<()> {
    let logits = [1.0f32, 3.0, 3.0, 0.5, 2.9];
    // Greedy: ties go to the lowest id.
    assert_eq!(
        Sampler::new(SamplingParams::default())?.sample(&logits, &[])?,
        1
    );
    // Repeat penalty pushes a seen token down.
    let p = SamplingParams {
        repeat_penalty: 2.0,
        ..Default::default()
    };
    assert_eq!(Sampler::new(p)?.sample(&logits, &[1, 2])?, 4);
    // top-k 2 at a high temperature never leaves the two best.
    let p = SamplingParams {
        temperature: 5.0,
        top_k: Some(2),
        seed: 3,
        ..Default::default()
    };
    let mut s = Sampler::new(p)?;
    let draws: Vec<u32> = (0..200).map(|_| s.sample(&logits, &[]).unwrap()).collect();
    assert!(draws.iter().all(|&t| t == 1 || t == 2));
    assert!(draws.contains(&1) && draws.contains(&2));
    // A tiny top-p keeps only the most likely token.
    let p = SamplingParams {
        temperature: 1.0,
        top_p: Some(1e-6),
        seed: 3,
        ..Default::default()
    };
    let mut s = Sampler::new(p)?;
    assert!((0..50).all(|_| s.sample(&logits, &[]).unwrap() == 1));
    for bad in [
        SamplingParams {
            top_p: Some(0.0),
            ..Default::default()
        },
        SamplingParams {
            top_p: Some(1.5),
            ..Default::default()
        },
        SamplingParams {
            temperature: -1.0,
            ..Default::default()
        },
        SamplingParams {
            top_k: Some(0),
            ..Default::default()
        },
        SamplingParams {
            repeat_penalty: 0.0,
            ..Default::default()
        },
    ] {
        assert!(Sampler::new(bad).is_err());
    }
    assert!(Sampler::new(SamplingParams::default())?
        .sample(&[f32::NAN, 1.0], &[])
        .is_err());
    Ok(())
}

#[test]
fn training_lowers_the_loss() -> Result<()> {
    let cfg = GptConfig {
        resid_pdrop: 0.1,
        embd_pdrop: 0.1,
        attn_pdrop: 0.1,
        ..tiny(NormPlacement::Pre)
    };
    let (varmap, gpt) = model(&cfg, DType::F32);
    let text: Vec<u32> = (0..33).map(|i| (i * 7 % 13) as u32).collect();
    let batch = Tensor::from_vec(text, (1, 33), &DEV)?;
    let before = gpt.loss(&batch, false)?.to_scalar::<f32>()?;
    let mut opt = candle_nn::AdamW::new(
        varmap.all_vars(),
        candle_nn::ParamsAdamW {
            lr: 1e-2,
            ..Default::default()
        },
    )?;
    for _ in 0..30 {
        opt.backward_step(&gpt.loss(&batch, true)?)?;
    }
    let after = gpt.loss(&batch, false)?.to_scalar::<f32>()?;
    assert!(after < 0.5 * before, "loss {before} -> {after}");
    Ok(())
}

#[test]
fn gradients_match_finite_differences() -> Result<()> {
    let cfg = GptConfig {
        vocab_size: 11,
        n_positions: 8,
        n_embd: 8,
        n_layer: 2,
        n_head: 2,
        ..tiny(NormPlacement::Pre)
    };
    let (varmap, gpt) = model(&cfg, DType::F64);
    let batch = ids(&[&[1, 5, 2, 9, 3, 3], &[4, 0, 10, 7, 6, 1]]);
    // Sum of next-token log-probabilities, in f64 end to end.
    let log_likelihood = |g: &Gpt| -> Result<Tensor> {
        let logp = candle_nn::ops::log_softmax(&g.forward_t(&batch, false)?, 2)?;
        let targets = batch.narrow(1, 1, 5)?.unsqueeze(2)?.contiguous()?;
        logp.narrow(1, 0, 5)?
            .contiguous()?
            .gather(&targets, 2)?
            .sum_all()
    };
    let loss = |g: &Gpt| log_likelihood(g)?.to_scalar::<f64>();
    let loss_t = log_likelihood(&gpt)?;
    let grads = loss_t.backward()?;
    let vars = common::vars_of(&varmap);
    // Candle's tanh-GELU backward uses 6-digit constants: 1e-4 relative holds.
    let checked = common::check_gradients(&vars, &grads, 3, 1e-4, || loss(&gpt))?;
    assert!(
        checked >= vars.len() * 2,
        "{checked} coordinates for {} tensors",
        vars.len()
    );
    Ok(())
}

#[test]
fn bad_inputs_are_errors() -> Result<()> {
    let cfg = tiny(NormPlacement::Pre);
    let (_vm, gpt) = model(&cfg, DType::F32);
    let check = |ids: Tensor, needle: &str| {
        let err = gpt
            .infer(&ids, None, None, Logits::All)
            .unwrap_err()
            .to_string();
        assert!(err.contains(needle), "{err}");
    };
    check(
        Tensor::new(&[[1u32, 50]], &DEV)?,
        "token id 50 is outside the vocabulary",
    );
    check(Tensor::new(&[1u32, 2], &DEV)?, "[batch, seq]");
    check(
        Tensor::zeros((1, 41), DType::U32, &DEV)?,
        "41 tokens exceed the model's context of 40",
    );
    check(Tensor::new(&[[1i64, -3]], &DEV)?, "negative");
    check(Tensor::new(&[[1f32, 2.0]], &DEV)?, "integers");
    let keep = Tensor::ones((1, 3), DType::U8, &DEV)?;
    let err = gpt
        .infer(
            &Tensor::new(&[[1u32, 2]], &DEV)?,
            Some(&keep),
            None,
            Logits::All,
        )
        .unwrap_err();
    assert!(err.to_string().contains("attention mask must be"), "{err}");
    let opts = GenerateOptions {
        max_new_tokens: 39,
        sampling: SamplingParams::default(),
        stop_tokens: vec![],
    };
    let err = generate(&gpt, &[vec![1, 2]], &opts, |_, _| true).unwrap_err();
    assert!(
        err.to_string().contains("exceeds the model's context"),
        "{err}"
    );
    assert!(generate(&gpt, &[vec![]], &opts, |_, _| true).is_err());
    for bad in [
        GptConfig {
            n_head: 3,
            ..cfg.clone()
        },
        GptConfig {
            n_embd: 0,
            ..cfg.clone()
        },
        GptConfig {
            resid_pdrop: 1.0,
            ..cfg.clone()
        },
        GptConfig {
            layer_norm_epsilon: 0.0,
            ..cfg.clone()
        },
        GptConfig {
            vocab_size: 0,
            ..cfg.clone()
        },
    ] {
        assert!(
            Gpt::new(&bad, VarBuilder::zeros(DType::F32, &DEV)).is_err(),
            "{bad:?}"
        );
    }
    let err = GptConfig::from_json("{\"n_embd\": 10, \"n_head\": 4}").unwrap_err();
    assert!(err.to_string().contains("n_head=4"), "{err}");
    assert!(GptConfig::from_json("not json").is_err());
    // n_ctx alone is read as n_positions.
    let old = GptConfig::from_json("{\"n_ctx\": 77}")?;
    assert_eq!(old.n_positions, 77);
    Ok(())
}

#[test]
fn non_finite_weights_are_reported_by_layer_and_by_name() -> Result<()> {
    let cfg = tiny(NormPlacement::Pre);
    let (varmap, gpt) = model(&cfg, DType::F32);
    gpt.check_weights()?;
    let ids = ids(&[&[1, 2, 3]]);
    assert!(gpt.infer(&ids, None, None, Logits::All).is_ok());
    let var = varmap.data().lock().unwrap()["transformer.h.1.mlp.c_fc.weight"].clone();
    let mut w = var.as_tensor().flatten_all()?.to_vec1::<f32>()?;
    w[5] = f32::NAN;
    var.set(&Tensor::from_vec(w, var.shape(), &DEV)?)?;
    let err = gpt
        .infer(&ids, None, None, Logits::All)
        .unwrap_err()
        .to_string();
    assert!(err.contains("output of block 1"), "{err}");
    let err = gpt.check_weights().unwrap_err().to_string();
    assert!(err.contains("transformer.h.1.mlp.c_fc.weight"), "{err}");
    Ok(())
}

/// Quantized weights: close to the f32 model (q8_0 much closer than q4_0), cached decoding
/// consistent with the full pass, and projections whose input width does not fit the block
/// size kept dense (as llama.cpp's quantizer does) while the others are quantized.
#[test]
fn quantized_model_tracks_the_f32_model() -> Result<()> {
    use candle_core::quantized::GgmlDType;
    let cfg = GptConfig {
        n_embd: 64,
        ..tiny(NormPlacement::Pre)
    };
    let (_vm, gpt) = seeded_model(&cfg)?;
    let xs = ids(&[&[3, 1, 4, 1, 5, 9, 2, 6], &[2, 7, 1, 8, 2, 8, 1, 8]]);
    let dense = gpt.infer(&xs, None, None, Logits::All)?;
    let spread = common::flat(&dense)?
        .iter()
        .fold(0f32, |m, x| m.max(x.abs()));
    let mut errors = Vec::new();
    for dtype in [GgmlDType::Q8_0, GgmlDType::Q4_0] {
        let q = gpt.quantize(dtype)?;
        assert!(q.is_quantized() && !gpt.is_quantized());
        let logits = q.infer(&xs, None, None, Logits::All)?;
        errors.push(common::max_abs_diff(&logits, &dense) / spread);
        // Decoding token by token through the cache gives the full pass's logits, up to
        // the rounding of activations to 8 bits: one query row and eight take different
        // (equally exact) f32 arithmetic, and a last-bit difference can move an
        // activation to the neighbouring int8 level (a 1.5e-3 difference, once in ~150
        // runs). 0.5% of the logits' range is far above one such step and far below what
        // decoding without the cache gives.
        let mut cache = GptCache::new(q.config(), 8);
        for t in 0..8 {
            let step = q.infer(&xs.narrow(1, t, 1)?, None, Some(&mut cache), Logits::All)?;
            assert_close(
                &step,
                &logits.narrow(1, t, 1)?,
                5e-3 * spread,
                0.0,
                "quantized decode",
            );
        }
    }
    let (q8, q4) = (errors[0], errors[1]);
    assert!(q8 < 0.02, "q8_0 max logit error {q8} of the logits' range");
    assert!(q4 < 0.2, "q4_0 max logit error {q4} of the logits' range");
    assert!(
        q8 < q4 / 4.0,
        "q8_0 ({q8}) should be far closer than q4_0 ({q4})"
    );
    // Width 16 is not a multiple of the 32-wide blocks; the MLP's down projection (input
    // 4·16 = 64) is, and is the only one quantized.
    let (_vm, narrow) = seeded_model(&tiny(NormPlacement::Pre))?;
    let q = narrow.quantize(GgmlDType::Q8_0)?;
    assert!(q.is_quantized());
    let (projections, _) = q.blocks()[0].parts().3.projections();
    let quantized: Vec<_> = projections
        .iter()
        .map(|(n, p)| (*n, p.is_quantized()))
        .collect();
    assert_eq!(quantized, [("c_fc", false), ("c_proj", true)]);
    assert!(!q.lm_head().is_quantized());
    let xs = ids(&[&[3, 1, 4, 1]]);
    let (a, b) = (
        q.infer(&xs, None, None, Logits::All)?,
        narrow.infer(&xs, None, None, Logits::All)?,
    );
    assert_close(&a, &b, 0.05, 0.05, "partly quantized");
    Ok(())
}

/// A half-precision checkpoint run with f32 activations (how `gpt` runs one on the CPU)
/// gives the logits of the f32 model holding the same rounded values, to f32 rounding: the
/// full pass (the f32 GEMM on widened weights), and decoding through the cache (the
/// few-rows kernels reading half-precision weights). Its matrices and token table stay in
/// half precision.
#[test]
fn half_weights_with_f32_activations_equal_f32_on_the_same_values() -> Result<()> {
    // Pre-norm: the layout Hugging Face's GPT-2 files have, which `save_dir_as` writes.
    let placement = NormPlacement::Pre;
    let cfg = GptConfig {
        n_embd: 64,
        ..tiny(placement)
    };
    let (_vm, gpt) = model(&cfg, DType::F32);
    let dir = tempfile::tempdir().unwrap();
    for half in [DType::F16, DType::BF16] {
        gpt_blocks::save_dir_as(&gpt, dir.path(), half)?;
        let exact = gpt_blocks::load(dir.path(), DType::F32, &DEV)?;
        let mixed = gpt_blocks::load(dir.path(), half, &DEV)?.with_f32_activations()?;
        let what = format!("{placement:?} {half:?}");
        assert_eq!(mixed.dtype(), DType::F32, "{what}");
        assert_eq!(mixed.embedding().stored_dtype(), Some(half), "{what}");
        let (projections, _) = mixed.blocks()[0].parts().3.projections();
        for (name, p) in projections {
            assert_eq!(p.weight_t()?.dtype(), half, "{what}: {name}");
        }
        let seq = ids(&[
            &[3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 2, 4],
            &[2, 7, 18, 28, 18, 28, 45, 9, 0, 4, 1, 1],
        ]);
        let want = exact.infer(&seq, None, None, Logits::All)?;
        let full = mixed.infer(&seq, None, None, Logits::All)?;
        assert_eq!(full.dtype(), DType::F32);
        assert_close(&full, &want, 1e-5, 1e-4, &format!("{what}, full pass"));
        let mut cache = GptCache::new(&cfg, 4);
        let mut parts =
            vec![mixed.infer(&seq.narrow(1, 0, 3)?, None, Some(&mut cache), Logits::All)?];
        for t in 3..12 {
            parts.push(mixed.infer(&seq.narrow(1, t, 1)?, None, Some(&mut cache), Logits::All)?);
        }
        let cached = Tensor::cat(&parts, 1)?;
        assert_close(&cached, &want, 1e-5, 1e-4, &format!("{what}, decoding"));
    }
    Ok(())
}

/// Quantizing while loading (block by block) gives exactly the model that loading in
/// full precision and quantizing afterwards gives.
#[test]
fn quantizing_while_loading_equals_quantizing_after() -> Result<()> {
    use candle_core::quantized::GgmlDType;
    let cfg = GptConfig {
        n_embd: 64,
        ..tiny(NormPlacement::Pre)
    };
    let (_vm, gpt) = model(&cfg, DType::F32);
    let dir = tempfile::tempdir().unwrap();
    gpt_blocks::save_dir(&gpt, dir.path())?;
    let xs = ids(&[&[3, 1, 4, 1, 5, 9, 2, 6]]);
    for dtype in [GgmlDType::Q8_0, GgmlDType::Q4_0] {
        let load_as = gpt_blocks::LoadOptions::new(DType::F32).quantized(dtype);
        let on_load = gpt_blocks::load(dir.path(), load_as, &Device::Cpu)?;
        let after = gpt_blocks::load(dir.path(), DType::F32, &Device::Cpu)?.quantize(dtype)?;
        assert!(on_load.is_quantized());
        let a = on_load.infer(&xs, None, None, Logits::All)?;
        let b = after.infer(&xs, None, None, Logits::All)?;
        assert_eq!(common::max_abs_diff(&a, &b), 0.0, "{dtype:?}");
    }
    Ok(())
}

/// The tests above on the paths a GPU takes (`GPT_GENERIC_PATHS=1`).
#[test]
fn every_test_on_the_generic_paths() {
    common::rerun_on_generic_paths("every_test_on_the_generic_paths", &[], 13);
}
