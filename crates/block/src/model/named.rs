//! The model's weights under their Hugging Face names, as `save_pretrained` writes them.

use std::collections::HashMap;

use candle_core::{bail, Result, Tensor};
use mha::{neox_to_fused, Proj};

use super::embedding::Embedding;
use super::Gpt;
use crate::parts::mixer::Mixer;
use crate::parts::norm::Norm;

impl Gpt {
    /// Every weight under its Hugging Face name for the model's family (for GPT-2 the
    /// `transformer.` prefix, no `lm_head` when tied), as `save_pretrained` writes them
    /// (Gemma's norms as the `w` of their `1 + w`).
    pub fn named_tensors(&self) -> Result<HashMap<String, Tensor>> {
        let names = self.cfg.family.names();
        let mut out = HashMap::new();
        let mut put = |name: String, t: &Tensor| {
            out.insert(name, t.clone());
        };
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
        // A half-precision table as it is stored; a block-quantized one dequantized.
        let wte = match &self.wte {
            Embedding::Half { table, .. } => table.clone(),
            other => other.to_dense()?,
        };
        put(format!("{}.weight", names.embed.hf), &wte);
        if let Some(wpe) = &self.wpe {
            put(format!("{}.weight", names.positions.hf), wpe);
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
        let norm = |put: &mut dyn FnMut(String, &Tensor), name: String, n: &Norm| -> Result<()> {
            put(format!("{name}.weight"), &stored(n.weight())?);
            if let Some(b) = n.bias() {
                put(format!("{name}.bias"), b);
            }
            Ok(())
        };
        for (i, block) in self.h.iter().enumerate() {
            let pre = format!("{}.{i}", names.layers.hf);
            let (ln_1, mixer, ln_2, mlp) = block.parts();
            norm(&mut put, format!("{pre}.{}", names.attn_norm.hf), ln_1)?;
            norm(&mut put, format!("{pre}.{}", names.mlp_norm.hf), ln_2)?;
            if let Some((post_attn, post_mlp)) = block.post_norms() {
                norm(
                    &mut put,
                    format!("{pre}.{}", names.attn_post_norm.hf),
                    post_attn,
                )?;
                norm(
                    &mut put,
                    format!("{pre}.{}", names.mlp_post_norm.hf),
                    post_mlp,
                )?;
            }
            let attn = match mixer {
                Mixer::Attention(attn) => attn,
                Mixer::ShortConv(conv) => {
                    let Some(sc) = names.short_conv else {
                        bail!("block {i}: a short convolution in a family without them")
                    };
                    let c = format!("{pre}.{}", sc.module);
                    let (in_proj, taps, bias, out_proj) = conv.parts();
                    proj(&mut put, format!("{c}.{}", sc.in_proj.hf), in_proj, false)?;
                    proj(&mut put, format!("{c}.{}", sc.out_proj.hf), out_proj, false)?;
                    // Hugging Face's depthwise Conv1d: [d, 1, L].
                    let (d, l) = taps.dims2()?;
                    put(
                        format!("{c}.{}.weight", sc.conv.hf),
                        &taps.reshape((d, 1, l))?,
                    );
                    if let Some(b) = bias {
                        put(format!("{c}.{}.bias", sc.conv.hf), b);
                    }
                    let (projections, conv1d) = mlp.projections();
                    for (n, p) in projections {
                        proj(&mut put, format!("{pre}.{}.{n}", names.mlp), p, conv1d)?;
                    }
                    continue;
                }
            };
            let a = format!("{pre}.{}", names.attn);
            if let Some((q, k)) = attn.qk_norm() {
                let (qn, kn) = (names.attn_proj.q_norm.hf, names.attn_proj.k_norm.hf);
                put(format!("{a}.{qn}.weight"), &stored(q)?);
                put(format!("{a}.{kn}.weight"), &stored(k)?);
            }
            match (names.attn_layout(), attn.fused_qkv()) {
                (mha::WeightLayout::Gpt2Conv1d, Some(qkv)) => {
                    let (q_name, o) = (names.attn_proj.qkv.hf, names.attn_proj.o.hf);
                    proj(&mut put, format!("{a}.{q_name}"), qkv, true)?;
                    proj(&mut put, format!("{a}.{o}"), attn.out_proj(), true)?;
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
                proj(&mut put, format!("{pre}.{}.{n}", names.mlp), p, conv1d)?;
            }
        }
        if let Some(ln_f) = &self.ln_f {
            norm(&mut put, names.final_norm.hf.to_string(), ln_f)?;
        }
        match &self.lm_head_weight {
            Some(w) => put(format!("{}.weight", names.head.hf), w),
            // A head loaded as a part (from GGUF): its weight, dequantized if need be.
            None if !self.cfg.tie_word_embeddings => put(
                format!("{}.weight", names.head.hf),
                &self.lm_head.weight_t()?.t()?,
            ),
            None => {}
        }
        if let Some(fused) = names.stored_fused {
            // Phi-3 stores q/k/v and gate/up fused: their rows one after the other.
            let (a, m) = (&names.attn_proj, &names.mlp_proj);
            for i in 0..self.h.len() {
                let pre = format!("{}.{i}", names.layers.hf);
                let attn = |p: &str| format!("{pre}.{}.{p}.weight", names.attn);
                let mlp = |p: &str| format!("{pre}.{}.{p}.weight", names.mlp);
                let mut groups = vec![(
                    attn(fused.qkv),
                    vec![attn(a.q.hf), attn(a.k.hf), attn(a.v.hf)],
                )];
                if let Some(gate) = m.gate {
                    groups.push((mlp(fused.gate_up), vec![mlp(gate.hf), mlp(m.up.hf)]));
                }
                for (name, parts) in groups {
                    let parts = parts
                        .iter()
                        .map(|p| match out.remove(p) {
                            Some(t) => Ok(t),
                            None => bail!("block {i}: no {p} to store fused"),
                        })
                        .collect::<Result<Vec<_>>>()?;
                    out.insert(name, Tensor::cat(&parts, 0)?);
                }
            }
        }
        Ok(out)
    }
}
