//! A GGUF file's tokenizer, from its `tokenizer.ggml.*` metadata:
//! - `gpt2`: byte-level BPE with the file's merges and the pre-tokenizer that llama.cpp names
//!   in `tokenizer.ggml.pre` ([`PRE_TOKENIZERS`]: each name's split patterns as the model's own
//!   `tokenizer.json` writes them), built as that `tokenizer.json` and parsed like any other.
//!   A name outside the table is refused, never replaced by another pattern; a file with no
//!   name gets llama.cpp's `default` patterns, as llama.cpp gives it.
//! - `llama`: SentencePiece BPE computed as SentencePiece computes it ([`SentencePiece`]).
//!
//! And back: [`to_vocab`] writes a tokenizer as GGUF metadata, for `gpt convert`.

use std::collections::HashMap;

use anyhow::{bail, Context, Result};
use gpt_blocks::GgufVocab;
use serde_json::{json, Value};

use super::sentencepiece::{PieceKind, SentencePiece};
use super::tokenizer::{SentencePieceTokenizer, Tokenizer};
use super::tokenizer_json;

/// llama.cpp's token types.
const UNKNOWN: i32 = 2;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;

/// Llama 3's `tokenizer.json` pattern (llama.cpp's LLAMA3 group).
const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's (and Qwen3's).
const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen3.5's: marks join their letters.
const QWEN35: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Mistral's Tekken (Mistral Nemo).
const TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// GPT-4o's (o200k: Phi-4-mini, Llama 4).
const GPT4O: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// llama.cpp's `default`: four patterns applied one after the other.
const DEFAULT: [&str; 4] = [
    r"[\p{P}\$\+<=>\^~\|]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
];

/// How a byte-level vocabulary splits text before its merges.
#[derive(Debug, Clone, Copy)]
enum Pre {
    /// GPT-2's `ByteLevel` pre-tokenizer (its own pattern).
    ByteLevel,
    /// Each digit alone, then GPT-2's (StarCoder, SmolLM, Cohere).
    DigitsThenByteLevel,
    /// These patterns in turn (each splits what the one before left), then bytes.
    Split(&'static [&'static str]),
}

/// The pre-tokenizers by llama.cpp's `tokenizer.ggml.pre` names (src/llama-vocab.cpp of
/// October 2026: each name its group's patterns), and whether the vocabulary takes a word
/// that is a token whole before merging (`ignore_merges`, as llama.cpp sets it).
pub const PRE_TOKENIZERS: &[(&[&str], &str)] = &[
    (
        &[
            "gpt-2",
            "gpt2",
            "phi-2",
            "mpt",
            "olmo",
            "jais",
            "trillion",
            "gigachat",
            "a.x-4.0",
            "mellum",
            "granite-docling",
        ],
        "gpt2",
    ),
    (
        &[
            "llama-bpe",
            "llama3",
            "llama-v3",
            "dbrx",
            "smaug-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "lfm2",
            "midm-2.0",
            "jina-v5-nano",
        ],
        "llama3",
    ),
    (
        &[
            "qwen2",
            "deepseek-r1-qwen",
            "stablelm2",
            "kormo",
            "f2llmv2",
            "hunyuan",
            "solar-open",
        ],
        "qwen2",
    ),
    (&["qwen35"], "qwen35"),
    (
        &[
            "smollm",
            "starcoder",
            "refact",
            "command-r",
            "codeshell",
            "exaone",
            "minerva-7b",
            "mellum2",
        ],
        "digits",
    ),
    (&["tekken"], "tekken"),
    (
        &["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"],
        "gpt4o",
    ),
    (&["default"], "default"),
];

/// The pre-tokenizer and `ignore_merges` of a group of [`PRE_TOKENIZERS`].
fn group(name: &str) -> Option<(Pre, bool)> {
    Some(match name {
        "gpt2" => (Pre::ByteLevel, false),
        "llama3" => (Pre::Split(&[LLAMA3]), true),
        "qwen2" => (Pre::Split(&[QWEN2]), false),
        "qwen35" => (Pre::Split(&[QWEN35]), false),
        "digits" => (Pre::DigitsThenByteLevel, false),
        "tekken" => (Pre::Split(&[TEKKEN]), true),
        "gpt4o" => (Pre::Split(&[GPT4O]), false),
        "default" => (Pre::Split(&DEFAULT), false),
        _ => return None,
    })
}

