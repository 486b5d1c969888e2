//! The HTTP endpoints: request in, jobs queued, tokens turned into OpenAI's responses or
//! server-sent events.

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::{Extension, Path, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use super::api::{self, json_body, ApiError, Plan};
use super::body;
use super::conns::{Busy, ConnBusy};
use super::job::{Event, Failure, Job, TokenOut};
use super::queue::{QueueError, Ticket};
use super::shared::{authorize, Shared};
use crate::text::grammar::Constrained;
use crate::tokens::visible;

/// Every route.
pub fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/tokenize", post(super::tokenize::tokenize))
        .route("/detokenize", post(super::tokenize::detokenize))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(shared)
}

/// The router as hyper's service for one connection: each request carries the connection's
/// busy count (a request extension), which a request holding work raises so that the
/// connection is not evicted as idle ([`super::conns`]).
#[derive(Clone)]
pub struct ConnService {
    app: Router,
    busy: ConnBusy,
}

impl ConnService {
    /// `app` serving the connection whose count is `busy`.
    pub fn new(app: Router, busy: ConnBusy) -> Self {
        Self { app, busy }
    }
}

impl hyper::service::Service<Request<hyper::body::Incoming>> for ConnService {
    type Response = Response;
    type Error = Infallible;
    type Future = axum::routing::future::RouteFuture<Infallible>;

    fn call(&self, mut req: Request<hyper::body::Incoming>) -> Self::Future {
        req.extensions_mut().insert(self.busy.clone());
        // The router is always ready (its `poll_ready` returns at once).
        tower_service::Service::call(&mut self.app.clone(), req)
    }
}

async fn health(State(s): State<Arc<Shared>>) -> Response {
    match s.draining() {
        false => json_body(&json!({"status": "ok"})).into_response(),
        true => (
            StatusCode::SERVICE_UNAVAILABLE,
            json_body(&json!({"status": "shutting down"})),
        )
            .into_response(),
    }
}

async fn metrics(State(s): State<Arc<Shared>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.metrics.render(),
    )
        .into_response()
}

fn model_object(s: &Shared) -> Value {
    json!({"id": s.model_name, "object": "model", "created": s.created, "owned_by": "gpt"})
}

async fn models(State(s): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    if let Err(e) = authorize(&s, &headers) {
        return e.into_response();
    }
    json_body(&json!({"object": "list", "data": [model_object(&s)]})).into_response()
}

async fn model(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    if let Err(e) = authorize(&s, &headers) {
        return e.into_response();
    }
    match id == s.model_name {
        true => json_body(&model_object(&s)).into_response(),
        false => ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            Some("model_not_found"),
            format!(
                "the model `{id}` does not exist; this server serves `{}`",
                s.model_name
            ),
        )
        .into_response(),
    }
}

async fn not_found() -> Response {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        None,
        "no such endpoint; this server has /v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize, /health, /metrics",
    )
    .into_response()
}

async fn method_not_allowed() -> Response {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        None,
        "method not allowed on this endpoint",
    )
    .into_response()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Completions,
    Chat,
}

impl Endpoint {
    fn name(self) -> &'static str {
        match self {
            Self::Completions => "completions",
            Self::Chat => "chat_completions",
        }
    }
}

async fn completions(
    State(s): State<Arc<Shared>>,
    conn: Option<Extension<ConnBusy>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    handle(s, conn, headers, body, Endpoint::Completions).await
}

async fn chat_completions(
    State(s): State<Arc<Shared>>,
    conn: Option<Extension<ConnBusy>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    handle(s, conn, headers, body, Endpoint::Chat).await
}

async fn handle(
    s: Arc<Shared>,
    conn: Option<Extension<ConnBusy>>,
    headers: HeaderMap,
    body: Body,
    ep: Endpoint,
) -> Response {
    let started = Instant::now();
    let conn = conn.map(|Extension(c)| c);
    let response = match accept(&s, conn, &headers, body, ep, started).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    };
    s.metrics.request(ep.name(), response.status().as_u16());
    // A stream's duration is recorded when it ends.
    if !is_stream(&response) {
        s.metrics.latency.observe(started.elapsed().as_secs_f64());
    }
    response
}

