//! One decoding step of self-attention on the CPU, from a fused q/k/v projection's output
//! `[b, t, (h + 2·h_kv)·d]` (f32, `t ≤` [`DIRECT_ROWS`]): the new keys are rotated and
//! written into the cache's storage in place, the new values likewise, the queries rotated
//! into a scratch row, and [`super::decode`] runs over the cache, its output laid out
//! `[b, t, h·d]` as the output projection reads it.
//!
//! The general path computes the same through a dozen tensor ops a layer (the projection's
//! three views and their transposes, two rotations with their copies, two casts to the
//! cache's dtype, two slice copies, the attention op's checks, the output's transpose),
//! each with its allocations and locks: on a small model, bookkeeping the calling thread
//! does while the other threads wait.
//! Rotation and rounding are the general path's to the bit ([`rotate_pairs`], `half`'s
//! conversions), which the tests check against it.

use candle_core::{bail, CpuStorage, DType, InplaceOp2, Layout, Result, Storage, Tensor};
use half::slice::HalfFloatSliceExt;

use super::decode;
use super::tiles::{FlashAttn, KvRows, Rows, DIRECT_ROWS};
use crate::cache::KvCache;
use crate::mask::Mask;
use crate::qk_norm::{normalise, HeadNorm};
use crate::rope::rotate_pairs;
use crate::rope::{Rope, RopeTables};
use gpt_kernels::storage::{values, with_values};

/// The rotation angles of the step's positions: `[b·t, half]` cosines and sines.
pub(crate) struct Angles {
    cos: Vec<f32>,
    sin: Vec<f32>,
    half: usize,
}

impl Angles {
    /// From the caller's tables (`[b, t, rotary_dim / 2]`), or for positions
    /// `offset..offset + t` of every row.
    pub(crate) fn of(
        rope: &Rope,
        tables: Option<&RopeTables>,
        (b, t): (usize, usize),
        offset: usize,
    ) -> Result<Self> {
        let own;
        let tables = match tables {
            Some(tables) => tables,
            None => {
                own = rope.tables_from(b, t, offset, &candle_core::Device::Cpu)?;
                &own
            }
        };
        let half = rope.rotary_dim() / 2;
        let read = |x: &Tensor| -> Result<Vec<f32>> {
            if x.dims() != [b, t, half] || x.dtype() != DType::F32 {
                bail!(
                    "rope: tables {:?} {:?} do not fit [batch, seq, rotary_dim/2] = [{b}, {t}, {half}] f32",
                    x.dims(),
                    x.dtype()
                )
            }
            with_values(&x.contiguous()?, "rope tables", |v| Ok(v.to_vec()))
        };
        Ok(Self {
            cos: read(&tables.cos)?,
            sin: read(&tables.sin)?,
            half,
        })
    }

    /// Rotates the first `rotary_dim` features of `head`, a head of position `bt` (of
    /// `b·t`).
    fn rotate(&self, head: &mut [f32], bt: usize) {
        let at = bt * self.half..(bt + 1) * self.half;
        rotate_pairs(head, &self.cos[at.clone()], &self.sin[at], false);
    }
}

/// The step's shapes: `b` sequences of `t` new positions, `h` query heads over `h_kv`
/// key/value heads of `d` features.
#[derive(Clone, Copy)]
pub(crate) struct Heads {
    pub h: usize,
    pub h_kv: usize,
    pub d: usize,
}

