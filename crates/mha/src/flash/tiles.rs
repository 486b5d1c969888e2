//! What every fused attention pass shares: the op's parameters ([`FlashAttn`]: scale, causal
//! offset, window, padding, dropout, the saved log-sum-exp), `[b, h, t, d]` tensors seen as
//! rows ([`Rows`], [`KvRows`] over f32 or half-precision caches), and what a query row may
//! see ([`Visibility`]).

use std::sync::Mutex;

use candle_core::{bail, CpuStorage, Layout, Result, Tensor};
use gpt_kernels::simd;
use half::{bf16, f16};

use crate::dropout::DropMask;
use crate::mask::Mask;

/// Query rows per block.
pub(crate) const BR: usize = 64;
/// Keys per block.
pub(crate) const BC: usize = 128;
/// The most query rows per head that take [`super::decode`] (decoding: one row per
/// sequence) rather than blocks of BR rows, when no dropout is asked for.
pub(crate) const DIRECT_ROWS: usize = 4;

/// The kernels read rows with unit stride; cache views (strided heads) are fine.
pub(crate) fn unit(t: &Tensor) -> Result<Tensor> {
    if t.stride().last() == Some(&1) {
        Ok(t.clone())
    } else {
        t.contiguous()
    }
}

pub(crate) struct FlashAttn {
    pub(crate) scale: f32,
    /// Gemma 2's soft cap: each score `s` becomes `cap · tanh(s / cap)` before the mask.
    /// Forward passes only (the differentiable path is the reference one).
    pub(crate) softcap: Option<f32>,
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
    pub(crate) fn new(
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
            softcap: None,
            causal: mask.causal,
            window: mask.causal.and(mask.window),
            keep,
            drop: None,
            lse: Mutex::new(Vec::new()),
        })
    }

    /// The op with its scores soft-capped at `cap` (see [`FlashAttn::softcap`]).
    pub(crate) fn capped(self, cap: Option<f64>) -> Result<Self> {
        if cap.is_some() && self.drop.is_some() {
            bail!("flash_attn_cpu: soft-capped scores have no training kernel")
        }
        Ok(Self {
            softcap: cap.map(|c| c as f32),
            ..self
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

    pub(crate) fn is_half(&self) -> bool {
        !matches!(self, Self::F32(_))
    }

    /// Whether rows `t..t + n` of head `h` of batch `b`, `width` values each, lie in the
    /// storage: past the head's last row they run into the next head's, or past the
    /// storage's end for the last head.
    pub(crate) fn holds(&self, b: usize, h: usize, t: usize, n: usize, width: usize) -> bool {
        fn fits<T>(r: &Rows<'_, T>, b: usize, h: usize, t: usize, n: usize, width: usize) -> bool {
            n == 0 || r.offset + b * r.sb + h * r.sh + (t + n - 1) * r.st + width <= r.data.len()
        }
        match self {
            Self::F32(r) => fits(r, b, h, t, n, width),
            Self::F16(r) => fits(r, b, h, t, n, width),
            Self::BF16(r) => fits(r, b, h, t, n, width),
        }
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
    pub(crate) tk: usize,
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

/// `cap · tanh(s / cap)` for every score of `row` (Gemma 2's soft cap).
pub(crate) fn soft_cap(row: &mut [f32], cap: Option<f32>) {
    if let Some(cap) = cap {
        for s in row {
            *s = cap * (*s / cap).tanh();
        }
    }
}
