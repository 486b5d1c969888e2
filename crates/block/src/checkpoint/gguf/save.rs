//! Writing a model as a GGUF file llama.cpp runs: each family's llama.cpp names, its
//! metadata, the tokenizer and chat template.

use std::fs::File;
use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{bail, DType, Device, Result, Tensor};
use mha::{Proj, RopeConfig, RopeScaling};

use super::rope::{inv_freqs, rotary_order, select_rows};
use super::vocab::{vocab_metadata, GgufVocab};
use crate::checkpoint::io::{path_err, write_atomic};
use crate::config::{Activation, NormKind, NormPlacement};
use crate::family::names::{gguf, Name};
use crate::family::Family;
use crate::model::Gpt;
use crate::parts::norm::Norm;

/// llama.cpp's `general.file_type` of a model whose matrices are `dtype`.
fn file_type(dtype: GgmlDType) -> u32 {
    match dtype {
        GgmlDType::F32 => 0,
        GgmlDType::F16 => 1,
        GgmlDType::Q4_0 => 2,
        GgmlDType::Q4_1 => 3,
        GgmlDType::Q8_0 => 7,
        GgmlDType::Q5_0 => 8,
        GgmlDType::Q5_1 => 9,
        GgmlDType::Q2K => 10,
        GgmlDType::Q3K => 12,
        GgmlDType::Q4K => 15,
        GgmlDType::Q5K => 17,
        GgmlDType::Q6K => 18,
        GgmlDType::BF16 => 32,
        GgmlDType::Q8_1 | GgmlDType::Q8K => 7,
    }
}