fn is_stream(r: &Response) -> bool {
    r.headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"))
}

async fn accept(
    s: &Arc<Shared>,
    conn: Option<ConnBusy>,
    headers: &HeaderMap,
    body: Body,
    ep: Endpoint,
    started: Instant,
) -> Result<Response, ApiError> {
    authorize(s, headers)?;
    if s.draining() {
        return Err(shutting_down());
    }
    body::check_declared(headers)?;
    let bytes = body::read(body).await?;
    // Tokenizing (and rendering a chat template) is CPU work: off the async threads.
    let s2 = s.clone();
    let plan = tokio::task::spawn_blocking(move || {
        let o = api::object(&bytes)?;
        let info = s2.info();
        match ep {
            Endpoint::Completions => api::completions(&o, &info),
            Endpoint::Chat => api::chat(&o, &info),
        }
    })
    .await
    .map_err(|_| internal("the request could not be read"))??;
    let (rx, cancels, ticket) = submit(s, &plan)?;
    let run = Run {
        _ticket: ticket,
        _busy: conn.map(|c| c.hold()),
        shared: s.clone(),
        choices: (0..plan.prompts.len()).map(|_| Choice::default()).collect(),
        cancels,
        prompt_tokens: plan.prompts.iter().map(Vec::len).sum(),
        id: format!(
            "{}-{}",
            if ep == Endpoint::Chat {
                "chatcmpl"
            } else {
                "cmpl"
            },
            s.next_id()
        ),
        plan,
        ep,
        rx,
        started,
        first_token: false,
    };
    match run.plan.stream {
        true => Ok(stream(run)),
        false => whole(run).await,
    }
}

fn shutting_down() -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "server_error",
        None,
        "the server is shutting down",
    )
}

fn internal(msg: &str) -> ApiError {
    ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", None, msg)
}

/// Queues one job per prompt, all sending to one channel: all of them or none.
#[allow(clippy::type_complexity)]
fn submit(
    s: &Shared,
    plan: &Plan,
) -> Result<
    (
        UnboundedReceiver<(usize, Event)>,
        Vec<Arc<AtomicBool>>,
        Ticket,
    ),
    ApiError,
> {
    let (tx, rx) = unbounded_channel();
    let mut cancels = Vec::new();
    let mut jobs = Vec::new();
    // Compiled here, so that what cannot be enforced is a 400 before anything is queued.
    let constraint = match &plan.grammar {
        None => None,
        Some((field, spec)) => {
            let grammars = s
                .grammars()
                .map_err(|e| ApiError::invalid(Some(field), format!("`{field}`: {e}")))?;
            let c = grammars.compile(spec).map_err(|e| {
                ApiError::invalid(Some(field), format!("`{field}` cannot be enforced: {e:#}"))
            })?;
            Some(c)
        }
    };
    for (index, prompt) in plan.prompts.iter().enumerate() {
        let cancel = Arc::new(AtomicBool::new(false));
        // The request's fields were checked in the types the sampler uses, so this fails
        // only on a bug of ours.
        let sampler = gpt_blocks::Sampler::new(plan.sampling.clone())
            .map_err(|e| internal(&format!("{e:#}")))?;
        jobs.push(Job {
            index,
            prompt: prompt.clone(),
            max_tokens: plan.max_tokens,
            sampler,
            stop_ids: plan.stop_ids.clone(),
            logprobs: plan.logprobs,
            constraint: constraint.as_ref().map(Constrained::fork),
            events: tx.clone(),
            cancel: cancel.clone(),
            queued_at: Instant::now(),
        });
        cancels.push(cancel);
    }
    let ticket = match s.queue.push(jobs) {
        Ok(t) => t,
        Err(QueueError::Full) => {
            return Err(ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                Some("queue_full"),
                "the server's queue is full; retry later",
            ))
        }
        Err(QueueError::Closed) => return Err(shutting_down()),
    };
    s.metrics.prompt_tokens.fetch_add(
        plan.prompts.iter().map(|p| p.len() as u64).sum(),
        Ordering::Relaxed,
    );
    Ok((rx, cancels, ticket))
}

