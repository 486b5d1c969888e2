//! Fused, differentiable CPU ops for training the layers around attention: LayerNorm,
//! RMSNorm, a linear layer with bias, and next-token cross-entropy.
//! (And [`add`], the residual add, which a decoding step's rows take without Candle's
//! per-op setup.)
//!
//! Built from Candle's tensor ops, a LayerNorm keeps about ten activations of its input's
//! size for the backward pass, a linear layer its product and the biased sum, and a
//! cross-entropy four copies of the logits; these keep only their inputs (and recompute
//! row statistics in the backward pass), and both passes are one vectorised sweep split
//! over rayon's pool, with sums across tasks added in a fixed order (the same result
//! whatever the threads do). f32 on the CPU; the crates built on this one fall back to
//! Candle's ops elsewhere. The tests hold them to the op-by-op formulas and to PyTorch.
//!
//! ```
//! use candle_core::{Device, Tensor, Var};
//! use gpt_kernels::ops::{layer_norm, linear, next_token_cross_entropy};
//!
//! let dev = Device::Cpu;
//! let ids = Tensor::new(&[[1u32, 4, 2, 3]], &dev)?; // [b, t]
//! let xs = Var::from_tensor(&Tensor::randn(0f32, 1.0, (4, 16), &dev)?)?; // [b·t, d]
//! let (g, b) = (Var::ones(16, candle_core::DType::F32, &dev)?, Var::zeros(16, candle_core::DType::F32, &dev)?);
//! let w = Var::from_tensor(&Tensor::randn(0f32, 0.1, (5, 16), &dev)?)?; // [vocab, d] as nn.Linear stores it
//! let bias = Var::zeros(5, candle_core::DType::F32, &dev)?;
//! let h = layer_norm(&xs, &g, &b, 1e-5)?;
//! let logits = linear(&h, &w.t()?, &bias)?.reshape((1, 4, 5))?; // [b, t, vocab]
//! let loss = next_token_cross_entropy(&logits, &ids)?; // F.cross_entropy(logits[:, :-1], ids[:, 1:])
//! let grads = loss.backward()?;
//! assert_eq!(grads.get(w.as_tensor()).unwrap().dims(), &[5, 16]);
//! # Ok::<(), candle_core::Error>(())
//! ```

use candle_core::{
    bail, CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Storage,
    Tensor,
};
use rayon::prelude::*;

use crate::simd;
use crate::storage::{cpu, values, with_values};

/// Rows per task.
const ROWS: usize = 32;

/// `(x - mean) / sqrt(var + eps) · weight + bias` over the last dimension, as
/// `torch.nn.functional.layer_norm`.
///
/// # Shapes
/// `xs [.., dim]`, `weight [dim]`, `bias [dim]`; returns `xs`'s shape.
pub fn layer_norm(xs: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let dim = xs.dim(candle_core::D::Minus1)?;
    if weight.dims() != [dim] || bias.dims() != [dim] {
        bail!(
            "layer_norm: weight {:?} and bias {:?} must be [{dim}]",
            weight.dims(),
            bias.dims()
        )
    }
    let op = LayerNorm { eps: eps as f32 };
    xs.contiguous()?
        .apply_op3(&weight.contiguous()?, &bias.contiguous()?, op)
}

struct LayerNorm {
    eps: f32,
}

/// `ys` computed row by row from `xs` (rows of `dim`), `ROWS` rows per task.
fn per_row(xs: &[f32], dim: usize, f: impl Fn(&mut [f32], &[f32]) + Sync) -> Vec<f32> {
    let mut ys = vec![0f32; xs.len()];
    if dim > 0 && xs.len() <= ROWS * dim {
        // One task's rows (decoding) run here: handing them to the pool cost more than
        // computing them.
        for (y, x) in ys.chunks_mut(dim).zip(xs.chunks(dim)) {
            f(y, x)
        }
    } else if dim > 0 {
        ys.par_chunks_mut(ROWS * dim)
            .zip(xs.par_chunks(ROWS * dim))
            .for_each(|(ys, xs)| {
                for (y, x) in ys.chunks_mut(dim).zip(xs.chunks(dim)) {
                    f(y, x)
                }
            });
    }
    ys
}

