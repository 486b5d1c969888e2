//! Rotary position embeddings (RoPE), as Hugging Face applies them: the rotate-half layout
//! (Llama, Mistral, Qwen2, GPT-NeoX), optionally on the first `rotary_dim` features of each
//! head only (NeoX's `rotary_pct`, `partial_rotary_factor`).
//!
//! Feature `i < rotary_dim / 2` of a head is paired with feature `i + rotary_dim / 2` and the
//! pair is turned by the angle `position · inv_freq[i]`, where
//! `inv_freq[i] = theta^(-2i / rotary_dim)`, then scaled ([`RopeScaling`]: linear, or Llama
//! 3.1's bands).

use candle_core::{bail, DType, Device, Layout, Result, Tensor, D};
use serde::{Deserialize, Serialize};
use std::mem::MaybeUninit;

use gpt_kernels::storage::with_values;

/// How the frequencies are stretched for contexts longer than the model was trained on
/// (`rope_scaling` / `rope_parameters.rope_type` in `config.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum RopeScaling {
    /// The frequencies as trained.
    None,
    /// Positions divided by `factor` (Hugging Face's `"linear"`).
    Linear {
        /// The divisor, > 0.
        factor: f64,
    },
    /// Llama 3.1's `"llama3"`: frequencies whose wavelength exceeds
    /// `original_max_position_embeddings / low_freq_factor` are divided by `factor`, those
    /// below `original_max_position_embeddings / high_freq_factor` kept, and those between
    /// blended smoothly.
    Llama3 {
        /// The divisor of the low frequencies, > 0.
        factor: f64,
        /// Sets the longest wavelength left unblended.
        low_freq_factor: f64,
        /// Sets the shortest wavelength left untouched; > `low_freq_factor`.
        high_freq_factor: f64,
        /// The context the model was first trained with.
        original_max_position_embeddings: f64,
    },
    /// Phi-3's `"longrope"` (`"su"`): frequency `i` divided by its own factor, `short[i]`
    /// while a sequence stays within `original_max_position_embeddings` and `long[i]` once
    /// its furthest position passes it (transformers decides at each forward pass, by the
    /// largest position of the row), and the cosines and sines times `attention_factor`.
    LongRope {
        /// One divisor per frequency (`rotary_dim / 2`) within the original context.
        short_factor: Vec<f64>,
        /// One divisor per frequency beyond it.
        long_factor: Vec<f64>,
        /// The context the model was first trained with.
        original_max_position_embeddings: usize,
        /// Factor on the cosines and sines (so on every score, squared).
        attention_factor: f64,
    },
}

impl RopeScaling {
    /// An inverse frequency `inv_freq` (f32) after scaling, computed as transformers does:
    /// unchanged, divided by the linear factor, or in Llama 3's bands.
    /// LongRoPE's factors are per frequency: [`Rope::new`] applies them.
    pub fn apply(&self, inv_freq: f32) -> f32 {
        match *self {
            Self::None | Self::LongRope { .. } => inv_freq,
            Self::Linear { factor } => inv_freq / factor as f32,
            Self::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            } => {
                // transformers' _compute_llama3_parameters, step by step in f32.
                let (factor, low, high, old) = (
                    factor as f32,
                    low_freq_factor as f32,
                    high_freq_factor as f32,
                    old as f32,
                );
                let wavelen = 2.0 * std::f32::consts::PI / inv_freq;
                if wavelen < old / high {
                    inv_freq
                } else if wavelen > old / low {
                    inv_freq / factor
                } else {
                    let smooth = (old / wavelen - low) / (high - low);
                    (1.0 - smooth) * inv_freq / factor + smooth * inv_freq
                }
            }
        }
    }
}

/// Configuration of rotary embeddings for one attention layer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RopeConfig {
    /// The base of the frequencies (`rope_theta`, NeoX's `rotary_emb_base`), > 1.
    pub theta: f64,
    /// How many leading features of each head are rotated; `None` is all of them. Must be
    /// even and at most `head_dim`.
    pub rotary_dim: Option<usize>,
    /// Frequency scaling.
    pub scaling: RopeScaling,
}

impl Default for RopeConfig {
    /// Llama's: theta 10000, every feature rotated, no scaling.
    fn default() -> Self {
        Self {
            theta: 10_000.0,
            rotary_dim: None,
            scaling: RopeScaling::None,
        }
    }
}