/// The tokenizer the file's metadata describes.
pub fn from_vocab(v: &GgufVocab) -> Result<Tokenizer> {
    match v.model.as_str() {
        "gpt2" => {
            let json = byte_level(v)?;
            let bytes = serde_json::to_vec(&json)?;
            let tok = tokenizer_json::parse(&bytes)
                .map_err(|e| anyhow::anyhow!("building the GGUF tokenizer: {e}"))?;
            Ok(tok.into())
        }
        "llama" => Ok(Tokenizer::SentencePiece(Box::new(SentencePieceTokenizer {
            sp: sentencepiece(v)?,
            bos: v.bos,
            eos: v.eos,
            // llama.cpp's defaults for SentencePiece vocabularies.
            add_bos: v.add_bos.unwrap_or(true) && v.bos.is_some(),
            add_eos: v.add_eos.unwrap_or(false) && v.eos.is_some(),
        }))),
        other => bail!(
            "GGUF tokenizer model {other:?} is not supported (gpt2 and llama are); pass token ids with --prompt-ids"
        ),
    }
}

/// The SentencePiece vocabulary of a `llama` tokenizer.
pub fn sentencepiece(v: &GgufVocab) -> Result<SentencePiece> {
    let n = v.tokens.len();
    let Some(scores) = &v.scores else {
        bail!("GGUF tokenizer: a llama (SentencePiece) vocabulary needs tokenizer.ggml.scores")
    };
    let kinds = match &v.token_types {
        Some(t) => t
            .iter()
            .enumerate()
            .map(|(i, &t)| {
                PieceKind::from_gguf(t).with_context(|| format!("GGUF tokenizer: token {i}"))
            })
            .collect::<Result<Vec<_>>>()?,
        None => vec![PieceKind::Normal; n],
    };
    SentencePiece::new(
        v.tokens.clone(),
        scores.clone(),
        kinds,
        // llama.cpp's default for a SentencePiece vocabulary whose file names no unknown
        // token: id 0, whatever its type (`llama_vocab::impl::load`).
        Some(v.unk.unwrap_or(0)),
        v.add_space_prefix.unwrap_or(true),
        v.remove_extra_whitespaces.unwrap_or(false),
    )
    .context("GGUF tokenizer")
}

/// Control, unknown and user-defined tokens, as transformers lists them.
fn added_tokens(types: Option<&[i32]>, tokens: &[String]) -> Vec<Value> {
    let Some(types) = types else {
        return Vec::new();
    };
    types
        .iter()
        .enumerate()
        .filter(|(_, t)| [UNKNOWN, CONTROL, USER_DEFINED].contains(t))
        .map(|(id, &t)| {
            json!({"id": id, "content": tokens[id], "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": t != USER_DEFINED})
        })
        .collect()
}

/// BOS (and EOS) around the text when asked for.
fn template(tokens: &[String], bos: Option<u32>, eos: Option<u32>) -> Option<Value> {
    if bos.is_none() && eos.is_none() {
        return None;
    }
    let special = |id: u32| json!({"SpecialToken": {"id": tokens[id as usize], "type_id": 0}});
    let mut single: Vec<Value> = bos.map(special).into_iter().collect();
    single.push(json!({"Sequence": {"id": "A", "type_id": 0}}));
    single.extend(eos.map(special));
    let specials: serde_json::Map<String, Value> = bos
        .into_iter()
        .chain(eos)
        .map(|id| {
            let t = &tokens[id as usize];
            (t.clone(), json!({"id": t, "ids": [id], "tokens": [t]}))
        })
        .collect();
    Some(
        json!({"type": "TemplateProcessing", "single": single, "pair": single.clone(),
                "special_tokens": specials}),
    )
}

fn vocab_map(tokens: &[String]) -> serde_json::Map<String, Value> {
    tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), json!(i)))
        .collect()
}

