//! Scaled dot-product attention over `[batch, heads, len, head_dim]` tensors: the fused
//! CPU kernels where they compute the same thing, the plain differentiable path elsewhere.

use candle_core::{bail, DType, Result, Tensor, D};

use crate::dropout::Dropout;
use crate::flash;
use crate::mask::Mask;

/// How to run [`sdpa`] beyond its tensors and mask.
#[derive(Debug, Clone, Copy)]
pub struct SdpaParams<'a> {
    /// Factor applied to `q·k`, usually `1/sqrt(head_dim)`.
    pub scale: f64,
    /// Dropout on the attention weights, applied only when `train` is true.
    pub dropout: Option<&'a Dropout>,
    /// Training mode: dropout on, and the fast inference kernels off.
    pub train: bool,
    /// Return the attention weights `[batch, n_heads, q_len, kv_len]` (after dropout, as
    /// PyTorch does).
    pub need_weights: bool,
}

impl SdpaParams<'_> {
    /// Inference with the given scale: no dropout, no weights returned.
    pub fn inference(scale: f64) -> Self {
        SdpaParams {
            scale,
            dropout: None,
            train: false,
            need_weights: false,
        }
    }
}

/// Checks `q [b, h, tq, d]`, `k [b, h_kv, tk, d]`, `v [b, h_kv, tk, dv]`.
fn check_heads(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(usize, usize, usize, usize)> {
    let dims = |t: &Tensor, name: &str| match t.dims() {
        &[a, b, c, d] => Ok((a, b, c, d)),
        s => bail!("attention: {name} must be [batch, heads, seq, head_dim], got {s:?}"),
    };
    let (b, h, tq, d) = dims(q, "query")?;
    let (kb, hkv, tk, kd) = dims(k, "key")?;
    let (vb, vh, vt, _) = dims(v, "value")?;
    if kb != b || vb != b || kd != d || (vh, vt) != (hkv, tk) {
        bail!(
            "attention: query {:?}, key {:?} and value {:?} disagree (batch, heads, key length or head_dim)",
            q.dims(),
            k.dims(),
            v.dims()
        )
    }
    if hkv == 0 || h % hkv != 0 {
        bail!("attention: {hkv} key/value heads do not divide {h} query heads")
    }
    // Keys and values may be kept in half precision beside f32 queries (a half-precision
    // KV cache, [`crate::KvCache::with_dtype`]); otherwise one dtype.
    let half = |t: &Tensor| matches!(t.dtype(), DType::F16 | DType::BF16);
    let kv_ok = |t: &Tensor| t.dtype() == q.dtype() || (q.dtype() == DType::F32 && half(t));
    if !kv_ok(k) || !kv_ok(v) {
        bail!(
            "attention: query, key and value dtypes differ: {:?}, {:?}, {:?}",
            q.dtype(),
            k.dtype(),
            v.dtype()
        )
    }
    Ok((b, h, tq, tk))
}

/// Scaled dot-product attention on heads: `softmax(q·kᵀ·scale + mask)·v`.
///
/// Picks a fused CPU kernel when it computes the same thing (f32 on CPU, no additive mask,
/// no weights asked for): [`flash::flash_attn_cpu`] for inference, and
/// [`flash::flash_attn_cpu_train`] when a gradient is needed or dropout is on (it keeps no
/// `q_len × kv_len` matrix for the backward pass). Otherwise the reference path
/// [`sdpa_reference`]. Keys and values may have fewer heads than queries
/// (grouped-query attention): query head `i` reads key/value head `i / (h / h_kv)`.
///
/// # Shapes
/// - `q`: `[batch, n_heads, q_len, head_dim]`
/// - `k`: `[batch, n_kv_heads, kv_len, head_dim]`
/// - `v`: `[batch, n_kv_heads, kv_len, v_head_dim]`
/// - returns `[batch, n_heads, q_len, v_head_dim]`, and the weights
///   `[batch, n_heads, q_len, kv_len]` when asked for.
pub fn sdpa(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Mask,
    p: &SdpaParams,
) -> Result<(Tensor, Option<Tensor>)> {
    sdpa_softcapped(q, k, v, mask, p, None)
}

/// [`sdpa`] with each score `s = q·kᵀ·scale` soft-capped to `cap · tanh(s / cap)` before
/// the mask (Gemma 2's `attn_logit_softcapping`). Gradients and dropout take the reference
/// path (the fused training kernel has no soft cap).
pub fn sdpa_softcapped(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Mask,
    p: &SdpaParams,
    softcap: Option<f64>,
) -> Result<(Tensor, Option<Tensor>)> {
    if let Some(cap) = softcap {
        if !(cap.is_finite() && cap > 0.0) {
            bail!("attention: a soft cap must be a positive number, got {cap}")
        }
    }
    let (b, h, tq, tk) = check_heads(q, k, v)?;
    let dropout = p.dropout.filter(|d| d.is_active(p.train));
    let fused = ![b, h, tq, tk].contains(&0)
        && gpt_kernels::cpu_kernels(q.device())
        && q.dtype() == DType::F32
        && mask.is_structural()
        && !p.need_weights;
    let grad = q.track_op() || k.track_op() || v.track_op();
    let mixed = k.dtype() != q.dtype() || v.dtype() != q.dtype();
    let training = grad || dropout.is_some();
    // On CUDA, where asked for (`MHA_CUDA_ATTENTION=fused`, until a GPU has checked it):
    // the fused kernel of `flash::cuda`, inference only.
    #[cfg(feature = "cuda")]
    if !training && !p.need_weights && q.device().is_cuda() && flash::cuda::enabled() {
        if let Some(ys) = flash::cuda::attention(q, k, v, mask, p.scale, softcap)? {
            return Ok((ys, None));
        }
    }
    if fused && !(mixed && training) && !(softcap.is_some() && training) {
        let ys = if training {
            flash::flash_attn_cpu_train(q, k, v, mask, p.scale, dropout)?
        } else {
            flash::flash_attn_cpu_softcapped(q, k, v, mask, p.scale, softcap)?
        };
        return Ok((ys, None));
    }
    reference(q, k, v, mask, p, softcap)
}

/// The plain path: materialise the scores, mask, softmax, multiply. Differentiable, any
/// device and dtype (scores and softmax in f32). Every faster path is tested against it.
///
/// Shapes as in [`sdpa`].
pub fn sdpa_reference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Mask,
    p: &SdpaParams,
) -> Result<(Tensor, Option<Tensor>)> {
    reference(q, k, v, mask, p, None)
}

