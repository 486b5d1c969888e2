//! One transformer block: attention and MLP, each with a norm, dropout and a residual
//! connection, in sequence or in parallel.

use candle_core::{DType, Result, Tensor};
use candle_nn::VarBuilder;
use mha::{Dropout, ForwardArgs, KvCache, Mask, MhaConfig, MultiHeadAttention, RopeTables};

use super::mixer::Mixer;
use super::mlp::Mlp;
use super::norm::Norm;
use super::short_conv::ShortConv;
use crate::config::{GptConfig, NormPlacement};

/// A decoder block (`h.{i}` in GPT-2 checkpoints, `layers.{i}` in others): a norm and
/// attention, a norm and an MLP, and with sandwich norms one more norm after each.
#[derive(Debug, Clone)]
pub struct Block {
    /// The attention's norm: before it, or after it ([`NormPlacement`]).
    ln_1: Norm,
    /// Attention, or LFM2's short convolution.
    mixer: Mixer,
    /// The mixer's dropout slot when it has none (a short convolution): never drops.
    still: Dropout,
    /// The MLP's norm.
    ln_2: Norm,
    mlp: Mlp,
    /// With [`NormPlacement::Sandwich`]: the norms on the attention's and the MLP's
    /// outputs.
    post: Option<(Norm, Norm)>,
    resid_drop: Dropout,
    placement: NormPlacement,
    parallel: bool,
    /// Factor on each branch's output (Granite's `residual_multiplier`).
    residual_multiplier: f64,
}

impl Block {
    /// Loads block number `layer_idx` (its index sets the attention scale when
    /// `scale_attn_by_inverse_layer_idx` is on, its window, and its dropout seed).
    pub fn new(cfg: &GptConfig, layer_idx: usize, vb: VarBuilder) -> Result<Self> {
        let names = cfg.family.names();
        let (d, eps) = (cfg.n_embd, cfg.layer_norm_epsilon);
        let layout = names.attn_layout();
        let attn_cfg = Self::attn_config(cfg, layer_idx);
        let norm = |name: &str| Norm::new(cfg.norm, d, eps, vb.pp(name));
        let mixer: Mixer = match cfg.is_conv(layer_idx) {
            true => {
                let Some(sc) = names.short_conv else {
                    candle_core::bail!(
                        "{} models have no convolution blocks",
                        cfg.family.model_type()
                    )
                };
                ShortConv::new(d, cfg.conv_taps, cfg.conv_bias, vb.pp(sc.module))?.into()
            }
            false => MultiHeadAttention::load(
                &attn_cfg,
                &layout,
                qk_norm_names(names, vb.pp(names.attn)),
            )?
            .into(),
        };
        let block = Self::from_parts(
            cfg,
            layer_idx,
            norm(names.attn_norm.hf)?,
            mixer,
            norm(names.mlp_norm.hf)?,
            Mlp::new(cfg, vb.pp(names.mlp))?,
        )?;
        match cfg.norm_placement {
            NormPlacement::Sandwich => block.with_post_norms(
                norm(names.attn_post_norm.hf)?,
                norm(names.mlp_post_norm.hf)?,
            ),
            _ => Ok(block),
        }
    }

    /// The block from parts loaded elsewhere (a GGUF file's, say); an attention should be
    /// built with [`Self::attn_config`].
    pub fn from_parts(
        cfg: &GptConfig,
        layer_idx: usize,
        ln_1: Norm,
        mixer: impl Into<Mixer>,
        ln_2: Norm,
        mlp: Mlp,
    ) -> Result<Self> {
        let seed = Self::seed(cfg, layer_idx);
        Ok(Self {
            ln_1,
            mixer: mixer.into(),
            still: Dropout::new(0.0, seed)?,
            ln_2,
            mlp,
            post: None,
            resid_drop: Dropout::new(cfg.resid_pdrop, seed.wrapping_add(1))?,
            placement: cfg.norm_placement,
            parallel: cfg.parallel_residual,
            residual_multiplier: cfg.residual_multiplier,
        })
    }

    /// The block with the norms on its attention's and MLP's outputs, which
    /// [`NormPlacement::Sandwich`] needs.
    pub fn with_post_norms(self, attn: Norm, mlp: Norm) -> Result<Self> {
        if self.placement != NormPlacement::Sandwich {
            candle_core::bail!("only sandwich-norm blocks have norms after their branches")
        }
        Ok(Self {
            post: Some((attn, mlp)),
            ..self
        })
    }

    /// The norms on the attention's and the MLP's outputs, for sandwich-norm blocks.
    pub fn post_norms(&self) -> Option<(&Norm, &Norm)> {
        self.post.as_ref().map(|(a, m)| (a, m))
    }

    /// The block's dropouts, in a fixed order: the attention weights', the residual
    /// branches'.
    pub fn dropouts(&self) -> [&Dropout; 2] {
        match &self.mixer {
            Mixer::Attention(a) => [a.dropout(), &self.resid_drop],
            Mixer::ShortConv(_) => [&self.still, &self.resid_drop],
        }
    }

