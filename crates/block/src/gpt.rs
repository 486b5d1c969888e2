//! The model: embeddings, blocks, final norm, language-model head (tied or not). The
//! family only decides the parts and their names.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{bail, DType, Device, ModuleT, Result, Tensor, D};
use candle_nn::{Init, VarBuilder};
use gpt_kernels::quant::Packed;
use mha::{neox_to_fused, Dropout, KvCache, Mask, Proj, RopeTables};

use crate::family::TensorNames;
use crate::norm::at_least_f32;
use crate::{Block, Family, GptConfig, Norm, NormPlacement};

/// Which positions get logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Every position: `[b, t, vocab]`.
    All,
    /// Only the last position, `[b, 1, vocab]`: all that decoding needs, and the LM head
    /// is the largest matrix of a small model.
    Last,
}

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
    fn rows(&self, ids: &Tensor) -> Result<Tensor> {
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
/// matrix, looked up row by row, so the model holds one copy of the table (GPT-2's is 154
/// MB in f32 beside 41 MB in q8_0); otherwise `wte` as it is.
fn shared_table(wte: Embedding, lm_head: &Proj, tied: bool) -> Embedding {
    match (tied, lm_head.packed()) {
        (true, Some(table)) => Embedding::Packed {
            table: table.clone(),
            dtype: wte.dtype(),
        },
        _ => wte,
    }
}

/// One [`KvCache`] per block, owned by the caller.
#[derive(Debug, Clone)]
pub struct GptCache {
    layers: Vec<KvCache>,
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

    /// The cache of a left-padded batch split into one cache per row, each holding only its
    /// row's real positions: row `i`'s last `lens[i]` positions. After a prefill with
    /// [`Gpt::infer`] and a `keep` mask (positions then count real tokens only), row `i`'s
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

/// A decoder-only language model of any supported [`Family`].
///
/// Checkpoint names are Hugging Face's for the family: for GPT-2 `transformer.wte`,
/// `transformer.wpe`, `transformer.h.{i}`, `transformer.ln_f`, and `lm_head` when not tied;
/// for Llama `model.embed_tokens`, `model.layers.{i}`, `model.norm`, `lm_head`; and so on.
#[derive(Debug, Clone)]
pub struct Gpt {
    cfg: GptConfig,
    wte: Embedding,
    /// Learned positions; `None` when attention rotates q and k instead.
    wpe: Option<Tensor>,
    drop: Dropout,
    h: Vec<Block>,
    ln_f: Option<Norm>,
    lm_head: Proj,
    lm_head_weight: Option<Tensor>,
    /// The dtype of the caches [`Gpt::new_cache`] makes, when set ([`Gpt::kv_dtype`]).
    kv_dtype: Option<DType>,
}

impl Gpt {
    /// Builds the model from `vb` rooted at the checkpoint's top level (for GPT-2 the body
    /// is under `transformer.`). From a `VarMap` it creates GPT-2's initialisation.
    pub fn new(cfg: &GptConfig, vb: VarBuilder) -> Result<Self> {
        Self::build(cfg, vb, None)
    }

    /// As [`Gpt::new`], with every matrix product's weight quantized to `dtype` as soon as
    /// its block is read: the full-precision blocks are never all in memory at once, so
    /// loading peaks near the quantized model's size instead of the f32 model's.
    pub fn new_quantized(cfg: &GptConfig, vb: VarBuilder, dtype: GgmlDType) -> Result<Self> {
        Self::build(cfg, vb, Some(dtype))
    }

    pub(crate) fn build(
        cfg: &GptConfig,
        vb: VarBuilder,
        quantize: Option<GgmlDType>,
    ) -> Result<Self> {
        let block = |i, vb: VarBuilder| {
            let block = Block::new(cfg, i, vb)?;
            match quantize {
                Some(dtype) => block.quantize(dtype), // drops the f32 block
                None => Ok(block),
            }
        };
        Self::build_with(cfg, vb, quantize, block, |_| Ok(None))
    }

    /// [`Self::build`] with each block made by `block(index, its VarBuilder)`, quantized or
    /// not as it chooses (a loader's own, fusing projections as it reads them, say);
    /// `quantize` applies to the head, whose matrix `packed(name)` may give already
    /// quantized and packed (read from a file row by row, say; `None`: quantized here).
    pub(crate) fn build_with(
        cfg: &GptConfig,
        vb: VarBuilder,
        quantize: Option<GgmlDType>,
        block: impl Fn(usize, VarBuilder) -> Result<Block>,
        packed: impl Fn(&str) -> Result<Option<Arc<Packed>>>,
    ) -> Result<Self> {
        cfg.validate()?;
        let names = TensorNames::of(cfg.family);
        let (v, d) = (cfg.vocab_size, cfg.n_embd);
        let normal = |stdev| Init::Randn { mean: 0.0, stdev };
        let embed = format!("{}.weight", names.embed);
        let table = match (cfg.tie_word_embeddings, quantize) {
            (true, Some(_)) => packed(&embed)?,
            _ => None,
        };
        // A tied head is the table: quantized here, before the blocks are read, a packed
        // table replaces the f32 one (the load's largest tensor) while nothing else is in
        // memory beside it.
        let (wte, tied_head) = match table {
            Some(table) => {
                let head = Proj::from_packed(table.clone(), None);
                let dtype = vb.dtype();
                (Embedding::Packed { table, dtype }, Some(head))
            }
            None => {
                let wte = vb.get_with_hints((v, d), &embed, normal(0.02))?;
                let tied_head = match cfg.tie_word_embeddings {
                    true => {
                        let head = Proj::from_linear(&wte, None)?;
                        Some(match quantize {
                            Some(dtype) => head.quantize_or_keep(dtype)?,
                            None => head,
                        })
                    }
                    false => None,
                };
                let wte = match &tied_head {
                    Some(head) => shared_table(Embedding::Dense(wte), head, true),
                    None => Embedding::Dense(wte),
                };
                (wte, tied_head)
            }
        };
        let wpe = match cfg.rope {
            Some(_) => None,
            None => Some(vb.get_with_hints(
                (cfg.n_positions, d),
                &format!("{}.weight", names.positions),
                normal(0.01),
            )?),
        };
        let layers = vb.pp(names.layers);
        let h = (0..cfg.n_layer)
            .map(|i| block(i, layers.pp(i.to_string())))
            .collect::<Result<Vec<_>>>()?;
        let ln_f = match cfg.norm_placement {
            NormPlacement::Pre => Some(Norm::new(
                cfg.norm,
                d,
                cfg.layer_norm_epsilon,
                vb.pp(names.final_norm),
            )?),
            NormPlacement::Post => None,
        };
        let head = format!("{}.weight", names.head);
        let packed_head = match (tied_head.is_none(), quantize) {
            (true, Some(_)) => packed(&head)?,
            _ => None,
        };
        let (lm_head_weight, lm_head) = match (tied_head, packed_head) {
            (Some(head), _) => (None, head),
            (None, Some(table)) => (None, Proj::from_packed(table, None)),
            (None, None) => {
                let name = head;
                let w = vb.get_with_hints((v, d), &name, normal(0.02))?;
                let head = Proj::from_linear(&w, None)?;
                let head = match quantize {
                    Some(dtype) => head.quantize_or_keep(dtype)?,
                    None => head,
                };
                (Some(w), head)
            }
        };
        let mut model = Self::from_parts(cfg, wte, wpe, h, ln_f, lm_head)?;
        model.lm_head_weight = lm_head_weight;
        Ok(model)
    }

    /// The model from parts loaded elsewhere (a GGUF file's, say): the token embedding
    /// `wte [vocab, d]`, learned positions `wpe [n_positions, d]` when the config has no
    /// rotary positions, the blocks, the final norm (pre-norm models), and the head
    /// `[d] -> [vocab]` (for a tied model, a projection of `wte` or its quantized copy).
    pub fn from_parts(
        cfg: &GptConfig,
        wte: Embedding,
        wpe: Option<Tensor>,
        h: Vec<Block>,
        ln_f: Option<Norm>,
        lm_head: Proj,
    ) -> Result<Self> {
        cfg.validate()?;
        let (v, d) = (cfg.vocab_size, cfg.n_embd);
        if wte.dims()? != (v, d) {
            bail!(
                "token embedding {:?}, the config needs [{v}, {d}]",
                wte.dims()?
            )
        }
        match (&wpe, cfg.rope) {
            (None, Some(_)) => {}
            (Some(p), None) if p.dims() == [cfg.n_positions, d] => {}
            (p, _) => bail!(
                "position embedding {:?} for a model with {} positions",
                p.as_ref().map(|p| p.dims().to_vec()),
                if cfg.rope.is_some() {
                    "rotary"
                } else {
                    "learned"
                }
            ),
        }
        if h.len() != cfg.n_layer {
            bail!("{} blocks for n_layer = {}", h.len(), cfg.n_layer)
        }
        if ln_f.is_some() != (cfg.norm_placement == NormPlacement::Pre) {
            bail!("a final norm goes with pre-norm blocks, and only with them")
        }
        if lm_head.dims()? != (d, v) {
            bail!(
                "LM head (in, out) = {:?}, the config needs ({d}, {v})",
                lm_head.dims()?
            )
        }
        Ok(Self {
            cfg: cfg.clone(),
            wte,
            wpe,
            drop: Dropout::new(cfg.embd_pdrop, cfg.seed)?,
            h,
            ln_f,
            lm_head,
            lm_head_weight: None,
            kv_dtype: None,
        })
    }

    /// The model with every matrix product's weight quantized to `dtype` (e.g.
    /// `GgmlDType::Q8_0`) for inference. LayerNorms stay as they are; a tied head gets a
    /// quantized copy of the token embedding, which becomes the embedding too where the
    /// CPU's packed kernels take it (one copy), and stays beside the dense table elsewhere.
    pub fn quantize(&self, dtype: GgmlDType) -> Result<Self> {
        let lm_head = self.lm_head.quantize_or_keep(dtype)?;
        let tied = self.cfg.tie_word_embeddings;
        Ok(Self {
            h: self
                .h
                .iter()
                .map(|b| b.quantize(dtype))
                .collect::<Result<_>>()?,
            wte: shared_table(self.wte.clone(), &lm_head, tied),
            lm_head,
            ..self.clone()
        })
    }

    /// The model with its matrices as they are and everything else (norms, position table)
    /// in f32, computing in f32: a half-precision model as llama.cpp runs one on the CPU.
    /// The products widen f16/bf16 weights as they read them (`gpt_kernels::dense`), or widen
    /// slabs of a weight for the f32 GEMM when there are many rows; the token table stays
    /// half precision (shared with a tied head) and its rows are widened on lookup.
    /// Elementwise work in f32 instead of f16 is also what makes this fast: Candle's CPU
    /// kernels convert every f16 element to f32 and back. A model already in f32 is
    /// returned as it is.
    pub fn with_f32_activations(&self) -> Result<Self> {
        if self.dtype() == DType::F32 {
            return Ok(self.clone());
        }
        let wte = match &self.wte {
            Embedding::Dense(t) | Embedding::Half { table: t, .. } => Embedding::Half {
                table: t.clone(),
                dtype: DType::F32,
            },
            Embedding::Quantized { table, device, .. } => Embedding::Quantized {
                table: table.clone(),
                dtype: DType::F32,
                device: device.clone(),
            },
            Embedding::Packed { table, .. } => Embedding::Packed {
                table: table.clone(),
                dtype: DType::F32,
            },
        };
        Ok(Self {
            wte,
            wpe: self
                .wpe
                .as_ref()
                .map(|p| p.to_dtype(DType::F32))
                .transpose()?,
            h: self
                .h
                .iter()
                .map(|b| b.norms_to_dtype(DType::F32))
                .collect::<Result<_>>()?,
            ln_f: self
                .ln_f
                .as_ref()
                .map(|n| n.to_dtype(DType::F32))
                .transpose()?,
            ..self.clone()
        })
    }

    /// The model for inference with each block's q/k/v projections, and its gate and up
    /// projections, computed as one product each where they can share a matrix (new
    /// matrices; the parts become views into them): decoding hands the threads two
    /// products per block fewer (a Llama-style block: 4 instead of 7), a prefill
    /// multiplies wider matrices. Families stored fused (GPT-2, GPT-NeoX) and ungated
    /// MLPs are unchanged. Logits equal the unfused model's up to summation order. Takes
    /// the model so that each block's separate matrices are freed as soon as its fused
    /// ones exist: memory grows by one block's matrices at most, not the model's.
    pub fn fused(mut self) -> Result<Self> {
        let blocks = std::mem::take(&mut self.h);
        let mut h = Vec::with_capacity(blocks.len());
        for block in blocks {
            h.push(block.fused()?);
        }
        self.h = h;
        Ok(self)
    }

    /// The model whose caches ([`Gpt::new_cache`]) store keys and values as `dtype`
    /// (`None`: in the activations' dtype). f16 beside f32 activations halves the cache;
    /// the fused CPU attention kernel reads it directly.
    pub fn with_kv_dtype(&self, dtype: Option<DType>) -> Self {
        Self {
            kv_dtype: dtype,
            ..self.clone()
        }
    }

    /// The dtype [`Gpt::new_cache`]'s caches store keys and values in: as set by
    /// [`Gpt::with_kv_dtype`], else a half-precision table's own (a half-precision model
    /// keeps its cache in its precision, as llama.cpp does), else `None` (the activations').
    pub fn kv_dtype(&self) -> Option<DType> {
        self.kv_dtype.or(match &self.wte {
            Embedding::Half { table, .. } => Some(table.dtype()),
            _ => None,
        })
    }

    /// An empty cache for this model, pre-allocated for `capacity` positions, keys and
    /// values stored as [`Gpt::kv_dtype`] says.
    pub fn new_cache(&self, capacity: usize) -> GptCache {
        GptCache::with_dtype(&self.cfg, capacity, self.kv_dtype())
    }

    /// Whether any matrix product uses quantized weights.
    pub fn is_quantized(&self) -> bool {
        self.lm_head.is_quantized()
            || self.h.iter().any(|b| {
                let (_, attn, _, mlp) = b.parts();
                let [q, k, v] = attn.qkv_proj();
                [q, k, v, attn.out_proj()].iter().any(|p| p.is_quantized())
                    || mlp.projections().0.iter().any(|(_, p)| p.is_quantized())
            })
    }

    /// The configuration.
    pub fn config(&self) -> &GptConfig {
        &self.cfg
    }

    /// The blocks.
    pub fn blocks(&self) -> &[Block] {
        &self.h
    }

    /// Every dropout of the model in a fixed order (the embeddings', then each block's):
    /// what a training checkpoint records the draw counts of ([`Dropout::calls`]).
    pub fn dropouts(&self) -> Vec<&Dropout> {
        let blocks = self.h.iter().flat_map(|b| b.dropouts());
        std::iter::once(&self.drop).chain(blocks).collect()
    }

    /// Token embedding `[vocab, d]`.
    pub fn embedding(&self) -> &Embedding {
        &self.wte
    }

    /// Token embedding `[vocab, d]` as a dense tensor (dequantized when it is stored
    /// quantized).
    pub fn wte(&self) -> Result<Tensor> {
        self.wte.to_dense()
    }

    /// Learned position embedding `[n_positions, d]`; `None` for rotary models.
    pub fn wpe(&self) -> Option<&Tensor> {
        self.wpe.as_ref()
    }

    /// Final norm (pre-norm models).
    pub fn ln_f(&self) -> Option<&Norm> {
        self.ln_f.as_ref()
    }

    /// The rotary tables of positions `pos` (`[b, t]`), shared by every block; `None` for
    /// models with learned positions.
    pub fn rope_tables(&self, pos: &Tensor) -> Result<Option<RopeTables>> {
        match self.h.first().and_then(|b| b.parts().1.rope()) {
            Some(rope) => Ok(Some(rope.tables(pos)?)),
            None => Ok(None),
        }
    }

    /// Language-model head: `[.., d]` to `[.., vocab]`.
    pub fn lm_head(&self) -> &Proj {
        &self.lm_head
    }

    /// Dtype of the weights.
    pub fn dtype(&self) -> DType {
        self.wte.dtype()
    }

    /// Device of the weights.
    pub fn device(&self) -> &Device {
        match &self.wte {
            Embedding::Dense(t) | Embedding::Half { table: t, .. } => t.device(),
            Embedding::Quantized { device, .. } => device,
            Embedding::Packed { .. } => &Device::Cpu,
        }
    }

    /// Inference logits for `ids [b, t]`.
    ///
    /// - `keep`: `[b, past + t]`, 1 for real tokens and 0 for padding (Hugging Face's
    ///   `attention_mask`), covering the cached positions too. Positions then count only
    ///   real tokens, as Hugging Face does for GPT-2, so a left-padded row gives the logits
    ///   of its prompt run alone.
    /// - `cache`: keys and values of earlier positions; `ids` are appended to it.
    pub fn infer(
        &self,
        ids: &Tensor,
        keep: Option<&Tensor>,
        cache: Option<&mut GptCache>,
        logits: Logits,
    ) -> Result<Tensor> {
        Ok(self.run(ids, keep, cache, false, false, logits)?.0)
    }

    /// Logits `[b, t, vocab]` and the attention weights of every block,
    /// `n_layer × [b, n_head, t, t]`.
    pub fn forward_with_weights(&self, ids: &Tensor) -> Result<(Tensor, Vec<Tensor>)> {
        self.run(ids, None, None, false, true, Logits::All)
    }

    /// Mean cross-entropy of predicting `ids[:, 1:]` from `ids[:, :-1]`: the loss of
    /// Hugging Face's `GPT2LMHeadModel(input_ids, labels=input_ids)`.
    pub fn loss(&self, ids: &Tensor, train: bool) -> Result<Tensor> {
        let logits = self.forward_t(ids, train)?;
        next_token_loss(&logits, ids)
    }

    /// Checks `ids` and turns them into `u32`.
    fn check_ids(&self, ids: &Tensor, past: usize) -> Result<Tensor> {
        let (_, t) = match ids.dims() {
            &[b, t] if b > 0 && t > 0 => (b, t),
            dims => bail!("token ids must be [batch, seq] with both > 0, got {dims:?}"),
        };
        let ids = match ids.dtype() {
            DType::U32 => ids.clone(),
            DType::U8 | DType::I64 | DType::I32 | DType::I16 => {
                if ids.to_dtype(DType::I64)?.min_all()?.to_scalar::<i64>()? < 0 {
                    bail!("token ids must not be negative")
                }
                ids.to_dtype(DType::U32)?
            }
            dt => bail!("token ids must be integers, got {dt:?}"),
        };
        let max = ids.max_all()?.to_scalar::<u32>()?;
        if max as usize >= self.cfg.vocab_size {
            bail!(
                "token id {max} is outside the vocabulary (vocab_size = {})",
                self.cfg.vocab_size
            )
        }
        if past + t > self.cfg.n_positions {
            bail!(
                "{} tokens exceed the model's context of {} positions",
                past + t,
                self.cfg.n_positions
            )
        }
        Ok(ids)
    }

    /// Position ids `[b, t]` of the last `t` of `past + t` positions.
    fn positions(&self, b: usize, t: usize, past: usize, keep: Option<&Tensor>) -> Result<Tensor> {
        let dev = self.device();
        let Some(keep) = keep else {
            let pos = Tensor::arange(past as u32, (past + t) as u32, dev)?;
            return pos.unsqueeze(0)?.broadcast_as((b, t))?.contiguous();
        };
        if keep.dims() != [b, past + t] {
            bail!(
                "attention mask must be [batch, past + seq] = [{b}, {}], got {:?}",
                past + t,
                keep.dims()
            )
        }
        // Hugging Face: cumsum(mask) - 1, with padding positions clamped to 0.
        let zero = Tensor::zeros((), keep.dtype(), keep.device())?.broadcast_as(keep.shape())?;
        let rows = keep.ne(&zero)?.to_vec2::<u8>()?;
        let pos: Vec<u32> = rows
            .iter()
            .flat_map(|row| {
                let mut seen = 0u32;
                let all: Vec<u32> = row
                    .iter()
                    .map(|&k| {
                        seen += u32::from(k);
                        seen.saturating_sub(1)
                    })
                    .collect();
                all[past..].to_vec()
            })
            .collect();
        Tensor::from_vec(pos, (b, t), dev)
    }

    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        ids: &Tensor,
        keep: Option<&Tensor>,
        mut cache: Option<&mut GptCache>,
        train: bool,
        need_weights: bool,
        logits: Logits,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let past = cache.as_ref().map_or(0, |c| c.len());
        let ids = self.check_ids(ids, past)?;
        let (b, t) = ids.dims2()?;
        if let Some(c) = &cache {
            if c.layers.len() != self.h.len() {
                bail!(
                    "cache has {} layers, the model {}",
                    c.layers.len(),
                    self.h.len()
                )
            }
        }
        let pos = self.positions(b, t, past, keep)?;
        // (b, t, d)
        let mut xs = self.wte.rows(&ids)?;
        if let Some(wpe) = &self.wpe {
            xs = (xs + wpe.embedding_rows(&pos)?)?;
        }
        let rope = self.rope_tables(&pos)?;
        let mut xs = self.drop.forward(&xs, train)?;
        let mask = match keep {
            Some(k) => Mask::causal(past).with_keep(k),
            None => Mask::causal(past),
        };
        let mut weights = Vec::new();
        let mut stages = Stages::new(&xs, train);
        stages.push(|| "the embeddings".into(), &xs)?;
        for (i, block) in self.h.iter().enumerate() {
            xs = if need_weights {
                let (ys, w) = block.forward_with_weights(&xs, &mask, rope.as_ref(), train)?;
                weights.push(w);
                ys
            } else {
                let layer_cache = cache.as_mut().map(|c| &mut c.layers[i]);
                block.forward(&xs, &mask, rope.as_ref(), layer_cache, train)?
            };
            stages.push(|| format!("block {i}"), &xs)?;
        }
        Ok((self.head(xs, logits, &stages, train)?, weights))
    }

    /// Final norm and LM head on `xs [b, t, d]`; names the first stage whose output is not
    /// finite when the logits are not.
    fn head(&self, xs: Tensor, logits: Logits, stages: &Stages, train: bool) -> Result<Tensor> {
        let t = xs.dim(1)?;
        let mut xs = xs;
        if logits == Logits::Last {
            xs = xs.narrow(1, t - 1, 1)?;
        }
        if let Some(ln_f) = &self.ln_f {
            xs = ln_f.forward(&xs)?;
        }
        let logits = self.lm_head.forward(&xs)?;
        if !train && !all_finite(&logits)? {
            let culprit = stages
                .first_non_finite()?
                .unwrap_or_else(|| "the final norm or the LM head".into());
            bail!("non-finite values (NaN or Inf) first appear in the output of {culprit}; check the weights (gpt --check-weights)")
        }
        Ok(logits)
    }

    /// Inference logits for a batch whose rows are separate sequences, each with its own
    /// cache of any length: continuous batching, where sequences join and leave a running
    /// batch between steps. Every matrix product runs once for the whole batch; each row
    /// attends to its own cache. Row `i` equals `infer(ids[i], None, caches[i], logits)`.
    ///
    /// # Shapes
    /// - `ids`: `[rows, t]`, row `i` at positions `caches[i].len()..+t` (decoding: `t = 1`)
    /// - returns `[rows, t, vocab]`, or `[rows, 1, vocab]` with [`Logits::Last`]
    pub fn infer_rows(
        &self,
        ids: &Tensor,
        caches: &mut [&mut GptCache],
        logits: Logits,
    ) -> Result<Tensor> {
        let longest = caches.iter().map(|c| c.len()).max().unwrap_or(0);
        let ids = self.check_ids(ids, longest)?;
        let (rows, t) = ids.dims2()?;
        if caches.len() != rows {
            bail!(
                "{rows} rows of ids need as many caches, got {}",
                caches.len()
            )
        }
        if let Some(c) = caches.iter().find(|c| c.layers.len() != self.h.len()) {
            bail!(
                "cache has {} layers, the model {}",
                c.layers.len(),
                self.h.len()
            )
        }
        let pos: Vec<u32> = caches
            .iter()
            .flat_map(|c| (c.len()..c.len() + t).map(|p| p as u32))
            .collect();
        let pos = Tensor::from_vec(pos, (rows, t), self.device())?;
        // (rows, t, d)
        let mut xs = self.wte.rows(&ids)?;
        if let Some(wpe) = &self.wpe {
            xs = (xs + wpe.embedding_rows(&pos)?)?;
        }
        let rope = self.rope_tables(&pos)?;
        let mut stages = Stages::new(&xs, false);
        stages.push(|| "the embeddings".into(), &xs)?;
        for (i, block) in self.h.iter().enumerate() {
            let mut layer: Vec<&mut KvCache> =
                caches.iter_mut().map(|c| &mut c.layers[i]).collect();
            xs = block.forward_rows(&xs, rope.as_ref(), &mut layer)?;
            stages.push(|| format!("block {i}"), &xs)?;
        }
        self.head(xs, logits, &stages, false)
    }

    /// Checks every weight for NaN and Inf; the error names the first bad tensor.
    pub fn check_weights(&self) -> Result<()> {
        let mut named: Vec<_> = self.named_tensors()?.into_iter().collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, t) in named {
            if !all_finite(&t)? {
                bail!("weight {name} contains NaN or Inf values")
            }
        }
        Ok(())
    }

    /// Every weight under its Hugging Face name for the model's family (for GPT-2 the
    /// `transformer.` prefix, no `lm_head` when tied), as `save_pretrained` writes them.
    pub fn named_tensors(&self) -> Result<HashMap<String, Tensor>> {
        let names = TensorNames::of(self.cfg.family);
        let mut out = HashMap::new();
        let mut put = |name: String, t: &Tensor| {
            out.insert(name, t.clone());
        };
        // A half-precision table as it is stored; a block-quantized one dequantized.
        let wte = match &self.wte {
            Embedding::Half { table, .. } => table.clone(),
            other => other.to_dense()?,
        };
        put(format!("{}.weight", names.embed), &wte);
        if let Some(wpe) = &self.wpe {
            put(format!("{}.weight", names.positions), wpe);
        }
        // A projection as stored: Conv1D `[in, out]`, nn.Linear `[out, in]`.
        let proj = |put: &mut dyn FnMut(String, &Tensor),
                    name: String,
                    p: &Proj,
                    conv1d: bool|
         -> Result<()> {
            let w = p.weight_t()?;
            put(format!("{name}.weight"), &if conv1d { w } else { w.t()? });
            if let Some(b) = p.bias() {
                put(format!("{name}.bias"), b);
            }
            Ok(())
        };
        let norm = |put: &mut dyn FnMut(String, &Tensor), name: String, n: &Norm| {
            put(format!("{name}.weight"), n.weight());
            if let Some(b) = n.bias() {
                put(format!("{name}.bias"), b);
            }
        };
        for (i, block) in self.h.iter().enumerate() {
            let pre = format!("{}.{i}", names.layers);
            let (ln_1, attn, ln_2, mlp) = block.parts();
            norm(&mut put, format!("{pre}.{}", names.attn_norm), ln_1);
            norm(&mut put, format!("{pre}.{}", names.mlp_norm), ln_2);
            let a = format!("{pre}.{}", names.attn);
            match (TensorNames::attn_layout(self.cfg.family), attn.fused_qkv()) {
                (mha::WeightLayout::Gpt2Conv1d, Some(qkv)) => {
                    proj(&mut put, format!("{a}.c_attn"), qkv, true)?;
                    proj(&mut put, format!("{a}.c_proj"), attn.out_proj(), true)?;
                }
                (mha::WeightLayout::HeadInterleavedQkv { qkv: q_name, o }, Some(qkv)) => {
                    // Back to NeoX's per-head grouping.
                    let h = self.cfg.n_head;
                    let w = neox_to_fused(&qkv.weight_t()?.t()?, h, true)?;
                    put(format!("{a}.{q_name}.weight"), &w);
                    if let Some(b) = qkv.bias() {
                        put(format!("{a}.{q_name}.bias"), &neox_to_fused(b, h, true)?);
                    }
                    proj(&mut put, format!("{a}.{o}"), attn.out_proj(), false)?;
                }
                // Fused for inference or not: q, k and v are views into the fused one.
                (mha::WeightLayout::Separate { q, k, v, o }, _) => {
                    let [pq, pk, pv] = attn.qkv_proj();
                    for (n, p) in [(q, pq), (k, pk), (v, pv), (o, attn.out_proj())] {
                        proj(&mut put, format!("{a}.{n}"), p, false)?;
                    }
                }
                (layout, _) => {
                    bail!("block {i}: attention weights do not match the {layout:?} layout")
                }
            }
            let (projections, conv1d) = mlp.projections();
            for (n, p) in projections {
                proj(
                    &mut put,
                    format!("{pre}.{}.{n}", names.mlp_prefix),
                    p,
                    conv1d,
                )?;
            }
        }
        if let Some(ln_f) = &self.ln_f {
            norm(&mut put, names.final_norm.to_string(), ln_f);
        }
        match &self.lm_head_weight {
            Some(w) => put(format!("{}.weight", names.head), w),
            // A head loaded as a part (from GGUF): its weight, dequantized if need be.
            None if !self.cfg.tie_word_embeddings => put(
                format!("{}.weight", names.head),
                &self.lm_head.weight_t()?.t()?,
            ),
            None => {}
        }
        Ok(out)
    }

    /// The model's family.
    pub fn family(&self) -> Family {
        self.cfg.family
    }
}

