//! The multi-head attention module: projections, rotary embeddings, cache and mask around
//! [`crate::sdpa`].

use candle_core::{bail, DType, Result, Tensor};
use candle_nn::VarBuilder;
use rayon::prelude::*;

use crate::cache::KvCache;
use crate::config::MhaConfig;
use crate::dropout::Dropout;
use crate::flash::{self, step};
use crate::layout::{self, Projections, QkvProj, WeightLayout};
use crate::mask::Mask;
use crate::qk_norm::QkNormWeights;
use crate::rope::{Rope, RopeTables};
use crate::sdpa::{sdpa_softcapped, SdpaParams};
use gpt_kernels::Proj;

/// Attention weights returned by [`MultiHeadAttention::forward_with_weights`].
#[derive(Debug, Clone)]
pub struct AttnWeights {
    /// `[batch, n_heads, q_len, kv_len]`, each row summing to 1 (0 for a fully masked row).
    pub per_head: Tensor,
}

impl AttnWeights {
    /// Weights averaged over heads, `[batch, q_len, kv_len]` (PyTorch's
    /// `average_attn_weights=True`).
    pub fn averaged(&self) -> Result<Tensor> {
        self.per_head.mean(1)
    }
}

/// Multi-head attention with separate query, key and value inputs.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use mha::{Mask, MhaConfig, MultiHeadAttention};
///
/// let dev = Device::Cpu;
/// let varmap = candle_nn::VarMap::new();
/// let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &dev);
/// let attn = MultiHeadAttention::new(&MhaConfig::new(64, 8), vb)?;
/// let xs = Tensor::randn(0f32, 1.0, (2, 10, 64), &dev)?; // [batch, seq, d_model]
/// let ys = attn.forward(&xs, &xs, &xs, &Mask::causal(0), false)?;
/// assert_eq!(ys.dims(), &[2, 10, 64]);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct MultiHeadAttention {
    cfg: MhaConfig,
    proj: Projections,
    dropout: Dropout,
    rope: Option<Rope>,
    /// `bias_k`, `bias_v` (`[kv_width]` each) with `add_bias_kv`.
    bias_kv: Option<(Tensor, Tensor)>,
    /// The weights of the config's `qk_norm`.
    qk_norm: Option<QkNormWeights>,
}

/// Everything a call of [`MultiHeadAttention::forward_with`] takes beside its three inputs.
///
/// ```
/// use mha::{ForwardArgs, Mask};
/// let args = ForwardArgs { mask: Mask::causal(0), ..Default::default() };
/// assert!(!args.train && args.cache.is_none());
/// ```
#[derive(Debug, Default)]
pub struct ForwardArgs<'a> {
    /// What hides keys from queries. The layer's own `window` is added to it.
    pub mask: Mask<'a>,
    /// Rotary tables of the query positions, `[batch, q_len, rotary_dim / 2]` (from
    /// [`Rope::tables`]); with `None` a rotary layer places its queries at
    /// `offset..offset + q_len`, `offset` being the cache length (without a cache, the
    /// mask's causal offset, else 0). Left-padded batches pass their own positions here.
    pub rope: Option<&'a RopeTables>,
    /// Keys and values of earlier positions; the new ones are appended (inference only).
    pub cache: Option<&'a mut KvCache>,
    /// Also return the attention weights of every head.
    pub need_weights: bool,
    /// Training mode: dropout on.
    pub train: bool,
}

impl MultiHeadAttention {
    /// Loads (or, from a `VarMap`, creates) the layer with `q_proj/k_proj/v_proj/o_proj`
    /// linears.
    pub fn new(cfg: &MhaConfig, vb: VarBuilder) -> Result<Self> {
        Self::load(cfg, &WeightLayout::hf(), vb)
    }

