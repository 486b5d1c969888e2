//! A fused attention kernel for CPU inference (f32).
//!
//! Flash-attention style: queries in blocks of `BR` rows, keys in blocks of `BC`, an
//! online softmax, and key blocks above the causal diagonal never touched, so nothing of
//! size `q_len × kv_len` exists. The two block products go through the `gemm` crate (the
//! kernels Candle's matmul uses); blocks run in parallel on rayon's pool. Its reference is
//! [`crate::sdpa_reference`], and the tests hold it to that.
//!
//! A public module for the crates built on this one and for the benchmarks: most users want
//! [`crate::sdpa`] or [`crate::MultiHeadAttention`], which pick this kernel when it applies.
//! [`gelu_tanh`] lives here because it shares the SIMD code; the MLPs of `gpt-blocks` use it.

use candle_core::{bail, CpuStorage, CustomOp1, CustomOp3, DType, Layout, Result, Shape, Tensor};
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

use crate::{simd, Mask};

/// Query rows per block.
const BR: usize = 64;
/// Keys per block.
const BC: usize = 128;

/// Fused attention of `q [b, h, tq, d]` over `k [b, h_kv, tk, d]`, `v [b, h_kv, tk, dv]`
/// with causal masking and key padding; additive masks go through the reference path.
pub fn flash_attn_cpu(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Mask,
    scale: f64,
) -> Result<Tensor> {
    if !mask.is_structural() {
        bail!("flash_attn_cpu: additive and boolean masks go through sdpa_reference")
    }
    let (b, _, _, _) = q.dims4()?;
    let tk = k.dim(2)?;
    let keep = match mask.keep_keys(b, tk, q.device())? {
        Some(keep) => Some(keep.flatten_all()?.to_vec1::<u8>()?),
        None => None,
    };
    if mask.window == Some(0) {
        bail!("attention window must be at least 1")
    }
    let op = FlashAttn {
        scale: scale as f32,
        causal: mask.causal,
        window: mask.causal.and(mask.window),
        keep,
    };
    // The kernel reads rows with unit stride; cache views (strided heads) are fine.
    let unit = |t: &Tensor| -> Result<Tensor> {
        if t.stride().last() == Some(&1) {
            Ok(t.clone())
        } else {
            t.contiguous()
        }
    };
    unit(q)?.apply_op3_no_bwd(&unit(k)?, &unit(v)?, &op)
}

struct FlashAttn {
    scale: f32,
    causal: Option<usize>,
    /// Keys visible to a query with `causal`, itself included (local attention).
    window: Option<usize>,
    /// `[b · tk]`, 1 where the key is kept.
    keep: Option<Vec<u8>>,
}

/// A `[b, h, t, d]` f32 tensor seen as rows of unit stride.
#[derive(Clone, Copy)]
struct Rows<'a> {
    data: &'a [f32],
    offset: usize,
    /// Strides of the batch, head and sequence dimensions.
    sb: usize,
    sh: usize,
    st: usize,
}

impl<'a> Rows<'a> {
    fn new(s: &'a CpuStorage, l: &Layout, name: &str) -> Result<Self> {
        let data = match s {
            CpuStorage::F32(d) => d.as_slice(),
            _ => bail!("flash_attn_cpu: {name} must be f32"),
        };
        match *l.stride() {
            [sb, sh, st, 1] => Ok(Self {
                data,
                offset: l.start_offset(),
                sb,
                sh,
                st,
            }),
            _ => bail!("flash_attn_cpu: {name} rows must have unit stride"),
        }
    }

    /// Pointer to row `t` of head `h` of batch `b`.
    fn ptr(&self, b: usize, h: usize, t: usize) -> *const f32 {
        let i = self.offset + b * self.sb + h * self.sh + t * self.st;
        debug_assert!(i <= self.data.len());
        // SAFETY: in bounds by the layout Candle handed us (checked in debug builds).
        unsafe { self.data.as_ptr().add(i) }
    }
}