impl RopeConfig {
    /// Checks the values against the head width; the error names them.
    pub fn validate(&self, head_dim: usize) -> Result<()> {
        if !(self.theta > 1.0 && self.theta.is_finite()) {
            bail!("rope: theta must be finite and > 1, got {}", self.theta)
        }
        let dim = self.rotary_dim.unwrap_or(head_dim);
        if dim == 0 || !dim.is_multiple_of(2) || dim > head_dim {
            bail!("rope: rotary_dim={dim} must be even, positive and at most head_dim={head_dim}")
        }
        if let RopeScaling::Llama3 {
            factor,
            low_freq_factor: low,
            high_freq_factor: high,
            original_max_position_embeddings: old,
        } = self.scaling
        {
            let finite = [factor, low, high, old].iter().all(|x| x.is_finite());
            if !(finite && factor > 0.0 && low > 0.0 && high > low && old > 0.0) {
                bail!("rope: llama3 scaling needs factor > 0, 0 < low_freq_factor < high_freq_factor and original_max_position_embeddings > 0, got {factor}, {low}, {high}, {old}")
            }
        }
        if let RopeScaling::Linear { factor } = self.scaling {
            if !(factor > 0.0 && factor.is_finite()) {
                bail!("rope: the linear scaling factor must be > 0, got {factor}")
            }
        }
        if let RopeScaling::LongRope {
            short_factor,
            long_factor,
            original_max_position_embeddings: old,
            attention_factor,
        } = &self.scaling
        {
            for (name, f) in [("short_factor", short_factor), ("long_factor", long_factor)] {
                if f.len() != dim / 2 {
                    bail!("rope: longrope {name} has {} entries for {} frequencies (rotary_dim {dim} / 2)", f.len(), dim / 2)
                }
                if !f.iter().all(|x| x.is_finite() && *x > 0.0) {
                    bail!("rope: longrope {name} entries must be positive numbers")
                }
            }
            if *old == 0 || *old > u32::MAX as usize {
                bail!(
                    "rope: longrope original_max_position_embeddings must be in 1..2^32, got {old}"
                )
            }
            if !(attention_factor.is_finite() && *attention_factor > 0.0) {
                bail!("rope: longrope attention_factor must be a positive number, got {attention_factor}")
            }
        }
        Ok(())
    }
}

/// The angles of one layer's rotary embedding; cheap to clone. Two are equal when they
/// turn every feature by the same angles (they can share [`RopeTables`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    /// `[rotary_dim / 2]`, f32 as transformers computes them.
    inv_freq: Vec<f32>,
    rotary_dim: usize,
    /// LongRoPE: the frequencies of rows whose furthest position is at or past the first
    /// position, `(first, inv_freq)`.
    long: Option<(u32, Vec<f32>)>,
    /// Factor on the cosines and sines (LongRoPE's attention factor; 1 otherwise).
    attention_factor: f32,
}

/// Cosines and sines for a batch of positions, `[b, t, rotary_dim / 2]` each (f32). Made
/// once per forward pass by [`Rope::tables`] and shared by every layer.
#[derive(Debug, Clone)]
pub struct RopeTables {
    /// `cos(position · inv_freq)`.
    pub cos: Tensor,
    /// `sin(position · inv_freq)`.
    pub sin: Tensor,
}

impl Rope {
    /// The frequencies for heads of width `head_dim`.
    pub fn new(cfg: &RopeConfig, head_dim: usize) -> Result<Self> {
        cfg.validate(head_dim)?;
        let dim = cfg.rotary_dim.unwrap_or(head_dim);
        // transformers: 1 / base ** (arange(0, dim, 2).float() / dim), in f32.
        let base = |i: usize| (cfg.theta as f32).powf((2 * i) as f32 / dim as f32);
        if let RopeScaling::LongRope {
            short_factor,
            long_factor,
            original_max_position_embeddings: old,
            attention_factor,
        } = &cfg.scaling
        {
            // transformers: 1 / (ext_factors * base ** (arange(0, dim, 2).float() / dim)).
            let freqs = |ext: &[f64]| -> Vec<f32> {
                (0..dim / 2)
                    .map(|i| 1.0 / (ext[i] as f32 * base(i)))
                    .collect()
            };
            return Ok(Self {
                inv_freq: freqs(short_factor),
                rotary_dim: dim,
                // Long from a row whose positions reach `old` (its length passes `old`).
                long: Some((*old as u32, freqs(long_factor))),
                attention_factor: *attention_factor as f32,
            });
        }
        let inv_freq = (0..dim / 2)
            .map(|i| cfg.scaling.apply(1.0 / base(i)))
            .collect();
        Ok(Self {
            inv_freq,
            rotary_dim: dim,
            long: None,
            attention_factor: 1.0,
        })
    }

