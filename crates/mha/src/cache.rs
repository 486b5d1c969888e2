//! A pre-allocated key/value cache for incremental decoding.

use candle_core::{bail, DType, Device, Result, Tensor};

/// Keys and values of the tokens seen so far, `[batch, n_kv_heads, len, head_dim]` each.
///
/// Storage is allocated once for `capacity` positions on the first append and written in
/// place, so a decode step copies only the new token's keys and values. Past `capacity` it
/// doubles. The cache belongs to the caller and is passed in `&mut`, so one attention
/// module can serve many sequences at once.
///
/// [`KvCache::with_dtype`] stores keys and values in another dtype than the model computes
/// in: f16 or bf16 beside f32 activations halve the cache, and the fused CPU kernel widens
/// them block by block as it reads them (llama.cpp's default cache is f16 likewise).
#[derive(Debug, Clone)]
pub struct KvCache {
    k: Option<Tensor>,
    v: Option<Tensor>,
    len: usize,
    capacity: usize,
    dtype: Option<DType>,
}

impl KvCache {
    /// An empty cache that will hold `capacity` positions before it has to grow.
    pub fn new(capacity: usize) -> Self {
        Self {
            k: None,
            v: None,
            len: 0,
            capacity: capacity.max(1),
            dtype: None,
        }
    }

    /// As [`KvCache::new`], storing keys and values as `dtype` (`None`: as they come).
    pub fn with_dtype(capacity: usize, dtype: Option<DType>) -> Self {
        Self {
            dtype,
            ..Self::new(capacity)
        }
    }

    /// The dtype keys and values are stored in, when it is fixed.
    pub fn dtype(&self) -> Option<DType> {
        self.dtype
    }

    /// Number of cached positions: the causal offset of the next query.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forgets every cached position; the storage is kept for the next sequence.
    pub fn reset(&mut self) {
        self.len = 0;
    }

    /// Forgets every position from `len` on (nothing when `len` is not below the cached
    /// length). A step that failed part way, or a speculated continuation, is undone so:
    /// positions are written in place after the cached ones, so those before `len` are
    /// untouched by anything appended since.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Cached keys and values, `[batch, n_kv_heads, len, head_dim]`, or `None` when empty.
    pub fn current(&self) -> Result<Option<(Tensor, Tensor)>> {
        match (&self.k, &self.v) {
            (Some(k), Some(v)) if self.len > 0 => {
                Ok(Some((k.narrow(2, 0, self.len)?, v.narrow(2, 0, self.len)?)))
            }
            _ => Ok(None),
        }
    }

    /// Appends `k` and `v` (`[batch, n_kv_heads, new, head_dim]`) and returns every cached
    /// position, the new ones included (in the cache's dtype).
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let (k, v) = match self.dtype {
            Some(dtype) => (&to_dtype(k, dtype)?, &to_dtype(v, dtype)?),
            None => (k, v),
        };
        let (b, h, new, d) = k.dims4()?;
        if v.dims4()? != (b, h, new, d) {
            bail!(
                "cache: keys {:?} and values {:?} must have the same shape",
                k.dims(),
                v.dims()
            )
        }
        if new == 0 {
            self.check((b, h, d), k.dtype(), k.device())?;
            // Nothing to write; and Candle's copy of an empty view at an offset (the keys of
            // a fused projection of zero positions) indexes past its storage.
            return match self.current()? {
                Some(kv) => Ok(kv),
                None => Ok((k.clone(), v.clone())),
            };
        }
        let (ck, cv) = self.reserve((b, h, new, d), k.dtype(), k.device())?;
        ck.slice_set(&k.contiguous()?, 2, self.len)?;
        cv.slice_set(&v.contiguous()?, 2, self.len)?;
        self.advance(new)
    }

    /// Fails unless the cache is empty or holds rows `[b, h, _, d]` of `dtype` on `dev`.
    fn check(&self, (b, h, d): (usize, usize, usize), dtype: DType, dev: &Device) -> Result<()> {
        if self.len > 0
            && !(holds(&self.k, (b, h, d), dtype, dev) && holds(&self.v, (b, h, d), dtype, dev))
        {
            bail!(
                "cache holds keys of another shape, dtype or device than [{b}, {h}, _, {d}] {dtype:?}; reset it first"
            )
        }
        Ok(())
    }

    /// The whole storage, `[b, h, allocated, d]` keys and values of `dtype` on `dev`, with
    /// room for `new` positions after the cached ones (allocated, or grown by doubling, as
    /// needed): where a step writes its keys and values in place before
    /// [`Self::advance`] counts them.
    pub(crate) fn reserve(
        &mut self,
        (b, h, new, d): (usize, usize, usize, usize),
        dtype: DType,
        dev: &Device,
    ) -> Result<(Tensor, Tensor)> {
        self.check((b, h, d), dtype, dev)?;
        let needed = self.len + new;
        let allocated = self.k.as_ref().map_or(0, |t| t.dim(2).unwrap_or(0));
        let fits = holds(&self.k, (b, h, d), dtype, dev) && holds(&self.v, (b, h, d), dtype, dev);
        if !fits || needed > allocated {
            let mut cap = self.capacity.max(allocated);
            while cap < needed {
                cap *= 2;
            }
            let shape = (b, h, cap, d);
            self.k = Some(grow(self.k.as_ref(), self.len, shape, dtype, dev)?);
            self.v = Some(grow(self.v.as_ref(), self.len, shape, dtype, dev)?);
        }
        match (&self.k, &self.v) {
            (Some(k), Some(v)) => Ok((k.clone(), v.clone())),
            _ => bail!("cache storage missing after allocation"),
        }
    }

    /// Counts `new` positions written after the cached ones (within what
    /// [`Self::reserve`] made room for) and returns every cached position.
    pub(crate) fn advance(&mut self, new: usize) -> Result<(Tensor, Tensor)> {
        let allocated = self.k.as_ref().map_or(0, |t| t.dim(2).unwrap_or(0));
        if self.len + new > allocated {
            bail!("cache: {new} positions written past its {allocated} reserved")
        }
        self.len += new;
        match self.current()? {
            Some(kv) => Ok(kv),
            None => bail!("cache: nothing cached after a step of {new} positions"),
        }
    }
}

