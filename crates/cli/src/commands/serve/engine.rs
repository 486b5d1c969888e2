//! The scheduler: one thread owns the model and runs continuous batching. New requests
//! join the running batch at the next decoding step (each prefilled alone into its own
//! KV cache), every step decodes one token for every sequence in one batched pass
//! ([`Gpt::infer_rows`]: the weights are read once per step, not once per sequence), and
//! a sequence leaves as soon as it ends or its client goes away.
//!
//! A sequence that leaves gives its keys and values to the [`PromptCache`]; a new prompt
//! that begins as an earlier sequence did starts from them and prefills only the rest.

use std::borrow::Cow;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Result};
use candle_core::{DType, Tensor};
use gpt_blocks::{left_padded, Gpt, GptCache, Logits};
use rayon::prelude::*;

use super::job::{Event, Failure, Job, TokenOut};
use super::metrics::Metrics;
use super::prompt_cache::PromptCache;
use super::queue::Queue;
use super::shared::Shared;
use crate::text::grammar::{Allowed, Constrained};

/// A sequence in the running batch.
struct Seq {
    job: Job,
    cache: GptCache,
    /// Prompt and generated tokens (the repetition penalty reads them).
    history: Vec<u32>,
    generated: usize,
}

impl Seq {
    fn last(&self) -> u32 {
        self.history[self.history.len() - 1]
    }
}

/// Fewest prompt tokens worth restoring from the prompt cache: a prompt that finds fewer
/// prefills from scratch, in a group with the others admitted with it.
const MIN_HIT: usize = 16;

/// The part of `prompt` the prompt cache may supply: all but its last token, whose
/// logits the first generated token needs.
fn reusable(prompt: &[u32]) -> &[u32] {
    &prompt[..prompt.len().saturating_sub(1)]
}

/// Runs the scheduler until shutdown has drained the running sequences, or cancelled them
/// at `shared`'s deadline.
///
/// A failure belongs to one sequence, never to the batch it ran in: a group prefill that
/// fails is run again prompt by prompt, a decoding step that fails is undone (every cache
/// truncated to its length before the step) and run again sequence by sequence, and a
/// sequence whose sampling fails leaves alone. Only what fails on its own is reported.
pub fn run(model: &Gpt, queue: &Queue, shared: &Shared, max_batch: usize, cache: &mut PromptCache) {
    let metrics = &shared.metrics;
    let mut active: Vec<Seq> = Vec::new();
    // Sequences that ended well, their caches to be kept.
    let mut done: Vec<Seq> = Vec::new();
    let mut busy = false;
    loop {
        // Idle again after work: the finished sequences' caches go back to the OS, not to
        // the next burst's peak.
        if busy && active.is_empty() {
            crate::alloc::release_freed_memory();
        }
        busy = !active.is_empty();
        if let Some(deadline) = shared.deadline() {
            // Nothing new starts; what waits in the queue is told so.
            for job in queue.close() {
                job.send(Event::Failed(Failure::ShutDown(
                    "the server is shutting down".into(),
                )));
            }
            if Instant::now() >= deadline {
                for s in active.drain(..) {
                    s.job.send(Event::Failed(Failure::ShutDown(
                        "the server shut down before this request finished".into(),
                    )));
                }
            }
            if active.is_empty() {
                metrics.batch_size.store(0, Ordering::Relaxed);
                metrics.cached_positions.store(0, Ordering::Relaxed);
                return;
            }
        } else {
            // Admit new sequences up to the batch size: wait when idle, else take only
            // what is already queued.
            let mut admitted = Vec::new();
            while active.len() + admitted.len() < max_batch {
                let job = match active.is_empty() && admitted.is_empty() {
                    true => queue.pop_wait(Duration::from_millis(50)),
                    false => queue.try_pop(),
                };
                let Some(job) = job else { break };
                if !job.gone() {
                    admitted.push(job); // else the client left while queued
                }
            }
            let prefilled = !admitted.is_empty();
            let (hits, misses): (Vec<Job>, Vec<Job>) = admitted
                .into_iter()
                .partition(|j| cache.matched(reusable(&j.prompt)) >= MIN_HIT);
            // Prompts that share a beginning the cache lacks (a system prompt many clients
            // send at once): the first prefills it, the others restore it after.
            let (leaders, followers) = split_shared(misses);
            for group in prefill_groups(leaders) {
                let seqs = prefill_group(model, group, metrics, &mut done);
                keep_prompts(cache, &seqs);
                active.extend(seqs);
            }
            for job in hits.into_iter().chain(followers) {
                let seqs = prefill_cached(model, job, cache, metrics, &mut done);
                keep_prompts(cache, &seqs);
                active.extend(seqs);
            }
            if prefilled {
                // The prefills' temporaries go back before the decoding steps.
                crate::alloc::release_freed_memory();
            }
        }
        // A client that disconnected frees its slot now (what it computed is kept).
        let (gone, going): (Vec<Seq>, Vec<Seq>) = active.drain(..).partition(|s| s.job.gone());
        active = going;
        done.extend(gone);
        keep_all(cache, &mut done, metrics);
        metrics
            .batch_size
            .store(active.len() as u64, Ordering::Relaxed);
        if active.is_empty() {
            continue;
        }
        metrics.step_batch.observe(active.len() as f64);
        step_all(model, &mut active, metrics, &mut done);
        keep_all(cache, &mut done, metrics);
        metrics
            .batch_size
            .store(active.len() as u64, Ordering::Relaxed);
        let cached: usize = active.iter().map(|s| s.cache.len()).sum();
        metrics
            .cached_positions
            .store(cached as u64, Ordering::Relaxed);
    }
}

