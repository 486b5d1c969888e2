//! What mixes information across positions in a block: attention (every family), or
//! LFM2's gated short convolution.

use candle_core::{Result, Tensor};
use mha::{ForwardArgs, KvCache, MultiHeadAttention, Rope, RopeTables};

use super::short_conv::ShortConv;

/// A block's token mixer.
// One per block, held in place: the attention's size costs nothing a box would save.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum Mixer {
    /// Multi-head attention.
    Attention(MultiHeadAttention),
    /// LFM2's gated short convolution.
    ShortConv(ShortConv),
}

impl From<MultiHeadAttention> for Mixer {
    fn from(attn: MultiHeadAttention) -> Self {
        Self::Attention(attn)
    }
}

impl From<ShortConv> for Mixer {
    fn from(conv: ShortConv) -> Self {
        Self::ShortConv(conv)
    }
}

impl Mixer {
    /// The attention, for an attention block.
    pub fn attention(&self) -> Option<&MultiHeadAttention> {
        match self {
            Self::Attention(a) => Some(a),
            Self::ShortConv(_) => None,
        }
    }

    /// The short convolution, for a convolution block.
    pub fn short_conv(&self) -> Option<&ShortConv> {
        match self {
            Self::ShortConv(c) => Some(c),
            Self::Attention(_) => None,
        }
    }

    /// The rotation the block applies to queries and keys, if any.
    pub fn rope(&self) -> Option<&Rope> {
        self.attention().and_then(MultiHeadAttention::rope)
    }

    /// `[b, t, d]` to `[b, t, d]` (and the attention weights when `args.need_weights`).
    pub(crate) fn forward(
        &self,
        xs: &Tensor,
        args: ForwardArgs,
    ) -> Result<(Tensor, Option<Tensor>)> {
        match self {
            Self::Attention(a) => {
                let (ys, w) = a.forward_with(xs, xs, xs, args)?;
                Ok((ys, w.map(|w| w.per_head)))
            }
            Self::ShortConv(c) => {
                if args.need_weights {
                    candle_core::bail!("a short-convolution block has no attention weights")
                }
                Ok((c.forward(xs, Some(&args.mask), args.cache)?, None))
            }
        }
    }

    /// Rows that are separate sequences, each with its own cache.
    pub(crate) fn forward_rows(
        &self,
        xs: &Tensor,
        rope: Option<&RopeTables>,
        caches: &mut [&mut KvCache],
    ) -> Result<Tensor> {
        match self {
            Self::Attention(a) => a.forward_rows(xs, rope, caches),
            Self::ShortConv(c) => c.forward_rows(xs, caches),
        }
    }

    /// The mixer with its projections quantized to `dtype`.
    pub fn quantize(&self, dtype: candle_core::quantized::GgmlDType) -> Result<Self> {
        Ok(match self {
            Self::Attention(a) => Self::Attention(a.quantize(dtype)?),
            Self::ShortConv(c) => Self::ShortConv(c.quantize(dtype)?),
        })
    }

    /// The mixer with what can share a matrix fused, for inference.
    pub fn fused(&self) -> Result<Self> {
        Ok(match self {
            Self::Attention(a) => Self::Attention(a.fused()?),
            Self::ShortConv(c) => Self::ShortConv(c.clone()),
        })
    }
}
