//! The model: embeddings, blocks, final norm, language-model head (tied or not). The
//! family only decides the parts and their names.

mod build;
mod cache;
mod embedding;
mod loss;
mod named;
mod rope_set;
mod stages;

use candle_core::{bail, DType, Device, ModuleT, Result, Tensor};
use mha::{Dropout, KvCache, Mask, Proj};

pub use cache::GptCache;
pub use embedding::Embedding;
use embedding::EmbeddingRows;
pub use loss::{next_token_loss, token_logprobs};
pub use named::StoredTensor;
pub use rope_set::RopeSet;

use crate::config::GptConfig;
use crate::family::Family;
use crate::parts::block::Block;
use crate::parts::mixer::Mixer;
use crate::parts::norm::Norm;
use stages::{all_finite, Stages};

/// Which positions get logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Every position: `[b, t, vocab]`.
    All,
    /// Only the last position, `[b, 1, vocab]`: all that decoding needs, and the LM head
    /// is the largest matrix of a small model.
    Last,
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
                let (_, mixer, _, mlp) = b.parts();
                let mixing: Vec<&Proj> = match mixer {
                    Mixer::Attention(attn) => {
                        let [q, k, v] = attn.qkv_proj();
                        vec![q, k, v, attn.out_proj()]
                    }
                    Mixer::ShortConv(conv) => {
                        let (i, _, _, o) = conv.parts();
                        vec![i, o]
                    }
                };
                mixing.iter().any(|p| p.is_quantized())
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

    /// The rotary tables of positions `pos` (`[b, t]`) for every distinct rotation among
    /// the blocks (empty for models with learned positions); a block finds its own with
    /// `RopeSet::get(block.parts().1.rope())`.
    pub fn rope_tables(&self, pos: &Tensor) -> Result<RopeSet> {
        RopeSet::new(self.h.iter().filter_map(|b| b.parts().1.rope()), pos)
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
    /// `n_layer × [b, n_head, t, t]` (zeros for a short-convolution block, which has none).
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
        let mut xs = self.embed(&ids)?;
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
            xs = if need_weights && block.attention().is_none() {
                // A convolution block (LFM2) has no attention weights: zeros in its place.
                let (b, t, _) = xs.dims3()?;
                let h = self.cfg.n_head;
                weights.push(Tensor::zeros((b, h, t, t), DType::F32, xs.device())?);
                block.forward(&xs, &mask, None, None, train)?
            } else if need_weights {
                let tables = rope.get(block.parts().1.rope());
                let (ys, w) = block.forward_with_weights(&xs, &mask, tables, train)?;
                weights.push(w);
                ys
            } else {
                let layer_cache = cache.as_mut().map(|c| &mut c.layers[i]);
                let tables = rope.get(block.parts().1.rope());
                block.forward(&xs, &mask, tables, layer_cache, train)?
            };
            stages.push(|| format!("block {i}"), &xs)?;
        }
        Ok((self.head(xs, logits, &stages, train)?, weights))
    }

    /// The token embeddings of `ids` `[b, t]`, `[b, t, d]`, times the config's
    /// `embedding_multiplier`.
    fn embed(&self, ids: &Tensor) -> Result<Tensor> {
        let xs = self.wte.rows(ids)?;
        match self.cfg.embedding_multiplier {
            1.0 => Ok(xs),
            m => xs.affine(m, 0.0),
        }
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
        let mut logits = self.lm_head.forward(&xs)?;
        if self.cfg.logits_scaling != 1.0 {
            logits = logits.affine(1.0 / self.cfg.logits_scaling, 0.0)?;
        }
        if let Some(cap) = self.cfg.final_logit_softcapping {
            logits = softcap(&logits, cap)?;
        }
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
        let mut xs = self.embed(&ids)?;
        if let Some(wpe) = &self.wpe {
            xs = (xs + wpe.embedding_rows(&pos)?)?;
        }
        let rope = self.rope_tables(&pos)?;
        let mut stages = Stages::new(&xs, false);
        stages.push(|| "the embeddings".into(), &xs)?;
        for (i, block) in self.h.iter().enumerate() {
            let mut layer: Vec<&mut KvCache> =
                caches.iter_mut().map(|c| &mut c.layers[i]).collect();
            xs = block.forward_rows(&xs, rope.get(block.parts().1.rope()), &mut layer)?;
            stages.push(|| format!("block {i}"), &xs)?;
        }
        self.head(xs, logits, &stages, false)
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

/// `cap · tanh(xs / cap)`: Gemma's soft cap on the logits.
pub fn softcap(xs: &Tensor, cap: f64) -> Result<Tensor> {
    xs.affine(1.0 / cap, 0.0)?.tanh()?.affine(cap, 0.0)
}