/// Mean and `1 / sqrt(var + eps)` of a row, two passes (no cancellation).
fn row_stats(x: &[f32], eps: f32, centred: &mut [f32]) -> (f32, f32) {
    let n = x.len() as f32;
    let mean = simd::sum(x) / n;
    for (c, &v) in centred.iter_mut().zip(x) {
        *c = v - mean;
    }
    let var = simd::dot(centred, centred) / n;
    (mean, 1.0 / (var + eps).sqrt())
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "layer-norm-fused"
    }

    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
        sb: &CpuStorage,
        lb: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let xs = values(sx, lx, "layer_norm input")?;
        let (w, b) = (
            values(sw, lw, "layer_norm weight")?,
            values(sb, lb, "layer_norm bias")?,
        );
        let ys = per_row(xs, w.len(), |y, x| {
            let (_, rstd) = row_stats(x, self.eps, y);
            for ((y, &w), &b) in y.iter_mut().zip(w).zip(b) {
                *y = *y * rstd * w + b;
            }
        });
        Ok((CpuStorage::F32(ys), lx.shape().clone()))
    }

    fn bwd(
        &self,
        xs: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        _ys: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let dim = weight.elem_count();
        let (sx, lx) = xs.storage_and_layout();
        let (sw, lw) = weight.storage_and_layout();
        let (sg, lg) = grad.storage_and_layout();
        let (x, w, g) = match (&*sx, &*sw, &*sg) {
            (Storage::Cpu(sx), Storage::Cpu(sw), Storage::Cpu(sg)) => (
                values(sx, lx, "layer_norm input")?,
                values(sw, lw, "layer_norm weight")?,
                values(sg, lg, "layer_norm gradient")?,
            ),
            _ => bail!("layer_norm: expected CPU tensors"),
        };
        if g.len() != x.len() || dim == 0 {
            bail!("layer_norm backward: gradient and input sizes differ")
        }
        let mut dx = vec![0f32; x.len()];
        // Each task sums its rows' dweight and dbias; the partial sums are added after.
        let (dw, db) = dx
            .par_chunks_mut(ROWS * dim)
            .zip(x.par_chunks(ROWS * dim).zip(g.par_chunks(ROWS * dim)))
            .map(|(dx, (x, g))| {
                let (mut dw, mut db) = (vec![0f32; dim], vec![0f32; dim]);
                let (mut xhat, mut gw) = (vec![0f32; dim], vec![0f32; dim]);
                for ((dx, x), g) in dx.chunks_mut(dim).zip(x.chunks(dim)).zip(g.chunks(dim)) {
                    let (_, rstd) = row_stats(x, self.eps, &mut xhat);
                    for (((h, gw), &g), &w) in xhat.iter_mut().zip(&mut gw).zip(g).zip(w) {
                        *h *= rstd;
                        *gw = g * w;
                    }
                    let n = dim as f32;
                    let mean_g = simd::sum(&gw) / n;
                    let mean_gx = simd::dot(&gw, &xhat) / n;
                    for (((dx, &gw), &h), ((dw, db), &g)) in dx
                        .iter_mut()
                        .zip(&gw)
                        .zip(&xhat)
                        .zip(dw.iter_mut().zip(&mut db).zip(g))
                    {
                        *dx = rstd * (gw - mean_g - h * mean_gx);
                        *dw += g * h;
                        *db += g;
                    }
                }
                (dw, db)
            })
            .collect::<Vec<_>>()
            .into_iter()
            // Added in task order: the same sums whatever the threads did.
            .fold(
                (vec![0f32; dim], vec![0f32; dim]),
                |(mut aw, mut ab), (bw, bb)| {
                    simd::axpy(&mut aw, 1.0, &bw);
                    simd::axpy(&mut ab, 1.0, &bb);
                    (aw, ab)
                },
            );
        let dev = xs.device();
        Ok((
            Some(Tensor::from_vec(dx, xs.shape(), dev)?),
            Some(Tensor::from_vec(dw, weight.shape(), dev)?),
            Some(Tensor::from_vec(db, bias.shape(), dev)?),
        ))
    }
}

