//! Model families: how each reads its `config.json` into the family-free [`GptConfig`], and
//! the names its checkpoints give the tensors. A family only decides the parts; one model
//! runs them all.
//!
//! Both generations of field names are read: transformers 5's `rope_parameters`
//! (`rope_theta`, `rope_type`, `factor`, `partial_rotary_factor`) and the older top-level
//! `rope_theta` / `rope_scaling` (`type` or `rope_type`) / `partial_rotary_factor` and
//! GPT-NeoX's `rotary_pct` / `rotary_emb_base` that most files on the hub carry. Values the
//! model cannot run are refused with the field's name.

use candle_core::{bail, Result};
use mha::{RopeConfig, RopeScaling, WeightLayout};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::mlp::MlpNames;
use crate::{Activation, GptConfig, NormKind};

/// The checkpoint family, from `config.json`'s `model_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Family {
    /// GPT-2 (`transformer.h.{i}`, fused Conv1D `c_attn`).
    #[default]
    Gpt2,
    /// Llama and the many models in its layout (SmolLM, TinyLlama, ...).
    Llama,
    /// Mistral: Llama's layout with sliding-window attention.
    Mistral,
    /// Qwen2 / Qwen2.5: Llama's layout with q/k/v biases.
    Qwen2,
    /// GPT-NeoX / Pythia: partial rotary, head-interleaved fused q/k/v, parallel residual.
    GptNeox,
    /// GPT-Neo: learned positions, global and local layers, unscaled scores.
    GptNeo,
}

impl Family {
    /// The `model_type` values read, in the order of the README's table.
    pub const SUPPORTED: [&'static str; 6] =
        ["gpt2", "llama", "mistral", "qwen2", "gpt_neox", "gpt_neo"];

    /// The family of a `model_type`.
    pub fn from_model_type(t: &str) -> Result<Self> {
        Ok(match t {
            "gpt2" => Self::Gpt2,
            "llama" => Self::Llama,
            "mistral" => Self::Mistral,
            "qwen2" => Self::Qwen2,
            "gpt_neox" => Self::GptNeox,
            "gpt_neo" => Self::GptNeo,
            other => bail!(
                "config: model_type {other:?} is not supported (supported: {})",
                Self::SUPPORTED.join(", ")
            ),
        })
    }

    /// The `model_type` string.
    pub fn model_type(self) -> &'static str {
        match self {
            Self::Gpt2 => "gpt2",
            Self::Llama => "llama",
            Self::Mistral => "mistral",
            Self::Qwen2 => "qwen2",
            Self::GptNeox => "gpt_neox",
            Self::GptNeo => "gpt_neo",
        }
    }
}

/// Where a family keeps each tensor, relative to the checkpoint's root.
#[derive(Debug, Clone)]
pub(crate) struct TensorNames {
    /// Token embedding `[vocab, d]`.
    pub embed: &'static str,
    /// Learned position embedding `[n_positions, d]`, for models without rotary positions.
    pub positions: &'static str,
    /// Block `i` lives under `{layers}.{i}`.
    pub layers: &'static str,
    /// Norm before attention (and, for post-norm models, after it).
    pub attn_norm: &'static str,
    /// Attention, under the block.
    pub attn: &'static str,
    /// Norm before the MLP.
    pub mlp_norm: &'static str,
    /// MLP, under the block.
    pub mlp_prefix: &'static str,
    /// The MLP's projections.
    pub mlp: MlpNames,
    /// Final norm.
    pub final_norm: &'static str,
    /// Untied LM head `[vocab, d]` (an `nn.Linear` without bias).
    pub head: &'static str,
}

