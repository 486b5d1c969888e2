//! The GPT configuration, read from Hugging Face's `config.json`.

use candle_core::{bail, Result};
use serde::{Deserialize, Serialize};

/// The MLP's activation, named as in `config.json`'s `activation_function`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Activation {
    /// GELU with the tanh approximation (GPT-2's; `gelu_pytorch_tanh` is the same).
    #[serde(rename = "gelu_new", alias = "gelu_pytorch_tanh")]
    GeluNew,
    /// Exact GELU, with `erf`.
    #[serde(rename = "gelu")]
    Gelu,
    /// `max(0, x)`.
    #[serde(rename = "relu")]
    Relu,
}

impl Activation {
    /// Applies the activation elementwise.
    pub fn apply(self, xs: &candle_core::Tensor) -> Result<candle_core::Tensor> {
        match self {
            // A vectorised kernel on the CPU in inference; Candle's gelu otherwise.
            Activation::GeluNew => mha::kernel::gelu_tanh(xs),
            Activation::Gelu => xs.gelu_erf(),
            Activation::Relu => xs.relu(),
        }
    }
}

/// Where each block applies its LayerNorms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NormPlacement {
    /// `x + f(ln(x))`, GPT-2's, with a final LayerNorm after the last block.
    Pre,
    /// `ln(x + f(x))`, the original Transformer's.
    Post,
}

/// A GPT-2 family model's shape, with Hugging Face's field names.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct GptConfig {
    /// Number of tokens in the vocabulary.
    pub vocab_size: usize,
    /// Longest sequence the position embedding covers (`n_ctx` in old configs).
    pub n_positions: usize,
    /// Model width.
    pub n_embd: usize,
    /// Number of transformer blocks.
    pub n_layer: usize,
    /// Number of attention heads; must divide `n_embd`.
    pub n_head: usize,
    /// Hidden width of the MLP; `None` is `4 · n_embd`.
    pub n_inner: Option<usize>,
    /// The MLP's activation.
    pub activation_function: Activation,
    /// LayerNorm epsilon.
    pub layer_norm_epsilon: f64,
    /// Dropout on each residual branch in training.
    pub resid_pdrop: f32,
    /// Dropout on the embeddings in training.
    pub embd_pdrop: f32,
    /// Dropout on the attention weights in training.
    pub attn_pdrop: f32,
    /// Scale scores by `1/sqrt(head_dim)`.
    pub scale_attn_weights: bool,
    /// Also scale the scores of block `i` by `1/(i + 1)`.
    pub scale_attn_by_inverse_layer_idx: bool,
    /// Hugging Face's flag to compute scores in f32 with the scale folded in; scores are
    /// always f32 here, so it changes nothing beyond rounding.
    pub reorder_and_upcast_attn: bool,
    /// The language-model head reuses the token embedding.
    pub tie_word_embeddings: bool,
    /// Beginning-of-text token.
    pub bos_token_id: Option<u32>,
    /// End-of-text token: generation stops there.
    pub eos_token_id: Option<u32>,
    /// Pre- or post-LayerNorm blocks (not a Hugging Face field; GPT-2 is `pre`).
    pub norm_placement: NormPlacement,
    /// Seed of the dropout masks in training (not a Hugging Face field).
    pub seed: u64,
    /// `gpt2` for Hugging Face checkpoints.
    pub model_type: Option<String>,
    /// Cross-attention blocks (encoder-decoder GPT-2): not supported, refused at load.
    pub add_cross_attention: bool,
}

impl Default for GptConfig {
    fn default() -> Self {
        Self::gpt2()
    }
}

impl GptConfig {
    /// GPT-2 small (124M).
    pub fn gpt2() -> Self {
        Self {
            vocab_size: 50257,
            n_positions: 1024,
            n_embd: 768,
            n_layer: 12,
            n_head: 12,
            n_inner: None,
            activation_function: Activation::GeluNew,
            layer_norm_epsilon: 1e-5,
            resid_pdrop: 0.1,
            embd_pdrop: 0.1,
            attn_pdrop: 0.1,
            scale_attn_weights: true,
            scale_attn_by_inverse_layer_idx: false,
            reorder_and_upcast_attn: false,
            tie_word_embeddings: true,
            bos_token_id: Some(50256),
            eos_token_id: Some(50256),
            norm_placement: NormPlacement::Pre,
            seed: 0,
            model_type: Some("gpt2".into()),
            add_cross_attention: false,
        }
    }

