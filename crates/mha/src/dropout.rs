//! Dropout that can be replayed: the same seed gives the same masks in the same order.
//!
//! Candle's CPU random generator cannot be seeded, so masks come from a counter-based
//! generator (SplitMix64 over `seed`, call number and element index). The counter is
//! atomic, so modules stay `&self` and `Send + Sync`.

use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::{bail, CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

/// Inverted dropout: in training, zeroes each element with probability `p` and scales the
/// rest by `1 / (1 - p)`; outside training, the identity.
#[derive(Debug)]
pub struct Dropout {
    p: f32,
    seed: u64,
    calls: AtomicU64,
}

impl Clone for Dropout {
    fn clone(&self) -> Self {
        Self {
            p: self.p,
            seed: self.seed,
            calls: AtomicU64::new(self.calls.load(Ordering::Relaxed)),
        }
    }
}

impl Dropout {
    /// A dropout with probability `p` in `[0, 1)` whose masks are drawn from `seed`.
    pub fn new(p: f32, seed: u64) -> Result<Self> {
        if !(0.0..1.0).contains(&p) {
            bail!("dropout probability must be in [0, 1), got {p}")
        }
        Ok(Self {
            p,
            seed,
            calls: AtomicU64::new(0),
        })
    }

    /// The drop probability.
    pub fn p(&self) -> f32 {
        self.p
    }

    /// How many masks this dropout has drawn: each training call draws the next one. A
    /// training run saves it with its checkpoint and [`Self::set_calls`] restores it, so a
    /// resumed run draws the masks an uninterrupted one would.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    /// Makes the next call draw mask number `calls` (see [`Self::calls`]).
    pub fn set_calls(&self, calls: u64) {
        self.calls.store(calls, Ordering::Relaxed)
    }

    /// True when a call with this `train` flag changes its input.
    pub fn is_active(&self, train: bool) -> bool {
        train && self.p > 0.0
    }

    /// Applies dropout when `train` is true; returns `xs` itself otherwise.
    pub fn forward(&self, xs: &Tensor, train: bool) -> Result<Tensor> {
        if !self.is_active(train) {
            return Ok(xs.clone());
        }
        let mask = self.draw();
        if gpt_kernels::cpu_kernels(xs.device()) && xs.dtype() == DType::F32 {
            // One parallel pass, and a backward pass that replays the mask instead of
            // keeping it as a tensor.
            return xs.contiguous()?.apply_op1(Apply(mask));
        }
        let mask: Vec<f32> = (0..xs.elem_count() as u64)
            .map(|i| mask.factor(i))
            .collect();
        let mask = Tensor::from_vec(mask, xs.shape(), xs.device())?.to_dtype(xs.dtype())?;
        xs * mask
    }

    /// The mask of the next call, which it consumes: what [`Dropout::forward`] would
    /// multiply element `i` (row-major) of its input by is `draw().factor(i)`. The fused
    /// attention kernel replays the reference path's masks this way.
    pub(crate) fn draw(&self) -> DropMask {
        let call = self.calls.fetch_add(1, Ordering::Relaxed);
        DropMask {
            stream: splitmix64(self.seed ^ call.wrapping_mul(0x9E37_79B9_7F4A_7C15)),
            // 24 random bits give a uniform f32 in [0, 1) with every value exact.
            threshold: (self.p as f64 * (1u64 << 24) as f64) as u64,
            keep_scale: 1.0 / (1.0 - self.p),
        }
    }
}

/// One call's dropout mask, computed element by element from its index.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DropMask {
    stream: u64,
    threshold: u64,
    keep_scale: f32,
}

impl DropMask {
    /// `0` or `1 / (1 - p)` for element `i`.
    #[inline]
    pub(crate) fn factor(&self, i: u64) -> f32 {
        if splitmix64(self.stream.wrapping_add(i)) >> 40 >= self.threshold {
            self.keep_scale
        } else {
            0.0
        }
    }
}

/// Multiplies a contiguous f32 CPU tensor by a mask, element `i` by `factor(i)`; its
/// gradient is the incoming gradient times the same mask.
struct Apply(DropMask);

/// Elements per task.
const CHUNK: usize = 1 << 14;

impl CustomOp1 for Apply {
    fn name(&self) -> &'static str {
        "dropout"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (CpuStorage::F32(v), Some((a, b))) = (s, l.contiguous_offsets()) else {
            bail!("dropout: expected a contiguous f32 tensor")
        };
        let mut ys = v[a..b].to_vec();
        ys.par_chunks_mut(CHUNK).enumerate().for_each(|(c, ys)| {
            let first = (c * CHUNK) as u64;
            for (i, y) in ys.iter_mut().enumerate() {
                *y *= self.0.factor(first + i as u64);
            }
        });
        Ok((CpuStorage::F32(ys), l.shape().clone()))
    }

    fn bwd(&self, _xs: &Tensor, _ys: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(grad.contiguous()?.apply_op1_no_bwd(&Apply(self.0))?))
    }
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
