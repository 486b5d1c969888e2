//! The fused attention kernels for the CPU (f32), with their eager reference in
//! [`crate::sdpa_reference`] and the tests that hold them to it.
//!
//! Flash-attention style: queries in blocks of `BR` rows, keys in blocks of `BC`, an online
//! softmax, and key blocks above the causal diagonal never touched, so nothing of size
//! `q_len × kv_len` exists. The two block products go through the `gemm` crate (the kernels
//! Candle's matmul uses); blocks run in parallel on rayon's pool.
//!
//! - `prefill.rs`: the blocked forward pass, and `decode.rs` for a few query rows against a
//!   long cache (decoding), split over the keys instead;
//! - `step.rs`: a decoding step in place, from a fused q/k/v projection into the cache;
//! - `backward.rs`: the gradients, recomputing each block's weights from the saved
//!   log-sum-exp; `qkv.rs`: the training op from a fused projection's output;
//! - `tiles.rs`: the parameters and row views every pass shares;
//! - `cuda.rs` (feature `cuda`): the same online softmax on CUDA devices
//!   (`kernels/attention.cu`), taken only when `MHA_CUDA_ATTENTION=fused` is set.
//!
//! A public module for the crates built on this one and for the benchmarks: most users want
//! [`crate::sdpa`] or [`crate::MultiHeadAttention`], which pick these kernels when they
//! apply.

mod backward;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod decode;
mod prefill;
mod qkv;
pub(crate) mod step;
pub(crate) mod tiles;

use candle_core::{bail, DType, Result, Tensor};

use crate::dropout::Dropout;
use crate::mask::Mask;
use crate::rope::{Rope, RopeTables};
use qkv::{qkv_heads, FlashAttnQkv, QkRotation};
pub(crate) use tiles::DIRECT_ROWS;
use tiles::{unit, FlashAttn};

/// Fused attention of `q [b, h, tq, d]` over `k [b, h_kv, tk, d]`, `v [b, h_kv, tk, dv]`
/// with causal masking and key padding; additive masks go through the reference path.
/// No gradient flows through it: [`flash_attn_cpu_train`] is the differentiable one.
pub fn flash_attn_cpu(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Mask,
    scale: f64,
) -> Result<Tensor> {
    flash_attn_cpu_softcapped(q, k, v, mask, scale, None)
}

/// [`flash_attn_cpu`] with each score `s` (after the scale) soft-capped to
/// `cap · tanh(s / cap)` before the mask, as Gemma 2's `attn_logit_softcapping` does.
pub fn flash_attn_cpu_softcapped(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Mask,
    scale: f64,
    softcap: Option<f64>,
) -> Result<Tensor> {
    let op = FlashAttn::new(q, k, mask, scale, None)?.capped(softcap)?;
    unit(q)?.apply_op3_no_bwd(&unit(k)?, &unit(v)?, &op)
}

/// [`flash_attn_cpu`] for training: differentiable, with dropout on the attention weights.
///
/// The forward pass keeps only its inputs, its output and one log-sum-exp per query row;
/// the backward pass recomputes the weights block by block (flash-attention style), so no
/// `q_len × kv_len` matrix exists in either pass, and key blocks the mask hides are never
/// visited. Dropout replays the masks [`Dropout::forward`] would draw on the weights
/// `[b, h, tq, tk]` (the same call of `dropout`, the same elements), so this computes what
/// [`crate::sdpa_reference`] computes, its gradients included; the tests hold it to that
/// and to PyTorch.
///
/// # Shapes
/// As [`flash_attn_cpu`]; gradients have their inputs' shapes (a key/value head shared by
/// several query heads sums their gradients).
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// use mha::{flash::flash_attn_cpu_train, Dropout, Mask};
///
/// let dev = Device::Cpu;
/// // 4 query heads over 2 key/value heads, 10 positions, head_dim 8.
/// let q = Var::from_tensor(&Tensor::randn(0f32, 1.0, (1, 4, 10, 8), &dev)?)?;
/// let k = Var::from_tensor(&Tensor::randn(0f32, 1.0, (1, 2, 10, 8), &dev)?)?;
/// let v = Var::from_tensor(&Tensor::randn(0f32, 1.0, (1, 2, 10, 8), &dev)?)?;
/// let dropout = Dropout::new(0.1, 42)?;
/// let ys = flash_attn_cpu_train(&q, &k, &v, &Mask::causal(0), 8f64.powf(-0.5), Some(&dropout))?;
/// let grads = ys.sqr()?.sum_all()?.backward()?;
/// assert_eq!(grads.get(k.as_tensor()).unwrap().dims(), &[1, 2, 10, 8]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn flash_attn_cpu_train(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Mask,
    scale: f64,
    dropout: Option<&Dropout>,
) -> Result<Tensor> {
    let drop = dropout.filter(|d| d.is_active(true)).map(Dropout::draw);
    let op = FlashAttn::new(q, k, mask, scale, drop)?;
    unit(q)?.apply_op3(&unit(k)?, &unit(v)?, op)
}