/// Writes `model` as a GGUF file that llama.cpp loads: its tensor names, its metadata for
/// the family, matrices in `dtype` (those whose rows are not whole blocks of it in a
/// k-quant's fallback, else f16, as llama.cpp's quantizer falls back; see
/// [`Proj::quantized_as`]), norms, biases and learned positions in f32, and the
/// tokenizer (`vocab`) and chat template when given. Llama's query and key rows are put in
/// llama.cpp's rotary order. Written to a temporary name and renamed.
///
/// Families and options llama.cpp cannot express are refused: GPT-Neo, sliding windows,
/// norms placed otherwise than the architecture's, q/k norms, rotation-free layers or
/// multipliers where it has none, GPT-2 without its tanh GELU or with per-layer score
/// scaling.
pub fn save_gguf(
    model: &Gpt,
    path: &Path,
    dtype: GgmlDType,
    vocab: Option<&GgufVocab>,
    chat_template: Option<&str>,
) -> Result<()> {
    let cfg = model.config();
    let Some(arch) = cfg.family.gguf_arch() else {
        bail!(
            "{} models are not written as GGUF (llama.cpp has no such architecture, or runs it otherwise: its phi3 without windows)",
            cfg.family.model_type()
        )
    };
    // llama.cpp's Gemma 2 and 3 read one window and a flag per layer; the others none.
    let gemma = matches!(cfg.family, Family::Gemma2 | Family::Gemma3);
    let windows: Vec<Option<usize>> = (0..cfg.n_layer).map(|i| cfg.window(i)).collect();
    let window = windows.iter().flatten().next().copied();
    if let Some(w) = window {
        if !gemma {
            bail!("llama.cpp's {arch} architecture has no sliding-window attention")
        }
        if windows.iter().flatten().any(|&x| x != w) {
            bail!("llama.cpp's {arch} architecture has one window for all its windowed layers")
        }
    }
    if cfg
        .rope
        .as_ref()
        .is_some_and(|r| matches!(r.scaling, RopeScaling::LongRope { .. }))
        && cfg.family != Family::Phi3
    {
        bail!("llama.cpp's {arch} architecture has no LongRoPE scaling (its phi3 has)")
    }
    if let Some(local) = &cfg.rope_local {
        let same_dims = cfg.rope.as_ref().map(|r| r.rotary_dim) == Some(local.rotary_dim);
        if !gemma || local.scaling != RopeScaling::None || !same_dims {
            bail!("llama.cpp's {arch} architecture cannot rotate windowed layers differently (its Gemma 3 takes another base, unscaled)")
        }
    }
    if cfg.final_logit_softcapping.is_some() && !gemma {
        bail!("llama.cpp's {arch} architecture has no soft cap on the logits")
    }
    if cfg.attn_logit_softcapping.is_some() && cfg.family != Family::Gemma2 {
        bail!("llama.cpp's {arch} architecture has no soft cap on the attention scores")
    }
    let placement = match cfg.family {
        Family::Olmo2 => NormPlacement::PostBranch,
        Family::Gemma2 | Family::Gemma3 => NormPlacement::Sandwich,
        _ => NormPlacement::Pre,
    };
    if cfg.norm_placement != placement || cfg.scale_attn_by_inverse_layer_idx {
        bail!(
            "llama.cpp's {arch} architecture has {placement:?} norms and its own score scale only"
        )
    }
    let qk_norm = match cfg.family {
        Family::Qwen3 | Family::Gemma3 | Family::Lfm2 => Some(true),
        Family::Olmo2 => Some(false),
        _ => None,
    };
    if cfg.qk_norm.map(|n| n.per_head) != qk_norm {
        bail!(
            "llama.cpp's {arch} architecture reads q/k norms {}",
            match qk_norm {
                Some(true) => "over each head",
                Some(false) => "over the whole projection",
                None => "nowhere",
            }
        )
    }
    // llama.cpp's SmolLM3 leaves out the rotation in every fourth layer, and only there.
    let nope = |i: usize| cfg.family == Family::SmolLm3 && (i + 1).is_multiple_of(4);
    if cfg.rope.is_some()
        && (0..cfg.n_layer.min(4096))
            .filter(|&i| !cfg.is_conv(i))
            .any(|i| cfg.layer_rope(i).is_none() != nope(i))
    {
        bail!("llama.cpp's {arch} architecture cannot say which layers rotate (its SmolLM3 skips every fourth)")
    }
    let scaled = cfg.attn_scale.is_some()
        || [
            cfg.embedding_multiplier,
            cfg.residual_multiplier,
            cfg.logits_scaling,
        ] != [1.0; 3];
    if gemma {
        // llama.cpp fixes Gemma's scales: embeddings times sqrtf(width), scores times
        // 1/sqrtf(head width) (the 27B, 62 layers of Gemma 3 or 46 of Gemma 2: width /
        // heads).
        let head = match (cfg.n_layer, cfg.family) {
            (62, Family::Gemma3) | (46, Family::Gemma2) => cfg.n_embd / cfg.n_head.max(1),
            _ => cfg.head_dim(),
        };
        let near = |x: f64, y: f32| (x - y as f64).abs() <= 1e-6 * x.abs();
        let fits = near(cfg.embedding_multiplier, (cfg.n_embd as f32).sqrt())
            && near(cfg.attn_scale.unwrap_or(0.0), 1.0 / (head as f32).sqrt())
            && [cfg.residual_multiplier, cfg.logits_scaling] == [1.0; 2]
            && cfg.activation_function == Activation::GeluNew;
        if !fits {
            bail!("llama.cpp's {arch} architecture fixes the embedding scale (sqrt of the width), the score scale (1/sqrt of the head width) and the tanh GELU; this model differs")
        }
    } else if scaled && cfg.family != Family::Granite {
        bail!("llama.cpp's {arch} architecture has no embedding, attention, residual or logit multipliers")
    }
    if cfg.family == Family::Gpt2 && cfg.activation_function != Activation::GeluNew {
        bail!(
            "llama.cpp's gpt2 architecture uses the tanh GELU (gelu_new), not {:?}",
            cfg.activation_function
        )
    }
    let dev = Device::Cpu;
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let mut dense = |name: String, t: &Tensor| -> Result<()> {
        let t = t.to_device(&dev)?.to_dtype(DType::F32)?.contiguous()?;
        tensors.push((name, QTensor::quantize(&t, GgmlDType::F32)?));
        Ok(())
    };
    // A matrix `[out, in]` in `dtype`, or where its rows are not whole blocks of it a
    // k-quant's fallback (as llama.cpp's quantizer), else f16.
    let matrix = |w: &Tensor| -> Result<QTensor> {
        let w = w.to_device(&dev)?.to_dtype(DType::F32)?.contiguous()?;
        let q = Proj::quantized_as(dtype, w.dim(1)?).unwrap_or(GgmlDType::F16);
        QTensor::quantize(&w, q)
    };
    let mut matrices: Vec<(String, QTensor)> = Vec::new();
    let mut proj = |name: String, p: &Proj, heads: usize| -> Result<Option<(String, Tensor)>> {
        // [in, out] -> [out, in]
        let mut w = p.weight_t()?.t()?.contiguous()?;
        let mut b = p.bias().cloned();
        if heads > 0 && cfg.family.gguf_permutes_qk() {
            let order = rotary_order(w.dim(0)?, heads, true)?;
            w = select_rows(&w, &order)?;
            b = b.map(|b| select_rows(&b, &order)).transpose()?;
        }
        matrices.push((format!("{name}.weight"), matrix(&w)?));
        Ok(b.map(|b| (format!("{name}.bias"), b)))
    };
    let mut biases: Vec<(String, Tensor)> = Vec::new();
    let norm = |biases: &mut Vec<(String, Tensor)>, name: &str, x: &Norm| {
        biases.push((format!("{name}.weight"), x.weight().clone()));
        if let Some(b) = x.bias() {
            biases.push((format!("{name}.bias"), b.clone()));
        }
    };
    let n = cfg.family.names();
    let (a, m) = (&n.attn_proj, &n.mlp_proj);
    for (i, block) in model.blocks().iter().enumerate() {
        let blk = |part: Name| n.gguf_block(i, part);
        let (ln_1, mixer, ln_2, mlp) = block.parts();
        norm(&mut biases, &blk(n.attn_norm), ln_1);
        norm(&mut biases, &blk(n.mlp_norm), ln_2);
        let attn = match (mixer, n.short_conv) {
            (crate::parts::mixer::Mixer::Attention(attn), _) => attn,
            (crate::parts::mixer::Mixer::ShortConv(conv), Some(sc)) => {
                // llama.cpp's shortconv: the taps [d, L] and the two projections, no biases.
                let (in_proj, taps, bias, out_proj) = conv.parts();
                if bias.is_some() || in_proj.bias().is_some() || out_proj.bias().is_some() {
                    bail!("llama.cpp's {arch} architecture has no biases in its convolution blocks")
                }
                biases.push((format!("{}.weight", blk(sc.conv)), taps.clone()));
                let mut parts = vec![
                    proj(blk(sc.in_proj), in_proj, 0)?,
                    proj(blk(sc.out_proj), out_proj, 0)?,
                ];
                let (up, gate, down) = mlp.parts();
                match (gate, m.gate) {
                    (Some(g), Some(name)) => parts.push(proj(blk(name), g, 0)?),
                    _ => bail!("{:?} convolution blocks need a gated MLP", cfg.family),
                }
                parts.push(proj(blk(m.up), up, 0)?);
                parts.push(proj(blk(m.down), down, 0)?);
                biases.extend(parts.into_iter().flatten());
                continue;
            }
            (crate::parts::mixer::Mixer::ShortConv(_), None) => {
                bail!("block {i} is a short convolution, which llama.cpp's {arch} has not")
            }
        };
        if let Some((post_attn, post_mlp)) = block.post_norms() {
            norm(&mut biases, &blk(n.attn_post_norm), post_attn);
            norm(&mut biases, &blk(n.mlp_post_norm), post_mlp);
        }
        if let Some((q, k)) = attn.qk_norm() {
            biases.push((format!("{}.weight", blk(a.q_norm)), q.clone()));
            biases.push((format!("{}.weight", blk(a.k_norm)), k.clone()));
        }
        let mut parts = Vec::new();
        match attn.fused_qkv() {
            Some(qkv) => parts.push(proj(blk(a.qkv), qkv, 0)?),
            None => {
                let [q, k, v] = attn.qkv_proj();
                parts.push(proj(blk(a.q), q, cfg.n_head)?);
                parts.push(proj(blk(a.k), k, cfg.kv_heads())?);
                parts.push(proj(blk(a.v), v, 0)?);
            }
        }
        parts.push(proj(blk(a.o), attn.out_proj(), 0)?);
        let (up, gate, down) = mlp.parts();
        match (gate, m.gate, n.stored_fused) {
            // Phi-3: llama.cpp's ffn_up holds the gate's rows, then the up projection's.
            (Some(g), Some(_), Some(_)) => {
                if g.bias().is_some() || up.bias().is_some() {
                    bail!("llama.cpp's {arch} architecture has no MLP biases")
                }
                let rows = |p: &Proj| -> Result<Tensor> { p.weight_t()?.t()?.contiguous() };
                let w = Tensor::cat(&[rows(g)?, rows(up)?], 0)?;
                parts.push(proj(blk(m.up), &Proj::from_linear(&w, None)?, 0)?);
            }
            (Some(g), Some(name), None) => {
                parts.push(proj(blk(name), g, 0)?);
                parts.push(proj(blk(m.up), up, 0)?);
            }
            (Some(_), None, _) => bail!("{:?} models have no gated MLP", cfg.family),
            (None, _, _) => parts.push(proj(blk(m.up), up, 0)?),
        }
        parts.push(proj(blk(m.down), down, 0)?);
        biases.extend(parts.into_iter().flatten());
    }
    if let Some(ln_f) = model.ln_f() {
        norm(&mut biases, n.final_norm.gguf, ln_f);
    }
    if !cfg.tie_word_embeddings {
        proj(n.head.gguf.into(), model.lm_head(), 0)?;
    }
    let weight = |name: &str| format!("{name}.weight");
    matrices.push((weight(n.embed.gguf), matrix(&model.wte()?)?));
    if let Some(wpe) = model.wpe() {
        dense(weight(n.positions.gguf), wpe)?;
    }
    if let Some(
        rope @ RopeConfig {
            scaling: RopeScaling::Llama3 { .. },
            ..
        },
    ) = &cfg.rope
    {
        // llama.cpp reads Llama 3's scaling as one divisor per frequency.
        let dim = rope.rotary_dim.unwrap_or(cfg.head_dim());
        let divisors: Vec<f32> = inv_freqs(rope.theta, dim)
            .into_iter()
            .map(|f| f / rope.scaling.apply(f))
            .collect();
        dense(weight(gguf::ROPE_FREQS), &Tensor::new(divisors, &dev)?)?;
    }
    if let Some(RopeConfig {
        scaling:
            RopeScaling::LongRope {
                short_factor,
                long_factor,
                ..
            },
        ..
    }) = &cfg.rope
    {
        // Phi-3's LongRoPE: one divisor per frequency for each context range.
        for (name, f) in [
            (gguf::ROPE_FACTORS_LONG, long_factor),
            (gguf::ROPE_FACTORS_SHORT, short_factor),
        ] {
            let f: Vec<f32> = f.iter().map(|&x| x as f32).collect();
            dense(weight(name), &Tensor::new(f, &dev)?)?;
        }
    }
    for (name, t) in &biases {
        dense(name.clone(), t)?;
    }
    tensors.extend(matrices);

    let key = |k: &str| format!("{arch}.{k}");
    let u32v = |n: usize| -> Result<Value> {
        u32::try_from(n)
            .map(Value::U32)
            .map_err(|_| candle_core::Error::Msg(format!("{n} does not fit a GGUF u32")))
    };
    let head_dim = cfg.head_dim();
    // llama.cpp reads "phi3" in a model's name as Phi-3's SentencePiece vocabulary and
    // looks its `</s>`, `<unk>`, `<s>` and `<|endoftext|>` up (a Phi-4-mini's has not them).
    let phi3_vocab = vocab.is_some_and(|v| {
        ["</s>", "<unk>", "<s>", "<|endoftext|>"]
            .iter()
            .all(|t| v.tokens.iter().any(|x| x == t))
    });
    let name = match cfg.family {
        Family::Phi3 if !phi3_vocab => "phi",
        f => f.model_type(),
    };
    let mut meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        ("general.name".into(), Value::String(name.into())),
        ("general.file_type".into(), Value::U32(file_type(dtype))),
        (key("context_length"), u32v(cfg.n_positions)?),
        (key("embedding_length"), u32v(cfg.n_embd)?),
        (key("block_count"), u32v(cfg.n_layer)?),
        (key("feed_forward_length"), u32v(cfg.inner_dim())?),
        (key("attention.head_count"), u32v(cfg.n_head)?),
    ];
    // LFM2: no key/value heads marks a convolution layer.
    if (0..cfg.n_layer).any(|i| cfg.is_conv(i)) {
        let per_layer = (0..cfg.n_layer)
            .map(|i| u32v(if cfg.is_conv(i) { 0 } else { cfg.kv_heads() }))
            .collect::<Result<Vec<_>>>()?;
        meta.push((key("attention.head_count_kv"), Value::Array(per_layer)));
        meta.push((key("shortconv.l_cache"), u32v(cfg.conv_taps)?));
    } else {
        meta.push((key("attention.head_count_kv"), u32v(cfg.kv_heads())?));
    }
    let eps = Value::F32(cfg.layer_norm_epsilon as f32);
    match cfg.norm {
        NormKind::RmsNorm => meta.push((key("attention.layer_norm_rms_epsilon"), eps)),
        NormKind::LayerNorm => meta.push((key("attention.layer_norm_epsilon"), eps)),
    }
    if let Some(rope) = &cfg.rope {
        meta.push((key("rope.freq_base"), Value::F32(rope.theta as f32)));
        meta.push((
            key("rope.dimension_count"),
            u32v(rope.rotary_dim.unwrap_or(head_dim))?,
        ));
        match &rope.scaling {
            RopeScaling::Linear { factor } => {
                meta.push((key("rope.scaling.type"), Value::String("linear".into())));
                meta.push((key("rope.scaling.factor"), Value::F32(*factor as f32)));
            }
            RopeScaling::LongRope {
                original_max_position_embeddings: old,
                attention_factor,
                ..
            } => {
                meta.push((key("rope.scaling.original_context_length"), u32v(*old)?));
                meta.push((
                    key("rope.scaling.attn_factor"),
                    Value::F32(*attention_factor as f32),
                ));
            }
            _ => {}
        }
    }
    if cfg.head_dim.is_some() {
        meta.push((key("attention.key_length"), u32v(head_dim)?));
        meta.push((key("attention.value_length"), u32v(head_dim)?));
    }
    if cfg.family == Family::Granite {
        let scales = [
            ("embedding_scale", cfg.embedding_multiplier),
            ("residual_scale", cfg.residual_multiplier),
            ("attention.scale", cfg.attn_scale.unwrap_or(0.0)),
            ("logit_scale", cfg.logits_scaling),
        ];
        for (k, x) in scales {
            meta.push((key(k), Value::F32(x as f32)));
        }
    }
    if let Some(w) = window {
        meta.push((key("attention.sliding_window"), u32v(w)?));
        let flags = windows.iter().map(|w| Value::Bool(w.is_some())).collect();
        meta.push((key("attention.sliding_window_pattern"), Value::Array(flags)));
    }
    if let Some(local) = &cfg.rope_local {
        meta.push((key("rope.freq_base_swa"), Value::F32(local.theta as f32)));
    }
    if let Some(cap) = cfg.final_logit_softcapping {
        meta.push((key("final_logit_softcapping"), Value::F32(cap as f32)));
    }
    if let Some(cap) = cfg.attn_logit_softcapping {
        meta.push((key("attn_logit_softcapping"), Value::F32(cap as f32)));
    }
    if cfg.family == Family::GptNeox {
        meta.push((
            key("use_parallel_residual"),
            Value::Bool(cfg.parallel_residual),
        ));
    }
    match vocab {
        Some(v) => meta.extend(vocab_metadata(v)?),
        // Without a tokenizer the special ids still belong to the model.
        None => {
            let ids = [("bos", cfg.bos_token_id), ("eos", cfg.eos_token_id)];
            for (name, id) in ids {
                if let Some(id) = id {
                    meta.push((format!("tokenizer.ggml.{name}_token_id"), Value::U32(id)));
                }
            }
        }
    }
    if let Some(t) = chat_template {
        meta.push(("tokenizer.chat_template".into(), Value::String(t.into())));
    }
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
    write_atomic(path, |tmp| {
        let mut file = std::io::BufWriter::new(File::create(tmp).map_err(|e| path_err(tmp, e))?);
        gguf_file::write(&mut file, &meta_refs, &tensor_refs)?;
        std::io::Write::flush(&mut file).map_err(|e| path_err(tmp, e))
    })
}
