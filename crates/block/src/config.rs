//! The model's configuration, family-free: its shape and which parts it uses. Each
//! family's `config.json` reader fills it ([`crate::family`]).

use candle_core::{bail, Result};
use mha::{QkNorm, RopeConfig};
use serde::{Deserialize, Serialize};

use crate::family::id::Family;

/// The MLP's activation, named as in `config.json`'s `activation_function`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Activation {
    /// GELU with the tanh approximation (GPT-2's; `gelu_pytorch_tanh` is the same).
    #[serde(rename = "gelu_new", alias = "gelu_pytorch_tanh", alias = "gelu_fast")]
    GeluNew,
    /// Exact GELU, with `erf`.
    #[serde(rename = "gelu")]
    Gelu,
    /// `max(0, x)`.
    #[serde(rename = "relu")]
    Relu,
    /// `x · sigmoid(x)` (SwiGLU's gate in Llama, Mistral, Qwen2; `swish` is the same).
    #[serde(rename = "silu", alias = "swish")]
    Silu,
}

impl Activation {
    /// Applies the activation elementwise.
    pub fn apply(self, xs: &candle_core::Tensor) -> Result<candle_core::Tensor> {
        match self {
            // A vectorised kernel on the CPU in inference; Candle's gelu otherwise.
            Activation::GeluNew => gpt_kernels::act::gelu_tanh(xs),
            Activation::Gelu => xs.gelu_erf(),
            Activation::Relu => xs.relu(),
            Activation::Silu => xs.silu(),
        }
    }
}

/// Which normalisation the blocks use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NormKind {
    /// Mean and variance, weight and bias (GPT-2, GPT-NeoX, GPT-Neo).
    #[default]
    LayerNorm,
    /// Root mean square, weight only (Llama, Mistral, Qwen2).
    RmsNorm,
}

/// Where each block applies its norms. All but `Post` end with a final norm after the
/// last block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NormPlacement {
    /// `x + f(ln(x))`, GPT-2's and most models'.
    Pre,
    /// `ln(x + f(x))`, the original Transformer's (no final norm).
    Post,
    /// `x + ln_post(f(ln(x)))`: a norm before and one after each branch (Gemma 2 and 3).
    Sandwich,
    /// `x + ln(f(x))`: the norm on each branch's output only (OLMo 2).
    PostBranch,
}