/// `x / sqrt(mean(x²) + eps) · weight` over the last dimension (Llama's RMSNorm, as
/// `torch.nn.functional.rms_norm`).
///
/// # Shapes
/// `xs [.., dim]`, `weight [dim]`; returns `xs`'s shape.
pub fn rms_norm(xs: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let dim = xs.dim(candle_core::D::Minus1)?;
    if weight.dims() != [dim] {
        bail!("rms_norm: weight {:?} must be [{dim}]", weight.dims())
    }
    xs.contiguous()?
        .apply_op2(&weight.contiguous()?, RmsNorm { eps: eps as f32 })
}

struct RmsNorm {
    eps: f32,
}

/// `1 / sqrt(mean(x²) + eps)` of a row: [`rms_norm`]'s scale, for code that normalises
/// rows in place and must give the same values.
pub fn rms_scale(x: &[f32], eps: f32) -> f32 {
    1.0 / (simd::dot(x, x) / x.len() as f32 + eps).sqrt()
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "rms-norm-fused"
    }

    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let xs = values(sx, lx, "rms_norm input")?;
        let w = values(sw, lw, "rms_norm weight")?;
        let ys = per_row(xs, w.len(), |y, x| {
            let r = rms_scale(x, self.eps);
            for ((y, &x), &w) in y.iter_mut().zip(x).zip(w) {
                *y = x * r * w;
            }
        });
        Ok((CpuStorage::F32(ys), lx.shape().clone()))
    }

    fn bwd(
        &self,
        xs: &Tensor,
        weight: &Tensor,
        _ys: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let dim = weight.elem_count();
        let (sx, lx) = xs.storage_and_layout();
        let (sw, lw) = weight.storage_and_layout();
        let (sg, lg) = grad.storage_and_layout();
        let x = values(cpu(&sx, "rms_norm input")?, lx, "rms_norm input")?;
        let w = values(cpu(&sw, "rms_norm weight")?, lw, "rms_norm weight")?;
        let g = values(cpu(&sg, "rms_norm gradient")?, lg, "rms_norm gradient")?;
        if g.len() != x.len() || dim == 0 {
            bail!("rms_norm backward: gradient and input sizes differ")
        }
        let mut dx = vec![0f32; x.len()];
        // dx = r·(g∘w - x̂·mean(g∘w∘x̂)) with x̂ = r·x; dweight = Σ_rows g∘x̂.
        let dw = dx
            .par_chunks_mut(ROWS * dim)
            .zip(x.par_chunks(ROWS * dim).zip(g.par_chunks(ROWS * dim)))
            .map(|(dx, (x, g))| {
                let mut dw = vec![0f32; dim];
                let (mut xhat, mut gw) = (vec![0f32; dim], vec![0f32; dim]);
                for ((dx, x), g) in dx.chunks_mut(dim).zip(x.chunks(dim)).zip(g.chunks(dim)) {
                    let r = rms_scale(x, self.eps);
                    for ((((h, gw), &x), &g), &w) in
                        xhat.iter_mut().zip(&mut gw).zip(x).zip(g).zip(w)
                    {
                        *h = x * r;
                        *gw = g * w;
                    }
                    let mean_gx = simd::dot(&gw, &xhat) / dim as f32;
                    for ((((dx, &gw), &h), dw), &g) in
                        dx.iter_mut().zip(&gw).zip(&xhat).zip(dw.iter_mut()).zip(g)
                    {
                        *dx = r * (gw - h * mean_gx);
                        *dw += g * h;
                    }
                }
                dw
            })
            .collect::<Vec<_>>()
            .into_iter()
            // Added in task order: reproducible sums.
            .fold(vec![0f32; dim], |mut a, b| {
                simd::axpy(&mut a, 1.0, &b);
                a
            });
        let dev = xs.device();
        Ok((
            Some(Tensor::from_vec(dx, xs.shape(), dev)?),
            Some(Tensor::from_vec(dw, weight.shape(), dev)?),
        ))
    }
}

