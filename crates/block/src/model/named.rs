//! The model's weights under their Hugging Face names, as `save_pretrained` writes them:
//! as tensors ([`Gpt::named_tensors`]), or as names, stored formats and shapes without
//! their values ([`Gpt::stored_tensors`]: a quantized model's matrices are not
//! dequantized to list them).

use std::collections::HashMap;

use candle_core::{bail, Result, Tensor};
use mha::{neox_to_fused, Proj};

use super::embedding::Embedding;
use super::stages::all_finite;
use super::Gpt;
use crate::parts::mixer::Mixer;
use crate::parts::norm::Norm;

/// A weight as [`Gpt::stored_tensors`] lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredTensor {
    /// Its Hugging Face name.
    pub name: String,
    /// Its format: a dtype (`f32`, `f16`, `bf16`) or a GGUF block type by llama.cpp's name
    /// (`q4_K`, `q8_0`).
    pub format: &'static str,
    /// Its shape as `save_pretrained` writes it.
    pub shape: Vec<usize>,
}

/// One weight as the walk over the model finds it: a tensor at hand, or a matrix left as
/// stored until a caller asks for its values.
enum Entry<'a> {
    Tensor(Tensor),
    /// A projection's weight: nn.Linear's `[out, in]`, or Conv1D's `[in, out]` (`true`).
    Proj(&'a Proj, bool),
    /// GPT-NeoX's fused q/k/v weight `[3 · d, d]`, back in its per-head grouping (heads).
    NeoxQkv(&'a Proj, usize),
    Embedding(&'a Embedding),
}

impl Entry<'_> {
    /// The values (a quantized matrix dequantized).
    fn tensor(self) -> Result<Tensor> {
        match self {
            Entry::Tensor(t) => Ok(t),
            Entry::Proj(p, conv1d) => {
                let w = p.weight_t()?;
                if conv1d {
                    Ok(w)
                } else {
                    w.t()
                }
            }
            Entry::NeoxQkv(p, heads) => neox_to_fused(&p.weight_t()?.t()?, heads, true),
            // A half-precision table as it is stored; a block-quantized one dequantized.
            Entry::Embedding(Embedding::Half { table, .. }) => Ok(table.clone()),
            Entry::Embedding(e) => e.to_dense(),
        }
    }

    /// The stored format and the shape, without the values.
    fn describe(&self) -> Result<(&'static str, Vec<usize>)> {
        Ok(match self {
            Entry::Tensor(t) => (t.dtype().as_str(), t.dims().to_vec()),
            Entry::Proj(p, conv1d) => {
                let (d_in, d_out) = p.dims()?;
                let shape = if *conv1d {
                    vec![d_in, d_out]
                } else {
                    vec![d_out, d_in]
                };
                (p.format_name(), shape)
            }
            Entry::NeoxQkv(p, _) => {
                let (d_in, d_out) = p.dims()?;
                (p.format_name(), vec![d_out, d_in])
            }
            Entry::Embedding(e) => {
                let (v, d) = e.dims()?;
                (e.format_name(), vec![v, d])
            }
        })
    }
}

/// The entries `parts` taken out of `out`, in their order, to be stored fused as `name`.
fn take<T>(out: &mut HashMap<String, T>, name: &str, parts: &[String]) -> Result<Vec<T>> {
    parts
        .iter()
        .map(|p| match out.remove(p) {
            Some(t) => Ok(t),
            None => bail!("no {p} to store fused as {name}"),
        })
        .collect()
}

impl Gpt {
    /// Every weight under its Hugging Face name for the model's family (for GPT-2 the
    /// `transformer.` prefix, no `lm_head` when tied), as `save_pretrained` writes them
    /// (Gemma's norms as the `w` of their `1 + w`; block-quantized matrices dequantized).
    pub fn named_tensors(&self) -> Result<HashMap<String, Tensor>> {
        // Phi-3 stores q/k/v and gate/up fused: their rows one after the other.
        self.collect(|entry| entry.tensor(), |parts| Tensor::cat(&parts, 0))
    }

    /// The weights [`Gpt::named_tensors`] gives, by name with their stored formats and
    /// shapes, in no particular order: what a quantized file holds, listed without
    /// dequantizing it.
    pub fn stored_tensors(&self) -> Result<Vec<StoredTensor>> {
        let described = self.collect(
            |entry| entry.describe(),
            |parts| {
                let (format, mut shape) = parts[0].clone();
                shape[0] = parts.iter().map(|(_, s)| s[0]).sum();
                Ok((format, shape))
            },
        )?;
        Ok(described
            .into_iter()
            .map(|(name, (format, shape))| StoredTensor {
                name,
                format,
                shape,
            })
            .collect())
    }

    /// Every weight by name as `value` makes it from its entry, the parts a family stores
    /// fused joined by `fuse` (given them in the order of their rows).
    fn collect<T>(
        &self,
        value: impl Fn(Entry) -> Result<T>,
        fuse: impl Fn(Vec<T>) -> Result<T>,
    ) -> Result<HashMap<String, T>> {
        let mut out = HashMap::new();
        self.walk(&mut |name, entry| {
            out.insert(name, value(entry)?);
            Ok(())
        })?;
        for (name, parts) in self.stored_fused() {
            let parts = take(&mut out, &name, &parts)?;
            out.insert(name, fuse(parts)?);
        }
        Ok(out)
    }

    /// Checks every weight for NaN and Inf; the error names the first bad tensor in the
    /// order of the model's parts. One weight at a time: a quantized matrix is dequantized
    /// alone, never the whole model at once.
    pub fn check_weights(&self) -> Result<()> {
        self.walk(&mut |name, entry| match all_finite(&entry.tensor()?)? {
            true => Ok(()),
            false => bail!("weight {name} contains NaN or Inf values"),
        })
    }

    /// The tensors a family stores fused (Phi-3's q/k/v and gate/up), each with the names
    /// of its parts in the order of their rows.
    fn stored_fused(&self) -> Vec<(String, Vec<String>)> {
        let names = self.cfg.family.names();
        let Some(fused) = names.stored_fused else {
            return Vec::new();
        };
        let (a, m) = (&names.attn_proj, &names.mlp_proj);
        let mut groups = Vec::new();
        for i in 0..self.h.len() {
            let pre = format!("{}.{i}", names.layers.hf);
            let attn = |p: &str| format!("{pre}.{}.{p}.weight", names.attn);
            let mlp = |p: &str| format!("{pre}.{}.{p}.weight", names.mlp);
            groups.push((
                attn(fused.qkv),
                vec![attn(a.q.hf), attn(a.k.hf), attn(a.v.hf)],
            ));
            if let Some(gate) = m.gate {
                groups.push((mlp(fused.gate_up), vec![mlp(gate.hf), mlp(m.up.hf)]));
            }
        }
        groups
    }

    /// Every weight under its name, in the order of the model's parts, as found.
    fn walk(&self, put: &mut dyn FnMut(String, Entry) -> Result<()>) -> Result<()> {
        let names = self.cfg.family.names();
        let tensor = |t: &Tensor| Entry::Tensor(t.clone());
        let shift = self.cfg.family.norm_weight_shift();
        // A norm's weight as stored: the factor it multiplies by, less the family's shift
        // (in f32, where it is exact for factors in [0.5, 2]).
        let stored = |w: &Tensor| -> Result<Tensor> {
            match shift {
                0.0 => Ok(w.clone()),
                s => w
                    .to_dtype(candle_core::DType::F32)?
                    .affine(1.0, -s)?
                    .to_dtype(w.dtype()),
            }
        };
        put(
            format!("{}.weight", names.embed.hf),
            Entry::Embedding(&self.wte),
        )?;
        if let Some(wpe) = &self.wpe {
            put(format!("{}.weight", names.positions.hf), tensor(wpe))?;
        }
        // A projection as stored: Conv1D `[in, out]`, nn.Linear `[out, in]`.
        let proj = |put: &mut dyn FnMut(String, Entry) -> Result<()>,
                    name: String,
                    p: &Proj,
                    conv1d: bool|
         -> Result<()> {
            put(format!("{name}.weight"), Entry::Proj(p, conv1d))?;
            if let Some(b) = p.bias() {
                put(format!("{name}.bias"), tensor(b))?;
            }
            Ok(())
        };
        let norm = |put: &mut dyn FnMut(String, Entry) -> Result<()>,
                    name: String,
                    n: &Norm|
         -> Result<()> {
            put(format!("{name}.weight"), Entry::Tensor(stored(n.weight())?))?;
            if let Some(b) = n.bias() {
                put(format!("{name}.bias"), tensor(b))?;
            }
            Ok(())
        };
        for (i, block) in self.h.iter().enumerate() {
            let pre = format!("{}.{i}", names.layers.hf);
            let (ln_1, mixer, ln_2, mlp) = block.parts();
            norm(put, format!("{pre}.{}", names.attn_norm.hf), ln_1)?;
            norm(put, format!("{pre}.{}", names.mlp_norm.hf), ln_2)?;
            if let Some((post_attn, post_mlp)) = block.post_norms() {
                norm(put, format!("{pre}.{}", names.attn_post_norm.hf), post_attn)?;
                norm(put, format!("{pre}.{}", names.mlp_post_norm.hf), post_mlp)?;
            }
            let attn = match mixer {
                Mixer::Attention(attn) => attn,
                Mixer::ShortConv(conv) => {
                    let Some(sc) = names.short_conv else {
                        bail!("block {i}: a short convolution in a family without them")
                    };
                    let c = format!("{pre}.{}", sc.module);
                    let (in_proj, taps, bias, out_proj) = conv.parts();
                    proj(put, format!("{c}.{}", sc.in_proj.hf), in_proj, false)?;
                    proj(put, format!("{c}.{}", sc.out_proj.hf), out_proj, false)?;
                    // Hugging Face's depthwise Conv1d: [d, 1, L].
                    let (d, l) = taps.dims2()?;
                    put(
                        format!("{c}.{}.weight", sc.conv.hf),
                        Entry::Tensor(taps.reshape((d, 1, l))?),
                    )?;
                    if let Some(b) = bias {
                        put(format!("{c}.{}.bias", sc.conv.hf), tensor(b))?;
                    }
                    let (projections, conv1d) = mlp.projections();
                    for (n, p) in projections {
                        proj(put, format!("{pre}.{}.{n}", names.mlp), p, conv1d)?;
                    }
                    continue;
                }
            };
            let a = format!("{pre}.{}", names.attn);
            if let Some((q, k)) = attn.qk_norm() {
                let (qn, kn) = (names.attn_proj.q_norm.hf, names.attn_proj.k_norm.hf);
                put(format!("{a}.{qn}.weight"), Entry::Tensor(stored(q)?))?;
                put(format!("{a}.{kn}.weight"), Entry::Tensor(stored(k)?))?;
            }
            match (names.attn_layout(), attn.fused_qkv()) {
                (mha::WeightLayout::Gpt2Conv1d, Some(qkv)) => {
                    let (q_name, o) = (names.attn_proj.qkv.hf, names.attn_proj.o.hf);
                    proj(put, format!("{a}.{q_name}"), qkv, true)?;
                    proj(put, format!("{a}.{o}"), attn.out_proj(), true)?;
                }
                (mha::WeightLayout::HeadInterleavedQkv { qkv: q_name, o }, Some(qkv)) => {
                    // Back to NeoX's per-head grouping.
                    let h = self.cfg.n_head;
                    put(format!("{a}.{q_name}.weight"), Entry::NeoxQkv(qkv, h))?;
                    if let Some(b) = qkv.bias() {
                        let b = neox_to_fused(b, h, true)?;
                        put(format!("{a}.{q_name}.bias"), Entry::Tensor(b))?;
                    }
                    proj(put, format!("{a}.{o}"), attn.out_proj(), false)?;
                }
                // Fused for inference or not: q, k and v are views into the fused one.
                (mha::WeightLayout::Separate { q, k, v, o }, _) => {
                    let [pq, pk, pv] = attn.qkv_proj();
                    for (n, p) in [(q, pq), (k, pk), (v, pv), (o, attn.out_proj())] {
                        proj(put, format!("{a}.{n}"), p, false)?;
                    }
                }
                (layout, _) => {
                    bail!("block {i}: attention weights do not match the {layout:?} layout")
                }
            }
            let (projections, conv1d) = mlp.projections();
            for (n, p) in projections {
                proj(put, format!("{pre}.{}.{n}", names.mlp), p, conv1d)?;
            }
        }
        if let Some(ln_f) = &self.ln_f {
            norm(put, names.final_norm.hf.to_string(), ln_f)?;
        }
        match &self.lm_head_weight {
            Some(w) => put(format!("{}.weight", names.head.hf), tensor(w)),
            // A head loaded as a part (from GGUF): its weight as stored.
            None if !self.cfg.tie_word_embeddings => put(
                format!("{}.weight", names.head.hf),
                Entry::Proj(&self.lm_head, false),
            ),
            None => Ok(()),
        }
    }
}