/// A decoder-only model's shape and parts, family-free. The fields that GPT-2's
/// `config.json` has carry its names (and are read from it by serde); the parts other
/// families switch (`family` onwards below) are filled in by each family's reader
/// ([`GptConfig::from_json`] dispatches on `model_type`) and default to GPT-2's.
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
    /// The checkpoint family: decides the tensor names (and nothing else).
    #[serde(skip)]
    pub family: Family,
    /// Key/value heads (grouped-query attention); `None` is `n_head`.
    #[serde(skip)]
    pub n_kv_head: Option<usize>,
    /// LayerNorm or RMSNorm (`layer_norm_epsilon` is the epsilon of either).
    #[serde(skip)]
    pub norm: NormKind,
    /// Rotary positions in attention; `None` is a learned position embedding (`wpe`).
    #[serde(skip)]
    pub rope: Option<RopeConfig>,
    /// A gated MLP, `down(act(gate(x)) · up(x))`, instead of `down(act(up(x)))`.
    #[serde(skip)]
    pub gated_mlp: bool,
    /// Attention and MLP both read the block's input and add to it (GPT-NeoX), instead of
    /// the MLP reading the attention's output.
    #[serde(skip)]
    pub parallel_residual: bool,
    /// Biases on the query, key and value projections.
    #[serde(skip)]
    pub attn_bias: bool,
    /// A bias on the attention's output projection.
    #[serde(skip)]
    pub attn_out_bias: bool,
    /// Biases on the MLP's projections (GPT-2's Conv1D always has them).
    #[serde(skip)]
    pub mlp_bias: bool,
    /// Width of one attention head; `None` is `n_embd / n_head`. Qwen3 and Gemma 3 have
    /// heads wider than that (the queries `n_head · head_dim` wide).
    #[serde(skip)]
    pub head_dim: Option<usize>,
    /// RMSNorm of queries and keys before the rotation (Qwen3, Gemma 3, OLMo 2).
    #[serde(skip)]
    pub qk_norm: Option<QkNorm>,
    /// The factor on the scores, when not `1/sqrt(head_dim)` (Granite's
    /// `attention_multiplier`, Gemma's `query_pre_attn_scalar^-0.5`).
    #[serde(skip)]
    pub attn_scale: Option<f64>,
    /// Factor on the token embeddings (Granite's `embedding_multiplier`, Gemma's
    /// `sqrt(hidden_size)`); 1 for most.
    #[serde(skip)]
    pub embedding_multiplier: f64,
    /// Factor on each branch's output before it joins the residual (Granite).
    #[serde(skip)]
    pub residual_multiplier: f64,
    /// The logits are divided by it (Granite's `logits_scaling`).
    #[serde(skip)]
    pub logits_scaling: f64,
    /// The rotary embedding of the windowed blocks when it differs from `rope` (Gemma 3's
    /// local layers: `rope_local_base_freq`, `rope_parameters.sliding_attention`).
    #[serde(skip)]
    pub rope_local: Option<RopeConfig>,
    /// The logits become `cap · tanh(logits / cap)` (Gemma's `final_logit_softcapping`).
    #[serde(skip)]
    pub final_logit_softcapping: Option<f64>,
    /// The scaled attention scores become `cap · tanh(s / cap)` before the mask (Gemma 2's
    /// `attn_logit_softcapping`).
    #[serde(skip)]
    pub attn_logit_softcapping: Option<f64>,
    /// Blocks without rotary positions (SmolLM3's NoPE layers), as runs of a repeated
    /// pattern like `windows`: `true` for a block that does not rotate. Empty: every block
    /// of a rotary model rotates.
    #[serde(skip)]
    pub no_rope: Vec<(Vec<bool>, usize)>,
    /// Every `k`-th block (blocks `k - 1`, `2k - 1`, ...) without rotary positions, beside
    /// `no_rope` (SmolLM3's `no_rope_layer_interval`; llama.cpp's fixed step of 4): a
    /// period that costs nothing however large the config claims it.
    #[serde(skip)]
    pub no_rope_every: Option<usize>,
    /// Which blocks mix tokens with LFM2's gated short convolution instead of attention,
    /// as runs of a repeated pattern like `windows`: `true` for a convolution block.
    /// Empty: every block attends.
    #[serde(skip)]
    pub conv_layers: Vec<(Vec<bool>, usize)>,
    /// Taps of the short convolution (`conv_L_cache`), when the model has any.
    #[serde(skip)]
    pub conv_taps: usize,
    /// Biases on the short convolution and its projections (`conv_bias`).
    #[serde(skip)]
    pub conv_bias: bool,
    /// Which blocks attend locally, as runs of a repeated pattern (GPT-Neo's
    /// `attention_types` form): `(pattern, repeat)` covers `pattern.len() · repeat` blocks,
    /// and block `i` of the run gets `pattern[i % pattern.len()]`: the number of keys a query
    /// sees, itself included, or `None` for global attention. Empty: every block global.
    /// Runs keep a config that claims billions of layers as small as its text.
    #[serde(skip)]
    pub windows: Vec<(Vec<Option<usize>>, usize)>,
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
            family: Family::Gpt2,
            n_kv_head: None,
            norm: NormKind::LayerNorm,
            rope: None,
            gated_mlp: false,
            parallel_residual: false,
            attn_bias: true,
            attn_out_bias: true,
            mlp_bias: true,
            windows: Vec::new(),
            head_dim: None,
            qk_norm: None,
            attn_scale: None,
            embedding_multiplier: 1.0,
            residual_multiplier: 1.0,
            logits_scaling: 1.0,
            no_rope: Vec::new(),
            no_rope_every: None,
            rope_local: None,
            final_logit_softcapping: None,
            attn_logit_softcapping: None,
            conv_layers: Vec::new(),
            conv_taps: 0,
            conv_bias: false,
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

    /// The norm's name as papers write it.
    pub fn norm_name(&self) -> &'static str {
        match self.norm {
            NormKind::LayerNorm => "LayerNorm",
            NormKind::RmsNorm => "RMSNorm",
        }
    }

    /// Key/value heads after defaulting.
    pub fn kv_heads(&self) -> usize {
        self.n_kv_head.unwrap_or(self.n_head)
    }

    /// The local-attention window of block `layer`, if it has one.
    pub fn window(&self, layer: usize) -> Option<usize> {
        run_entry(&self.windows, layer).flatten()
    }

    /// The rotary embedding of block `layer`: `rope`, or `rope_local` for a windowed block
    /// when the model has one, unless the block is one of `no_rope`'s.
    pub fn layer_rope(&self, layer: usize) -> Option<RopeConfig> {
        let periodic = self
            .no_rope_every
            .is_some_and(|k| k > 0 && (layer + 1).is_multiple_of(k));
        match run_entry(&self.no_rope, layer) {
            Some(true) => None,
            // A short-convolution block (LFM2) has no queries or keys to rotate.
            _ if self.is_conv(layer) => None,
            _ if periodic => None,
            _ if self.window(layer).is_some() => {
                self.rope_local.clone().or_else(|| self.rope.clone())
            }
            _ => self.rope.clone(),
        }
    }

    /// Whether block `layer` mixes tokens with a short convolution (LFM2) instead of
    /// attention.
    pub fn is_conv(&self, layer: usize) -> bool {
        run_entry(&self.conv_layers, layer).unwrap_or(false)
    }

    /// Whether `other` describes the same model: every field equal once the per-block runs
    /// are spelled out block by block, the training-only settings (dropout, seed) aside.
    pub fn same_model(&self, other: &GptConfig) -> bool {
        let spelled = |c: &GptConfig| GptConfig {
            windows: vec![((0..c.n_layer).map(|i| c.window(i)).collect(), 1)],
            no_rope: vec![(
                (0..c.n_layer).map(|i| c.layer_rope(i).is_none()).collect(),
                1,
            )],
            no_rope_every: None,
            conv_layers: vec![((0..c.n_layer).map(|i| c.is_conv(i)).collect(), 1)],
            resid_pdrop: 0.0,
            embd_pdrop: 0.0,
            attn_pdrop: 0.0,
            seed: 0,
            ..c.clone()
        };
        self.n_layer == other.n_layer && spelled(self) == spelled(other)
    }

    /// Width of one attention head after defaulting.
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.n_embd / self.n_head.max(1))
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
        match self.head_dim {
            None if d == 0 || h == 0 || d % h != 0 => {
                bail!("config: n_head={h} must be positive and divide n_embd={d}")
            }
            Some(hd) if d == 0 || h == 0 || hd == 0 || hd > u32::MAX as usize / h => {
                bail!("config: head_dim={hd} and n_head={h} must be positive and their product below 2^32 (n_embd={d})")
            }
            _ => {}
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
            if Family::from_model_type(t)? != self.family {
                bail!(
                    "config: model_type {t:?} disagrees with the family {:?}",
                    self.family
                )
            }
        }
        let kv = self.kv_heads();
        if kv == 0 || h % kv != 0 {
            bail!("config: num_key_value_heads={kv} must be positive and divide the {h} attention heads")
        }
        if self.rope_local.is_some() && self.rope.is_none() {
            bail!("config: a local rotary embedding needs a global one")
        }
        for rope in [&self.rope, &self.rope_local].into_iter().flatten() {
            rope.validate(self.head_dim()).map_err(|e| {
                // The message alone: Candle's backtrace (under RUST_BACKTRACE) stays out of it.
                let msg = match e {
                    candle_core::Error::WithBacktrace { inner, .. } => inner.to_string(),
                    e => e.to_string(),
                };
                candle_core::Error::Msg(format!("config: {msg}"))
            })?;
        }
        if !self.windows.is_empty() {
            let covered = layers_covered(&self.windows);
            if covered != Some(self.n_layer) {
                bail!(
                    "config: the attention types describe {} layers but there are {}",
                    covered.map_or("too many".to_string(), |n| n.to_string()),
                    self.n_layer
                )
            }
        }
        let covered = layers_covered(&self.no_rope);
        if !self.no_rope.is_empty() && covered != Some(self.n_layer) {
            bail!(
                "config: no_rope_layers describes {} layers but there are {}",
                covered.map_or("too many".to_string(), |n| n.to_string()),
                self.n_layer
            )
        }
        let covered = layers_covered(&self.conv_layers);
        if !self.conv_layers.is_empty() && covered != Some(self.n_layer) {
            bail!(
                "config: layer_types describes {} layers but there are {}",
                covered.map_or("too many".to_string(), |n| n.to_string()),
                self.n_layer
            )
        }
        if self.conv_layers.iter().any(|(p, _)| p.contains(&true)) {
            if !(1..=MAX_CONV_TAPS).contains(&self.conv_taps) {
                bail!(
                    "config: conv_L_cache={} must be in 1..={MAX_CONV_TAPS}",
                    self.conv_taps
                )
            }
            if !self.n_embd.is_multiple_of(2) {
                bail!(
                    "config: a short-convolution model needs an even hidden_size, got {}",
                    self.n_embd
                )
            }
        }
        if self.no_rope_every == Some(0) {
            bail!("config: no_rope_layer_interval must be positive")
        }
        for (name, x) in [
            (
                "final_logit_softcapping",
                self.final_logit_softcapping.unwrap_or(1.0),
            ),
            (
                "attn_logit_softcapping",
                self.attn_logit_softcapping.unwrap_or(1.0),
            ),
            ("embedding_multiplier", self.embedding_multiplier),
            ("residual_multiplier", self.residual_multiplier),
            ("logits_scaling", self.logits_scaling),
            ("the attention scale", self.attn_scale.unwrap_or(1.0)),
        ] {
            if !(x.is_finite() && x > 0.0) {
                bail!("config: {name} must be a positive number, got {x}")
            }
        }
        if let Some(n) = &self.qk_norm {
            if !(n.eps > 0.0 && n.eps.is_finite()) {
                bail!(
                    "config: the q/k norm's epsilon must be positive, got {}",
                    n.eps
                )
            }
        }
        if self.windows.iter().any(|(p, _)| p.contains(&Some(0))) {
            bail!("config: an attention window (sliding_window / window_size) must be at least 1")
        }
        if self.family != Family::Gpt2 && self.norm_placement == NormPlacement::Post {
            bail!("config: only GPT-2 models can be post-norm")
        }
        if self.add_cross_attention {
            bail!("config: add_cross_attention (GPT-2 as a decoder with cross-attention) is not supported")
        }
        Ok(())
    }
}

