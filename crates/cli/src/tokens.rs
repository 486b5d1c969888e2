//! Token ids in and out: parsed from the command line, checked against the vocabulary,
//! fitted into the context, encoded and decoded, and shown as a stream that never cuts a
//! character or a stop text in two.

use anyhow::{anyhow, bail, Result};
use clap::ValueEnum;
use gpt_blocks::Gpt;
use serde_json::{json, Value};

use crate::text::tokenizer::Tokenizer;

/// Parses `1,2,3` into token ids.
pub fn parse_ids(s: &str) -> Result<Vec<u32>> {
    let ids = s
        .split(',')
        .map(|t| {
            let t = t.trim();
            t.parse::<u32>().map_err(|_| {
                anyhow!("token ids must be non-negative integers separated by commas, got {t:?}")
            })
        })
        .collect::<Result<Vec<_>>>()?;
    if ids.is_empty() {
        bail!("no token ids given")
    }
    Ok(ids)
}

/// Checks ids against the vocabulary.
pub fn check_ids(ids: &[u32], model: &Gpt) -> Result<()> {
    let vocab = model.config().vocab_size;
    if let Some(bad) = ids.iter().find(|&&i| i as usize >= vocab) {
        bail!("token id {bad} is outside the vocabulary of {vocab} tokens")
    }
    Ok(())
}

/// Encodes text, or says why it cannot.
pub fn encode(tokenizer: Option<&Tokenizer>, text: &str) -> Result<Vec<u32>> {
    let tok = tokenizer.ok_or_else(|| {
        anyhow!("this model has no tokenizer, so it cannot read text; pass token ids instead (--prompt-ids / --ids)")
    })?;
    tok.encode(text, true)
}

/// Decodes ids, or shows them when there is no tokenizer.
pub fn decode(tokenizer: Option<&Tokenizer>, ids: &[u32]) -> Result<String> {
    match tokenizer {
        Some(t) => t.decode(ids),
        None => Ok(ids.iter().map(|i| format!("<{i}>")).collect()),
    }
}

/// Each token's text, for labels.
pub fn token_texts(tokenizer: Option<&Tokenizer>, ids: &[u32]) -> Vec<String> {
    ids.iter()
        .map(|&i| match tokenizer.and_then(|t| t.decode(&[i]).ok()) {
            Some(s) => s.replace('\n', "\\n"),
            None => format!("<{i}>"),
        })
        .collect()
}

/// Which end to drop from a prompt longer than the context.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Truncate {
    /// Keep the end of the prompt.
    Left,
    /// Keep the beginning.
    Right,
}

/// Fits `ids` into `room` tokens, or explains why not.
pub fn fit(
    ids: Vec<u32>,
    room: usize,
    truncate: Option<Truncate>,
    context: usize,
) -> Result<Vec<u32>> {
    if ids.len() <= room {
        return Ok(ids);
    }
    match truncate {
        None => bail!(
            "the prompt has {} tokens but only {room} fit in the model's context of {context} \
             (with the new tokens asked for); shorten it or pass --truncate left|right",
            ids.len()
        ),
        Some(Truncate::Left) => Ok(ids[ids.len() - room..].to_vec()),
        Some(Truncate::Right) => Ok(ids[..room].to_vec()),
    }
}

/// Text of `new` so far that is safe to show: no half-decoded character at its end, and
/// nothing that could still turn into a stop text. Returns `(text, stopped)`.
pub fn visible(
    tok: Option<&Tokenizer>,
    new: &[u32],
    stops: &[String],
    finished: bool,
) -> Result<(String, bool)> {
    let text = decode(tok, new)?;
    if let Some(cut) = stops.iter().filter_map(|s| text.find(s.as_str())).min() {
        return Ok((text[..cut].to_string(), true));
    }
    if finished {
        return Ok((text, false));
    }
    // A byte-level token can end inside a character: hold back U+FFFD at the end.
    let mut end = text.trim_end_matches('\u{FFFD}').len();
    // Hold back a tail that could be the start of a stop text.
    let longest = stops.iter().map(String::len).max().unwrap_or(0);
    if longest > 1 {
        end = end.min(text.len().saturating_sub(longest - 1));
    }
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    Ok((text[..end].to_string(), false))
}

/// A token's piece as JSON, as llama.cpp's `/tokenize` gives it: a string when its bytes are
/// UTF-8 by themselves, else the list of bytes.
pub fn piece_json(bytes: Vec<u8>) -> Value {
    match String::from_utf8(bytes) {
        Ok(s) => json!(s),
        Err(e) => json!(e.into_bytes()),
    }
}
