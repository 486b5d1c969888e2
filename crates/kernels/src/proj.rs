//! `Proj`: the linear layer behind every matrix of a model, `xs · w_t + b`, over a dense
//! weight (f32, f16 or bf16, read as stored), Candle's block-quantized matrices, or a matrix
//! repacked once for this CPU's kernels ([`crate::quant::Packed`]). It picks the product for
//! the number of rows: the few-row kernels of [`crate::dense`] and [`crate::quant`] when
//! decoding, a GEMM (with the output's activation fused) for a prefill.

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{bail, DType, Module, Result, Tensor, D};

use crate::dense::OutputAct;
use crate::quant::Packed;

/// A linear map `xs · w_t + b`, with `w_t` `[in, out]` (often a transposed view), or its
/// quantized form.
#[derive(Debug, Clone)]
pub struct Proj {
    w: Weight,
    b: Option<Tensor>,
}

#[derive(Debug, Clone)]
enum Weight {
    /// `[in, out]`.
    Dense(Tensor),
    /// Candle's block-quantized matrix, stored `[out, in]`; `cols` narrows the output
    /// (a view into a fused projection, sharing its storage).
    Quantized {
        w: QMatMul,
        d_in: usize,
        d_out: usize,
        cols: Option<(usize, usize)>,
    },
    /// A q8_0 or q4_0 matrix `[out, in]` repacked for this CPU's kernels, the only copy
    /// of the weight (`cols` as above).
    Packed {
        w: Arc<Packed>,
        cols: Option<(usize, usize)>,
    },
}

impl Proj {
    /// From an `[in, out]` matrix and an optional `[out]` bias.
    pub fn new(w_t: Tensor, b: Option<Tensor>) -> Self {
        Self {
            w: Weight::Dense(w_t),
            b,
        }
    }

    /// From a PyTorch `nn.Linear` weight `[out, in]`.
    pub fn from_linear(w: &Tensor, b: Option<Tensor>) -> Result<Self> {
        Ok(Self::new(w.t()?, b))
    }

    /// From a GGML matrix `[out, in]` (how GGUF files store every weight). Block formats
    /// (Q8_0, Q4_K, ...) stay quantized; f32, f16 and bf16 become a dense weight in `dtype`.
    pub fn from_qtensor(w: Arc<QTensor>, b: Option<Tensor>, dtype: DType) -> Result<Self> {
        let (d_out, d_in) = w.shape().dims2()?;
        if let Some(b) = &b {
            if b.dims() != [d_out] {
                bail!(
                    "a bias of shape {:?} for a projection with {d_out} outputs",
                    b.dims()
                )
            }
        }
        if matches!(w.dtype(), GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16) {
            let dense = w.dequantize(&w.device())?.to_dtype(dtype)?;
            return Self::from_linear(&dense, b);
        }
        if let Some(packed) = Packed::new(&w)? {
            return Ok(Self::from_packed(Arc::new(packed), b));
        }
        Ok(Self {
            w: Weight::Quantized {
                w: QMatMul::QTensor(w),
                d_in,
                d_out,
                cols: None,
            },
            b,
        })
    }

    /// From a repacked q8_0 or q4_0 matrix `[out, in]` (shared, e.g. with a tied
    /// embedding) and an optional `[out]` bias.
    pub fn from_packed(w: Arc<Packed>, b: Option<Tensor>) -> Self {
        Self {
            w: Weight::Packed { w, cols: None },
            b,
        }
    }

    /// The repacked matrix `[out, in]`, when this projection is one whole.
    pub fn packed(&self) -> Option<&Arc<Packed>> {
        match &self.w {
            Weight::Packed { w, cols: None } => Some(w),
            _ => None,
        }
    }