/// One choice's tokens and text as they arrive.
#[derive(Debug, Default)]
struct Choice {
    /// Tokens that make up the text (stop tokens left out).
    tokens: Vec<TokenOut>,
    /// Tokens generated, stop tokens included.
    generated: usize,
    /// The text that may be shown so far.
    text: String,
    /// Bytes of `text` already streamed, and tokens whose log-probabilities were.
    sent_bytes: usize,
    sent_tokens: usize,
    finish: Option<&'static str>,
    /// Prompt tokens whose keys and values came from the prompt cache.
    cached: usize,
}

/// A request in flight. Dropped (finished, failed, or its client gone), it gives back the
/// queue places its jobs still hold and lets its connection count as idle again.
struct Run {
    _ticket: Ticket,
    _busy: Option<Busy>,
    shared: Arc<Shared>,
    plan: Plan,
    ep: Endpoint,
    id: String,
    rx: UnboundedReceiver<(usize, Event)>,
    choices: Vec<Choice>,
    cancels: Vec<Arc<AtomicBool>>,
    prompt_tokens: usize,
    started: Instant,
    first_token: bool,
}

impl Run {
    /// Waits for the next event and applies it; `Ok(Some(i))` names the choice it changed,
    /// `Ok(None)` means every choice has finished.
    async fn next(&mut self) -> Result<Option<usize>, ApiError> {
        loop {
            if self.choices.iter().all(|c| c.finish.is_some()) {
                return Ok(None);
            }
            let Some((i, event)) = self.rx.recv().await else {
                return Err(internal(
                    "the scheduler stopped before the request finished",
                ));
            };
            let Some(choice) = self.choices.get_mut(i) else {
                continue;
            };
            if choice.finish.is_some() {
                continue; // ended by a stop text; the scheduler has been told
            }
            let tok = self.shared.tokenizer.as_deref();
            match event {
                Event::Started { cached } => {
                    choice.cached = cached;
                    continue;
                }
                Event::Token(t) => {
                    if !self.first_token {
                        self.first_token = true;
                        let m = &self.shared.metrics;
                        m.first_token.observe(self.started.elapsed().as_secs_f64());
                    }
                    choice.generated += 1;
                    if !t.is_stop {
                        choice.tokens.push(t);
                    }
                    // The text so far matters only to a stream or to stop strings; a whole
                    // response is decoded once at the end.
                    if !self.plan.stream && self.plan.stops.is_empty() {
                        return Ok(Some(i));
                    }
                    let ids: Vec<u32> = choice.tokens.iter().map(|t| t.id).collect();
                    let (text, stopped) = visible(tok, &ids, &self.plan.stops, false)
                        .map_err(|e| internal(&format!("{e:#}")))?;
                    choice.text = text;
                    if stopped {
                        choice.finish = Some("stop");
                        self.cancels[i].store(true, Ordering::Relaxed);
                    }
                }
                Event::Done { stopped } => {
                    let ids: Vec<u32> = choice.tokens.iter().map(|t| t.id).collect();
                    let (text, cut) = visible(tok, &ids, &self.plan.stops, true)
                        .map_err(|e| internal(&format!("{e:#}")))?;
                    choice.text = text;
                    choice.finish = Some(if stopped || cut { "stop" } else { "length" });
                }
                Event::Failed(Failure::ShutDown(msg)) => {
                    return Err(ApiError {
                        message: msg,
                        ..shutting_down()
                    })
                }
                Event::Failed(Failure::Internal(msg)) => return Err(internal(&msg)),
            }
            return Ok(Some(i));
        }
    }

