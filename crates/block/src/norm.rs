//! LayerNorm that keeps its gradient.

use candle_core::{Result, Tensor};
use candle_nn::{Init, VarBuilder};

/// LayerNorm over the last dimension, with `weight` and `bias` named as in checkpoints.
///
/// Candle's fused `layer_norm` has no backward pass, so it runs only when nothing needs a
/// gradient; otherwise the same formula is built from differentiable ops.
#[derive(Debug, Clone)]
pub struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f64,
}

impl LayerNorm {
    /// Loads (or creates, as ones and zeros) `weight` and `bias` of width `dim`.
    pub fn new(dim: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            weight: vb.get_with_hints(dim, "weight", Init::Const(1.0))?,
            bias: vb.get_with_hints(dim, "bias", Init::Const(0.0))?,
            eps,
        })
    }

    /// The scale, `[dim]`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The shift, `[dim]`.
    pub fn bias(&self) -> &Tensor {
        &self.bias
    }

    /// `[.., dim]` to `[.., dim]`.
    pub fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let needs_grad = xs.track_op() || self.weight.track_op() || self.bias.track_op();
        if needs_grad || !xs.is_contiguous() {
            candle_nn::ops::layer_norm_slow(xs, &self.weight, &self.bias, self.eps as f32)
        } else {
            candle_nn::ops::layer_norm(xs, &self.weight, &self.bias, self.eps as f32)
        }
    }
}
