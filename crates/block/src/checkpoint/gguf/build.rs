//! The model built from a GGUF file: llama.cpp's tensor names (each family's table) mapped
//! onto the same blocks as every other format, block-quantized matrices kept as stored.

use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use candle_core::{bail, DType, Device, Result, Tensor};
use mha::{MultiHeadAttention, Proj, QkvProj};

use super::read::{matrix_dtype, stored_float};
use super::rope::{rotary_order, rotary_rows, select_rows};
use super::{tensor_bytes, Gguf};
use crate::checkpoint::arena::FloatArena;
use crate::checkpoint::options::LoadOptions;
use crate::config::{GptConfig, NormKind, NormPlacement};
use crate::family::names::Name;
use crate::model::{Embedding, Gpt};
use crate::parts::{block::Block, mlp::Mlp, norm::Norm, short_conv::ShortConv};

impl Gguf {
    /// The model, with block-quantized matrices kept as they are stored and everything else
    /// (f32/f16/bf16 matrices, norms, biases, embeddings) in `opts.dtype`; except that with
    /// f32 on the CPU, f16 and bf16 matrices (the token table among them) stay as stored and
    /// are widened as the products read them: the same results as f32 weights, at half the
    /// memory and bytes read (see [`Gpt::with_f32_activations`]). `opts.quantize` applies
    /// to a model whose matrices are all stored in float.
    ///
    /// With `opts.fused` each block's q/k/v and gate/up projections are fused into one
    /// product each as it is loaded ([`Gpt::fused`]): the block's separate matrices are
    /// freed at once and their memory serves the next block's, where fusing the loaded
    /// model would hold them all until the allocator returns them. Float (f32, f16, bf16)
    /// block matrices are read side by side into one buffer first, each a view of it, the
    /// fused ones views spanning their parts: nothing is copied.
    pub fn load(&self, opts: impl Into<LoadOptions>, device: &Device) -> Result<Gpt> {
        let opts = opts.into();
        let model = self.load_blocks(opts.dtype, device, opts.fused)?;
        match opts.quantize {
            Some(q) if !model.is_quantized() => model.quantize(q),
            _ => Ok(model),
        }
    }