impl TensorNames {
    /// The names of `family`.
    pub fn of(family: Family) -> Self {
        const GATED: MlpNames = MlpNames {
            up: "up_proj",
            gate: Some("gate_proj"),
            down: "down_proj",
            conv1d: false,
        };
        let llama = TensorNames {
            embed: "model.embed_tokens",
            positions: "",
            layers: "model.layers",
            attn_norm: "input_layernorm",
            attn: "self_attn",
            mlp_norm: "post_attention_layernorm",
            mlp_prefix: "mlp",
            mlp: GATED,
            final_norm: "model.norm",
            head: "lm_head",
        };
        match family {
            Family::Gpt2 | Family::GptNeo => TensorNames {
                embed: "transformer.wte",
                positions: "transformer.wpe",
                layers: "transformer.h",
                attn_norm: "ln_1",
                attn: match family {
                    Family::Gpt2 => "attn",
                    _ => "attn.attention",
                },
                mlp_norm: "ln_2",
                mlp_prefix: "mlp",
                mlp: MlpNames {
                    up: "c_fc",
                    gate: None,
                    down: "c_proj",
                    conv1d: family == Family::Gpt2,
                },
                final_norm: "transformer.ln_f",
                head: "lm_head",
            },
            Family::Llama | Family::Mistral | Family::Qwen2 => llama,
            Family::GptNeox => TensorNames {
                embed: "gpt_neox.embed_in",
                positions: "",
                layers: "gpt_neox.layers",
                attn_norm: "input_layernorm",
                attn: "attention",
                mlp_norm: "post_attention_layernorm",
                mlp_prefix: "mlp",
                mlp: MlpNames {
                    up: "dense_h_to_4h",
                    gate: None,
                    down: "dense_4h_to_h",
                    conv1d: false,
                },
                final_norm: "gpt_neox.final_layer_norm",
                head: "embed_out",
            },
        }
    }

    /// The attention weights' layout.
    pub fn attn_layout(family: Family) -> WeightLayout {
        match family {
            Family::Gpt2 => WeightLayout::Gpt2Conv1d,
            Family::GptNeo => WeightLayout::separate("q_proj", "k_proj", "v_proj", "out_proj"),
            Family::GptNeox => WeightLayout::HeadInterleavedQkv {
                qkv: "query_key_value".into(),
                o: "dense".into(),
            },
            Family::Llama | Family::Mistral | Family::Qwen2 => WeightLayout::hf(),
        }
    }

    /// The first component of every name (`transformer`, `model`, `gpt_neox`), which some
    /// checkpoints leave out.
    pub fn root(&self) -> &'static str {
        self.embed.split('.').next().unwrap_or("")
    }
}

/// Reads a non-GPT-2 `config.json` (already parsed) of `family`.
pub(crate) fn read(family: Family, obj: &Map<String, Value>) -> Result<GptConfig> {
    let f = Fields { obj };
    let cfg = match family {
        Family::Gpt2 => bail!("GPT-2 configs are read by GptConfig::from_json"),
        Family::Llama | Family::Mistral | Family::Qwen2 => llama_like(family, &f)?,
        Family::GptNeox => neox(&f)?,
        Family::GptNeo => neo(&f)?,
    };
    cfg.validate()?;
    Ok(cfg)
}

/// Typed access to `config.json`'s fields; every error names the field.
struct Fields<'a> {
    obj: &'a Map<String, Value>,
}

