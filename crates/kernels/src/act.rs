//! The activations of the MLPs with their backward passes: SwiGLU's `silu(gate)·up` and the
//! tanh GELU, each one vectorised pass over the rayon pool on f32 CPU tensors (and one
//! differentiable op there), widened from f16/bf16, Candle's ops elsewhere.

use candle_core::{bail, CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};
use half::slice::HalfFloatSliceExt;

use rayon::prelude::*;

use crate::simd;
use crate::storage::{cpu, values};

/// SwiGLU's product `silu(gate)·up`: on f32 CPU tensors whose rows (the last dimension)
/// have unit stride, views into one `[.., 2·inner]` gate-and-up product included, one
/// vectorised pass split over the rayon pool, into one new tensor (Candle's `silu` calls
/// libm's `expf` per element and the product is a second pass and a second tensor). With
/// gradients (training, f32 on the CPU) it is one differentiable op whose backward pass
/// is one sweep too (Candle's builds `silu`'s derivative from eight tensor ops). Elsewhere
/// (half precision, other devices) Candle's ops.
///
/// # Shapes
/// `gate`, `up`: `[.., inner]`, the same; returns `[.., inner]`, contiguous.
pub fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if gate.dims() != up.dims() {
        bail!(
            "silu_mul: gate {:?} and up {:?} differ",
            gate.dims(),
            up.dims()
        )
    }
    let trainable = |t: &Tensor| crate::cpu_kernels(t.device()) && t.dtype() == DType::F32;
    if (gate.track_op() || up.track_op()) && trainable(gate) && trainable(up) {
        return gate.contiguous()?.apply_op2(&up.contiguous()?, SiluMul);
    }
    let fast = |t: &Tensor| {
        let plain = crate::cpu_kernels(t.device()) && t.dtype() == DType::F32 && !t.track_op();
        plain.then(|| rows_of(t)).flatten()
    };
    let (Some((g0, gs)), Some((u0, us)), false) = (fast(gate), fast(up), gate.elem_count() == 0)
    else {
        return gate.silu()? * up;
    };
    let n = gate.dims().last().copied().unwrap_or(1);
    let rows = gate.elem_count() / n;
    let (gst, _) = gate.storage_and_layout();
    let (ust, _) = up.storage_and_layout();
    let (
        candle_core::Storage::Cpu(CpuStorage::F32(gd)),
        candle_core::Storage::Cpu(CpuStorage::F32(ud)),
    ) = (&*gst, &*ust)
    else {
        bail!("silu_mul: f32 CPU tensors without f32 CPU storage")
    };
    // Every row inside its storage, or the layouts lied.
    let fits = |len: usize, at: usize| at + n <= len;
    if rows > 0 && !(fits(gd.len(), g0 + (rows - 1) * gs) && fits(ud.len(), u0 + (rows - 1) * us)) {
        bail!("silu_mul: rows outside the storage")
    }
    let mut ys = vec![0f32; rows * n];
    // Chunks of about 64 Ki elements: a [512, 1536] product is a dozen tasks.
    let per = (65_536 / n).max(1);
    let chunk = |(c, out): (usize, &mut [f32])| {
        for (i, y) in out.chunks_mut(n).enumerate() {
            let r = c * per + i;
            simd::silu_mul(&gd[g0 + r * gs..][..n], &ud[u0 + r * us..][..n], y);
        }
    };
    // One chunk (decoding) runs here: handing it to the pool cost more than computing it.
    match rows <= per {
        true => chunk((0, &mut ys)),
        false => ys.par_chunks_mut(per * n).enumerate().for_each(chunk),
    }
    drop((gst, ust));
    Tensor::from_vec(ys, gate.dims(), gate.device())
}

/// The differentiable [`silu_mul`] on contiguous f32 CPU tensors.
struct SiluMul;

/// Elements per task of the SwiGLU passes.
const SILU_CHUNK: usize = 1 << 14;