/// Makes room in `cache` for `t` new positions of `b` sequences and asks for the cache
/// lines they will be written to: called before the q/k/v projection, so that its reads
/// overlap with bringing in rows nothing has touched yet, where writing them after it
/// waited on memory.
pub(crate) fn prepare(cache: &mut KvCache, (b, t): (usize, usize), heads: Heads) -> Result<()> {
    let Heads { h_kv, d, .. } = heads;
    let dtype = cache.dtype().unwrap_or(DType::F32);
    let at = cache.len();
    let (ck, cv) = cache.reserve((b, h_kv, t, d), dtype, &candle_core::Device::Cpu)?;
    for c in [ck, cv] {
        let (s, l) = c.storage_and_layout();
        let (Storage::Cpu(s), Ok((_, _, allocated, _))) = (&*s, l.shape().dims4()) else {
            continue;
        };
        let (ptr, size) = match s {
            CpuStorage::F32(v) => (v.as_ptr() as *const u8, 4),
            CpuStorage::F16(v) => (v.as_ptr() as *const u8, 2),
            CpuStorage::BF16(v) => (v.as_ptr() as *const u8, 2),
            _ => continue,
        };
        for g in 0..b * h_kv {
            // The rows' bytes, and every cache line they touch.
            let first = ptr as usize + (l.start_offset() + (g * allocated + at) * d) * size;
            for line in (first & !63..first + t * d * size).step_by(64) {
                // SAFETY: a prefetch never faults, whatever the address.
                #[cfg(target_arch = "x86_64")]
                unsafe {
                    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
                    _mm_prefetch::<_MM_HINT_T0>(line as *const i8);
                }
                #[cfg(not(target_arch = "x86_64"))]
                let _ = line;
            }
        }
    }
    Ok(())
}

/// What each query and key head goes through as [`attend`] reads it: a per-head q/k norm,
/// then the rotation.
#[derive(Clone, Copy)]
pub(crate) struct EachHead<'a> {
    pub norm: Option<HeadNorm<'a>>,
    pub angles: Option<&'a Angles>,
}

/// Self-attention of the positions in `qkv` (`[b, t, (h + 2·h_kv)·d]`, contiguous f32 on
/// the CPU) over `cache` and themselves: appends their keys (as `each` says) and values
/// to `cache` and returns the heads' outputs `[b, t, h·d]`. `mask` as the general
/// path takes it (its causal offset is the cache's length).
pub(crate) fn attend(
    qkv: &Tensor,
    heads: Heads,
    each: EachHead,
    cache: &mut KvCache,
    mask: &Mask,
    scale: f64,
    softcap: Option<f64>,
) -> Result<Tensor> {
    let Heads { h, h_kv, d } = heads;
    let EachHead { norm, angles } = each;
    let (b, t, w) = qkv.dims3()?;
    if w != (h + 2 * h_kv) * d || t == 0 || t > DIRECT_ROWS || !qkv.is_contiguous() {
        bail!("attention step: a projection of {:?} for {h} query and {h_kv} key/value heads of {d}, at most {DIRECT_ROWS} positions", qkv.dims())
    }
    let dtype = cache.dtype().unwrap_or(DType::F32);
    let at = cache.len();
    let (ck, cv) = cache.reserve((b, h_kv, t, d), dtype, qkv.device())?;
    let keys = Store {
        from: h * d,
        heads,
        t,
        at,
        norm: norm.map(|n| (n.k, n.eps)),
        angles,
    };
    ck.inplace_op2(qkv, &keys)?;
    let values = Store {
        from: (h + h_kv) * d,
        norm: None,
        angles: None,
        ..keys
    };
    cv.inplace_op2(qkv, &values)?;
    let (k, v) = cache.advance(t)?;
    let tk = k.dim(2)?;
    let op = FlashAttn::over(b, tk, qkv.device(), mask, scale)?.capped(softcap)?;

    // The queries, normalised and rotated: `[b, t, h, d]`, read as `[b, h, t, d]`.
    let mut q_values = Vec::with_capacity(b * t * h * d);
    with_values(qkv, "attention step", |x| {
        for (bt, row) in x.chunks_exact(w).enumerate() {
            let first = q_values.len();
            q_values.extend_from_slice(&row[..h * d]);
            for head in q_values[first..].chunks_exact_mut(d) {
                if let Some(n) = norm {
                    normalise(head, n.q, n.eps);
                }
                if let Some(angles) = angles {
                    angles.rotate(head, bt);
                }
            }
        }
        Ok(())
    })?;
    let q_layout = Layout::new((b, h, t, d).into(), vec![t * h * d, d, h * d, 1], 0);
    let q = Rows::of(&q_values, &q_layout, "q")?;

    let (sk, lk) = k.storage_and_layout();
    let (sv, lv) = v.storage_and_layout();
    let (Storage::Cpu(sk), Storage::Cpu(sv)) = (&*sk, &*sv) else {
        bail!("attention step: the cache is not on the CPU")
    };
    let (k, v) = (KvRows::new(sk, lk, "k")?, KvRows::new(sv, lv, "v")?);
    let dims = decode::Dims {
        b,
        h,
        h_kv,
        tq: t,
        tk,
        d,
        dv: d,
    };
    let parts = decode::partials(&op, q, k, v, dims);
    // The queries are read: their buffer (b·t·h·d values, as many as the output's) takes
    // the output `(b, h, t, d)`. Written a moment ago, it sits in the caches, where a new
    // buffer's lines would be read from memory first (docs/PERFORMANCE.md).
    let mut out = q_values;
    let mut lse = vec![0f32; b * h * t];
    parts.merge(&mut out, &mut lse);
    if t > 1 {
        // (b, h, t, d) -> (b, t, h·d)
        let mut ys = vec![0f32; out.len()];
        for (bh, head) in out.chunks_exact(t * d).enumerate() {
            let (bi, hi) = (bh / h, bh % h);
            for (ti, row) in head.chunks_exact(d).enumerate() {
                ys[((bi * t + ti) * h + hi) * d..][..d].copy_from_slice(row);
            }
        }
        out = ys;
    }
    Tensor::from_vec(out, (b, t, h * d), qkv.device())
}