/// `a + b` for tensors of one shape. Small f32 CPU tensors held contiguous, with no
/// gradient to track, take one vectorised pass into a new tensor on this thread (a
/// decoding step's residual adds, where Candle's `add` sets up its strided walk for every
/// row); anything else takes
/// Candle's `add`, which splits large ones (a prefill's) over the pool.
///
/// # Shapes
/// `a [..]`, `b` the same; returns that shape.
pub fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    /// Below Candle's threshold for splitting an element-wise op over the pool.
    const SMALL: usize = 64 << 10;
    let plain = |t: &Tensor| {
        crate::cpu_kernels(t.device())
            && t.dtype() == DType::F32
            && t.is_contiguous()
            && !t.track_op()
    };
    if a.shape() != b.shape() || a.elem_count() > SMALL || !plain(a) || !plain(b) {
        return a.add(b);
    }
    let mut ys = with_values(a, "add", |a| Ok(a.to_vec()))?;
    with_values(b, "add", |b| {
        simd::add(&mut ys, b);
        Ok(())
    })?;
    Tensor::from_vec(ys, a.shape(), a.device())
}

/// Mean cross-entropy of predicting `ids[:, j + 1]` from `logits[:, j]` over every
/// position but the last: the loss of Hugging Face's `GPT2LMHeadModel(input_ids,
/// labels=input_ids)`, without the copy of the logits that slicing off the last position
/// makes. `ids` must lie in `0..vocab` (the caller checks).
///
/// # Shapes
/// `logits [b, t, vocab]` (t ≥ 2), `ids [b, t]`; returns a scalar.
pub fn next_token_cross_entropy(logits: &Tensor, ids: &Tensor) -> Result<Tensor> {
    let (b, t, v) = logits.dims3()?;
    if ids.dims() != [b, t] || t < 2 {
        bail!(
            "next_token_cross_entropy: logits {:?} and ids {:?} must be [b, t, vocab] and [b, t] with t >= 2",
            logits.dims(),
            ids.dims()
        )
    }
    let ids = ids
        .to_dtype(candle_core::DType::U32)?
        .flatten_all()?
        .to_vec1::<u32>()?;
    if let Some(&bad) = ids.iter().find(|&&i| i as usize >= v) {
        bail!("next_token_cross_entropy: token id {bad} is outside the vocabulary of {v}")
    }
    logits.contiguous()?.apply_op1(CrossEntropy { ids, t })
}

struct CrossEntropy {
    /// `[b · t]` token ids.
    ids: Vec<u32>,
    t: usize,
}

impl CrossEntropy {
    /// The target of row `r` (position `r % t` of sequence `r / t`), `None` for the last
    /// position of a sequence.
    fn target(&self, r: usize) -> Option<usize> {
        (r % self.t + 1 < self.t).then(|| self.ids[r + 1] as usize)
    }

    fn count(&self) -> usize {
        self.ids.len() / self.t * (self.t - 1)
    }
}