    /// The `[in, out]` weight (dequantized to f32 when the projection is quantized).
    pub fn weight_t(&self) -> Result<Tensor> {
        match &self.w {
            Weight::Dense(w_t) => Ok(w_t.clone()),
            Weight::Quantized { w, cols, .. } => {
                let full = match w {
                    QMatMul::QTensor(q) => q.dequantize(&q.device())?,
                    QMatMul::Tensor(t) => t.clone(),
                    QMatMul::TensorF16(t) => t.to_dtype(DType::F32)?,
                };
                let full = full.t()?;
                match cols {
                    Some((start, len)) => full.narrow(1, *start, *len),
                    None => Ok(full),
                }
            }
            Weight::Packed { w, cols } => {
                let (n, k) = w.dims();
                let full = Tensor::from_vec(w.dequantize()?, (n, k), &candle_core::Device::Cpu)?;
                let full = full.t()?;
                match cols {
                    Some((start, len)) => full.narrow(1, *start, *len),
                    None => Ok(full),
                }
            }
        }
    }

    /// The weight's stored format: a dtype (`f32`, `f16`, `bf16`) or a GGUF block type by
    /// llama.cpp's name (`q4_K`, `q8_0`).
    pub fn format_name(&self) -> &'static str {
        match &self.w {
            Weight::Dense(w_t) => w_t.dtype().as_str(),
            Weight::Quantized { w, .. } => match w {
                QMatMul::QTensor(q) => crate::quant::type_name(q.dtype()),
                QMatMul::Tensor(t) => t.dtype().as_str(),
                QMatMul::TensorF16(_) => "f16",
            },
            Weight::Packed { w, .. } => crate::quant::type_name(w.dtype()),
        }
    }

    /// `(in, out)`.
    pub fn dims(&self) -> Result<(usize, usize)> {
        match &self.w {
            Weight::Dense(w_t) => w_t.dims2(),
            Weight::Quantized {
                d_in,
                cols: Some((_, len)),
                ..
            } => Ok((*d_in, *len)),
            Weight::Quantized { d_in, d_out, .. } => Ok((*d_in, *d_out)),
            Weight::Packed { w, cols } => {
                let (n, k) = w.dims();
                Ok((k, cols.map_or(n, |(_, len)| len)))
            }
        }
    }

    /// The `[out]` bias.
    pub fn bias(&self) -> Option<&Tensor> {
        self.b.as_ref()
    }

    /// Whether the weight is block-quantized.
    pub fn is_quantized(&self) -> bool {
        matches!(self.w, Weight::Quantized { .. } | Weight::Packed { .. })
    }

    /// The format a matrix with rows of `d_in` takes when quantized to `dtype`: `dtype`
    /// where the rows are whole blocks of it, a k-quant's fallback where they are whole
    /// blocks of 32 (llama.cpp's quantizer's choices: q4_K → q5_0, q5_K → q5_1, q6_K →
    /// q8_0), otherwise none.
    pub fn quantized_as(dtype: GgmlDType, d_in: usize) -> Option<GgmlDType> {
        if d_in.is_multiple_of(dtype.block_size()) {
            return Some(dtype);
        }
        let fallback = match dtype {
            GgmlDType::Q4K => GgmlDType::Q5_0,
            GgmlDType::Q5K => GgmlDType::Q5_1,
            GgmlDType::Q6K => GgmlDType::Q8_0,
            _ => return None,
        };
        d_in.is_multiple_of(fallback.block_size())
            .then_some(fallback)
    }

    /// The weight quantized to `dtype` (e.g. [`GgmlDType::Q8_0`]): the quantized kernels
    /// then read 8.5 bits per weight (q8_0) instead of 32. The input width must be a
    /// multiple of the format's block size, except that a k-quant falls back as llama.cpp's
    /// quantizer does (q4_K to q5_0, q5_K to q5_1, q6_K to q8_0: SmolLM's width of 576 is
    /// not a multiple of 256); the bias stays as it is.
    pub fn quantize(&self, dtype: GgmlDType) -> Result<Self> {
        let Weight::Dense(w_t) = &self.w else {
            bail!("the projection is already quantized")
        };
        let (d_in, d_out) = w_t.dims2()?;
        let Some(dtype) = Self::quantized_as(dtype, d_in) else {
            bail!(
                "cannot quantize a projection with input width {d_in} to {dtype:?}: it must be a multiple of {}",
                dtype.block_size()
            )
        };
        let w = w_t.t()?.to_dtype(DType::F32)?.contiguous()?;
        let q = QTensor::quantize(&w, dtype)?;
        if let Some(packed) = Packed::new(&q)? {
            return Ok(Self::from_packed(Arc::new(packed), self.b.clone()));
        }
        Ok(Self {
            w: Weight::Quantized {
                w: QMatMul::from_qtensor(q)?,
                d_in,
                d_out,
                cols: None,
            },
            b: self.b.clone(),
        })
    }

    /// As [`Self::quantize`], but a dense weight whose input width is not a multiple of the
    /// format's block size stays as it is (llama.cpp's quantizer falls back likewise), so a
    /// whole model quantizes even when one width, say an MLP of 48, does not divide.
    pub fn quantize_or_keep(&self, dtype: GgmlDType) -> Result<Self> {
        match &self.w {
            Weight::Dense(w_t) if Self::quantized_as(dtype, w_t.dim(0)?).is_none() => {
                Ok(self.clone())
            }
            _ => self.quantize(dtype),
        }
    }

    /// The projection with a whole packed matrix moved beside the model's other settled
    /// matrices ([`Packed::settled`]), for inference once the model's matrices are final;
    /// anything else as it is.
    pub fn settled(&self) -> Self {
        match &self.w {
            Weight::Packed { w, cols: None } => match w.settled() {
                Some(w) => Self::from_packed(Arc::new(w), self.b.clone()),
                None => self.clone(),
            },
            _ => self.clone(),
        }
    }

    /// Output columns `start..start + len` of this projection, sharing its storage.
    pub fn narrow(&self, start: usize, len: usize) -> Result<Self> {
        let b = match &self.b {
            Some(b) => Some(b.narrow(0, start, len)?),
            None => None,
        };
        let w = match &self.w {
            Weight::Dense(w_t) => Weight::Dense(w_t.narrow(1, start, len)?),
            Weight::Quantized {
                w,
                d_in,
                d_out,
                cols,
            } => {
                let (base, width) = cols.unwrap_or((0, *d_out));
                if start + len > width {
                    bail!(
                        "narrow {start}..{} of a projection with {width} outputs",
                        start + len
                    )
                }
                Weight::Quantized {
                    w: w.clone(),
                    d_in: *d_in,
                    d_out: *d_out,
                    cols: Some((base + start, len)),
                }
            }
            Weight::Packed { w, cols } => {
                let (base, width) = cols.unwrap_or((0, w.dims().0));
                if start + len > width {
                    bail!(
                        "narrow {start}..{} of a projection with {width} outputs",
                        start + len
                    )
                }
                Weight::Packed {
                    w: w.clone(),
                    cols: Some((base + start, len)),
                }
            }
        };
        Ok(Self { w, b })
    }

    /// One dense projection that computes `parts` side by side, differentiable: its weight
    /// is Candle's concatenation of the parts' (a copy per call, of the weights' size), so
    /// gradients reach each part's variables. For training through a fused kernel
    /// (`mha`'s `flash_attn_cpu_train_qkv`). `None` unless every part is dense
    /// with the same input width, dtype and device, and all or none have biases.
    pub fn concat_differentiable(parts: &[&Proj]) -> Result<Option<Proj>> {
        let Some(first) = parts.first() else {
            return Ok(None);
        };
        let Weight::Dense(w0) = &first.w else {
            return Ok(None);
        };
        let (mut ws, mut bs) = (Vec::new(), Vec::new());
        for p in parts {
            match &p.w {
                Weight::Dense(w)
                    if w.dim(0)? == w0.dim(0)?
                        && w.dtype() == w0.dtype()
                        && w.device().same_device(w0.device())
                        && p.b.is_some() == first.b.is_some() =>
                {
                    // [in, out] -> [out, in]: rows are outputs, concatenated along dim 0.
                    ws.push(w.t()?);
                    bs.extend(p.b.clone());
                }
                _ => return Ok(None),
            }
        }
        let b = match bs.is_empty() {
            true => None,
            false => Some(Tensor::cat(&bs, 0)?),
        };
        Ok(Some(Proj::new(Tensor::cat(&ws, 0)?.t()?, b)))
    }

    /// One projection that computes `parts` side by side (their outputs concatenated in
    /// order), for inference: one product where there were several (a Llama layer's q, k
    /// and v, its gate and up), so decoding hands one product to the threads instead of
    /// three and a prefill multiplies one wider matrix. The weight is a new matrix; the
    /// parts keep theirs. `None` when the parts cannot share a matrix: different input
    /// widths, dtypes, devices or kinds, biases on some only, narrowed views of quantized
    /// matrices, quantized matrices that are not packed, or packed ones whose row tiles
    /// would not line up (a part other than the last with rows not a multiple of 16).
    pub fn concat(parts: &[&Proj]) -> Result<Option<Proj>> {
        let Some(first) = parts.first() else {
            return Ok(None);
        };
        let d_in = first.dims()?.0;
        for p in parts {
            if p.dims()?.0 != d_in || p.b.is_some() != first.b.is_some() {
                return Ok(None);
            }
        }
        let b = match &first.b {
            Some(b0) => {
                let bs: Vec<Tensor> = parts.iter().filter_map(|p| p.b.clone()).collect();
                if bs
                    .iter()
                    .any(|b| b.dtype() != b0.dtype() || !b.device().same_device(b0.device()))
                {
                    return Ok(None);
                }
                Some(Tensor::cat(&bs, 0)?)
            }
            None => None,
        };
        let w = match &first.w {
            Weight::Dense(w0) => {
                let mut ws = Vec::with_capacity(parts.len());
                for p in parts {
                    match &p.w {
                        Weight::Dense(w)
                            if w.dtype() == w0.dtype() && w.device().same_device(w0.device()) =>
                        {
                            ws.push(w.clone())
                        }
                        _ => return Ok(None),
                    }
                }
                Weight::Dense(cat_columns(&ws)?)
            }
            Weight::Packed { .. } => {
                let mut ws = Vec::with_capacity(parts.len());
                for p in parts {
                    match &p.w {
                        Weight::Packed { w, cols: None } => ws.push(w.as_ref()),
                        _ => return Ok(None),
                    }
                }
                match Packed::concat(&ws) {
                    Some(w) => Weight::Packed {
                        w: Arc::new(w),
                        cols: None,
                    },
                    None => return Ok(None),
                }
            }
            Weight::Quantized { .. } => return Ok(None),
        };
        Ok(Some(Self { w, b }))
    }

    /// `act(self.forward(xs))`, `[.., in]` to `[.., out]` (`[.., out / 2]` for
    /// [`OutputAct::SwiGlu`], whose projection computes the gate's outputs, then the up
    /// projection's). A prefill through a dense weight on the CPU applies `act` as each
    /// task of the product writes its outputs ([`crate::dense::prefill_fused`]): no
    /// second tensor of the product's size and no second pass over it. Elsewhere the
    /// projection, then [`crate::act::gelu_tanh`] or [`crate::act::silu_mul`].
    pub fn forward_act(&self, xs: &Tensor, act: OutputAct) -> Result<Tensor> {
        let (d_in, d_out) = self.dims()?;
        if act == OutputAct::SwiGlu && d_out % 2 != 0 {
            bail!("a SwiGLU projection needs an even number of outputs (gate, up), got {d_out}")
        }
        if let (Weight::Dense(w_t), Some(&d)) = (&self.w, xs.dims().last()) {
            if d == d_in {
                let xs2 = xs.reshape((xs.elem_count() / d_in, d_in))?;
                if !crate::dense::preferred(&xs2, w_t) {
                    let fused = crate::dense::prefill_fused(&xs2, w_t, self.b.as_ref(), Some(act))?;
                    if let Some(ys) = fused {
                        return ys.reshape(out_dims(xs.dims(), ys.dim(1)?));
                    }
                }
            }
        }
        let ys = self.forward(xs)?;
        match act {
            OutputAct::GeluTanh => crate::act::gelu_tanh(&ys),
            OutputAct::SwiGlu => {
                let inner = d_out / 2;
                let (g, u) = (
                    ys.narrow(D::Minus1, 0, inner)?,
                    ys.narrow(D::Minus1, inner, inner)?,
                );
                crate::act::silu_mul(&g, &u)
            }
        }
    }

    /// `[.., in]` to `[.., out]`.
    pub fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let _timer = crate::profile::time(crate::profile::Part::Products);
        let (d_in, d_out) = self.dims()?;
        let dims = xs.dims();
        match dims.last() {
            Some(&d) if d == d_in => {}
            _ => bail!("projection expects inputs [.., {d_in}], got {dims:?}"),
        }
        let rows = xs.elem_count() / d_in;
        if let Weight::Packed { w, cols } = &self.w {
            // Every row count: decoding reads each tile once, a prefill reuses it from
            // L1 for four rows of `x` at a time.
            let (start, len) = cols.unwrap_or((0, w.dims().0));
            // `xs` read as it is (rows of `d_in`), and the product made in its
            // final shape: a decoding step's hundred products each made two tensors
            // fewer (views of one), with their shapes and strides.
            let mut ys =
                crate::dense::with_f32_values(xs, |x| w.matmul(x, rows, start..start + len))?;
            // The bias goes into the product's own buffer (the same sums as a
            // broadcast add, without a second `[rows, out]` tensor).
            if let Some(b) = &self.b {
                crate::dense::with_f32_values(b, |b| {
                    if b.len() != len {
                        bail!("a bias of {} for {len} outputs", b.len())
                    }
                    for row in ys.chunks_exact_mut(len) {
                        row.iter_mut().zip(b).for_each(|(y, b)| *y += b);
                    }
                    Ok(())
                })?;
            }
            return Tensor::from_vec(ys, out_dims(dims, d_out), xs.device())?.to_dtype(xs.dtype());
        }
        let xs2 = xs.reshape((rows, d_in))?;
        // One 2-D product over all rows: no per-batch broadcast of the weight.
        let ys = match &self.w {
            Weight::Dense(w_t) => {
                // Decoding: a few rows against the weight, bound by reading it once.
                if crate::dense::preferred(&xs2, w_t) {
                    if let Some(ys) = crate::dense::few_rows_matmul(&xs2, w_t, self.b.as_ref())? {
                        return ys.reshape(out_dims(dims, d_out));
                    }
                }
                // Training: product and bias in one op with a direct backward pass.
                let grad = xs2.track_op() || w_t.track_op();
                if let (Some(b), true) = (&self.b, grad) {
                    let f32_cpu =
                        |t: &Tensor| crate::cpu_kernels(t.device()) && t.dtype() == DType::F32;
                    if f32_cpu(&xs2) && f32_cpu(w_t) && f32_cpu(b) {
                        let ys = crate::ops::linear(&xs2, w_t, b)?;
                        return ys.reshape(out_dims(dims, d_out));
                    }
                }
                // A prefill with f32 activations (f32, f16 or bf16 weights), the bias
                // added by the product's tasks.
                if let Some(ys) = crate::dense::prefill_fused(&xs2, w_t, self.b.as_ref(), None)? {
                    return ys.reshape(out_dims(dims, d_out));
                }
                match w_t.dtype() == xs2.dtype() {
                    true => xs2.matmul(w_t)?,
                    false => xs2.matmul(&w_t.to_dtype(xs2.dtype())?)?,
                }
            }
            Weight::Quantized {
                w,
                cols,
                d_in,
                d_out,
            } => {
                let (start, len) = cols.unwrap_or((0, *d_out));
                let own = match w {
                    // Decoding and small batches of matrices that were not packed (a CPU
                    // without AVX2, or not x86): blocks read once from where they are stored
                    // (Candle's kernels would keep a repacked copy beside the file's).
                    QMatMul::QTensor(q) if rows < DENSE_ROWS => {
                        match crate::quant::stored::qmatmul(&xs2, q, start..start + len)? {
                            Some(ys) => Some(ys),
                            None => {
                                crate::quant::stored::kquant_matmul(&xs2, q, start..start + len)?
                            }
                        }
                    }
                    // A prefill where Candle has no repacked kernel: each GEMM task
                    // dequantizes its own span of the rows asked for, in cache, where the whole
                    // matrix dequantized first would go through memory. CPUs with AVX2 pack
                    // every format this reads (`quant::packed`) and never come here.
                    QMatMul::QTensor(q) if !candle_repacks(q, *d_in, *d_out) => {
                        crate::quant::stored::prefill_dequantized(&xs2, q, start..start + len)?
                    }
                    _ => None,
                };
                let ys = match own {
                    Some(ys) => ys,
                    None => {
                        let xs32 = xs2.to_dtype(DType::F32)?.contiguous()?;
                        let ys = match w {
                            QMatMul::QTensor(q)
                                if rows >= DENSE_ROWS && !candle_repacks(q, *d_in, *d_out) =>
                            {
                                // A format `prefill_dequantized` does not read: the
                                // whole matrix dequantized, [rows, in] x [in, out], by the
                                // prefill's per-thread GEMM tasks.
                                let w_t = q.dequantize(&q.device())?.t()?;
                                match crate::dense::prefill_matmul(&xs32, &w_t)? {
                                    Some(ys) => ys,
                                    None => xs32.matmul(&w_t)?,
                                }
                            }
                            _ => w.forward(&xs32)?,
                        };
                        // A view of a fused projection computes all of it (only
                        // cross-attention on a fused layout takes this path).
                        match cols {
                            Some(_) => ys.narrow(1, start, len)?,
                            None => ys,
                        }
                    }
                };
                ys.to_dtype(xs.dtype())?
            }
            Weight::Packed { .. } => unreachable!("taken above"),
        };
        let ys = match &self.b {
            Some(b) if b.dtype() != ys.dtype() => ys.broadcast_add(&b.to_dtype(ys.dtype())?)?,
            Some(b) => ys.broadcast_add(b)?,
            None => ys,
        };
        ys.reshape(out_dims(dims, d_out))
    }
}

