//! Attention masks whose meaning is written in their type.
//!
//! Candle's models disagree on what a `1` in a `u8` mask means; here no bare tensor is a
//! mask. Causal masking is an offset, key padding says whether its ones keep or ignore,
//! and an additive mask is added to the scores. The three combine.

use candle_core::{bail, DType, Device, Result, Tensor};

/// Which keys of each batch row are padding.
#[derive(Debug, Clone, Copy)]
pub enum KeyPadding<'a> {
    /// `[batch, kv_len]`, non-zero where the key is a real token that may be attended
    /// (the polarity of Hugging Face's `attention_mask`).
    Keep(&'a Tensor),
    /// `[batch, kv_len]`, non-zero where the key is padding to be ignored
    /// (the polarity of PyTorch's `key_padding_mask`).
    Ignore(&'a Tensor),
}

/// Everything that hides keys from queries.
///
/// A query row whose keys are all hidden attends to nothing: its output is zero, not NaN.
///
/// ```
/// use mha::Mask;
/// let prefill = Mask::causal(0);
/// let decode_step = Mask::causal(17); // 17 tokens already in the cache
/// assert_eq!(decode_step.causal, Some(17));
/// assert!(Mask::NONE.is_empty() && !prefill.is_empty());
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct Mask<'a> {
    /// `Some(offset)`: query `i` sits at absolute position `offset + i` and sees the keys
    /// `0..=offset + i`. With a KV cache, `offset` is the number of cached tokens.
    pub causal: Option<usize>,
    /// With `causal`: query `i` sees only the `window` most recent keys, itself included,
    /// i.e. the keys `offset + i + 1 - window ..= offset + i` (local / sliding-window
    /// attention). Ignored without `causal`.
    pub window: Option<usize>,
    /// Padding keys to hide, per batch row.
    pub key_padding: Option<KeyPadding<'a>>,
    /// Added to the scores before softmax (`-inf` hides a key); any float dtype. 2-D and 4-D
    /// shapes broadcast to `[batch, n_heads, q_len, kv_len]`; a 3-D one is PyTorch's
    /// `[batch·n_heads, q_len, kv_len]` (per head) or `[batch, q_len, kv_len]` (per batch
    /// row), as for [`Mask::disallowed`].
    pub additive: Option<&'a Tensor>,
    /// PyTorch's boolean `attn_mask`, in its polarity: non-zero where a query may NOT attend
    /// to a key (any integer dtype; save a `torch.bool` mask as `uint8`). Shapes:
    /// `[q_len, kv_len]` for every batch row and head; `[batch·n_heads, q_len, kv_len]`,
    /// PyTorch's per-head form (row `i·n_heads + j` is batch row `i`, head `j`); or
    /// `[batch, q_len, kv_len]`, one mask per batch row shared by its heads. A 3-D mask whose
    /// first dimension is `batch·n_heads` is read per head, else it must be `batch`: a
    /// first dimension equal to the head count alone is an error, never a silent broadcast.
    pub disallowed: Option<&'a Tensor>,
}

