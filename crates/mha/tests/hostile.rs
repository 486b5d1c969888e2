//! The public API under a caller who gets everything wrong: the same entry points as the
//! `mha_forward` fuzz target (fuzz/), driven by proptest so that CI runs them. Any
//! configuration, input rank and size (zero-sized included), dtype and mask must give a
//! result or an error, never a panic.

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use mha::{
    sdpa, sdpa_reference, KvCache, Mask, MhaConfig, MultiHeadAttention, SdpaParams, WeightLayout,
};
use proptest::prelude::*;

const DTYPES: [DType; 6] = [
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::F64,
    DType::U8,
    DType::U32,
];

fn tensor(dims: &[usize], dtype: DType) -> Tensor {
    Tensor::ones(dims, DType::F32, &Device::Cpu)
        .and_then(|t| t.to_dtype(dtype))
        .unwrap()
}

/// Any rank up to 4, but mostly `rank`: most inputs should get past the rank checks.
fn dims_of_rank(rank: usize) -> impl Strategy<Value = Vec<usize>> {
    prop_oneof![
        3 => prop::collection::vec(0usize..6, rank),
        1 => prop::collection::vec(0usize..6, 0..5),
    ]
}

fn dims() -> impl Strategy<Value = Vec<usize>> {
    dims_of_rank(3)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 256,
        rng_algorithm: proptest::test_runner::RngAlgorithm::ChaCha,
        // A fixed seed keeps CI repeatable; PROPTEST_RNG_SEED=<n> searches elsewhere.
        rng_seed: match ProptestConfig::default().rng_seed {
            proptest::test_runner::RngSeed::Random => {
                proptest::test_runner::RngSeed::Fixed(0x5eed0001)
            }
            chosen => chosen,
        },
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn attention_never_panics(
        d_model in 0usize..9,
        n_heads in 0usize..5,
        n_kv_heads in prop::option::of(0usize..5),
        kdim in prop::option::of(0usize..9),
        dropout in prop_oneof![4 => Just(0.0f32), 2 => Just(0.5), 1 => Just(1.0), 1 => Just(f32::NAN), 1 => Just(-1.0)],
        layout in 0usize..4,
        mut q in dims(), mut k in prop::option::of(dims()), mut v in prop::option::of(dims()),
        fit_widths in prop::bool::weighted(0.8),
        dtype in prop_oneof![3 => Just(0usize), 1 => 0usize..6],
        causal in prop::option::of(prop_oneof![0usize..4, Just(usize::MAX)]),
        padding in prop::option::of((any::<bool>(), dims_of_rank(2), 0usize..6)),
        additive in prop::option::of(dims()),
        mode in 0usize..3,
        train in any::<bool>(),
        rope in prop::option::of((prop_oneof![Just(10_000.0f64), Just(0.5), Just(f64::NAN), Just(f64::INFINITY)], prop::option::of(0usize..10), prop_oneof![Just(1.0f64), Just(0.0), Just(-2.0)])),
        window in prop::option::of(prop_oneof![0usize..4, Just(usize::MAX)]),
        mask_window in prop::option::of(prop_oneof![0usize..4, Just(usize::MAX)]),
    ) {
        let rope = rope.map(|(theta, rotary_dim, factor)| mha::RopeConfig {
            theta,
            rotary_dim,
            scaling: if factor == 1.0 { mha::RopeScaling::None } else { mha::RopeScaling::Linear { factor } },
        });
        let cfg = MhaConfig { n_kv_heads, kdim, dropout, rope, window, ..MhaConfig::new(d_model, n_heads) };
        let layout = [
            WeightLayout::hf(),
            WeightLayout::Gpt2Conv1d,
            WeightLayout::TorchInProj,
            WeightLayout::HeadInterleavedQkv { qkv: "query_key_value".into(), o: "dense".into() },
        ][layout].clone();
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let Ok(attn) = MultiHeadAttention::load(&cfg, &layout, vb) else { return Ok(()) };
        if fit_widths {
            // Most calls get the widths right, so that the masks and dtypes are reached.
            for (dims, width) in [(&mut q, cfg.d_model), (k.as_mut().unwrap_or(&mut vec![]), cfg.k_dim()), (v.as_mut().unwrap_or(&mut vec![]), cfg.v_dim())] {
                if let Some(last) = dims.last_mut() {
                    *last = width;
                }
            }
        }
        let dt = DTYPES[dtype];
        let q = tensor(&q, dt);
        let k = k.map(|d| tensor(&d, dt));
        let v = v.map(|d| tensor(&d, dt));
        let (k, v) = (k.as_ref().unwrap_or(&q), v.as_ref().unwrap_or(&q));
        let padding = padding.map(|(keep, d, t)| (keep, tensor(&d, DTYPES[t])));
        let additive = additive.map(|d| tensor(&d, dt));
        let mut mask = Mask { causal, window: mask_window, ..Mask::NONE };
        if let Some((keep, t)) = &padding {
            mask = if *keep { mask.with_keep(t) } else { mask.with_ignore(t) };
        }
        if let Some(a) = &additive {
            mask = mask.with_additive(a);
        }
        match mode {
            0 => { let _ = attn.forward(&q, k, v, &mask, train); }
            1 => { let _ = attn.forward_with_weights(&q, k, v, &mask, train); }
            _ => {
                let mut cache = KvCache::new(2);
                for _ in 0..3 {
                    let _ = attn.forward_cached(&q, k, v, &mask, &mut cache);
                }
            }
        }
    }

    #[test]
    fn sdpa_never_panics(
        (b, h, h_kv, tq, tk, d) in (0usize..3, 0usize..5, 0usize..5, 0usize..5, 0usize..5, 0usize..5),
        wrong in prop::option::of((0usize..3, dims_of_rank(4))),
        dtype in prop_oneof![3 => Just(0usize), 1 => 0usize..6],
        causal in prop::option::of(0usize..4),
        keep in prop::option::of(dims_of_rank(2)),
        weights in any::<bool>(),
    ) {
        let dt = DTYPES[dtype];
        let mut shapes = [vec![b, h, tq, d], vec![b, h_kv, tk, d], vec![b, h_kv, tk, d]];
        if let Some((which, dims)) = wrong {
            shapes[which] = dims;
        }
        let [q, k, v] = shapes.map(|s| tensor(&s, dt));
        let keep = keep.map(|s| tensor(&s, DType::U8));
        let mut mask = Mask { causal, ..Mask::NONE };
        if let Some(keep) = &keep {
            mask = mask.with_keep(keep);
        }
        let params = SdpaParams { scale: 0.5, dropout: None, train: false, need_weights: weights };
        let fast = sdpa(&q, &k, &v, &mask, &params);
        let reference = sdpa_reference(&q, &k, &v, &mask, &params);
        // Both paths agree on whether the arguments are valid.
        prop_assert_eq!(fast.is_ok(), reference.is_ok());
        // The fused kernel, called directly, refuses what the reference refuses (shapes
        // that do not fit, heads that do not divide) rather than reading past its inputs.
        if let Ok(kernel) = mha::flash::flash_attn_cpu(&q, &k, &v, &mask, 0.5) {
            let (reference, _) = reference.expect("the kernel took what the reference refused");
            prop_assert_eq!(kernel.dims(), reference.dims());
        }
    }
}