    /// Loads the layer from a checkpoint in the given layout.
    pub fn load(cfg: &MhaConfig, layout: &WeightLayout, vb: VarBuilder) -> Result<Self> {
        // A checkpoint (not a VarMap creating the layer) must hold bias_k/bias_v itself.
        let from_file = layout::layout_in_file(&vb).is_some();
        let proj = layout::load(cfg, layout, vb.clone())?;
        let qk_norm = QkNormWeights::load(cfg, &vb)?;
        let bias_kv = match cfg.add_bias_kv {
            false => None,
            true => {
                let kv = cfg.kv_width();
                // PyTorch initialises them with xavier_normal_ over [1, 1, kv].
                let init = candle_nn::Init::Randn {
                    mean: 0.0,
                    stdev: (2.0 / (kv as f64 + kv as f64)).sqrt(),
                };
                let get = |name: &str| -> Result<Tensor> {
                    if from_file && !vb.contains_tensor(name) {
                        bail!("the config says `add_bias_kv: true` but the checkpoint has no `{name}`: set `add_bias_kv: false`")
                    }
                    vb.get_with_hints((1, 1, kv), name, init)?.reshape(kv)
                };
                Some((get("bias_k")?, get("bias_v")?))
            }
        };
        Ok(Self {
            qk_norm,
            ..Self::assemble(cfg, proj, bias_kv)?
        })
    }

    /// Builds the layer from projections loaded elsewhere (a GGUF file's quantized
    /// matrices, say), checking their widths and biases against `cfg`. A config with
    /// `qk_norm` then needs [`Self::with_qk_norm`].
    pub fn from_projections(cfg: &MhaConfig, qkv: QkvProj, o: Proj) -> Result<Self> {
        if cfg.add_bias_kv {
            bail!("add_bias_kv needs bias_k and bias_v: build the layer with MultiHeadAttention::load")
        }
        Self::assemble(cfg, layout::from_projections(cfg, qkv, o)?, None)
    }

    /// The layer with the weights of its config's `qk_norm` (loaded elsewhere): `q` and `k`
    /// `[head_dim]` each per head, or `[n_heads · head_dim]` and `[n_kv_heads · head_dim]`
    /// over the whole projections.
    pub fn with_qk_norm(self, q: Tensor, k: Tensor) -> Result<Self> {
        Ok(Self {
            qk_norm: Some(QkNormWeights::new(&self.cfg, q, k)?),
            ..self
        })
    }

    /// The weights of the q/k norm (queries', keys'), when the layer has one.
    pub fn qk_norm(&self) -> Option<(&Tensor, &Tensor)> {
        self.qk_norm.as_ref().map(|n| (&n.q, &n.k))
    }

    /// Queries `[b, t, n_heads · head_dim]` and keys `[b, t, n_kv_heads · head_dim]` through
    /// the layer's q/k norm (unchanged when it has none), as its forward pass does between
    /// the projections and the rotation.
    pub fn normalize_qk(&self, q: &Tensor, k: &Tensor) -> Result<(Tensor, Tensor)> {
        match self.qk_norm_weights()? {
            Some(norm) => norm.apply(q, k, self.cfg.head_dim()),
            None => Ok((q.clone(), k.clone())),
        }
    }

    /// The q/k norm the config asks for, or an error when its weights were never given.
    fn qk_norm_weights(&self) -> Result<Option<&QkNormWeights>> {
        match (&self.cfg.qk_norm, &self.qk_norm) {
            (Some(_), None) => bail!("attention: the config has qk_norm but the layer was built without its weights (MultiHeadAttention::with_qk_norm)"),
            (_, w) => Ok(w.as_ref()),
        }
    }

    fn assemble(
        cfg: &MhaConfig,
        proj: Projections,
        bias_kv: Option<(Tensor, Tensor)>,
    ) -> Result<Self> {
        let rope = match &cfg.rope {
            Some(r) => Some(Rope::new(r, cfg.head_dim())?),
            None => None,
        };
        Ok(Self {
            cfg: cfg.clone(),
            proj,
            dropout: Dropout::new(cfg.dropout, cfg.seed)?,
            rope,
            bias_kv,
            qk_norm: None,
        })
    }