impl ModuleT for Gpt {
    /// Logits `[b, t, vocab]` for `ids [b, t]`, with dropout when `train`.
    fn forward_t(&self, ids: &Tensor, train: bool) -> Result<Tensor> {
        Ok(self.run(ids, None, None, train, false, Logits::All)?.0)
    }
}

/// True when no element is NaN or ±Inf (`0·x` is 0 for finite `x` only).
/// The stages of a forward pass (embeddings, each block), to name the first whose output
/// is not finite when the logits are not. On the CPU each output is checked as the pass
/// goes, a read with nothing kept: holding every block's output (as references) made a
/// 512-token prefill peak 19 MiB higher for GPT-2 124M and 35 MiB for SmolLM-135M. On
/// other devices the outputs are kept and read only if the logits are not finite: a check
/// per stage would wait on the device at every block. Training skips all of it.
enum Stages {
    Off,
    Checked(Option<String>),
    Kept(Vec<(String, Tensor)>),
}

impl Stages {
    fn new(xs: &Tensor, train: bool) -> Self {
        match (train, xs.device().is_cpu()) {
            (true, _) => Self::Off,
            (false, true) => Self::Checked(None),
            (false, false) => Self::Kept(Vec::new()),
        }
    }

    fn push(&mut self, name: impl FnOnce() -> String, xs: &Tensor) -> Result<()> {
        match self {
            Self::Off | Self::Checked(Some(_)) => {}
            Self::Checked(first) => {
                if !all_finite(xs)? {
                    *first = Some(name());
                }
            }
            Self::Kept(stages) => stages.push((name(), xs.clone())),
        }
        Ok(())
    }

