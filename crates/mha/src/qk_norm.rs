//! RMSNorm of queries and keys between their projections and the rotation (Qwen3, Gemma 3,
//! OLMo 2, LFM2): over each head, or over the whole projection.

use candle_core::{bail, DType, Result, Tensor, D};
use candle_nn::{Init, VarBuilder};

use crate::config::{MhaConfig, QkNorm};

/// The weights of [`QkNorm`]: `q` `[head_dim]` and `k` `[head_dim]` per head, or
/// `[n_heads · head_dim]` and `[n_kv_heads · head_dim]` over the whole projection.
#[derive(Debug, Clone)]
pub(crate) struct QkNormWeights {
    pub q: Tensor,
    pub k: Tensor,
    pub norm: QkNorm,
    /// `q` and `k` as f32 values, read once for the decoding step's in-place pass.
    host: (Vec<f32>, Vec<f32>),
}

impl QkNormWeights {
    /// The widths the weights must have under `cfg`.
    fn widths(cfg: &MhaConfig, norm: &QkNorm) -> (usize, usize) {
        match norm.per_head {
            true => (cfg.head_dim(), cfg.head_dim()),
            false => (cfg.q_width(), cfg.kv_width()),
        }
    }

    /// `q_norm.weight` and `k_norm.weight` from a checkpoint (or created as ones).
    pub(crate) fn load(cfg: &MhaConfig, vb: &VarBuilder) -> Result<Option<Self>> {
        let Some(norm) = cfg.qk_norm else {
            return Ok(None);
        };
        let (qw, kw) = Self::widths(cfg, &norm);
        let q = vb.get_with_hints(qw, "q_norm.weight", Init::Const(1.0))?;
        let k = vb.get_with_hints(kw, "k_norm.weight", Init::Const(1.0))?;
        Ok(Some(Self::with(q, k, norm)?))
    }

    fn with(q: Tensor, k: Tensor, norm: QkNorm) -> Result<Self> {
        let host = |t: &Tensor| t.to_dtype(DType::F32)?.to_vec1::<f32>();
        Ok(Self {
            host: (host(&q)?, host(&k)?),
            q,
            k,
            norm,
        })
    }

    /// Weights loaded elsewhere, checked against `cfg`.
    pub(crate) fn new(cfg: &MhaConfig, q: Tensor, k: Tensor) -> Result<Self> {
        let Some(norm) = cfg.qk_norm else {
            bail!("attention: q/k norm weights given to a layer whose config has no qk_norm")
        };
        let (qw, kw) = Self::widths(cfg, &norm);
        if q.dims() != [qw] || k.dims() != [kw] {
            bail!(
                "attention: q/k norm weights {:?} and {:?}, the config needs [{qw}] and [{kw}]",
                q.dims(),
                k.dims()
            )
        }
        Self::with(q, k, norm)
    }

    /// Normalises queries `[b, t, n_heads · head_dim]` and keys `[b, t, n_kv_heads ·
    /// head_dim]`, returning them in the same shapes.
    pub(crate) fn apply(&self, q: &Tensor, k: &Tensor, hd: usize) -> Result<(Tensor, Tensor)> {
        let one = |x: &Tensor, w: &Tensor| -> Result<Tensor> {
            if !self.norm.per_head {
                return rms_norm(x, w, self.norm.eps);
            }
            let (b, t, width) = x.dims3()?;
            let heads = x.reshape((b, t, width / hd, hd))?;
            rms_norm(&heads, w, self.norm.eps)?.reshape((b, t, width))
        };
        Ok((one(q, &self.q)?, one(k, &self.k)?))
    }

    /// The same in place on a decoding step's fused output, f32 `[rows, q | k | v]`
    /// contiguous (`rows = b · t`): the queries' and keys' columns normalised, the values'
    /// left.
    pub(crate) fn apply_fused(
        &self,
        qkv: &mut [f32],
        widths: (usize, usize, usize),
        hd: usize,
    ) -> Result<()> {
        let (qw, kw, vw) = widths;
        let row = qw + 2 * kw;
        if vw != kw || row == 0 || !qkv.len().is_multiple_of(row) {
            bail!(
                "attention: a fused q/k/v output of {} values is not rows of {row}",
                qkv.len()
            )
        }
        let (q, k) = &self.host;
        let eps = self.norm.eps as f32;
        let group = |w: &[f32]| if self.norm.per_head { hd } else { w.len() };
        for r in qkv.chunks_exact_mut(row) {
            let (qs, rest) = r.split_at_mut(qw);
            for (xs, w) in [(qs, q), (&mut rest[..kw], k)] {
                for x in xs.chunks_exact_mut(group(w)) {
                    normalise(x, w, eps);
                }
            }
        }
        Ok(())
    }

    /// The weights as a decoding step applies them to each head as it reads it (the
    /// queries into its scratch rows, the keys into the cache), where there is no pass of
    /// its own over the projection's output; `None` where the norm spans the whole
    /// projection ([`Self::apply_fused`] then).
    pub(crate) fn per_head(&self) -> Option<HeadNorm<'_>> {
        self.norm.per_head.then(|| HeadNorm {
            q: &self.host.0,
            k: &self.host.1,
            eps: self.norm.eps as f32,
        })
    }
}

/// A per-head q/k norm's weights (`[head_dim]` each) and epsilon.
#[derive(Clone, Copy)]
pub(crate) struct HeadNorm<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub eps: f32,
}

/// `x / sqrt(mean(x²) + eps) · w` in place, with the scale `rms_norm` takes (the full
/// pass's), so that every path gives the same values to the bit. Its sum of squares is
/// vectorised: a sequential one was 1% of decoding Qwen3-0.6B.
pub(crate) fn normalise(x: &mut [f32], w: &[f32], eps: f32) {
    let s = gpt_kernels::ops::rms_scale(x, eps);
    x.iter_mut().zip(w).for_each(|(v, w)| *v = *v * s * w);
}

/// RMSNorm over the last dimension with the statistics in f32 (as transformers computes
/// them): `x / sqrt(mean(x²) + eps) · w`, in the input's dtype.
fn rms_norm(xs: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    if gpt_kernels::cpu_kernels(xs.device()) && xs.dtype() == DType::F32 && w.dtype() == DType::F32
    {
        // One fused op with a backward pass (training takes it too).
        return gpt_kernels::ops::rms_norm(xs, w, eps);
    }
    let dtype = xs.dtype();
    let wide = match dtype {
        DType::F16 | DType::BF16 => DType::F32,
        d => d,
    };
    let x = xs.to_dtype(wide)?;
    let var = x.sqr()?.mean_keepdim(D::Minus1)?;
    let x = x.broadcast_div(&(var + eps)?.sqrt()?)?;
    x.to_dtype(dtype)?.broadcast_mul(&w.to_dtype(dtype)?)
}
