//! A Hugging Face checkpoint loaded for inference: each block's q/k/v and gate/up
//! projections one product each, their matrices views of one buffer read side by side.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::{bail, DType, Device, Result, Tensor};
use candle_nn::VarBuilder;
use mha::{MultiHeadAttention, Proj, QkvProj, WeightLayout};

use super::files::FileTensors;
use super::{in_file, with_prefix_fallback};
use crate::checkpoint::arena::FloatArena;
use crate::checkpoint::options::LoadOptions;
use crate::config::{GptConfig, NormPlacement};
use crate::model::Gpt;
use crate::parts::{block::Block, mixer::Mixer, mlp::Mlp, norm::Norm, short_conv::ShortConv};

/// The model of `st` (opened and checked against `cfg`) for inference: each block's q/k/v
/// and gate/up projections one product each. On the CPU every block matrix is read, in
/// `opts.dtype`, into one buffer, in the order the blocks use them (q, k and v of a block
/// next to each other, then its output projection, gate and up next to each other, then
/// down), as a GGUF file's are read; quantized while loading or off the CPU, each block is
/// fused as it is built.
pub(super) fn load(
    cfg: &GptConfig,
    st: FileTensors,
    prefixed: bool,
    opts: LoadOptions,
    device: &Device,
) -> Result<Gpt> {
    let LoadOptions {
        dtype, quantize, ..
    } = opts;
    let in_file = in_file(cfg, prefixed);
    let st = Arc::new(st);
    let arena = Arc::new(Mutex::new(FloatArena::default()));
    let backend = ArenaTensors {
        files: st.clone(),
        arena: arena.clone(),
    };
    let backend = super::stored_fused::for_family(cfg, Box::new(backend));
    let backend = super::norm_shift::for_family(cfg, backend);
    let vb = VarBuilder::from_backend(backend, dtype, device.clone());
    let model = Gpt::build_with(
        cfg,
        with_prefix_fallback(vb, cfg, prefixed),
        quantize,
        |i, vb| {
            // Read when the first block is built: after the token embedding, whose reading is
            // the load's largest moment and is better had before the blocks are all there.
            if i == 0 && quantize.is_none() && gpt_kernels::cpu_kernels(device) {
                *lock(&arena)? = block_matrices(&st, cfg, dtype, &in_file)?;
            }
            if lock(&arena)?.slots.is_empty() {
                let block = Block::new(cfg, i, vb)?;
                return match quantize {
                    Some(q) => block.quantize(q)?.fused(),
                    None => block.fused(),
                };
            }
            block_from_arena(cfg, i, vb, &arena, &in_file)
        },
        // A quantized head (a tied model's table too) read and packed row by row.
        |name| match (quantize, gpt_kernels::cpu_kernels(device)) {
            (Some(q), true) => Ok(st.packed_rows(&in_file(name), dtype, q)?.map(Arc::new)),
            _ => Ok(None),
        },
    )?;
    if let Some(name) = lock(&arena)?.slots.keys().next() {
        bail!("internal error: tensor {name} was read for a block but no block took it")
    }
    Ok(model)
}

fn lock(arena: &Mutex<FloatArena>) -> Result<std::sync::MutexGuard<'_, FloatArena>> {
    arena
        .lock()
        .map_err(|_| candle_core::Error::Msg("the weight buffer's lock is poisoned".into()))
}