    /// Attention of `q` over `k`/`v` (`[b, heads, t, head_dim]`) with the positions
    /// `add_bias_kv`/`add_zero_attn` append: every query sees them, whatever the mask hides
    /// of the others (PyTorch pads its masks with a visible column for each).
    fn attend(
        &self,
        q: &Tensor,
        k: Tensor,
        v: Tensor,
        mask: &Mask,
        params: &SdpaParams,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let mut ks = vec![k];
        let mut vs = vec![v];
        let (b, h_kv, tk, hd) = ks[0].dims4()?;
        let (dtype, dev) = (ks[0].dtype(), ks[0].device().clone());
        if let Some((bk, bv)) = &self.bias_kv {
            let row = |t: &Tensor| -> Result<Tensor> {
                t.to_dtype(dtype)?
                    .reshape((1, h_kv, 1, hd))?
                    .broadcast_as((b, h_kv, 1, hd))
            };
            ks.push(row(bk)?);
            vs.push(row(bv)?);
        }
        if self.cfg.add_zero_attn {
            ks.push(Tensor::zeros((b, h_kv, 1, hd), dtype, &dev)?);
            vs.push(Tensor::zeros((b, h_kv, 1, hd), dtype, &dev)?);
        }
        let extra = ks.len() - 1;
        let cap = self.cfg.softcap;
        if extra == 0 {
            let (k, v) = (ks.swap_remove(0), vs.swap_remove(0));
            return sdpa_softcapped(q, &k, &v, mask, params, cap);
        }
        let (_, h, tq, _) = q.dims4()?;
        let k = Tensor::cat(&ks, 2)?;
        let v = Tensor::cat(&vs, 2)?;
        // The mask over the real keys, then visible columns for the appended ones.
        let real = match mask.to_bias((b, h, tq, tk), &dev)? {
            Some(bias) => bias.broadcast_as((b, h, tq, tk))?.contiguous()?,
            None => Tensor::zeros((b, h, tq, tk), DType::F32, &dev)?,
        };
        let open = Tensor::zeros((b, h, tq, extra), DType::F32, &dev)?;
        let bias = Tensor::cat(&[&real, &open], 3)?;
        sdpa_softcapped(q, &k, &v, &Mask::NONE.with_additive(&bias), params, cap)
    }

    /// The rotary embedding of this layer, when it has one.
    pub fn rope(&self) -> Option<&Rope> {
        self.rope.as_ref()
    }

    /// The dropout on the attention weights (drawn only in training).
    pub fn dropout(&self) -> &Dropout {
        &self.dropout
    }

    /// The configuration this layer was built with.
    pub fn config(&self) -> &MhaConfig {
        &self.cfg
    }

    /// The fused q/k/v projection, `[d_model, q_width + 2·kv_width]`, when the checkpoint
    /// stored one (GPT-2's `c_attn`, PyTorch's `in_proj_weight`).
    pub fn fused_qkv(&self) -> Option<&Proj> {
        self.proj.qkv.as_ref()
    }

    /// The query, key and value projections (views into the fused one when there is one).
    pub fn qkv_proj(&self) -> [&Proj; 3] {
        [&self.proj.q, &self.proj.k, &self.proj.v]
    }

    /// The output projection.
    pub fn out_proj(&self) -> &Proj {
        &self.proj.o
    }

    /// The layer with its projections quantized to `dtype` (e.g. `GgmlDType::Q8_0`), for
    /// inference: quantized products have no gradient.
    pub fn quantize(&self, dtype: candle_core::quantized::GgmlDType) -> Result<Self> {
        Ok(Self {
            cfg: self.cfg.clone(),
            proj: self.proj.quantize(dtype)?,
            ..self.clone()
        })
    }

    /// The layer with its query, key and value projections computed as one (their
    /// matrices concatenated into a new one, the checkpoint's left as they are) where they
    /// can share a matrix: for inference, one product per self-attention step instead of
    /// three. The same outputs up to the summation order of the products. A layer that
    /// already has a fused projection comes back as it is; one whose projections differ in
    /// kind keeps them apart, and its decoding steps take them side by side.
    pub fn fused(&self) -> Result<Self> {
        Ok(Self {
            proj: self.proj.fused()?,
            ..self.clone()
        })
    }

