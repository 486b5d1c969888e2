//! A `tokenizers` tokenizer from a GGUF file's `tokenizer.ggml.*` metadata, written as the
//! `tokenizer.json` that transformers would write for the same vocabulary and parsed like
//! any other (so the one guarded parser reads both):
//! - `gpt2`: byte-level BPE with the file's merges, and the pre-tokenizer llama.cpp names in
//!   `tokenizer.ggml.pre` (GPT-2's, Llama 3's, Qwen2's, SmolLM's);
//! - `llama`: SentencePiece-style BPE with byte fallback, whose merges are rebuilt from the
//!   vocabulary as transformers' converter does (every split of a token into two tokens,
//!   ranked by the token's id, then by the pieces' lengths: for SentencePiece vocabularies
//!   ids follow the scores that llama.cpp ranks by).
//!
//! Control and user-defined tokens become added tokens, as in transformers' files.

use std::collections::HashMap;

use anyhow::{bail, Result};
use gpt_blocks::GgufVocab;
use serde_json::{json, Value};
use tokenizers::Tokenizer;

use crate::tokenizer;

/// llama.cpp's token types.
const UNKNOWN: i32 = 2;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;

/// The split patterns of the pre-tokenizers named by `tokenizer.ggml.pre` (as in the
/// models' own tokenizer.json files).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The tokenizer the file's metadata describes.
pub fn from_vocab(v: &GgufVocab) -> Result<Tokenizer> {
    let json = match v.model.as_str() {
        "gpt2" => byte_level(v)?,
        "llama" => sentencepiece(v)?,
        other => bail!(
            "GGUF tokenizer model {other:?} is not supported (gpt2 and llama are); pass token ids with --prompt-ids"
        ),
    };
    let bytes = serde_json::to_vec(&json)?;
    tokenizer::parse(&bytes).map_err(|e| anyhow::anyhow!("building the GGUF tokenizer: {e}"))
}

/// Control, unknown and user-defined tokens, as transformers lists them.
fn added_tokens(v: &GgufVocab) -> Vec<Value> {
    let Some(types) = &v.token_types else {
        return Vec::new();
    };
    types
        .iter()
        .enumerate()
        .filter(|(_, t)| [UNKNOWN, CONTROL, USER_DEFINED].contains(t))
        .map(|(id, &t)| {
            json!({"id": id, "content": v.tokens[id], "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": t != USER_DEFINED})
        })
        .collect()
}

/// BOS (and EOS) around the text when the file asks for them.
fn template(v: &GgufVocab, default_bos: bool) -> Option<Value> {
    let bos = v.bos.filter(|_| v.add_bos.unwrap_or(default_bos));
    let eos = v.eos.filter(|_| v.add_eos.unwrap_or(false));
    if bos.is_none() && eos.is_none() {
        return None;
    }
    let special = |id: u32| json!({"SpecialToken": {"id": v.tokens[id as usize], "type_id": 0}});
    let mut single: Vec<Value> = bos.map(special).into_iter().collect();
    single.push(json!({"Sequence": {"id": "A", "type_id": 0}}));
    single.extend(eos.map(special));
    let specials: serde_json::Map<String, Value> = bos
        .into_iter()
        .chain(eos)
        .map(|id| {
            let t = &v.tokens[id as usize];
            (t.clone(), json!({"id": t, "ids": [id], "tokens": [t]}))
        })
        .collect();
    Some(
        json!({"type": "TemplateProcessing", "single": single, "pair": single.clone(),
                "special_tokens": specials}),
    )
}

fn vocab_map(v: &GgufVocab) -> serde_json::Map<String, Value> {
    v.tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), json!(i)))
        .collect()
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
    let pre = v.pre.as_deref().unwrap_or("default");
    let (pre_tokenizer, ignore_merges) = match pre {
        "default" | "gpt-2" | "gpt2" => (byte_level(true), false),
        "llama-bpe" | "llama3" | "llama-v3" => (
            json!({"type": "Sequence", "pretokenizers": [split(LLAMA3_SPLIT), byte_level(false)]}),
            true,
        ),
        "qwen2" => (
            json!({"type": "Sequence", "pretokenizers": [split(QWEN2_SPLIT), byte_level(false)]}),
            false,
        ),
        "smollm" => (
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true}, byte_level(true)]}),
            false,
        ),
        other => bail!(
            "GGUF pre-tokenizer {other:?} is not supported (gpt-2, llama-bpe, qwen2, smollm); pass token ids with --prompt-ids"
        ),
    };
    let post = template(v, false).unwrap_or_else(|| {
        json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false,
               "use_regex": true})
    });
    Ok(json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added_tokens(v),
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
                    "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": ignore_merges,
                  "vocab": vocab_map(v), "merges": merges},
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

