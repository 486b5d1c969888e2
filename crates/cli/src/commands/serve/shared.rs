//! What the HTTP handlers and the scheduler share: the model's description, the queue,
//! the metrics, the shutdown deadline, the API key; and the server's log.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use hyper::header::{self, HeaderMap};
use hyper::StatusCode;

use super::api::{ApiError, ModelInfo};
use super::metrics::Metrics;
use super::queue::Queue;
use crate::text::chat_template::ChatTemplate;
use crate::text::grammar::Grammars;
use crate::text::tokenizer::Tokenizer;

/// What the HTTP handlers and the scheduler share.
pub struct Shared {
    pub(super) model_name: String,
    pub(super) tokenizer: Option<Arc<Tokenizer>>,
    pub(super) chat: ChatTemplate,
    pub(super) n_positions: usize,
    pub(super) vocab_size: usize,
    pub(super) eos: Option<u32>,
    pub(super) queue: Queue,
    pub(super) metrics: Arc<Metrics>,
    /// Set on SIGTERM / Ctrl-C to the end of the grace period: from then on nothing new is
    /// accepted, and at it whatever still runs is cancelled.
    pub(super) shutdown: OnceLock<Instant>,
    pub(super) api_key: Option<String>,
    /// Unix time the server started (the model's `created`).
    pub(super) created: u64,
    pub(super) ids: AtomicU64,
    /// Structured output's view of the vocabulary, built by the first request that asks
    /// for it.
    pub(super) grammars: OnceLock<Result<Grammars, String>>,
}

impl Shared {
    pub(super) fn info(&self) -> ModelInfo<'_> {
        ModelInfo {
            tokenizer: self.tokenizer.as_deref(),
            chat: &self.chat,
            n_positions: self.n_positions,
            vocab_size: self.vocab_size,
            eos: self.eos,
            name: &self.model_name,
        }
    }

    /// The model's [`Grammars`] (a pass over the vocabulary the first time).
    pub(super) fn grammars(&self) -> Result<&Grammars, String> {
        self.grammars
            .get_or_init(|| {
                let tok = self.tokenizer.clone().ok_or_else(|| {
                    "structured output needs the model's tokenizer, and this model has none"
                        .to_string()
                })?;
                // The end token is only where the grammar may end; without one, id 0.
                Grammars::new(tok, self.vocab_size, self.eos.unwrap_or(0))
                    .map_err(|e| format!("{e:#}"))
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    pub(super) fn next_id(&self) -> u64 {
        self.ids.fetch_add(1, Ordering::Relaxed)
    }

    /// The end of the grace period, once shutdown has begun.
    pub(super) fn deadline(&self) -> Option<Instant> {
        self.shutdown.get().copied()
    }

    pub(super) fn draining(&self) -> bool {
        self.shutdown.get().is_some()
    }
}

/// A line on the server's log. Never fails: stderr may be a pipe its reader has closed, and
/// the server goes on without its log (`eprintln!` would panic).
pub(super) fn log(line: std::fmt::Arguments) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// With `--api-key`, requests must carry `Authorization: Bearer KEY`.
pub(super) fn authorize(s: &Shared, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &s.api_key else {
        return Ok(());
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    // Compared in time independent of where they differ.
    let same = given.len() == key.len()
        && given
            .bytes()
            .zip(key.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0;
    match same {
        true => Ok(()),
        false => Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            Some("invalid_api_key"),
            "missing or wrong API key (send `Authorization: Bearer KEY`)",
        )),
    }
}