/// Gives the caches of the sequences in `done` to the prompt cache, each keyed by the
/// tokens it holds (the prompt and every generated token but the last, never run).
fn keep_all(cache: &mut PromptCache, done: &mut Vec<Seq>, metrics: &Metrics) {
    for seq in done.drain(..) {
        let n = seq.cache.len().min(seq.history.len());
        // A failure here loses only a future hit.
        let _ = catch(|| cache.insert(&seq.history[..n], &seq.cache));
    }
    metrics
        .prompt_cache_bytes
        .store(cache.bytes() as u64, Ordering::Relaxed);
}

/// Gives the prompt cache the prompts of just prefilled sequences, so that prompts admitted
/// while they run can start from them.
fn keep_prompts(cache: &mut PromptCache, seqs: &[Seq]) {
    for seq in seqs {
        let n = seq.cache.len().min(seq.history.len());
        let _ = catch(|| cache.insert(&seq.history[..n], &seq.cache));
    }
}

/// `jobs` split into those to prefill first and those that begin (at least [`MIN_HIT`]
/// tokens) as one of the first do, to restore that beginning from the prompt cache after.
fn split_shared(jobs: Vec<Job>) -> (Vec<Job>, Vec<Job>) {
    let mut order: Vec<usize> = (0..jobs.len()).collect();
    order.sort_by(|&a, &b| jobs[a].prompt.cmp(&jobs[b].prompt));
    // Sorted, prompts that share a beginning are neighbours; each one's first leads.
    let mut follows = vec![false; jobs.len()];
    for w in order.windows(2) {
        let (a, b) = (reusable(&jobs[w[0]].prompt), reusable(&jobs[w[1]].prompt));
        let shared = a.iter().zip(b).take_while(|(x, y)| x == y).count();
        follows[w[1]] = shared >= MIN_HIT;
    }
    let mut follows = follows.into_iter();
    jobs.into_iter()
        .partition(|_| !follows.next().unwrap_or(false))
}

/// Runs `f`, turning a panic into an error.
fn catch<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let msg = p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown".into());
        Err(anyhow!("internal error: {msg}"))
    })
}

/// Most positions (prompts × padded length) prefilled in one pass.
const PREFILL_POSITIONS: usize = 4096;

/// Newly admitted jobs in groups to prefill together: prompts of similar length (sorted,
/// with padding kept under half the real tokens), each group within [`PREFILL_POSITIONS`].
fn prefill_groups(mut jobs: Vec<Job>) -> Vec<Vec<Job>> {
    jobs.sort_by_key(|j| j.prompt.len());
    let mut groups: Vec<Vec<Job>> = Vec::new();
    for job in jobs {
        let len = job.prompt.len();
        let fits = groups.last().is_some_and(|g| {
            let real: usize = g.iter().map(|j| j.prompt.len()).sum::<usize>() + len;
            let padded = (g.len() + 1) * len; // sorted: this prompt is the longest
            padded <= PREFILL_POSITIONS && 2 * padded <= 3 * real + 32
        });
        match (fits, groups.last_mut()) {
            (true, Some(g)) => g.push(job),
            _ => groups.push(vec![job]),
        }
    }
    groups
}