/// From this many rows on (a prefill), a quantized matrix that Candle would multiply with
/// its generic kernel is dequantized and multiplied by the f32 GEMM instead, several times
/// faster (docs/PERFORMANCE.md, "Quantized products"). Decoding (a row or a few) keeps the
/// quantized kernels, which read 4x fewer bytes. 32 sits between decoding batches and
/// prefills; it was not tuned.
const DENSE_ROWS: usize = 32;

/// Whether Candle 0.11 multiplies `w` (`[out, in]`) with its repacked x86 kernels
/// (`quantized::repack_x86::select`: `in` a multiple of 256, `out` of 16, a CPU with AVX2
/// and FMA; Q4_K and Q6_K, and Q8_0 only with AVX-512 VNNI or AVX-VNNI), which beat the
/// f32 GEMM. Without them Candle's q8_0 product runs its generic kernel, slower than the
/// f32 GEMM on the dequantized weight. Only speed depends on this guess, never the result.
fn candle_repacks(w: &QTensor, d_in: usize, d_out: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        let avx2 = has!("avx2") && has!("fma");
        let vnni = (has!("avx512f") && has!("avx512vnni")) || (avx2 && has!("avxvnni"));
        let kernel = match w.dtype() {
            GgmlDType::Q4K | GgmlDType::Q6K => avx2,
            GgmlDType::Q8_0 => vnni,
            _ => false,
        };
        kernel
            && d_in.is_multiple_of(256)
            && d_out.is_multiple_of(16)
            && crate::cpu_kernels(&w.device())
    }
    // Elsewhere (not measured) Candle's own product stays, as before.
    #[cfg(not(target_arch = "x86_64"))]
    {
        matches!(w.dtype(), GgmlDType::Q4K | GgmlDType::Q6K | GgmlDType::Q8_0)
            && d_in.is_multiple_of(256)
            && d_out.is_multiple_of(16)
            && crate::cpu_kernels(w.device())
    }
}