/// Whether `t` is storage of `[b, h, _, d]` rows of `dtype` on `dev`.
fn holds(t: &Option<Tensor>, (b, h, d): (usize, usize, usize), dtype: DType, dev: &Device) -> bool {
    match t {
        Some(t) => {
            let (tb, th, _, td) = t.dims4().unwrap_or_default();
            (tb, th, td) == (b, h, d) && t.dtype() == dtype && t.device().same_device(dev)
        }
        None => false,
    }
}

/// `t` in `dtype`: f32 keys and values on the CPU narrowed to f16 four lanes at a time
/// (`half`'s slice conversion, F16C where the CPU has it; the same rounding), where
/// Candle's `to_dtype` converts a strided view one element at a time.
fn to_dtype(t: &Tensor, dtype: DType) -> Result<Tensor> {
    if dtype != DType::F16 || t.dtype() != DType::F32 || !gpt_kernels::cpu_kernels(t.device()) {
        return t.to_dtype(dtype);
    }
    gpt_kernels::dense::with_f32_values(t, |x| {
        let mut h = vec![half::f16::ZERO; x.len()];
        half::slice::HalfFloatSliceExt::convert_from_f32_slice(h.as_mut_slice(), x);
        Tensor::from_vec(h, t.shape(), t.device())
    })
}

/// New storage of `shape` holding the first `len` positions of `old`.
fn grow(
    old: Option<&Tensor>,
    len: usize,
    shape: (usize, usize, usize, usize),
    dtype: DType,
    dev: &Device,
) -> Result<Tensor> {
    let fresh = Tensor::zeros(shape, dtype, dev)?;
    if let (Some(old), true) = (old, len > 0) {
        fresh.slice_set(&old.narrow(2, 0, len)?.contiguous()?, 2, 0)?;
    }
    Ok(fresh)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_cache_stores_what_candle_would() -> Result<()> {
        // Keys as the attention hands them over: a strided view, heads before positions.
        let x = Tensor::randn(0f32, 3.0, (2, 5, 3, 8), &Device::Cpu)?.transpose(1, 2)?;
        let mut cache = KvCache::with_dtype(4, Some(DType::F16));
        let (k, _) = cache.append(&x, &(&x * 2.0)?)?;
        let want = x.to_dtype(DType::F16)?;
        assert_eq!(k.dtype(), DType::F16);
        let bits = |t: &Tensor| -> Result<Vec<u16>> {
            let v = t.flatten_all()?.to_vec1::<half::f16>()?;
            Ok(v.iter().map(|h| h.to_bits()).collect())
        };
        assert_eq!(bits(&k)?, bits(&want)?);
        Ok(())
    }
}