/// Zero-sized inputs that are well-formed give well-formed, empty or zero results.
#[test]
fn zero_sized_inputs_are_fine() {
    let cfg = MhaConfig::new(8, 2);
    let varmap = VarMap::new();
    let attn = MultiHeadAttention::new(
        &cfg,
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )
    .unwrap();
    let empty_batch = tensor(&[0, 3, 8], DType::F32);
    assert_eq!(
        attn.forward(
            &empty_batch,
            &empty_batch,
            &empty_batch,
            &Mask::causal(0),
            false
        )
        .unwrap()
        .dims(),
        &[0, 3, 8]
    );
    let no_queries = tensor(&[2, 0, 8], DType::F32);
    let kv = tensor(&[2, 3, 8], DType::F32);
    assert_eq!(
        attn.forward(&no_queries, &kv, &kv, &Mask::NONE, false)
            .unwrap()
            .dims(),
        &[2, 0, 8]
    );
    // No keys at all: every query attends to nothing, which is zeros (not NaN) before the
    // output projection, so the output is the output bias.
    let q = tensor(&[2, 3, 8], DType::F32);
    let no_keys = tensor(&[2, 0, 8], DType::F32);
    let out = attn
        .forward(&q, &no_keys, &no_keys, &Mask::NONE, false)
        .unwrap();
    assert_eq!(out.dims(), &[2, 3, 8]);
    let finite = out
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .all(|x| x.is_finite());
    assert!(finite);
}