/// `dims` with the last one replaced by `d_out`.
fn out_dims(dims: &[usize], d_out: usize) -> Vec<usize> {
    let mut out = dims.to_vec();
    if let Some(last) = out.last_mut() {
        *last = d_out;
    }
    out
}

/// `[in, out_i]` matrices side by side, `[in, Σ out_i]`. Weights seen transposed (an
/// `nn.Linear`'s `[out, in]`, the decoding kernels' favourite layout) stay so: their rows
/// are concatenated into a new `[Σ out_i, in]` matrix, on the CPU in a buffer on huge
/// pages as the loaders' (see [`crate::memory::weight_vec`]).
fn cat_columns(ws: &[Tensor]) -> Result<Tensor> {
    let transposed = ws.iter().all(|w| w.t().is_ok_and(|t| t.is_contiguous()));
    if !transposed {
        return Tensor::cat(ws, 1);
    }
    let rows: Vec<Tensor> = ws.iter().map(|w| w.t()).collect::<Result<_>>()?;
    let cpu = rows.iter().all(|r| crate::cpu_kernels(r.device()));
    let cat = match (cpu, rows[0].dtype()) {
        (true, DType::F32) => cat_rows_cpu::<f32>(&rows)?,
        (true, DType::F16) => cat_rows_cpu::<half::f16>(&rows)?,
        (true, DType::BF16) => cat_rows_cpu::<half::bf16>(&rows)?,
        _ => Tensor::cat(&rows, 0)?,
    };
    cat.t()
}

