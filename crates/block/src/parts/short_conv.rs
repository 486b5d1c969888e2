//! LFM2's gated short convolution, the token mixer of its non-attention blocks:
//! `out_proj(C · conv(B · x))`, where `in_proj` makes `B`, `C` and `x` (`[b, t, d]` each)
//! and `conv` is a causal depthwise convolution over the last `L` positions
//! (`conv_L_cache`): `y[t, c] = Σ_j w[c, j] · h[t - (L - 1) + j, c] (+ bias[c])`, with
//! `h = B · x` and zeros before the first position.
//!
//! Its decoding state is the last `L - 1` inputs `h`. They are kept in the layer's
//! [`KvCache`] beside nothing else, its two halves of `h` stored as the "keys" and
//! "values" (`[b, 1, len, d / 2]` each): the cache grows, truncates, splits by row and
//! holds its dtype as the attention layers' do, one position per token.

use candle_core::{bail, DType, Result, Tensor, D};
use candle_nn::{Init, VarBuilder};
use mha::{KvCache, Mask, Proj};

use super::mlp::linear;

/// The short-convolution mixer of one block.
#[derive(Debug, Clone)]
pub struct ShortConv {
    /// `[d, 3d]`: `B`, `C`, `x`, in that order.
    in_proj: Proj,
    /// The taps, `[d, L]` (Hugging Face's `conv.weight` is `[d, 1, L]`).
    taps: Tensor,
    bias: Option<Tensor>,
    out_proj: Proj,
}

impl ShortConv {
    /// Loads (or creates) `in_proj`, `conv` and `out_proj` of width `d` with `taps`
    /// (`L`) per channel, with biases when `bias`.
    pub fn new(d: usize, taps: usize, bias: bool, vb: VarBuilder) -> Result<Self> {
        if taps == 0 || !d.is_multiple_of(2) {
            bail!("short convolution: {taps} taps over width {d}: the taps must be positive and the width even")
        }
        let bound = 1.0 / (taps as f64).sqrt();
        let init = Init::Uniform {
            lo: -bound,
            up: bound,
        };
        let conv = vb.pp("conv");
        let w = conv.get_with_hints((d, 1, taps), "weight", init)?;
        let b = match bias {
            true => Some(conv.get_with_hints(d, "bias", Init::Const(0.0))?),
            false => None,
        };
        Self::from_parts(
            linear(d, 3 * d, bias, vb.pp("in_proj"))?,
            w.reshape((d, taps))?,
            b,
            linear(d, d, bias, vb.pp("out_proj"))?,
        )
    }

    /// From parts loaded elsewhere: `in_proj` `d → 3d`, `taps [d, L]`, `bias [d]`,
    /// `out_proj` `d → d`.
    pub fn from_parts(
        in_proj: Proj,
        taps: Tensor,
        bias: Option<Tensor>,
        out_proj: Proj,
    ) -> Result<Self> {
        let (d, l) = taps.dims2()?;
        let w = in_proj.weight_t()?;
        if w.dims() != [d, 3 * d] || out_proj.weight_t()?.dims() != [d, d] || l == 0 {
            bail!(
                "short convolution: in_proj {:?}, taps {:?}, out_proj {:?} do not fit a width {d}",
                w.dims(),
                taps.dims(),
                out_proj.weight_t()?.dims()
            )
        }
        if bias.as_ref().is_some_and(|b| b.dims() != [d]) {
            bail!("short convolution: the bias must be [{d}]")
        }
        Ok(Self {
            in_proj,
            taps,
            bias,
            out_proj,
        })
    }

    /// Number of taps, `L`.
    pub fn taps(&self) -> usize {
        self.taps.dim(1).unwrap_or(0)
    }

    /// `(in_proj, taps [d, L], bias, out_proj)`, for saving and inspection.
    pub fn parts(&self) -> (&Proj, &Tensor, Option<&Tensor>, &Proj) {
        (
            &self.in_proj,
            &self.taps,
            self.bias.as_ref(),
            &self.out_proj,
        )
    }

    /// The mixer with its projections quantized to `dtype`.
    pub fn quantize(&self, dtype: candle_core::quantized::GgmlDType) -> Result<Self> {
        Ok(Self {
            in_proj: self.in_proj.quantize_or_keep(dtype)?,
            out_proj: self.out_proj.quantize_or_keep(dtype)?,
            ..self.clone()
        })
    }

    /// `h = B · x` and `C` of `xs` (`[b, t, d]` each), `h` zero at the padding of `mask`.
    fn gates(&self, xs: &Tensor, mask: Option<&Mask>) -> Result<(Tensor, Tensor)> {
        let d = xs.dim(D::Minus1)?;
        let bcx = self.in_proj.forward(xs)?;
        let (b, c, x) = (
            bcx.narrow(D::Minus1, 0, d)?,
            bcx.narrow(D::Minus1, d, d)?,
            bcx.narrow(D::Minus1, 2 * d, d)?,
        );
        let mut h = (b * x)?;
        if let Some(keep) = mask.and_then(|m| keep_of(m, &h)) {
            h = h.broadcast_mul(&keep?.to_dtype(h.dtype())?.unsqueeze(2)?)?;
        }
        Ok((h, c))
    }