/// The pre-tokenizer llama.cpp uses for `pre` (absent: its `default`).
fn pre_tokenizer(pre: Option<&str>) -> Result<(Pre, bool)> {
    let name = pre.unwrap_or("default");
    PRE_TOKENIZERS
        .iter()
        .find(|(names, _)| names.contains(&name))
        .and_then(|(_, g)| group(g))
        .ok_or_else(|| {
            let groups: Vec<&str> = PRE_TOKENIZERS.iter().map(|(n, _)| n[0]).collect();
            anyhow::anyhow!(
                "GGUF pre-tokenizer {name:?} is not supported (supported: {} and their aliases in llama.cpp); pass token ids with --prompt-ids",
                groups.join(", ")
            )
        })
}

fn byte_level(v: &GgufVocab) -> Result<Value> {
    let Some(merges) = &v.merges else {
        bail!("GGUF tokenizer: a gpt2 (BPE) vocabulary needs tokenizer.ggml.merges")
    };
    let merges: Vec<Value> = merges
        .iter()
        .map(|m| {
            // A space after the first character (a merge may join a space token itself).
            let first = m.chars().next().map_or(0, char::len_utf8);
            (m, m[first..].find(' ').map(|i| i + first))
        })
        .map(|(m, at)| match at {
            Some(i) => Ok(json!([m[..i], m[i + 1..]])),
            None => bail!("GGUF tokenizer: merge {m:?} is not two tokens separated by a space"),
        })
        .collect::<Result<_>>()?;
    let byte_level = |use_regex: bool| {
        json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
               "use_regex": use_regex})
    };
    let split = |pattern: &str| {
        json!({"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated",
               "invert": false})
    };
    let (pre, ignore_merges) = pre_tokenizer(v.pre.as_deref())?;
    let pre_tokenizer = match pre {
        Pre::ByteLevel => byte_level(true),
        Pre::DigitsThenByteLevel => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true}, byte_level(true)]}),
        Pre::Split(patterns) => {
            let mut steps: Vec<Value> = patterns.iter().map(|p| split(p)).collect();
            steps.push(byte_level(false));
            json!({"type": "Sequence", "pretokenizers": steps})
        }
    };
    let bos = v.bos.filter(|_| v.add_bos.unwrap_or(false));
    let eos = v.eos.filter(|_| v.add_eos.unwrap_or(false));
    let post = template(&v.tokens, bos, eos).unwrap_or_else(|| {
        json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false,
               "use_regex": true})
    });
    Ok(json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added_tokens(v.token_types.as_deref(), &v.tokens),
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
                    "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": ignore_merges,
                  "vocab": vocab_map(&v.tokens), "merges": merges},
    }))
}

/// transformers' `generate_merges`: each token split in two known tokens, ordered by the
/// token's id, then by the left and right pieces' lengths (in characters); within a token,
/// by the pieces' ids.
fn sentencepiece_merges(tokens: &[String]) -> Vec<(String, String)> {
    let ids: HashMap<&str, usize> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.as_str(), i))
        .collect();
    // (id of the merged token, left length, right length, left id, right id, left, right)
    let mut merges = Vec::new();
    for (id, token) in tokens.iter().enumerate() {
        for (at, _) in token.char_indices().skip(1) {
            let (l, r) = token.split_at(at);
            if let (Some(&li), Some(&ri)) = (ids.get(l), ids.get(r)) {
                let (ll, rl) = (l.chars().count(), r.chars().count());
                merges.push((id, ll, rl, li, ri, l, r));
            }
        }
    }
    // Python sorts each token's splits by the pieces' ids, then all merges stably by
    // (id, left length, right length): one sort on the whole key does the same.
    merges.sort_by_key(|m| (m.0, m.1, m.2, m.3, m.4));
    merges
        .into_iter()
        .map(|m| (m.5.to_string(), m.6.to_string()))
        .collect()
}