/// [`sdpa_reference`] with [`sdpa_softcapped`]'s soft cap.
pub fn sdpa_reference_softcapped(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Mask,
    p: &SdpaParams,
    softcap: f64,
) -> Result<(Tensor, Option<Tensor>)> {
    reference(q, k, v, mask, p, Some(softcap))
}

fn reference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Mask,
    p: &SdpaParams,
    softcap: Option<f64>,
) -> Result<(Tensor, Option<Tensor>)> {
    let (b, h, tq, tk) = check_heads(q, k, v)?;
    if [b, h, tq, tk].contains(&0) {
        // Nothing to attend with or to: queries with no keys attend to nothing (zeros, as
        // for fully masked rows). The mask is still checked against the shapes.
        mask.to_bias((b, h, tq, tk), q.device())?;
        let ys = Tensor::zeros((b, h, tq, v.dim(3)?), q.dtype(), q.device())?;
        let weights = match p.need_weights {
            true => Some(Tensor::zeros((b, h, tq, tk), DType::F32, q.device())?),
            false => None,
        };
        return Ok((ys, weights));
    }
    let h_kv = k.dim(1)?;
    let n_rep = h / h_kv;
    let (d, dv) = (q.dim(3)?, v.dim(3)?);
    // Half-precision keys and values beside f32 queries (a half-precision cache).
    let (k, v) = (k.to_dtype(q.dtype())?, v.to_dtype(q.dtype())?);
    // Scores in f32 at least (f64 stays f64, for gradient checks).
    let compute = match q.dtype() {
        DType::F64 => DType::F64,
        _ => DType::F32,
    };
    // The query heads grouped by the key/value head they read (query head i reads head
    // i / n_rep, PyTorch's `enable_gqa`): rows `[b, h_kv, n_rep·tq, d]`, whose products
    // take each group's keys and values as they are. No copy of them per query head
    // ([`repeat_kv`]: on a GPU, n_rep copies of the cache each layer and step).
    let qc = q.to_dtype(compute)?.reshape((b, h_kv, n_rep * tq, d))?;
    let kc = k.to_dtype(compute)?.contiguous()?;
    // (b, h_kv, n_rep·tq, tk)
    let scores = (qc.matmul(&kc.t()?)? * p.scale)?;
    let scores = match softcap {
        Some(cap) => ((scores / cap)?.tanh()? * cap)?,
        None => scores,
    };
    let weights = match mask.to_bias((b, h, tq, tk), q.device())? {
        Some(bias) => {
            // The bias, broadcastable to (b, h, tq, tk), grouped as the scores.
            let mut dims = bias.dims().to_vec();
            while dims.len() < 4 {
                dims.insert(0, 1);
            }
            let (bb, bh, bq, bk) = (dims[0], dims[1], dims[2], dims[3]);
            let bias = match bh == h {
                true => bias.reshape((bb, h_kv, n_rep, bq, bk))?,
                false => bias.reshape((bb, 1, bh, bq, bk))?,
            };
            let scores = scores.reshape((b, h_kv, n_rep, tq, tk))?;
            let weights = masked_softmax(&scores.broadcast_add(&bias.to_dtype(compute)?)?)?;
            weights.reshape((b, h_kv, n_rep * tq, tk))?
        }
        // Nothing hidden, so no row is all `-inf`, and no gradient asked for: Candle's
        // fused softmax, one kernel where the differentiable one takes seven (a decoding
        // step on a GPU waits on its launches).
        None if !scores.track_op() => candle_nn::ops::softmax_last_dim(&scores)?,
        None => masked_softmax(&scores)?,
    };
    // (b, h, tq, tk), as dropout draws and the caller reads them.
    let weights = weights.reshape((b, h, tq, tk))?;
    let weights = match p.dropout {
        Some(d) => d.forward(&weights, p.train)?,
        None => weights,
    };
    // (b, h_kv, n_rep·tq, dv), then (b, h, tq, dv)
    let ys = weights
        .reshape((b, h_kv, n_rep * tq, tk))?
        .to_dtype(v.dtype())?
        .matmul(&v.contiguous()?)?
        .reshape((b, h, tq, dv))?;
    Ok((ys, p.need_weights.then_some(weights)))
}

