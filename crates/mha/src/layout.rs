//! The weight layouts that attention checkpoints actually use, and the projections built
//! from them.
//!
//! Every layout is kept as it is stored: a fused `[in, 3·out]` GPT-2 `c_attn` stays one
//! tensor and q/k/v are views into it. That keeps one matrix product for self-attention,
//! and in training the optimiser updates the very storage the views read.

use candle_core::quantized::GgmlDType;
use candle_core::{bail, Result, Tensor};
use candle_nn::{Init, VarBuilder};

use gpt_kernels::Proj;

use crate::config::MhaConfig;

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
    /// `torch.nn.MultiheadAttention`: `in_proj_weight` `[3·d_model, d_model]` (with
    /// grouped key/value heads `[d_model + 2·kv_width, d_model]`, `kv_width = n_kv_heads ·
    /// head_dim`), or `q_proj_weight [d_model, d_model]`, `k_proj_weight [kv_width, kdim]`,
    /// `v_proj_weight [kv_width, vdim]` when `kdim`/`vdim` differ from `d_model`; the fused
    /// `in_proj_bias` `[d_model + 2·kv_width]`; `out_proj.weight [d_model, d_model]` and
    /// `out_proj.bias [d_model]`. A checkpoint with `bias_k`/`bias_v` (`add_bias_kv=True`)
    /// is refused.
    TorchInProj,
    /// GPT-NeoX: one `nn.Linear` `{qkv}` `[3·d_model, d_model]` whose outputs are grouped
    /// by head (q, k, v of head 0, then of head 1, ...), and an `{o}` `nn.Linear`. The rows
    /// are regrouped as `[q | k | v]` into a copy while loading ([`neox_to_fused`]), so
    /// this layout is for inference: trainable variables (a `VarMap`) are refused.
    HeadInterleavedQkv {
        /// Fused projection prefix (`query_key_value`).
        qkv: String,
        /// Output projection prefix (`dense`).
        o: String,
    },
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

/// The projections of one attention layer.
#[derive(Debug, Clone)]
pub(crate) struct Projections {
    pub q: Proj,
    pub k: Proj,
    pub v: Proj,
    pub o: Proj,
    /// q, k and v side by side, when the checkpoint stores them fused.
    pub qkv: Option<Proj>,
    /// Prepared for inference ([`Self::fused`]) where q, k and v cannot share a matrix (a
    /// GGUF file's q/k/v in different formats: q4_K_M's q6_K values beside q4_K queries
    /// and keys): a decoding step then takes their three products side by side.
    pub apart: bool,
}

impl Projections {
    /// q, k and v computed by one projection where they can share a matrix (see
    /// [`Proj::concat`]), each then a view into it as for a checkpoint that stores them
    /// fused, else marked [`Self::apart`]; every packed matrix side by side with the
    /// model's others in shared slabs ([`Proj::settled`]).
    pub(crate) fn fused(&self) -> Result<Self> {
        let qkv = match &self.qkv {
            Some(qkv) => Some(qkv.settled()),
            None => Proj::concat(&[&self.q, &self.k, &self.v])?,
        };
        let Some(qkv) = qkv else {
            return Ok(Projections {
                q: self.q.settled(),
                k: self.k.settled(),
                v: self.v.settled(),
                o: self.o.settled(),
                qkv: None,
                apart: true,
            });
        };
        let (q_len, k_len) = (self.q.dims()?.1, self.k.dims()?.1);
        let v_len = self.v.dims()?.1;
        Ok(Projections {
            q: qkv.narrow(0, q_len)?,
            k: qkv.narrow(q_len, k_len)?,
            v: qkv.narrow(q_len + k_len, v_len)?,
            o: self.o.settled(),
            qkv: Some(qkv),
            apart: false,
        })
    }

