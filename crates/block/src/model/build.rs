//! How a model is made: from a `VarBuilder` (a checkpoint, or a `VarMap`'s initialisation),
//! from parts loaded elsewhere, and remade for inference (quantized, fused, f32
//! activations, another KV cache dtype).

use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use candle_core::{bail, DType, Result, Tensor};
use candle_nn::{Init, VarBuilder};
use gpt_kernels::quant::Packed;
use mha::{Dropout, Proj};

use super::embedding::{shared_table, Embedding};
use super::Gpt;
use crate::config::{GptConfig, NormPlacement};
use crate::parts::block::Block;
use crate::parts::norm::Norm;

impl Gpt {
    /// Builds the model from `vb` rooted at the checkpoint's top level (for GPT-2 the body
    /// is under `transformer.`). From a `VarMap` it creates GPT-2's initialisation.
    pub fn new(cfg: &GptConfig, vb: VarBuilder) -> Result<Self> {
        Self::build(cfg, vb, None, false)
    }

    /// As [`Gpt::new`], with every matrix product's weight quantized to `dtype` as soon as
    /// its block is read: the full-precision blocks are never all in memory at once, so
    /// loading peaks near the quantized model's size instead of the f32 model's.
    pub fn new_quantized(cfg: &GptConfig, vb: VarBuilder, dtype: GgmlDType) -> Result<Self> {
        Self::build(cfg, vb, Some(dtype), false)
    }

    /// [`Self::new`], each block quantized to `quantize` and fused (`fused`, see
    /// [`Self::fused`]) as soon as it is read.
    pub(crate) fn build(
        cfg: &GptConfig,
        vb: VarBuilder,
        quantize: Option<GgmlDType>,
        fused: bool,
    ) -> Result<Self> {
        let block = |i, vb: VarBuilder| {
            let block = Block::new(cfg, i, vb)?;
            let block = match quantize {
                Some(dtype) => block.quantize(dtype)?, // drops the f32 block
                None => block,
            };
            match fused {
                true => block.fused(),
                false => Ok(block),
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
        let names = cfg.family.names();
        let (v, d) = (cfg.vocab_size, cfg.n_embd);
        let normal = |stdev| Init::Randn { mean: 0.0, stdev };
        let embed = format!("{}.weight", names.embed.hf);
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
                &format!("{}.weight", names.positions.hf),
                normal(0.01),
            )?),
        };
        let layers = vb.pp(names.layers.hf);
        let h = (0..cfg.n_layer)
            .map(|i| block(i, layers.pp(i.to_string())))
            .collect::<Result<Vec<_>>>()?;
        let ln_f = match cfg.norm_placement {
            NormPlacement::Post => None,
            _ => Some(Norm::new(
                cfg.norm,
                d,
                cfg.layer_norm_epsilon,
                vb.pp(names.final_norm.hf),
            )?),
        };
        let head = format!("{}.weight", names.head.hf);
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
        match (&wpe, &cfg.rope) {
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
        if ln_f.is_some() == (cfg.norm_placement == NormPlacement::Post) {
            bail!("a final norm goes with every placement of norms but post-norm")
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
}