/// The `tokenizer.json` transformers' converter writes for a SentencePiece BPE vocabulary
/// (`LlamaConverter`): a merge list rebuilt from the pieces, in id order. It is what a Hugging
/// Face directory of the model carries, so it is what `gpt train` saves beside a fine-tuned
/// model; it can tokenize some texts differently from SentencePiece (see [`SentencePiece`]),
/// as transformers' own files of these models do.
pub fn sentencepiece_json(t: &SentencePieceTokenizer) -> Value {
    let sp = &t.sp;
    let tokens: Vec<String> = (0..sp.len() as u32)
        .map(|i| sp.piece(i).unwrap_or_default().to_string())
        .collect();
    let types: Vec<i32> = (0..sp.len() as u32)
        .map(|i| match sp.kind(i) {
            Some(PieceKind::Unknown) => UNKNOWN,
            Some(PieceKind::Control) => CONTROL,
            Some(PieceKind::UserDefined) => USER_DEFINED,
            _ => 1,
        })
        .collect();
    let merges: Vec<Value> = sentencepiece_merges(&tokens)
        .into_iter()
        .map(|(l, r)| json!([l, r]))
        .collect();
    let prepend = match sp.add_dummy_prefix() {
        true => "always",
        false => "never",
    };
    let unk = match sp.byte_fallback() {
        false => json!(tokens[sp.unk() as usize]),
        true => Value::Null,
    };
    let bos = t.bos.filter(|_| t.add_bos);
    let eos = t.eos.filter(|_| t.add_eos);
    json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added_tokens(Some(&types), &tokens),
        "normalizer": null,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "\u{2581}",
                          "prepend_scheme": prepend, "split": false},
        "post_processor": template(&tokens, bos, eos),
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": null, "unk_token": unk,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": true, "byte_fallback": sp.byte_fallback(), "ignore_merges": false,
                  "vocab": vocab_map(&tokens), "merges": merges},
    })
}

/// The tokenizer as a `tokenizers` tokenizer: itself, or for a SentencePiece vocabulary
/// the `tokenizer.json` transformers writes for it ([`sentencepiece_json`]).
pub fn json_tokenizer(tok: &Tokenizer) -> Result<tokenizers::Tokenizer> {
    match (tok, tok.json()) {
        (_, Some(json)) => Ok(json.clone()),
        (Tokenizer::SentencePiece(t), None) => {
            let bytes = serde_json::to_vec(&sentencepiece_json(t))?;
            tokenizer_json::parse(&bytes)
        }
        (Tokenizer::Json(_), None) => bail!("no tokenizer.json"),
    }
}

/// The `tokenizer.ggml.*` metadata of a tokenizer, for writing a GGUF file: byte-level
/// BPE (GPT-2's pre-tokenizer) as `gpt2`; a SentencePiece vocabulary as `llama` with its
/// own pieces, scores and types; a `tokenizer.json` of SentencePiece-style BPE (Metaspace
/// with byte fallback) as `llama` with scores that rank merges as [`sentencepiece_merges`]
/// does. `vocab_size` is the model's: tokens past the tokenizer's are written as unused
/// padding.
pub fn to_vocab(
    tok: &Tokenizer,
    vocab_size: usize,
    bos: Option<u32>,
    eos: Option<u32>,
) -> Result<GgufVocab> {
    match tok {
        Tokenizer::SentencePiece(t) => sentencepiece_vocab(t, vocab_size),
        Tokenizer::Json(_) => match tok.json() {
            Some(json) => json_vocab(json, vocab_size, bos, eos),
            None => bail!("no tokenizer.json to write"),
        },
    }
}

