//! AdamW whose state can be saved and restored, so training can resume exactly.

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{bail, CpuStorage, Result, Storage, Tensor, Var};
use rayon::prelude::*;

/// Hyper-parameters of [`AdamW`].
#[derive(Debug, Clone, PartialEq)]
pub struct AdamWParams {
    /// Learning rate (changed every step by a schedule through [`AdamW::set_lr`]).
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// Decoupled weight decay, applied to matrices only (not to biases, LayerNorms).
    pub weight_decay: f64,
}

impl Default for AdamWParams {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        }
    }
}

/// AdamW over named variables (the names key the saved state).
#[derive(Debug)]
pub struct AdamW {
    vars: Vec<(String, Var, Tensor, Tensor)>,
    params: AdamWParams,
    step: usize,
}

impl AdamW {
    /// An optimiser with zero moments for `vars`.
    pub fn new(vars: Vec<(String, Var)>, params: AdamWParams) -> Result<Self> {
        let vars = vars
            .into_iter()
            .map(|(n, v)| {
                let z = v.as_tensor().zeros_like()?;
                Ok((n, v, z.clone(), z))
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            vars,
            params,
            step: 0,
        })
    }

    /// Steps taken so far.
    pub fn step_count(&self) -> usize {
        self.step
    }

    /// Sets the learning rate for the next steps.
    pub fn set_lr(&mut self, lr: f64) {
        self.params.lr = lr;
    }

    /// Global L2 norm of the gradients; scales them down to `max_norm` when above it.
    pub fn clip_grad_norm(&self, grads: &mut GradStore, max_norm: f64) -> Result<f64> {
        let mut sq = 0f64;
        for (_, v, _, _) in &self.vars {
            if let Some(g) = grads.get(v.as_tensor()) {
                // f32 on the CPU: summed in f64 where it lies, without a squared copy.
                sq += match with_f32(g, |x| x.iter().map(|&e| (e as f64) * (e as f64)).sum()) {
                    Some(s) => s,
                    None => g
                        .sqr()?
                        .sum_all()?
                        .to_dtype(candle_core::DType::F64)?
                        .to_scalar::<f64>()?,
                };
            }
        }
        let norm = sq.sqrt();
        if norm > max_norm && norm.is_finite() {
            let scale = max_norm / norm;
            for (_, v, _, _) in &self.vars {
                if let Some(g) = grads.remove(v.as_tensor()) {
                    grads.insert(v.as_tensor(), (g * scale)?);
                }
            }
        }
        Ok(norm)
    }

    /// One update from `grads`.
    pub fn step(&mut self, grads: &GradStore) -> Result<()> {
        self.step += 1;
        let p = &self.params;
        let t = self.step as i32;
        let (c1, c2) = (1.0 - p.beta1.powi(t), 1.0 - p.beta2.powi(t));
        for (_, var, m, v) in self.vars.iter_mut() {
            let Some(g) = grads.get(var.as_tensor()) else {
                continue;
            };
            let decay = if var.rank() >= 2 { p.weight_decay } else { 0.0 };
            let k = Step {
                beta1: p.beta1 as f32,
                beta2: p.beta2 as f32,
                c1: c1 as f32,
                c2: c2 as f32,
                eps: p.eps as f32,
                lr: p.lr as f32,
                shrink: (1.0 - p.lr * decay) as f32,
            };
            let (w, m_next, v_next) = match step_cpu(var.as_tensor(), g, m, v, &k)? {
                Some(next) => next,
                None => step_tensors(var.as_tensor(), g, m, v, &k)?,
            };
            var.set(&w)?;
            (*m, *v) = (m_next, v_next);
        }
        Ok(())
    }

    /// The moments by variable name, plus the step count, for saving.
    pub fn state(&self) -> Result<HashMap<String, Tensor>> {
        let mut out = HashMap::new();
        for (n, _, m, v) in &self.vars {
            out.insert(format!("{n}.m"), m.clone());
            out.insert(format!("{n}.v"), v.clone());
        }
        out.insert(
            "step".into(),
            Tensor::new(
                self.step as i64,
                self.vars
                    .first()
                    .map_or(&candle_core::Device::Cpu, |v| v.1.device()),
            )?,
        );
        Ok(out)
    }

    /// Restores what [`Self::state`] saved; every variable must be there with its shape.
    pub fn load_state(&mut self, state: &HashMap<String, Tensor>) -> Result<()> {
        for (n, var, m, v) in self.vars.iter_mut() {
            for (suffix, slot) in [("m", m), ("v", v)] {
                let Some(t) = state.get(&format!("{n}.{suffix}")) else {
                    bail!("optimizer state lacks {n}.{suffix}")
                };
                if t.shape() != var.shape() {
                    bail!(
                        "optimizer state {n}.{suffix} is {:?}, the variable {:?}",
                        t.dims(),
                        var.dims()
                    )
                }
                *slot = t.to_dtype(var.dtype())?.to_device(var.device())?;
            }
        }
        match state.get("step") {
            Some(s) => {
                self.step = s
                    .to_dtype(candle_core::DType::I64)?
                    .to_scalar::<i64>()?
                    .max(0) as usize
            }
            None => bail!("optimizer state lacks its step count"),
        }
        Ok(())
    }
}

/// The constants of one AdamW update of one variable.
struct Step {
    beta1: f32,
    beta2: f32,
    /// Bias corrections `1 - beta^t`.
    c1: f32,
    c2: f32,
    eps: f32,
    lr: f32,
    /// `1 - lr · weight_decay`.
    shrink: f32,
}