impl Fields<'_> {
    /// The field, absent when missing or `null`.
    fn get(&self, name: &str) -> Option<&Value> {
        self.obj.get(name).filter(|v| !v.is_null())
    }

    fn usize(&self, name: &str) -> Result<Option<usize>> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) if n <= u32::MAX as u64 => Ok(Some(n as usize)),
                _ => bail!("config: {name} must be a non-negative integer below 2^32, got {v}"),
            },
        }
    }

    /// A size the model cannot do without: present and positive.
    fn need(&self, name: &str) -> Result<usize> {
        match self.usize(name)? {
            None => bail!("config: {name} is missing"),
            Some(0) => bail!("config: {name} must be positive, got 0"),
            Some(n) => Ok(n),
        }
    }

    fn f64(&self, name: &str) -> Result<Option<f64>> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() => Ok(Some(x)),
                _ => bail!("config: {name} must be a number, got {v}"),
            },
        }
    }

    fn bool(&self, name: &str) -> Result<Option<bool>> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => bail!("config: {name} must be true or false, got {v}"),
        }
    }

    fn str(&self, name: &str) -> Result<Option<&str>> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => bail!("config: {name} must be a string, got {v}"),
        }
    }

    /// A token id; a list (Llama 3's several end tokens) gives its first.
    fn token(&self, name: &str) -> Result<Option<u32>> {
        let v = match self.get(name) {
            Some(Value::Array(a)) => a.first().filter(|v| !v.is_null()),
            other => other,
        };
        match v {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) if n <= u32::MAX as u64 => Ok(Some(n as u32)),
                _ => bail!("config: {name} must be a token id, got {v}"),
            },
        }
    }

    fn activation(&self, name: &str, default: Activation) -> Result<Activation> {
        match self.str(name)? {
            None => Ok(default),
            Some(s) => serde_json::from_value(Value::String(s.into())).map_err(|_| {
                candle_core::Error::Msg(format!(
                    "config: {name} {s:?} is not supported (gelu, gelu_new, gelu_pytorch_tanh, gelu_fast, silu, relu)"
                ))
            }),
        }
    }

    /// The rotary embedding, from `rope_parameters` (transformers 5) or the older top-level
    /// fields. `theta_alias` and `pct_alias` are GPT-NeoX's old names.
    fn rope(
        &self,
        head_dim: usize,
        default_fraction: f64,
        theta_alias: Option<&str>,
        pct_alias: Option<&str>,
    ) -> Result<RopeConfig> {
        let params = match self.get("rope_parameters") {
            None => None,
            Some(Value::Object(m)) => Some(Fields { obj: m }),
            Some(v) => bail!("config: rope_parameters must be an object, got {v}"),
        };
        let scaling_obj = match self.get("rope_scaling") {
            None => None,
            Some(Value::Object(m)) => Some(Fields { obj: m }),
            Some(v) => bail!("config: rope_scaling must be an object or null, got {v}"),
        };
        // Where each value is looked up, newest first.
        let theta = match &params {
            Some(p) => p.f64("rope_theta")?,
            None => None,
        };
        let theta = match theta {
            Some(t) => t,
            None => match self.f64("rope_theta")? {
                Some(t) => t,
                None => match theta_alias {
                    Some(a) => self.f64(a)?.unwrap_or(10_000.0),
                    None => 10_000.0,
                },
            },
        };
        let mut fraction = match &params {
            Some(p) => p.f64("partial_rotary_factor")?,
            None => None,
        };
        if fraction.is_none() {
            fraction = self.f64("partial_rotary_factor")?;
        }
        if let (None, Some(a)) = (fraction, pct_alias) {
            fraction = self.f64(a)?;
        }
        let fraction = fraction.unwrap_or(default_fraction);
        if !(fraction > 0.0 && fraction <= 1.0) {
            bail!("config: partial_rotary_factor (rotary_pct) must be in (0, 1], got {fraction}")
        }
        // The kind of scaling and its factor: transformers 5 keeps them in rope_parameters,
        // older files in rope_scaling (as "type" or "rope_type").
        let scale = match (&params, &scaling_obj) {
            (Some(p), _) if p.get("rope_type").is_some() => Some(("rope_parameters", p)),
            (_, Some(s)) => Some(("rope_scaling", s)),
            _ => None,
        };
        let scaling = match scale {
            None => RopeScaling::None,
            Some((field, s)) => {
                let kind = match s.str("rope_type")? {
                    Some(k) => k,
                    None => s.str("type")?.unwrap_or("default"),
                };
                match kind {
                    "default" => RopeScaling::None,
                    "linear" => match s.f64("factor")? {
                        Some(factor) if factor > 0.0 => RopeScaling::Linear { factor },
                        other => bail!("config: {field} linear needs factor > 0, got {other:?}"),
                    },
                    "llama3" => {
                        let need = |k: &str| match s.f64(k)? {
                            Some(x) => Ok(x),
                            None => bail!("config: {field} llama3 needs {k}"),
                        };
                        let scaling = RopeScaling::Llama3 {
                            factor: need("factor")?,
                            low_freq_factor: need("low_freq_factor")?,
                            high_freq_factor: need("high_freq_factor")?,
                            original_max_position_embeddings: need(
                                "original_max_position_embeddings",
                            )?,
                        };
                        // Its own checks, named as the config names them.
                        RopeConfig {
                            scaling,
                            ..Default::default()
                        }
                        .validate(2)
                        .map_err(|e| candle_core::Error::Msg(format!("config: {field}: {e}")))?;
                        scaling
                    }
                    other => bail!(
                        "config: {field} type {other:?} is not supported (default, linear and llama3 are)"
                    ),
                }
            }
        };
        // transformers: int(head_dim * fraction).
        let rotary_dim = (head_dim as f64 * fraction) as usize;
        Ok(RopeConfig {
            theta,
            rotary_dim: (rotary_dim != head_dim).then_some(rotary_dim),
            scaling,
        })
    }
}

