//! The scheduler: one thread owns the model and runs continuous batching. New requests
//! join the running batch at the next decoding step (each prefilled alone into its own
//! KV cache), every step decodes one token for every sequence in one batched pass
//! ([`Gpt::infer_rows`]: the weights are read once per step, not once per sequence), and
//! a sequence leaves as soon as it ends or its client goes away.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};
use candle_core::{DType, Tensor};
use gpt_blocks::{left_padded, Gpt, GptCache, Logits, Sampler, SamplingParams};
use rayon::prelude::*;
use tokio::sync::mpsc::UnboundedSender;

use super::metrics::Metrics;
use super::Shared;

/// One sequence to generate.
#[derive(Debug)]
pub struct Job {
    /// Which of its request's choices this is.
    pub index: usize,
    /// Prompt tokens, checked against the vocabulary and the context.
    pub prompt: Vec<u32>,
    /// Most new tokens; `prompt.len() + max_tokens` fits the context.
    pub max_tokens: usize,
    /// How tokens are picked.
    pub sampling: SamplingParams,
    /// Tokens that end the sequence.
    pub stop_ids: Vec<u32>,
    /// `Some(n)`: report each token's log-probability and the `n` most likely tokens.
    pub logprobs: Option<usize>,
    /// Where the tokens go, tagged with `index`; closed when the client has gone.
    pub events: UnboundedSender<(usize, Event)>,
    /// Set when the request no longer wants this choice (a stop text was seen).
    pub cancel: Arc<AtomicBool>,
    /// When the request was queued.
    pub queued_at: Instant,
}

impl Job {
    /// Sends `event`; false when the client has gone.
    fn send(&self, event: Event) -> bool {
        self.events.send((self.index, event)).is_ok()
    }

    /// Whether nobody waits for this sequence any more.
    fn gone(&self) -> bool {
        self.events.is_closed() || self.cancel.load(Ordering::Relaxed)
    }
}

/// What the scheduler tells a request.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A new token.
    Token(TokenOut),
    /// The sequence ended: at one of its stop tokens (the last `Token`), or at its length.
    Done {
        /// True when a stop token ended it.
        stopped: bool,
    },
    /// The sequence could not go on.
    Failed(String),
}

/// A generated token with, on request, its log-probability and the likeliest alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenOut {
    /// The token id.
    pub id: u32,
    /// Whether it is one of the sequence's stop tokens (counted, not shown).
    pub is_stop: bool,
    /// `log p(id)` under the model (before temperature and truncation), when asked for.
    pub logprob: Option<f32>,
    /// The most likely tokens and their log-probabilities, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// A sequence in the running batch.
struct Seq {
    job: Job,
    cache: GptCache,
    sampler: Sampler,
    /// Prompt and generated tokens (the repetition penalty reads them).
    history: Vec<u32>,
    generated: usize,
}

impl Seq {
    fn last(&self) -> u32 {
        self.history[self.history.len() - 1]
    }
}

