//! The model's KV cache: one [`KvCache`] per block.

use candle_core::{bail, DType, Result, Tensor};
use mha::KvCache;

use crate::config::GptConfig;

/// One [`KvCache`] per block, owned by the caller.
#[derive(Debug, Clone)]
pub struct GptCache {
    pub(super) layers: Vec<KvCache>,
}

impl GptCache {
    /// An empty cache for `cfg`'s blocks, pre-allocated for `capacity` positions.
    pub fn new(cfg: &GptConfig, capacity: usize) -> Self {
        Self::with_dtype(cfg, capacity, None)
    }

    /// As [`GptCache::new`], keys and values stored as `dtype` (`None`: the activations'),
    /// e.g. f16 beside f32 activations: half the memory ([`KvCache::with_dtype`]).
    pub fn with_dtype(cfg: &GptConfig, capacity: usize, dtype: Option<DType>) -> Self {
        Self {
            layers: (0..cfg.n_layer)
                .map(|_| KvCache::with_dtype(capacity, dtype))
                .collect(),
        }
    }

    /// The dtype keys and values are stored in, when fixed.
    pub fn dtype(&self) -> Option<DType> {
        self.layers.first().and_then(KvCache::dtype)
    }

    /// Number of cached positions.
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, KvCache::len)
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forgets the cached positions and keeps the storage.
    pub fn reset(&mut self) {
        self.layers.iter_mut().for_each(KvCache::reset)
    }

    /// Forgets every position from `len` on, in every layer ([`KvCache::truncate`]): a
    /// decoding step that failed part way, some layers written and some not, is undone by
    /// truncating to the length before it.
    pub fn truncate(&mut self, len: usize) {
        self.layers.iter_mut().for_each(|l| l.truncate(len))
    }

    /// Positions `start..start + n` of a one-row cache, every layer's keys and values
    /// (`[1, h, n, d]` each) copied into storage of their own: a span that outlives the
    /// cache and holds no more memory than it shows ([`GptCache::extend`] puts it back).
    pub fn span(&self, start: usize, n: usize) -> Result<Vec<(Tensor, Tensor)>> {
        let len = self.len();
        if n == 0 || start + n > len {
            bail!("span: positions {start}..{} of a cache of {len}", start + n)
        }
        self.layers
            .iter()
            .enumerate()
            .map(|(l, layer)| {
                let Some((k, v)) = layer.current()? else {
                    bail!("span: layer {l} of the cache is empty")
                };
                if k.dim(0)? != 1 {
                    bail!("span: a cache of {} rows, not one", k.dim(0)?)
                }
                let take = |t: &Tensor| t.narrow(2, start, n)?.force_contiguous();
                Ok((take(&k)?, take(&v)?))
            })
            .collect()
    }

    /// Appends a span made by [`GptCache::span`] (of a cache for the same model) after the
    /// cached positions: the cache then holds what running those positions would have put
    /// there.
    pub fn extend(&mut self, span: &[(Tensor, Tensor)]) -> Result<()> {
        if span.len() != self.layers.len() {
            bail!(
                "extend: a span of {} layers for a cache of {}",
                span.len(),
                self.layers.len()
            )
        }
        let n = span.first().map_or(Ok(0), |(k, _)| k.dim(2))?;
        if span.iter().any(|(k, _)| k.dim(2).ok() != Some(n)) {
            bail!("extend: the span's layers hold different numbers of positions")
        }
        let len = self.len();
        let failed = self
            .layers
            .iter_mut()
            .zip(span)
            .enumerate()
            .find_map(|(l, (layer, (k, v)))| layer.append(k, v).err().map(|e| (l, e)));
        if let Some((l, e)) = failed {
            // Leave every layer as long as the others.
            self.truncate(len);
            bail!("extend: layer {l}: {e}")
        }
        Ok(())
    }

    /// The cache of a left-padded batch split into one cache per row, each holding only its
    /// row's real positions: row `i`'s last `lens[i]` positions. After a prefill with
    /// [`Gpt::infer`](crate::Gpt::infer) and a `keep` mask (positions then count real tokens only), row `i`'s
    /// cache is the one its prompt would have made alone. Each new cache has room for
    /// `capacity[i]` positions before it grows.
    pub fn split_left_padded(&self, lens: &[usize], capacity: &[usize]) -> Result<Vec<GptCache>> {
        let len = self.len();
        if lens.len() != capacity.len() || lens.iter().any(|&l| l == 0 || l > len) {
            bail!("split: row lengths {lens:?} do not fit a cache of {len} positions")
        }
        let mut rows: Vec<GptCache> = capacity
            .iter()
            .map(|&c| GptCache {
                layers: (0..self.layers.len())
                    .map(|_| KvCache::with_dtype(c, self.dtype()))
                    .collect(),
            })
            .collect();
        for (l, layer) in self.layers.iter().enumerate() {
            let Some((k, v)) = layer.current()? else {
                bail!("split: layer {l} of the cache is empty")
            };
            // (b, h_kv, len, d)
            if k.dim(0)? != lens.len() {
                bail!(
                    "split: {} row lengths for a batch of {}",
                    lens.len(),
                    k.dim(0)?
                )
            }
            for (i, (&n, row)) in lens.iter().zip(&mut rows).enumerate() {
                let take = |t: &Tensor| t.narrow(0, i, 1)?.narrow(2, len - n, n);
                row.layers[l].append(&take(&k)?, &take(&v)?)?;
            }
        }
        Ok(rows)
    }
}
