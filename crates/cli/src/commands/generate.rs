//! `gpt generate`: continue prompts.

use std::io::Write;
use std::time::Instant;

use crate::args::{self, Format, ModelArgs, SamplingArgs};
use crate::model::{self, Loaded};
use crate::text::chat_template::{message, Conversation};
use crate::text::grammar::{GrammarSpec, Grammars};
use crate::tokens::{self, visible, Truncate};
use anyhow::{bail, Result};
use clap::Args;
use gpt_blocks::{GenerateOptions, Steer};

/// Options of `gpt generate`.
#[derive(Debug, Clone, Args)]
pub struct GenerateArgs {
    /// Prompt text; give it several times to run a padded batch.
    #[arg(long, action = clap::ArgAction::Append, required_unless_present_any = ["prompt_ids", "prompt_file", "messages"])]
    pub prompt: Vec<String>,
    /// Prompt as token ids, e.g. 464,3290,318.
    #[arg(long, conflicts_with_all = ["prompt", "prompt_file"])]
    pub prompt_ids: Option<String>,
    /// Read the prompt from a UTF-8 text file.
    #[arg(long, conflicts_with = "prompt")]
    pub prompt_file: Option<std::path::PathBuf>,
    /// Most new tokens per prompt (default: 64, or what the context leaves).
    #[arg(long)]
    pub max_new_tokens: Option<usize>,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Stop when this text appears (may be given several times); it is not printed.
    #[arg(long, action = clap::ArgAction::Append)]
    pub stop: Vec<String>,
    /// Output format.
    #[arg(long, value_enum, default_value = "text")]
    pub format: Format,
    /// Drop tokens from this end of a prompt that does not fit in the context.
    #[arg(long, value_enum)]
    pub truncate: Option<Truncate>,
    /// Send each prompt as a user message through the model's chat template (or the plain
    /// `User: … / Assistant:` format when it has none) and print the reply.
    #[arg(long, conflicts_with = "prompt_ids")]
    pub chat: bool,
    /// A system message before the user's (with --chat).
    #[arg(long, requires = "chat")]
    pub system: Option<String>,
    /// A whole conversation from a JSON file (with --chat): OpenAI's list of messages
    /// (`role`, `content`, `tool_calls`, `tool_call_id`, ...), or an object with
    /// `messages` and optionally `tools`, `documents` and `chat_template_kwargs`
    /// (`{"enable_thinking": false}`), passed to the template as transformers passes them.
    #[arg(long, requires = "chat", conflicts_with_all = ["prompt", "prompt_file", "system"])]
    pub messages: Option<std::path::PathBuf>,
    /// Generate JSON that follows this JSON schema (a file), as `gpt serve`'s
    /// `response_format` does: tokens that would break it are never sampled, and a reply
    /// ends where the JSON is complete.
    #[arg(long, conflicts_with = "grammar")]
    pub json_schema: Option<std::path::PathBuf>,
    /// Generate text that follows this grammar (a file in llguidance's Lark syntax, which
    /// takes regular expressions as `/.../` terminals).
    #[arg(long)]
    pub grammar: Option<std::path::PathBuf>,
}