/// Cached steps of zero new positions, found by `attention_never_panics`: with the fused
/// `c_attn` layout the keys are a view at an offset into an empty product, and copying
/// such a view into the cache indexed past the end of its storage inside Candle.
#[test]
fn empty_cached_steps_are_fine() {
    let cfg = MhaConfig::new(1, 1);
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let attn = MultiHeadAttention::load(&cfg, &WeightLayout::Gpt2Conv1d, vb).unwrap();
    let mut cache = KvCache::new(2);
    let empty = tensor(&[1, 0, 1], DType::F32);
    for _ in 0..3 {
        let out = attn
            .forward_cached(&empty, &empty, &empty, &Mask::NONE, &mut cache)
            .unwrap();
        assert_eq!(out.dims(), &[1, 0, 1]);
    }
    assert_eq!(cache.len(), 0);
    // An empty step after real ones leaves the cache as it was.
    let x = tensor(&[1, 2, 1], DType::F32);
    attn.forward_cached(&x, &x, &x, &Mask::causal(0), &mut cache)
        .unwrap();
    let out = attn
        .forward_cached(&empty, &empty, &empty, &Mask::causal(2), &mut cache)
        .unwrap();
    assert_eq!(out.dims(), &[1, 0, 1]);
    assert_eq!(cache.len(), 2);
}

