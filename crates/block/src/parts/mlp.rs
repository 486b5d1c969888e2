//! The feed-forward half of a block: plain (`down(act(up(x)))`, GPT-2, NeoX, Neo) or gated
//! (`down(act(gate(x)) · up(x))`, SwiGLU in Llama, Mistral, Qwen2).

use candle_core::{Result, Tensor, D};
use candle_nn::{Init, VarBuilder};
use mha::{OutputAct, Proj};

use crate::config::{Activation, GptConfig};
use crate::family::names::MlpNames;

/// The MLP of a block, its projections named as in the checkpoint.
#[derive(Debug, Clone)]
pub struct Mlp {
    up: Proj,
    gate: Option<Proj>,
    /// Gate and up as one projection (`[d, 2·inner]`, gate first) in a model fused for
    /// inference ([`Mlp::fused`]); `gate` and `up` are then views into it.
    gate_up: Option<Proj>,
    down: Proj,
    act: Activation,
    names: MlpNames,
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

/// An `nn.Linear`: `weight [d_out, d_in]`, optional `bias [d_out]`.
pub(crate) fn linear(d_in: usize, d_out: usize, bias: bool, vb: VarBuilder) -> Result<Proj> {
    let bound = 1.0 / (d_in as f64).sqrt();
    let init = Init::Uniform {
        lo: -bound,
        up: bound,
    };
    let w = vb.get_with_hints((d_out, d_in), "weight", init)?;
    let b = match bias {
        true => Some(vb.get_with_hints(d_out, "bias", Init::Const(0.0))?),
        false => None,
    };
    Proj::from_linear(&w, b)
}

impl Mlp {
    /// Loads the projections under `vb` with the family's names.
    pub fn new(cfg: &GptConfig, vb: VarBuilder) -> Result<Self> {
        let names = cfg.family.names().mlp_proj;
        let (d, inner) = (cfg.n_embd, cfg.inner_dim());
        let load = |name: &str, d_in, d_out| match names.conv1d {
            true => conv1d(d_in, d_out, vb.pp(name)),
            false => linear(d_in, d_out, cfg.mlp_bias, vb.pp(name)),
        };
        let gate = match (cfg.gated_mlp, names.gate) {
            (true, Some(g)) => Some(load(g.hf, d, inner)?),
            (true, None) => candle_core::bail!("{:?} checkpoints have no gated MLP", cfg.family),
            (false, _) => None,
        };
        Ok(Self {
            up: load(names.up.hf, d, inner)?,
            gate,
            gate_up: None,
            down: load(names.down.hf, inner, d)?,
            act: cfg.activation_function,
            names,
        })
    }

    /// The MLP from projections loaded elsewhere (a GGUF file's, say), named as `cfg`'s
    /// family names them; their widths are checked against `cfg`.
    pub fn from_projections(
        cfg: &GptConfig,
        up: Proj,
        gate: Option<Proj>,
        down: Proj,
    ) -> Result<Self> {
        let (d, inner) = (cfg.n_embd, cfg.inner_dim());
        let names = cfg.family.names().mlp_proj;
        if gate.is_some() != cfg.gated_mlp {
            candle_core::bail!(
                "the MLP {} a gate projection but the config says gated = {}",
                if gate.is_some() { "has" } else { "lacks" },
                cfg.gated_mlp
            )
        }
        for (name, p, want) in [
            ("up", Some(&up), (d, inner)),
            ("gate", gate.as_ref(), (d, inner)),
            ("down", Some(&down), (inner, d)),
        ] {
            if let Some(p) = p {
                let got = p.dims()?;
                if got != want {
                    candle_core::bail!(
                        "MLP {name} projection: (in, out) = {got:?}, the config needs {want:?}"
                    )
                }
            }
        }
        Ok(Self {
            up,
            gate,
            gate_up: None,
            down,
            act: cfg.activation_function,
            names,
        })
    }

    /// The MLP of a model loaded for inference whose gate and up projections are one
    /// (`gate_up`: `[d, 2·inner]`, gate first), as [`Mlp::fused`] makes them.
    pub fn from_gate_up(cfg: &GptConfig, gate_up: Proj, down: Proj) -> Result<Self> {
        let inner = cfg.inner_dim();
        let (up, gate) = (gate_up.narrow(inner, inner)?, gate_up.narrow(0, inner)?);
        Self::from_projections(cfg, up, Some(gate), down)?.with_gate_up(gate_up)
    }

    /// The MLP with its gate and up projections computed as one where they can share a
    /// matrix ([`Proj::concat`]: a new matrix, the checkpoint's left as they are): for
    /// inference, one product instead of two, and SwiGLU's `silu(gate)·up` in one pass
    /// over it. The same outputs up to the summation order of the products. Packed
    /// matrices move side by side with the model's others into shared slabs
    /// ([`Proj::settled`]).
    pub fn fused(&self) -> Result<Self> {
        let gate_up = match (&self.gate_up, &self.gate) {
            (Some(gate_up), _) => Some(gate_up.settled()),
            (None, Some(gate)) => Proj::concat(&[gate, &self.up])?,
            (None, None) => None,
        };
        let down = self.down.settled();
        match gate_up {
            Some(gate_up) => Ok(Self {
                down,
                ..self.with_gate_up(gate_up)?
            }),
            None => Ok(Self {
                gate: self.gate.as_ref().map(Proj::settled),
                up: self.up.settled(),
                down,
                ..self.clone()
            }),
        }
    }

