//! `gpt tokenize`: text to token ids and pieces, or ids back to text, with the model's own
//! tokenizer (no weights are read).

use std::io::Read;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::{json, Value};

use crate::args::{self, Format, ModelArgs};
use crate::model;
use crate::text::tokenizer::Tokenizer;
use crate::tokens::{self, piece_json};

/// Options of `gpt tokenize`.
#[derive(Debug, Args)]
pub struct TokenizeArgs {
    /// The text to tokenize.
    #[arg(long, conflicts_with_all = ["file", "ids"])]
    pub text: Option<String>,
    /// A file whose whole text to tokenize (`-`: standard input).
    #[arg(long, conflicts_with = "ids")]
    pub file: Option<PathBuf>,
    /// Token ids to turn back into text (`1,2,3`).
    #[arg(long)]
    pub ids: Option<String>,
    /// Without the special tokens the tokenizer adds around a text (BOS for Llama-style
    /// vocabularies).
    #[arg(long)]
    pub no_special: bool,
    /// Special tokens written in the text (`<s>`, `<|im_end|>`) stay text instead of
    /// becoming those tokens.
    #[arg(long)]
    pub no_parse_special: bool,
    /// Output: `text` (one `id<TAB>piece` line per token), or `json`
    /// (`{"ids": [...], "pieces": [...]}`; `{"text": ...}` for --ids).
    #[arg(long, value_enum, default_value = "text")]
    pub format: Format,
}

/// Runs `gpt tokenize`.
pub fn run(a: &TokenizeArgs, margs: &ModelArgs) -> Result<()> {
    let (tokenizer, _, source) = model::load_text(margs)?;
    let Some(tok) = tokenizer else {
        bail!("{source}: the model has no tokenizer")
    };
    if let Some(ids) = &a.ids {
        let ids = tokens::parse_ids(ids)?;
        let text = tok.decode(&ids)?;
        match a.format {
            Format::Text => println!("{text}"),
            Format::Json => println!("{}", json!({ "text": text })),
        }
        return Ok(());
    }
    let text = match (&a.text, &a.file) {
        (Some(t), _) => t.clone(),
        (None, Some(p)) if p.as_os_str() == "-" => {
            let mut s = String::new();
            std::io::stdin()
                .read_to_string(&mut s)
                .context("reading standard input")?;
            s
        }
        (None, Some(p)) => args::read_text(p)?,
        (None, None) => bail!("give --text, --file or --ids"),
    };
    let ids = tok.encode_with(&text, !a.no_special, !a.no_parse_special)?;
    print_tokens(&tok, &ids, a.format)
}

fn print_tokens(tok: &Tokenizer, ids: &[u32], format: Format) -> Result<()> {
    let pieces = ids
        .iter()
        .map(|&id| tok.piece_bytes(id))
        .collect::<Result<Vec<_>>>()?;
    match format {
        Format::Json => {
            let pieces: Vec<Value> = pieces.into_iter().map(piece_json).collect();
            println!("{}", json!({ "ids": ids, "pieces": pieces }));
        }
        Format::Text => {
            for (id, bytes) in ids.iter().zip(pieces) {
                // Shown as Rust debug strings: spaces, newlines and cut characters visible.
                let piece = match String::from_utf8(bytes) {
                    Ok(s) => format!("{s:?}"),
                    Err(e) => format!("bytes {:?}", e.into_bytes()),
                };
                println!("{id}\t{piece}");
            }
        }
    }
    Ok(())
}