/// Runs the scheduler until the queue closes, or until shutdown has drained (or, after
/// `grace`, cancelled) the running sequences.
pub fn run(model: &Gpt, jobs: Receiver<Job>, shared: &Shared, max_batch: usize, grace: Duration) {
    let metrics = &shared.metrics;
    let mut active: Vec<Seq> = Vec::new();
    let mut drain_deadline: Option<Instant> = None;
    loop {
        if shared.draining.load(Ordering::SeqCst) {
            let deadline = *drain_deadline.get_or_insert_with(|| Instant::now() + grace);
            // Nothing new starts; what waits in the queue is told so.
            while let Ok(job) = jobs.try_recv() {
                metrics.queue_length.fetch_sub(1, Ordering::Relaxed);
                job.send(Event::Failed("the server is shutting down".into()));
            }
            if Instant::now() >= deadline {
                for s in active.drain(..) {
                    s.job.send(Event::Failed(
                        "the server shut down before this request finished".into(),
                    ));
                }
            }
            if active.is_empty() {
                metrics.batch_size.store(0, Ordering::Relaxed);
                return;
            }
        } else {
            // Admit new sequences up to the batch size: wait when idle, else take only
            // what is already queued.
            let mut admitted = Vec::new();
            while active.len() + admitted.len() < max_batch {
                let job = if active.is_empty() && admitted.is_empty() {
                    match jobs.recv_timeout(Duration::from_millis(50)) {
                        Ok(job) => job,
                        Err(RecvTimeoutError::Timeout) => break,
                        Err(RecvTimeoutError::Disconnected) => return,
                    }
                } else {
                    match jobs.try_recv() {
                        Ok(job) => job,
                        Err(_) => break,
                    }
                };
                metrics.queue_length.fetch_sub(1, Ordering::Relaxed);
                metrics
                    .queue_wait
                    .observe(job.queued_at.elapsed().as_secs_f64());
                if !job.gone() {
                    admitted.push(job); // else the client left while queued
                }
            }
            let prefilled = !admitted.is_empty();
            for group in prefill_groups(admitted) {
                let senders: Vec<_> = group.iter().map(|j| (j.index, j.events.clone())).collect();
                match catch(|| prefill(model, group, metrics)) {
                    Ok(seqs) => active.extend(seqs),
                    Err(e) => {
                        for (index, events) in senders {
                            let _ = events.send((index, Event::Failed(format!("{e:#}"))));
                        }
                    }
                }
            }
            if prefilled {
                // The prefills' temporaries go back before the decoding steps.
                crate::release_freed_memory();
            }
        }
        // A client that disconnected frees its slot now.
        active.retain(|s| !s.job.gone());
        metrics
            .batch_size
            .store(active.len() as u64, Ordering::Relaxed);
        if active.is_empty() {
            continue;
        }
        metrics.step_batch.observe(active.len() as f64);
        if let Err(e) = catch(|| step(model, &mut active, metrics)) {
            // One failed step fails the sequences in it, not the server.
            for s in active.drain(..) {
                s.job.send(Event::Failed(format!("{e:#}")));
            }
        }
        metrics
            .batch_size
            .store(active.len() as u64, Ordering::Relaxed);
    }
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

/// Runs the prompts of `jobs` in one left-padded pass, splits the batch's cache into one
/// cache per sequence (each as its prompt alone would have made it) and picks each first
/// token. Returns the sequences that go on (not those that already ended: one token asked
/// for, a stop token, a client gone).
fn prefill(model: &Gpt, jobs: Vec<Job>, metrics: &Metrics) -> Result<Vec<Seq>> {
    let dev = model.device();
    let n = jobs.len();
    let lens: Vec<usize> = jobs.iter().map(|j| j.prompt.len()).collect();
    let longest = lens.iter().copied().max().unwrap_or(0);
    let prompts: Vec<&[u32]> = jobs.iter().map(|j| j.prompt.as_slice()).collect();
    let (ids, keep) = left_padded(&prompts, dev)?;
    let padded = lens.iter().any(|&l| l != longest);
    let capacity: Vec<usize> = jobs.iter().map(|j| j.prompt.len() + j.max_tokens).collect();
    // One prompt keeps the batch's cache: give it its whole room at once.
    let room = if n == 1 { capacity[0] } else { longest };
    let mut batch = model.new_cache(room);
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
        _ => batch.split_left_padded(&lens, &capacity)?,
    };
    let mut going = Vec::with_capacity(n);
    for ((job, cache), row) in jobs.into_iter().zip(caches).zip(&logits) {
        let mut seq = Seq {
            cache,
            sampler: Sampler::new(job.sampling.clone())?,
            history: job.prompt.clone(),
            generated: 0,
            job,
        };
        if advance(&mut seq, row, metrics)? {
            going.push(seq);
        }
    }
    Ok(going)
}

/// One decoding step for every running sequence; those that end leave the batch.
fn step(model: &Gpt, active: &mut Vec<Seq>, metrics: &Metrics) -> Result<()> {
    let n = active.len();
    let last: Vec<u32> = active.iter().map(Seq::last).collect();
    let ids = Tensor::from_vec(last, (n, 1), model.device())?;
    let mut caches: Vec<&mut GptCache> = active.iter_mut().map(|s| &mut s.cache).collect();
    // (n, 1, vocab)
    let logits = model.infer_rows(&ids, &mut caches, Logits::Last)?;
    let logits = logits.squeeze(1)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    // Sampling reads the whole vocabulary per sequence: split it across the cores.
    let keep: Vec<bool> = active
        .par_iter_mut()
        .zip(logits.par_iter())
        .map(|(seq, row)| advance(seq, row, metrics))
        .collect::<Result<_>>()?;
    let mut keep = keep.into_iter();
    active.retain(|_| keep.next().unwrap_or(false));
    Ok(())
}

/// Samples the next token from `logits`, sends it, and says whether the sequence goes on.
fn advance(seq: &mut Seq, logits: &[f32], metrics: &Metrics) -> Result<bool> {
    let id = seq.sampler.sample(logits, &seq.history)?;
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

/// The scheduler's handle for request handlers: a bounded queue.
#[derive(Debug, Clone)]
pub struct Queue {
    tx: std::sync::mpsc::SyncSender<Job>,
    metrics: Arc<Metrics>,
}

/// Why a job was not queued.
#[derive(Debug, PartialEq, Eq)]
pub enum QueueError {
    /// `--max-queue` requests are already waiting.
    Full,
    /// The scheduler has stopped.
    Closed,
}

impl Queue {
    /// A queue of `capacity` waiting jobs and its receiving end.
    pub fn new(capacity: usize, metrics: Arc<Metrics>) -> (Self, Receiver<Job>) {
        let (tx, rx) = std::sync::mpsc::sync_channel(capacity);
        (Self { tx, metrics }, rx)
    }

    /// Queues `job` without waiting.
    pub fn push(&self, job: Job) -> Result<(), QueueError> {
        // Counted before it is sent so the scheduler's decrement never goes first.
        self.metrics.queue_length.fetch_add(1, Ordering::Relaxed);
        let r = self.tx.try_send(job);
        if r.is_err() {
            self.metrics.queue_length.fetch_sub(1, Ordering::Relaxed);
        }
        match r {
            Ok(()) => Ok(()),
            Err(std::sync::mpsc::TrySendError::Full(_)) => Err(QueueError::Full),
            Err(std::sync::mpsc::TrySendError::Disconnected(_)) => Err(QueueError::Closed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(len: usize) -> Job {
        Job {
            index: len,
            prompt: vec![1; len],
            max_tokens: 1,
            sampling: SamplingParams::default(),
            stop_ids: Vec::new(),
            logprobs: None,
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