fn sentencepiece_vocab(t: &SentencePieceTokenizer, vocab_size: usize) -> Result<GgufVocab> {
    let sp = &t.sp;
    if sp.len() > vocab_size {
        bail!(
            "the tokenizer has {} tokens, the model {vocab_size}",
            sp.len()
        )
    }
    let mut tokens: Vec<String> = (0..vocab_size).map(|i| format!("[PAD{i}]")).collect();
    let mut scores = vec![-1000.0f32; vocab_size];
    let mut types = vec![5i32; vocab_size];
    for id in 0..sp.len() as u32 {
        let i = id as usize;
        tokens[i] = sp.piece(id).unwrap_or_default().to_string();
        scores[i] = sp.score(id).unwrap_or(0.0);
        types[i] = match sp.kind(id) {
            Some(PieceKind::Normal) | None => 1,
            Some(PieceKind::Unknown) => UNKNOWN,
            Some(PieceKind::Control) => CONTROL,
            Some(PieceKind::UserDefined) => USER_DEFINED,
            Some(PieceKind::Unused) => 5,
            Some(PieceKind::Byte) => 6,
        };
    }
    Ok(GgufVocab {
        model: "llama".into(),
        pre: Some("default".into()),
        tokens,
        scores: Some(scores),
        token_types: Some(types),
        merges: None,
        bos: t.bos,
        eos: t.eos,
        unk: Some(sp.unk()),
        pad: None,
        add_bos: Some(t.add_bos),
        add_eos: Some(t.add_eos),
        add_space_prefix: Some(sp.add_dummy_prefix()),
        remove_extra_whitespaces: Some(sp.remove_extra_whitespaces()),
    })
}

fn json_vocab(
    tok: &tokenizers::Tokenizer,
    vocab_size: usize,
    bos: Option<u32>,
    eos: Option<u32>,
) -> Result<GgufVocab> {
    let json = serde_json::to_value(tok)?;

    let model = &json["model"];
    if model["type"] != "BPE" {
        bail!(
            "only BPE tokenizers can be written to GGUF, this one is {}",
            model["type"]
        )
    }
    let pre = &json["pre_tokenizer"];
    let kind = match (pre["type"].as_str(), model["byte_fallback"].as_bool()) {
        (Some("ByteLevel"), _) if pre["use_regex"] != false => "gpt2",
        (Some("Metaspace"), Some(true)) => "llama",
        _ => bail!(
            "only GPT-2-style byte-level BPE and SentencePiece-style BPE tokenizers can be written to GGUF (pre-tokenizer {pre})"
        ),
    };
    let size = tok.get_vocab_size(true);
    if size > vocab_size {
        bail!("the tokenizer has {size} tokens, the model {vocab_size}")
    }
    let mut tokens: Vec<String> = (0..vocab_size).map(|i| format!("[PAD{i}]")).collect();
    let mut types = vec![5i32; vocab_size];
    for (text, id) in tok.get_vocab(true) {
        let id = id as usize;
        if id >= vocab_size {
            bail!("token {text:?} has id {id}, past the model's {vocab_size}")
        }
        let byte =
            kind == "llama" && text.len() == 6 && text.starts_with("<0x") && text.ends_with('>');
        types[id] = if byte { 6 } else { 1 };
        tokens[id] = text;
    }
    for added in tok.get_added_tokens_decoder().values() {
        if let Some(id) = tok.token_to_id(&added.content) {
            types[id as usize] = if added.special { CONTROL } else { USER_DEFINED };
        }
    }
    // Whether encoding puts BOS first: ask the tokenizer itself.
    let with = tokenizer_json::encode_with(tok, "a", true)?;
    let without = tokenizer_json::encode_with(tok, "a", false)?;
    let add_bos = bos.is_some() && with.len() > without.len() && with.first() == bos.as_ref();
    let merges = match model["merges"].as_array() {
        Some(m) if kind == "gpt2" => Some(
            m.iter()
                .map(|m| match (m.as_str(), m.as_array()) {
                    (Some(s), _) => Ok(s.to_string()),
                    (_, Some(pair)) if pair.len() == 2 => Ok(format!(
                        "{} {}",
                        pair[0].as_str().unwrap_or_default(),
                        pair[1].as_str().unwrap_or_default()
                    )),
                    _ => bail!("merge {m} is not a pair of tokens"),
                })
                .collect::<Result<Vec<_>>>()?,
        ),
        _ => None,
    };
    let (scores, add_space_prefix, pre_name) = match kind {
        "llama" => (
            Some((0..vocab_size).map(|i| -(i as f32)).collect()),
            Some(pre["prepend_scheme"] != "never"),
            None,
        ),
        _ => (None, None, Some("gpt-2".to_string())),
    };
    Ok(GgufVocab {
        model: kind.into(),
        pre: pre_name,
        tokens,
        scores,
        token_types: Some(types),
        merges,
        bos,
        eos,
        unk: model["unk_token"].as_str().and_then(|u| tok.token_to_id(u)),
        pad: None,
        add_bos: Some(add_bos),
        add_eos: Some(false),
        add_space_prefix,
        remove_extra_whitespaces: None,
    })
}

