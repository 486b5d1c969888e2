//! The shape of a multi-head attention layer.

use candle_core::{bail, Result};
use serde::{Deserialize, Serialize};

use crate::rope::RopeConfig;

/// RMSNorm of the queries and keys after their projections and before the rotation, with
/// learned weights (`q_norm.weight`, `k_norm.weight` in a checkpoint).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QkNorm {
    /// Over each head (`[head_dim]` weights: Qwen3, Gemma 3, LFM2), or over the whole
    /// projection (`[n_heads · head_dim]` and `[n_kv_heads · head_dim]` weights: OLMo 2).
    pub per_head: bool,
    /// The epsilon added to the mean square.
    pub eps: f64,
}

/// Configuration of [`crate::MultiHeadAttention`].
///
/// Build it with struct update syntax:
/// `MhaConfig { n_kv_heads: Some(2), ..MhaConfig::new(64, 8) }`.
///
/// From JSON, PyTorch's argument names work too (`embed_dim`, `num_heads`, `kdim`, `vdim`,
/// `bias`, `dropout`, `add_bias_kv`, `add_zero_attn`), and a field this struct does not have is an error rather than
/// silently ignored:
///
/// ```
/// let cfg: mha::MhaConfig = serde_json::from_str(r#"{"embed_dim": 64, "num_heads": 8}"#).unwrap();
/// assert_eq!((cfg.d_model, cfg.n_heads), (64, 8));
/// assert!(serde_json::from_str::<mha::MhaConfig>(r#"{"embed_dims": 64}"#).is_err());
/// ```
///
/// | `torch.nn.MultiheadAttention` | here |
/// |---|---|
/// | `embed_dim` | `d_model` |
/// | `num_heads` | `n_heads` |
/// | `dropout` | `dropout` (on the attention weights, in training) |
/// | `bias` | `bias` (`out_bias` to differ for the output projection) |
/// | `kdim`, `vdim` | `kdim`, `vdim` |
/// | `batch_first=True` | always: inputs are `[batch, seq, width]` |
/// | `attn_mask`, `key_padding_mask`, `is_causal` | [`crate::Mask`] |
/// | `need_weights`, `average_attn_weights` | [`crate::MultiHeadAttention::forward_with_weights`], [`crate::AttnWeights::averaged`] |
/// | state dict names | [`crate::WeightLayout::TorchInProj`] |
/// | `add_bias_kv`, `add_zero_attn` | `add_bias_kv`, `add_zero_attn` |
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MhaConfig {
    /// Width of the query input and of the output (`embed_dim` in PyTorch).
    #[serde(alias = "embed_dim")]
    pub d_model: usize,
    /// Number of query heads; must divide `d_model` (`num_heads` in PyTorch).
    #[serde(alias = "num_heads")]
    pub n_heads: usize,
    /// Width of one head: `None` is `d_model / n_heads`. Set, the queries are
    /// `n_heads · head_dim` wide whatever `d_model` is (Qwen3: 16 heads of 128 over a width
    /// of 1024), and the output projection maps them back to `d_model`.
    pub head_dim: Option<usize>,
    /// Number of key/value heads: `None` is `n_heads` (classic attention), `1` is multi-query
    /// attention, anything else that divides `n_heads` is grouped-query attention.
    #[serde(alias = "num_key_value_heads")]
    pub n_kv_heads: Option<usize>,
    /// Width of the key input (`kdim`); `None` is `d_model`.
    pub kdim: Option<usize>,
    /// Width of the value input (`vdim`); `None` is `d_model`.
    pub vdim: Option<usize>,
    /// Whether the projections have biases (all four, as PyTorch's `bias`, unless
    /// `out_bias` says otherwise for the output projection).
    pub bias: bool,
    /// Whether the output projection has a bias; `None` is `bias`. (Qwen2 has q/k/v biases
    /// and none on `o_proj`; GPT-Neo the other way round.)
    pub out_bias: Option<bool>,
    /// Rotary position embeddings applied to queries and keys (the cache keeps rotated
    /// keys); `None` for none.
    pub rope: Option<RopeConfig>,
    /// Local attention: with causal masking, query `i` sees only the `window` most recent
    /// keys, itself included (GPT-Neo's `window_size`, Mistral's `sliding_window`).
    pub window: Option<usize>,
    /// Dropout probability on the attention weights (after softmax), in `[0, 1)`.
    pub dropout: f32,
    /// RMSNorm of queries and keys before the rotation; `None` for none.
    pub qk_norm: Option<QkNorm>,
    /// Factor applied to the scores `q·k`; `None` is `1/sqrt(head_dim)`.
    pub scale: Option<f64>,
    /// Soft cap of the scaled scores: each `s` becomes `cap · tanh(s / cap)` before the
    /// mask (Gemma 2's `attn_logit_softcapping`); `None` for none.
    pub softcap: Option<f64>,
    /// Seed of the dropout mask stream, so that training runs can be repeated.
    pub seed: u64,
    /// PyTorch's `add_bias_kv`: learned `bias_k`/`bias_v` (`[1, 1, kv_width]` in the state
    /// dict) appended to the keys and values as one more position that every query sees.
    pub add_bias_kv: bool,
    /// PyTorch's `add_zero_attn`: a zero key and value appended (after `bias_k`/`bias_v`)
    /// as one more position that every query sees.
    pub add_zero_attn: bool,
}