/// The files' block matrices read into one buffer of `dtype` ([`FloatArena`]), in the order
/// the blocks use them; keyed by their names in the files. A GPT-NeoX `query_key_value`
/// is left out: its rows are regrouped into a copy as it loads.
fn block_matrices(
    st: &FileTensors,
    cfg: &GptConfig,
    dtype: DType,
    in_file: &dyn Fn(&str) -> String,
) -> Result<FloatArena> {
    let names = cfg.family.names();
    let (attn, mlp) = (names.attn, names.mlp);
    let mut order = Vec::new(); // the parts of a block, in the order they are read
                                // Phi-3's q/k/v and gate/up as stored: each already one matrix, in the place of its
                                // parts (the parts' names are not in its files).
    let stored = names.stored_fused;
    match names.attn_layout() {
        WeightLayout::Separate { q, k, v, o } => {
            if let Some(f) = stored {
                order.push(format!("{attn}.{}.weight", f.qkv));
            }
            order.extend([q, k, v, o].map(|p| format!("{attn}.{p}.weight")))
        }
        WeightLayout::HeadInterleavedQkv { o, .. } => order.push(format!("{attn}.{o}.weight")),
        WeightLayout::Gpt2Conv1d => {
            let a = &names.attn_proj;
            order.extend([a.qkv.hf, a.o.hf].map(|p| format!("{attn}.{p}.weight")))
        }
        WeightLayout::TorchInProj => {}
    }
    // LFM2's convolution blocks: their projections where a block's attention would be.
    if let Some(sc) = names.short_conv {
        for p in [sc.in_proj, sc.out_proj] {
            order.push(format!("{}.{}.weight", sc.module, p.hf));
        }
    }
    let m = names.mlp_proj;
    if let Some(f) = stored {
        order.push(format!("{mlp}.{}.weight", f.gate_up));
    }
    for p in m.gate.into_iter().chain([m.up, m.down]) {
        order.push(format!("{mlp}.{}.weight", p.hf));
    }
    let shapes: HashMap<&str, &[usize]> = st.infos().map(|(n, _, s)| (n, s)).collect();
    let mut parts = Vec::new();
    for i in 0..cfg.n_layer {
        for part in &order {
            let name = in_file(&format!("{}.{i}.{part}", names.layers.hf));
            // Shapes were checked against the config when the files were opened.
            if let Some(&&[rows, cols]) = shapes.get(name.as_str()) {
                parts.push((name, [rows, cols]));
            }
        }
    }
    let mut arena = FloatArena::default();
    if parts.is_empty() {
        return Ok(arena);
    }
    let list: Vec<_> = parts.iter().map(|(n, s)| (n.as_str(), *s)).collect();
    let buf = st.read_arena(&list, dtype)?;
    let mut at = 0;
    for (name, [rows, cols]) in parts {
        arena.slots.insert(name, (buf.clone(), at, [rows, cols]));
        at += rows * cols;
    }
    Ok(arena)
}

