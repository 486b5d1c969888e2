//! `gpt serve`: the OpenAI HTTP API (`/v1/completions`, `/v1/chat/completions`,
//! `/v1/models`) with continuous batching, plus `/health` and Prometheus `/metrics`.
//!
//! Threads: the scheduler ([`engine`]) owns the model and runs on the command's own
//! thread (a worker of the pool the kernels split on); tokio's threads serve HTTP. They
//! meet in a bounded queue of jobs, and each job streams its tokens back on its own
//! channel.

mod api;
mod body;
mod conns;
mod engine;
mod job;
mod metrics;
mod prompt_cache;
mod queue;
mod routes;
mod shared;
mod tokenize;
mod tools;

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crate::args::ModelArgs;
use crate::model::{self, Loaded};
use anyhow::{bail, Context, Result};
use clap::Args;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;

use conns::Conns;
use metrics::Metrics;
use prompt_cache::PromptCache;
use queue::Queue;
use shared::{log, Shared};

/// Options of `gpt serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Address to listen on. Without --api-key, keep it a loopback address.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: the OS picks one; the address is printed).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Most sequences decoded together in one step.
    #[arg(long, default_value_t = 16)]
    pub max_batch: usize,
    /// Most requests waiting for a place in the batch; past it, 429.
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
    /// Require `Authorization: Bearer KEY` on /v1 (also from GPT_API_KEY).
    #[arg(long, env = "GPT_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// The model's name in the API (default: the --model argument, or `gpt-default`).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Most open connections; past it, the oldest idle one (no request queued or running)
    /// is closed to make room, and when every one is busy the new one is.
    #[arg(long, default_value_t = 256)]
    pub max_connections: usize,
    /// Seconds a client has to send a request's headers (slow clients are dropped).
    #[arg(long, default_value_t = 10)]
    pub header_timeout: u64,
    /// MiB of keys and values kept across requests, so that a prompt that begins as an
    /// earlier one did (a chat's earlier turns, a shared system prompt) prefills only the
    /// rest; least recently used first out. 0 turns the prompt cache off.
    #[arg(long, default_value_t = 1024)]
    pub cache_mem: u64,
    /// Seconds in-flight requests get to finish after SIGTERM or Ctrl-C; then they are
    /// cancelled, every connection is closed, and the process exits.
    #[arg(long, default_value_t = 30)]
    pub shutdown_grace: u64,
}