    /// Attention of `query` over `key`/`value` (PyTorch's `forward(query, key, value)` with
    /// `batch_first=True`; pass the same tensor three times for self-attention).
    ///
    /// - `mask`: what each query may not see ([`Mask`]): `Mask::NONE`, `Mask::causal(0)`
    ///   (PyTorch's `is_causal=True`), key padding (`with_ignore` is PyTorch's
    ///   `key_padding_mask`), PyTorch's boolean `attn_mask` (`with_disallowed`) or a float
    ///   one (`with_additive`), in any combination. A query that may see no key at all gets
    ///   zeros from attention, so the layer returns `out_proj`'s bias there (PyTorch returns
    ///   NaN).
    /// - `train`: dropout on the attention weights when true (PyTorch's `module.train()`);
    ///   false for inference, where the fused CPU kernel may run.
    ///
    /// # Shapes
    /// - `query`: `[batch, q_len, d_model]`
    /// - `key`: `[batch, kv_len, kdim]`, `value`: `[batch, kv_len, vdim]`
    /// - returns `[batch, q_len, d_model]` (the heads' outputs, `n_heads · head_dim` wide,
    ///   go through the output projection)
    pub fn forward(
        &self,
        query: &Tensor,
        key: &Tensor,
        value: &Tensor,
        mask: &Mask,
        train: bool,
    ) -> Result<Tensor> {
        let args = ForwardArgs {
            mask: *mask,
            train,
            ..Default::default()
        };
        Ok(self.forward_with(query, key, value, args)?.0)
    }

    /// As [`Self::forward`], also returning the attention weights of every head.
    pub fn forward_with_weights(
        &self,
        query: &Tensor,
        key: &Tensor,
        value: &Tensor,
        mask: &Mask,
        train: bool,
    ) -> Result<(Tensor, AttnWeights)> {
        let args = ForwardArgs {
            mask: *mask,
            need_weights: true,
            train,
            ..Default::default()
        };
        match self.forward_with(query, key, value, args)? {
            (ys, Some(w)) => Ok((ys, w)),
            _ => bail!("attention weights were not computed"),
        }
    }

    /// Inference with a KV cache: the keys and values of `key`/`value` are appended to
    /// `cache` and `query` attends to everything cached. For decoding use
    /// `Mask::causal(cache.len())` taken before the call; a key padding mask then covers
    /// all `cache.len() + kv_len` positions. On the CPU, f16 and bf16 layers cache their
    /// keys and values in f32 and attend in f32 (the output is in the layer's dtype).
    pub fn forward_cached(
        &self,
        query: &Tensor,
        key: &Tensor,
        value: &Tensor,
        mask: &Mask,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        let args = ForwardArgs {
            mask: *mask,
            cache: Some(cache),
            ..Default::default()
        };
        Ok(self.forward_with(query, key, value, args)?.0)
    }

    /// The general call: any mask, explicit rotary positions, an optional cache, the
    /// weights on request. Shapes as in [`Self::forward`]; the weights are
    /// `[batch, n_heads, q_len, kv_len]`.
    pub fn forward_with(
        &self,
        query: &Tensor,
        key: &Tensor,
        value: &Tensor,
        args: ForwardArgs,
    ) -> Result<(Tensor, Option<AttnWeights>)> {
        let ForwardArgs {
            mask,
            rope,
            cache,
            need_weights,
            train,
        } = args;
        if need_weights && cache.is_some() {
            bail!("attention weights are not returned from cached steps")
        }
        let cfg = &self.cfg;
        let (b, tq) = check_input(query, "query", None, cfg.d_model)?;
        let (_, tk) = check_input(key, "key", Some(b), cfg.k_dim())?;
        let (_, tv) = check_input(value, "value", Some(b), cfg.v_dim())?;
        if tk != tv {
            bail!("attention: key length {tk} and value length {tv} differ")
        }
        let offset = match &cache {
            Some(c) => c.len(),
            None => mask.causal.unwrap_or(0),
        };
        let mask = match cfg.window {
            Some(w) => Mask {
                window: Some(mask.window.map_or(w, |m| m.min(w))),
                ..mask
            },
            None => mask,
        };
        if cache.is_none() && !need_weights {
            let fused = self.train_from_qkv(query, key, value, &mask, rope, offset, train)?;
            if let Some(ys) = fused {
                return Ok((self.proj.o.forward(&ys)?, None));
            }
        }
        let cache = match cache {
            Some(cache) if self.steps(query, key, value, &mask, need_weights, train) => {
                let ys = self.step(query, rope, offset, cache, &mask)?;
                return Ok((self.proj.o.forward(&ys)?, None));
            }
            other => other,
        };
        let exact = need_weights || self.dropout.is_active(train);
        let Projected { q, k, v, dtype } = self.project(query, key, value, rope, offset, exact)?;
        let (k, v) = match cache {
            Some(cache) => cache.append(&k, &v)?,
            None => (k, v),
        };
        let params = SdpaParams {
            scale: cfg.softmax_scale(),
            dropout: Some(&self.dropout),
            train,
            need_weights,
        };
        let (ys, weights) = self.attend(&q, k, v, &mask, &params)?;
        // (b, h, tq, hd) -> (b, tq, h·hd)
        let ys = ys
            .to_dtype(dtype)?
            .transpose(1, 2)?
            .reshape((b, tq, cfg.q_width()))?;
        let weights = weights.map(|per_head| AttnWeights { per_head });
        Ok((self.proj.o.forward(&ys)?, weights))
    }