impl CustomOp3 for FlashAttn {
    fn name(&self) -> &'static str {
        "flash-attn-cpu"
    }

    fn cpu_fwd(
        &self,
        sq: &CpuStorage,
        lq: &Layout,
        sk: &CpuStorage,
        lk: &Layout,
        sv: &CpuStorage,
        lv: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (b, h, tq, d) = lq.shape().dims4()?;
        let (_, h_kv, tk, _) = lk.shape().dims4()?;
        let dv = lv.shape().dims4()?.3;
        let (q, k, v) = (
            Rows::new(sq, lq, "q")?,
            Rows::new(sk, lk, "k")?,
            Rows::new(sv, lv, "v")?,
        );
        if let Some(keep) = &self.keep {
            if keep.len() != b * tk {
                bail!(
                    "flash_attn_cpu: key padding has {} entries, expected {}",
                    keep.len(),
                    b * tk
                )
            }
        }
        let n_rep = h / h_kv;
        let mut out = vec![0f32; b * h * tq * dv];
        if out.is_empty() {
            return Ok((CpuStorage::F32(out), Shape::from((b, h, tq, dv))));
        }
        out.par_chunks_mut(tq * dv)
            .enumerate()
            .for_each(|(bh, out_head)| {
                let (bi, hi) = (bh / h, bh % h);
                let hk = hi / n_rep;
                let keep = self.keep.as_ref().map(|k| &k[bi * tk..(bi + 1) * tk]);
                out_head.par_chunks_mut(BR * dv).enumerate().for_each_init(
                    || vec![0f32; BR * BC],
                    |scores, (blk, out_blk)| {
                        let i0 = blk * BR;
                        let rows = out_blk.len() / dv;
                        let block = Block {
                            q: q.ptr(bi, hi, i0),
                            q_st: q.st,
                            k: k.ptr(bi, hk, 0),
                            k_st: k.st,
                            v: v.ptr(bi, hk, 0),
                            v_st: v.st,
                            rows,
                            d,
                            dv,
                            tk,
                            // An offset past the keys shows them all; clamped, it cannot overflow.
                            first_pos: self.causal.map(|o| o.min(tk) + i0),
                            window: self.window,
                            keep,
                            scale: self.scale,
                        };
                        block.run(out_blk, scores);
                    },
                );
            });
        Ok((CpuStorage::F32(out), Shape::from((b, h, tq, dv))))
    }
}

/// One block of query rows of one head.
struct Block<'a> {
    q: *const f32,
    q_st: usize,
    k: *const f32,
    k_st: usize,
    v: *const f32,
    v_st: usize,
    rows: usize,
    d: usize,
    dv: usize,
    tk: usize,
    /// Absolute position of the first query row when causal.
    first_pos: Option<usize>,
    /// With `first_pos`: keys visible to a query, itself included.
    window: Option<usize>,
    keep: Option<&'a [u8]>,
    scale: f32,
}