    /// Number of rotated features per head.
    pub fn rotary_dim(&self) -> usize {
        self.rotary_dim
    }

    /// The tables for `positions` (`[b, t]`, integer).
    pub fn tables(&self, positions: &Tensor) -> Result<RopeTables> {
        let (b, t) = positions.dims2()?;
        let pos = positions.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(b * t * half);
        let mut sin = Vec::with_capacity(b * t * half);
        let a = self.attention_factor;
        for row in &pos {
            // LongRoPE: the long frequencies for a row that reaches past the original
            // context (transformers: max(position_ids) + 1 > original).
            let furthest = row.iter().copied().fold(0f32, f32::max);
            let inv_freq = match &self.long {
                Some((first, long)) if furthest >= *first as f32 => long,
                _ => &self.inv_freq,
            };
            for p in row {
                for &f in inv_freq {
                    // The product rounded to f32 first, as transformers' f32 matmul does.
                    let angle = p * f;
                    match a {
                        1.0 => {
                            cos.push(angle.cos());
                            sin.push(angle.sin());
                        }
                        a => {
                            cos.push(angle.cos() * a);
                            sin.push(angle.sin() * a);
                        }
                    }
                }
            }
        }
        let dev = positions.device();
        Ok(RopeTables {
            cos: Tensor::from_vec(cos, (b, t, half), dev)?,
            sin: Tensor::from_vec(sin, (b, t, half), dev)?,
        })
    }

    /// Positions `offset..offset + t` for every row: the tables of a sequence without
    /// padding whose first `offset` tokens are cached.
    pub fn tables_from(
        &self,
        b: usize,
        t: usize,
        offset: usize,
        dev: &Device,
    ) -> Result<RopeTables> {
        let end = match offset.checked_add(t) {
            Some(end) if end <= u32::MAX as usize => end,
            _ => bail!("rope: positions beyond {} are not supported", u32::MAX),
        };
        let pos = Tensor::arange(offset as u32, end as u32, dev)?
            .unsqueeze(0)?
            .broadcast_as((b, t))?
            .contiguous()?;
        self.tables(&pos)
    }

    /// Rotates the first `rotary_dim` features of every head of `xs` (`[b, h, t, head_dim]`).
    /// Differentiable when `xs` needs a gradient. f32 on the CPU takes our own rotation
    /// either way (Candle's fused CPU kernel divides for every element's index); other
    /// devices and dtypes take Candle's fused kernel outside training.
    pub fn apply(&self, xs: &Tensor, tables: &RopeTables) -> Result<Tensor> {
        let (b, _, t, d) = xs.dims4()?;
        let half = self.rotary_dim / 2;
        if tables.cos.dims() != [b, t, half] || tables.sin.dims() != [b, t, half] {
            bail!(
                "rope: tables {:?} do not fit [batch, seq, rotary_dim/2] = [{b}, {t}, {half}]",
                tables.cos.dims()
            )
        }
        let dtype = xs.dtype();
        let (cos, sin) = (tables.cos.to_dtype(dtype)?, tables.sin.to_dtype(dtype)?);
        let (rot, pass) = match self.rotary_dim < d {
            true => (
                xs.narrow(D::Minus1, 0, self.rotary_dim)?,
                Some(xs.narrow(D::Minus1, self.rotary_dim, d - self.rotary_dim)?),
            ),
            false => (xs.clone(), None),
        };
        let cpu_f32 = gpt_kernels::cpu_kernels(xs.device()) && dtype == DType::F32;
        let rotated = if cpu_f32 {
            // One op each way: the backward pass is the rotation by the opposite angles.
            rot.apply_op1(CpuRope {
                cos: cos.contiguous()?,
                sin: sin.contiguous()?,
            })?
        } else if xs.track_op() {
            // [b, 1, t, rot]: each half of the pair sees the same angle.
            let cos = Tensor::cat(&[&cos, &cos], D::Minus1)?.unsqueeze(1)?;
            let sin = Tensor::cat(&[&sin, &sin], D::Minus1)?.unsqueeze(1)?;
            let x1 = rot.narrow(D::Minus1, 0, half)?;
            let x2 = rot.narrow(D::Minus1, half, half)?;
            let rotate_half = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
            (rot.broadcast_mul(&cos)? + rotate_half.broadcast_mul(&sin)?)?
        } else {
            candle_nn::rotary_emb::rope(&rot.contiguous()?, &cos.contiguous()?, &sin.contiguous()?)?
        };
        match pass {
            Some(pass) => Tensor::cat(&[&rotated, &pass], D::Minus1),
            None => Ok(rotated),
        }
    }
}