    fn usage(&self) -> Value {
        let completion: usize = self.choices.iter().map(|c| c.generated).sum();
        let cached: usize = self.choices.iter().map(|c| c.cached).sum();
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        })
    }

    fn token_text(&self, id: u32) -> String {
        crate::tokens::decode(self.shared.tokenizer.as_deref(), &[id]).unwrap_or_default()
    }

    /// OpenAI's `logprobs` object for `tokens` (text offsets from `offset`).
    fn logprobs(&self, tokens: &[TokenOut], offset: usize) -> Value {
        if self.plan.logprobs.is_none() {
            return Value::Null;
        }
        let texts: Vec<String> = tokens.iter().map(|t| self.token_text(t.id)).collect();
        match self.ep {
            Endpoint::Completions => {
                let mut at = offset;
                let offsets: Vec<usize> = texts
                    .iter()
                    .map(|t| {
                        let o = at;
                        at += t.len();
                        o
                    })
                    .collect();
                let top: Vec<Value> = tokens
                    .iter()
                    .map(|t| {
                        let m: serde_json::Map<String, Value> = t
                            .top
                            .iter()
                            .map(|&(id, lp)| (self.token_text(id), json!(lp)))
                            .collect();
                        Value::Object(m)
                    })
                    .collect();
                json!({
                    "tokens": texts,
                    "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
                    "top_logprobs": top,
                    "text_offset": offsets,
                })
            }
            Endpoint::Chat => {
                let entry = |text: &str, lp: f32| json!({"token": text, "logprob": lp, "bytes": text.as_bytes()});
                let content: Vec<Value> = tokens
                    .iter()
                    .zip(&texts)
                    .map(|(t, text)| {
                        let mut e = entry(text, t.logprob.unwrap_or(0.0));
                        e["top_logprobs"] = t
                            .top
                            .iter()
                            .map(|&(id, lp)| entry(&self.token_text(id), lp))
                            .collect();
                        e
                    })
                    .collect();
                json!({"content": content})
            }
        }
    }

    /// The `object` of a streamed chunk.
    fn chunk_object(&self) -> &'static str {
        match self.ep {
            Endpoint::Completions => "text_completion",
            Endpoint::Chat => "chat.completion.chunk",
        }
    }

    fn envelope(&self, object: &str, choices: Vec<Value>) -> Value {
        json!({
            "id": self.id,
            "object": object,
            "created": now(),
            "model": self.shared.model_name,
            "system_fingerprint": Value::Null,
            "choices": choices,
        })
    }

    /// Choice `i`'s content and tool calls: while it runs, the content up to where a call
    /// may begin (and no calls); once finished, the reply parsed (each call with its
    /// `index` in a stream, as OpenAI's deltas carry it).
    fn content_and_calls(&self, i: usize, stream: bool) -> (String, Vec<Value>) {
        let c = &self.choices[i];
        let Some(tools) = self
            .plan
            .tools
            .as_ref()
            .filter(|_| self.ep == Endpoint::Chat)
        else {
            return (c.text.clone(), Vec::new());
        };
        if c.finish.is_none() {
            return (tools.format.content_so_far(&c.text).to_string(), Vec::new());
        }
        let (content, calls) = tools.format.parse(&c.text);
        let calls = calls
            .iter()
            .enumerate()
            .map(|(k, call)| {
                let id = format!("call-{}-{i}-{k}", self.id);
                call.to_openai(&id, stream.then_some(k))
            })
            .collect();
        (content, calls)
    }

    /// A streamed chunk of choice `i`: its text since the last chunk.
    fn chunk(&mut self, i: usize, first: bool) -> Option<Value> {
        let (content, calls) = self.content_and_calls(i, true);
        let c = &self.choices[i];
        let delta = content.get(c.sent_bytes..).unwrap_or("").to_string();
        let finish = match calls.is_empty() {
            true => c.finish,
            false => Some("tool_calls"),
        };
        // One chunk per token (its text may be held back: half a character, or what could
        // still become a stop string), as OpenAI streams.
        if delta.is_empty() && finish.is_none() && !first && c.tokens.len() == c.sent_tokens {
            return None;
        }
        // The log-probabilities of the tokens that arrived since the last chunk.
        let upto = c.tokens.len();
        let tokens = c.tokens[c.sent_tokens.min(upto)..upto].to_vec();
        let offset = c.sent_bytes;
        let logprobs = self.logprobs(&tokens, offset);
        let c = &mut self.choices[i];
        c.sent_bytes += delta.len();
        c.sent_tokens = upto;
        let choice = match self.ep {
            Endpoint::Completions => json!({
                "index": i, "text": delta, "logprobs": logprobs, "finish_reason": finish,
            }),
            Endpoint::Chat => {
                let mut d = json!({});
                if first {
                    d["role"] = json!("assistant");
                }
                if !delta.is_empty() || first {
                    d["content"] = json!(delta);
                }
                if !calls.is_empty() {
                    d["tool_calls"] = Value::Array(calls);
                }
                json!({"index": i, "delta": d, "logprobs": logprobs, "finish_reason": finish})
            }
        };
        let mut v = self.envelope(self.chunk_object(), vec![choice]);
        if finish.is_some() && self.choices.iter().all(|c| c.finish.is_some()) {
            v["usage"] = self.usage();
        }
        Some(v)
    }
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The whole response at once.
async fn whole(mut run: Run) -> Result<Response, ApiError> {
    while run.next().await?.is_some() {}
    let choices: Vec<Value> = (0..run.choices.len())
        .map(|i| {
            let c = &run.choices[i];
            let logprobs = run.logprobs(&c.tokens, 0);
            match run.ep {
                Endpoint::Completions => json!({
                    "index": i, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish,
                }),
                Endpoint::Chat => {
                    let (content, calls) = run.content_and_calls(i, false);
                    let mut message = json!({"role": "assistant", "content": content});
                    let mut finish = json!(c.finish);
                    if !calls.is_empty() {
                        if content.is_empty() {
                            message["content"] = Value::Null;
                        }
                        message["tool_calls"] = Value::Array(calls);
                        finish = json!("tool_calls");
                    }
                    json!({
                        "index": i,
                        "message": message,
                        "logprobs": logprobs,
                        "finish_reason": finish,
                    })
                }
            }
        })
        .collect();
    let object = match run.ep {
        Endpoint::Completions => "text_completion",
        Endpoint::Chat => "chat.completion",
    };
    let mut v = run.envelope(object, choices);
    v["usage"] = run.usage();
    Ok(json_body(&v).into_response())
}

