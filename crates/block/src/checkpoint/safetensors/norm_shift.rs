//! Gemma's RMSNorm weights as stored: `w` where the norm multiplies by `1 + w`
//! (transformers' `Gemma3RMSNorm`). The model multiplies by its weight, so `1` is added as
//! the norms are read, in f32 before any rounding to the load dtype, as llama.cpp's
//! converter adds it when it writes a GGUF file.

use candle_core::{DType, Device, Result, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;

use crate::config::GptConfig;

/// `inner`'s tensors, with `shift` added to every norm weight (a name ending in
/// `norm.weight`: the block norms, the q/k norms, the final norm).
struct NormShift<'a> {
    inner: Box<dyn SimpleBackend + 'a>,
    shift: f64,
}

/// Whether `name` is a norm's weight.
fn is_norm(name: &str) -> bool {
    name.ends_with("norm.weight")
}

impl NormShift<'_> {
    /// `t` (f32 for a norm) shifted when it is a norm's, in `dtype`.
    fn shifted(&self, name: &str, t: Tensor, dtype: DType) -> Result<Tensor> {
        match is_norm(name) {
            true => t.affine(1.0, self.shift)?.to_dtype(dtype),
            false => Ok(t),
        }
    }

    /// The dtype to read `name` in: f32 for a norm, so the shift is added before rounding.
    fn read_dtype(name: &str, dtype: DType) -> DType {
        match is_norm(name) {
            true => DType::F32,
            false => dtype,
        }
    }
}

impl SimpleBackend for NormShift<'_> {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> Result<Tensor> {
        let t = self
            .inner
            .get(s, name, h, Self::read_dtype(name, dtype), dev)?;
        self.shifted(name, t, dtype)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> Result<Tensor> {
        let t = self
            .inner
            .get_unchecked(name, Self::read_dtype(name, dtype), dev)?;
        self.shifted(name, t, dtype)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.inner.contains_tensor(name)
    }
}

/// `backend`, with the family's norm shift applied when it has one.
pub(super) fn for_family<'a>(
    cfg: &GptConfig,
    backend: Box<dyn SimpleBackend + 'a>,
) -> Box<dyn SimpleBackend + 'a> {
    match cfg.family.norm_weight_shift() {
        0.0 => backend,
        shift => Box::new(NormShift {
            inner: backend,
            shift,
        }),
    }
}