/// A checkpoint that does not fit the config is an error that says what to change: the
/// layout whose names the file has, `bias: false`, `kdim`/`vdim`; biases the config would
/// leave unread, and PyTorch's `add_bias_kv`, are refused rather than giving wrong outputs.
#[test]
fn mismatched_checkpoints_name_the_fix() {
    use candle_nn::VarBuilder;
    use mha::{MhaConfig, MultiHeadAttention, WeightLayout};
    use std::collections::HashMap;
    let d = 8;
    let t = |dims: &[usize]| Tensor::zeros(dims, DType::F32, &Device::Cpu).unwrap();
    let torch = |bias: bool, extra: &[(&str, &[usize])]| {
        let mut m: HashMap<String, Tensor> = HashMap::new();
        m.insert("in_proj_weight".into(), t(&[3 * d, d]));
        m.insert("out_proj.weight".into(), t(&[d, d]));
        if bias {
            m.insert("in_proj_bias".into(), t(&[3 * d]));
            m.insert("out_proj.bias".into(), t(&[d]));
        }
        for (name, dims) in extra {
            m.insert(name.to_string(), t(dims));
        }
        m
    };
    let load = |cfg: &MhaConfig, layout: &WeightLayout, m: HashMap<String, Tensor>| {
        let vb = VarBuilder::from_tensors(m, DType::F32, &Device::Cpu);
        MultiHeadAttention::load(cfg, layout, vb)
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    let cfg = MhaConfig::new(d, 2);
    let no_bias = MhaConfig {
        bias: false,
        ..cfg.clone()
    };
    assert!(load(&cfg, &WeightLayout::TorchInProj, torch(true, &[])).is_ok());
    assert!(load(&no_bias, &WeightLayout::TorchInProj, torch(false, &[])).is_ok());
    for (cfg, layout, file, needle) in [
        (
            &cfg,
            WeightLayout::hf(),
            torch(true, &[]),
            "use WeightLayout::TorchInProj",
        ),
        (
            &cfg,
            WeightLayout::Gpt2Conv1d,
            torch(true, &[]),
            "use WeightLayout::TorchInProj",
        ),
        (
            &cfg,
            WeightLayout::TorchInProj,
            torch(false, &[]),
            "set `bias: false`",
        ),
        (
            &no_bias,
            WeightLayout::TorchInProj,
            torch(true, &[]),
            "set `bias: true`",
        ),
        (
            &cfg,
            WeightLayout::TorchInProj,
            torch(true, &[("bias_k", &[1, 1, d]), ("bias_v", &[1, 1, d])]),
            "add_bias_kv=True",
        ),
        (
            &MhaConfig {
                kdim: Some(4),
                vdim: Some(4),
                ..cfg.clone()
            },
            WeightLayout::TorchInProj,
            torch(true, &[]),
            "leave `kdim` and `vdim` unset",
        ),
    ] {
        let err = load(cfg, &layout, file).expect_err(needle);
        assert!(err.contains(needle), "{needle:?} not in {err:?}");
    }
    // A forgotten kdim: the file has PyTorch's separate projections.
    let mut m: HashMap<String, Tensor> = HashMap::new();
    m.insert("q_proj_weight".into(), t(&[d, d]));
    m.insert("k_proj_weight".into(), t(&[d, 4]));
    m.insert("v_proj_weight".into(), t(&[d, 4]));
    m.insert("in_proj_bias".into(), t(&[3 * d]));
    m.insert("out_proj.weight".into(), t(&[d, d]));
    m.insert("out_proj.bias".into(), t(&[d]));
    let err = load(&cfg, &WeightLayout::TorchInProj, m.clone()).unwrap_err();
    assert!(err.contains("set `kdim` and `vdim`"), "{err}");
    let with_kdim = MhaConfig {
        kdim: Some(4),
        vdim: Some(4),
        ..cfg.clone()
    };
    assert!(load(&with_kdim, &WeightLayout::TorchInProj, m).is_ok());
}

/// Rotating no positions in training (a variable, the differentiable op) gives no
/// positions back, not a panic (a zero-sized chunk; found by `attention_never_panics`).
#[test]
fn rotating_no_positions_while_training_is_fine() {
    let dev = Device::Cpu;
    let rope = mha::Rope::new(&mha::RopeConfig::default(), 2).unwrap();
    let tables = rope.tables_from(1, 0, 0, &dev).unwrap();
    let xs = candle_core::Var::zeros((1, 1, 0, 2), DType::F32, &dev).unwrap();
    let ys = rope.apply(xs.as_tensor(), &tables).unwrap();
    assert_eq!(ys.dims(), &[1, 1, 0, 2]);
}

/// Positions past `u32::MAX`, the end included, are refused by name, never wrapped; an
/// offset of `usize::MAX` (a hostile causal mask's) must not overflow on the way.
#[test]
fn rotating_positions_past_u32_is_an_error() {
    let dev = Device::Cpu;
    let rope = mha::Rope::new(&mha::RopeConfig::default(), 2).unwrap();
    let last = u32::MAX as usize;
    assert!(rope.tables_from(1, 1, last - 1, &dev).is_ok());
    for (t, offset) in [(1, last), (2, last - 1), (1, usize::MAX), (usize::MAX, 1)] {
        let err = rope
            .tables_from(1, t, offset, &dev)
            .unwrap_err()
            .to_string();
        assert!(err.contains("positions beyond"), "{t} at {offset}: {err}");
    }
}