/// Writes the step's keys (normalised by `norm`'s weights and epsilon, then rotated) or
/// values, features `from..from + h_kv·d` of each row of the projection, into a cache's
/// storage `[b, h_kv, allocated, d]` at positions `at..at + t`, in the storage's dtype.
#[derive(Clone, Copy)]
struct Store<'a> {
    from: usize,
    heads: Heads,
    t: usize,
    at: usize,
    norm: Option<(&'a [f32], f32)>,
    angles: Option<&'a Angles>,
}

impl InplaceOp2 for Store<'_> {
    fn name(&self) -> &'static str {
        "kv-cache-store"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dl: &Layout,
        src: &CpuStorage,
        sl: &Layout,
    ) -> Result<()> {
        let Heads { h_kv, d, .. } = self.heads;
        let (b, hk, allocated, dd) = dl.shape().dims4()?;
        let x = values(src, sl, "kv-cache-store")?;
        let w = x.len() / (b * self.t).max(1);
        let fits = dl.is_contiguous()
            && (hk, dd) == (h_kv, d)
            && self.at + self.t <= allocated
            && x.len() == b * self.t * w
            && self.from + h_kv * d <= w;
        if !fits {
            bail!(
                "kv-cache-store: {} rows of {w} do not fit a cache {:?} at {}",
                b * self.t,
                dl.dims(),
                self.at
            )
        }
        let mut head = vec![0f32; d];
        for (bt, row) in x.chunks_exact(w).enumerate() {
            let (bi, ti) = (bt / self.t, bt % self.t);
            for hi in 0..h_kv {
                head.copy_from_slice(&row[self.from + hi * d..][..d]);
                if let Some((w, eps)) = self.norm {
                    normalise(&mut head, w, eps);
                }
                if let Some(angles) = self.angles {
                    angles.rotate(&mut head, bt);
                }
                let at = dl.start_offset() + ((bi * h_kv + hi) * allocated + self.at + ti) * d;
                match dst {
                    CpuStorage::F32(s) => s[at..at + d].copy_from_slice(&head),
                    CpuStorage::F16(s) => s[at..at + d].convert_from_f32_slice(&head),
                    CpuStorage::BF16(s) => s[at..at + d].convert_from_f32_slice(&head),
                    _ => bail!("kv-cache-store: the cache must be f32, f16 or bf16"),
                }
            }
        }
        Ok(())
    }
}
