//! `gpt`: run, score, inspect, visualise, benchmark and train small GPT models.

mod attention;
mod bench;
mod chat;
mod common;
mod convert;
mod generate;
mod inspect;
mod plot;
mod score;
mod serve;
mod text;
mod tokenize;
mod trace;
mod train;

use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};

use common::ModelArgs;

// glibc hands large freed buffers back to the OS, so every big temporary is faulted in
// again on the next op; mimalloc keeps them (measured in docs/PERFORMANCE.md).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
    /// the model it names, fine-tuned (GPT-2 or Llama; its tokenizer, architecture and size).
    Train(train::TrainArgs),
    /// Serve the OpenAI HTTP API (completions, chat) with continuous batching.
    Serve(serve::ServeArgs),
    /// Write the model as a GGUF file for llama.cpp (f32, f16, q8_0, q4_0).
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

/// mimalloc's `mi_option_arena_eager_commit` (its place in `mi_option_e`, the same in
/// mimalloc 2 and 3).
#[cfg(target_os = "linux")]
const MI_OPTION_ARENA_EAGER_COMMIT: libmimalloc_sys::mi_option_t = 4;

/// Commits mimalloc's arenas page by page as they are used. By default it commits each
/// arena whole where the OS overcommits, and marks it for transparent huge pages: every
/// 2 MiB region the heap touches then takes 2 MiB of memory. Measured (alternating runs,
/// medians of 5–8; 2 threads): `gpt --help` 13.1 → 7.5 MiB, GPT-2 124M q8_0 decoding
/// 187 → 162 MiB and prefill 270 → 249 MiB, f16 decoding 310 → 279 MiB, speed unchanged
/// once the weights ask for huge pages themselves (`gpt_kernels::memory::weight_vec`). Runs from
/// `.init_array`, before Rust's runtime allocates anything: the first arena is reserved
/// by the first allocation, with the setting of that moment.
/// MIMALLOC_ARENA_EAGER_COMMIT in the environment still wins.
#[cfg(target_os = "linux")]
#[used]
#[link_section = ".init_array"]
static LAZY_ARENAS: extern "C" fn() = {
    extern "C" fn lazy_arenas() {
        // SAFETY: `getenv` with a NUL-terminated name (no allocation, nothing else runs
        // yet), then a plain call on mimalloc's option table.
        unsafe {
            if libc::getenv(c"MIMALLOC_ARENA_EAGER_COMMIT".as_ptr()).is_null() {
                libmimalloc_sys::mi_option_set(MI_OPTION_ARENA_EAGER_COMMIT, 0);
            }
        }
    }
    lazy_arenas
};

/// Hands the memory freed since the last call back to the OS now, rather than after
/// mimalloc's purge delay: called after a prefill. A prefill's temporaries are tens of
/// MiB (a 512-token one of SmolLM-135M frees ~30 MiB per block) against a decoding
/// step's few KiB; kept, they stay in the process's memory for the decoding that follows,
/// and the next prefill's sizes reuse only part of them, so peaks grow from prefill to
/// prefill. `gpt bench --prompt-len 512` (a warm-up prefill, then the timed one; 2 rounds
/// each, alternating): SmolLM-135M q5_K_M 171 → 156–164 MiB, f16 322–334 → 313–316 MiB,
/// GPT-2 124M q8_0 194–197 → 189–192 MiB, prefill speed within 1–3% (the next prefill
/// faults its pages in afresh). The call itself takes 1–2 ms. Not in training, which
/// keeps freed memory on purpose ([`keep_freed_memory`]).
pub(crate) fn release_freed_memory() {
    // SAFETY: a plain FFI call; mimalloc collects the calling thread's heap and purges
    // the free pages of its arenas.
    unsafe { libmimalloc_sys::mi_collect(true) }
}

/// mimalloc's `mi_option_purge_delay` (its place in `mi_option_e`, the same in mimalloc 2
/// and 3; libmimalloc-sys does not name it) and its documented defaults: 10 ms in
/// mimalloc 2, 1000 ms in mimalloc 3 (what libmimalloc-sys 0.1.49 builds).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;
const MI_DEFAULT_PURGE_DELAYS: [std::os::raw::c_long; 2] = [10, 1000];

/// Training keeps freed memory for reuse instead of returning it to the OS once it has
/// been free for the purge delay: a step frees and reallocates hundreds of large
/// temporaries, and returned ones fault in again. With mimalloc 2's 10 ms a 6-step trial
/// ran at 1206–1652 tokens/s against 1925–2345 with this (docs/PERFORMANCE.md); with
/// mimalloc 3's 1000 ms, 12 steps of the same trial, 5 rounds alternating, medians: 13147
/// against 14076 tokens/s (13549 against 13945 with eagerly committed arenas). The cost is
/// that the process keeps its peak memory until it exits, which inference need not pay: a
/// `gpt bench` of three 512-token prefills grew from 208 to 224 MiB (GPT-2 124M q8_0)
/// when freed pages were never returned, at the same speed. MIMALLOC_PURGE_DELAY in the
/// environment still wins.
fn keep_freed_memory() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
        return;
    }
    // SAFETY: plain FFI calls on mimalloc's option table. The default is checked first, so
    // a future mimalloc that numbers its options differently is left alone.
    unsafe {
        let delay = libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY);
        if MI_DEFAULT_PURGE_DELAYS.contains(&delay) {
            libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1);
        }
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
    // threads as cores the spinning worker takes a core from them. 100 spins: GPT-2 124M
    // prefill (512 tokens, 2 threads, alternating runs, medians) +11% in f16, +15% in q8_0,
    // SmolLM-135M q8_0 +10%; decoding did not move beyond the noise. Read once, when
    // Candle's pool starts, so set before any thread does.
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
        keep_freed_memory();
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