impl CustomOp2 for SiluMul {
    fn name(&self) -> &'static str {
        "silu-mul"
    }

    fn cpu_fwd(
        &self,
        sg: &CpuStorage,
        lg: &Layout,
        su: &CpuStorage,
        lu: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (g, u) = (
            values(sg, lg, "silu_mul gate")?,
            values(su, lu, "silu_mul up")?,
        );
        if g.len() != u.len() {
            bail!("silu_mul: gate and up sizes differ")
        }
        let mut ys = vec![0f32; g.len()];
        ys.par_chunks_mut(SILU_CHUNK)
            .zip(g.par_chunks(SILU_CHUNK).zip(u.par_chunks(SILU_CHUNK)))
            .for_each(|(y, (g, u))| simd::silu_mul(g, u, y));
        Ok((CpuStorage::F32(ys), lg.shape().clone()))
    }

    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _ys: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let (sg, lg) = gate.storage_and_layout();
        let (su, lu) = up.storage_and_layout();
        let (sd, ld) = grad.storage_and_layout();
        let what = "silu_mul backward";
        let g = values(cpu(&sg, what)?, lg, what)?;
        let u = values(cpu(&su, what)?, lu, what)?;
        let mut dg = values(cpu(&sd, what)?, ld, what)?.to_vec();
        if g.len() != u.len() || g.len() != dg.len() {
            bail!("silu_mul backward: gate, up and gradient sizes differ")
        }
        let mut du = vec![0f32; g.len()];
        dg.par_chunks_mut(SILU_CHUNK)
            .zip(du.par_chunks_mut(SILU_CHUNK))
            .zip(g.par_chunks(SILU_CHUNK).zip(u.par_chunks(SILU_CHUNK)))
            .for_each(|((dg, du), (g, u))| simd::silu_mul_grad(g, u, dg, du));
        drop((sg, su, sd));
        Ok((
            Some(Tensor::from_vec(dg, gate.shape(), gate.device())?),
            Some(Tensor::from_vec(du, up.shape(), up.device())?),
        ))
    }
}

/// `(offset of row 0, row stride)` of a tensor seen as rows of its last dimension, when
/// that dimension has unit stride and the rows are evenly spaced (leading dimensions that
/// merge into one); `None` otherwise.
fn rows_of(t: &Tensor) -> Option<(usize, usize)> {
    let layout = t.layout();
    let (dims, stride) = (layout.dims(), layout.stride());
    let r = dims.len();
    if r == 0 || stride[r - 1] != 1 {
        return None;
    }
    // The row stride is that of the innermost leading dimension longer than 1; each
    // longer one further out must step over whole runs of those inside it.
    let lead = &dims[..r - 1];
    let row = (0..r - 1)
        .rev()
        .find(|&i| lead[i] > 1)
        .map_or(0, |i| stride[i]);
    let mut step = row;
    for i in (0..r - 1).rev() {
        if lead[i] > 1 {
            if stride[i] != step {
                return None;
            }
            step *= lead[i];
        }
    }
    Some((layout.start_offset(), row))
}

/// GPT-2's tanh GELU on an f32, f16 or bf16 CPU tensor, one vectorised pass split over the
/// rayon pool (Candle's `gelu` evaluates `tanh` element by element, several times the time of
/// its erf GELU; in f16 and bf16 it also rounds after every step). Half-precision values are
/// widened, computed in f32 and rounded once. On f32 it is differentiable, with a backward pass
/// of the same kind (Candle's builds the derivative from a dozen tensor ops, each a pass over
/// the activations on one thread). Other tensors, and half precision with gradients, take
/// Candle's `gelu`.
pub fn gelu_tanh(xs: &Tensor) -> Result<Tensor> {
    let dtype_ok = matches!(xs.dtype(), DType::F32 | DType::F16 | DType::BF16);
    if !crate::cpu_kernels(xs.device()) || !dtype_ok {
        return xs.gelu();
    }
    match (xs.track_op(), xs.dtype()) {
        (false, _) => xs.contiguous()?.apply_op1_no_bwd(&GeluTanh),
        (true, DType::F32) => xs.contiguous()?.apply_op1(GeluTanh),
        (true, _) => xs.gelu(),
    }
}