impl Default for MhaConfig {
    fn default() -> Self {
        Self::new(512, 8)
    }
}

impl MhaConfig {
    /// A classic attention layer: `n_heads` heads over `d_model`, biases, no dropout.
    pub fn new(d_model: usize, n_heads: usize) -> Self {
        Self {
            d_model,
            n_heads,
            head_dim: None,
            n_kv_heads: None,
            kdim: None,
            vdim: None,
            bias: true,
            out_bias: None,
            rope: None,
            window: None,
            qk_norm: None,
            dropout: 0.0,
            scale: None,
            softcap: None,
            seed: 0,
            add_bias_kv: false,
            add_zero_attn: false,
        }
    }

    /// Width of one head after defaulting: `head_dim`, else `d_model / n_heads`.
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.d_model / self.n_heads.max(1))
    }

    /// Width of the queries and of the heads' outputs: `n_heads · head_dim` (`d_model`
    /// unless `head_dim` says otherwise).
    pub fn q_width(&self) -> usize {
        self.n_heads * self.head_dim()
    }

    /// Number of key/value heads after defaulting.
    pub fn kv_heads(&self) -> usize {
        self.n_kv_heads.unwrap_or(self.n_heads)
    }

    /// Width of the key input after defaulting.
    pub fn k_dim(&self) -> usize {
        self.kdim.unwrap_or(self.d_model)
    }

    /// Width of the value input after defaulting.
    pub fn v_dim(&self) -> usize {
        self.vdim.unwrap_or(self.d_model)
    }

    /// Output width of the key and value projections: `kv_heads * head_dim`.
    pub fn kv_width(&self) -> usize {
        self.kv_heads() * self.head_dim()
    }

    /// Whether the output projection has a bias, after defaulting.
    pub fn o_bias(&self) -> bool {
        self.out_bias.unwrap_or(self.bias)
    }

    /// The factor applied to the scores after defaulting.
    pub fn softmax_scale(&self) -> f64 {
        self.scale
            .unwrap_or_else(|| 1.0 / (self.head_dim() as f64).sqrt())
    }

    /// Checks every invariant; the error names the offending values.
    pub fn validate(&self) -> Result<()> {
        let (d, h) = (self.d_model, self.n_heads);
        if d == 0 || h == 0 {
            bail!("attention needs d_model > 0 and n_heads > 0, got d_model={d}, n_heads={h}")
        }
        match self.head_dim {
            None if d % h != 0 => bail!("n_heads={h} does not divide d_model={d}"),
            Some(0) => bail!("head_dim must be positive"),
            // Bounded so that n_heads · head_dim and every width after it fit easily.
            Some(hd) if h.checked_mul(hd).is_none_or(|w| w > u32::MAX as usize) => {
                bail!("n_heads={h} heads of head_dim={hd} are wider than any model this can run")
            }
            _ => {}
        }
        let kv = self.kv_heads();
        if kv == 0 || h % kv != 0 {
            bail!("n_kv_heads={kv} must be positive and divide n_heads={h}")
        }
        if self.k_dim() == 0 || self.v_dim() == 0 {
            bail!(
                "kdim and vdim must be positive, got kdim={}, vdim={}",
                self.k_dim(),
                self.v_dim()
            )
        }
        if !(0.0..1.0).contains(&self.dropout) {
            bail!("dropout must be in [0, 1), got {}", self.dropout)
        }
        if self.window == Some(0) {
            bail!("window must be at least 1 (the query itself)")
        }
        if let Some(cap) = self.softcap {
            if !(cap.is_finite() && cap > 0.0) {
                bail!("softcap must be a positive number, got {cap}")
            }
        }
        if let Some(rope) = &self.rope {
            rope.validate(self.head_dim())?;
        }
        if let Some(n) = &self.qk_norm {
            if !(n.eps > 0.0 && n.eps.is_finite()) {
                bail!("qk_norm eps must be positive, got {}", n.eps)
            }
        }
        if let Some(s) = self.scale {
            if !s.is_finite() {
                bail!("scale must be finite, got {s}")
            }
        }
        Ok(())
    }
}
