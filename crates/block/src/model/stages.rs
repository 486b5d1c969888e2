//! The first stage of a forward pass whose output is not finite, named when the logits are
//! not.

use candle_core::{DType, Result, Tensor};

/// The stages of a forward pass (embeddings, each block), to name the first whose output
/// is not finite when the logits are not. On the CPU each output is checked as the pass
/// goes, a read with nothing kept: holding every block's output (as references) would
/// raise a prefill's peak memory by all of them. On
/// other devices the outputs are kept and read only if the logits are not finite: a check
/// per stage would wait on the device at every block. Training skips all of it.
pub(super) enum Stages {
    Off,
    Checked(Option<String>),
    Kept(Vec<(String, Tensor)>),
}

impl Stages {
    pub(super) fn new(xs: &Tensor, train: bool) -> Self {
        match (train, gpt_kernels::cpu_kernels(xs.device())) {
            (true, _) => Self::Off,
            (false, true) => Self::Checked(None),
            (false, false) => Self::Kept(Vec::new()),
        }
    }

    pub(super) fn push(&mut self, name: impl FnOnce() -> String, xs: &Tensor) -> Result<()> {
        match self {
            Self::Off | Self::Checked(Some(_)) => {}
            Self::Checked(first) => {
                if !all_finite(xs)? {
                    *first = Some(name());
                }
            }
            Self::Kept(stages) => stages.push((name(), xs.clone())),
        }
        Ok(())
    }

    pub(super) fn first_non_finite(&self) -> Result<Option<String>> {
        match self {
            Self::Off => Ok(None),
            Self::Checked(first) => Ok(first.clone()),
            Self::Kept(stages) => {
                for (name, t) in stages {
                    if !all_finite(t)? {
                        return Ok(Some(name.clone()));
                    }
                }
                Ok(None)
            }
        }
    }
}

/// From this many values on, [`all_finite`] reads its input on two threads.
const PARALLEL_VALUES: usize = 1 << 16;

/// Whether every value of `t` is finite: read on the CPU (f32 where it lies), reduced on
/// other devices.
pub(super) fn all_finite(t: &Tensor) -> Result<bool> {
    if gpt_kernels::cpu_kernels(t.device()) {
        // Branch-free within a chunk, so the compiler vectorizes it.
        let finite = |c: &[f32]| c.iter().fold(true, |ok, v| ok & v.is_finite());
        return gpt_kernels::dense::with_f32_values(t, |x| {
            if x.len() < PARALLEL_VALUES {
                return Ok(x.chunks(1024).all(finite));
            }
            // A vocabulary's logits in two halves at once, each likely in the cache of the
            // thread whose product wrote it.
            let half = x.len().div_ceil(2);
            let part = |i: usize| &x[i * half..((i + 1) * half).min(x.len())];
            let halves = gpt_kernels::team::map(2, |i| part(i).chunks(1024).all(finite));
            Ok(halves.into_iter().all(|ok| ok))
        });
    }
    all_finite_on_device(t)
}

fn all_finite_on_device(t: &Tensor) -> Result<bool> {
    let s = (t * 0.0)?
        .to_dtype(DType::F32)?
        .sum_all()?
        .to_scalar::<f32>()?;
    Ok(s == 0.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Both ways of finding the first non-finite stage name the same one, for f32 (read in
    /// place) and f16 (reduced on the device), a narrowed view among them; training names
    /// none.
    #[test]
    fn stages_name_the_first_non_finite_output() -> Result<()> {
        let dev = Device::Cpu;
        let fine = Tensor::ones((2, 3, 4), DType::F32, &dev)?;
        let mut values = vec![1f32; 24];
        values[17] = f32::INFINITY;
        let inf = Tensor::from_vec(values, (2, 3, 4), &dev)?;
        let nan = (&fine * f64::NAN)?.narrow(2, 1, 2)?;
        for dtype in [DType::F32, DType::F16] {
            let (fine, inf, nan) = (fine.to_dtype(dtype)?, inf.to_dtype(dtype)?, nan.clone());
            for mut stages in [Stages::Checked(None), Stages::Kept(Vec::new()), Stages::Off] {
                stages.push(|| "a".into(), &fine)?;
                assert_eq!(stages.first_non_finite()?, None);
                stages.push(|| "b".into(), &inf)?;
                stages.push(|| "c".into(), &nan)?;
                stages.push(|| "d".into(), &fine)?;
                let want = match stages {
                    Stages::Off => None,
                    _ => Some("b".to_string()),
                };
                assert_eq!(stages.first_non_finite()?, want);
            }
        }
        assert!(!all_finite(&nan)?);
        assert!(all_finite(&fine.narrow(1, 1, 2)?)?);
        // Read in two halves (an odd count): a non-finite value anywhere is seen.
        let n = PARALLEL_VALUES + 3;
        assert!(all_finite(&Tensor::ones(n, DType::F32, &dev)?)?);
        for at in [0, n / 2 - 1, n / 2, n / 2 + 1, n - 1] {
            for bad in [f32::NAN, f32::NEG_INFINITY] {
                let mut values = vec![1f32; n];
                values[at] = bad;
                assert!(
                    !all_finite(&Tensor::from_vec(values, n, &dev)?)?,
                    "{bad} at {at}"
                );
            }
        }
        Ok(())
    }
}
