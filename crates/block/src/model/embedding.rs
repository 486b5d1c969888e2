//! The token embedding: a dense table, a block-quantized one, one packed for this CPU, or a
//! half-precision one widened on lookup; a tied head shares it.

use std::sync::Arc;

use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Result, Tensor};
use gpt_kernels::quant::Packed;
use mha::Proj;

/// The token embedding `[vocab, d]`: a dense table, or a block-quantized one (a GGUF
/// file's, shared with a tied head) whose rows are dequantized as they are looked up, so
/// the model holds one quantized copy instead of a dense one beside it.
#[derive(Debug, Clone)]
pub enum Embedding {
    /// A dense table in the model's dtype.
    Dense(Tensor),
    /// A block-quantized table; looked-up rows come out in `dtype`.
    Quantized {
        /// `[vocab, d]`, rows of whole blocks.
        table: Arc<QTensor>,
        /// The dtype of the activations.
        dtype: DType,
        /// Where the table lives.
        device: Device,
    },
    /// A q8_0 or q4_0 table repacked for this CPU's kernels (shared with a tied head);
    /// looked-up rows come out in `dtype`.
    Packed {
        /// `[vocab, d]`.
        table: Arc<Packed>,
        /// The dtype of the activations.
        dtype: DType,
    },
    /// A half-precision table (f16 or bf16, shared with a tied head) whose looked-up rows
    /// are widened to `dtype`: a half-precision model running with f32 activations.
    Half {
        /// `[vocab, d]`.
        table: Tensor,
        /// The dtype of the activations.
        dtype: DType,
    },
}

impl Embedding {
    /// The dtype of the looked-up rows (the activations').
    pub fn dtype(&self) -> DType {
        match self {
            Self::Dense(t) => t.dtype(),
            Self::Quantized { dtype, .. }
            | Self::Packed { dtype, .. }
            | Self::Half { dtype, .. } => *dtype,
        }
    }

    /// The dtype the table is stored in (`None` when block-quantized).
    pub fn stored_dtype(&self) -> Option<DType> {
        match self {
            Self::Dense(t) | Self::Half { table: t, .. } => Some(t.dtype()),
            Self::Quantized { .. } | Self::Packed { .. } => None,
        }
    }

    /// `(vocab, d)`.
    pub fn dims(&self) -> Result<(usize, usize)> {
        match self {
            Self::Dense(t) | Self::Half { table: t, .. } => t.dims2(),
            Self::Quantized { table, .. } => table.shape().dims2(),
            Self::Packed { table, .. } => Ok(table.dims()),
        }
    }

    /// The table's stored format: a dtype or a GGUF block type by llama.cpp's name.
    pub fn format_name(&self) -> &'static str {
        match self {
            Self::Dense(t) | Self::Half { table: t, .. } => t.dtype().as_str(),
            Self::Quantized { table, .. } => gpt_kernels::quant::type_name(table.dtype()),
            Self::Packed { table, .. } => gpt_kernels::quant::type_name(table.dtype()),
        }
    }

    /// The whole table, dequantized if need be.
    pub fn to_dense(&self) -> Result<Tensor> {
        match self {
            Self::Dense(t) => Ok(t.clone()),
            Self::Quantized {
                table,
                dtype,
                device,
            } => table.dequantize(device)?.to_dtype(*dtype),
            Self::Packed { table, dtype } => {
                Tensor::from_vec(table.dequantize()?, table.dims(), &Device::Cpu)?.to_dtype(*dtype)
            }
            Self::Half { table, dtype } => table.to_dtype(*dtype),
        }
    }

    /// Rows `ids [b, t]` as `[b, t, d]` (the dense table's lookup keeps its gradient).
    pub(super) fn rows(&self, ids: &Tensor) -> Result<Tensor> {
        match self {
            Self::Dense(t) => t.embedding_rows(ids),
            Self::Quantized { table, dtype, .. } => table.embedding(ids)?.to_dtype(*dtype),
            Self::Packed { table, dtype } => {
                let d = table.dims().1;
                let mut shape = ids.dims().to_vec();
                shape.push(d);
                let ids = ids.flatten_all()?.to_dtype(DType::U32)?.to_vec1::<u32>()?;
                Tensor::from_vec(table.rows(&ids)?, shape, &Device::Cpu)?.to_dtype(*dtype)
            }
            Self::Half { table, dtype } => table.embedding_rows(ids)?.to_dtype(*dtype),
        }
    }
}

/// The token embedding of a tied model whose head was quantized and repacked: the head's
/// matrix, looked up row by row, so the model holds one copy of the table (the largest
/// tensor of a small model); otherwise `wte` as it is.
pub(super) fn shared_table(wte: Embedding, lm_head: &Proj, tied: bool) -> Embedding {
    match (tied, lm_head.packed()) {
        (true, Some(table)) => Embedding::Packed {
            table: table.clone(),
            dtype: wte.dtype(),
        },
        _ => wte,
    }
}

/// Row lookup that keeps the gradient of the table: `[v, d]` indexed by `[b, t]` ids.
pub(super) trait EmbeddingRows {
    fn embedding_rows(&self, ids: &Tensor) -> Result<Tensor>;
}

impl EmbeddingRows for Tensor {
    fn embedding_rows(&self, ids: &Tensor) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let d = self.dim(1)?;
        self.index_select(&ids.flatten_all()?, 0)?
            .reshape((b, t, d))
    }
}
