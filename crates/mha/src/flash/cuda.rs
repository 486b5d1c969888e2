//! Fused attention on CUDA devices (feature `cuda`): `kernels/attention.cu`, one pass over
//! the keys with an online softmax, no `q_len × kv_len` score matrix in memory, launched
//! through Candle's custom-op interface: a thread per query for prefills, a block per
//! query for decoding (one launch in place of the reference path's chain: the scores, the
//! mask, the softmax's seven ops, the product).
//!
//! Inference only (no gradient), and taken only when `MHA_CUDA_ATTENTION=fused` is set:
//! the kernels' arithmetic is tested on the CPU (the workspace's `tests/cuda_attention.rs`
//! runs the same source with CUDA's built-ins emulated), but this launch and its speed
//! wait for a GPU to check them (`scripts/gpu_check.sh`), and until then the default stays
//! the reference path.

use std::sync::OnceLock;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{
    bail, CpuStorage, CudaDevice, CudaStorage, CustomOp3, DType, Layout, Result, Shape, Tensor,
    WithDType,
};

use crate::mask::Mask;

/// The kernel's PTX, compiled by the build script.
const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/attention.ptx"));

/// Queries per block of the thread-per-query kernel (`MHA_BQ`).
const BLOCK_QUERIES: usize = 64;

/// Threads per block of the block-per-query kernel (`MHA_DECODE_THREADS`).
const DECODE_THREADS: usize = 128;

/// Below this many queries the block-per-query kernel runs (decoding steps, short
/// prompts), from it on the thread-per-query one (prefills).
const DECODE_BELOW: usize = 16;

/// The head dimensions the kernel has instances for.
const HEAD_DIMS: [usize; 8] = [8, 16, 32, 64, 80, 96, 128, 256];

/// Whether `MHA_CUDA_ATTENTION=fused` asks for the fused kernel.
pub(crate) fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("MHA_CUDA_ATTENTION").is_ok_and(|v| v == "fused"))
}

/// `softmax(q·kᵀ·scale [soft-capped] + mask)·v` by the fused kernel, `[b, h, tq, d]` in q's
/// dtype; `None` where it does not apply (another device, key padding or an additive or
/// boolean mask, a head dimension or dtype pair it has no instance for, empty shapes), for
/// the caller to take the reference path.
pub(crate) fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Mask,
    scale: f64,
    softcap: Option<f64>,
) -> Result<Option<Tensor>> {
    let (b, h, tq, d) = q.dims4()?;
    let (_, _, tk, _) = k.dims4()?;
    let pair = (q.dtype(), k.dtype());
    let supported = matches!(
        pair,
        (DType::F32, DType::F32 | DType::F16 | DType::BF16)
            | (DType::F16, DType::F16)
            | (DType::BF16, DType::BF16)
    );
    let small = |n: usize| n <= i32::MAX as usize;
    let applies = q.device().is_cuda()
        && supported
        && v.dtype() == k.dtype()
        && v.dims4()? == k.dims4()?
        && HEAD_DIMS.contains(&d)
        && ![b, h, tq, tk].contains(&0)
        && mask.is_structural()
        && mask.key_padding.is_none()
        && mask.window != Some(0)
        && [
            b,
            h,
            tq,
            tk,
            mask.causal.unwrap_or(0),
            mask.window.unwrap_or(0),
        ]
        .into_iter()
        .all(small)
        // The grid's second and third dimensions (heads, batch rows) stop at 65,535.
        && b.max(h) <= 65_535;
    if !applies {
        return Ok(None);
    }
    let op = CudaAttention {
        // A thread per query leaves a block idle but for the few threads that walk every
        // key alone when there are few queries (decoding): those take a block per query.
        per_query_block: tq < DECODE_BELOW,
        causal: mask.causal.is_some(),
        offset: mask.causal.unwrap_or(0),
        window: mask.causal.and(mask.window).unwrap_or(0),
        scale: scale as f32,
        softcap: softcap.unwrap_or(0.0) as f32,
    };
    // The kernel reads each tensor with its strides, the head dimension contiguous.
    let dense_rows = |t: &Tensor| -> Result<Tensor> {
        match t.stride()[3] {
            1 => Ok(t.clone()),
            _ => t.contiguous(),
        }
    };
    let ys = dense_rows(q)?.apply_op3_no_bwd(&dense_rows(k)?, &dense_rows(v)?, &op)?;
    Ok(Some(ys))
}