/// The update as tensor ops, on any device and dtype.
fn step_tensors(
    w: &Tensor,
    g: &Tensor,
    m: &Tensor,
    v: &Tensor,
    k: &Step,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (b1, b2) = (k.beta1 as f64, k.beta2 as f64);
    let m = ((m * b1)? + (g * (1.0 - b1))?)?;
    let v = ((v * b2)? + (g.sqr()? * (1.0 - b2))?)?;
    let update = ((&m / k.c1 as f64)? / ((&v / k.c2 as f64)?.sqrt()? + k.eps as f64)?)?;
    let w = ((w * k.shrink as f64)? - (update * k.lr as f64)?)?;
    Ok((w.detach(), m.detach(), v.detach()))
}

/// The values of a contiguous f32 CPU tensor, read under its storage's lock.
fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Option<R> {
    let (s, l) = t.storage_and_layout();
    let (a, b) = l.contiguous_offsets()?;
    match &*s {
        Storage::Cpu(CpuStorage::F32(v)) => v.get(a..b).map(f),
        _ => None,
    }
}

/// One pass over `w`, `g` and the moments on the CPU (f32, contiguous), split over rayon's
/// pool: the same arithmetic as the tensor ops of [`AdamW::step`] without their dozen
/// temporaries per variable. `None` where the tensors are elsewhere or laid out otherwise.
fn step_cpu(
    w: &Tensor,
    g: &Tensor,
    m: &Tensor,
    v: &Tensor,
    k: &Step,
) -> Result<Option<(Tensor, Tensor, Tensor)>> {
    let n = w.elem_count();
    let (mut w1, mut m1, mut v1) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
    let done = with_f32(w, |w0| {
        with_f32(g, |g0| {
            with_f32(m, |m0| {
                with_f32(v, |v0| {
                    if [w0.len(), g0.len(), m0.len(), v0.len()] != [n; 4] {
                        return false;
                    }
                    update(k, (w0, g0, m0, v0), (&mut w1, &mut m1, &mut v1));
                    true
                })
            })
        })
    });
    if done != Some(Some(Some(Some(true)))) {
        return Ok(None);
    }
    let (shape, dev) = (w.shape(), w.device());
    Ok(Some((
        Tensor::from_vec(w1, shape, dev)?,
        Tensor::from_vec(m1, shape, dev)?,
        Tensor::from_vec(v1, shape, dev)?,
    )))
}

#[allow(clippy::type_complexity)]
fn update(
    k: &Step,
    (w0, g0, m0, v0): (&[f32], &[f32], &[f32], &[f32]),
    (w1, m1, v1): (&mut [f32], &mut [f32], &mut [f32]),
) {
    const CHUNK: usize = 1 << 14;
    w1.par_chunks_mut(CHUNK)
        .zip(m1.par_chunks_mut(CHUNK))
        .zip(v1.par_chunks_mut(CHUNK))
        .enumerate()
        .for_each(|(c, ((w1, m1), v1))| {
            let r = c * CHUNK..c * CHUNK + w1.len();
            let (w0, g0, m0, v0) = (&w0[r.clone()], &g0[r.clone()], &m0[r.clone()], &v0[r]);
            for i in 0..w1.len() {
                let g = g0[i];
                let m = m0[i] * k.beta1 + g * (1.0 - k.beta1);
                let v = v0[i] * k.beta2 + g * g * (1.0 - k.beta2);
                let update = (m / k.c1) / ((v / k.c2).sqrt() + k.eps);
                w1[i] = w0[i] * k.shrink - update * k.lr;
                m1[i] = m;
                v1[i] = v;
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, D};

    /// The fused CPU update equals the tensor ops it replaces, with and without weight
    /// decay, early (large bias corrections) and late, over several chunks.
    #[test]
    fn fused_step_equals_tensor_ops() -> Result<()> {
        let dev = Device::Cpu;
        let r = |seed: f64| -> Result<Tensor> {
            Tensor::arange(0f32, 40_000.0, &dev)?
                .reshape((200, 200))?
                .affine(seed * 1e-3, seed)?
                .sin()
        };
        let (w, g, m) = (r(1.0)?, r(2.0)?, (r(3.0)? * 0.1)?);
        let v = (r(4.0)?.sqr()? * 0.01)?;
        for (t, decay) in [(1, 0.1), (50, 0.0), (1000, 0.1)] {
            let k = Step {
                beta1: 0.9,
                beta2: 0.95,
                c1: 1.0 - 0.9f32.powi(t),
                c2: 1.0 - 0.95f32.powi(t),
                eps: 1e-8,
                lr: 3e-3,
                shrink: 1.0 - 3e-3 * decay,
            };
            let fused = step_cpu(&w, &g, &m, &v, &k)?.expect("f32 CPU tensors take the fused path");
            let plain = step_tensors(&w, &g, &m, &v, &k)?;
            for (a, b) in [
                (&fused.0, &plain.0),
                (&fused.1, &plain.1),
                (&fused.2, &plain.2),
            ] {
                // Candle divides by multiplying with the reciprocal: a few ulps apart.
                let excess = ((a - b)?.abs()? - (b.abs()? * 1e-5)?)?;
                let worst = excess
                    .max_keepdim(D::Minus1)?
                    .max_all()?
                    .to_scalar::<f32>()?;
                assert!(
                    worst <= 1e-6,
                    "step {t}: fused and tensor-op AdamW differ by {worst} beyond 1e-5 relative"
                );
            }
        }
        // Elsewhere than f32 on the CPU, the tensor ops run.
        let w64 = w.to_dtype(DType::F64)?;
        let k = Step {
            beta1: 0.9,
            beta2: 0.95,
            c1: 0.1,
            c2: 0.05,
            eps: 1e-8,
            lr: 1e-3,
            shrink: 1.0,
        };
        assert!(step_cpu(&w64, &w64, &w64, &w64, &k)?.is_none());
        Ok(())
    }
}