impl CustomOp1 for CrossEntropy {
    fn name(&self) -> &'static str {
        "next-token-cross-entropy"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let logits = values(s, l, "cross-entropy logits")?;
        let v = logits.len() / self.ids.len();
        // f64 for the sum over rows: thousands of terms.
        let total: f64 = logits
            .par_chunks(ROWS * v)
            .enumerate()
            .map_init(
                || vec![0f32; v],
                |buf, (task, rows)| {
                    let mut sum = 0f64;
                    for (i, row) in rows.chunks(v).enumerate() {
                        if let Some(target) = self.target(task * ROWS + i) {
                            buf.copy_from_slice(row);
                            let m = simd::max(row);
                            let lse = m + simd::exp_sub_sum(buf, m).ln();
                            sum += (lse - row[target]) as f64;
                        }
                    }
                    sum
                },
            )
            .collect::<Vec<f64>>()
            .into_iter()
            // In task order, so the loss does not depend on the threads' timing.
            .sum();
        let loss = (total / self.count() as f64) as f32;
        Ok((CpuStorage::F32(vec![loss]), Shape::from(())))
    }

    fn bwd(&self, logits: &Tensor, _loss: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let scale =
            grad.to_dtype(candle_core::DType::F32)?.to_scalar::<f32>()? / self.count() as f32;
        let (s, l) = logits.storage_and_layout();
        let x = match &*s {
            Storage::Cpu(s) => values(s, l, "cross-entropy logits")?,
            _ => bail!("cross-entropy: expected a CPU tensor"),
        };
        let v = x.len() / self.ids.len();
        let mut dx = vec![0f32; x.len()];
        // d loss / d logits = (softmax - one_hot(target)) · grad / count; 0 on last positions.
        dx.par_chunks_mut(ROWS * v)
            .zip(x.par_chunks(ROWS * v))
            .enumerate()
            .for_each(|(task, (dx, x))| {
                for (i, (d, row)) in dx.chunks_mut(v).zip(x.chunks(v)).enumerate() {
                    if let Some(target) = self.target(task * ROWS + i) {
                        d.copy_from_slice(row);
                        let m = simd::max(row);
                        let sum = simd::exp_sub_sum(d, m);
                        simd::scale(d, scale / sum);
                        d[target] -= scale;
                    }
                }
            });
        Ok(Some(Tensor::from_vec(dx, logits.shape(), logits.device())?))
    }
}

/// `xs · w + bias` with a backward pass that writes the three gradients directly: Candle's
/// `matmul` then `broadcast_add` keeps both results for autograd, sums the bias gradient
/// over rows on one thread, and accumulates each gradient into a zero tensor first.
///
/// # Shapes
/// `xs [rows, d_in]`, `w [d_in, d_out]` (any strides: a transposed `[d_out, d_in]` weight
/// is read in place), `bias [d_out]`; returns `[rows, d_out]`.
pub fn linear(xs: &Tensor, w: &Tensor, bias: &Tensor) -> Result<Tensor> {
    let d_in = xs.dim(1)?;
    let (w_in, d_out) = w.dims2()?;
    if xs.rank() != 2 || w_in != d_in || bias.dims() != [d_out] {
        bail!(
            "linear: input {:?}, weight {:?} and bias {:?} do not fit",
            xs.dims(),
            w.dims(),
            bias.dims()
        )
    }
    xs.contiguous()?.apply_op3(w, &bias.contiguous()?, Linear)
}

struct Linear;

/// A 2-D f32 CPU matrix: pointer to element (0, 0) and its row and column strides.
#[derive(Clone, Copy)]
struct Mat {
    ptr: *const f32,
    rs: isize,
    cs: isize,
}

fn mat(s: &CpuStorage, l: &Layout, what: &str) -> Result<Mat> {
    let (CpuStorage::F32(v), [rs, cs]) = (s, l.stride()) else {
        bail!("{what}: expected a 2-D f32 CPU matrix")
    };
    let (rows, cols) = l.shape().dims2()?;
    // The last element must lie in the storage: strides and offset come from Candle.
    let last = l.start_offset() + rows.saturating_sub(1) * rs + cols.saturating_sub(1) * cs;
    if rows * cols > 0 && last >= v.len() {
        bail!("{what}: layout outside its storage")
    }
    Ok(Mat {
        // SAFETY: the offset is inside the storage (checked above, or the matrix is empty).
        ptr: unsafe { v.as_ptr().add(l.start_offset().min(v.len())) },
        rs: *rs as isize,
        cs: *cs as isize,
    })
}