    fn first_non_finite(&self) -> Result<Option<String>> {
        match self {
            Self::Off => Ok(None),
            Self::Checked(first) => Ok(first.clone()),
            Self::Kept(stages) => {
                for (name, t) in stages {
                    if !all_finite(t)? {
                        return Ok(Some(name.clone()));
                    }
                }
                Ok(None)
            }
        }
    }
}

/// Whether every value of `t` is finite: read on the CPU (f32 where it lies), reduced on
/// other devices.
fn all_finite(t: &Tensor) -> Result<bool> {
    if t.device().is_cpu() {
        // Branch-free within a chunk, so the compiler vectorizes it.
        let finite = |c: &[f32]| c.iter().fold(true, |ok, v| ok & v.is_finite());
        return gpt_kernels::dense::with_f32_values(t, |x| Ok(x.chunks(1024).all(finite)));
    }
    all_finite_on_device(t)
}

fn all_finite_on_device(t: &Tensor) -> Result<bool> {
    let s = (t * 0.0)?
        .to_dtype(DType::F32)?
        .sum_all()?
        .to_scalar::<f32>()?;
    Ok(s == 0.0)
}

/// Row lookup that keeps the gradient of the table: `[v, d]` indexed by `[b, t]` ids.
trait EmbeddingRows {
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

/// Mean cross-entropy of `logits [b, t, v]` predicting `ids[:, 1:]`.
pub fn next_token_loss(logits: &Tensor, ids: &Tensor) -> Result<Tensor> {
    let (b, t, v) = logits.dims3()?;
    if t < 2 {
        bail!("the loss needs at least 2 tokens per row, got {t}")
    }
    check_targets(ids, b, t, v)?;
    if logits.device().is_cpu() && logits.dtype() == DType::F32 {
        // Fused: no copy of the logits, and a backward pass of one sweep.
        return gpt_kernels::ops::next_token_cross_entropy(logits, ids);
    }
    let inputs = logits.narrow(1, 0, t - 1)?.reshape((b * (t - 1), v))?;
    let targets = ids
        .narrow(1, 1, t - 1)?
        .flatten_all()?
        .to_dtype(DType::U32)?;
    candle_nn::loss::cross_entropy(&inputs.to_dtype(at_least_f32(logits.dtype()))?, &targets)
}

/// Log-probability of each next token, `[b, t - 1]`: entry `(i, j)` is
/// `log p(ids[i, j + 1] | ids[i, ..= j])`.
pub fn token_logprobs(logits: &Tensor, ids: &Tensor) -> Result<Tensor> {
    let (b, t, v) = logits.dims3()?;
    if t < 2 {
        bail!("log-probabilities need at least 2 tokens per row, got {t}")
    }
    check_targets(ids, b, t, v)?;
    let logp = candle_nn::ops::log_softmax(
        &logits
            .narrow(1, 0, t - 1)?
            .to_dtype(at_least_f32(logits.dtype()))?,
        D::Minus1,
    )?;
    let targets = ids
        .narrow(1, 1, t - 1)?
        .to_dtype(DType::U32)?
        .unsqueeze(2)?;
    logp.contiguous()?
        .gather(&targets.contiguous()?, 2)?
        .squeeze(2)
}

/// Checks that `ids` are the `[b, t]` integer targets of `[b, t, v]` logits.
fn check_targets(ids: &Tensor, b: usize, t: usize, v: usize) -> Result<()> {
    if ids.dims() != [b, t] {
        bail!(
            "ids must be [batch, seq] = [{b}, {t}] to match the logits, got {:?}",
            ids.dims()
        )
    }
    if b == 0 {
        bail!("no rows to score")
    }
    if ids.dtype().is_float() {
        bail!("ids must be integers, got {:?}", ids.dtype())
    }
    let ids = ids.to_dtype(DType::I64)?.flatten_all()?;
    let (lo, hi) = (
        ids.min(0)?.to_scalar::<i64>()?,
        ids.max(0)?.to_scalar::<i64>()?,
    );
    if lo < 0 || hi >= v as i64 {
        bail!("ids must be in 0..{v}, got values from {lo} to {hi}")
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both ways of finding the first non-finite stage name the same one, for f32 (read in
    /// place) and f16 (reduced on the device), a narrowed view among them; training names
    /// none.
    #[test]
    fn stages_name_the_first_non_finite_output() -> Result<()> {
        let dev = Device::Cpu;
        let fine = Tensor::ones((2, 3, 4), DType::F32, &dev)?;
        let mut values = vec![1f32; 24];
        values[17] = f32::INFINITY;
        let inf = Tensor::from_vec(values, (2, 3, 4), &dev)?;
        let nan = (&fine * f64::NAN)?.narrow(2, 1, 2)?;
        for dtype in [DType::F32, DType::F16] {
            let (fine, inf, nan) = (fine.to_dtype(dtype)?, inf.to_dtype(dtype)?, nan.clone());
            for mut stages in [Stages::Checked(None), Stages::Kept(Vec::new()), Stages::Off] {
                stages.push(|| "a".into(), &fine)?;
                assert_eq!(stages.first_non_finite()?, None);
                stages.push(|| "b".into(), &inf)?;
                stages.push(|| "c".into(), &nan)?;
                stages.push(|| "d".into(), &fine)?;
                let want = match stages {
                    Stages::Off => None,
                    _ => Some("b".to_string()),
                };
                assert_eq!(stages.first_non_finite()?, want);
            }
        }
        assert!(!all_finite(&nan)?);
        assert!(all_finite(&fine.narrow(1, 1, 2)?)?);
        Ok(())
    }
}