    /// Every projection quantized (where its width allows); q/k/v stay views of the fused
    /// one when there is one.
    pub(crate) fn quantize(&self, dtype: GgmlDType) -> Result<Self> {
        let o = self.o.quantize_or_keep(dtype)?;
        match &self.qkv {
            Some(qkv) => {
                let qkv = qkv.quantize_or_keep(dtype)?;
                let (_, q_len) = self.q.dims()?;
                let (_, kv_len) = self.k.dims()?;
                Ok(Projections {
                    q: qkv.narrow(0, q_len)?,
                    k: qkv.narrow(q_len, kv_len)?,
                    v: qkv.narrow(q_len + kv_len, kv_len)?,
                    o,
                    qkv: Some(qkv),
                    apart: false,
                })
            }
            None => Ok(Projections {
                q: self.q.quantize_or_keep(dtype)?,
                k: self.k.quantize_or_keep(dtype)?,
                v: self.v.quantize_or_keep(dtype)?,
                o,
                qkv: None,
                apart: self.apart,
            }),
        }
    }
}

/// The query, key and value projections of a layer built from projections already loaded
/// ([`MultiHeadAttention::from_projections`](crate::MultiHeadAttention::from_projections)).
#[derive(Debug, Clone)]
pub enum QkvProj {
    /// Three projections: `[d_model, d_model]`, `[kdim, kv_width]`, `[vdim, kv_width]`
    /// (`(in, out)`).
    Separate([Proj; 3]),
    /// One projection `[d_model, d_model + 2·kv_width]` whose outputs are all queries, then
    /// all keys, then all values.
    Fused(Proj),
}