/// Contiguous CPU matrices `[n_i, k]` stacked, `[Σ n_i, k]`, in a weight buffer.
fn cat_rows_cpu<T: candle_core::WithDType>(rows: &[Tensor]) -> Result<Tensor> {
    let k = rows[0].dim(1)?;
    let total: usize = rows.iter().map(|r| r.elem_count()).sum();
    let mut out = crate::memory::weight_vec(total, T::zero());
    let mut at = 0;
    for r in rows {
        let n = r.elem_count();
        let (storage, layout) = r.storage_and_layout();
        let candle_core::Storage::Cpu(cpu) = &*storage else {
            bail!("cat_rows_cpu: a matrix not on the CPU")
        };
        let src = cpu.as_slice::<T>()?;
        let Some(src) = src.get(layout.start_offset()..layout.start_offset() + n) else {
            bail!("cat_rows_cpu: a matrix outside its storage")
        };
        out[at..at + n].copy_from_slice(src);
        at += n;
    }
    Tensor::from_vec(out, (total / k, k), rows[0].device())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// A k-quant whose super-blocks do not fit the rows takes llama.cpp's fallback (the same
    /// weights as quantizing to it directly); where neither fits, `quantize` refuses and
    /// `quantize_or_keep` keeps the dense weight.
    #[test]
    fn k_quants_fall_back_where_rows_are_not_whole_super_blocks() -> Result<()> {
        let dev = Device::Cpu;
        let xs = Tensor::randn(0f32, 1.0, (3, 192), &dev)?;
        let w = Tensor::randn(0f32, 1.0, (48, 192), &dev)?;
        let p = Proj::from_linear(&w, None)?;
        for (k, fallback) in [
            (GgmlDType::Q4K, GgmlDType::Q5_0),
            (GgmlDType::Q5K, GgmlDType::Q5_1),
            (GgmlDType::Q6K, GgmlDType::Q8_0),
        ] {
            let got = p.quantize(k)?.forward(&xs)?;
            let want = p.quantize(fallback)?.forward(&xs)?;
            let diff = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert_eq!(diff, 0.0, "{k:?}");
        }
        // Whole super-blocks keep the k-quant: different weights from the fallback's.
        let wide = Proj::from_linear(&Tensor::randn(0f32, 1.0, (48, 256), &dev)?, None)?;
        let xs = Tensor::randn(0f32, 1.0, (3, 256), &dev)?;
        let k = wide.quantize(GgmlDType::Q4K)?.forward(&xs)?;
        let q5 = wide.quantize(GgmlDType::Q5_0)?.forward(&xs)?;
        assert!((k - q5)?.abs()?.max_all()?.to_scalar::<f32>()? > 0.0);
        let narrow = Proj::from_linear(&Tensor::randn(0f32, 1.0, (8, 100), &dev)?, None)?;
        assert!(narrow.quantize(GgmlDType::Q4K).is_err());
        assert!(!narrow.quantize_or_keep(GgmlDType::Q4K)?.is_quantized());
        Ok(())
    }

    /// The stored-layout path ([`crate::quant::stored`]), which CPUs with AVX2 or AVX-512
    /// VNNI never take through `Proj::from_qtensor` (they pack): a whole projection and a
    /// narrowed view, against the product with the dequantized weight, within `x`'s 8-bit rounding.
    #[test]
    fn unpacked_quantized_projections_match_the_dequantized_product() -> Result<()> {
        let dev = Device::Cpu;
        for dtype in [GgmlDType::Q8_0, GgmlDType::Q4_0] {
            let w = Tensor::randn(0f32, 1.0, (40, 64), &dev)?;
            let q = Arc::new(QTensor::quantize(&w, dtype)?);
            let dense = q.dequantize(&dev)?;
            let b = Tensor::randn(0f32, 1.0, 40, &dev)?;
            let proj = Proj {
                w: Weight::Quantized {
                    w: QMatMul::QTensor(q),
                    d_in: 64,
                    d_out: 40,
                    cols: None,
                },
                b: Some(b.clone()),
            };
            let xs = Tensor::randn(0f32, 1.0, (3, 64), &dev)?;
            let want = xs.matmul(&dense.t()?)?.broadcast_add(&b)?;
            for (got, want) in [
                (proj.forward(&xs)?, want.clone()),
                (proj.narrow(8, 16)?.forward(&xs)?, want.narrow(1, 8, 16)?),
            ] {
                let err = (&got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
                let scale = want.abs()?.max_all()?.to_scalar::<f32>()?;
                assert!(
                    err <= 0.02 * scale,
                    "{dtype:?}: off by {err} (scale {scale})"
                );
                assert!(
                    err > 0.0,
                    "{dtype:?}: x was not quantized, so not this path"
                );
            }
        }
        Ok(())
    }

    /// A packed projection adds its bias into the product's buffer: the same sums as the
    /// packed product followed by a broadcast add, to the bit, for the whole projection
    /// and a narrowed view, f32 and f16 inputs and a bias in either precision.
    #[test]
    fn packed_projections_add_their_bias_exactly() -> Result<()> {
        let dev = Device::Cpu;
        for dtype in [GgmlDType::Q8_0, GgmlDType::Q4_0] {
            let w = Tensor::randn(0f32, 1.0, (40, 64), &dev)?;
            let q = QTensor::quantize(&w, dtype)?;
            let bytes = q.data()?;
            let mut at = 0;
            let packed = Packed::from_rows(dtype, 40, 64, |rows| {
                rows.copy_from_slice(&bytes[at..at + rows.len()]);
                at += rows.len();
                Ok(())
            })?
            .expect("q8_0 and q4_0 pack");
            let packed = Arc::new(packed);
            for b_dtype in [DType::F32, DType::F16] {
                let b = Tensor::randn(0f32, 1.0, 40, &dev)?.to_dtype(b_dtype)?;
                let proj = Proj::from_packed(packed.clone(), Some(b.clone()));
                let xs = Tensor::randn(0f32, 1.0, (2, 3, 64), &dev)?;
                let x = xs.flatten_all()?.to_vec1::<f32>()?;
                let b32 = b.to_dtype(DType::F32)?;
                for (start, len) in [(0, 40), (8, 16)] {
                    let ys = packed.matmul(&x, 6, start..start + len)?;
                    let want = Tensor::from_vec(ys, (6, len), &dev)?
                        .broadcast_add(&b32.narrow(0, start, len)?)?
                        .reshape((2, 3, len))?;
                    let got = match len {
                        40 => proj.forward(&xs)?,
                        _ => proj.narrow(start, len)?.forward(&xs)?,
                    };
                    assert_eq!(got.to_vec3::<f32>()?, want.to_vec3::<f32>()?);
                    let half = proj.forward(&xs.to_dtype(DType::F16)?)?;
                    assert_eq!(half.dtype(), DType::F16);
                }
            }
        }
        Ok(())
    }
}
