//! The weight layouts that attention checkpoints actually use, and the projections built
//! from them.
//!
//! Every layout is kept as it is stored: a fused `[in, 3·out]` GPT-2 `c_attn` stays one
//! tensor and q/k/v are views into it. That keeps one matrix product for self-attention,
//! and in training the optimiser updates the very storage the views read.

use candle_core::{bail, Result, Tensor};
use candle_nn::{Init, VarBuilder};

use crate::MhaConfig;

/// Where the four projections of an attention layer live in a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WeightLayout {
    /// Four `nn.Linear`s (`{name}.weight` stored `[out, in]`, optional `{name}.bias`).
    Separate {
        /// Query projection prefix.
        q: String,
        /// Key projection prefix.
        k: String,
        /// Value projection prefix.
        v: String,
        /// Output projection prefix.
        o: String,
    },
    /// GPT-2: a fused `c_attn` Conv1D (`weight` stored `[d_model, d_model + 2·kv_width]`,
    /// that is `[in, out]`) and a `c_proj` Conv1D `[d_model, d_model]`.
    Gpt2Conv1d,
    /// `torch.nn.MultiheadAttention`: `in_proj_weight` `[3·d_model, d_model]` (or
    /// `q_proj_weight`/`k_proj_weight`/`v_proj_weight` when `kdim`/`vdim` differ), the
    /// fused `in_proj_bias`, and `out_proj.weight`/`out_proj.bias`.
    TorchInProj,
}

impl WeightLayout {
    /// `q_proj`, `k_proj`, `v_proj`, `o_proj`: Llama, Mistral, OPT and most of the hub.
    pub fn hf() -> Self {
        Self::separate("q_proj", "k_proj", "v_proj", "o_proj")
    }

    /// `W_q`, `W_k`, `W_v`, `W_o`: the classic from-scratch tutorial.
    pub fn tutorial() -> Self {
        Self::separate("W_q", "W_k", "W_v", "W_o")
    }

    /// Four `nn.Linear`s under the given prefixes.
    pub fn separate(q: &str, k: &str, v: &str, o: &str) -> Self {
        Self::Separate {
            q: q.into(),
            k: k.into(),
            v: v.into(),
            o: o.into(),
        }
    }
}

/// A linear map `xs · w_t + b`, with `w_t` `[in, out]` (often a transposed view).
#[derive(Debug, Clone)]
pub struct Proj {
    w_t: Tensor,
    b: Option<Tensor>,
}

impl Proj {
    /// From an `[in, out]` matrix and an optional `[out]` bias.
    pub fn new(w_t: Tensor, b: Option<Tensor>) -> Self {
        Self { w_t, b }
    }

    /// From a PyTorch `nn.Linear` weight `[out, in]`.
    pub fn from_linear(w: &Tensor, b: Option<Tensor>) -> Result<Self> {
        Ok(Self::new(w.t()?, b))
    }

    /// The `[in, out]` weight.
    pub fn weight_t(&self) -> &Tensor {
        &self.w_t
    }

    /// The `[out]` bias.
    pub fn bias(&self) -> Option<&Tensor> {
        self.b.as_ref()
    }

    /// Output columns `start..start + len` of this projection, sharing its storage.
    pub fn narrow(&self, start: usize, len: usize) -> Result<Self> {
        let b = match &self.b {
            Some(b) => Some(b.narrow(0, start, len)?),
            None => None,
        };
        Ok(Self::new(self.w_t.narrow(1, start, len)?, b))
    }

    /// `[.., in]` to `[.., out]`.
    pub fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let (d_in, d_out) = self.w_t.dims2()?;
        let dims = xs.dims();
        match dims.last() {
            Some(&d) if d == d_in => {}
            _ => bail!("projection expects inputs [.., {d_in}], got {dims:?}"),
        }
        let rows = xs.elem_count() / d_in;
        // One 2-D product over all rows: no per-batch broadcast of the weight.
        let ys = xs.reshape((rows, d_in))?.matmul(&self.w_t)?;
        let ys = match &self.b {
            Some(b) => ys.broadcast_add(b)?,
            None => ys,
        };
        let mut out_dims = dims.to_vec();
        if let Some(last) = out_dims.last_mut() {
            *last = d_out;
        }
        ys.reshape(out_dims)
    }
}

/// The projections of one attention layer.
#[derive(Debug, Clone)]
pub(crate) struct Projections {
    pub q: Proj,
    pub k: Proj,
    pub v: Proj,
    pub o: Proj,
    /// q, k and v side by side, when the checkpoint stores them fused.
    pub qkv: Option<Proj>,
}

