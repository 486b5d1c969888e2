//! What a checkpoint's weights are loaded as, and for what.

use candle_core::quantized::GgmlDType;
use candle_core::DType;

/// How [`crate::load`] (and each format's loader) reads the weights. A plain [`DType`]
/// converts into it: everything in that dtype, as stored otherwise.
///
/// ```
/// use candle_core::{quantized::GgmlDType, DType};
/// use gpt_blocks::LoadOptions;
///
/// let opts = LoadOptions::new(DType::F32).quantized(GgmlDType::Q8_0).for_inference();
/// assert!(opts.fused && opts.quantize == Some(GgmlDType::Q8_0));
/// assert_eq!(LoadOptions::from(DType::F16), LoadOptions::new(DType::F16));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadOptions {
    /// The dtype of the embeddings, norms and biases, and of the matrix products when not
    /// quantized. A GGUF file's block-quantized matrices stay as stored; on the CPU under
    /// f32, so do its f16 and bf16 ones (widened as the products read them).
    pub dtype: DType,
    /// Quantize the matrix products' weights while loading (each block as it is read, so
    /// the full-precision blocks are never all in memory). A model whose matrices are
    /// stored quantized (a GGUF file's) keeps them as they are.
    pub quantize: Option<GgmlDType>,
    /// For inference: each block's q/k/v projections, and its gate and up projections,
    /// computed as one product each ([`crate::Gpt::fused`]), made as the blocks are read
    /// (on the CPU the float block matrices are read side by side into one buffer, the
    /// fused ones views of it). The logits equal the unfused model's up to the summation
    /// order of the products. Off, the model keeps the checkpoint's tensors as they are
    /// named (what showing, saving or training a model wants).
    pub fused: bool,
}

impl LoadOptions {
    /// Everything in `dtype`, unquantized, unfused.
    pub fn new(dtype: DType) -> Self {
        Self {
            dtype,
            quantize: None,
            fused: false,
        }
    }

    /// The matrix products' weights quantized to `q` while loading.
    pub fn quantized(self, q: GgmlDType) -> Self {
        Self {
            quantize: Some(q),
            ..self
        }
    }

    /// Loaded for inference ([`Self::fused`]).
    pub fn for_inference(self) -> Self {
        Self {
            fused: true,
            ..self
        }
    }
}

impl From<DType> for LoadOptions {
    fn from(dtype: DType) -> Self {
        Self::new(dtype)
    }
}