    /// Whether a cached call takes [`Self::step`]: f32 self-attention decoding on the CPU
    /// (at most [`flash::DIRECT_ROWS`] new positions) through a fused q/k/v projection or
    /// three prepared for inference ([`Self::fused`]), nothing appended to the keys, no
    /// weights or dropout asked for.
    fn steps(
        &self,
        query: &Tensor,
        key: &Tensor,
        value: &Tensor,
        mask: &Mask,
        need_weights: bool,
        train: bool,
    ) -> bool {
        let cfg = &self.cfg;
        (self.proj.qkv.is_some() || self.proj.apart)
            && query.id() == key.id()
            && key.id() == value.id()
            && (1..=flash::DIRECT_ROWS).contains(&query.dim(1).unwrap_or(0))
            && gpt_kernels::cpu_kernels(query.device())
            && query.dtype() == DType::F32
            && !query.track_op()
            && !need_weights
            && !self.dropout.is_active(train)
            && self.bias_kv.is_none()
            && !cfg.add_zero_attn
            && mask.is_structural()
    }

    /// A decoding step of self-attention ([`step`]): the fused projection's output (or
    /// the three projections' side by side) rotated (after the q/k norm, when the layer
    /// has one), its keys and values written into `cache` in place, the heads' outputs
    /// `[b, t, q_width]` before the output projection.
    fn step(
        &self,
        xs: &Tensor,
        rope: Option<&RopeTables>,
        offset: usize,
        cache: &mut KvCache,
        mask: &Mask,
    ) -> Result<Tensor> {
        let cfg = &self.cfg;
        let (b, t, _) = xs.dims3()?;
        let angles = match &self.rope {
            Some(r) => Some(step::Angles::of(r, rope, (b, t), offset)?),
            None => None,
        };
        let heads = step::Heads {
            h: cfg.n_heads,
            h_kv: cfg.kv_heads(),
            d: cfg.head_dim(),
        };
        step::prepare(cache, (b, t), heads)?;
        // (b, t, q_width + 2·kv_width)
        let qkv = match &self.proj.qkv {
            Some(proj) => proj.forward(xs)?,
            None if self.proj.apart => {
                let p = &self.proj;
                Tensor::cat(&[p.q.forward(xs)?, p.k.forward(xs)?, p.v.forward(xs)?], 2)?
            }
            None => bail!("attention: a decoding step needs q, k and v prepared for inference (MultiHeadAttention::fused)"),
        };
        let mut qkv = qkv.contiguous()?;
        if qkv.dtype() != DType::F32 {
            bail!(
                "attention: the fused projection gives {:?} for f32 inputs",
                qkv.dtype()
            )
        }
        // A per-head norm is applied to each head as the step reads it; one over the whole
        // projection in a pass of its own, here.
        let qk_norm = self.qk_norm_weights()?;
        let head_norm = qk_norm.and_then(QkNormWeights::per_head);
        if let (Some(norm), None) = (qk_norm, head_norm) {
            let shape = qkv.shape().clone();
            let mut values = qkv.flatten_all()?.to_vec1::<f32>()?;
            let widths = (cfg.q_width(), cfg.kv_width(), cfg.kv_width());
            norm.apply_fused(&mut values, widths, cfg.head_dim())?;
            qkv = Tensor::from_vec(values, shape, xs.device())?;
        }
        let _timer = gpt_kernels::profile::time(gpt_kernels::profile::Part::Attention);
        step::attend(
            &qkv,
            heads,
            step::EachHead {
                norm: head_norm,
                angles: angles.as_ref(),
            },
            cache,
            mask,
            cfg.softmax_scale(),
            cfg.softcap,
        )
    }