/// Block `i` of a model loaded for inference, its matrices views of `arena`: q/k/v and
/// gate/up, read side by side, become one projection each with no copy.
fn block_from_arena(
    cfg: &GptConfig,
    i: usize,
    vb: VarBuilder,
    arena: &Mutex<FloatArena>,
    in_file: &dyn Fn(&str) -> String,
) -> Result<Block> {
    let names = cfg.family.names();
    let (d, inner) = (cfg.n_embd, cfg.inner_dim());
    let (qw, kv) = (cfg.n_head * cfg.head_dim(), cfg.kv_heads() * cfg.head_dim());
    // `(prefix, rows)` under `vb` read side by side: one `[Σ rows, cols]` view.
    // (The lock is held only here: the VarBuilder's reads take it too.)
    let span = |vb: &VarBuilder, parts: &[(&str, usize)], cols: usize| {
        // Parts a family stores fused (Phi-3) are the one stored matrix.
        let stored = names.stored_fused.map(|f| {
            let rows = parts.iter().map(|(_, r)| r).sum::<usize>();
            match parts.len() {
                3 => (f.qkv, rows),
                _ => (f.gate_up, rows),
            }
        });
        let one;
        let parts = match stored {
            Some(s) => {
                one = [s];
                &one[..]
            }
            None => parts,
        };
        let parts: Vec<_> = parts
            .iter()
            .map(|(p, rows)| {
                (
                    in_file(&format!("{}.{p}.weight", vb.prefix())),
                    [*rows, cols],
                )
            })
            .collect();
        lock(arena)?.take(&parts)
    };
    let biases = |vb: &VarBuilder, parts: &[(&str, usize)], on: bool| -> Result<Option<Tensor>> {
        if !on {
            return Ok(None);
        }
        let bs = parts
            .iter()
            .map(|(p, rows)| vb.pp(p).get(*rows, "bias"))
            .collect::<Result<Vec<_>>>()?;
        Ok(Some(Tensor::cat(&bs, 0)?))
    };
    let linear = |vb: VarBuilder, (d_out, d_in): (usize, usize), bias: bool| -> Result<Proj> {
        let b = match bias {
            true => Some(vb.get(d_out, "bias")?),
            false => None,
        };
        Proj::from_linear(&vb.get((d_out, d_in), "weight")?, b)
    };
    let attn_cfg = Block::attn_config(cfg, i);
    let layout = names.attn_layout();
    let a = vb.pp(names.attn);
    let conv = names.short_conv.filter(|_| cfg.is_conv(i));
    let qkv = match &layout {
        // LFM2's convolution blocks have no q, k or v.
        _ if conv.is_some() => None,
        WeightLayout::Separate { q, k, v, .. } => {
            let parts = [(q.as_str(), qw), (k.as_str(), kv), (v.as_str(), kv)];
            span(&a, &parts, d)?.map(|w| (w, parts))
        }
        _ => None,
    };
    let attn: Mixer = match (qkv, &layout) {
        _ if conv.is_some() => {
            let module = conv.map_or("conv", |c| c.module);
            ShortConv::new(d, cfg.conv_taps, cfg.conv_bias, vb.pp(module))?.into()
        }
        (Some((w, parts)), WeightLayout::Separate { o, .. }) => {
            let qkv = Proj::from_linear(&w, biases(&a, &parts, cfg.attn_bias)?)?;
            let o = linear(a.pp(o), (d, qw), cfg.attn_out_bias)?;
            let attn = MultiHeadAttention::from_projections(&attn_cfg, QkvProj::Fused(qkv), o)?;
            match Block::qk_norm_widths(cfg) {
                Some((qn, kn)) => {
                    let an = &names.attn_proj;
                    let q = a.pp(an.q_norm.hf).get(qn, "weight")?;
                    attn.with_qk_norm(q, a.pp(an.k_norm.hf).get(kn, "weight")?)?
                }
                None => attn,
            }
            .into()
        }
        _ => MultiHeadAttention::load(&attn_cfg, &layout, a)?
            .fused()?
            .into(),
    };
    let m = vb.pp(names.mlp);
    let gate_up = match names.mlp_proj.gate.filter(|_| cfg.gated_mlp) {
        Some(gate) => {
            let parts = [(gate.hf, inner), (names.mlp_proj.up.hf, inner)];
            span(&m, &parts, d)?.map(|w| (w, parts))
        }
        None => None,
    };
    let mlp = match gate_up {
        Some((w, parts)) => {
            let gate_up = Proj::from_linear(&w, biases(&m, &parts, cfg.mlp_bias)?)?;
            let down = linear(m.pp(names.mlp_proj.down.hf), (d, inner), cfg.mlp_bias)?;
            Mlp::from_gate_up(cfg, gate_up, down)?
        }
        None => Mlp::new(cfg, m)?.fused()?,
    };
    let eps = cfg.layer_norm_epsilon;
    let ln_1 = Norm::new(cfg.norm, d, eps, vb.pp(names.attn_norm.hf))?;
    let ln_2 = Norm::new(cfg.norm, d, eps, vb.pp(names.mlp_norm.hf))?;
    let block = Block::from_parts(cfg, i, ln_1, attn, ln_2, mlp)?;
    match cfg.norm_placement {
        NormPlacement::Sandwich => block.with_post_norms(
            Norm::new(cfg.norm, d, eps, vb.pp(names.attn_post_norm.hf))?,
            Norm::new(cfg.norm, d, eps, vb.pp(names.mlp_post_norm.hf))?,
        ),
        _ => Ok(block),
    }
}

/// The files' tensors, a block's matrices served as views of the [`FloatArena`] they were
/// read into (each taken out as it is served).
struct ArenaTensors {
    files: Arc<FileTensors>,
    arena: Arc<Mutex<FloatArena>>,
}

impl ArenaTensors {
    fn load(
        &self,
        name: &str,
        shape: Option<&[usize]>,
        dtype: DType,
        dev: &Device,
    ) -> Result<Tensor> {
        let mut arena = lock(&self.arena)?;
        let Some(&(_, _, stored)) = arena.slots.get(name) else {
            drop(arena);
            return self.files.load(name, dtype, dev);
        };
        let want = match shape {
            Some(&[rows, cols]) => [rows, cols],
            Some(other) => bail!("tensor {name} is {stored:?}, expected {other:?}"),
            None => stored,
        };
        match arena.take(&[(name.to_string(), want)])? {
            Some(w) => w.to_dtype(dtype)?.to_device(dev),
            None => bail!("cannot find tensor {name}"),
        }
    }
}

impl candle_nn::var_builder::SimpleBackend for ArenaTensors {
    fn get(
        &self,
        s: candle_core::Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> Result<Tensor> {
        let t = self.load(name, Some(s.dims()), dtype, dev)?;
        if t.shape() != &s {
            bail!("tensor {name} is {:?}, expected {:?}", t.dims(), s.dims())
        }
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> Result<Tensor> {
        self.load(name, None, dtype, dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.files.contains_tensor(name)
    }
}