    fn load_blocks(&self, dtype: DType, device: &Device, fuse: bool) -> Result<Gpt> {
        let cfg = self.config()?;
        self.check_memory(&cfg, dtype, device)?;
        let n = cfg.family.names();
        let (a, m) = (&n.attn_proj, &n.mlp_proj);
        let matrix = |t: GgmlDType| matrix_dtype(t, dtype, device);
        let (v, d, inner) = (cfg.vocab_size, cfg.n_embd, cfg.inner_dim());
        let hd = cfg.head_dim();
        let (qw, kv) = (cfg.n_head * hd, cfg.kv_heads() * hd);
        let bias = |name: String, len: usize, on: bool| -> Result<Option<Tensor>> {
            match on {
                true => Ok(Some(self.dense(&name, &[len], dtype, device)?)),
                false => Ok(None),
            }
        };
        // llama.cpp's Llama rotates adjacent pairs, so its converter reorders each head's
        // query and key rows; this model rotates halves, so the rows go back.
        let unpermute = |heads: usize| cfg.family.gguf_permutes_qk() && heads > 0;
        // A projection's bias, its rows in the order the matrix's are put in.
        let proj_bias = |stem: &str, d_out: usize, has_bias: bool, heads: usize| {
            let b = bias(format!("{stem}.bias"), d_out, has_bias)?;
            match (b, unpermute(heads)) {
                (Some(b), true) => Ok(Some(select_rows(&b, &rotary_order(d_out, heads, false)?)?)),
                (b, _) => Ok::<_, candle_core::Error>(b),
            }
        };
        let arena = std::cell::RefCell::new(match fuse {
            true => self.float_arena(&cfg, dtype, device)?,
            false => FloatArena::default(),
        });
        // The biases of matrices read side by side (`parts`: stem, rows, rotary heads),
        // concatenated.
        let stacked_bias = |parts: &[(String, usize, usize)], has_bias: bool| match has_bias {
            true => {
                let bs = parts
                    .iter()
                    .map(|(stem, rows, heads)| proj_bias(stem, *rows, true, *heads))
                    .collect::<Result<Vec<_>>>()?;
                Ok(Some(Tensor::cat(
                    &bs.into_iter().flatten().collect::<Vec<_>>(),
                    0,
                )?))
            }
            false => Ok::<_, candle_core::Error>(None),
        };
        // Matrices read side by side as one projection: the view `w` of them.
        let side_by_side = |w: Tensor, parts: &[(String, usize, usize)], has_bias: bool| {
            Proj::from_linear(&w, stacked_bias(parts, has_bias)?)
        };
        // The rotary heads whose rows a matrix stores in llama.cpp's order (0: as stored).
        let stored_heads = |heads: usize| if unpermute(heads) { heads } else { 0 };
        // Block-quantized matrices read side by side and packed as one (q, k and v; gate
        // and up) straight into the slabs the model's matrices share, when loading for
        // inference (`fuse`): the fused projection with no copy of its parts. `None`
        // otherwise, or where they cannot be (see `packed_parts`).
        let packed_side_by_side = |parts: &[(String, usize, usize)], has_bias: bool| {
            if !fuse {
                return Ok(None);
            }
            let names: Vec<_> = parts
                .iter()
                .map(|(stem, rows, heads)| {
                    (format!("{stem}.weight"), [*rows, d], stored_heads(*heads))
                })
                .collect();
            let names: Vec<_> = names.iter().map(|(n, s, h)| (n.as_str(), *s, *h)).collect();
            match self.packed_parts(&names, device, true)? {
                Some(w) => Ok(Some(Proj::from_packed(
                    Arc::new(w),
                    stacked_bias(parts, has_bias)?,
                ))),
                None => Ok::<_, candle_core::Error>(None),
            }
        };
        let arena_take = |parts: &[(String, usize, usize)], cols: usize| {
            let names: Vec<_> = parts
                .iter()
                .map(|(stem, rows, _)| (format!("{stem}.weight"), [*rows, cols]))
                .collect();
            arena.borrow_mut().take(&names)
        };
        // `settle`: a packed matrix goes straight where inference keeps it (a slab beside
        // the model's others, as `Block::fused` would move it).
        let proj_in = |stem: String,
                       (d_out, d_in): (usize, usize),
                       has_bias: bool,
                       heads: usize,
                       settle: bool| {
            let name = format!("{stem}.weight");
            let b = proj_bias(&stem, d_out, has_bias, heads)?;
            let dims = [d_out, d_in];
            if let Some(packed) = self.packed(&name, &dims, stored_heads(heads), device, settle)? {
                return Ok(Proj::from_packed(Arc::new(packed), b));
            }
            if let Some(w) = arena.borrow_mut().take(&[(name.clone(), [d_out, d_in])])? {
                return Proj::from_linear(&w, b);
            }
            // Rows put back in order once read: the read checks the shape the order's size
            // comes from (a file's metadata may claim any width).
            if let Some(t) = self.stored(&name).filter(|&t| stored_float(t).is_some()) {
                let w = self.dense(&name, &[d_out, d_in], matrix(t), device)?;
                return match unpermute(heads) {
                    true => {
                        Proj::from_linear(&select_rows(&w, &rotary_order(d_out, heads, false)?)?, b)
                    }
                    false => Proj::from_linear(&w, b),
                };
            }
            let mut w = self.qtensor(&name, &[d_out, d_in], device)?;
            if unpermute(heads) {
                w = rotary_rows(&w, heads)?;
            }
            Proj::from_qtensor(Arc::new(w), b, dtype)
        };
        let proj = |stem: String, dims: (usize, usize), has_bias: bool, heads: usize| {
            proj_in(stem, dims, has_bias, heads, false)
        };
        let norm = |name: &str| -> Result<Norm> {
            let w = self.dense(&format!("{name}.weight"), &[d], dtype, device)?;
            let b = bias(format!("{name}.bias"), d, cfg.norm == NormKind::LayerNorm)?;
            Norm::from_tensors(cfg.norm, w, b, cfg.layer_norm_epsilon)
        };
        // The largest matrices first: the bytes read and the tensor made of them are both
        // held for a moment, and early on the rest of the model is not there beside them
        // (read last, the token table raised decoding's peak memory).
        let table_name = format!("{}.weight", n.embed.gguf);
        let (wte, lm_head) = match self.packed(&table_name, &[v, d], 0, device, false)? {
            // A table packed for this CPU (q8_0, q4_0, q4_K, q6_K): looked up row by row, and a
            // tied head multiplies by the same tiles.
            Some(packed) => {
                let table = Arc::new(packed);
                let head = match cfg.tie_word_embeddings {
                    true => Proj::from_packed(table.clone(), None),
                    false => proj(n.head.gguf.into(), (v, d), false, 0)?,
                };
                (Embedding::Packed { table, dtype }, head)
            }
            None => {
                let table = table_name.as_str();
                let wte = match self.stored(table).filter(|&t| stored_float(t).is_some()) {
                    // A float table; in half precision under f32 activations.
                    Some(t) => {
                        let table = self.dense(table, &[v, d], matrix(t), device)?;
                        match table.dtype() == dtype {
                            true => Embedding::Dense(table),
                            false => Embedding::Half { table, dtype },
                        }
                    }
                    // A quantized table stays one quantized copy: rows are dequantized on
                    // lookup, and a tied head multiplies by the same blocks.
                    None => Embedding::Quantized {
                        table: Arc::new(self.qtensor(table, &[v, d], device)?),
                        dtype,
                        device: device.clone(),
                    },
                };
                let head = match (&wte, cfg.tie_word_embeddings) {
                    // A dense table is the head's weight too (one copy, as for safetensors).
                    (Embedding::Dense(t) | Embedding::Half { table: t, .. }, true) => {
                        Proj::from_linear(t, None)?
                    }
                    (Embedding::Quantized { table, .. }, true) => {
                        Proj::from_qtensor(table.clone(), None, dtype)?
                    }
                    (Embedding::Packed { table, .. }, true) => {
                        Proj::from_packed(table.clone(), None)
                    }
                    (_, false) => proj(n.head.gguf.into(), (v, d), false, 0)?,
                };
                (wte, head)
            }
        };
        // Grown block by block: a file claiming a billion blocks stops at the first missing.
        let mut blocks = Vec::new();
        for i in 0..cfg.n_layer {
            let blk = |part: Name| n.gguf_block(i, part);
            if cfg.is_conv(i) {
                // LFM2's convolution block: llama.cpp's shortconv tensors, no biases.
                let Some(sc) = n.short_conv else {
                    bail!("{:?} models have no convolution blocks", cfg.family)
                };
                let taps = format!("{}.weight", blk(sc.conv));
                let conv = ShortConv::from_parts(
                    proj(blk(sc.in_proj), (3 * d, d), false, 0)?,
                    self.dense(&taps, &[d, cfg.conv_taps], DType::F32, device)?,
                    None,
                    proj(blk(sc.out_proj), (d, d), false, 0)?,
                )?;
                let mlp = Mlp::from_projections(
                    &cfg,
                    proj(blk(m.up), (inner, d), false, 0)?,
                    m.gate
                        .map(|g| proj(blk(g), (inner, d), false, 0))
                        .transpose()?,
                    proj(blk(m.down), (d, inner), false, 0)?,
                )?;
                let (ln_1, ln_2) = (norm(&blk(n.attn_norm))?, norm(&blk(n.mlp_norm))?);
                let block = Block::from_parts(&cfg, i, ln_1, conv, ln_2, mlp)?;
                blocks.push(if fuse { block.fused()? } else { block });
                continue;
            }
            let attn_cfg = Block::attn_config(&cfg, i);
            let qkv_parts = [
                (blk(a.q), qw, cfg.n_head),
                (blk(a.k), kv, cfg.kv_heads()),
                (blk(a.v), kv, 0),
            ];
            // For inference (`fuse`), a block's packed matrices go straight into the slabs
            // in the order decoding reads them (q/k/v, output, gate/up, down: one stream
            // runs on from each product into the next).
            let qkv = if self.shape(&format!("{}.weight", blk(a.qkv))).is_some() {
                QkvProj::Fused(proj_in(
                    blk(a.qkv),
                    (qw + 2 * kv, d),
                    cfg.attn_bias,
                    0,
                    fuse,
                )?)
            } else if let Some(qkv) = packed_side_by_side(&qkv_parts, cfg.attn_bias)? {
                QkvProj::Fused(qkv)
            } else if let Some(w) = arena_take(&qkv_parts, d)? {
                // q, k and v side by side as read: the fused projection is a view of them.
                QkvProj::Fused(side_by_side(w, &qkv_parts, cfg.attn_bias)?)
            } else {
                // q, k and v that cannot share a matrix (llama.cpp's q4_K_M keeps some
                // layers' v in q6_K) go straight into the slabs one after the other, in
                // decoding's order.
                QkvProj::Separate([
                    proj_in(blk(a.q), (qw, d), cfg.attn_bias, cfg.n_head, fuse)?,
                    proj_in(blk(a.k), (kv, d), cfg.attn_bias, cfg.kv_heads(), fuse)?,
                    proj_in(blk(a.v), (kv, d), cfg.attn_bias, 0, fuse)?,
                ])
            };
            let o = proj_in(blk(a.o), (d, qw), cfg.attn_out_bias, 0, fuse)?;
            let mut attn = MultiHeadAttention::from_projections(&attn_cfg, qkv, o)
                .map_err(|e| candle_core::Error::Msg(format!("block {i}: {e}")))?;
            if let Some((qn, kn)) = Block::qk_norm_widths(&cfg) {
                let q = self.dense(&format!("{}.weight", blk(a.q_norm)), &[qn], dtype, device)?;
                let k = self.dense(&format!("{}.weight", blk(a.k_norm)), &[kn], dtype, device)?;
                attn = attn.with_qk_norm(q, k)?;
            }
            let gate = match (cfg.gated_mlp, m.gate) {
                (true, None) => bail!("{:?} models have no gated MLP", cfg.family),
                (gated, gate) => gate.filter(|_| gated),
            };
            let gate_up_parts = gate.map(|g| [(blk(g), inner, 0), (blk(m.up), inner, 0)]);
            // Phi-3's ffn_up holds the gate's rows, then the up projection's.
            let up = format!("{}.weight", blk(m.up));
            let stored_gate_up =
                n.stored_fused.is_some() && self.shape(&up) == Some(&[2 * inner, d][..]);
            let packed_gate_up = match &gate_up_parts {
                Some(parts) if !stored_gate_up => packed_side_by_side(parts, cfg.mlp_bias)?,
                _ => None,
            };
            let gate_up = match (&gate_up_parts, &packed_gate_up) {
                (Some(parts), None) => arena_take(parts, d)?.map(|w| (w, parts)),
                _ => None,
            };
            let mlp = match (gate_up, packed_gate_up) {
                _ if stored_gate_up => {
                    let gate_up = proj_in(blk(m.up), (2 * inner, d), cfg.mlp_bias, 0, fuse)?;
                    let down = proj_in(blk(m.down), (d, inner), cfg.mlp_bias, 0, fuse)?;
                    Mlp::from_gate_up(&cfg, gate_up, down)?
                }
                // Gate and up packed side by side as read.
                (_, Some(gate_up)) => {
                    let down = proj_in(blk(m.down), (d, inner), cfg.mlp_bias, 0, fuse)?;
                    Mlp::from_gate_up(&cfg, gate_up, down)?
                }
                // Gate and up side by side as read: the fused projection is a view of them.
                (Some((w, parts)), None) => {
                    let gate_up = side_by_side(w, parts, cfg.mlp_bias)?;
                    let down = proj_in(blk(m.down), (d, inner), cfg.mlp_bias, 0, fuse)?;
                    Mlp::from_gate_up(&cfg, gate_up, down)?
                }
                (None, None) => {
                    let gate = gate
                        .map(|g| proj_in(blk(g), (inner, d), cfg.mlp_bias, 0, fuse))
                        .transpose()?;
                    let up = proj_in(blk(m.up), (inner, d), cfg.mlp_bias, 0, fuse)?;
                    let down = proj_in(blk(m.down), (d, inner), cfg.mlp_bias, 0, fuse)?;
                    Mlp::from_projections(&cfg, up, gate, down)?
                }
            };
            let (ln_1, ln_2) = (norm(&blk(n.attn_norm))?, norm(&blk(n.mlp_norm))?);
            let block = Block::from_parts(&cfg, i, ln_1, attn, ln_2, mlp)?;
            let block = match cfg.norm_placement {
                NormPlacement::Sandwich => block
                    .with_post_norms(norm(&blk(n.attn_post_norm))?, norm(&blk(n.mlp_post_norm))?)?,
                _ => block,
            };
            blocks.push(if fuse { block.fused()? } else { block });
        }
        let wpe = match cfg.rope {
            Some(_) => None,
            None => {
                let name = format!("{}.weight", n.positions.gguf);
                Some(self.dense(&name, &[cfg.n_positions, d], dtype, device)?)
            }
        };
        let ln_f = match cfg.norm_placement {
            NormPlacement::Post => None,
            _ => Some(norm(n.final_norm.gguf)?),
        };
        let model = Gpt::from_parts(&cfg, wte, wpe, blocks, ln_f, lm_head)?;
        let mut read = self
            .read
            .lock()
            .map_err(|_| candle_core::Error::Msg("the GGUF file's lock is poisoned".into()))?;
        // Read into the arena but taken by no block (a gate in an ungated model, say): unused.
        for name in arena.borrow().slots.keys() {
            read.remove(name);
        }
        let mut unused: Vec<&str> = self
            .content
            .tensor_infos
            .keys()
            .map(String::as_str)
            .filter(|n| !read.contains(*n))
            .collect();
        unused.sort_unstable();
        if let Some(first) = unused.first() {
            bail!(
                "tensor {first} ({} unread in all) is not part of a {arch} model as this loader knows it; running without it would give wrong results",
                unused.len(),
                arch = self.family()?.0
            )
        }
        Ok(model)
    }