    /// Training self-attention on the CPU in f32: the heads' outputs `[b, t, q_width]` by
    /// one op from a fused q/k/v projection's output
    /// ([`flash::flash_attn_cpu_train_qkv`], which also applies the rotary embeddings),
    /// computing what the general path's fused kernel does with a fraction of its gradient
    /// bookkeeping. Separate q, k and v projections are fused for it
    /// ([`Proj::concat_differentiable`]). `None` (nothing computed) where the general path
    /// must run: inference, appended keys, additive masks, quantized projections, a q/k
    /// norm (the kernel rotates what the projection gives).
    #[allow(clippy::too_many_arguments)]
    fn train_from_qkv(
        &self,
        query: &Tensor,
        key: &Tensor,
        value: &Tensor,
        mask: &Mask,
        rope: Option<&RopeTables>,
        offset: usize,
        train: bool,
    ) -> Result<Option<Tensor>> {
        let cfg = &self.cfg;
        let (h, h_kv, hd) = (cfg.n_heads, cfg.kv_heads(), cfg.head_dim());
        let (b, t, _) = query.dims3()?;
        let applies = (train || query.track_op())
            && query.id() == key.id()
            && key.id() == value.id()
            && self.bias_kv.is_none()
            && !cfg.add_zero_attn
            && mask.is_structural()
            && gpt_kernels::cpu_kernels(query.device())
            && query.dtype() == DType::F32
            && b * t > 0
            && cfg.qk_norm.is_none()
            && cfg.softcap.is_none();
        if !applies {
            return Ok(None);
        }
        let own;
        let proj = match &self.proj.qkv {
            Some(qkv) => qkv,
            None => {
                let parts = [&self.proj.q, &self.proj.k, &self.proj.v];
                match Proj::concat_differentiable(&parts)? {
                    Some(p) => {
                        own = p;
                        &own
                    }
                    None => return Ok(None),
                }
            }
        };
        let own_tables;
        let rope = match (&self.rope, rope) {
            (None, _) => None,
            (Some(r), Some(tables)) => Some((r, tables)),
            (Some(r), None) => {
                own_tables = r.tables_from(b, t, offset, query.device())?;
                Some((r, &own_tables))
            }
        };
        let qkv = proj.forward(query)?;
        if qkv.dtype() != DType::F32 || qkv.dim(2)? != (h + 2 * h_kv) * hd {
            bail!("attention: the fused projection gives {:?} for {h} query and {h_kv} key/value heads of {hd}", qkv.dims())
        }
        let dropout = Some(&self.dropout).filter(|d| d.is_active(train));
        let scale = cfg.softmax_scale();
        let ys = flash::flash_attn_cpu_train_qkv(&qkv, h, h_kv, mask, scale, dropout, rope)?;
        Ok(Some(ys))
    }