impl Block<'_> {
    /// Writes the block's `[rows, dv]` output into `out`; `scores` is `BR × BC` scratch.
    fn run(&self, out: &mut [f32], scores: &mut [f32]) {
        let rows = self.rows;
        // Keys past the last row's causal limit are never read.
        let kv_end = match self.first_pos {
            Some(p) => (p + rows).min(self.tk),
            None => self.tk,
        };
        let mut m = [f32::NEG_INFINITY; BR];
        let mut l = [0f32; BR];
        out.fill(0.0);
        // Nor are keys before the first row's window.
        let oldest = |pos: usize| match self.window {
            Some(w) => (pos + 1).saturating_sub(w),
            None => 0,
        };
        let mut j0 = self.first_pos.map_or(0, oldest);
        while j0 < kv_end {
            let bc = BC.min(kv_end - j0);
            let s = &mut scores[..rows * bc];
            // S[rows, bc] = scale · Q[rows, d] · K[j0.., d]ᵀ
            // SAFETY: the pointers address `rows` query rows and `bc` key rows of length
            // `d` with the given strides, all inside the storages (see `Rows::ptr`).
            unsafe {
                gemm::gemm(
                    rows,
                    bc,
                    self.d,
                    s.as_mut_ptr(),
                    1,
                    bc as isize,
                    false,
                    self.q,
                    1,
                    self.q_st as isize,
                    self.k.add(j0 * self.k_st),
                    self.k_st as isize,
                    1,
                    0.0,
                    self.scale,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
            for r in 0..rows {
                let row = &mut s[r * bc..(r + 1) * bc];
                // Keys this row may see: causal limit, then padding.
                let visible = match self.first_pos {
                    Some(p) => (p + r + 1).saturating_sub(j0).min(bc),
                    None => bc,
                };
                row[visible..].fill(f32::NEG_INFINITY);
                if let Some(p) = self.first_pos {
                    let hidden = oldest(p + r).saturating_sub(j0).min(visible);
                    row[..hidden].fill(f32::NEG_INFINITY);
                }
                if let Some(keep) = self.keep {
                    for (x, &kp) in row[..visible].iter_mut().zip(&keep[j0..j0 + visible]) {
                        if kp == 0 {
                            *x = f32::NEG_INFINITY;
                        }
                    }
                }
                let row_max = simd::max(&row[..visible]);
                let m_new = m[r].max(row_max);
                if m_new == f32::NEG_INFINITY {
                    // Nothing visible yet: this block contributes nothing to the row.
                    row.fill(0.0);
                    continue;
                }
                let corr = (m[r] - m_new).exp();
                // Hidden keys hold -inf and become exactly 0.
                let sum = simd::exp_sub_sum(row, m_new);
                l[r] = l[r] * corr + sum;
                m[r] = m_new;
                if corr != 1.0 {
                    simd::scale(&mut out[r * self.dv..(r + 1) * self.dv], corr);
                }
            }
            // O[rows, dv] += P[rows, bc] · V[j0.., dv]
            // SAFETY: as above, for `bc` value rows of length `dv`.
            unsafe {
                gemm::gemm(
                    rows,
                    self.dv,
                    bc,
                    out.as_mut_ptr(),
                    1,
                    self.dv as isize,
                    true,
                    s.as_ptr(),
                    1,
                    bc as isize,
                    self.v.add(j0 * self.v_st),
                    1,
                    self.v_st as isize,
                    1.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
            j0 += bc;
        }
        for r in 0..rows {
            // A row that saw no key keeps its zeros.
            let inv = if l[r] > 0.0 { 1.0 / l[r] } else { 0.0 };
            simd::scale(&mut out[r * self.dv..(r + 1) * self.dv], inv);
        }
    }
}

/// GPT-2's tanh GELU on an f32, f16 or bf16 CPU tensor without gradient tracking, one
/// vectorised pass split over the rayon pool (Candle's `gelu` evaluates `tanh` element by
/// element and was measured at 2.8x the time of its erf GELU on [512, 3072]; in f16 and
/// bf16 it also rounds after every step). Half-precision values are widened, computed in
/// f32 and rounded once. Other tensors take Candle's `gelu`, which is differentiable and
/// runs on every device.
pub fn gelu_tanh(xs: &Tensor) -> Result<Tensor> {
    let dtype_ok = matches!(xs.dtype(), DType::F32 | DType::F16 | DType::BF16);
    if !xs.device().is_cpu() || !dtype_ok || xs.track_op() {
        return xs.gelu();
    }
    xs.contiguous()?.apply_op1_no_bwd(&GeluTanh)
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
                ys.par_chunks_mut(GELU_CHUNK)
                    .zip(xs.par_chunks(GELU_CHUNK))
                    .for_each(|(y, x)| simd::gelu_tanh(x, y));
                CpuStorage::F32(ys)
            }
            CpuStorage::F16(xs) => CpuStorage::F16(gelu_tanh_half(&xs[start..end])),
            CpuStorage::BF16(xs) => CpuStorage::BF16(gelu_tanh_half(&xs[start..end])),
            _ => bail!("gelu_tanh: expected f32, f16 or bf16 storage"),
        };
        Ok((ys, layout.shape().clone()))
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