struct GeluTanh;

impl CustomOp1 for GeluTanh {
    fn name(&self) -> &'static str {
        "gelu-tanh-simd"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let Some((start, end)) = layout.contiguous_offsets() else {
            bail!("gelu_tanh: expected a contiguous tensor")
        };
        let ys = match storage {
            CpuStorage::F32(xs) => {
                let xs = &xs[start..end];
                let mut ys = vec![0f32; xs.len()];
                // One chunk (decoding) runs here, without the pool's hand-off.
                match xs.len() <= GELU_CHUNK {
                    true => simd::gelu_tanh(xs, &mut ys),
                    false => ys
                        .par_chunks_mut(GELU_CHUNK)
                        .zip(xs.par_chunks(GELU_CHUNK))
                        .for_each(|(y, x)| simd::gelu_tanh(x, y)),
                }
                CpuStorage::F32(ys)
            }
            CpuStorage::F16(xs) => CpuStorage::F16(gelu_tanh_half(&xs[start..end])),
            CpuStorage::BF16(xs) => CpuStorage::BF16(gelu_tanh_half(&xs[start..end])),
            _ => bail!("gelu_tanh: expected f32, f16 or bf16 storage"),
        };
        Ok((ys, layout.shape().clone()))
    }

    fn bwd(&self, xs: &Tensor, _ys: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(
            xs.apply_op2_no_bwd(&grad.contiguous()?, &GeluTanhGrad)?,
        ))
    }
}

/// `grad · gelu_tanh'(xs)`, both f32 and contiguous.
struct GeluTanhGrad;

impl CustomOp2 for GeluTanhGrad {
    fn name(&self) -> &'static str {
        "gelu-tanh-grad"
    }

    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sg: &CpuStorage,
        lg: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (Some((x0, x1)), Some((g0, g1))) = (lx.contiguous_offsets(), lg.contiguous_offsets())
        else {
            bail!("gelu_tanh backward: expected contiguous tensors")
        };
        let (CpuStorage::F32(xs), CpuStorage::F32(gs)) = (sx, sg) else {
            bail!("gelu_tanh backward: expected f32 tensors")
        };
        let mut out = gs[g0..g1].to_vec();
        if out.len() != x1 - x0 {
            bail!("gelu_tanh backward: gradient and input sizes differ")
        }
        out.par_chunks_mut(GELU_CHUNK)
            .zip(xs[x0..x1].par_chunks(GELU_CHUNK))
            .for_each(|(g, x)| simd::gelu_tanh_grad(x, g));
        Ok((CpuStorage::F32(out), lx.shape().clone()))
    }
}

/// Elements per task of the GELU pass.
const GELU_CHUNK: usize = 1 << 14;

/// The tanh GELU of f16 or bf16 values, each chunk widened into an f32 buffer, computed
/// and rounded back once.
fn gelu_tanh_half<T>(xs: &[T]) -> Vec<T>
where
    T: Copy + Default + Send + Sync,
    [T]: HalfFloatSliceExt,
{
    let mut ys = vec![T::default(); xs.len()];
    ys.par_chunks_mut(GELU_CHUNK)
        .zip(xs.par_chunks(GELU_CHUNK))
        .for_each_init(
            || (vec![0f32; GELU_CHUNK], vec![0f32; GELU_CHUNK]),
            |(wide, out), (y, x)| {
                let (wide, out) = (&mut wide[..x.len()], &mut out[..x.len()]);
                x.convert_to_f32_slice(wide);
                simd::gelu_tanh(wide, out);
                y.convert_from_f32_slice(out);
            },
        );
    ys
}