/// Server-sent events: a chunk per piece of text, `data: [DONE]` at the end. A task
/// drives the request and feeds the response; a client that goes away closes the response
/// stream, the task sees it and drops the request's channel, and the scheduler frees the
/// slots at its next step.
fn stream(mut run: Run) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel::<Value>(16);
    tokio::spawn(async move {
        let send = |v: Value| {
            let tx = tx.clone();
            async move { tx.send(v).await.is_ok() }
        };
        // Chat streams open with the role, as OpenAI's do.
        if run.ep == Endpoint::Chat {
            for i in 0..run.choices.len() {
                if let Some(v) = run.chunk(i, true) {
                    if !send(v).await {
                        return;
                    }
                }
            }
        }
        loop {
            let next = tokio::select! {
                next = run.next() => next,
                _ = tx.closed() => return,
            };
            match next {
                Ok(Some(i)) => {
                    if let Some(v) = run.chunk(i, false) {
                        if !send(v).await {
                            return;
                        }
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    let _ = send(e.body()).await;
                    break;
                }
            }
        }
        if run.plan.include_usage && run.choices.iter().all(|c| c.finish.is_some()) {
            let mut v = run.envelope(run.chunk_object(), Vec::new());
            v["usage"] = run.usage();
            send(v).await;
        }
        run.shared
            .metrics
            .latency
            .observe(run.started.elapsed().as_secs_f64());
    });
    let events = futures_util::stream::unfold((rx, false), |(mut rx, done)| async move {
        if done {
            return None;
        }
        let event = match rx.recv().await {
            Some(v) => (SseEvent::default().data(v.to_string()), false),
            None => (SseEvent::default().data("[DONE]"), true),
        };
        Some((Ok::<_, Infallible>(event.0), (rx, event.1)))
    });
    Sse::new(events).into_response()
}