    /// distilgpt2: GPT-2 small with 6 blocks.
    pub fn distilgpt2() -> Self {
        Self {
            n_layer: 6,
            ..Self::gpt2()
        }
    }

    /// GPT-2 medium (355M).
    pub fn gpt2_medium() -> Self {
        Self {
            n_embd: 1024,
            n_layer: 24,
            n_head: 16,
            ..Self::gpt2()
        }
    }

    /// GPT-2 large (774M).
    pub fn gpt2_large() -> Self {
        Self {
            n_embd: 1280,
            n_layer: 36,
            n_head: 20,
            ..Self::gpt2()
        }
    }

    /// GPT-2 XL (1.5B).
    pub fn gpt2_xl() -> Self {
        Self {
            n_embd: 1600,
            n_layer: 48,
            n_head: 25,
            ..Self::gpt2()
        }
    }

    /// Parses a `config.json` and checks it. Old configs that give `n_ctx` but no
    /// `n_positions` are read as they were meant.
    pub fn from_json(json: &str) -> Result<Self> {
        let mut value: serde_json::Value = serde_json::from_str(json)
            .map_err(|e| candle_core::Error::Msg(format!("config.json: {e}")))?;
        if let Some(obj) = value.as_object_mut() {
            if !obj.contains_key("n_positions") {
                if let Some(n_ctx) = obj.get("n_ctx").cloned() {
                    obj.insert("n_positions".into(), n_ctx);
                }
            }
        }
        let cfg: Self = serde_json::from_value(value)
            .map_err(|e| candle_core::Error::Msg(format!("config.json: {e}")))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// The configuration as `config.json` text, with the fields `transformers` reads.
    pub fn to_json(&self) -> Result<String> {
        let mut value = serde_json::to_value(self).map_err(candle_core::Error::wrap)?;
        if let Some(obj) = value.as_object_mut() {
            obj.insert(
                "architectures".into(),
                serde_json::json!(["GPT2LMHeadModel"]),
            );
            obj.insert("model_type".into(), serde_json::json!("gpt2"));
            obj.insert("n_ctx".into(), serde_json::json!(self.n_positions));
        }
        serde_json::to_string_pretty(&value).map_err(candle_core::Error::wrap)
    }

    /// MLP hidden width after defaulting.
    pub fn inner_dim(&self) -> usize {
        self.n_inner.unwrap_or(self.n_embd.saturating_mul(4))
    }

    /// Checks that the model can be built and run as configured; the error names the values.
    pub fn validate(&self) -> Result<()> {
        let (d, h) = (self.n_embd, self.n_head);
        if self.vocab_size == 0 || self.n_positions == 0 || self.n_layer == 0 {
            bail!(
                "config: vocab_size, n_positions and n_layer must be positive, got {}, {}, {}",
                self.vocab_size,
                self.n_positions,
                self.n_layer
            )
        }
        // Token ids are u32, and bounded sizes keep every product of them (3·n_embd,
        // vocab·n_embd) far from overflowing.
        for (name, n) in [
            ("vocab_size", self.vocab_size),
            ("n_positions", self.n_positions),
            ("n_embd", d),
            ("n_layer", self.n_layer),
            ("n_head", h),
            ("n_inner", self.inner_dim()),
        ] {
            if n > u32::MAX as usize {
                bail!("config: {name}={n} is larger than any model this can run")
            }
        }
        if d == 0 || h == 0 || d % h != 0 {
            bail!("config: n_head={h} must be positive and divide n_embd={d}")
        }
        if self.inner_dim() == 0 {
            bail!("config: n_inner must be positive")
        }
        if !(self.layer_norm_epsilon > 0.0 && self.layer_norm_epsilon.is_finite()) {
            bail!(
                "config: layer_norm_epsilon must be positive, got {}",
                self.layer_norm_epsilon
            )
        }
        for (name, p) in [
            ("resid_pdrop", self.resid_pdrop),
            ("embd_pdrop", self.embd_pdrop),
            ("attn_pdrop", self.attn_pdrop),
        ] {
            if !(0.0..1.0).contains(&p) {
                bail!("config: {name} must be in [0, 1), got {p}")
            }
        }
        if let Some(t) = &self.model_type {
            if t != "gpt2" {
                bail!("config: model_type {t:?} is not supported (only gpt2)")
            }
        }
        if self.add_cross_attention {
            bail!("config: add_cross_attention (GPT-2 as a decoder with cross-attention) is not supported")
        }
        Ok(())
    }
}