/// The differentiable rotation of an f32 CPU `[b, h, t, rot]` tensor by the angles of
/// `cos`/`sin` (`[b, t, rot/2]`, contiguous): Candle's `rope` has no backward pass, and
/// the rotation built from tensor ops costs a dozen passes over q and k each way. Its
/// values are Candle's fused kernel's to the bit (the same products, summed in the same
/// pairs), so inference takes it too. The input may be strided (attention's heads are a
/// transposed view of the projection's output): it is read where it lies and the rotated
/// copy written once, where a contiguous copy and then a rotated copy of it took two
/// passes over q and k.
struct CpuRope {
    cos: Tensor,
    sin: Tensor,
}

impl CpuRope {
    /// Each `[t, rot]` plane of `xs` (the view `layout` describes, features at unit stride)
    /// rotated by the angles, or by their opposites (`inverse`: the transpose of the
    /// rotation, i.e. its backward pass), as a contiguous `[b, h, t, rot]` vector. The
    /// tables are read in place, not copied per call.
    fn rotate(&self, xs: &[f32], layout: &Layout, inverse: bool) -> Result<Vec<f32>> {
        use rayon::prelude::*;
        let (b, h, t, rot) = layout.shape().dims4()?;
        let half = rot / 2;
        if self.cos.dims() != [b, t, half] || self.sin.dims() != [b, t, half] || rot % 2 != 0 {
            bail!(
                "rope: tables {:?} do not fit {:?}",
                self.cos.dims(),
                layout.dims()
            )
        }
        let len = b * h * t * rot;
        if len == 0 {
            // No positions (or no rotated features): nothing to rotate, and no chunk size.
            return Ok(Vec::new());
        }
        let (at, st) = (layout.start_offset(), layout.stride());
        let end = at + (b - 1) * st[0] + (h - 1) * st[1] + (t - 1) * st[2] + rot;
        if st[3] != 1 || end > xs.len() {
            bail!("rope: expected each head's features in a row of the storage")
        }
        let mut ys = Vec::with_capacity(len);
        let plane = t * rot;
        with_values(&self.cos, "rope cos", |cos| {
            with_values(&self.sin, "rope sin", |sin| {
                let out = &mut ys.spare_capacity_mut()[..len];
                out.par_chunks_mut(plane).enumerate().for_each(|(bh, y)| {
                    let (bi, hi) = (bh / h, bh % h);
                    let angles = bi * t * half;
                    let (cos, sin) = (&cos[angles..][..t * half], &sin[angles..][..t * half]);
                    for (ti, (y, (c, s))) in y
                        .chunks_mut(rot)
                        .zip(cos.chunks(half).zip(sin.chunks(half)))
                        .enumerate()
                    {
                        let x = &xs[at + bi * st[0] + hi * st[1] + ti * st[2]..][..rot];
                        rotate_pairs_into(x, y, c, s, inverse);
                    }
                });
                Ok(())
            })
        })?;
        // SAFETY: every row of every plane was written by `rotate_pairs_into` (rot = 2·half).
        unsafe { ys.set_len(len) };
        Ok(ys)
    }
}