/// Prefills `jobs` together; if that fails, each alone, so that a prompt that cannot run
/// fails only its own request. Returns the sequences that go on.
fn prefill_group(model: &Gpt, jobs: Vec<Job>, metrics: &Metrics, done: &mut Vec<Seq>) -> Vec<Seq> {
    for job in &jobs {
        metrics
            .prompt_cache_queried
            .fetch_add(reusable(&job.prompt).len() as u64, Ordering::Relaxed);
    }
    if jobs.len() > 1 {
        let prompts: Vec<&[u32]> = jobs.iter().map(|j| j.prompt.as_slice()).collect();
        let room: Vec<usize> = jobs.iter().map(|j| j.prompt.len() + j.max_tokens).collect();
        if let Ok((rows, caches)) = catch(|| prefill(model, &prompts, &room)) {
            let cached = std::iter::repeat(0);
            return start(
                jobs.into_iter().zip(caches).zip(rows).zip(cached),
                metrics,
                done,
            );
        }
    }
    let mut going = Vec::new();
    for job in jobs {
        let room = job.prompt.len() + job.max_tokens;
        match catch(|| prefill(model, &[&job.prompt], &[room])) {
            Ok((rows, caches)) => {
                let one = std::iter::once(job).zip(caches).zip(rows).zip([0]);
                going.extend(start(one, metrics, done))
            }
            Err(e) => job.fail(&e),
        }
    }
    going
}

/// Prefills `job` after the longest prefix of its prompt that the prompt cache holds; if
/// that fails, from scratch, so that a bad cache entry costs time, never a request.
fn prefill_cached(
    model: &Gpt,
    job: Job,
    cache: &mut PromptCache,
    metrics: &Metrics,
    done: &mut Vec<Seq>,
) -> Vec<Seq> {
    let run = || -> Result<(Vec<f32>, GptCache, usize)> {
        let mut kv = model.new_cache(job.prompt.len() + job.max_tokens);
        let hit = cache.restore(reusable(&job.prompt), &mut kv)?;
        let ids = Tensor::new(&job.prompt[hit..], model.device())?.unsqueeze(0)?;
        // (1, 1, vocab)
        let logits = model.infer(&ids, None, Some(&mut kv), Logits::Last)?;
        let row = logits
            .flatten_all()?
            .to_dtype(DType::F32)?
            .to_vec1::<f32>()?;
        Ok((row, kv, hit))
    };
    match catch(run) {
        Ok((row, kv, hit)) => {
            let queried = reusable(&job.prompt).len() as u64;
            metrics
                .prompt_cache_queried
                .fetch_add(queried, Ordering::Relaxed);
            metrics
                .prompt_cache_hits
                .fetch_add(hit as u64, Ordering::Relaxed);
            start(std::iter::once((((job, kv), row), hit)), metrics, done)
        }
        Err(_) => prefill_group(model, vec![job], metrics, done),
    }
}

/// Runs `prompts` in one left-padded pass and splits the batch's cache into one cache per
/// prompt (each as the prompt alone would have made it, with room for `room[i]` positions).
/// Returns each prompt's last logits and its cache.
fn prefill(
    model: &Gpt,
    prompts: &[&[u32]],
    room: &[usize],
) -> Result<(Vec<Vec<f32>>, Vec<GptCache>)> {
    let dev = model.device();
    let n = prompts.len();
    let lens: Vec<usize> = prompts.iter().map(|p| p.len()).collect();
    let longest = lens.iter().copied().max().unwrap_or(0);
    let (ids, keep) = left_padded(prompts, dev)?;
    let padded = lens.iter().any(|&l| l != longest);
    // One prompt keeps the batch's cache: give it its whole room at once.
    let capacity = if n == 1 { room[0] } else { longest };
    let mut batch = model.new_cache(capacity);
    // (n, 1, vocab)
    let logits = model.infer(
        &ids,
        padded.then_some(&keep),
        Some(&mut batch),
        Logits::Last,
    )?;
    let logits = logits.squeeze(1)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let caches = match n {
        1 => vec![batch],
        _ => batch.split_left_padded(&lens, room)?,
    };
    Ok((logits, caches))
}