    /// Refuses a model that cannot fit: the stored tensors, block-quantized ones as stored,
    /// the others as [`Self::load`] keeps them.
    fn check_memory(&self, cfg: &GptConfig, dtype: DType, device: &Device) -> Result<()> {
        let mut need = 0u64;
        for (name, dims, ggml) in self.tensors() {
            let stored = tensor_bytes(name, ggml, dims)?;
            let elems: u64 = dims.iter().map(|&x| x as u64).product();
            need += match ggml {
                GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 if dims.len() == 2 => {
                    elems * matrix_dtype(ggml, dtype, device).size_in_bytes() as u64
                }
                GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 => {
                    elems * dtype.size_in_bytes() as u64
                }
                _ => stored,
            };
        }
        if let Some(avail) = crate::checkpoint::check::available_memory() {
            if need > avail {
                bail!(
                    "the model needs {} MiB as {dtype:?} ({} layers), more than the {} MiB of memory available",
                    need >> 20,
                    cfg.n_layer,
                    avail >> 20
                )
            }
        }
        Ok(())
    }

    /// The [`FloatArena`] of a model loaded in `dtype` for inference: every block matrix
    /// kept as stored (f32, f16 or bf16 as [`matrix_dtype`] wants it), llama.cpp's rotary
    /// rows of a Llama's q and k put back in Hugging Face's order. Empty off the CPU.
    fn float_arena(&self, cfg: &GptConfig, dtype: DType, device: &Device) -> Result<FloatArena> {
        let mut arena = FloatArena::default();
        if !gpt_kernels::cpu_kernels(device) {
            return Ok(arena);
        }
        let (d, inner) = (cfg.n_embd, cfg.inner_dim());
        let (qw, kv) = (cfg.n_head * cfg.head_dim(), cfg.kv_heads() * cfg.head_dim());
        let n = cfg.family.names();
        let (a, m) = (&n.attn_proj, &n.mlp_proj);
        // llama.cpp reorders a Llama's query and key rows for its rotation.
        let rotary = |heads: usize| match cfg.family.gguf_permutes_qk() {
            true => heads,
            false => 0,
        };
        // A block's matrices in the order it uses them, with the shape it needs (checked
        // against the stored one as each is read) and the rotary heads to reorder.
        let mut order = vec![
            (a.qkv, [qw + 2 * kv, d], 0),
            (a.q, [qw, d], rotary(cfg.n_head)),
            (a.k, [kv, d], rotary(cfg.kv_heads())),
            (a.v, [kv, d], 0),
            (a.o, [d, qw], 0),
        ];
        order.extend(m.gate.map(|g| (g, [inner, d], 0)));
        // Phi-3's ffn_up holds the gate's rows too.
        let up_rows = match n.stored_fused {
            Some(_) => 2 * inner,
            None => inner,
        };
        order.extend([(m.up, [up_rows, d], 0), (m.down, [d, inner], 0)]);
        let blk = format!("{}.", n.layers.gguf);
        // (block, place in the block, name, [rows, cols], rotary heads to reorder, dtype),
        // from the file's own tensors: a file claiming a billion blocks lists no more.
        let mut mats = Vec::new();
        // By name, so that a file with several bad tensors names the same one every time.
        let mut tensors: Vec<_> = self.tensors().collect();
        tensors.sort_unstable_by_key(|(name, ..)| *name);
        for (name, dims, t) in tensors {
            let Some((i, part)) = name
                .strip_prefix(&blk)
                .and_then(|n| n.strip_suffix(".weight"))
                .and_then(|n| n.split_once('.'))
            else {
                continue;
            };
            let place = order.iter().position(|(p, ..)| p.gguf == part);
            let (Ok(i), Some(place)) = (i.parse::<usize>(), place) else {
                continue;
            };
            if i >= cfg.n_layer {
                continue;
            }
            let (2, Some(stored)) = (dims.len(), stored_float(t)) else {
                continue;
            };
            if stored != matrix_dtype(t, dtype, device) {
                continue;
            }
            let (_, shape, heads) = order[place];
            // The buffer is sized by these shapes before any part is read: a file whose
            // tensors are smaller than its metadata says is refused here, as reading the
            // part would refuse it, and not after allocating what the metadata claims.
            if dims != shape {
                bail!("tensor {name} has shape {dims:?}, the config needs {shape:?}")
            }
            mats.push((i, place, name.to_string(), shape, heads, stored));
        }
        mats.sort_unstable_by_key(|m| (m.0, m.1));
        for want in [DType::F32, DType::F16, DType::BF16] {
            let group: Vec<_> = mats.iter().filter(|m| m.5 == want).collect();
            if group.is_empty() {
                continue;
            }
            let parts: Vec<_> = group.iter().map(|m| (m.2.as_str(), m.3, m.4)).collect();
            let buf = match want {
                DType::F32 => self.read_arena::<f32>(&parts)?,
                DType::F16 => self.read_arena::<half::f16>(&parts)?,
                _ => self.read_arena::<half::bf16>(&parts)?,
            };
            let mut at = 0;
            for (name, [rows, cols], _) in parts {
                arena
                    .slots
                    .insert(name.to_string(), (buf.clone(), at, [rows, cols]));
                at += rows * cols;
            }
        }
        Ok(arena)
    }
}