/// [`flash_attn_cpu_train`] straight from the output of a fused q/k/v projection, for
/// self-attention: one differentiable op from `qkv` to the heads' outputs side by side.
///
/// The same kernels on the same numbers: the heads are read in place, and the backward pass
/// writes the gradients of the three parts into one tensor of `qkv`'s shape. Taken apart
/// with `narrow`, `reshape` and `transpose` instead, Candle's backward pass pads each
/// part's gradient to the whole width, concatenates and adds the three, and copies the
/// output's transposes: about ten passes over a tensor the size of `qkv` per layer and
/// training step where this makes one.
///
/// With `rope`, queries and keys are first rotated at the positions of the tables
/// (`[b, t, rotary_dim / 2]`, f32) as [`Rope::apply`] does, inside the op: its backward pass
/// rotates their gradients back.
///
/// # Shapes
/// - `qkv`: `[b, t, (n_heads + 2·n_kv_heads)·head_dim]`, queries then keys then values
/// - returns `[b, t, n_heads·head_dim]`
pub fn flash_attn_cpu_train_qkv(
    qkv: &Tensor,
    n_heads: usize,
    n_kv_heads: usize,
    mask: &Mask,
    scale: f64,
    dropout: Option<&Dropout>,
    rope: Option<(&Rope, &RopeTables)>,
) -> Result<Tensor> {
    let (b, t, width) = qkv.dims3()?;
    let parts = n_heads + 2 * n_kv_heads;
    if n_kv_heads == 0 || !n_heads.is_multiple_of(n_kv_heads) || !width.is_multiple_of(parts) {
        bail!("flash_attn_cpu_train_qkv: a width of {width} for {n_heads} query and {n_kv_heads} key/value heads")
    }
    let rope = match rope {
        None => None,
        Some((r, tables)) => {
            let (rot, d) = (r.rotary_dim(), width / parts);
            let half = rot / 2;
            let fits = |x: &Tensor| x.dims() == [b, t, half] && x.dtype() == DType::F32;
            if rot > d || rot % 2 != 0 || !fits(&tables.cos) || !fits(&tables.sin) {
                bail!("flash_attn_cpu_train_qkv: rotary tables {:?} of {rot} features do not fit [{b}, {t}] positions of heads of {d}", tables.cos.dims())
            }
            Some(QkRotation {
                cos: tables.cos.contiguous()?,
                sin: tables.sin.contiguous()?,
                rot,
            })
        }
    };
    let qkv = qkv.contiguous()?;
    let (q, k, _) = qkv_heads(&qkv, n_heads, n_kv_heads)?;
    let drop = dropout.filter(|d| d.is_active(true)).map(Dropout::draw);
    let inner = FlashAttn::new(&q, &k, mask, scale, drop)?;
    qkv.apply_op1(FlashAttnQkv {
        inner,
        n_heads,
        n_kv_heads,
        rope,
    })
}