/// The entry of block `layer` in runs of repeated patterns (`(pattern, repeat)` covers
/// `pattern.len() · repeat` blocks); `None` past the runs.
fn run_entry<T: Copy>(runs: &[(Vec<T>, usize)], layer: usize) -> Option<T> {
    let mut first = 0usize;
    for (pattern, repeat) in runs {
        let span = pattern.len().saturating_mul(*repeat);
        if layer < first.saturating_add(span) {
            return pattern.get((layer - first) % pattern.len().max(1)).copied();
        }
        first = first.saturating_add(span);
    }
    None
}

/// Per-block values as runs of a repeated pattern: `(pattern, repeat)` covers
/// `pattern.len() · repeat` blocks (see [`GptConfig::windows`]).
pub type Runs<T> = Vec<(Vec<T>, usize)>;

/// The most taps of a short convolution read (LFM2's have 3).
const MAX_CONV_TAPS: usize = 1024;

/// The longest period of windowed and global layers kept when it repeats within the
/// model (the runs hold one period whole).
const MAX_PERIOD: usize = 1 << 16;

/// Every `p`-th block global and the others windowed (`window` keys): blocks
/// `p - 1, 2p - 1, ...` global, as Gemma's `sliding_window_pattern` and llama.cpp's
/// `set_swa_pattern` place them; every block windowed when `p` exceeds `n_layer`. As runs
/// (see [`GptConfig::windows`]).
pub(crate) fn periodic_windows(
    p: usize,
    n_layer: usize,
    window: usize,
) -> Result<Vec<(Vec<Option<usize>>, usize)>> {
    if p > n_layer {
        return Ok(vec![(vec![Some(window)], n_layer)]);
    }
    if p > MAX_PERIOD {
        bail!("config: a sliding-window pattern of period {p} (over {MAX_PERIOD} layers) is not supported")
    }
    let p = p.max(1);
    let mut pattern = vec![Some(window); p];
    pattern[p - 1] = None;
    let mut runs = vec![(pattern, n_layer / p)];
    if !n_layer.is_multiple_of(p) {
        runs.push((vec![Some(window)], n_layer % p));
    }
    Ok(runs)
}

/// How many blocks runs of repeated patterns (as [`GptConfig::windows`]) cover; `None`
/// past `usize`.
pub(crate) fn layers_covered<T>(runs: &[(Vec<T>, usize)]) -> Option<usize> {
    runs.iter().try_fold(0usize, |n, (pattern, repeat)| {
        n.checked_add(pattern.len().checked_mul(*repeat)?)
    })
}
