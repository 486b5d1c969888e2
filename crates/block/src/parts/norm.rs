//! LayerNorm and RMSNorm that keep their gradients.

use candle_core::{bail, DType, Result, Tensor, D};
use candle_nn::{Init, VarBuilder};

use crate::config::NormKind;

/// LayerNorm over the last dimension, with `weight` and `bias` named as in checkpoints.
///
/// Candle's fused `layer_norm` has no backward pass, so it runs only when nothing needs a
/// gradient; training on the CPU in f32 takes [`gpt_kernels::ops::layer_norm`], which has one, and
/// other devices and dtypes the same formula built from differentiable ops.
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
        if needs_grad && gpt_kernels::cpu_kernels(xs.device()) && xs.dtype() == DType::F32 {
            // One fused op whose backward recomputes the row statistics (training).
            return gpt_kernels::ops::layer_norm(xs, &self.weight, &self.bias, self.eps);
        }
        if needs_grad || !xs.is_contiguous() {
            candle_nn::ops::layer_norm_slow(xs, &self.weight, &self.bias, self.eps as f32)
        } else {
            candle_nn::ops::layer_norm(xs, &self.weight, &self.bias, self.eps as f32)
        }
    }
}

/// RMSNorm over the last dimension (Llama, Mistral, Qwen2): `x / sqrt(mean(x²) + eps) ·
/// weight`, the statistics in f32 whatever the input's dtype (as transformers computes it).
///
/// Candle's fused `rms_norm` has no backward pass, so it runs only when nothing needs a
/// gradient; training on the CPU in f32 takes [`gpt_kernels::ops::rms_norm`], and other devices
/// and dtypes the formula built from differentiable ops.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    /// Loads (or creates, as ones) `weight` of width `dim`.
    pub fn new(dim: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            weight: vb.get_with_hints(dim, "weight", Init::Const(1.0))?,
            eps,
        })
    }

    /// The scale, `[dim]`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// `[.., dim]` to `[.., dim]`.
    pub fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let needs_grad = xs.track_op() || self.weight.track_op();
        let f32_weight = self.weight.dtype() == DType::F32;
        if gpt_kernels::cpu_kernels(xs.device()) && xs.dtype() == DType::F32 && f32_weight {
            // One fused op whose backward recomputes the row scale (training). Inference
            // takes it too: its sum of squares is vectorised, where Candle's `rms_norm`
            // adds one value at a time, serial work on the calling thread between
            // decoding products.
            return gpt_kernels::ops::rms_norm(xs, &self.weight, self.eps);
        }
        if !needs_grad && xs.is_contiguous() && xs.dtype() == DType::F32 {
            return candle_nn::ops::rms_norm(xs, &self.weight, self.eps as f32);
        }
        // Half precision is widened to f32 for the statistics; f64 stays f64.
        let dtype = xs.dtype();
        let x = xs.to_dtype(at_least_f32(dtype))?;
        let var = x.sqr()?.mean_keepdim(D::Minus1)?;
        let x = x.broadcast_div(&(var + self.eps)?.sqrt()?)?;
        x.to_dtype(dtype)?.broadcast_mul(&self.weight)
    }
}

/// The dtype statistics are computed in: f32 for half precision, the dtype itself otherwise.
pub(crate) fn at_least_f32(dtype: DType) -> DType {
    match dtype {
        DType::F16 | DType::BF16 => DType::F32,
        d => d,
    }
}

/// The normalisation a model uses, with its checkpoint weights.
#[derive(Debug, Clone)]
pub enum Norm {
    /// Weight and bias (GPT-2, GPT-NeoX, GPT-Neo).
    LayerNorm(LayerNorm),
    /// Weight only (Llama, Mistral, Qwen2).
    RmsNorm(RmsNorm),
}

impl Norm {
    /// Loads the norm `kind` of width `dim` under `vb`.
    pub fn new(kind: NormKind, dim: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        Ok(match kind {
            NormKind::LayerNorm => Self::LayerNorm(LayerNorm::new(dim, eps, vb)?),
            NormKind::RmsNorm => Self::RmsNorm(RmsNorm::new(dim, eps, vb)?),
        })
    }

    /// The norm `kind` from tensors loaded elsewhere: `weight [dim]`, and `bias [dim]` for a
    /// LayerNorm (an RMSNorm takes none).
    pub fn from_tensors(
        kind: NormKind,
        weight: Tensor,
        bias: Option<Tensor>,
        eps: f64,
    ) -> Result<Self> {
        let dim = weight.dims1()?;
        match (kind, bias) {
            (NormKind::LayerNorm, Some(bias)) if bias.dims() == [dim] => {
                Ok(Self::LayerNorm(LayerNorm { weight, bias, eps }))
            }
            (NormKind::LayerNorm, Some(bias)) => bail!(
                "LayerNorm bias {:?} does not match its weight [{dim}]",
                bias.dims()
            ),
            (NormKind::LayerNorm, None) => bail!("a LayerNorm needs a bias"),
            (NormKind::RmsNorm, None) => Ok(Self::RmsNorm(RmsNorm { weight, eps })),
            (NormKind::RmsNorm, Some(_)) => bail!("an RMSNorm has no bias"),
        }
    }

    /// The norm with its weights in `dtype`.
    pub fn to_dtype(&self, dtype: DType) -> Result<Self> {
        Ok(match self {
            Self::LayerNorm(n) => Self::LayerNorm(LayerNorm {
                weight: n.weight.to_dtype(dtype)?,
                bias: n.bias.to_dtype(dtype)?,
                eps: n.eps,
            }),
            Self::RmsNorm(n) => Self::RmsNorm(RmsNorm {
                weight: n.weight.to_dtype(dtype)?,
                eps: n.eps,
            }),
        })
    }

    /// `[.., dim]` to `[.., dim]`.
    pub fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        match self {
            Self::LayerNorm(n) => n.forward(xs),
            Self::RmsNorm(n) => n.forward(xs),
        }
    }

    /// The scale, `[dim]`.
    pub fn weight(&self) -> &Tensor {
        match self {
            Self::LayerNorm(n) => n.weight(),
            Self::RmsNorm(n) => n.weight(),
        }
    }

    /// The shift, `[dim]` (LayerNorm only).
    pub fn bias(&self) -> Option<&Tensor> {
        match self {
            Self::LayerNorm(n) => Some(n.bias()),
            Self::RmsNorm(_) => None,
        }
    }

    /// The name of the kind, for messages.
    pub fn kind(&self) -> NormKind {
        match self {
            Self::LayerNorm(_) => NormKind::LayerNorm,
            Self::RmsNorm(_) => NormKind::RmsNorm,
        }
    }
}