/// Sequences made of prefilled jobs (each with the number of its prompt's tokens that
/// came from the prompt cache), each with its first token picked and sent; those that end
/// at once (one token asked for, a stop token, a client gone) go to `done`, those whose
/// sampler fails are dropped.
fn start(
    prefilled: impl Iterator<Item = (((Job, GptCache), Vec<f32>), usize)>,
    metrics: &Metrics,
    done: &mut Vec<Seq>,
) -> Vec<Seq> {
    let mut going = Vec::new();
    for (((job, cache), row), cached) in prefilled {
        job.send(Event::Started { cached });
        let mut seq = Seq {
            cache,
            history: job.prompt.clone(),
            generated: 0,
            job,
        };
        let first = catch(|| {
            let allowed = seq
                .job
                .constraint
                .as_mut()
                .map(|c| c.allowed())
                .transpose()?;
            advance(&mut seq, &row, allowed, metrics)
        });
        match first {
            Ok(true) => going.push(seq),
            Ok(false) => done.push(seq),
            Err(e) => seq.job.fail(&e),
        }
    }
    going
}

/// One decoding step for every running sequence; those that end leave the batch for
/// `done`, those that fail are dropped.
fn step_all(model: &Gpt, active: &mut Vec<Seq>, metrics: &Metrics, done: &mut Vec<Seq>) {
    let lens: Vec<usize> = active.iter().map(|s| s.cache.len()).collect();
    let last: Vec<u32> = active.iter().map(Seq::last).collect();
    let mut caches = Vec::with_capacity(active.len());
    let mut constraints = Vec::with_capacity(active.len());
    for Seq { cache, job, .. } in active.iter_mut() {
        caches.push(cache);
        constraints.push(job.constraint.as_mut());
    }
    // The constrained sequences' token masks are computed while the forward pass runs
    // (neither reads what the other writes): the forward pass splits its products over the
    // kernels' own team, so an idle worker of rayon's pool takes the masks (when none is
    // free, this thread computes them after the pass).
    let (logits, mut masks) = match constraints.iter().any(Option::is_some) {
        true => rayon::join(
            || decode(model, &last, &mut caches, &lens),
            || mask_all(&mut constraints),
        ),
        false => (decode(model, &last, &mut caches, &lens), Vec::new()),
    };
    let n = active.len();
    masks.resize_with(n, || None);
    // Sampling reads the whole vocabulary per sequence: split it across the cores.
    let sample = |rows: Vec<Result<Cow<[f32]>>>| -> Vec<Result<bool>> {
        active
            .par_iter_mut()
            .zip(rows)
            .zip(masks)
            .map(|((seq, row), allowed)| {
                catch(|| {
                    let allowed = match (allowed, seq.job.constraint.is_some()) {
                        (Some(a), _) => Some(a?),
                        (None, false) => None,
                        (None, true) => bail!("structured output: no token mask was computed"),
                    };
                    advance(seq, &row?, allowed, metrics)
                })
            })
            .collect()
    };
    let outcomes = match logits {
        Decoded::Batch(logits) => {
            let rows = gpt_kernels::dense::with_f32_values(&logits, |all| {
                let vocab = (all.len() / n.max(1)).max(1);
                Ok(sample(
                    all.chunks(vocab).map(|r| Ok(Cow::Borrowed(r))).collect(),
                ))
            });
            rows.unwrap_or_else(|e| (0..n).map(|_| Err(anyhow!("{e}"))).collect())
        }
        Decoded::Rows(rows) => sample(rows.into_iter().map(|r| r.map(Cow::Owned)).collect()),
    };
    let mut kept = Vec::with_capacity(active.len());
    for (seq, outcome) in active.drain(..).zip(outcomes) {
        match outcome {
            Ok(true) => kept.push(seq),
            Ok(false) => done.push(seq),
            Err(e) => seq.job.fail(&e),
        }
    }
    *active = kept;
}

/// The tokens each constrained sequence may take next (`None` for the others).
fn mask_all(constraints: &mut [Option<&mut Constrained>]) -> Vec<Option<Result<Allowed>>> {
    constraints
        .iter_mut()
        .map(|c| c.as_mut().map(|c| catch(|| c.allowed())))
        .collect()
}

