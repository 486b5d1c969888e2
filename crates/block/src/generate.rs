//! Sampling and batched generation with a KV cache.

use candle_core::{bail, DType, Device, Result, Tensor};

use crate::model::{Gpt, Logits};

/// How the next token is chosen.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; 0 is greedy (argmax, ties to the lowest id).
    pub temperature: f64,
    /// Keep only the `k` most likely tokens.
    pub top_k: Option<usize>,
    /// Keep the smallest set of most likely tokens whose probability reaches `p`, in (0, 1].
    pub top_p: Option<f64>,
    /// Divide positive logits (multiply negative ones) of tokens already in the sequence by
    /// this (CTRL's penalty, as Hugging Face applies it); 1 is off.
    pub repeat_penalty: f32,
    /// Seed of the sampling stream; every row of a batch starts from it, so a row samples as
    /// it would alone.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: None,
            top_p: None,
            repeat_penalty: 1.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Checks the ranges; the error names the value.
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            bail!("temperature must be >= 0, got {}", self.temperature)
        }
        if self.top_k == Some(0) {
            bail!("top-k must be at least 1")
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                bail!("top-p must be in (0, 1], got {p}")
            }
        }
        if !(self.repeat_penalty > 0.0 && self.repeat_penalty.is_finite()) {
            bail!("repeat penalty must be > 0, got {}", self.repeat_penalty)
        }
        Ok(())
    }
}

/// SplitMix64: a tiny generator whose stream is the same on every platform and version,
/// so seeded runs (sampling, batches, initialisation) repeat exactly. The state is public
/// so that it can be saved and restored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform number in `[0, 1)`.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// A number in `0..n`; 0 when `n` is 0.
    pub fn below(&mut self, n: usize) -> usize {
        self.next_u64().checked_rem(n as u64).unwrap_or(0) as usize
    }
}

/// Picks tokens from logits; one per sequence, as its random stream is its own.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: SplitMix64,
}

impl Sampler {
    /// A sampler whose stream starts at `params.seed`.
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        Ok(Self {
            rng: SplitMix64(params.seed),
            params,
        })
    }

    /// The next token given the logits of one position and the tokens so far.
    pub fn sample(&mut self, logits: &[f32], context: &[u32]) -> Result<u32> {
        if logits.is_empty() {
            bail!("no logits to sample from")
        }
        // Branch-free within a chunk, so the compiler vectorises the common case.
        let nan = |c: &[f32]| c.iter().fold(false, |any, x| any | x.is_nan());
        if logits.chunks(1024).any(nan) {
            let bad = logits.iter().position(|x| x.is_nan()).unwrap_or(0);
            bail!("logit {bad} is NaN: the model produced invalid numbers")
        }
        let p = &self.params;
        // Copied only when the penalty changes them (a vocabulary's logits are ~600 KB).
        let mut logits = std::borrow::Cow::Borrowed(logits);
        if p.repeat_penalty != 1.0 {
            let logits = logits.to_mut();
            let mut seen = context.to_vec();
            seen.sort_unstable();
            seen.dedup();
            for &id in &seen {
                if let Some(l) = logits.get_mut(id as usize) {
                    *l = if *l < 0.0 {
                        *l * p.repeat_penalty
                    } else {
                        *l / p.repeat_penalty
                    };
                }
            }
        }
        if p.temperature == 0.0 {
            return Ok(argmax(&logits));
        }
        let best = argmax(&logits) as usize;
        let max = logits[best] as f64;
        if !max.is_finite() {
            return Ok(best as u32);
        }
        let weight = |l: f32| ((l as f64 - max) / p.temperature).exp();
        let top_p = p.top_p.filter(|&x| x < 1.0);
        if p.top_k.is_none() && top_p.is_none() {
            // Nothing is cut off, so the candidates' order does not matter: one pass in
            // vocabulary order instead of sorting the vocabulary for every token.
            let weights: Vec<f64> = logits.iter().map(|&l| weight(l)).collect();
            let total: f64 = weights.iter().sum();
            let mut u = self.rng.uniform() * total;
            for (id, &w) in weights.iter().enumerate() {
                if u < w {
                    return Ok(id as u32);
                }
                u -= w;
            }
            return Ok(best as u32);
        }
        // Candidates, most likely first; ties keep the lower id first. With top-k only the
        // k best are sorted.
        let cmp = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
        let mut order: Vec<usize> = (0..logits.len()).collect();
        if let Some(k) = p.top_k.filter(|&k| k < order.len()) {
            order.select_nth_unstable_by(k - 1, cmp);
            order.truncate(k);
        }
        order.sort_by(cmp);
        let mut probs: Vec<f64> = order.iter().map(|&i| weight(logits[i])).collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= total);
        if let Some(top_p) = top_p {
            let mut cum = 0.0;
            let keep = probs
                .iter()
                .position(|&x| {
                    cum += x;
                    cum >= top_p
                })
                .map_or(probs.len(), |i| i + 1);
            order.truncate(keep);
            probs.truncate(keep);
            let total: f64 = probs.iter().sum();
            probs.iter_mut().for_each(|x| *x /= total);
        }
        let mut u = self.rng.uniform();
        for (&id, &prob) in order.iter().zip(&probs) {
            if u < prob {
                return Ok(id as u32);
            }
            u -= prob;
        }
        Ok(order[order.len() - 1] as u32)
    }
}

