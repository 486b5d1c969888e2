//! What a request asks of the scheduler (a [`Job`] per choice) and what the scheduler
//! sends back ([`Event`]s).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::text::grammar::Constrained;
use gpt_blocks::Sampler;
use tokio::sync::mpsc::UnboundedSender;

/// One sequence to generate.
#[derive(Debug)]
pub struct Job {
    /// Which of its request's choices this is.
    pub index: usize,
    /// Prompt tokens, checked against the vocabulary and the context.
    pub prompt: Vec<u32>,
    /// Most new tokens; `prompt.len() + max_tokens` fits the context.
    pub max_tokens: usize,
    /// How tokens are picked: built, and so checked, by the request's handler.
    pub sampler: Sampler,
    /// Tokens that end the sequence.
    pub stop_ids: Vec<u32>,
    /// `Some(n)`: report each token's log-probability and the `n` most likely tokens.
    pub logprobs: Option<usize>,
    /// What the text must follow, if anything: tokens it forbids are never sampled, and
    /// the sequence ends when it is complete.
    pub constraint: Option<Constrained>,
    /// Where the tokens go, tagged with `index`; closed when the client has gone.
    pub events: UnboundedSender<(usize, Event)>,
    /// Set when the request no longer wants this choice (a stop text was seen).
    pub cancel: Arc<AtomicBool>,
    /// When the request was queued.
    pub queued_at: Instant,
}

impl Job {
    /// Sends `event`; false when the client has gone.
    pub(super) fn send(&self, event: Event) -> bool {
        self.events.send((self.index, event)).is_ok()
    }

    /// Whether nobody waits for this sequence any more.
    pub(super) fn gone(&self) -> bool {
        self.events.is_closed() || self.cancel.load(Ordering::Relaxed)
    }

    pub(super) fn fail(&self, e: &anyhow::Error) {
        self.send(Event::Failed(Failure::Internal(format!("{e:#}"))));
    }
}

/// What the scheduler tells a request.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The prompt has been prefilled: its first `cached` tokens' keys and values came from
    /// the prompt cache (sent once, before the first token).
    Started {
        /// Prompt tokens not computed again.
        cached: usize,
    },
    /// A new token.
    Token(TokenOut),
    /// The sequence ended: at one of its stop tokens (the last `Token`), or at its length.
    Done {
        /// True when a stop token ended it.
        stopped: bool,
    },
    /// The sequence could not go on.
    Failed(Failure),
}

/// Why a sequence could not go on.
#[derive(Debug, Clone, PartialEq)]
pub enum Failure {
    /// Shutdown came first: before it started, or past the grace period.
    ShutDown(String),
    /// The model or the sampler failed on this sequence (alone: see [`super::engine::run`]).
    Internal(String),
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