/// Each sequence's next-token logits after feeding it `last[i]`: one batched pass, or, if
/// that fails, the pass undone (every cache truncated to `lens[i]`) and each sequence run
/// alone, so that only what fails on its own fails.
fn decode(model: &Gpt, last: &[u32], caches: &mut [&mut GptCache], lens: &[usize]) -> Decoded {
    match catch(|| forward(model, last, caches)) {
        Ok(logits) => Decoded::Batch(logits),
        Err(_) if caches.len() > 1 => Decoded::Rows(
            caches
                .iter_mut()
                .zip(last.iter().zip(lens))
                .map(|(cache, (&id, &len))| {
                    cache.truncate(len);
                    catch(|| {
                        let logits = forward(model, &[id], std::slice::from_mut(cache))?;
                        Ok(logits.flatten_all()?.to_vec1::<f32>()?)
                    })
                })
                .collect(),
        ),
        Err(e) => Decoded::Rows(vec![Err(e)]),
    }
}

/// Each sequence's next-token logits after a decoding step: the rows of the batch's pass,
/// sampled from where the model left them (a copy of a vocabulary's logits per sequence
/// took 1–2% of a decoding step of Gemma-3-270M), or each sequence's own, where the batch
/// failed.
enum Decoded {
    /// `[n, vocab]`, f32.
    Batch(Tensor),
    Rows(Vec<Result<Vec<f32>>>),
}

/// The batched decoding pass: each row's next-token logits `[n, vocab]` (f32) after
/// feeding it `last[i]`.
fn forward(model: &Gpt, last: &[u32], caches: &mut [&mut GptCache]) -> Result<Tensor> {
    let ids = Tensor::from_vec(last.to_vec(), (last.len(), 1), model.device())?;
    // (n, 1, vocab)
    let logits = model.infer_rows(&ids, caches, Logits::Last)?;
    Ok(logits.squeeze(1)?.to_dtype(DType::F32)?)
}

/// Samples the next token from `logits` (among those `allowed`, when the sequence is
/// constrained), sends it, and says whether the sequence goes on. A constrained sequence
/// whose grammar is complete, with nothing that may follow, ends here without a token.
fn advance(
    seq: &mut Seq,
    logits: &[f32],
    allowed: Option<Allowed>,
    metrics: &Metrics,
) -> Result<bool> {
    let id = match &allowed {
        None => seq.job.sampler.sample(logits, &seq.history)?,
        Some(a) if a.must_end() => {
            seq.job.send(Event::Done { stopped: true });
            return Ok(false);
        }
        Some(a) => {
            let mut masked = logits.to_vec();
            a.apply(&mut masked, &seq.job.stop_ids);
            seq.job.sampler.sample(&masked, &seq.history)?
        }
    };
    if let Some(c) = seq.job.constraint.as_mut() {
        if !seq.job.stop_ids.contains(&id) {
            c.commit(id)?;
        }
    }
    metrics.generated_tokens.fetch_add(1, Ordering::Relaxed);
    seq.history.push(id);
    seq.generated += 1;
    let is_stop = seq.job.stop_ids.contains(&id);
    let (logprob, top) = match seq.job.logprobs {
        Some(n) => {
            let logp = log_softmax(logits);
            (Some(logp[id as usize]), top_n(&logp, n))
        }
        None => (None, Vec::new()),
    };
    let token = TokenOut {
        id,
        is_stop,
        logprob,
        top,
    };
    if !seq.job.send(Event::Token(token)) {
        return Ok(false); // the client has gone
    }
    if is_stop || seq.generated >= seq.job.max_tokens {
        seq.job.send(Event::Done { stopped: is_stop });
        return Ok(false);
    }
    Ok(true)
}

/// `log softmax(xs)` in f64 for accuracy, returned in f32.
fn log_softmax(xs: &[f32]) -> Vec<f32> {
    let max = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = xs.iter().map(|&x| (x as f64 - max).exp()).sum();
    let log_z = max + sum.ln();
    xs.iter().map(|&x| (x as f64 - log_z) as f32).collect()
}

