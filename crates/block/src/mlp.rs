//! The feed-forward half of a block.

use candle_core::{Result, Tensor};
use candle_nn::{Init, VarBuilder};
use mha::Proj;

use crate::{Activation, GptConfig};

/// `c_proj(act(c_fc(x)))`, with GPT-2's Conv1D weights stored `[in, out]`.
#[derive(Debug, Clone)]
pub struct Mlp {
    c_fc: Proj,
    c_proj: Proj,
    act: Activation,
}

/// A GPT-2 Conv1D layer: `weight [d_in, d_out]`, `bias [d_out]`.
pub(crate) fn conv1d(d_in: usize, d_out: usize, vb: VarBuilder) -> Result<Proj> {
    let init = Init::Randn {
        mean: 0.0,
        stdev: 0.02,
    };
    let w = vb.get_with_hints((d_in, d_out), "weight", init)?;
    let b = vb.get_with_hints(d_out, "bias", Init::Const(0.0))?;
    Ok(Proj::new(w, Some(b)))
}

impl Mlp {
    /// The MLP with both projections quantized to `dtype`.
    pub fn quantize(&self, dtype: candle_core::quantized::GgmlDType) -> Result<Self> {
        Ok(Self {
            c_fc: self.c_fc.quantize(dtype)?,
            c_proj: self.c_proj.quantize(dtype)?,
            ..self.clone()
        })
    }

    /// Loads `c_fc` and `c_proj` under `vb`.
    pub fn new(cfg: &GptConfig, vb: VarBuilder) -> Result<Self> {
        let (d, inner) = (cfg.n_embd, cfg.inner_dim());
        Ok(Self {
            c_fc: conv1d(d, inner, vb.pp("c_fc"))?,
            c_proj: conv1d(inner, d, vb.pp("c_proj"))?,
            act: cfg.activation_function,
        })
    }

    /// The two projections, for saving.
    pub fn projections(&self) -> [(&'static str, &Proj); 2] {
        [("c_fc", &self.c_fc), ("c_proj", &self.c_proj)]
    }

    /// `[b, t, d]` to `[b, t, d]`.
    pub fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let hs = self.act.apply(&self.c_fc.forward(xs)?)?;
        self.c_proj.forward(&hs)
    }
}