    /// Self-attention of a batch whose rows are separate sequences, each with its own cache
    /// of any length: continuous batching, where sequences join and leave a running batch.
    /// The projections run once for the whole batch (one pass over the weights); each row
    /// then appends its keys and values to its own cache and attends to it. Inference only.
    ///
    /// # Shapes
    /// - `xs`: `[rows, t, d_model]`; row `i` holds positions `caches[i].len()..+t`
    /// - `rope`: the rotary tables of those positions, `[rows, t, rotary_dim / 2]`; `None`
    ///   computes them from the cache lengths
    /// - returns `[rows, t, d_model]`, row `i` equal to that row run alone with its cache
    pub fn forward_rows(
        &self,
        xs: &Tensor,
        rope: Option<&RopeTables>,
        caches: &mut [&mut KvCache],
    ) -> Result<Tensor> {
        let cfg = &self.cfg;
        let (rows, t) = check_input(xs, "input", None, cfg.d_model)?;
        if caches.len() != rows {
            bail!(
                "attention: {rows} rows need as many caches, got {}",
                caches.len()
            )
        }
        let own;
        let rope = match (&self.rope, rope) {
            (Some(r), None) => {
                let pos: Vec<u32> = caches
                    .iter()
                    .flat_map(|c| (c.len()..c.len() + t).map(|p| p as u32))
                    .collect();
                own = r.tables(&Tensor::from_vec(pos, (rows, t), xs.device())?)?;
                Some(&own)
            }
            (_, given) => given,
        };
        let Projected { q, k, v, dtype } = self.project(xs, xs, xs, rope, 0, false)?;
        let params = SdpaParams::inference(cfg.softmax_scale());
        let row = |(i, cache): (usize, &mut &mut KvCache)| -> Result<Tensor> {
            let mut mask = Mask::causal(cache.len());
            mask.window = cfg.window;
            let (k, v) = cache.append(&k.narrow(0, i, 1)?, &v.narrow(0, i, 1)?)?;
            Ok(self.attend(&q.narrow(0, i, 1)?, k, v, &mask, &params)?.0)
        };
        // Rows are independent, and on a small model each is mostly per-call overhead:
        // spread them over the CPU's threads.
        let ys: Vec<Tensor> = match gpt_kernels::cpu_kernels(xs.device()) {
            true => caches
                .par_iter_mut()
                .enumerate()
                .map(row)
                .collect::<Result<_>>()?,
            false => caches
                .iter_mut()
                .enumerate()
                .map(row)
                .collect::<Result<_>>()?,
        };
        // (rows, h, t, hd) -> (rows, t, h·hd)
        let ys = Tensor::cat(&ys, 0)?
            .to_dtype(dtype)?
            .transpose(1, 2)?
            .reshape((rows, t, cfg.q_width()))?;
        self.proj.o.forward(&ys)
    }

    /// Projects the inputs to heads `[b, heads, t, head_dim]` and rotates queries and keys
    /// at their positions (`rope`, or `offset..offset + t`). Half-precision inference on
    /// the CPU is widened to f32 unless `exact` (weights or dropout asked for).
    fn project(
        &self,
        query: &Tensor,
        key: &Tensor,
        value: &Tensor,
        rope: Option<&RopeTables>,
        offset: usize,
        exact: bool,
    ) -> Result<Projected> {
        let cfg = &self.cfg;
        let (h, h_kv, hd) = (cfg.n_heads, cfg.kv_heads(), cfg.head_dim());
        let (b, tq, _) = query.dims3()?;
        let tk = key.dim(1)?;
        let self_attention = query.id() == key.id() && key.id() == value.id();
        let (q, k, v) = match (&self.proj.qkv, self_attention) {
            // One product for all three when the checkpoint stores them fused.
            (Some(qkv), true) => {
                let qkv = qkv.forward(query)?;
                let (qw, kv) = (cfg.q_width(), cfg.kv_width());
                (
                    qkv.narrow(2, 0, qw)?,
                    qkv.narrow(2, qw, kv)?,
                    qkv.narrow(2, qw + kv, kv)?,
                )
            }
            _ => (
                self.proj.q.forward(query)?,
                self.proj.k.forward(key)?,
                self.proj.v.forward(value)?,
            ),
        };
        let (q, k) = match self.qk_norm_weights()? {
            Some(norm) => norm.apply(&q, &k, hd)?,
            None => (q, k),
        };
        // (b, t, h·hd) -> (b, h, t, hd)
        let q = q.reshape((b, tq, h, hd))?.transpose(1, 2)?;
        let k = k.reshape((b, tk, h_kv, hd))?.transpose(1, 2)?;
        let v = v.reshape((b, tk, h_kv, hd))?.transpose(1, 2)?;
        // Half-precision inference on the CPU attends in f32, where the fused kernel runs,
        // and keeps its cache in f32: widening the new rows once is cheaper than widening
        // every cached row at every step as the reference path's f32 scores would.
        let dtype = q.dtype();
        let widen = gpt_kernels::cpu_kernels(q.device())
            && matches!(dtype, DType::F16 | DType::BF16)
            && !exact
            && !(q.track_op() || k.track_op() || v.track_op());
        let (q, k, v) = if widen {
            (
                q.to_dtype(DType::F32)?,
                k.to_dtype(DType::F32)?,
                v.to_dtype(DType::F32)?,
            )
        } else {
            (q, k, v)
        };
        // Rotate the queries and the new keys at their positions; the cache keeps rotated
        // keys, so earlier positions are never rotated again.
        let (q, k) = match &self.rope {
            None => (q, k),
            Some(r) => {
                if tk != tq {
                    bail!("attention: rotary embeddings need as many keys as queries (self-attention), got {tq} queries and {tk} keys")
                }
                let own;
                let tables = match rope {
                    Some(t) => t,
                    None => {
                        own = r.tables_from(b, tq, offset, q.device())?;
                        &own
                    }
                };
                (r.apply(&q, tables)?, r.apply(&k, tables)?)
            }
        };
        Ok(Projected { q, k, v, dtype })
    }
}