/// Index of the largest value; the lowest index wins a tie, a NaN is never chosen (0 when
/// nothing else is there).
pub fn argmax(xs: &[f32]) -> u32 {
    // Vectorised: a loop that compared each value with the best so far was 1% of decoding
    // Qwen3-0.6B (a vocabulary of 151,936).
    gpt_kernels::simd::argmax(xs) as u32
}

/// Prompts as one left-padded batch, so that every row's last token sits in the last
/// column: the ids `[b, longest]` (padding 0) and the matching `keep` mask (1 for real
/// tokens), as [`Gpt::infer`] takes them.
pub fn left_padded<P: AsRef<[u32]>>(prompts: &[P], dev: &Device) -> Result<(Tensor, Tensor)> {
    let longest = prompts.iter().map(|p| p.as_ref().len()).max().unwrap_or(0);
    let b = prompts.len();
    let mut ids = Vec::with_capacity(b * longest);
    let mut keep = Vec::with_capacity(b * longest);
    for p in prompts {
        let p = p.as_ref();
        let pad = longest - p.len();
        ids.extend(std::iter::repeat_n(0u32, pad).chain(p.iter().copied()));
        keep.extend(std::iter::repeat_n(0u8, pad).chain(std::iter::repeat_n(1u8, p.len())));
    }
    Ok((
        Tensor::from_vec(ids, (b, longest), dev)?,
        Tensor::from_vec(keep, (b, longest), dev)?,
    ))
}

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    /// Most new tokens per prompt.
    pub max_new_tokens: usize,
    /// How tokens are picked.
    pub sampling: SamplingParams,
    /// Tokens that end a sequence (included in its output).
    pub stop_tokens: Vec<u32>,
}

/// What a [`generate_steered`] hook decides for a row before its next token is sampled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Steer {
    /// Sample from the logits (as the hook left them).
    Sample,
    /// End the row here, without another token.
    End,
}

/// Generates continuations of `prompts` as one left-padded batch with a KV cache.
///
/// `on_token(row, token)` sees each new token as it is chosen (for streaming) and may
/// return `false` to end that row (a stop text, say). Returns the new tokens of each row.
/// Each row's tokens equal those of its prompt run alone.
pub fn generate(
    model: &Gpt,
    prompts: &[Vec<u32>],
    opts: &GenerateOptions,
    on_token: impl FnMut(usize, u32) -> bool,
) -> Result<Vec<Vec<u32>>> {
    run(model, prompts, opts, None, on_token)
}

/// As [`generate`], with `steer(row, logits)` called before each row's token is sampled:
/// it may change the logits (set a token's to `-inf` to forbid it, as a grammar does) or
/// end the row.
pub fn generate_steered(
    model: &Gpt,
    prompts: &[Vec<u32>],
    opts: &GenerateOptions,
    mut steer: impl FnMut(usize, &mut [f32]) -> Result<Steer>,
    on_token: impl FnMut(usize, u32) -> bool,
) -> Result<Vec<Vec<u32>>> {
    run(model, prompts, opts, Some(&mut steer), on_token)
}

/// A hook of [`generate_steered`].
type SteerHook<'a> = &'a mut dyn FnMut(usize, &mut [f32]) -> Result<Steer>;