    /// Distinct, reproducible dropout streams per block and per site.
    fn seed(cfg: &GptConfig, layer_idx: usize) -> u64 {
        cfg.seed
            .wrapping_add(1000u64.wrapping_mul(layer_idx as u64 + 1))
    }

    /// The attention configuration of block `layer_idx`: heads, biases, rotary positions,
    /// its window and its scale.
    pub fn attn_config(cfg: &GptConfig, layer_idx: usize) -> MhaConfig {
        let head_dim = cfg.head_dim() as f64;
        let mut scale = match (cfg.attn_scale, cfg.scale_attn_weights) {
            (Some(s), _) => s,
            (None, true) => 1.0 / head_dim.sqrt(),
            (None, false) => 1.0,
        };
        if cfg.scale_attn_by_inverse_layer_idx {
            scale /= (layer_idx + 1) as f64;
        }
        MhaConfig {
            n_kv_heads: cfg.n_kv_head,
            head_dim: cfg.head_dim,
            qk_norm: cfg.qk_norm,
            bias: cfg.attn_bias,
            out_bias: Some(cfg.attn_out_bias),
            rope: cfg.layer_rope(layer_idx),
            window: cfg.window(layer_idx),
            dropout: cfg.attn_pdrop,
            scale: Some(scale),
            softcap: cfg.attn_logit_softcapping,
            seed: Self::seed(cfg, layer_idx),
            ..MhaConfig::new(cfg.n_embd, cfg.n_head)
        }
    }

    /// The widths of the q/k norm's weights (queries', keys') under `cfg`, when it has one.
    pub fn qk_norm_widths(cfg: &GptConfig) -> Option<(usize, usize)> {
        let hd = cfg.head_dim();
        cfg.qk_norm.map(|n| match n.per_head {
            true => (hd, hd),
            false => (cfg.n_head * hd, cfg.kv_heads() * hd),
        })
    }

    /// The block with its attention and MLP projections quantized to `dtype`.
    pub fn quantize(&self, dtype: candle_core::quantized::GgmlDType) -> Result<Self> {
        Ok(Self {
            mixer: self.mixer.quantize(dtype)?,
            mlp: self.mlp.quantize(dtype)?,
            ..self.clone()
        })
    }

    /// The block with its norms' weights in `dtype` (the projections as they are).
    pub fn norms_to_dtype(&self, dtype: DType) -> Result<Self> {
        let post = match &self.post {
            Some((a, m)) => Some((a.to_dtype(dtype)?, m.to_dtype(dtype)?)),
            None => None,
        };
        Ok(Self {
            ln_1: self.ln_1.to_dtype(dtype)?,
            ln_2: self.ln_2.to_dtype(dtype)?,
            post,
            ..self.clone()
        })
    }

    /// The block with q/k/v and gate/up each computed by one projection where they can
    /// share a matrix ([`MultiHeadAttention::fused`], [`Mlp::fused`]), for inference.
    pub fn fused(&self) -> Result<Self> {
        Ok(Self {
            mixer: self.mixer.fused()?,
            mlp: self.mlp.fused()?,
            ..self.clone()
        })
    }

    /// The parts in the order they run, for saving and inspection: the norm before the
    /// mixer, the mixer (attention, or a short convolution), the norm before the MLP, the
    /// MLP.
    pub fn parts(&self) -> (&Norm, &Mixer, &Norm, &Mlp) {
        (&self.ln_1, &self.mixer, &self.ln_2, &self.mlp)
    }

    /// The block's attention; `None` for a short-convolution block.
    pub fn attention(&self) -> Option<&MultiHeadAttention> {
        self.mixer.attention()
    }

    /// Whether attention and MLP read the same input (GPT-NeoX's parallel residual).
    pub fn is_parallel(&self) -> bool {
        self.parallel
    }

    /// `[b, t, d]` to `[b, t, d]`. With a cache the keys and values of `xs` are appended to
    /// it and attention covers everything cached (inference only). `rope`: the rotary
    /// tables of the positions of `xs` (see [`ForwardArgs::rope`]).
    pub fn forward(
        &self,
        xs: &Tensor,
        mask: &Mask,
        rope: Option<&RopeTables>,
        cache: Option<&mut KvCache>,
        train: bool,
    ) -> Result<Tensor> {
        Ok(self.run(xs, mask, rope, cache, train, false)?.0)
    }

    /// As [`Self::forward`] without a cache, also returning the attention weights
    /// `[b, n_head, t, t]`.
    pub fn forward_with_weights(
        &self,
        xs: &Tensor,
        mask: &Mask,
        rope: Option<&RopeTables>,
        train: bool,
    ) -> Result<(Tensor, Tensor)> {
        match self.run(xs, mask, rope, None, train, true)? {
            (ys, Some(w)) => Ok((ys, w)),
            _ => candle_core::bail!("attention weights were not computed"),
        }
    }