/// The kernel's parameters beyond its tensors (see `kernels/attention.cu`).
struct CudaAttention {
    /// `mha_attention_decode` (a block per query) rather than `mha_attention`.
    per_query_block: bool,
    causal: bool,
    offset: usize,
    window: usize,
    scale: f32,
    softcap: f32,
}

fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        _ => "f32",
    }
}

impl CustomOp3 for CudaAttention {
    fn name(&self) -> &'static str {
        "mha-cuda-attention"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!("mha's fused CUDA attention runs on CUDA devices only")
    }

    fn cuda_fwd(
        &self,
        q: &CudaStorage,
        ql: &Layout,
        k: &CudaStorage,
        kl: &Layout,
        v: &CudaStorage,
        vl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let out = match (q.dtype(), k.dtype()) {
            (DType::F32, DType::F32) => self.launch::<f32, f32>(q, ql, k, kl, v, vl)?,
            (DType::F32, DType::F16) => self.launch::<f32, half::f16>(q, ql, k, kl, v, vl)?,
            (DType::F32, DType::BF16) => self.launch::<f32, half::bf16>(q, ql, k, kl, v, vl)?,
            (DType::F16, DType::F16) => self.launch::<half::f16, half::f16>(q, ql, k, kl, v, vl)?,
            (DType::BF16, DType::BF16) => {
                self.launch::<half::bf16, half::bf16>(q, ql, k, kl, v, vl)?
            }
            (a, b) => {
                bail!("mha's fused CUDA attention has no kernel for {a:?} queries with {b:?} keys")
            }
        };
        Ok((out, ql.shape().clone()))
    }
}

impl CudaAttention {
    /// One launch: per (batch, head), a block of [`BLOCK_QUERIES`] threads per that many
    /// queries, or of [`DECODE_THREADS`] per query.
    #[allow(clippy::too_many_arguments)]
    fn launch<TQ, TKV>(
        &self,
        q: &CudaStorage,
        ql: &Layout,
        k: &CudaStorage,
        kl: &Layout,
        v: &CudaStorage,
        vl: &Layout,
    ) -> Result<CudaStorage>
    where
        TQ: CudaDType + DeviceRepr + WithDType,
        TKV: CudaDType + DeviceRepr + WithDType,
    {
        let (b, h, tq, d) = ql.shape().dims4()?;
        let (_, h_kv, tk, _) = kl.shape().dims4()?;
        // Element strides of batch, head and position: q's, k's, v's.
        let mut strides = [0i64; 9];
        for (i, l) in [ql, kl, vl].into_iter().enumerate() {
            let s = l.stride();
            if s.len() != 4 || s[3] != 1 {
                bail!("mha's fused CUDA attention needs the head dimension contiguous, got strides {s:?}")
            }
            for j in 0..3 {
                strides[3 * i + j] = s[j] as i64;
            }
        }
        let dev: &CudaDevice = &q.device;
        let kernel = match self.per_query_block {
            true => "mha_attention_decode",
            false => "mha_attention",
        };
        let name = format!(
            "{kernel}_{}_{}_d{d}",
            dtype_name(TQ::DTYPE),
            dtype_name(TKV::DTYPE)
        );
        let func = dev.get_or_load_custom_func(&name, "mha_attention", PTX)?;
        let qs = q.as_cuda_slice::<TQ>()?.slice(ql.start_offset()..);
        let ks = k.as_cuda_slice::<TKV>()?.slice(kl.start_offset()..);
        let vs = v.as_cuda_slice::<TKV>()?.slice(vl.start_offset()..);
        // SAFETY: every element is written by the kernel (each query row by its thread or
        // its block).
        let out = unsafe { dev.alloc::<TQ>(b * h * tq * d)? };
        let dims = [h, h_kv, tq, tk].map(|n| n as i32);
        let (causal, offset, window) = (self.causal as i32, self.offset as i32, self.window as i32);
        let (blocks, threads) = match self.per_query_block {
            true => (tq, DECODE_THREADS),
            false => (tq.div_ceil(BLOCK_QUERIES), BLOCK_QUERIES),
        };
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, h as u32, b as u32),
            block_dim: (threads as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut args = func.builder();
        args.arg(&qs);
        args.arg(&ks);
        args.arg(&vs);
        args.arg(&out);
        for n in &dims {
            args.arg(n);
        }
        for s in &strides {
            args.arg(s);
        }
        args.arg(&causal);
        args.arg(&offset);
        args.arg(&window);
        args.arg(&self.scale);
        args.arg(&self.softcap);
        // SAFETY: the arguments match the kernel's signature in order and type; the
        // slices hold what the shapes and strides reach (Candle's layouts of them).
        unsafe { args.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }
}