impl<'a> Mask<'a> {
    /// No masking at all.
    pub const NONE: Mask<'static> = Mask {
        causal: None,
        window: None,
        key_padding: None,
        additive: None,
        disallowed: None,
    };

    /// Causal masking for queries starting at absolute position `offset`.
    pub fn causal(offset: usize) -> Self {
        Mask {
            causal: Some(offset),
            ..Default::default()
        }
    }

    /// Limits causal attention to the `window` most recent keys.
    pub fn with_window(self, window: usize) -> Self {
        Mask {
            window: Some(window),
            ..self
        }
    }

    /// Adds key padding in Hugging Face polarity (non-zero = real token).
    pub fn with_keep(self, keep: &'a Tensor) -> Self {
        Mask {
            key_padding: Some(KeyPadding::Keep(keep)),
            ..self
        }
    }

    /// Adds key padding in PyTorch polarity (non-zero = padding).
    pub fn with_ignore(self, ignore: &'a Tensor) -> Self {
        Mask {
            key_padding: Some(KeyPadding::Ignore(ignore)),
            ..self
        }
    }

    /// Adds a float mask added to the scores.
    pub fn with_additive(self, additive: &'a Tensor) -> Self {
        Mask {
            additive: Some(additive),
            ..self
        }
    }

    /// Adds PyTorch's boolean `attn_mask`: non-zero where attending is NOT allowed (see
    /// [`Mask::disallowed`] for the shapes).
    ///
    /// ```
    /// use candle_core::{Device, Tensor};
    /// use mha::Mask;
    /// // torch.triu(torch.ones(3, 3, dtype=torch.bool), diagonal=1): the causal mask.
    /// let m = Tensor::new(&[[0u8, 1, 1], [0, 0, 1], [0, 0, 0]], &Device::Cpu)?;
    /// let bias = Mask::NONE.with_disallowed(&m).to_bias((1, 2, 3, 3), &Device::Cpu)?.unwrap();
    /// let causal = Mask::causal(0).to_bias((1, 2, 3, 3), &Device::Cpu)?.unwrap();
    /// let (a, b) = (bias.flatten_all()?.to_vec1::<f32>()?, causal.flatten_all()?.to_vec1::<f32>()?);
    /// assert_eq!(a, b);
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn with_disallowed(self, disallowed: &'a Tensor) -> Self {
        Mask {
            disallowed: Some(disallowed),
            ..self
        }
    }

    /// True when the mask hides nothing.
    pub fn is_empty(&self) -> bool {
        self.causal.is_none()
            && self.key_padding.is_none()
            && self.additive.is_none()
            && self.disallowed.is_none()
    }

    /// Whether only the fused kernel's masks are used (causal, window, key padding).
    pub fn is_structural(&self) -> bool {
        self.additive.is_none() && self.disallowed.is_none()
    }

    /// The key padding as a `u8` tensor `[batch, kv_len]` with 1 where the key is kept.
    pub fn keep_keys(&self, b_sz: usize, kv_len: usize, device: &Device) -> Result<Option<Tensor>> {
        let (t, keep_polarity) = match self.key_padding {
            None => return Ok(None),
            Some(KeyPadding::Keep(t)) => (t, true),
            Some(KeyPadding::Ignore(t)) => (t, false),
        };
        if t.dims() != [b_sz, kv_len] {
            bail!(
                "key padding mask must be [batch, kv_len] = [{b_sz}, {kv_len}], got {:?}",
                t.dims()
            )
        }
        let t = t.to_device(device)?;
        // `ne` on the dtype itself: works for u8, u32, i64 and floats alike.
        let zero = Tensor::zeros((), t.dtype(), device)?.broadcast_as(t.shape())?;
        let keep = if keep_polarity {
            t.ne(&zero)?
        } else {
            t.eq(&zero)?
        };
        Ok(Some(keep))
    }

    /// The whole mask as one f32 tensor to add to the scores, broadcastable to
    /// `[b_sz, n_heads, q_len, kv_len]`, with `-inf` where a key is hidden; `None` when the
    /// mask hides nothing (empty, or a causal mask every key of which is visible to every
    /// query: a decoding step's, within its window). This is the reference path: it
    /// materialises `q_len × kv_len`.
    pub fn to_bias(
        &self,
        (b_sz, n_heads, q_len, kv_len): (usize, usize, usize, usize),
        device: &Device,
    ) -> Result<Option<Tensor>> {
        let mut bias: Option<Tensor> = None;
        let mut add = |t: Tensor| -> Result<()> {
            bias = Some(match bias.take() {
                None => t,
                Some(b) => b.broadcast_add(&t)?,
            });
            Ok(())
        };
        if let Some(causal) = self.causal_bias(q_len, kv_len, device)? {
            add(causal)?;
        }
        if let Some(keep) = self.keep_keys(b_sz, kv_len, device)? {
            add(keep_to_bias(&keep)?.reshape((b_sz, 1, 1, kv_len))?)?;
        }
        if let Some(a) = self.additive {
            let full = (b_sz, n_heads, q_len, kv_len);
            // A 3-D mask is read as the boolean one is: per head when its first dimension
            // is batch·heads, else per batch row; never right-aligned onto the heads.
            let a = &match *a.dims() {
                [n, q, k] if (q, k) == (q_len, kv_len) && n == b_sz * n_heads => {
                    a.reshape(full)?
                }
                [n, q, k] if (q, k) == (q_len, kv_len) && n == b_sz => {
                    a.reshape((b_sz, 1, q, k))?
                }
                [_, _, _] => bail!(
                    "a 3-D additive mask must be [batch·n_heads, q_len, kv_len] = [{}, {q_len}, {kv_len}] or [batch, q_len, kv_len] = [{b_sz}, {q_len}, {kv_len}], got {:?}",
                    b_sz * n_heads,
                    a.dims()
                ),
                _ => a.clone(),
            };
            if a.rank() > 4 || a.broadcast_as(full).is_err() {
                bail!(
                    "additive mask of shape {:?} does not broadcast to [batch, heads, q_len, kv_len] = {full:?}",
                    a.dims()
                )
            }
            if !a.dtype().is_float() {
                bail!("additive mask must be a float tensor, got {:?}", a.dtype())
            }
            add(a.to_device(device)?.to_dtype(DType::F32)?)?;
        }
        if let Some(m) = self.disallowed {
            add(disallowed_to_bias(m, b_sz, n_heads, q_len, kv_len, device)?)?;
        }
        Ok(bias)
    }

    /// The causal mask's part of [`Self::to_bias`], `[q_len, kv_len]`; `None` without a
    /// causal mask or where it hides no key.
    fn causal_bias(&self, q_len: usize, kv_len: usize, device: &Device) -> Result<Option<Tensor>> {
        let Some(offset) = self.causal else {
            return Ok(None);
        };
        // (q_len, kv_len): key j is visible to query i iff j <= offset + i. Any offset
        // from kv_len on shows every key, so clamping it keeps the sums in range.
        let offset = offset.min(kv_len);
        if offset + q_len > u32::MAX as usize {
            bail!(
                "causal mask: positions beyond {} are not supported",
                u32::MAX
            )
        }
        if self.window == Some(0) {
            bail!("attention window must be at least 1")
        }
        // Query 0 sees every key once offset + 1 >= kv_len (the later ones too), and a
        // window of w hides a key from the last query, at offset + q_len - 1, iff
        // offset + q_len > w. A bias of zeros adds nothing: none is built (on a GPU, a
        // decoding step's mask took six kernels a layer to build and one to add).
        let hides = offset + 1 < kv_len || self.window.is_some_and(|w| offset + q_len > w);
        if !hides {
            return Ok(None);
        }
        let rows =
            Tensor::arange(offset as u32, (offset + q_len) as u32, device)?.reshape((q_len, 1))?;
        let cols = Tensor::arange(0u32, kv_len as u32, device)?.reshape((1, kv_len))?;
        let mut visible = cols.broadcast_le(&rows)?;
        if let Some(w) = self.window {
            // The oldest key each query still sees.
            let first: Vec<u32> = (offset..offset + q_len)
                .map(|p| (p + 1).saturating_sub(w) as u32)
                .collect();
            let first = Tensor::from_vec(first, (q_len, 1), device)?;
            visible = (visible * cols.broadcast_ge(&first)?)?;
        }
        keep_to_bias(&visible).map(Some)
    }
}