/// Queries, keys and values `[b, heads, t, head_dim]` after projection and rotation, and
/// the layer's dtype (they may have been widened to f32).
struct Projected {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dtype: DType,
}

/// Checks a `[batch, seq, width]` input and returns `(batch, seq)`.
fn check_input(
    xs: &Tensor,
    name: &str,
    batch: Option<usize>,
    width: usize,
) -> Result<(usize, usize)> {
    match (xs.dims(), batch) {
        (&[b, t, w], None) if w == width => Ok((b, t)),
        (&[b, t, w], Some(bb)) if w == width && b == bb => Ok((b, t)),
        (dims, _) => bail!(
            "attention: {name} must be [batch{}, seq, {width}], got {dims:?}",
            batch.map(|b| format!(" = {b}")).unwrap_or_default()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The step is what a fused layer's cached decoding takes (the integration tests hold
    /// its outputs to the general path's), and only where it applies.
    #[test]
    fn cached_steps_of_fused_layers_take_the_step() -> Result<()> {
        let cfg = MhaConfig {
            n_kv_heads: Some(2),
            rope: Some(crate::RopeConfig::default()),
            ..MhaConfig::new(32, 4)
        };
        let varmap = candle_nn::VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let general = MultiHeadAttention::load(&cfg, &WeightLayout::hf(), vb)?;
        let fused = general.fused()?;
        let x = Tensor::zeros((2, 1, 32), DType::F32, &Device::Cpu)?;
        let five = Tensor::zeros((2, 5, 32), DType::F32, &Device::Cpu)?;
        let mask = Mask::causal(3);
        assert!(fused.steps(&x, &x, &x, &mask, false, false));
        assert!(!general.steps(&x, &x, &x, &mask, false, false));
        // Projections that cannot share a matrix (q8_0 beside q4_0): apart, and stepped.
        use candle_core::quantized::GgmlDType;
        let q8 = Proj::from_linear(&Tensor::ones((32, 32), DType::F32, &Device::Cpu)?, None)?;
        let q4 = Proj::from_linear(&Tensor::ones((16, 32), DType::F32, &Device::Cpu)?, None)?;
        let (q8, q4) = (q8.quantize(GgmlDType::Q8_0)?, q4.quantize(GgmlDType::Q4_0)?);
        let qkv = QkvProj::Separate([q8.clone(), q4.clone(), q4]);
        let plain = MhaConfig {
            bias: false,
            ..cfg.clone()
        };
        let mixed = MultiHeadAttention::from_projections(&plain, qkv, q8)?;
        assert!(!mixed.steps(&x, &x, &x, &mask, false, false));
        let apart = mixed.fused()?;
        assert!(apart.fused_qkv().is_none());
        assert!(apart.steps(&x, &x, &x, &mask, false, false));
        // Weights asked for, a prefill, cross-attention: the general path.
        assert!(!fused.steps(&x, &x, &x, &mask, true, false));
        assert!(!fused.steps(&five, &five, &five, &mask, false, false));
        let other = x.clone().contiguous()?.affine(1.0, 0.0)?;
        assert!(!fused.steps(&x, &other, &other, &mask, false, false));
        Ok(())
    }
}