    /// `C · conv(h)` through `out_proj`, where `past [b, L - 1, d]` holds the inputs
    /// before `h`'s first position (zeros before a sequence's start).
    fn mix(&self, h: &Tensor, c: &Tensor, past: &Tensor) -> Result<Tensor> {
        let (_, t, _) = h.dims3()?;
        let full = Tensor::cat(&[past, h], 1)?;
        let taps = self.taps.to_dtype(h.dtype())?;
        let mut y: Option<Tensor> = None;
        for j in 0..self.taps() {
            let w = taps.narrow(1, j, 1)?.squeeze(1)?;
            let term = full.narrow(1, j, t)?.broadcast_mul(&w)?;
            y = Some(match y {
                None => term,
                Some(y) => (y + term)?,
            });
        }
        let mut y = match y {
            Some(y) => y,
            None => bail!("short convolution without taps"),
        };
        if let Some(b) = &self.bias {
            y = y.broadcast_add(&b.to_dtype(y.dtype())?)?;
        }
        self.out_proj.forward(&(c * y)?)
    }

    /// `[b, t, d]` to `[b, t, d]`. With a cache, `h` is appended to it and the positions
    /// before `xs` come from it; `mask`'s key padding (Hugging Face's `attention_mask`)
    /// zeroes `h` at padded positions, so a left-padded row equals the row alone.
    pub fn forward(
        &self,
        xs: &Tensor,
        mask: Option<&Mask>,
        cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        let (b, _, d) = xs.dims3()?;
        let (h, c) = self.gates(xs, mask)?;
        let past = match cache {
            Some(cache) => {
                let past = self.past(cache, b, d, h.dtype())?;
                store(cache, &h)?;
                past
            }
            None => Tensor::zeros((b, self.taps() - 1, d), h.dtype(), h.device())?,
        };
        self.mix(&h, &c, &past)
    }

    /// Rows that are separate sequences, each with its own cache: `[rows, t, d]` to
    /// `[rows, t, d]`, each row equal to that sequence run alone.
    pub fn forward_rows(&self, xs: &Tensor, caches: &mut [&mut KvCache]) -> Result<Tensor> {
        let (rows, _, d) = xs.dims3()?;
        if caches.len() != rows {
            bail!("{} caches for {rows} rows", caches.len())
        }
        let (h, c) = self.gates(xs, None)?;
        let mut pasts = Vec::with_capacity(rows);
        for (i, cache) in caches.iter_mut().enumerate() {
            pasts.push(self.past(cache, 1, d, h.dtype())?);
            store(cache, &h.narrow(0, i, 1)?)?;
        }
        self.mix(&h, &c, &Tensor::cat(&pasts, 0)?)
    }

    /// The last `L - 1` inputs in `cache` (`[b, L - 1, d]`, zeros before the start).
    fn past(&self, cache: &KvCache, b: usize, d: usize, dtype: DType) -> Result<Tensor> {
        let want = self.taps() - 1;
        let dev = self.taps.device();
        let have = match cache.current()? {
            Some((lo, hi)) => {
                let n = lo.dim(2)?.min(want);
                let from = lo.dim(2)? - n;
                // [b, 1, n, d/2] twice -> [b, n, d]
                let h = Tensor::cat(&[lo.narrow(2, from, n)?, hi.narrow(2, from, n)?], 3)?;
                Some(h.squeeze(1)?.to_dtype(dtype)?)
            }
            None => None,
        };
        match have {
            Some(h) if h.dims() != [b, h.dim(1)?, d] => {
                bail!(
                    "the convolution cache holds {:?}, not rows [{b}, _, {d}]",
                    h.dims()
                )
            }
            Some(h) if h.dim(1)? == want => Ok(h),
            Some(h) => {
                let zeros = Tensor::zeros((b, want - h.dim(1)?, d), dtype, dev)?;
                Tensor::cat(&[&zeros, &h], 1)
            }
            None => Tensor::zeros((b, want, d), dtype, dev),
        }
    }
}

/// Appends `h` (`[b, t, d]`) to the cache as its halves `[b, 1, t, d / 2]`.
fn store(cache: &mut KvCache, h: &Tensor) -> Result<()> {
    let d = h.dim(2)?;
    let h = h.unsqueeze(1)?;
    let (lo, hi) = (h.narrow(3, 0, d / 2)?, h.narrow(3, d / 2, d / 2)?);
    cache.append(&lo, &hi)?;
    Ok(())
}

/// The keep flags of `xs`'s positions (`[b, t]`, 1 for a real token) from `mask`'s key
/// padding over the cached and new positions, `None` without padding.
fn keep_of(mask: &Mask, xs: &Tensor) -> Option<Result<Tensor>> {
    let flags = |m: &Tensor, keep: bool| -> Result<Tensor> {
        let (b, t, _) = xs.dims3()?;
        let n = m.dim(1)?;
        if m.dim(0)? != b || n < t {
            bail!("key padding {:?} for {b} rows of {t} positions", m.dims())
        }
        let zero = Tensor::zeros((), m.dtype(), m.device())?.broadcast_as(m.shape())?;
        let real = match keep {
            true => m.ne(&zero)?,
            false => m.eq(&zero)?,
        };
        real.narrow(1, n - t, t)?.to_dtype(DType::F32)
    };
    match mask.key_padding? {
        mha::KeyPadding::Keep(m) => Some(flags(m, true)),
        mha::KeyPadding::Ignore(m) => Some(flags(m, false)),
    }
}