/// `dst[m, n] (+)= a[m, k] · b[k, n]` on rayon's pool.
///
/// # Safety
/// `dst` holds `m × n` contiguous f32; `a` and `b` address `m × k` and `k × n` elements.
unsafe fn matmul(
    dst: *mut f32,
    accumulate: bool,
    a: Mat,
    b: Mat,
    (m, n, k): (usize, usize, usize),
) {
    gemm::gemm(
        m,
        n,
        k,
        dst,
        1,
        n as isize,
        accumulate,
        a.ptr,
        a.cs,
        a.rs,
        b.ptr,
        b.cs,
        b.rs,
        1.0,
        1.0,
        false,
        false,
        false,
        gemm::Parallelism::Rayon(rayon::current_num_threads()),
    )
}

impl CustomOp3 for Linear {
    fn name(&self) -> &'static str {
        "linear-fused"
    }

    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
        sb: &CpuStorage,
        lb: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (rows, d_in) = lx.shape().dims2()?;
        let d_out = lw.shape().dims2()?.1;
        let (x, w) = (mat(sx, lx, "linear input")?, mat(sw, lw, "linear weight")?);
        let bias = values(sb, lb, "linear bias")?;
        // Every row starts as the bias; the product is added to it.
        let mut ys = vec![0f32; rows * d_out];
        if d_out > 0 {
            ys.par_chunks_mut(ROWS * d_out).for_each(|c| {
                for row in c.chunks_mut(d_out) {
                    row.copy_from_slice(bias);
                }
            });
        }
        if rows * d_out * d_in > 0 {
            // SAFETY: `ys` is `rows × d_out`; `x` and `w` are checked views of
            // `rows × d_in` and `d_in × d_out`.
            unsafe { matmul(ys.as_mut_ptr(), true, x, w, (rows, d_out, d_in)) };
        }
        Ok((CpuStorage::F32(ys), Shape::from((rows, d_out))))
    }

    fn bwd(
        &self,
        xs: &Tensor,
        w: &Tensor,
        _bias: &Tensor,
        _ys: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let (rows, d_in) = xs.dims2()?;
        let d_out = w.dim(1)?;
        let (sx, lx) = xs.storage_and_layout();
        let (sw, lw) = w.storage_and_layout();
        let (sg, lg) = grad.storage_and_layout();
        let x = mat(cpu(&sx, "linear input")?, lx, "linear input")?;
        let wm = mat(cpu(&sw, "linear weight")?, lw, "linear weight")?;
        let gs = cpu(&sg, "linear gradient")?;
        let g = mat(gs, lg, "linear gradient")?;
        let g_rows = values(gs, lg, "linear gradient")?;
        let t = |m: Mat| Mat {
            ptr: m.ptr,
            rs: m.cs,
            cs: m.rs,
        };
        let mut dx = vec![0f32; rows * d_in];
        let mut dw = vec![0f32; d_in * d_out];
        if rows * d_in * d_out > 0 {
            // SAFETY: the views are checked by `mat`; the outputs have the sizes given.
            unsafe {
                // dx[rows, d_in] = g[rows, d_out] · wᵀ
                matmul(dx.as_mut_ptr(), false, g, t(wm), (rows, d_in, d_out));
                // dw[d_in, d_out] = xᵀ · g
                matmul(dw.as_mut_ptr(), false, t(x), g, (d_in, d_out, rows));
            }
        }
        // dbias = Σ_rows g: per-task sums of contiguous rows, then added.
        let db = if d_out == 0 {
            Vec::new()
        } else {
            g_rows
                .par_chunks(ROWS * 4 * d_out)
                .map(|c| {
                    let mut acc = vec![0f32; d_out];
                    for row in c.chunks(d_out) {
                        simd::axpy(&mut acc, 1.0, row);
                    }
                    acc
                })
                .collect::<Vec<_>>()
                .into_iter()
                // In task order: reproducible sums.
                .fold(vec![0f32; d_out], |mut a, b| {
                    simd::axpy(&mut a, 1.0, &b);
                    a
                })
        };
        let dev = xs.device();
        Ok((
            Some(Tensor::from_vec(dx, (rows, d_in), dev)?),
            Some(Tensor::from_vec(dw, (d_in, d_out), dev)?),
            Some(Tensor::from_vec(db, d_out, dev)?),
        ))
    }
}