/// `[b, h_kv, t, d]` to `[b, h_kv·n_rep, t, d]`, each kv head repeated `n_rep` times in
/// place (PyTorch's `repeat_interleave`, as in `enable_gqa=True`).
pub fn repeat_kv(xs: &Tensor, n_rep: usize) -> Result<Tensor> {
    if n_rep == 1 {
        return Ok(xs.clone());
    }
    let (b, h_kv, t, d) = xs.dims4()?;
    xs.unsqueeze(2)?
        .broadcast_as((b, h_kv, n_rep, t, d))?
        .reshape((b, h_kv * n_rep, t, d))
}

/// Softmax over the last dimension where `-inf` entries get weight 0 and a row that is all
/// `-inf` gets all zeros instead of NaN. Built from differentiable ops (Candle's fused
/// `softmax_last_dim` has no backward).
pub fn masked_softmax(scores: &Tensor) -> Result<Tensor> {
    // Softmax is invariant to the shift, so the max needs no gradient; clamping it keeps
    // `-inf - -inf` (a fully masked row) out of the computation.
    let max = scores
        .max_keepdim(D::Minus1)?
        .detach()
        .maximum(f32::MIN as f64)?;
    let e = scores.broadcast_sub(&max)?.exp()?;
    // A row with any visible key sums to at least 1; only empty rows hit the clamp.
    let sum = e
        .sum_keepdim(D::Minus1)?
        .maximum(f32::MIN_POSITIVE as f64)?;
    e.broadcast_div(&sum)
}
