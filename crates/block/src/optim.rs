//! AdamW whose state can be saved and restored, so training can resume exactly.

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{bail, Result, Tensor, Var};

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
                sq += g
                    .sqr()?
                    .sum_all()?
                    .to_dtype(candle_core::DType::F64)?
                    .to_scalar::<f64>()?;
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
            *m = ((&*m * p.beta1)? + (g * (1.0 - p.beta1))?)?;
            *v = ((&*v * p.beta2)? + (g.sqr()? * (1.0 - p.beta2))?)?;
            let update = ((&*m / c1)? / ((&*v / c2)?.sqrt()? + p.eps)?)?;
            let decay = if var.rank() >= 2 { p.weight_decay } else { 0.0 };
            let w = var.as_tensor();
            let next = ((w * (1.0 - p.lr * decay))? - (update * p.lr)?)?;
            var.set(&next.detach())?;
            *m = m.detach();
            *v = v.detach();
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
