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

use std::sync::Mutex;

use candle_core::{bail, CpuStorage, CustomOp1, CustomOp3, DType, Layout, Result, Shape, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;

use crate::dropout::DropMask;
use crate::{decode, Dropout, Mask, Rope, RopeTables};
use gpt_kernels::simd;
use gpt_kernels::storage::{values, with_values};

/// Query rows per block.
pub(crate) const BR: usize = 64;
/// Keys per block.
pub(crate) const BC: usize = 128;
/// The most query rows per head that take [`crate::decode`] (decoding: one row per
/// sequence) rather than blocks of BR rows, when no dropout is asked for.
pub(crate) const DIRECT_ROWS: usize = 4;

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
    let op = FlashAttn::new(q, k, mask, scale, None)?;
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
/// use mha::{kernel::flash_attn_cpu_train, Dropout, Mask};
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

/// The rotation of the queries and keys in a fused `[b, t, w]` projection output.
struct QkRotation {
    /// `[b, t, rot / 2]`, contiguous f32.
    cos: Tensor,
    sin: Tensor,
    rot: usize,
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
fn qkv_heads(qkv: &Tensor, h: usize, h_kv: usize) -> Result<(Tensor, Tensor, Tensor)> {
    let (b, t, w) = qkv.dims3()?;
    // (b, t, w) -> (b, t, h + 2·h_kv, d): free on a contiguous tensor.
    let heads = qkv.reshape((b, t, h + 2 * h_kv, w / (h + 2 * h_kv)))?;
    let part = |at: usize, n: usize| heads.narrow(2, at, n)?.transpose(1, 2);
    Ok((part(0, h)?, part(h, h_kv)?, part(h + h_kv, h_kv)?))
}

/// The op of [`flash_attn_cpu_train_qkv`].
struct FlashAttnQkv {
    inner: FlashAttn,
    n_heads: usize,
    n_kv_heads: usize,
    rope: Option<QkRotation>,
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
        let (dq, dk, dv) = crate::flash_backward::gradients(
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

/// The kernels read rows with unit stride; cache views (strided heads) are fine.
fn unit(t: &Tensor) -> Result<Tensor> {
    if t.stride().last() == Some(&1) {
        Ok(t.clone())
    } else {
        t.contiguous()
    }
}

pub(crate) struct FlashAttn {
    pub(crate) scale: f32,
    pub(crate) causal: Option<usize>,
    /// Keys visible to a query with `causal`, itself included (local attention).
    pub(crate) window: Option<usize>,
    /// `[b · tk]`, 1 where the key is kept.
    pub(crate) keep: Option<Vec<u8>>,
    /// Dropout on the weights, element `((b·h + h)·tq + i)·tk + j`.
    pub(crate) drop: Option<DropMask>,
    /// `[b, h, tq]`: each query row's `max + ln(Σ exp(s - max))`, `+inf` for a row that
    /// sees no key; written by the forward pass for the backward pass.
    pub(crate) lse: Mutex<Vec<f32>>,
}

impl FlashAttn {
    fn new(
        q: &Tensor,
        k: &Tensor,
        mask: &Mask,
        scale: f64,
        drop: Option<DropMask>,
    ) -> Result<Self> {
        let (b, _, _, _) = q.dims4()?;
        Ok(Self {
            drop,
            ..Self::over(b, k.dim(2)?, q.device(), mask, scale)?
        })
    }

    /// The op for `b` sequences over `tk` keys, without dropout.
    pub(crate) fn over(
        b: usize,
        tk: usize,
        dev: &candle_core::Device,
        mask: &Mask,
        scale: f64,
    ) -> Result<Self> {
        if !mask.is_structural() {
            bail!("flash_attn_cpu: additive and boolean masks go through sdpa_reference")
        }
        let keep = match mask.keep_keys(b, tk, dev)? {
            Some(keep) => Some(keep.flatten_all()?.to_vec1::<u8>()?),
            None => None,
        };
        if mask.window == Some(0) {
            bail!("attention window must be at least 1")
        }
        Ok(Self {
            scale: scale as f32,
            causal: mask.causal,
            window: mask.causal.and(mask.window),
            keep,
            drop: None,
            lse: Mutex::new(Vec::new()),
        })
    }

    /// What query row `i0` onwards of batch `bi` may see.
    pub(crate) fn visibility(&self, bi: usize, tk: usize, i0: usize) -> Visibility<'_> {
        Visibility {
            // An offset past the keys shows them all; clamped, it cannot overflow.
            first_pos: self.causal.map(|o| o.min(tk) + i0),
            window: self.window,
            keep: self.keep.as_ref().map(|k| &k[bi * tk..(bi + 1) * tk]),
            tk,
        }
    }
}

/// A `[b, h, t, d]` tensor (f32 unless said otherwise) seen as rows of unit stride.
#[derive(Clone, Copy)]
pub(crate) struct Rows<'a, T = f32> {
    data: &'a [T],
    offset: usize,
    /// Strides of the batch, head and sequence dimensions.
    sb: usize,
    sh: usize,
    pub(crate) st: usize,
}

impl<'a> Rows<'a> {
    pub(crate) fn new(s: &'a CpuStorage, l: &Layout, name: &str) -> Result<Self> {
        match s {
            CpuStorage::F32(d) => Rows::of(d, l, name),
            _ => bail!("flash_attn_cpu: {name} must be f32"),
        }
    }
}

impl<'a, T> Rows<'a, T> {
    pub(crate) fn of(data: &'a [T], l: &Layout, name: &str) -> Result<Self> {
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
    pub(crate) fn ptr(&self, b: usize, h: usize, t: usize) -> *const T {
        let i = self.offset + b * self.sb + h * self.sh + t * self.st;
        debug_assert!(i <= self.data.len());
        // SAFETY: in bounds by the layout Candle handed us (checked in debug builds).
        unsafe { self.data.as_ptr().add(i) }
    }
}

/// Keys or values: f32 rows read in place, or f16/bf16 rows (a half-precision KV cache)
/// widened block by block into a task's scratch.
#[derive(Clone, Copy)]
pub(crate) enum KvRows<'a> {
    F32(Rows<'a>),
    F16(Rows<'a, f16>),
    BF16(Rows<'a, bf16>),
}

impl<'a> KvRows<'a> {
    pub(crate) fn new(s: &'a CpuStorage, l: &Layout, name: &str) -> Result<Self> {
        Ok(match s {
            CpuStorage::F32(d) => Self::F32(Rows::of(d, l, name)?),
            CpuStorage::F16(d) => Self::F16(Rows::of(d, l, name)?),
            CpuStorage::BF16(d) => Self::BF16(Rows::of(d, l, name)?),
            _ => bail!("flash_attn_cpu: {name} must be f32, f16 or bf16"),
        })
    }

    pub(crate) fn st(&self) -> usize {
        match self {
            Self::F32(r) => r.st,
            Self::F16(r) => r.st,
            Self::BF16(r) => r.st,
        }
    }

    pub(crate) fn ptr(&self, b: usize, h: usize, t: usize) -> KvPtr {
        match self {
            Self::F32(r) => KvPtr::F32(r.ptr(b, h, t)),
            Self::F16(r) => KvPtr::F16(r.ptr(b, h, t)),
            Self::BF16(r) => KvPtr::BF16(r.ptr(b, h, t)),
        }
    }

    fn is_half(&self) -> bool {
        !matches!(self, Self::F32(_))
    }
}

/// The first row of one head's keys or values.
#[derive(Clone, Copy)]
pub(crate) enum KvPtr {
    F32(*const f32),
    F16(*const f16),
    BF16(*const bf16),
}

impl KvPtr {
    /// Rows `j0..j0 + n` (each `width` long, `st` apart) as f32: a pointer and a row stride,
    /// into the storage itself or, for half precision, into `buf` after widening them.
    ///
    /// # Safety
    /// The rows must lie inside the storage the pointer came from.
    pub(crate) unsafe fn rows(
        self,
        j0: usize,
        n: usize,
        st: usize,
        width: usize,
        buf: &mut [f32],
    ) -> (*const f32, usize) {
        unsafe fn widen<H>(
            conv: fn(&[H], &mut [f32]),
            p: *const H,
            j0: usize,
            n: usize,
            st: usize,
            width: usize,
            buf: &mut [f32],
        ) {
            for (r, dst) in buf[..n * width].chunks_mut(width).enumerate() {
                conv(std::slice::from_raw_parts(p.add((j0 + r) * st), width), dst);
            }
        }
        match self {
            Self::F32(p) => (p.add(j0 * st), st),
            Self::F16(p) => {
                widen(simd::widen_f16, p, j0, n, st, width, buf);
                (buf.as_ptr(), width)
            }
            Self::BF16(p) => {
                widen(simd::widen_bf16, p, j0, n, st, width, buf);
                (buf.as_ptr(), width)
            }
        }
    }
}

/// Which keys a block of query rows sees: the causal limit, the window, key padding.
#[derive(Clone, Copy)]
pub(crate) struct Visibility<'a> {
    /// Absolute position of the block's first query row when causal.
    first_pos: Option<usize>,
    /// With `first_pos`: keys visible to a query, itself included.
    window: Option<usize>,
    keep: Option<&'a [u8]>,
    tk: usize,
}

impl Visibility<'_> {
    fn oldest(&self, pos: usize) -> usize {
        match self.window {
            Some(w) => (pos + 1).saturating_sub(w),
            None => 0,
        }
    }

    /// The keys any of `rows` rows may see: none before the first row's window, none past
    /// the last row's causal limit.
    pub(crate) fn key_range(&self, rows: usize) -> std::ops::Range<usize> {
        match self.first_pos {
            Some(p) => self.oldest(p)..(p + rows).min(self.tk),
            None => 0..self.tk,
        }
    }

    /// Sets the scores of row `r` for keys `j0..` that it may not see to `-inf`; returns
    /// how many leading entries can be visible (the rest are all hidden).
    pub(crate) fn mask_row(&self, row: &mut [f32], r: usize, j0: usize) -> usize {
        let bc = row.len();
        let visible = match self.first_pos {
            Some(p) => (p + r + 1).saturating_sub(j0).min(bc),
            None => bc,
        };
        row[visible..].fill(f32::NEG_INFINITY);
        if let Some(p) = self.first_pos {
            let hidden = self.oldest(p + r).saturating_sub(j0).min(visible);
            row[..hidden].fill(f32::NEG_INFINITY);
        }
        if let Some(keep) = self.keep {
            for (x, &kp) in row[..visible].iter_mut().zip(&keep[j0..j0 + visible]) {
                if kp == 0 {
                    *x = f32::NEG_INFINITY;
                }
            }
        }
        visible
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
        let (bk, h_kv, tk, dk) = lk.shape().dims4()?;
        let (bv, hv, tv, dv) = lv.shape().dims4()?;
        if bk != b || bv != b || hv != h_kv || tv != tk || dk != d || h_kv == 0 || h % h_kv != 0 {
            bail!(
                "flash_attn_cpu: q {:?}, k {:?} and v {:?} do not fit [b, h, tq, d], [b, h_kv, tk, d], [b, h_kv, tk, dv] with h a multiple of h_kv",
                lq.dims(),
                lk.dims(),
                lv.dims()
            )
        }
        let (q, k, v) = (
            Rows::new(sq, lq, "q")?,
            KvRows::new(sk, lk, "k")?,
            KvRows::new(sv, lv, "v")?,
        );
        if (k.is_half() || v.is_half()) && self.drop.is_some() {
            bail!("flash_attn_cpu: half-precision keys and values are for inference")
        }
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
        let mut lse = vec![f32::INFINITY; b * h * tq];
        if out.is_empty() {
            return Ok((CpuStorage::F32(out), Shape::from((b, h, tq, dv))));
        }
        if tq <= DIRECT_ROWS && self.drop.is_none() {
            let dims = decode::Dims {
                b,
                h,
                h_kv,
                tq,
                tk,
                d,
                dv,
            };
            decode::run(self, q, k, v, dims, &mut out, &mut lse);
            if let Ok(mut slot) = self.lse.lock() {
                *slot = lse;
            }
            return Ok((CpuStorage::F32(out), Shape::from((b, h, tq, dv))));
        }
        // Scratch sized by what the blocks use: scores for up to BR rows, and a block of
        // widened keys and values where they are half precision. Each head of each step
        // allocates and zeroes it.
        let half = |kv: &KvRows, width: usize| match kv.is_half() {
            true => BC * width,
            false => 0,
        };
        let (k_buf, v_buf) = (half(&k, d), half(&v, dv));
        let score_rows = tq.min(BR);
        out.par_chunks_mut(tq * dv)
            .zip(lse.par_chunks_mut(tq))
            .enumerate()
            .for_each(|(bh, (out_head, lse_head))| {
                let (bi, hi) = (bh / h, bh % h);
                let hk = hi / n_rep;
                out_head
                    .par_chunks_mut(BR * dv)
                    .zip(lse_head.par_chunks_mut(BR))
                    .enumerate()
                    .for_each_init(
                        || Scratch {
                            scores: vec![0f32; score_rows * BC],
                            k: vec![0f32; k_buf],
                            v: vec![0f32; v_buf],
                        },
                        |scratch, (blk, (out_blk, lse_blk))| {
                            let i0 = blk * BR;
                            let block = Block {
                                q: q.ptr(bi, hi, i0),
                                q_st: q.st,
                                k: k.ptr(bi, hk, 0),
                                k_st: k.st(),
                                v: v.ptr(bi, hk, 0),
                                v_st: v.st(),
                                rows: lse_blk.len(),
                                d,
                                dv,
                                vis: self.visibility(bi, tk, i0),
                                drop: self.drop.map(|m| (m, ((bh * tq + i0) * tk) as u64)),
                                scale: self.scale,
                            };
                            block.run(out_blk, lse_blk, scratch);
                        },
                    );
            });
        if let Ok(mut slot) = self.lse.lock() {
            *slot = lse;
        }
        Ok((CpuStorage::F32(out), Shape::from((b, h, tq, dv))))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        grad_out: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dq, dk, dv) = crate::flash_backward::backward(self, q, k, v, out, grad_out)?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

/// A task's scratch: a block of scores, and widened keys and values (half precision).
struct Scratch {
    scores: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
}

/// One block of query rows of one head.
struct Block<'a> {
    q: *const f32,
    q_st: usize,
    k: KvPtr,
    k_st: usize,
    v: KvPtr,
    v_st: usize,
    rows: usize,
    d: usize,
    dv: usize,
    vis: Visibility<'a>,
    /// The dropout mask and the index of the block's element `(0, 0)` in it.
    drop: Option<(DropMask, u64)>,
    scale: f32,
}

impl Block<'_> {
    /// Writes the block's `[rows, dv]` output into `out` and each row's log-sum-exp into
    /// `lse`.
    fn run(&self, out: &mut [f32], lse: &mut [f32], scratch: &mut Scratch) {
        let Scratch {
            scores,
            k: k_buf,
            v: v_buf,
        } = scratch;
        let rows = self.rows;
        let mut m = [f32::NEG_INFINITY; BR];
        let mut l = [0f32; BR];
        out.fill(0.0);
        let keys = self.vis.key_range(rows);
        for j0 in keys.clone().step_by(BC) {
            let bc = BC.min(keys.end - j0);
            let s = &mut scores[..rows * bc];
            // SAFETY: key rows j0..j0 + bc lie in the storage (see `Rows::ptr`).
            let (k, k_st) = unsafe { self.k.rows(j0, bc, self.k_st, self.d, k_buf) };
            // S[rows, bc] = scale · Q[rows, d] · K[j0.., d]ᵀ
            // SAFETY: the pointers address `rows` query rows and `bc` key rows of length
            // `d` with the given strides, all inside the storages (see `Rows::ptr`) or the
            // scratch.
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
                    k,
                    k_st as isize,
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
                let visible = self.vis.mask_row(row, r, j0);
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
                // Dropout acts on the normalised weights; the sum above is before it.
                if let Some((mask, base)) = self.drop {
                    let first = base + (r * self.vis.tk + j0) as u64;
                    for (c, x) in row[..visible].iter_mut().enumerate() {
                        *x *= mask.factor(first + c as u64);
                    }
                }
            }
            // SAFETY: value rows j0..j0 + bc lie in the storage.
            let (v, v_st) = unsafe { self.v.rows(j0, bc, self.v_st, self.dv, v_buf) };
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
                    v,
                    1,
                    v_st as isize,
                    1.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
        }
        for r in 0..rows {
            // A row that saw no key keeps its zeros, and its weights are all 0.
            let (inv, row_lse) = if l[r] > 0.0 {
                (1.0 / l[r], m[r] + l[r].ln())
            } else {
                (0.0, f32::INFINITY)
            };
            simd::scale(&mut out[r * self.dv..(r + 1) * self.dv], inv);
            lse[r] = row_lse;
        }
    }
}