/// PyTorch's `nn.Linear` initialisation, used when the `VarBuilder` creates variables.
fn linear_init(d_in: usize) -> Init {
    let bound = 1.0 / (d_in as f64).sqrt();
    Init::Uniform {
        lo: -bound,
        up: bound,
    }
}

fn get(vb: &VarBuilder, shape: (usize, usize), name: &str, init: Init) -> Result<Tensor> {
    vb.get_with_hints(shape, name, init)
}

fn get_bias(vb: &VarBuilder, len: usize, name: &str, cfg: &MhaConfig) -> Result<Option<Tensor>> {
    if cfg.bias {
        Ok(Some(vb.get_with_hints(len, name, Init::Const(0.0))?))
    } else {
        Ok(None)
    }
}

fn linear(vb: VarBuilder, d_in: usize, d_out: usize, cfg: &MhaConfig) -> Result<Proj> {
    let w = get(&vb, (d_out, d_in), "weight", linear_init(d_in))?;
    Proj::from_linear(&w, get_bias(&vb, d_out, "bias", cfg)?)
}

/// Splits a fused `[in, q + 2·kv]` projection into views.
fn split_fused(qkv: Proj, o: Proj, cfg: &MhaConfig) -> Result<Projections> {
    let (d, kv) = (cfg.d_model, cfg.kv_width());
    Ok(Projections {
        q: qkv.narrow(0, d)?,
        k: qkv.narrow(d, kv)?,
        v: qkv.narrow(d + kv, kv)?,
        o,
        qkv: Some(qkv),
    })
}

pub(crate) fn load(cfg: &MhaConfig, layout: &WeightLayout, vb: VarBuilder) -> Result<Projections> {
    cfg.validate()?;
    let (d, kv, kdim, vdim) = (cfg.d_model, cfg.kv_width(), cfg.k_dim(), cfg.v_dim());
    let same_width = kdim == d && vdim == d;
    match layout {
        WeightLayout::Separate { q, k, v, o } => Ok(Projections {
            q: linear(vb.pp(q), d, d, cfg)?,
            k: linear(vb.pp(k), kdim, kv, cfg)?,
            v: linear(vb.pp(v), vdim, kv, cfg)?,
            o: linear(vb.pp(o), d, d, cfg)?,
            qkv: None,
        }),
        WeightLayout::Gpt2Conv1d => {
            if !same_width {
                bail!("the GPT-2 c_attn layout needs kdim = vdim = d_model = {d}, got kdim={kdim}, vdim={vdim}")
            }
            let gpt2_init = Init::Randn {
                mean: 0.0,
                stdev: 0.02,
            };
            let attn = vb.pp("c_attn");
            let w = get(&attn, (d, d + 2 * kv), "weight", gpt2_init)?;
            let qkv = Proj::new(w, get_bias(&attn, d + 2 * kv, "bias", cfg)?);
            let proj = vb.pp("c_proj");
            let o = Proj::new(
                get(&proj, (d, d), "weight", gpt2_init)?,
                get_bias(&proj, d, "bias", cfg)?,
            );
            split_fused(qkv, o, cfg)
        }
        WeightLayout::TorchInProj => {
            let o = linear(vb.pp("out_proj"), d, d, cfg)?;
            let bias = get_bias(&vb, d + 2 * kv, "in_proj_bias", cfg)?;
            if same_width {
                let w = get(&vb, (d + 2 * kv, d), "in_proj_weight", linear_init(d))?;
                let qkv = Proj::from_linear(&w, bias)?;
                return split_fused(qkv, o, cfg);
            }
            let part = |start: usize, len: usize| -> Result<Option<Tensor>> {
                match &bias {
                    Some(b) => Ok(Some(b.narrow(0, start, len)?)),
                    None => Ok(None),
                }
            };
            let qw = get(&vb, (d, d), "q_proj_weight", linear_init(d))?;
            let kw = get(&vb, (kv, kdim), "k_proj_weight", linear_init(kdim))?;
            let vw = get(&vb, (kv, vdim), "v_proj_weight", linear_init(vdim))?;
            Ok(Projections {
                q: Proj::from_linear(&qw, part(0, d)?)?,
                k: Proj::from_linear(&kw, part(d, kv)?)?,
                v: Proj::from_linear(&vw, part(d + kv, kv)?)?,
                o,
                qkv: None,
            })
        }
    }
}
