//! The differentiable fused attention straight from a fused q/k/v projection's output
//! `[b, t, (h + 2·h_kv)·d]` (rotating q and k as it reads them), with one gradient of the
//! projection's shape: training reads and writes the projection's layout, not three head
//! tensors.

use candle_core::{bail, CpuStorage, CustomOp1, CustomOp3, Layout, Result, Shape, Tensor};
use gpt_kernels::storage::{values, with_values};
use rayon::prelude::*;

use super::tiles::FlashAttn;

/// The rotation of the queries and keys in a fused `[b, t, w]` projection output.
pub(super) struct QkRotation {
    /// `[b, t, rot / 2]`, contiguous f32.
    pub(super) cos: Tensor,
    pub(super) sin: Tensor,
    pub(super) rot: usize,
}

impl QkRotation {
    /// Rotates, in place, the first `rot` features of the first `heads` heads (of `d`) in
    /// every `[w]` row of `xs` (`[b·t, w]`), by the angles or their opposites.
    fn apply(&self, xs: &mut [f32], w: usize, heads: usize, d: usize, inverse: bool) -> Result<()> {
        let half = self.rot / 2;
        if half == 0 || xs.is_empty() {
            return Ok(());
        }
        with_values(&self.cos, "rotary cos", |cos| {
            with_values(&self.sin, "rotary sin", |sin| {
                xs.par_chunks_mut(w).enumerate().for_each(|(bt, row)| {
                    let (c, s) = (&cos[bt * half..][..half], &sin[bt * half..][..half]);
                    for head in row[..heads * d].chunks_exact_mut(d) {
                        crate::rope::rotate_pairs(head, c, s, inverse);
                    }
                });
                Ok(())
            })
        })
    }
}

/// Views `[b, h, t, d]` of the queries, keys and values in a contiguous `[b, t, w]`.
pub(super) fn qkv_heads(qkv: &Tensor, h: usize, h_kv: usize) -> Result<(Tensor, Tensor, Tensor)> {
    let (b, t, w) = qkv.dims3()?;
    // (b, t, w) -> (b, t, h + 2·h_kv, d): free on a contiguous tensor.
    let heads = qkv.reshape((b, t, h + 2 * h_kv, w / (h + 2 * h_kv)))?;
    let part = |at: usize, n: usize| heads.narrow(2, at, n)?.transpose(1, 2);
    Ok((part(0, h)?, part(h, h_kv)?, part(h + h_kv, h_kv)?))
}

/// The op of [`flash_attn_cpu_train_qkv`].
pub(super) struct FlashAttnQkv {
    pub(super) inner: FlashAttn,
    pub(super) n_heads: usize,
    pub(super) n_kv_heads: usize,
    pub(super) rope: Option<QkRotation>,
}

impl FlashAttnQkv {
    /// `qkv` with its queries and keys rotated (a copy), or `None` without a rotation.
    fn rotated(&self, qkv: &[f32], w: usize) -> Result<Option<Vec<f32>>> {
        let Some(rope) = &self.rope else {
            return Ok(None);
        };
        let mut xs = qkv.to_vec();
        let d = w / (self.n_heads + 2 * self.n_kv_heads);
        rope.apply(&mut xs, w, self.n_heads + self.n_kv_heads, d, false)?;
        Ok(Some(xs))
    }
}

impl CustomOp1 for FlashAttnQkv {
    fn name(&self) -> &'static str {
        "flash-attn-cpu-qkv"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (b, t, w) = l.shape().dims3()?;
        let (h, h_kv) = (self.n_heads, self.n_kv_heads);
        let d = w / (h + 2 * h_kv);
        if !l.is_contiguous() {
            bail!("flash_attn_cpu_train_qkv: expected a contiguous input")
        }
        // Part `at..at + n` of the heads as (b, n, t, d): strides (t·w, d, w, 1).
        let view = |at: usize, n: usize| {
            Layout::new(
                Shape::from((b, n, t, d)),
                vec![t * w, d, w, 1],
                l.start_offset() + at * d,
            )
        };
        let (lq, lk, lv) = (view(0, h), view(h, h_kv), view(h + h_kv, h_kv));
        let rotated = self
            .rotated(values(s, l, "flash_attn_cpu_train_qkv")?, w)?
            .map(CpuStorage::F32);
        let (heads, _) = match &rotated {
            Some(r) => {
                // The copy starts at 0 where `s` starts at the layout's offset.
                let at = |l: Layout, n: usize| {
                    Layout::new(l.shape().clone(), l.stride().to_vec(), n * d)
                };
                let (lq, lk, lv) = (at(lq, 0), at(lk, h), at(lv, h + h_kv));
                self.inner.cpu_fwd(r, &lq, r, &lk, r, &lv)?
            }
            None => self.inner.cpu_fwd(s, &lq, s, &lk, s, &lv)?,
        };
        let CpuStorage::F32(heads) = heads else {
            bail!("flash_attn_cpu_train_qkv: expected f32 outputs")
        };
        // (b, h, t, d) -> (b, t, h·d)
        let mut ys = vec![0f32; b * t * h * d];
        if !ys.is_empty() {
            ys.par_chunks_mut(t * h * d)
                .zip(heads.par_chunks(h * t * d))
                .for_each(|(ys, heads)| {
                    for (hi, head) in heads.chunks_exact(t * d).enumerate() {
                        for (ti, row) in head.chunks_exact(d).enumerate() {
                            ys[(ti * h + hi) * d..][..d].copy_from_slice(row);
                        }
                    }
                });
        }
        Ok((CpuStorage::F32(ys), Shape::from((b, t, h * d))))
    }

    fn bwd(&self, qkv: &Tensor, ys: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let (h, h_kv) = (self.n_heads, self.n_kv_heads);
        let (b, t, w) = qkv.dims3()?;
        let d = w / (h + 2 * h_kv);
        let qkv = qkv.contiguous()?;
        let rotated = with_values(&qkv, "flash_attn_cpu_train_qkv", |x| self.rotated(x, w))?;
        let qkv = match rotated {
            Some(r) => Tensor::from_vec(r, (b, t, w), qkv.device())?,
            None => qkv,
        };
        let (q, k, v) = qkv_heads(&qkv, h, h_kv)?;
        let heads = |x: &Tensor| x.reshape((b, t, h, d))?.transpose(1, 2);
        let (dq, dk, dv) = super::backward::gradients(
            &self.inner,
            &q,
            &k,
            &v,
            &heads(ys)?,
            &heads(&grad.contiguous()?)?,
        )?;
        // Each position's row of the gradient: its query heads' rows, then keys', values'.
        let mut dqkv = vec![0f32; b * t * w];
        if !dqkv.is_empty() {
            dqkv.par_chunks_mut(w).enumerate().for_each(|(bt, row)| {
                let (bi, ti) = (bt / t, bt % t);
                let parts = [(&dq, h, 0), (&dk, h_kv, h), (&dv, h_kv, h + h_kv)];
                for (src, n, at) in parts {
                    for hi in 0..n {
                        let from = ((bi * n + hi) * t + ti) * d;
                        row[(at + hi) * d..][..d].copy_from_slice(&src[from..from + d]);
                    }
                }
            });
        }
        // The gradients of the rotated queries and keys, rotated back.
        if let Some(rope) = &self.rope {
            rope.apply(&mut dqkv, w, h + h_kv, d, true)?;
        }
        Ok(Some(Tensor::from_vec(dqkv, (b, t, w), qkv.device())?))
    }
}
