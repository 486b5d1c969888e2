//! `gpt chat`: a conversation on the terminal. Replies stream as they are generated; the
//! history is rendered with the model's chat template each turn, dropping the oldest turns
//! when it outgrows the context. Commands: `/reset`, `/system TEXT`, `/exit`; Ctrl-C stops
//! the reply being written (not the program), end of input (Ctrl-D) exits.

use std::io::{BufRead, IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{bail, Result};
use clap::Args;
use gpt_blocks::{GenerateOptions, SamplingParams};

use crate::args::{ModelArgs, SamplingArgs};
use crate::model::{self, Loaded};
use crate::text::chat_template::{message, Conversation};
use crate::tokens::visible;

/// Options of `gpt chat`.
#[derive(Debug, Clone, Args)]
pub struct ChatArgs {
    /// System message at the start of the conversation.
    #[arg(long)]
    pub system: Option<String>,
    /// Most new tokens per reply.
    #[arg(long, default_value_t = 256)]
    pub max_new_tokens: usize,
    /// A variable for the chat template, `KEY=VALUE` (VALUE as JSON, else as text), as
    /// transformers' `chat_template_kwargs`: `--template-var enable_thinking=false` turns
    /// Qwen3's and SmolLM3's reasoning off. Repeatable.
    #[arg(long = "template-var", value_name = "KEY=VALUE")]
    pub template_vars: Vec<String>,
    /// Reply `n` samples with seed + n.
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

/// Set by Ctrl-C; the reply being generated checks it after every token.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

#[cfg(unix)]
extern "C" fn on_interrupt(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::Relaxed);
}

/// Ctrl-C stops the reply instead of the program.
fn catch_interrupts() {
    #[cfg(unix)]
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(
            libc::SIGINT,
            on_interrupt as extern "C" fn(libc::c_int) as libc::sighandler_t,
        );
    }
}