impl candle_core::CustomOp1 for CpuRope {
    fn name(&self) -> &'static str {
        "rope-cpu"
    }

    fn cpu_fwd(
        &self,
        storage: &candle_core::CpuStorage,
        layout: &Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let candle_core::CpuStorage::F32(xs) = storage else {
            bail!("rope: expected an f32 CPU tensor")
        };
        let ys = self.rotate(xs, layout, false)?;
        Ok((candle_core::CpuStorage::F32(ys), layout.shape().clone()))
    }

    fn bwd(&self, xs: &Tensor, _ys: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let grad = grad.contiguous()?.to_dtype(DType::F32)?;
        let layout = Layout::contiguous(xs.shape());
        let gx = with_values(&grad, "rope gradient", |g| self.rotate(g, &layout, true))?;
        Ok(Some(Tensor::from_vec(gx, xs.shape(), xs.device())?))
    }
}

/// One pair of features `(a, b)` rotated by an angle of cosine `c` and sine `s`: the one
/// formula of every path ([`rotate_pairs`], [`rotate_pairs_into`]), so that they agree to
/// the last bit.
#[inline(always)]
fn rotated(a: f32, b: f32, c: f32, s: f32) -> (f32, f32) {
    (a * c - b * s, b * c + a * s)
}

/// [`rotate_pairs`] from `x` into `y` (`[x1, x2]`, `2 · half` features each), which need
/// not be initialised and is written whole.
fn rotate_pairs_into(
    x: &[f32],
    y: &mut [MaybeUninit<f32>],
    cos: &[f32],
    sin: &[f32],
    inverse: bool,
) {
    let half = cos.len();
    let sign = if inverse { -1f32 } else { 1f32 };
    let (x1, x2) = x[..2 * half].split_at(half);
    let (y1, y2) = y[..2 * half].split_at_mut(half);
    for i in 0..half {
        let (r1, r2) = rotated(x1[i], x2[i], cos[i], sign * sin[i]);
        y1[i].write(r1);
        y2[i].write(r2);
    }
}

/// Rotates, in place, the first `2 · half` features of one row (halves `[x1, x2]`) by the
/// angles of `cos`/`sin` (`[half]`), or by their opposites (`inverse`): `[x1, x2] · cos +
/// [-x2, x1] · sin`, Hugging Face's rotate-half pairing. The one formula of every training
/// path, so that they agree to the last bit.
pub(crate) fn rotate_pairs(x: &mut [f32], cos: &[f32], sin: &[f32], inverse: bool) {
    let half = cos.len();
    let sign = if inverse { -1f32 } else { 1f32 };
    let (x1, x2) = x[..2 * half].split_at_mut(half);
    for i in 0..half {
        (x1[i], x2[i]) = rotated(x1[i], x2[i], cos[i], sign * sin[i]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Inference on the CPU in f32 rotates through `CpuRope`; its values must be Candle's
    /// fused kernel's to the bit, for whole and partial rotation, from a strided view as
    /// attention hands it over (`[b, t, h, d]` transposed), at positions that differ by row.
    #[test]
    fn cpu_rotation_is_candles_fused_kernel_to_the_bit() -> Result<()> {
        let dev = Device::Cpu;
        let (b, h, t, d) = (2, 3, 5, 16);
        let xs = Tensor::randn(0f32, 1.0, (b, t, h, d), &dev)?.transpose(1, 2)?;
        let pos = Tensor::from_vec(vec![0u32, 1, 2, 3, 4, 7, 8, 9, 10, 11], (b, t), &dev)?;
        for rotary_dim in [None, Some(10)] {
            let cfg = RopeConfig {
                rotary_dim,
                ..RopeConfig::default()
            };
            let rope = Rope::new(&cfg, d)?;
            let tables = rope.tables(&pos)?;
            let ours = rope.apply(&xs, &tables)?;
            let rot = rotary_dim.unwrap_or(d);
            let candle = candle_nn::rotary_emb::rope(
                &xs.narrow(D::Minus1, 0, rot)?.contiguous()?,
                &tables.cos,
                &tables.sin,
            )?;
            let candle = match rot < d {
                true => Tensor::cat(&[&candle, &xs.narrow(D::Minus1, rot, d - rot)?], D::Minus1)?,
                false => candle,
            };
            let (ours, candle) = (
                ours.flatten_all()?.to_vec1::<f32>()?,
                candle.flatten_all()?.to_vec1::<f32>()?,
            );
            assert_eq!(ours.len(), b * h * t * d);
            for (i, (a, c)) in ours.iter().zip(&candle).enumerate() {
                assert_eq!(
                    a.to_bits(),
                    c.to_bits(),
                    "element {i}, rotary_dim {rotary_dim:?}"
                );
            }
        }
        Ok(())
    }
}