/// The head width: `hidden / heads`, which `head_dim` must equal when the config gives it.
fn head_dim(f: &Fields, (d_name, d): (&str, usize), (h_name, h): (&str, usize)) -> Result<usize> {
    if h == 0 || d % h != 0 {
        bail!("config: {h_name}={h} must divide {d_name}={d}")
    }
    let derived = d / h;
    match f.usize("head_dim")? {
        Some(hd) if hd != derived => bail!(
            "config: head_dim={hd} differs from hidden_size / num_attention_heads = {derived}; such models are not supported"
        ),
        _ => Ok(derived),
    }
}

/// Which layers attend locally: `layer_types` when the config lists them, else the first
/// `global` layers global and the rest windowed (Mistral: none global; Qwen2:
/// `max_window_layers`), as runs (see [`GptConfig::windows`]).
fn layer_windows(
    f: &Fields,
    n_layer: usize,
    window: Option<usize>,
    global: usize,
) -> Result<Vec<(Vec<Option<usize>>, usize)>> {
    match f.get("layer_types") {
        None => {
            let (Some(w), true) = (window, global < n_layer) else {
                return Ok(Vec::new());
            };
            Ok(vec![
                (vec![None], global),
                (vec![Some(w)], n_layer - global),
            ])
        }
        Some(Value::Array(types)) => {
            if types.len() != n_layer {
                bail!(
                    "config: layer_types has {} entries for num_hidden_layers={n_layer}",
                    types.len()
                )
            }
            let pattern = types
                .iter()
                .map(|t| match (t.as_str(), window) {
                    (Some("full_attention"), _) => Ok(None),
                    (Some("sliding_attention"), Some(w)) => Ok(Some(w)),
                    (Some("sliding_attention"), None) => {
                        bail!("config: sliding_attention layers need sliding_window")
                    }
                    _ => bail!("config: layer_types entry {t} is not supported (full_attention, sliding_attention)"),
                })
                .collect::<Result<_>>()?;
            Ok(vec![(pattern, 1)])
        }
        Some(v) => bail!("config: layer_types must be a list, got {v}"),
    }
}

/// What every family's config reads alike: vocabulary, context, end tokens, the head's
/// tying (whose default differs by family), no dropout in inference.
fn base(family: Family, f: &Fields, tied: bool) -> Result<GptConfig> {
    Ok(GptConfig {
        family,
        model_type: Some(family.model_type().into()),
        vocab_size: f.need("vocab_size")?,
        n_positions: f.usize("max_position_embeddings")?.unwrap_or(2048),
        tie_word_embeddings: f.bool("tie_word_embeddings")?.unwrap_or(tied),
        bos_token_id: f.token("bos_token_id")?,
        eos_token_id: f.token("eos_token_id")?,
        resid_pdrop: 0.0,
        embd_pdrop: 0.0,
        attn_pdrop: 0.0,
        ..GptConfig::gpt2()
    })
}

fn llama_like(family: Family, f: &Fields) -> Result<GptConfig> {
    let d = f.need("hidden_size")?;
    let h = f.need("num_attention_heads")?;
    let n_layer = f.need("num_hidden_layers")?;
    let hd = head_dim(f, ("hidden_size", d), ("num_attention_heads", h))?;
    let attention_bias = f.bool("attention_bias")?.unwrap_or(false);
    // Qwen2 has q/k/v biases and none on o_proj, whatever the config says.
    let (qkv_bias, o_bias) = match family {
        Family::Qwen2 => (true, false),
        _ => (attention_bias, attention_bias),
    };
    let window = f.usize("sliding_window")?;
    let global = match family {
        // Mistral: every layer, when sliding_window is set.
        Family::Mistral => 0,
        // Qwen2: from max_window_layers on, when use_sliding_window is set.
        Family::Qwen2 if f.bool("use_sliding_window")?.unwrap_or(false) => {
            f.usize("max_window_layers")?.unwrap_or(n_layer)
        }
        _ => n_layer,
    };
    let windows = layer_windows(f, n_layer, window, global)?;
    Ok(GptConfig {
        n_embd: d,
        n_layer,
        n_head: h,
        n_kv_head: Some(f.usize("num_key_value_heads")?.unwrap_or(h)),
        n_inner: Some(f.need("intermediate_size")?),
        activation_function: f.activation("hidden_act", Activation::Silu)?,
        layer_norm_epsilon: f.f64("rms_norm_eps")?.unwrap_or(1e-6),
        norm: NormKind::RmsNorm,
        rope: Some(f.rope(hd, 1.0, None, None)?),
        gated_mlp: true,
        parallel_residual: false,
        attn_bias: qkv_bias,
        attn_out_bias: o_bias,
        mlp_bias: f.bool("mlp_bias")?.unwrap_or(false),
        windows,
        ..base(family, f, false)?
    })
}