    /// The MLP computing gate and up by `gate_up` (`[d, 2·inner]`, gate first), the two
    /// then views into it.
    fn with_gate_up(&self, gate_up: Proj) -> Result<Self> {
        let inner = self.up.dims()?.1;
        Ok(Self {
            gate: Some(gate_up.narrow(0, inner)?),
            up: gate_up.narrow(inner, inner)?,
            gate_up: Some(gate_up),
            ..self.clone()
        })
    }

    /// The MLP with its projections quantized to `dtype` (those whose input width allows).
    pub fn quantize(&self, dtype: candle_core::quantized::GgmlDType) -> Result<Self> {
        if let Some(gate_up) = &self.gate_up {
            return Ok(Self {
                down: self.down.quantize_or_keep(dtype)?,
                ..self.with_gate_up(gate_up.quantize_or_keep(dtype)?)?
            });
        }
        Ok(Self {
            up: self.up.quantize_or_keep(dtype)?,
            gate: self
                .gate
                .as_ref()
                .map(|g| g.quantize_or_keep(dtype))
                .transpose()?,
            down: self.down.quantize_or_keep(dtype)?,
            ..self.clone()
        })
    }

    /// The projections under their checkpoint names, in the order they run, and whether
    /// their weights are stored `[in, out]` (Conv1D) rather than `[out, in]`.
    pub fn projections(&self) -> (Vec<(&'static str, &Proj)>, bool) {
        let mut out = Vec::with_capacity(3);
        if let (Some(g), Some(name)) = (&self.gate, self.names.gate) {
            out.push((name.hf, g));
        }
        out.push((self.names.up.hf, &self.up));
        out.push((self.names.down.hf, &self.down));
        (out, self.names.conv1d)
    }

    /// The up, gate (when gated) and down projections.
    pub fn parts(&self) -> (&Proj, Option<&Proj>, &Proj) {
        (&self.up, self.gate.as_ref(), &self.down)
    }

    /// Gate and up as one projection (`[d, 2·inner]`, gate first), in a model fused for
    /// inference ([`Mlp::fused`]).
    pub fn fused_gate_up(&self) -> Option<&Proj> {
        self.gate_up.as_ref()
    }

    /// The activation.
    pub fn activation(&self) -> Activation {
        self.act
    }

    /// Whether the MLP is gated.
    pub fn is_gated(&self) -> bool {
        self.gate.is_some()
    }

    /// `[b, t, d]` to `[b, t, d]`.
    pub fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        // A long prompt through quantized weights goes 128 tokens at a time: its widest
        // temporaries (gate and up, 2·inner per token) are a quarter of a 512-token
        // prefill's, and the allocator keeps less of them, at the same speed (the packed
        // kernels read each weight tile once per 4 tokens anyway). Dense half-precision
        // weights are widened per product, where chunks would cost speed: not chunked.
        const CHUNK: usize = 128;
        let long = xs.rank() == 3 && xs.dim(0)? == 1 && xs.dim(1)? > 2 * CHUNK;
        if long && self.down.is_quantized() {
            let t = xs.dim(1)?;
            let parts = (0..t)
                .step_by(CHUNK)
                .map(|s| self.forward_rows(&xs.narrow(1, s, CHUNK.min(t - s))?))
                .collect::<Result<Vec<_>>>()?;
            return Tensor::cat(&parts, 1);
        }
        self.forward_rows(xs)
    }

    /// [`Self::forward`] on all of `xs` at once.
    fn forward_rows(&self, xs: &Tensor) -> Result<Tensor> {
        // (b, t, inner)
        let hs = match (&self.gate, &self.gate_up) {
            // The activation applied as the product writes its outputs (a prefill through
            // dense weights: no `[b, t, 2·inner]` gate-and-up tensor), or right after it.
            (Some(_), Some(gate_up)) if self.act == Activation::Silu => {
                gate_up.forward_act(xs, OutputAct::SwiGlu)?
            }
            (None, _) if self.act == Activation::GeluNew => {
                self.up.forward_act(xs, OutputAct::GeluTanh)?
            }
            (Some(_), Some(gate_up)) => {
                // (b, t, 2·inner): gate, then up.
                let gu = gate_up.forward(xs)?;
                let inner = gu.dim(D::Minus1)? / 2;
                let (g, u) = (
                    gu.narrow(D::Minus1, 0, inner)?,
                    gu.narrow(D::Minus1, inner, inner)?,
                );
                self.gated(&g, &u)?
            }
            (Some(gate), None) => self.gated(&gate.forward(xs)?, &self.up.forward(xs)?)?,
            (None, _) => self.act.apply(&self.up.forward(xs)?)?,
        };
        self.down.forward(&hs)
    }

    /// `act(g)·u`; SwiGLU's in one pass where [`gpt_kernels::act::silu_mul`] applies.
    fn gated(&self, g: &Tensor, u: &Tensor) -> Result<Tensor> {
        match self.act {
            Activation::Silu => gpt_kernels::act::silu_mul(g, u),
            _ => self.act.apply(g)? * u,
        }
    }
}
