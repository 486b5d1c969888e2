//! Projections a family's files store fused and the model keeps apart (Phi-3's
//! `qkv_proj` and `gate_up_proj`): their headers checked and expanded into the parts, and
//! each part served as its rows of the stored tensor while reading. The parts are fused
//! again for inference where the model fuses Llama's ([`crate::Gpt::fused`]), and split
//! again from saved tensors for training ([`parts_of_stored`]).

use std::collections::HashMap;

use candle_core::{bail, DType, Device, Result, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;

use crate::config::GptConfig;

/// For each stored-fused tensor's suffix, the suffixes of its parts and their rows.
fn splits(cfg: &GptConfig) -> Vec<(String, Vec<(String, usize)>)> {
    let names = cfg.family.names();
    let Some(fused) = names.stored_fused else {
        return Vec::new();
    };
    let (a, m) = (&names.attn_proj, &names.mlp_proj);
    let hd = cfg.head_dim();
    let (qw, kw, inner) = (cfg.n_head * hd, cfg.kv_heads() * hd, cfg.inner_dim());
    let attn = |p: &str| format!(".{}.{p}.weight", names.attn);
    let mlp = |p: &str| format!(".{}.{p}.weight", names.mlp);
    let mut out = vec![(
        attn(fused.qkv),
        vec![(attn(a.q.hf), qw), (attn(a.k.hf), kw), (attn(a.v.hf), kw)],
    )];
    if let Some(gate) = m.gate {
        out.push((
            mlp(fused.gate_up),
            vec![(mlp(gate.hf), inner), (mlp(m.up.hf), inner)],
        ));
    }
    out
}

/// The header's shapes with each stored-fused tensor replaced by its parts' (`[rows, d]`
/// each), once its own shape is checked; the error names the stored tensor.
pub(super) fn expand_shapes(
    cfg: &GptConfig,
    shapes: HashMap<String, Vec<usize>>,
) -> Result<HashMap<String, Vec<usize>>> {
    let splits = splits(cfg);
    if splits.is_empty() {
        return Ok(shapes);
    }
    // The parts stored apart are not this family's files (the model would read the fused
    // names, which are then missing).
    for (suffix, parts) in &splits {
        if let Some(name) = shapes
            .keys()
            .find(|n| parts.iter().any(|(p, _)| n.ends_with(p.as_str())))
        {
            bail!(
                "tensor {name}: {} files store it inside the fused {}",
                cfg.family.model_type(),
                suffix.trim_start_matches('.')
            )
        }
    }
    let mut out = HashMap::with_capacity(shapes.len());
    for (name, shape) in shapes {
        let Some((suffix, parts)) = splits.iter().find(|(s, _)| name.ends_with(s.as_str())) else {
            out.insert(name, shape);
            continue;
        };
        let rows: usize = parts.iter().map(|(_, r)| r).sum();
        if shape != [rows, cfg.n_embd] {
            bail!(
                "tensor {name} is {shape:?}, expected [{rows}, {}]",
                cfg.n_embd
            )
        }
        let prefix = &name[..name.len() - suffix.len()];
        for (part, r) in parts {
            out.insert(format!("{prefix}{part}"), vec![*r, cfg.n_embd]);
        }
    }
    Ok(out)
}

/// `tensors` as stored ([`crate::Gpt::named_tensors`], a saved file) under the names of the
/// model's variables: each stored-fused tensor replaced by its parts, their rows of it
/// (training keeps Phi-3's q, k, v, gate and up as variables of their own).
pub fn parts_of_stored(
    cfg: &GptConfig,
    mut tensors: HashMap<String, Tensor>,
) -> Result<HashMap<String, Tensor>> {
    for (suffix, parts) in splits(cfg) {
        let fused: Vec<String> = tensors
            .keys()
            .filter(|n| n.ends_with(suffix.as_str()))
            .cloned()
            .collect();
        for name in fused {
            let Some(t) = tensors.remove(&name) else {
                continue;
            };
            let prefix = &name[..name.len() - suffix.len()];
            let mut first = 0;
            for (part, rows) in &parts {
                tensors.insert(format!("{prefix}{part}"), t.narrow(0, first, *rows)?);
                first += rows;
            }
        }
    }
    Ok(tensors)
}

/// `inner`'s tensors, with the parts of stored-fused tensors served as their rows.
struct PartsOfFused<'a> {
    inner: Box<dyn SimpleBackend + 'a>,
    splits: Vec<(String, Vec<(String, usize)>)>,
}

impl PartsOfFused<'_> {
    /// Where `name` lives when it is a part: the stored tensor, its first row, its rows.
    fn locate(&self, name: &str) -> Option<(String, usize, usize)> {
        for (suffix, parts) in &self.splits {
            let mut first = 0;
            for (part, rows) in parts {
                if let Some(prefix) = name.strip_suffix(part.as_str()) {
                    return Some((format!("{prefix}{suffix}"), first, *rows));
                }
                first += rows;
            }
        }
        None
    }
}

impl SimpleBackend for PartsOfFused<'_> {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> Result<Tensor> {
        match self.locate(name) {
            Some(_) => {
                let t = self.get_unchecked(name, dtype, dev)?;
                if t.shape() != &s {
                    bail!("tensor {name} is {:?}, expected {:?}", t.dims(), s.dims())
                }
                Ok(t)
            }
            None => self.inner.get(s, name, h, dtype, dev),
        }
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> Result<Tensor> {
        match self.locate(name) {
            Some((fused, first, rows)) => self
                .inner
                .get_unchecked(&fused, dtype, dev)?
                .narrow(0, first, rows)?
                // Its own storage, not a view into the stored tensor's: quantizing reads a
                // tensor's whole storage.
                .force_contiguous(),
            None => self.inner.get_unchecked(name, dtype, dev),
        }
    }

    fn contains_tensor(&self, name: &str) -> bool {
        match self.locate(name) {
            Some((fused, ..)) => self.inner.contains_tensor(&fused),
            None => self.inner.contains_tensor(name),
        }
    }
}

/// `backend`, serving the parts of the family's stored-fused tensors when it has any.
pub(super) fn for_family<'a>(
    cfg: &GptConfig,
    backend: Box<dyn SimpleBackend + 'a>,
) -> Box<dyn SimpleBackend + 'a> {
    let splits = splits(cfg);
    match splits.is_empty() {
        true => backend,
        false => Box::new(PartsOfFused {
            inner: backend,
            splits,
        }),
    }
}