/// PyTorch's boolean `attn_mask` (non-zero = not allowed) as a bias broadcastable to
/// `[b_sz, n_heads, q_len, kv_len]`.
fn disallowed_to_bias(
    m: &Tensor,
    b_sz: usize,
    n_heads: usize,
    q_len: usize,
    kv_len: usize,
    device: &Device,
) -> Result<Tensor> {
    if m.dtype().is_float() {
        bail!("the disallowed (boolean) mask must be an integer tensor (save a torch.bool mask as uint8), got {:?}; a float mask goes in `additive`", m.dtype())
    }
    let shape = match *m.dims() {
        [q, k] if (q, k) == (q_len, kv_len) => (1, 1, q, k),
        [n, q, k] if (q, k) == (q_len, kv_len) && n == b_sz * n_heads => (b_sz, n_heads, q, k),
        [n, q, k] if (q, k) == (q_len, kv_len) && n == b_sz => (b_sz, 1, q, k),
        _ => bail!(
            "the disallowed mask must be [q_len, kv_len] = [{q_len}, {kv_len}], [batch·n_heads, q_len, kv_len] = [{}, {q_len}, {kv_len}] or [batch, q_len, kv_len] = [{b_sz}, {q_len}, {kv_len}], got {:?}",
            b_sz * n_heads,
            m.dims()
        ),
    };
    let m = m.to_device(device)?;
    let zero = Tensor::zeros((), m.dtype(), device)?.broadcast_as(m.shape())?;
    keep_to_bias(&m.eq(&zero)?)?.reshape(shape)
}

/// `u8` keep flags to an f32 bias: 0 where kept, `-inf` where hidden.
fn keep_to_bias(keep: &Tensor) -> Result<Tensor> {
    let zeros = Tensor::zeros(keep.shape(), DType::F32, keep.device())?;
    let neg_inf = Tensor::full(f32::NEG_INFINITY, keep.shape(), keep.device())?;
    keep.where_cond(&zeros, &neg_inf)
}
