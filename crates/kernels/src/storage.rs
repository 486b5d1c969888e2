//! Reading Candle tensors on the CPU as slices, for the fused ops here and in `mha`.

use candle_core::{bail, CpuStorage, Layout, Result, Storage, Tensor};

/// The f32 values of a contiguous CPU tensor.
pub fn values<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((a, b))) => Ok(&v[a..b]),
        _ => bail!("{what}: expected a contiguous f32 CPU tensor"),
    }
}

/// `f` of the f32 values of a contiguous CPU tensor, read in place.
pub fn with_values<R>(t: &Tensor, what: &str, f: impl FnOnce(&[f32]) -> Result<R>) -> Result<R> {
    let (s, l) = t.storage_and_layout();
    match &*s {
        Storage::Cpu(s) => f(values(s, l, what)?),
        _ => bail!("{what}: expected a CPU tensor"),
    }
}

/// The CPU storage of a tensor.
pub fn cpu<'a>(s: &'a Storage, what: &str) -> Result<&'a CpuStorage> {
    match s {
        Storage::Cpu(s) => Ok(s),
        _ => bail!("{what}: expected a CPU tensor"),
    }
}