    /// Rows that are separate sequences, each with its own cache of any length (continuous
    /// batching; see [`MultiHeadAttention::forward_rows`]): `[rows, t, d]` to
    /// `[rows, t, d]`, each row equal to that sequence run alone. Inference only.
    pub fn forward_rows(
        &self,
        xs: &Tensor,
        rope: Option<&RopeTables>,
        caches: &mut [&mut KvCache],
    ) -> Result<Tensor> {
        let attend = |h: &Tensor| Ok((self.mixer.forward_rows(h, rope, caches)?, None));
        Ok(self.stack(xs, attend, false)?.0)
    }

    fn run(
        &self,
        xs: &Tensor,
        mask: &Mask,
        rope: Option<&RopeTables>,
        cache: Option<&mut KvCache>,
        train: bool,
        need_weights: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let attend = |h: &Tensor| -> Result<(Tensor, Option<Tensor>)> {
            let args = ForwardArgs {
                mask: *mask,
                rope,
                cache,
                need_weights,
                train,
            };
            self.mixer.forward(h, args)
        };
        self.stack(xs, attend, train)
    }

    /// Norms, attention (`attend`, called once), MLP and residuals in the family's order.
    fn stack(
        &self,
        xs: &Tensor,
        attend: impl FnOnce(&Tensor) -> Result<(Tensor, Option<Tensor>)>,
        train: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let drop = |t: Tensor| {
            let t = match self.residual_multiplier {
                1.0 => t,
                m => t.affine(m, 0.0)?,
            };
            self.resid_drop.forward(&t, train)
        };
        let add = gpt_kernels::ops::add;
        match (self.placement, self.parallel) {
            (NormPlacement::Sandwich, false) => {
                let Some((post_attn, post_mlp)) = &self.post else {
                    candle_core::bail!(
                        "a sandwich-norm block needs its post norms (Block::with_post_norms)"
                    )
                };
                let (a, weights) = attend(&self.ln_1.forward(xs)?)?;
                let xs = add(xs, &drop(post_attn.forward(&a)?)?)?;
                let m = self.mlp.forward(&self.ln_2.forward(&xs)?)?;
                Ok((add(&xs, &drop(post_mlp.forward(&m)?)?)?, weights))
            }
            (NormPlacement::PostBranch, false) => {
                let (a, weights) = attend(xs)?;
                let xs = add(xs, &drop(self.ln_1.forward(&a)?)?)?;
                let m = self.mlp.forward(&xs)?;
                Ok((add(&xs, &drop(self.ln_2.forward(&m)?)?)?, weights))
            }
            (NormPlacement::Sandwich | NormPlacement::PostBranch, true) => {
                candle_core::bail!(
                    "parallel residuals with {:?} norms are not supported",
                    self.placement
                )
            }
            (NormPlacement::Pre, false) => {
                let (a, weights) = attend(&self.ln_1.forward(xs)?)?;
                let xs = add(xs, &drop(a)?)?;
                let h = self.ln_2.forward(&xs)?;
                Ok((add(&xs, &drop(self.mlp.forward(&h)?)?)?, weights))
            }
            // x + attn(ln_1(x)) + mlp(ln_2(x))
            (NormPlacement::Pre, true) => {
                let (a, weights) = attend(&self.ln_1.forward(xs)?)?;
                let m = self.mlp.forward(&self.ln_2.forward(xs)?)?;
                Ok((add(&add(xs, &drop(a)?)?, &drop(m)?)?, weights))
            }
            (NormPlacement::Post, _) => {
                let (a, weights) = attend(xs)?;
                let xs = self.ln_1.forward(&add(xs, &drop(a)?)?)?;
                let ys = self
                    .ln_2
                    .forward(&add(&xs, &drop(self.mlp.forward(&xs)?)?)?)?;
                Ok((ys, weights))
            }
        }
    }
}

/// `vb` (an attention module's) with `mha`'s names of the q/k norms (`q_norm`, `k_norm`)
/// looked up under the family's (LFM2's `q_layernorm`, `k_layernorm`).
fn qk_norm_names<'a>(
    names: &crate::family::names::TensorNames,
    vb: VarBuilder<'a>,
) -> VarBuilder<'a> {
    let (q, k) = (names.attn_proj.q_norm.hf, names.attn_proj.k_norm.hf);
    if (q, k) == ("q_norm", "k_norm") || q.is_empty() || k.is_empty() {
        return vb;
    }
    // The renamer sees names with `vb`'s path and answers under it.
    let path = format!("{}.", vb.prefix());
    vb.rename_f(move |name: &str| {
        let name = name.strip_prefix(&path).unwrap_or(name);
        match name {
            "q_norm.weight" => format!("{q}.weight"),
            "k_norm.weight" => format!("{k}.weight"),
            other => other.to_string(),
        }
    })
}