/// Runs `gpt generate`.
pub fn run(a: &GenerateArgs, margs: &ModelArgs) -> Result<()> {
    if a.stop.iter().any(String::is_empty) {
        bail!("--stop text must not be empty")
    }
    let Loaded {
        model,
        tokenizer,
        chat,
        ..
    } = model::load_for_inference(margs)?;
    let tokenizer = tokenizer.map(std::sync::Arc::new);
    let tok = tokenizer.as_deref();
    let cfg = model.config().clone();
    let asked = a.max_new_tokens.unwrap_or(0);
    if asked >= cfg.n_positions {
        bail!(
            "--max-new-tokens {asked} leaves no room for a prompt in the model's context of {}",
            cfg.n_positions
        )
    }
    let room = cfg.n_positions - asked;
    let texts: Vec<String> = match &a.prompt_file {
        Some(f) => vec![args::read_text(f)?],
        None => a.prompt.clone(),
    };
    let prompts: Vec<Vec<u32>> = match (&a.prompt_ids, &a.messages) {
        (Some(ids), _) => vec![tokens::parse_ids(ids)?],
        (None, Some(file)) => {
            let text = args::read_text(file)?;
            let json: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| anyhow::anyhow!("{}: not JSON: {e}", file.display()))?;
            let conv = Conversation::from_json(&json)
                .map_err(|e| anyhow::anyhow!("{}: {e:#}", file.display()))?;
            vec![chat.prompt_ids(tok, &conv)?]
        }
        (None, None) if a.chat => texts
            .iter()
            .map(|t| {
                let mut messages: Vec<_> = a.system.iter().map(|s| message("system", s)).collect();
                messages.push(message("user", t));
                chat.prompt_ids(tok, &Conversation::new(messages))
            })
            .collect::<Result<_>>()?,
        (None, None) => texts
            .iter()
            .map(|p| tokens::encode(tok, p))
            .collect::<Result<_>>()?,
    };
    // A reply ends at the template's end-of-turn tokens (and, in the plain format, at the
    // next turn's label).
    let (stop_tokens, stops) = match a.chat {
        true => (
            chat.stop_ids(tok, cfg.eos_token_id),
            [a.stop.clone(), chat.stop_texts()].concat(),
        ),
        false => (cfg.eos_token_id.into_iter().collect(), a.stop.clone()),
    };
    let mut fitted = Vec::with_capacity(prompts.len());
    for p in prompts {
        if p.is_empty() {
            bail!("a prompt encodes to no tokens; give some text")
        }
        tokens::check_ids(&p, &model)?;
        fitted.push(tokens::fit(p, room, a.truncate, cfg.n_positions)?);
    }
    let longest = fitted.iter().map(Vec::len).max().unwrap_or(0);
    let max_new_tokens = match a.max_new_tokens {
        Some(n) => n,
        None if longest >= cfg.n_positions => bail!(
            "the prompt fills the model's context of {} tokens; nothing can be generated (see --truncate)",
            cfg.n_positions
        ),
        None => 64.min(cfg.n_positions - longest),
    };
    let sampling = a.sampling.params()?;
    let opts = GenerateOptions {
        max_new_tokens,
        sampling,
        stop_tokens,
    };
    let spec = match (&a.json_schema, &a.grammar) {
        (Some(f), _) => {
            let text = args::read_text(f)?;
            let schema = serde_json::from_str(&text)
                .map_err(|e| anyhow::anyhow!("{}: not JSON: {e}", f.display()))?;
            Some((f, GrammarSpec::JsonSchema(schema)))
        }
        (None, Some(f)) => Some((f, GrammarSpec::Lark(args::read_text(f)?))),
        (None, None) => None,
    };
    let constraints = match spec {
        None => Vec::new(),
        Some((file, spec)) => {
            let Some(tok) = tokenizer.clone() else {
                bail!("--json-schema and --grammar need the model's tokenizer, and this model has none")
            };
            let eos = opts.stop_tokens.first().copied().unwrap_or(0);
            let grammars = Grammars::new(tok, cfg.vocab_size, eos)?;
            let c = grammars
                .compile(&spec)
                .map_err(|e| anyhow::anyhow!("{}: cannot be enforced: {e:#}", file.display()))?;
            (0..fitted.len()).map(|_| c.fork()).collect()
        }
    };
    let constraints = std::cell::RefCell::new(constraints);
    let complete = std::cell::RefCell::new(vec![false; fitted.len()]);
    let stream = a.format == Format::Text && fitted.len() == 1;
    let mut stdout = std::io::stdout().lock();
    // A chat prints the reply only.
    if stream && !a.chat {
        write!(stdout, "{}", tokens::decode(tok, &fitted[0])?)?;
        stdout.flush()?;
    }
    let mut news: Vec<Vec<u32>> = vec![Vec::new(); fitted.len()];
    let mut shown = vec![0usize; fitted.len()];
    let mut stopped = vec![false; fitted.len()];
    let mut error = None;
    // A chat's reply leaves out the token that ended the turn.
    let reply = |new: &[u32]| -> Vec<u32> {
        match new.split_last() {
            Some((t, rest)) if a.chat && opts.stop_tokens.contains(t) => rest.to_vec(),
            _ => new.to_vec(),
        }
    };
    let started = Instant::now();
    let mut first_token_at = None;
    // A constrained row samples among the tokens its grammar allows, and ends where the
    // grammar is complete.
    let steer = |row: usize, logits: &mut [f32]| -> candle_core::Result<Steer> {
        let mut cs = constraints.borrow_mut();
        let Some(c) = cs.get_mut(row) else {
            return Ok(Steer::Sample);
        };
        let allowed = c.allowed().map_err(candle_core::Error::wrap)?;
        if allowed.must_end() {
            complete.borrow_mut()[row] = true;
            return Ok(Steer::End);
        }
        allowed.apply(logits, &opts.stop_tokens);
        Ok(Steer::Sample)
    };
    let out = gpt_blocks::generate_steered(&model, &fitted, &opts, steer, |row, t| {
        if let Some(c) = constraints.borrow_mut().get_mut(row) {
            if !opts.stop_tokens.contains(&t) {
                if let Err(e) = c.commit(t) {
                    error = Some(e);
                    return false;
                }
            }
        }
        if first_token_at.is_none() {
            // The prefill is done: its temporaries go back to the OS before decoding.
            crate::alloc::release_freed_memory();
            first_token_at = Some(Instant::now());
        }
        news[row].push(t);
        match visible(tok, &reply(&news[row]), &stops, false) {
            Ok((text, stop)) => {
                if stream && text.len() > shown[row] {
                    let _ = write!(stdout, "{}", &text[shown[row]..]);
                    let _ = stdout.flush();
                    shown[row] = text.len();
                }
                stopped[row] = stop;
                !stop
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
    let decode_end = Instant::now();
    for (row, new) in out.iter().enumerate() {
        let (text, stop) = visible(tok, &reply(new), &stops, true)?;
        let reason = if stop || stopped[row] {
            "stop_text"
        } else if new.last().is_some_and(|t| opts.stop_tokens.contains(t)) {
            "end_of_text"
        } else if complete.borrow()[row] {
            "grammar_complete"
        } else {
            "length"
        };
        match a.format {
            Format::Text if stream => {
                if text.len() > shown[row] {
                    write!(stdout, "{}", &text[shown[row]..])?;
                }
                writeln!(stdout)?;
            }
            Format::Text => {
                let prompt = match a.chat {
                    true => String::new(),
                    false => tokens::decode(tok, &fitted[row])?,
                };
                writeln!(stdout, "{prompt}{text}")?;
                if row + 1 < out.len() {
                    writeln!(stdout, "---")?;
                }
            }
            Format::Json => {
                let obj = serde_json::json!({
                    "prompt_ids": fitted[row],
                    "new_ids": new,
                    "text": text,
                    "finish_reason": reason,
                });
                writeln!(stdout, "{obj}")?;
            }
        }
    }
    // Speed on stderr, so stdout stays the text.
    let n_prompt: usize = fitted.iter().map(Vec::len).sum();
    let n_new: usize = out.iter().map(Vec::len).sum();
    if let Some(first) = first_token_at {
        let prefill = (first - started).as_secs_f64();
        let decode = (decode_end - first).as_secs_f64();
        let decoded = n_new.saturating_sub(fitted.len());
        eprintln!(
            "prompt: {n_prompt} tokens in {prefill:.3} s ({:.1} tokens/s); generation: {n_new} tokens, {:.1} tokens/s",
            n_prompt as f64 / prefill.max(1e-9),
            if decoded > 0 { decoded as f64 / decode.max(1e-9) } else { 0.0 }
        );
    }
    Ok(())
}