/// The `n` largest entries as `(index, value)`, largest first (ties: lower index first).
fn top_n(xs: &[f32], n: usize) -> Vec<(u32, f32)> {
    let mut order: Vec<u32> = (0..xs.len() as u32).collect();
    let n = n.min(xs.len());
    if n == 0 {
        return Vec::new();
    }
    let cmp = |a: &u32, b: &u32| xs[*b as usize].total_cmp(&xs[*a as usize]).then(a.cmp(b));
    order.select_nth_unstable_by(n - 1, cmp);
    order.truncate(n);
    order.sort_by(cmp);
    order.into_iter().map(|i| (i, xs[i as usize])).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    use candle_core::Device;
    use candle_nn::{VarBuilder, VarMap};
    use gpt_blocks::{GptConfig, Sampler, SamplingParams};
    use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

    fn tiny(n_head: usize) -> Gpt {
        let cfg = GptConfig {
            vocab_size: 50,
            n_positions: 40,
            n_embd: 16,
            n_layer: 2,
            n_head,
            ..GptConfig::gpt2()
        };
        let vm = VarMap::new();
        Gpt::new(&cfg, VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu)).unwrap()
    }

    /// A job whose events arrive on the returned receiver; sampled (seeded) so that the
    /// tokens depend on every logit.
    fn seq_job(prompt: &[u32], max_tokens: usize) -> (Job, UnboundedReceiver<(usize, Event)>) {
        let (tx, rx) = unbounded_channel();
        let params = SamplingParams {
            temperature: 0.9,
            seed: prompt.len() as u64,
            ..SamplingParams::default()
        };
        let job = Job {
            index: 0,
            prompt: prompt.to_vec(),
            max_tokens,
            sampler: Sampler::new(params).unwrap(),
            stop_ids: Vec::new(),
            logprobs: Some(2),
            constraint: None,
            events: tx,
            cancel: Arc::new(AtomicBool::new(false)),
            queued_at: Instant::now(),
        };
        (job, rx)
    }

    /// Everything a sequence was sent: its tokens (with log-probabilities), then how it ended.
    fn events(rx: &mut UnboundedReceiver<(usize, Event)>) -> Vec<Event> {
        std::iter::from_fn(|| rx.try_recv().ok().map(|(_, e)| e)).collect()
    }

    fn run_to_end(model: &Gpt, mut active: Vec<Seq>) {
        for _ in 0..100 {
            if active.is_empty() {
                return;
            }
            step_all(model, &mut active, &Metrics::default(), &mut Vec::new());
        }
        panic!("sequences still running after 100 steps");
    }

    /// What `prompt` gives when it runs alone.
    fn alone(model: &Gpt, prompt: &[u32], max_tokens: usize) -> Vec<Event> {
        let (job, mut rx) = seq_job(prompt, max_tokens);
        run_to_end(
            model,
            prefill_group(model, vec![job], &Metrics::default(), &mut Vec::new()),
        );
        events(&mut rx)
    }

    /// A prompt the model cannot run (an id past the vocabulary: the HTTP layer refuses it,
    /// the scheduler must not rely on that) fails alone; the prompts prefilled with it give
    /// what they give alone.
    #[test]
    fn a_failing_prompt_fails_alone_in_its_prefill_group() {
        let model = tiny(4);
        let prompts: [&[u32]; 3] = [&[1, 2, 3], &[4, 99, 5], &[6, 7, 8, 9]];
        let (jobs, mut rxs): (Vec<_>, Vec<_>) = prompts.iter().map(|p| seq_job(p, 5)).unzip();
        let active = prefill_group(&model, jobs, &Metrics::default(), &mut Vec::new());
        assert_eq!(active.len(), 2);
        run_to_end(&model, active);
        let got: Vec<Vec<Event>> = rxs.iter_mut().map(events).collect();
        assert_eq!(got[0], alone(&model, prompts[0], 5));
        assert_eq!(got[2], alone(&model, prompts[2], 5));
        assert_eq!(got[0].len(), 7, "{:?}", got[0]); // Started, 5 tokens and Done
        match &got[1][..] {
            [Event::Failed(Failure::Internal(m))] => assert!(m.contains("vocabulary"), "{m}"),
            other => panic!("{other:?}"),
        }
    }

    /// A sequence that fails a decoding step (here its cache holds keys of another shape, so
    /// it fails after its batch-mates have written theirs: rows attend in parallel) fails
    /// alone; the step is undone and the others decode exactly as they do alone.
    #[test]
    fn a_sequence_failing_a_step_fails_alone_and_the_rest_decode_as_alone() {
        let model = tiny(4);
        let other = tiny(2);
        let prompts: [&[u32]; 3] = [&[1, 2, 3], &[6, 7, 8, 9], &[10, 11]];
        let (jobs, mut rxs): (Vec<_>, Vec<_>) = prompts.iter().map(|p| seq_job(p, 6)).unzip();
        let mut active = prefill_group(&model, jobs, &Metrics::default(), &mut Vec::new());
        assert_eq!(active.len(), 3);
        let (_, foreign) = prefill(&other, &[prompts[2]], &[8]).unwrap();
        active[2].cache = foreign.into_iter().next().unwrap();
        run_to_end(&model, active);
        let got: Vec<Vec<Event>> = rxs.iter_mut().map(events).collect();
        assert_eq!(got[0], alone(&model, prompts[0], 6));
        assert_eq!(got[1], alone(&model, prompts[1], 6));
        match &got[2][..] {
            [Event::Started { cached: 0 }, Event::Token(_), Event::Failed(Failure::Internal(m))] => {
                assert!(m.contains("cache"), "{m}")
            }
            other => panic!("{other:?}"),
        }
    }

    /// Runs `active` to the end, giving what ends to `cache`.
    fn run_keeping(model: &Gpt, mut active: Vec<Seq>, cache: &mut PromptCache) {
        let mut done = Vec::new();
        for _ in 0..100 {
            keep_all(cache, &mut done, &Metrics::default());
            if active.is_empty() {
                return;
            }
            step_all(model, &mut active, &Metrics::default(), &mut done);
        }
        panic!("sequences still running after 100 steps");
    }

    /// Tokens, and log-probabilities to `tol`, equal; `Started` told apart.
    fn assert_same_reply(got: &[Event], want: &[Event], tol: f32) {
        assert_eq!(got.len(), want.len(), "{got:?}\n{want:?}");
        for (g, w) in got.iter().zip(want) {
            match (g, w) {
                (Event::Started { .. }, Event::Started { .. }) => {}
                (Event::Token(g), Event::Token(w)) => {
                    assert_eq!(g.id, w.id);
                    let d = (g.logprob.unwrap() - w.logprob.unwrap()).abs();
                    assert!(d <= tol, "{d}");
                    let ids = |t: &TokenOut| t.top.iter().map(|x| x.0).collect::<Vec<_>>();
                    assert_eq!(ids(g), ids(w));
                }
                _ => assert_eq!(g, w),
            }
        }
    }

    /// A chat's next turn (the previous prompt, the reply, a new message) starts from the
    /// keys and values the previous turn left in the prompt cache and prefills only the
    /// new tokens; its reply is the reply without the cache: the same tokens, the same
    /// log-probabilities up to the rounding of a prefill in two passes.
    #[test]
    fn a_prompt_cache_hit_gives_the_reply_without_it() {
        let model = tiny(4);
        let mut cache = PromptCache::new(usize::MAX);
        let first: Vec<u32> = (1..=10).collect();
        let (job, mut rx) = seq_job(&first, 6);
        let active = prefill_group(&model, vec![job], &Metrics::default(), &mut Vec::new());
        run_keeping(&model, active, &mut cache);
        let reply: Vec<u32> = events(&mut rx)
            .iter()
            .filter_map(|e| match e {
                Event::Token(t) => Some(t.id),
                _ => None,
            })
            .collect();
        assert_eq!(reply.len(), 6);
        // The turn's last token was never run: the cache holds 15 positions.
        let mut second = first.clone();
        second.extend(&reply);
        second.extend([20, 21, 22, 23]);
        assert_eq!(cache.matched(reusable(&second)), 15);
        let (job, mut rx) = seq_job(&second, 8);
        let metrics = Metrics::default();
        let active = prefill_cached(&model, job, &mut cache, &metrics, &mut Vec::new());
        run_keeping(&model, active, &mut cache);
        let got = events(&mut rx);
        assert_eq!(got[0], Event::Started { cached: 15 });
        assert_eq!(metrics.prompt_cache_hits.load(Ordering::Relaxed), 15);
        assert_same_reply(&got, &alone(&model, &second, 8), 1e-5);
        // The second turn is kept in its turn, below the first's node.
        assert_eq!(cache.matched(&second), second.len());
    }

    /// Constrained sequences decode in a batch beside unconstrained ones: each constrained
    /// reply is a JSON object of its schema that ends where the schema is complete, and the
    /// unconstrained rows are what they are alone (the masks touch only their own rows).
    #[test]
    fn constrained_rows_follow_their_schema_in_a_mixed_batch() {
        use crate::text::grammar::{GrammarSpec, Grammars};
        let json = include_bytes!("../../../models/default/tokenizer.json");
        let tok: crate::text::tokenizer::Tokenizer =
            tokenizers::Tokenizer::from_bytes(json).unwrap().into();
        let tok = Arc::new(tok);
        let model = {
            let cfg = GptConfig {
                vocab_size: 2048,
                n_positions: 128,
                n_embd: 16,
                n_layer: 2,
                n_head: 4,
                ..GptConfig::gpt2()
            };
            let vm = VarMap::new();
            Gpt::new(&cfg, VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu)).unwrap()
        };
        let grammars = Grammars::new(tok.clone(), 2048, 0).unwrap();
        let schema = serde_json::json!({
            "type": "object",
            "properties": {"yes": {"type": "boolean"}, "n": {"enum": [1, 22, 333]}},
            "required": ["yes", "n"], "additionalProperties": false,
        });
        let spec = GrammarSpec::JsonSchema(schema);
        let prompts: [&[u32]; 4] = [&[5, 6, 7], &[8, 9], &[10, 11, 12, 13], &[14]];
        let mut rxs = Vec::new();
        let mut jobs = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            let (mut job, rx) = seq_job(p, 60);
            job.stop_ids = vec![0];
            if i % 2 == 0 {
                job.constraint = Some(grammars.compile(&spec).unwrap());
            }
            jobs.push(job);
            rxs.push(rx);
        }
        let active = prefill_group(&model, jobs, &Metrics::default(), &mut Vec::new());
        run_to_end(&model, active);
        for (i, rx) in rxs.iter_mut().enumerate() {
            let got = events(rx);
            let ids: Vec<u32> = got
                .iter()
                .filter_map(|e| match e {
                    Event::Token(t) if !t.is_stop => Some(t.id),
                    _ => None,
                })
                .collect();
            if i % 2 == 0 {
                assert_eq!(got.last(), Some(&Event::Done { stopped: true }));
                let text = tok.decode(&ids).unwrap();
                let v: serde_json::Value =
                    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
                assert!(v["yes"].is_boolean() && [1, 22, 333].contains(&v["n"].as_i64().unwrap()));
            } else {
                let mut job = seq_job(prompts[i], 60);
                job.0.stop_ids = vec![0];
                run_to_end(
                    &model,
                    prefill_group(&model, vec![job.0], &Metrics::default(), &mut Vec::new()),
                );
                // Batches of other sizes round differently in the last bits.
                assert_same_reply(&got, &events(&mut job.1), 1e-5);
            }
        }
    }

    fn job(len: usize) -> Job {
        Job {
            index: len,
            prompt: vec![1; len],
            max_tokens: 1,
            sampler: Sampler::new(gpt_blocks::SamplingParams::default()).unwrap(),
            stop_ids: Vec::new(),
            logprobs: None,
            constraint: None,
            events: tokio::sync::mpsc::unbounded_channel().0,
            cancel: Arc::new(AtomicBool::new(false)),
            queued_at: Instant::now(),
        }
    }

    /// Similar lengths prefill together; a much longer prompt, or one past the position
    /// budget, starts its own group.
    #[test]
    fn prefill_groups_bound_padding_and_size() {
        let lens = |groups: Vec<Vec<Job>>| -> Vec<Vec<usize>> {
            groups
                .iter()
                .map(|g| g.iter().map(|j| j.prompt.len()).collect())
                .collect()
        };
        let jobs = [7, 5, 6, 40, 5, 300].map(job).into_iter().collect();
        assert_eq!(
            lens(prefill_groups(jobs)),
            [vec![5, 5, 6, 7], vec![40], vec![300]]
        );
        let jobs = (0..20).map(|_| job(256)).collect();
        let groups = lens(prefill_groups(jobs));
        assert_eq!(groups.iter().map(Vec::len).collect::<Vec<_>>(), [16, 4]);
        assert!(prefill_groups(Vec::new()).is_empty());
    }

    #[test]
    fn log_softmax_sums_to_one_and_top_n_orders() {
        let xs = [1.0f32, 3.0, 2.0, 3.0];
        let lp = log_softmax(&xs);
        let total: f64 = lp.iter().map(|&x| (x as f64).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6, "{total}");
        // By hand: log(e^3 / (e + 2e^3 + e^2)).
        let want = 3.0 - (1f64.exp() + 2.0 * 3f64.exp() + 2f64.exp()).ln();
        assert!((lp[1] as f64 - want).abs() < 1e-6);
        let top: Vec<u32> = top_n(&lp, 3).iter().map(|t| t.0).collect();
        assert_eq!(top, [1, 3, 2]);
        assert!(top_n(&lp, 0).is_empty());
        assert_eq!(top_n(&lp, 9).len(), 4);
    }
}