/// [`generate_steered`], or without a hook [`generate`]: then each row samples from the
/// logits where the model left them, not from a copy (a vocabulary's logits are ~1 MB,
/// whose copy took 1–2% of a decoding step of Gemma-3-270M).
fn run(
    model: &Gpt,
    prompts: &[Vec<u32>],
    opts: &GenerateOptions,
    mut steer: Option<SteerHook>,
    mut on_token: impl FnMut(usize, u32) -> bool,
) -> Result<Vec<Vec<u32>>> {
    let cfg = model.config();
    let b = prompts.len();
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    if b == 0 || prompts.iter().any(Vec::is_empty) {
        bail!("every prompt needs at least one token")
    }
    if longest + opts.max_new_tokens > cfg.n_positions {
        bail!(
            "prompt of {longest} tokens + {} new tokens exceeds the model's context of {} positions",
            opts.max_new_tokens,
            cfg.n_positions
        )
    }
    let dev = model.device();
    let mut samplers = vec![Sampler::new(opts.sampling.clone())?; b];
    let (mut input, mut keep_t) = left_padded(prompts, dev)?;
    let padded = prompts.iter().any(|p| p.len() != longest);
    let mut cache = model.new_cache(longest + opts.max_new_tokens);
    let mut history: Vec<Vec<u32>> = prompts.to_vec();
    let mut out = vec![Vec::new(); b];
    let mut done = vec![false; b];
    for _ in 0..opts.max_new_tokens {
        let keep_arg = padded.then_some(&keep_t);
        // (b, 1, vocab)
        let logits = model.infer(&input, keep_arg, Some(&mut cache), Logits::Last)?;
        let logits = logits.squeeze(1)?;
        // Each live row's token; `None` for a row that has ended.
        let tokens: Vec<Option<u32>> = match steer.as_mut() {
            Some(steer) => {
                let mut rows = logits.to_dtype(DType::F32)?.to_vec2::<f32>()?;
                let mut tokens = Vec::with_capacity(b);
                for (row, row_logits) in rows.iter_mut().enumerate() {
                    if !done[row] && steer(row, row_logits)? == Steer::End {
                        done[row] = true;
                    }
                    tokens.push(match done[row] {
                        true => None,
                        false => Some(samplers[row].sample(row_logits, &history[row])?),
                    });
                }
                tokens
            }
            None => gpt_kernels::dense::with_f32_values(&logits, |all| {
                let vocab = all.len() / b;
                (0..b)
                    .map(|row| match done[row] {
                        true => Ok(None),
                        false => samplers[row]
                            .sample(&all[row * vocab..(row + 1) * vocab], &history[row])
                            .map(Some),
                    })
                    .collect()
            })?,
        };
        let mut next = Vec::with_capacity(b);
        for (row, tok) in tokens.into_iter().enumerate() {
            let Some(tok) = tok else {
                next.push(0);
                continue;
            };
            history[row].push(tok);
            out[row].push(tok);
            let go_on = on_token(row, tok);
            done[row] = !go_on || opts.stop_tokens.contains(&tok);
            next.push(tok);
        }
        if done.iter().all(|&d| d) {
            break;
        }
        input = Tensor::from_vec(next, (b, 1), dev)?;
        if padded {
            keep_t = Tensor::cat(&[&keep_t, &Tensor::ones((b, 1), DType::U8, dev)?], 1)?;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vectorised argmax against the plain loop over every value, on lengths around
    /// the 16 lanes, ties, infinities and NaNs.
    #[test]
    fn argmax_equals_the_plain_loop() {
        let plain = |xs: &[f32]| {
            let mut best: Option<usize> = None;
            for (i, &x) in xs.iter().enumerate() {
                if !x.is_nan() && best.is_none_or(|b| x > xs[b]) {
                    best = Some(i);
                }
            }
            best.unwrap_or(0) as u32
        };
        let mut seed = 7u64;
        for len in [0, 1, 5, 15, 16, 17, 33, 100, 151_936] {
            for case in 0..4 {
                let mut xs: Vec<f32> = (0..len)
                    .map(|_| {
                        seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                        ((seed >> 40) % 50) as f32 // many ties
                    })
                    .collect();
                if len > 3 {
                    match case {
                        1 => xs[len / 2] = f32::NAN,
                        2 => xs[0] = f32::NAN,
                        3 => xs.iter_mut().for_each(|x| *x = f32::NEG_INFINITY),
                        _ => {}
                    }
                }
                assert_eq!(argmax(&xs), plain(&xs), "length {len}, case {case}");
            }
        }
        assert_eq!(argmax(&[f32::NAN, f32::NAN]), 0);
        assert_eq!(argmax(&[1.0, f32::INFINITY, f32::INFINITY]), 1);
    }
}
