//! `gpt`: run, score, inspect, visualise, benchmark and train small GPT models.

mod alloc;
mod args;
mod commands;
mod model;
mod plot;
mod text;
mod tokens;

use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};

use args::ModelArgs;
use commands::{
    attention, bench, chat, convert, generate, inspect, score, serve, tokenize, trace, train,
};

/// Run small GPT models from the command line.
#[derive(Debug, Parser)]
#[command(name = "gpt", version, about)]
struct Cli {
    #[command(flatten)]
    model: ModelArgs,
    /// CPU threads (default: all cores).
    #[arg(long, global = true)]
    threads: Option<usize>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Continue prompts (streamed), greedy or sampled; --chat for one chat turn.
    Generate(generate::GenerateArgs),
    /// Talk with a model through its chat template (interactive, streamed).
    Chat(chat::ChatArgs),
    /// Negative log-likelihood and perplexity of a text.
    Score(score::ScoreArgs),
    /// Configuration, tensors and parameter counts of a model.
    Inspect(inspect::InspectArgs),
    /// Attention weights as heatmaps (PNG/SVG) or in the terminal.
    Attention(attention::AttentionArgs),
    /// Prefill and decode speed, peak memory.
    Bench(bench::BenchArgs),
    /// One forward pass step by step, with every tensor's shape.
    Trace(trace::TraceArgs),
    /// Train a GPT on text files: a new one (--arch and the size options), or with --model
    /// the model it names, fine-tuned (any family but GPT-NeoX and GPT-Neo; its tokenizer,
    /// architecture and size).
    Train(train::TrainArgs),
    /// Serve the OpenAI HTTP API (completions, chat) with continuous batching.
    Serve(serve::ServeArgs),
    /// Write the model as a GGUF file for llama.cpp (f32, f16, q8_0, q4_0, q5_0, q4_K, q5_K, q6_K).
    Convert(convert::ConvertArgs),
    /// Text to token ids and pieces with the model's tokenizer, or ids back to text.
    Tokenize(tokenize::TokenizeArgs),
}

fn run(cli: Cli) -> Result<()> {
    let m = &cli.model;
    match &cli.command {
        Command::Generate(a) => generate::run(a, m),
        Command::Chat(a) => chat::run(a, m),
        Command::Score(a) => score::run(a, m),
        Command::Inspect(a) => inspect::run(a, m),
        Command::Attention(a) => attention::run(a, m),
        Command::Bench(a) => bench::run(a, m),
        Command::Trace(a) => trace::run(a, m),
        Command::Train(a) => train::run(a, m),
        Command::Convert(a) => convert::run(a, m),
        Command::Serve(a) => serve::run(a, m),
        Command::Tokenize(a) => tokenize::run(a, m),
    }
}

fn main() -> ExitCode {
    // Rust ignores SIGPIPE, so `gpt inspect | head` would fail on a closed pipe mid-print;
    // the default action ends the process quietly, as other command-line tools do.
    #[cfg(unix)]
    // SAFETY: setting a signal's disposition to its default before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    // Candle attaches a backtrace to every error when RUST_BACKTRACE is set, and messages
    // that quote an error would carry it along. Errors here are for users: keep library
    // backtraces off unless asked for explicitly (RUST_LIB_BACKTRACE=1). Set before any
    // thread starts or any backtrace is captured (std caches the setting).
    if std::env::var_os("RUST_LIB_BACKTRACE").is_none() {
        std::env::set_var("RUST_LIB_BACKTRACE", "0");
    }
    // Candle's element-wise ops run on its own pool, whose idle workers spin 25,000 times
    // before they sleep; the products that follow run on rayon's pool, and with as many
    // threads as cores the spinning worker takes a core from them (100 spins: faster
    // prefills, docs/PERFORMANCE.md, "Memory"). Read once, when Candle's pool
    // starts, so set before any thread does.
    if std::env::var_os("CANDLE_BARRIER_POOL_SPIN_LIMIT").is_none() {
        std::env::set_var("CANDLE_BARRIER_POOL_SPIN_LIMIT", "100");
    }
    // A bug must still end in one line, not a backtrace. Written without `eprintln!`, which
    // panics (inside the hook: an abort) when stderr is a closed pipe.
    std::panic::set_hook(Box::new(|info| {
        use std::io::Write;
        if text::tokenizer_json::guarded() {
            return; // a malformed tokenizer: the caller reports it as an error
        }
        let _ = writeln!(std::io::stderr(), "error: internal error: {info}");
    }));
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => e.exit(), // --help, --version
        Err(e) => {
            // Clap's message is several lines with usage; keep the first, as for every error.
            let text = e.to_string();
            let first = text.lines().next().unwrap_or("invalid arguments");
            eprintln!("{} (see gpt --help)", first.trim_end());
            return ExitCode::from(2);
        }
    };
    // A server must outlive its clients: with the default action, one write to a client that
    // has reset its connection (hyper writes with `writev`, which raises SIGPIPE) would end
    // the process. Ignored, the write fails with EPIPE for that connection alone.
    #[cfg(unix)]
    if matches!(cli.command, Command::Serve(_)) {
        // SAFETY: setting a signal's disposition before any thread starts.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_IGN);
        }
    }
    if let Some(n) = cli.threads {
        if n == 0 {
            eprintln!("error: --threads must be at least 1");
            return ExitCode::FAILURE;
        }
        // Candle sizes its matmul threads and its own pools (the one behind quantized
        // products included) from these variables when they first run; rayon's global
        // pool serves our kernels.
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
        std::env::set_var("CANDLE_NUM_THREADS", n.to_string());
    }
    if matches!(cli.command, Command::Train(_)) {
        alloc::keep_freed_memory();
    }
    // The main thread's stack size for the pool's threads (the command runs on one).
    let _ = rayon::ThreadPoolBuilder::new()
        .stack_size(8 << 20)
        .build_global();
    // Run the command on a worker of that pool: each parallel kernel then splits from a
    // worker, which takes a share itself, instead of handing every product from the main
    // thread to the pool and sleeping until it is done (decoding runs ~50 a token).
    match rayon::scope(|_| run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line: the chain of causes joined, newlines folded.
            let msg = format!("{e:#}").replace('\n', " ");
            eprintln!("error: {msg}");
            ExitCode::FAILURE
        }
    }
}