#[cfg(test)]
mod tests {
    //! The tokenizer built from each byte-level fixture GGUF's metadata against transformers'
    //! AutoTokenizer on the tokenizer.json of the same model (scripts/sentencepiece_fixtures.py),
    //! over 5,057 strings: Unicode of many scripts, emoji, runs of spaces, tabs and newlines,
    //! digits and special tokens. Ids (with the special tokens each adds) and decoded text
    //! must be equal.
    use std::path::PathBuf;

    use super::*;

    fn fixtures() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../block/tests/fixtures/gguf")
    }

    #[test]
    fn gguf_tokenizers_encode_and_decode_as_transformers() {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizers");
        let read = |f: &str| -> serde_json::Value {
            serde_json::from_str(&std::fs::read_to_string(dir.join(f)).unwrap()).unwrap()
        };
        let corpus = read("corpus.json");
        let corpus = corpus.as_array().unwrap();
        assert!(corpus.len() >= 5000);
        // The byte-level vocabularies: a SentencePiece one is checked against SentencePiece
        // itself (text::sentencepiece), from which transformers' tokenizer.json differs.
        for name in ["gpt2", "qwen2"] {
            let gguf =
                gpt_blocks::Gguf::open(&fixtures().join(format!("{name}.q8_0.gguf"))).unwrap();
            let ours = from_vocab(&gguf.vocab().unwrap()).unwrap();
            let want = read(&format!("bytelevel_{name}.json"));
            for (i, text) in corpus.iter().enumerate() {
                let text = text.as_str().unwrap();
                let ids: Vec<u32> = want["ids"][i]
                    .as_str()
                    .unwrap()
                    .split_whitespace()
                    .map(|x| x.parse().unwrap())
                    .collect();
                assert_eq!(
                    ours.encode(text, true).unwrap(),
                    ids,
                    "{name}: encoding {text:?}"
                );
                let back = want["decoded_where_different"][i.to_string()]
                    .as_str()
                    .unwrap_or(text);
                assert_eq!(
                    ours.decode(&ids).unwrap(),
                    back,
                    "{name}: decoding {text:?}"
                );
            }
        }
    }

    /// What `gpt convert` writes reads back as the same tokenizer: the built-in model's
    /// byte-level BPE, and the SentencePiece-style one of the Llama fixture.
    #[test]
    fn written_vocabularies_read_back_as_the_same_tokenizer() {
        let corpus: Vec<String> = serde_json::from_str(
            &std::fs::read_to_string(fixtures().join("tokenizer_corpus.json")).unwrap(),
        )
        .unwrap();
        let builtin: Tokenizer =
            tokenizer_json::parse(include_bytes!("../../models/default/tokenizer.json"))
                .unwrap()
                .into();
        let gguf = gpt_blocks::Gguf::open(&fixtures().join("llama.q8_0.gguf")).unwrap();
        let llama = from_vocab(&gguf.vocab().unwrap()).unwrap();
        for (name, tok, bos) in [("built-in", builtin, Some(0)), ("llama", llama, Some(1))] {
            let size = tok.vocab_size();
            let vocab = to_vocab(&tok, size, bos, bos.map(|b| b + 1)).unwrap();
            let again = from_vocab(&vocab).unwrap();
            for text in &corpus {
                let a = again.encode(text.as_str(), true).unwrap();
                let b = tok.encode(text.as_str(), true).unwrap();
                assert_eq!(a, b, "{name}: {text:?}");
            }
        }
    }

    /// A byte-level vocabulary whose file names no pre-tokenizer gets llama.cpp's `default`
    /// patterns (numbers split in threes, punctuation runs apart), not GPT-2's: with merges
    /// that make "12345" one token, GPT-2's split gives it whole, the default "123" + "45".
    #[test]
    fn a_vocabulary_without_a_pre_tokenizer_gets_llama_cpps_default() {
        let tokens: Vec<String> = ["1", "2", "3", "4", "5", "12", "123", "1234", "12345", "45"]
            .map(String::from)
            .into();
        let merges: Vec<String> = ["1 2", "12 3", "123 4", "1234 5", "4 5"]
            .map(String::from)
            .into();
        let v = |pre: Option<&str>| GgufVocab {
            model: "gpt2".into(),
            pre: pre.map(String::from),
            tokens: tokens.clone(),
            scores: None,
            token_types: None,
            merges: Some(merges.clone()),
            bos: None,
            eos: None,
            unk: None,
            pad: None,
            add_bos: None,
            add_eos: None,
            add_space_prefix: None,
            remove_extra_whitespaces: None,
        };
        let ids = |pre: Option<&str>| from_vocab(&v(pre)).unwrap().encode("12345", false).unwrap();
        assert_eq!(ids(Some("gpt-2")), [8]);
        assert_eq!(ids(None), [6, 9]);
        assert_eq!(ids(Some("default")), [6, 9]);
        let e = from_vocab(&v(Some("falcon"))).unwrap_err().to_string();
        assert!(
            e.contains("\"falcon\" is not supported (supported: gpt-2, llama-bpe"),
            "{e}"
        );
    }

    /// A SentencePiece vocabulary that names no unknown token and types no piece so (as
    /// `gpt convert` writes one from a `tokenizer.json` without `unk_token`) takes id 0
    /// for it, as llama.cpp does (`special_unk_id = 0` for `llama` vocabularies in
    /// llama-vocab.cpp): text no piece covers, with no byte pieces to fall back on, is 0.
    #[test]
    fn a_sentencepiece_vocabulary_without_an_unknown_token_takes_id_0() {
        let v = GgufVocab {
            model: "llama".into(),
            pre: None,
            tokens: ["<unk>", "<s>", "</s>", "▁", "a", "▁a"]
                .map(String::from)
                .into(),
            scores: Some(vec![0.0, 0.0, 0.0, -1.0, -2.0, -0.5]),
            token_types: Some(vec![CONTROL, CONTROL, CONTROL, 1, 1, 1]),
            merges: None,
            bos: Some(1),
            eos: Some(2),
            unk: None,
            pad: None,
            add_bos: Some(false),
            add_eos: None,
            add_space_prefix: Some(true),
            remove_extra_whitespaces: None,
        };
        let tok = from_vocab(&v).unwrap();
        assert_eq!(tok.encode("a", false).unwrap(), [5]);
        assert_eq!(tok.encode("a\u{2603}", false).unwrap(), [5, 0]);
        // A file that names its unknown token keeps it.
        let tok = from_vocab(&GgufVocab { unk: Some(2), ..v }).unwrap();
        assert_eq!(tok.encode("a\u{2603}", false).unwrap(), [5, 2]);
    }

    #[test]
    fn bad_vocabularies_are_errors() {
        let v = GgufVocab {
            model: "gpt2".into(),
            pre: Some("made-up".into()),
            tokens: vec!["a".into(), "b".into(), "ab".into()],
            scores: None,
            token_types: None,
            merges: Some(vec!["a b".into()]),
            bos: None,
            eos: None,
            unk: None,
            pad: None,
            add_bos: None,
            add_eos: None,
            add_space_prefix: None,
            remove_extra_whitespaces: None,
        };
        let e = from_vocab(&v).unwrap_err().to_string();
        assert!(e.contains("\"made-up\" is not supported"), "{e}");
        let e = from_vocab(&GgufVocab {
            merges: Some(vec!["ab".into()]),
            pre: None,
            ..v.clone()
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("not two tokens"), "{e}");
        let e = from_vocab(&GgufVocab {
            model: "rwkv".into(),
            ..v
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("\"rwkv\" is not supported"), "{e}");
    }
}