/// Runs `gpt chat`.
pub fn run(a: &ChatArgs, margs: &ModelArgs) -> Result<()> {
    let Loaded {
        model,
        tokenizer,
        chat,
        source,
    } = model::load_for_inference(margs)?;
    let tok = tokenizer.as_ref();
    if tok.is_none() {
        bail!("{source} has no tokenizer; gpt chat needs one")
    }
    let sampling = a.sampling.params()?;
    let n_ctx = model.config().n_positions;
    let stop_tokens = chat.stop_ids(tok, model.config().eos_token_id);
    let stops = chat.stop_texts();
    let interactive = std::io::stdin().is_terminal();
    if interactive {
        let kind = if chat.is_own() {
            "its chat template"
        } else {
            "the plain format"
        };
        eprintln!(
            "{source} ({kind}); /reset, /system TEXT, /exit; Ctrl-C stops a reply, Ctrl-D exits"
        );
        catch_interrupts();
    }
    let vars = template_vars(&a.template_vars)?;
    let mut system = a.system.clone();
    let mut history: Vec<serde_json::Value> = Vec::new();
    let mut turn = 0u64;
    let mut stdout = std::io::stdout().lock();
    let mut lines = std::io::stdin().lock().lines();
    loop {
        if interactive {
            write!(stdout, "> ")?;
            stdout.flush()?;
        }
        let Some(line) = lines.next() else { break };
        let line = line?;
        let line = line.trim_end_matches(['\r', '\n']);
        if line.trim().is_empty() {
            continue;
        }
        match line
            .split_once(' ')
            .map_or((line, ""), |(c, rest)| (c, rest))
        {
            ("/exit" | "/quit", _) => break,
            ("/reset", _) => {
                history.clear();
                writeln!(stdout, "(conversation cleared)")?;
                continue;
            }
            ("/system", text) => {
                system = Some(text.trim().to_string()).filter(|s| !s.is_empty());
                history.clear();
                writeln!(stdout, "(system message set; conversation cleared)")?;
                continue;
            }
            (c, _) if c.starts_with('/') => {
                writeln!(stdout, "(commands: /reset, /system TEXT, /exit)")?;
                continue;
            }
            _ => {}
        }
        history.push(message("user", line));
        // The oldest turns go first when the conversation outgrows the context.
        let prompt = loop {
            let messages = system
                .iter()
                .map(|s| message("system", s))
                .chain(history.iter().cloned())
                .collect();
            let mut conv = Conversation::new(messages);
            conv.extra.extend(vars.clone());
            let ids = chat.prompt_ids(tok, &conv);
            match ids {
                Ok(ids) if ids.len() + a.max_new_tokens > n_ctx && history.len() > 1 => {
                    history.drain(..history.len().min(2));
                }
                other => break other,
            }
        };
        // A template may refuse a conversation (raise_exception): say so and go on.
        let prompt = match prompt {
            Ok(ids) => ids,
            Err(e) => {
                writeln!(stdout, "(not sent: {e:#})")?;
                history.pop();
                continue;
            }
        };
        if prompt.len() >= n_ctx {
            writeln!(
                stdout,
                "(that message takes {} tokens, more than the context of {n_ctx}; not sent)",
                prompt.len()
            )?;
            history.pop();
            continue;
        }
        let opts = GenerateOptions {
            max_new_tokens: a.max_new_tokens.min(n_ctx - prompt.len()),
            sampling: SamplingParams {
                seed: sampling.seed.wrapping_add(turn),
                ..sampling.clone()
            },
            stop_tokens: stop_tokens.clone(),
        };
        turn += 1;
        INTERRUPTED.store(false, Ordering::Relaxed);
        let mut new = Vec::new();
        let mut shown = 0;
        let mut reply = String::new();
        let mut error = None;
        let mut prefilled = false;
        gpt_blocks::generate(&model, &[prompt], &opts, |_, t| {
            if !std::mem::replace(&mut prefilled, true) {
                // The turn's prefill is done: its temporaries go back before decoding.
                crate::alloc::release_freed_memory();
            }
            if !stop_tokens.contains(&t) {
                new.push(t);
            }
            match visible(tok, &new, &stops, false) {
                Ok((text, stop)) => {
                    if text.len() > shown {
                        let _ = write!(stdout, "{}", &text[shown..]);
                        let _ = stdout.flush();
                        shown = text.len();
                    }
                    reply = text;
                    !stop && !INTERRUPTED.load(Ordering::Relaxed)
                }
                Err(e) => {
                    error = Some(e);
                    false
                }
            }
        })?;
        if let Some(e) = error {
            return Err(e);
        }
        let (text, _) = visible(tok, &new, &stops, true)?;
        if !INTERRUPTED.load(Ordering::Relaxed) && text.len() > shown {
            write!(stdout, "{}", &text[shown..])?;
            reply = text;
        }
        writeln!(stdout)?;
        history.push(message("assistant", reply.trim()));
    }
    Ok(())
}

/// `KEY=VALUE` pairs as template variables: VALUE parsed as JSON (`false`, `3`, `"x"`,
/// `{...}`), else taken as text.
fn template_vars(pairs: &[String]) -> Result<serde_json::Map<String, serde_json::Value>> {
    pairs
        .iter()
        .map(|p| {
            let Some((k, v)) = p.split_once('=').filter(|(k, _)| !k.trim().is_empty()) else {
                bail!("--template-var {p:?}: expected KEY=VALUE")
            };
            let v = serde_json::from_str(v).unwrap_or_else(|_| serde_json::Value::String(v.into()));
            Ok((k.trim().to_string(), v))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn template_vars_are_json_else_text() {
        let vars = template_vars(&[
            "enable_thinking=false".into(),
            "n=3".into(),
            "date_string=26 Jul 2024".into(),
            "tools=[{\"name\": \"f\"}]".into(),
        ])
        .unwrap();
        assert_eq!(vars["enable_thinking"], json!(false));
        assert_eq!(vars["n"], json!(3));
        assert_eq!(vars["date_string"], json!("26 Jul 2024"));
        assert_eq!(vars["tools"], json!([{"name": "f"}]));
        for bad in ["novalue", "=x", " =x"] {
            let e = template_vars(&[bad.into()]).unwrap_err().to_string();
            assert!(e.contains("expected KEY=VALUE"), "{bad}: {e}");
        }
    }
}