/// Runs `gpt serve` until SIGTERM or Ctrl-C.
pub fn run(a: &ServeArgs, margs: &ModelArgs) -> Result<()> {
    for (name, v) in [
        ("--max-batch", a.max_batch),
        ("--max-queue", a.max_queue),
        ("--max-connections", a.max_connections),
    ] {
        if v == 0 {
            bail!("{name} must be at least 1")
        }
    }
    if a.api_key.as_deref() == Some("") {
        bail!("--api-key must not be empty")
    }
    let Loaded {
        model,
        tokenizer,
        chat,
        source,
    } = model::load_for_inference(margs)?;
    let cfg = model.config();
    let model_name = match (&a.served_model_name, &margs.model) {
        (Some(n), _) => n.clone(),
        (None, Some(m)) => m.clone(),
        (None, None) => "gpt-default".into(),
    };
    let listener = std::net::TcpListener::bind((a.host.as_str(), a.port))
        .with_context(|| format!("cannot listen on {}:{}", a.host, a.port))?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    if a.api_key.is_none() && !addr.ip().is_loopback() {
        log(format_args!(
            "warning: listening on {addr} without --api-key: anyone who can reach this address can use the model"
        ));
    }
    let kv_capacity = (a.max_batch as u64).saturating_mul(cfg.n_positions as u64);
    let metrics = Arc::new(Metrics::new(&model_name, kv_capacity));
    let queue = Queue::new(a.max_queue, metrics.clone());
    let shared = Arc::new(Shared {
        model_name,
        tokenizer: tokenizer.map(Arc::new),
        chat,
        n_positions: cfg.n_positions,
        vocab_size: cfg.vocab_size,
        eos: cfg.eos_token_id,
        queue: queue.clone(),
        metrics,
        shutdown: OnceLock::new(),
        api_key: a.api_key.clone(),
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        ids: AtomicU64::new(0),
        grammars: OnceLock::new(),
    });
    // HTTP needs little CPU; the cores are the model's.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let limits = Limits {
        connections: a.max_connections,
        header_timeout: Duration::from_secs(a.header_timeout.max(1)),
        grace: Duration::from_secs(a.shutdown_grace),
    };
    let http = {
        let _guard = rt.enter();
        let listener = tokio::net::TcpListener::from_std(listener)?;
        rt.spawn(serve_http(listener, shared.clone(), limits))
    };
    let template = match shared.chat.is_own() {
        true => "the model's chat template",
        false => "the plain User:/Assistant: format",
    };
    log(format_args!(
        "gpt serve: `{}` ({source}) on http://{addr} (max batch {}, queue {}, prompt cache {} MiB; chat uses {template})",
        shared.model_name, a.max_batch, a.max_queue, a.cache_mem
    ));
    log(format_args!("listening on http://{addr}"));
    let mut prompt_cache = PromptCache::new(
        usize::try_from(a.cache_mem.saturating_mul(1 << 20)).unwrap_or(usize::MAX),
    );
    engine::run(&model, &queue, &shared, a.max_batch, &mut prompt_cache);
    // The scheduler returns once shutdown has drained it; the HTTP side returns by the
    // deadline whatever its clients do, and what is left of it (connections that never
    // finished a request, blocking tasks) is dropped without waiting.
    rt.block_on(http).context("the HTTP server failed")??;
    rt.shutdown_background();
    log(format_args!("gpt serve: stopped"));
    Ok(())
}

#[derive(Debug, Clone, Copy)]
struct Limits {
    connections: usize,
    header_timeout: Duration,
    grace: Duration,
}

/// What the scheduler's failure events need to reach clients after the deadline.
const LAST_WORDS: Duration = Duration::from_millis(300);

/// Accepts connections until a shutdown signal, then lets open connections finish until the
/// grace period ends (and [`LAST_WORDS`] more for the cancelled ones' errors to go out).
async fn serve_http(
    listener: tokio::net::TcpListener,
    shared: Arc<Shared>,
    limits: Limits,
) -> Result<()> {
    let app = routes::router(shared.clone());
    let conns = Conns::new(limits.connections, shared.metrics.clone());
    let graceful = GracefulShutdown::new();
    let mut signal = std::pin::pin!(shutdown_signal());
    loop {
        let (stream, _peer): (tokio::net::TcpStream, SocketAddr) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(c) => c,
                // Out of file descriptors and the like: wait a moment, keep serving.
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut signal => break,
        };
        let Some(conn) = conns.open() else {
            drop(stream); // every connection is busy
            continue;
        };
        let _ = stream.set_nodelay(true);
        let svc = routes::ConnService::new(app.clone(), conn.busy.clone());
        let http = http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_timeout)
            .serve_connection(TokioIo::new(stream), svc);
        let http = graceful.watch(http);
        tokio::spawn(async move {
            // Evicted: the connection is dropped, which closes it.
            tokio::select! {
                _ = http => {}
                _ = conn.evicted() => {}
            }
            drop(conn);
        });
    }
    let deadline = Instant::now() + limits.grace;
    let _ = shared.shutdown.set(deadline);
    log(format_args!(
        "gpt serve: shutting down (in-flight requests get {} s)",
        limits.grace.as_secs()
    ));
    drop(listener);
    let end = tokio::time::Instant::from_std(deadline + LAST_WORDS);
    let _ = tokio::time::timeout_at(end, graceful.shutdown()).await;
    Ok(())
}

/// Resolves on Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