fn sentencepiece(v: &GgufVocab) -> Result<Value> {
    let merges: Vec<Value> = sentencepiece_merges(&v.tokens)
        .into_iter()
        .map(|(l, r)| json!([l, r]))
        .collect();
    let byte_fallback = v.tokens.iter().any(|t| t == "<0x00>");
    let prepend = match v.add_space_prefix.unwrap_or(true) {
        true => "always",
        false => "never",
    };
    let unk = match (byte_fallback, v.unk) {
        (false, Some(id)) => json!(v.tokens[id as usize]),
        _ => Value::Null,
    };
    Ok(json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added_tokens(v),
        "normalizer": null,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "\u{2581}",
                          "prepend_scheme": prepend, "split": false},
        "post_processor": template(v, true),
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": null, "unk_token": unk,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": true, "byte_fallback": byte_fallback, "ignore_merges": false,
                  "vocab": vocab_map(v), "merges": merges},
    }))
}

/// The `tokenizer.ggml.*` metadata of a tokenizer, for writing a GGUF file: byte-level
/// BPE (GPT-2's pre-tokenizer) as `gpt2`, and SentencePiece-style BPE (Metaspace with byte
/// fallback) as `llama` with scores that rank merges as [`sentencepiece_merges`] does.
/// `vocab_size` is the model's: tokens past the tokenizer's are written as unused padding.
pub fn to_vocab(
    tok: &Tokenizer,
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
    let with = tokenizer::encode_with(tok, "a", true)?;
    let without = tokenizer::encode_with(tok, "a", false)?;
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
    })
}

#[cfg(test)]
mod tests {
    //! The tokenizer built from each fixture GGUF's metadata against the tokenizer.json of
    //! the same model (as transformers wrote it; scripts/gguf_fixtures.py), over a committed
    //! corpus of 1,200 strings: Unicode, emoji, runs of spaces and newlines, digits and
    //! special tokens. Ids (with the special tokens each adds) and decoded text must be equal.
    use std::path::PathBuf;

    use super::*;

    fn fixtures() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../block/tests/fixtures/gguf")
    }

    #[test]
    fn gguf_tokenizers_encode_and_decode_as_their_tokenizer_json() {
        let corpus: Vec<String> = serde_json::from_str(
            &std::fs::read_to_string(fixtures().join("tokenizer_corpus.json")).unwrap(),
        )
        .unwrap();
        assert!(corpus.len() >= 1000);
        for name in ["gpt2", "llama", "qwen2"] {
            let gguf =
                gpt_blocks::Gguf::open(&fixtures().join(format!("{name}.q8_0.gguf"))).unwrap();
            let ours = from_vocab(&gguf.vocab().unwrap()).unwrap();
            let path = fixtures().join(format!("{name}.tokenizer.json"));
            let reference = Tokenizer::from_file(path).unwrap();
            for text in &corpus {
                let a = ours.encode(text.as_str(), true).unwrap();
                let b = reference.encode(text.as_str(), true).unwrap();
                assert_eq!(a.get_ids(), b.get_ids(), "{name}: encoding {text:?}");
                let ids = b.get_ids();
                assert_eq!(
                    ours.decode(ids, false).unwrap(),
                    reference.decode(ids, false).unwrap(),
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
        let builtin =
            crate::tokenizer::parse(include_bytes!("../models/default/tokenizer.json")).unwrap();
        let gguf = gpt_blocks::Gguf::open(&fixtures().join("llama.q8_0.gguf")).unwrap();
        let llama = from_vocab(&gguf.vocab().unwrap()).unwrap();
        for (name, tok, bos) in [("built-in", builtin, Some(0)), ("llama", llama, Some(1))] {
            let size = tok.get_vocab_size(true);
            let vocab = to_vocab(&tok, size, bos, bos.map(|b| b + 1)).unwrap();
            let again = from_vocab(&vocab).unwrap();
            for text in &corpus {
                let a = again.encode(text.as_str(), true).unwrap();
                let b = tok.encode(text.as_str(), true).unwrap();
                assert_eq!(a.get_ids(), b.get_ids(), "{name}: {text:?}");
            }
        }
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
