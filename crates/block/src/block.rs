//! One transformer block: attention and MLP, each with a LayerNorm, dropout and a
//! residual connection.

use candle_core::{Result, Tensor};
use candle_nn::VarBuilder;
use mha::{Dropout, KvCache, Mask, MhaConfig, MultiHeadAttention, WeightLayout};

use crate::{GptConfig, LayerNorm, Mlp, NormPlacement};

/// A GPT-2 block (`h.{i}` in checkpoints): `ln_1`, `attn`, `ln_2`, `mlp`.
#[derive(Debug, Clone)]
pub struct Block {
    ln_1: LayerNorm,
    attn: MultiHeadAttention,
    ln_2: LayerNorm,
    mlp: Mlp,
    resid_drop: Dropout,
    placement: NormPlacement,
}

impl Block {
    /// Loads block number `layer_idx` (its index sets the attention scale when
    /// `scale_attn_by_inverse_layer_idx` is on, and its dropout seed).
    pub fn new(cfg: &GptConfig, layer_idx: usize, vb: VarBuilder) -> Result<Self> {
        let head_dim = (cfg.n_embd / cfg.n_head) as f64;
        let mut scale = if cfg.scale_attn_weights {
            1.0 / head_dim.sqrt()
        } else {
            1.0
        };
        if cfg.scale_attn_by_inverse_layer_idx {
            scale /= (layer_idx + 1) as f64;
        }
        // Distinct, reproducible dropout streams per block and per site.
        let seed = cfg
            .seed
            .wrapping_add(1000u64.wrapping_mul(layer_idx as u64 + 1));
        let attn_cfg = MhaConfig {
            dropout: cfg.attn_pdrop,
            scale: Some(scale),
            seed,
            ..MhaConfig::new(cfg.n_embd, cfg.n_head)
        };
        let eps = cfg.layer_norm_epsilon;
        Ok(Self {
            ln_1: LayerNorm::new(cfg.n_embd, eps, vb.pp("ln_1"))?,
            attn: MultiHeadAttention::load(&attn_cfg, &WeightLayout::Gpt2Conv1d, vb.pp("attn"))?,
            ln_2: LayerNorm::new(cfg.n_embd, eps, vb.pp("ln_2"))?,
            mlp: Mlp::new(cfg, vb.pp("mlp"))?,
            resid_drop: Dropout::new(cfg.resid_pdrop, seed.wrapping_add(1))?,
            placement: cfg.norm_placement,
        })
    }

    /// The block with its attention and MLP projections quantized to `dtype`.
    pub fn quantize(&self, dtype: candle_core::quantized::GgmlDType) -> Result<Self> {
        Ok(Self {
            attn: self.attn.quantize(dtype)?,
            mlp: self.mlp.quantize(dtype)?,
            ..self.clone()
        })
    }

    /// The parts, for saving and inspection.
    pub fn parts(&self) -> (&LayerNorm, &MultiHeadAttention, &LayerNorm, &Mlp) {
        (&self.ln_1, &self.attn, &self.ln_2, &self.mlp)
    }

    /// `[b, t, d]` to `[b, t, d]`. With a cache the keys and values of `xs` are appended to
    /// it and attention covers everything cached (inference only).
    pub fn forward(
        &self,
        xs: &Tensor,
        mask: &Mask,
        cache: Option<&mut KvCache>,
        train: bool,
    ) -> Result<Tensor> {
        Ok(self.run(xs, mask, cache, train, false)?.0)
    }

    /// As [`Self::forward`] without a cache, also returning the attention weights
    /// `[b, n_head, t, t]`.
    pub fn forward_with_weights(
        &self,
        xs: &Tensor,
        mask: &Mask,
        train: bool,
    ) -> Result<(Tensor, Tensor)> {
        match self.run(xs, mask, None, train, true)? {
            (ys, Some(w)) => Ok((ys, w)),
            _ => candle_core::bail!("attention weights were not computed"),
        }
    }

    fn run(
        &self,
        xs: &Tensor,
        mask: &Mask,
        cache: Option<&mut KvCache>,
        train: bool,
        need_weights: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let attend = |h: &Tensor| -> Result<(Tensor, Option<Tensor>)> {
            match cache {
                Some(c) => Ok((self.attn.forward_cached(h, h, h, mask, c)?, None)),
                None if need_weights => {
                    let (ys, w) = self.attn.forward_with_weights(h, h, h, mask, train)?;
                    Ok((ys, Some(w.per_head)))
                }
                None => Ok((self.attn.forward(h, h, h, mask, train)?, None)),
            }
        };
        let drop = |t: Tensor| self.resid_drop.forward(&t, train);
        match self.placement {
            NormPlacement::Pre => {
                let (a, weights) = attend(&self.ln_1.forward(xs)?)?;
                let xs = (xs + drop(a)?)?;
                let h = self.ln_2.forward(&xs)?;
                Ok(((&xs + drop(self.mlp.forward(&h)?)?)?, weights))
            }
            NormPlacement::Post => {
                let (a, weights) = attend(xs)?;
                let xs = self.ln_1.forward(&(xs + drop(a)?)?)?;
                let ys = self.ln_2.forward(&(&xs + drop(self.mlp.forward(&xs)?)?)?)?;
                Ok((ys, weights))
            }
        }
    }
}
