//! Losses over logits: next-token cross-entropy and per-token log-probabilities.

use candle_core::{bail, DType, Result, Tensor, D};

use crate::parts::norm::at_least_f32;

/// Mean cross-entropy of `logits [b, t, v]` predicting `ids[:, 1:]`.
pub fn next_token_loss(logits: &Tensor, ids: &Tensor) -> Result<Tensor> {
    let (b, t, v) = logits.dims3()?;
    if t < 2 {
        bail!("the loss needs at least 2 tokens per row, got {t}")
    }
    check_targets(ids, b, t, v)?;
    if gpt_kernels::cpu_kernels(logits.device()) && logits.dtype() == DType::F32 {
        // Fused: no copy of the logits, and a backward pass of one sweep.
        return gpt_kernels::ops::next_token_cross_entropy(logits, ids);
    }
    let inputs = logits.narrow(1, 0, t - 1)?.reshape((b * (t - 1), v))?;
    let targets = ids
        .narrow(1, 1, t - 1)?
        .flatten_all()?
        .to_dtype(DType::U32)?;
    candle_nn::loss::cross_entropy(&inputs.to_dtype(at_least_f32(logits.dtype()))?, &targets)
}

/// Log-probability of each next token, `[b, t - 1]`: entry `(i, j)` is
/// `log p(ids[i, j + 1] | ids[i, ..= j])`.
pub fn token_logprobs(logits: &Tensor, ids: &Tensor) -> Result<Tensor> {
    let (b, t, v) = logits.dims3()?;
    if t < 2 {
        bail!("log-probabilities need at least 2 tokens per row, got {t}")
    }
    check_targets(ids, b, t, v)?;
    let logp = candle_nn::ops::log_softmax(
        &logits
            .narrow(1, 0, t - 1)?
            .to_dtype(at_least_f32(logits.dtype()))?,
        D::Minus1,
    )?;
    let targets = ids
        .narrow(1, 1, t - 1)?
        .to_dtype(DType::U32)?
        .unsqueeze(2)?;
    logp.contiguous()?
        .gather(&targets.contiguous()?, 2)?
        .squeeze(2)
}

/// Checks that `ids` are the `[b, t]` integer targets of `[b, t, v]` logits.
fn check_targets(ids: &Tensor, b: usize, t: usize, v: usize) -> Result<()> {
    if ids.dims() != [b, t] {
        bail!(
            "ids must be [batch, seq] = [{b}, {t}] to match the logits, got {:?}",
            ids.dims()
        )
    }
    if b == 0 {
        bail!("no rows to score")
    }
    if ids.dtype().is_float() {
        bail!("ids must be integers, got {:?}", ids.dtype())
    }
    let ids = ids.to_dtype(DType::I64)?.flatten_all()?;
    let (lo, hi) = (
        ids.min(0)?.to_scalar::<i64>()?,
        ids.max(0)?.to_scalar::<i64>()?,
    );
    if lo < 0 || hi >= v as i64 {
        bail!("ids must be in 0..{v}, got values from {lo} to {hi}")
    }
    Ok(())
}