fn neox(f: &Fields) -> Result<GptConfig> {
    let d = f.need("hidden_size")?;
    let h = f.need("num_attention_heads")?;
    let hd = head_dim(f, ("hidden_size", d), ("num_attention_heads", h))?;
    let bias = f.bool("attention_bias")?.unwrap_or(true);
    Ok(GptConfig {
        n_embd: d,
        n_layer: f.need("num_hidden_layers")?,
        n_head: h,
        n_inner: Some(f.need("intermediate_size")?),
        activation_function: f.activation("hidden_act", Activation::Gelu)?,
        layer_norm_epsilon: f.f64("layer_norm_eps")?.unwrap_or(1e-5),
        norm: NormKind::LayerNorm,
        rope: Some(f.rope(hd, 0.25, Some("rotary_emb_base"), Some("rotary_pct"))?),
        gated_mlp: false,
        parallel_residual: f.bool("use_parallel_residual")?.unwrap_or(true),
        attn_bias: bias,
        attn_out_bias: bias,
        mlp_bias: true,
        ..base(Family::GptNeox, f, false)?
    })
}

fn neo(f: &Fields) -> Result<GptConfig> {
    let d = f.need("hidden_size")?;
    let n_layer = f.need("num_layers")?;
    head_dim(f, ("hidden_size", d), ("num_heads", f.need("num_heads")?))?;
    let window = f.usize("window_size")?;
    // `attention_types`: [[["global", "local"], 12]] is 24 layers, kept as that run.
    let kind = |k: &Value| match (k.as_str(), window) {
        (Some("global"), _) => Ok(None),
        (Some("local"), Some(w)) => Ok(Some(w)),
        (Some("local"), None) => bail!("config: local attention layers need window_size"),
        _ => bail!("config: attention type {k} is not supported (global, local)"),
    };
    let windows: Vec<(Vec<Option<usize>>, usize)> = match f.get("attention_types") {
        None => Vec::new(),
        Some(Value::Array(groups)) => groups
            .iter()
            .map(|g| {
                let bad = || {
                    candle_core::Error::Msg(format!(
                        "config: attention_types entry {g} must be [[kinds...], repeat]"
                    ))
                };
                let pair = g.as_array().filter(|p| p.len() == 2).ok_or_else(bad)?;
                let kinds = pair[0]
                    .as_array()
                    .filter(|k| !k.is_empty())
                    .ok_or_else(bad)?;
                let times = pair[1].as_u64().ok_or_else(bad)?;
                let pattern = kinds.iter().map(kind).collect::<Result<_>>()?;
                Ok((pattern, usize::try_from(times).map_err(|_| bad())?))
            })
            .collect::<Result<_>>()?,
        Some(v) => bail!("config: attention_types must be a list, got {v}"),
    };
    let covered = crate::config::layers_covered(&windows);
    if !windows.is_empty() && covered != Some(n_layer) {
        bail!(
            "config: attention_types describes {} layers but num_layers={n_layer}",
            covered.map_or("too many".to_string(), |n| n.to_string())
        )
    }
    Ok(GptConfig {
        n_embd: d,
        n_layer,
        n_head: f.need("num_heads")?,
        n_inner: f.usize("intermediate_size")?,
        activation_function: f.activation("activation_function", Activation::GeluNew)?,
        layer_norm_epsilon: f.f64("layer_norm_epsilon")?.unwrap_or(1e-5),
        norm: NormKind::LayerNorm,
        rope: None,
        gated_mlp: false,
        parallel_residual: false,
        // No bias on q/k/v, one on out_proj; the MLP's Linears have biases.
        attn_bias: false,
        attn_out_bias: true,
        mlp_bias: true,
        windows,
        // GPT-Neo does not scale the scores by 1/sqrt(head_dim).
        scale_attn_weights: false,
        ..base(Family::GptNeo, f, true)?
    })
}