/// Checks the projections' widths against `cfg` and assembles them.
pub(crate) fn from_projections(cfg: &MhaConfig, qkv: QkvProj, o: Proj) -> Result<Projections> {
    cfg.validate()?;
    let (d, qw, kv) = (cfg.d_model, cfg.q_width(), cfg.kv_width());
    let check = |name: &str, p: &Proj, want: (usize, usize), bias: bool| -> Result<()> {
        let got = p.dims()?;
        if got != want {
            bail!("attention {name}: (in, out) = {got:?}, the config needs {want:?}")
        }
        if p.bias().is_some() != bias {
            let has = if bias { "needs" } else { "has no" };
            bail!("attention {name}: the config {has} a bias, the weights disagree")
        }
        Ok(())
    };
    check("output projection", &o, (qw, d), cfg.o_bias())?;
    match qkv {
        QkvProj::Separate([q, k, v]) => {
            check("query projection", &q, (d, qw), cfg.bias)?;
            check("key projection", &k, (cfg.k_dim(), kv), cfg.bias)?;
            check("value projection", &v, (cfg.v_dim(), kv), cfg.bias)?;
            Ok(Projections {
                q,
                k,
                v,
                o,
                qkv: None,
                apart: false,
            })
        }
        QkvProj::Fused(qkv) => {
            if cfg.k_dim() != d || cfg.v_dim() != d {
                bail!("a fused q/k/v projection needs kdim = vdim = d_model = {d}")
            }
            check("fused q/k/v projection", &qkv, (d, qw + 2 * kv), cfg.bias)?;
            split_fused(qkv, o, cfg)
        }
    }
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

fn get_bias(vb: &VarBuilder, len: usize, name: &str, on: bool) -> Result<Option<Tensor>> {
    if on {
        Ok(Some(vb.get_with_hints(len, name, Init::Const(0.0))?))
    } else {
        Ok(None)
    }
}

fn linear(vb: VarBuilder, d_in: usize, d_out: usize, bias: bool) -> Result<Proj> {
    let w = get(&vb, (d_out, d_in), "weight", linear_init(d_in))?;
    Proj::from_linear(&w, get_bias(&vb, d_out, "bias", bias)?)
}

/// Regroups the outputs of GPT-NeoX's fused projection, `[h, 3, head_dim, ..]` (per head
/// q, k, v) to `[3, h, head_dim, ..]` (all queries, all keys, all values), along dimension
/// 0 of `xs` (`[3·h·head_dim]` or `[3·h·head_dim, d_in]`). `inverse` goes back.
pub fn neox_to_fused(xs: &Tensor, n_heads: usize, inverse: bool) -> Result<Tensor> {
    let rows = xs.dim(0)?;
    if n_heads == 0 || rows % (3 * n_heads) != 0 {
        bail!("fused q/k/v of {rows} rows cannot be split into 3 x {n_heads} heads")
    }
    let hd = rows / (3 * n_heads);
    let rest: Vec<usize> = xs.dims()[1..].to_vec();
    let split = |a: usize, b: usize| {
        let mut d = vec![a, b, hd];
        d.extend_from_slice(&rest);
        d
    };
    let (from, to) = match inverse {
        false => (split(n_heads, 3), xs.dims().to_vec()),
        true => (split(3, n_heads), xs.dims().to_vec()),
    };
    xs.reshape(from)?.transpose(0, 1)?.contiguous()?.reshape(to)
}

/// Splits a fused `[in, q + 2·kv]` projection into views.
fn split_fused(qkv: Proj, o: Proj, cfg: &MhaConfig) -> Result<Projections> {
    let (qw, kv) = (cfg.q_width(), cfg.kv_width());
    Ok(Projections {
        q: qkv.narrow(0, qw)?,
        k: qkv.narrow(qw, kv)?,
        v: qkv.narrow(qw + kv, kv)?,
        o,
        qkv: Some(qkv),
        apart: false,
    })
}

pub(crate) fn load(cfg: &MhaConfig, layout: &WeightLayout, vb: VarBuilder) -> Result<Projections> {
    cfg.validate()?;
    // PyTorch's add_bias_kv changes the output: the file and the config must agree.
    for name in ["bias_k", "bias_v"] {
        if vb.contains_tensor(name) && !cfg.add_bias_kv {
            bail!("the checkpoint has `{name}` (saved with nn.MultiheadAttention(add_bias_kv=True)) but the config says `add_bias_kv: false`: set `add_bias_kv: true`")
        }
    }
    match load_layout(cfg, layout, &vb) {
        Ok(p) => {
            check_unexpected_biases(cfg, layout, &vb)?;
            Ok(p)
        }
        Err(e) => match diagnose(cfg, layout, &vb, &e.to_string()) {
            Some(hint) => bail!("{e}; {hint}"),
            None => Err(e),
        },
    }
}

/// The layout whose names a checkpoint has, told by one tensor each holds.
pub(crate) fn layout_in_file(vb: &VarBuilder) -> Option<(&'static str, &'static str)> {
    [
        ("in_proj_weight", "WeightLayout::TorchInProj"),
        (
            "q_proj_weight",
            "WeightLayout::TorchInProj with kdim/vdim set",
        ),
        ("c_attn.weight", "WeightLayout::Gpt2Conv1d"),
        ("query_key_value.weight", "WeightLayout::HeadInterleavedQkv"),
        ("q_proj.weight", "WeightLayout::hf()"),
        ("W_q.weight", "WeightLayout::tutorial()"),
    ]
    .into_iter()
    .find(|(name, _)| vb.contains_tensor(name))
}

/// What to change when loading failed with `error`: another layout, `bias: false`,
/// `kdim`/`vdim`.
fn diagnose(
    cfg: &MhaConfig,
    layout: &WeightLayout,
    vb: &VarBuilder,
    error: &str,
) -> Option<String> {
    let (found, fix) = layout_in_file(vb)?;
    let matches = match layout {
        WeightLayout::TorchInProj => found.ends_with("proj_weight"),
        WeightLayout::Gpt2Conv1d => found == "c_attn.weight",
        WeightLayout::HeadInterleavedQkv { qkv, .. } => {
            vb.contains_tensor(&format!("{qkv}.weight"))
        }
        WeightLayout::Separate { q, .. } => vb.contains_tensor(&format!("{q}.weight")),
    };
    let same_width = cfg.k_dim() == cfg.d_model && cfg.v_dim() == cfg.d_model;
    if !matches {
        return Some(format!("the file has `{found}`: use {fix}"));
    }
    if found == "q_proj_weight" && same_width {
        return Some("the file has separate q_proj_weight/k_proj_weight/v_proj_weight, as PyTorch saves them when kdim or vdim differ from embed_dim: set `kdim` and `vdim`".into());
    }
    if found == "in_proj_weight" && !same_width {
        return Some("the file has one in_proj_weight, as PyTorch saves it when kdim = vdim = embed_dim: leave `kdim` and `vdim` unset".into());
    }
    let biases = [
        "in_proj_bias",
        "c_attn.bias",
        "q_proj.bias",
        "out_proj.bias",
        "o_proj.bias",
    ];
    // Only when a bias is what was missing (a layer built for training has none yet).
    if cfg.bias && error.contains("bias") && !biases.iter().any(|b| vb.contains_tensor(b)) {
        return Some(
            "the file has no biases (nn.MultiheadAttention(bias=False)): set `bias: false`".into(),
        );
    }
    None
}

/// A checkpoint with biases the config would leave unread gives wrong outputs: refuse it.
fn check_unexpected_biases(cfg: &MhaConfig, layout: &WeightLayout, vb: &VarBuilder) -> Result<()> {
    let (qkv, o): (Vec<String>, String) = match layout {
        WeightLayout::TorchInProj => (["in_proj_bias".into()].into(), "out_proj.bias".into()),
        WeightLayout::Gpt2Conv1d => (["c_attn.bias".into()].into(), "c_proj.bias".into()),
        WeightLayout::HeadInterleavedQkv { qkv, o } => {
            ([format!("{qkv}.bias")].into(), format!("{o}.bias"))
        }
        WeightLayout::Separate { q, k, v, o } => (
            [q, k, v].iter().map(|p| format!("{p}.bias")).collect(),
            format!("{o}.bias"),
        ),
    };
    if !cfg.bias {
        if let Some(b) = qkv.iter().find(|b| vb.contains_tensor(b)) {
            bail!("the checkpoint has `{b}` but the config says `bias: false`: set `bias: true`")
        }
    }
    if !cfg.o_bias() && vb.contains_tensor(&o) {
        bail!("the checkpoint has `{o}` but the config has no output bias: set `out_bias: Some(true)` (or `bias: true`)")
    }
    Ok(())
}

fn load_layout(cfg: &MhaConfig, layout: &WeightLayout, vb: &VarBuilder) -> Result<Projections> {
    let vb = vb.clone();
    let (d, kv, kdim, vdim) = (cfg.d_model, cfg.kv_width(), cfg.k_dim(), cfg.v_dim());
    let same_width = kdim == d && vdim == d;
    if cfg.q_width() != d && !matches!(layout, WeightLayout::Separate { .. }) {
        bail!("heads of head_dim={} ({} wide in all, d_model={d}) need separate q/k/v/o projections (WeightLayout::Separate)", cfg.head_dim(), cfg.q_width())
    }
    match layout {
        WeightLayout::Separate { q, k, v, o } => Ok(Projections {
            q: linear(vb.pp(q), d, cfg.q_width(), cfg.bias)?,
            k: linear(vb.pp(k), kdim, kv, cfg.bias)?,
            v: linear(vb.pp(v), vdim, kv, cfg.bias)?,
            o: linear(vb.pp(o), cfg.q_width(), d, cfg.o_bias())?,
            qkv: None,
            apart: false,
        }),
        WeightLayout::HeadInterleavedQkv { qkv, o } => {
            if !same_width || kv != d {
                bail!("the GPT-NeoX query_key_value layout needs kdim = vdim = d_model = {d} and no grouped heads")
            }
            let fused = vb.pp(qkv);
            let w = get(&fused, (3 * d, d), "weight", linear_init(d))?;
            if w.is_variable() {
                // The rows are regrouped into a copy: an optimiser stepping the variable
                // would never change what the layer reads.
                bail!("the GPT-NeoX query_key_value layout loads checkpoints for inference; to train a layer, use WeightLayout::hf() or Gpt2Conv1d")
            }
            let w = neox_to_fused(&w, cfg.n_heads, false)?;
            let b = match get_bias(&fused, 3 * d, "bias", cfg.bias)? {
                Some(b) => Some(neox_to_fused(&b, cfg.n_heads, false)?),
                None => None,
            };
            let o = linear(vb.pp(o), d, d, cfg.o_bias())?;
            split_fused(Proj::from_linear(&w, b)?, o, cfg)
        }
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
            let qkv = Proj::new(w, get_bias(&attn, d + 2 * kv, "bias", cfg.bias)?);
            let proj = vb.pp("c_proj");
            let o = Proj::new(
                get(&proj, (d, d), "weight", gpt2_init)?,
                get_bias(&proj, d, "bias", cfg.o_bias())?,
            );
            split_fused(qkv, o, cfg)
        }
        WeightLayout::TorchInProj => {
            let o = linear(vb.pp("out_proj"), d, d, cfg.o_bias())?;
            let bias = get_bias(&vb, d + 2 * kv, "in_proj_bias", cfg.bias)?;
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
                apart: false,
            })
        }
    }
}
