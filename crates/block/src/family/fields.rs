//! Typed access to a `config.json`'s fields, and what every family reads alike from them:
//! the rotary embedding in both generations of field names, the head width, which layers
//! attend locally, vocabulary and end tokens. Every error names the field.
//!
//! Both generations of field names are read: transformers 5's `rope_parameters`
//! (`rope_theta`, `rope_type`, `factor`, `partial_rotary_factor`) and the older top-level
//! `rope_theta` / `rope_scaling` (`type` or `rope_type`) / `partial_rotary_factor` and
//! GPT-NeoX's `rotary_pct` / `rotary_emb_base` that most files on the hub carry. Values the
//! model cannot run are refused with the field's name.

use candle_core::{bail, Result};
use mha::{RopeConfig, RopeScaling};
use serde_json::{Map, Value};

use super::id::Family;
use crate::config::{Activation, GptConfig};

/// Typed access to `config.json`'s fields; every error names the field.
pub(super) struct Fields<'a> {
    pub obj: &'a Map<String, Value>,
}

impl Fields<'_> {
    /// The field, absent when missing or `null`.
    pub(super) fn get(&self, name: &str) -> Option<&Value> {
        self.obj.get(name).filter(|v| !v.is_null())
    }

    pub(super) fn usize(&self, name: &str) -> Result<Option<usize>> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) if n <= u32::MAX as u64 => Ok(Some(n as usize)),
                _ => bail!("config: {name} must be a non-negative integer below 2^32, got {v}"),
            },
        }
    }

    /// A size the model cannot do without: present and positive.
    pub(super) fn need(&self, name: &str) -> Result<usize> {
        match self.usize(name)? {
            None => bail!("config: {name} is missing"),
            Some(0) => bail!("config: {name} must be positive, got 0"),
            Some(n) => Ok(n),
        }
    }

    pub(super) fn f64(&self, name: &str) -> Result<Option<f64>> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() => Ok(Some(x)),
                _ => bail!("config: {name} must be a number, got {v}"),
            },
        }
    }

    pub(super) fn bool(&self, name: &str) -> Result<Option<bool>> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => bail!("config: {name} must be true or false, got {v}"),
        }
    }

    pub(super) fn str(&self, name: &str) -> Result<Option<&str>> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => bail!("config: {name} must be a string, got {v}"),
        }
    }

    /// A token id; a list (Llama 3's several end tokens) gives its first.
    pub(super) fn token(&self, name: &str) -> Result<Option<u32>> {
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

    pub(super) fn activation(&self, name: &str, default: Activation) -> Result<Activation> {
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
    pub(super) fn rope(
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
                            scaling: scaling.clone(),
                            ..Default::default()
                        }
                        .validate(2)
                        .map_err(|e| candle_core::Error::Msg(format!("config: {field}: {e}")))?;
                        scaling
                    }
                    "longrope" | "su" => self.longrope(field, s)?,
                    other => bail!(
                        "config: {field} type {other:?} is not supported (default, linear, llama3 and longrope are)"
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

impl Fields<'_> {
    /// LongRoPE (`s`: the object that names it, `field` its name): the short and long
    /// factors, the original context (there or at the top level, as Phi-3's older files
    /// keep it) and the attention factor, defaulted as transformers'
    /// `_compute_longrope_parameters` does: from `factor`, else `max_position_embeddings /
    /// original_max_position_embeddings`, `sqrt(1 + ln(factor) / ln(original))` above 1.
    fn longrope(&self, field: &str, s: &Fields) -> Result<RopeScaling> {
        let factors = |k: &str| -> Result<Vec<f64>> {
            match s.get(k) {
                Some(Value::Array(a)) => a
                    .iter()
                    .map(|v| match v.as_f64() {
                        Some(x) if x.is_finite() && x > 0.0 => Ok(x),
                        _ => bail!("config: {field} {k} entries must be positive numbers, got {v}"),
                    })
                    .collect(),
                Some(v) => bail!("config: {field} {k} must be a list, got {v}"),
                None => bail!("config: {field} longrope needs {k}"),
            }
        };
        let (short_factor, long_factor) = (factors("short_factor")?, factors("long_factor")?);
        let old_key = "original_max_position_embeddings";
        let old = match s.usize(old_key)? {
            Some(n) => n,
            None => match self.usize(old_key)? {
                Some(n) => n,
                None => bail!("config: {field} longrope needs {old_key}"),
            },
        };
        if old == 0 {
            bail!("config: {old_key} must be positive")
        }
        let factor = match s.f64("factor")? {
            Some(f) => f,
            None => self.f64("max_position_embeddings")?.unwrap_or(old as f64) / old as f64,
        };
        let attention_factor = match s.f64("attention_factor")? {
            Some(a) => a,
            None if factor <= 1.0 => 1.0,
            None => (1.0 + factor.ln() / (old as f64).ln()).sqrt(),
        };
        Ok(RopeScaling::LongRope {
            short_factor,
            long_factor,
            original_max_position_embeddings: old,
            attention_factor,
        })
    }
}

/// The head width: `hidden / heads`, which `head_dim` must equal when the config gives it.
pub(super) fn head_dim(
    f: &Fields,
    (d_name, d): (&str, usize),
    (h_name, h): (&str, usize),
) -> Result<usize> {
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

/// The head width of a Llama-layout model: `head_dim` when the config gives it (Qwen3's
/// and Gemma's heads are wider than `hidden / heads`), else `hidden / heads`. Returns it
/// and what [`GptConfig::head_dim`] records (`None` when it is `hidden / heads`).
pub(super) fn free_head_dim(f: &Fields, d: usize, h: usize) -> Result<(usize, Option<usize>)> {
    match f.usize("head_dim")? {
        Some(0) => bail!("config: head_dim must be positive"),
        Some(hd) if d.is_multiple_of(h) && hd == d / h => Ok((hd, None)),
        Some(hd) => Ok((hd, Some(hd))),
        None if !d.is_multiple_of(h) => {
            bail!("config: num_attention_heads={h} must divide hidden_size={d} (or head_dim be given)")
        }
        None => Ok((d / h, None)),
    }
}

/// `layer_types` as transformers writes it for these windows (`sliding_attention` for a
/// windowed layer, `full_attention` otherwise): [`layer_windows`]'s input, written back.
pub(super) fn layer_types(windows: &[Option<usize>]) -> Vec<&'static str> {
    windows
        .iter()
        .map(|w| match w {
            Some(_) => "sliding_attention",
            None => "full_attention",
        })
        .collect()
}

/// Which layers attend locally: `layer_types` when the config lists them, else the first
/// `global` layers global and the rest windowed (Mistral: none global; Qwen2:
/// `max_window_layers`), as runs (see [`GptConfig::windows`]).
pub(super) fn layer_windows(
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
pub(super) fn base(family: Family, f: &Fields, tied: bool) -> Result<GptConfig> {
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

/// An f32 as the f64 of its shortest decimal (0.1, not 0.10000000149011612), for JSON.
pub(super) fn decimal(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(x as f64)
}
