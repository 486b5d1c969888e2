//! The tokenizer a GGUF file describes in its `tokenizer.ggml.*` metadata: read, checked,
//! and written back.

use candle_core::quantized::gguf_file::Value;
use candle_core::{bail, Result};

use super::Gguf;

/// The tokenizer a GGUF file describes in its `tokenizer.ggml.*` metadata, checked for
/// consistency (one score and one type per token, special ids inside the vocabulary).
#[derive(Debug, Clone, PartialEq)]
pub struct GgufVocab {
    /// `tokenizer.ggml.model`: `gpt2` (byte-level BPE) or `llama` (SentencePiece).
    pub model: String,
    /// `tokenizer.ggml.pre`: llama.cpp's name of the pre-tokenizer (`gpt-2`, `llama-bpe`,
    /// `qwen2`, ...).
    pub pre: Option<String>,
    /// Token texts, by id.
    pub tokens: Vec<String>,
    /// SentencePiece scores, by id.
    pub scores: Option<Vec<f32>>,
    /// llama.cpp's token types, by id: 1 normal, 2 unknown, 3 control, 4 user-defined,
    /// 5 unused, 6 byte.
    pub token_types: Option<Vec<i32>>,
    /// BPE merges, `"left right"`, highest priority first.
    pub merges: Option<Vec<String>>,
    /// Beginning of text.
    pub bos: Option<u32>,
    /// End of text.
    pub eos: Option<u32>,
    /// Unknown token.
    pub unk: Option<u32>,
    /// Padding.
    pub pad: Option<u32>,
    /// Whether encoding puts BOS first.
    pub add_bos: Option<bool>,
    /// Whether encoding puts EOS last.
    pub add_eos: Option<bool>,
    /// Whether SentencePiece text gets a leading space.
    pub add_space_prefix: Option<bool>,
    /// Whether SentencePiece drops leading, trailing and repeated spaces.
    pub remove_extra_whitespaces: Option<bool>,
}

impl Gguf {
    /// Drops the tokenizer's arrays (token texts, scores, types, merges) from the parsed
    /// metadata once a tokenizer is built from them: tens of thousands of strings and as
    /// many merges, as Candle parses them, that would otherwise stay beside the weights.
    /// [`Self::vocab`] fails afterwards.
    pub fn release_vocab(&mut self) {
        for key in [
            "tokenizer.ggml.tokens",
            "tokenizer.ggml.scores",
            "tokenizer.ggml.token_type",
            "tokenizer.ggml.merges",
        ] {
            self.content.metadata.remove(key);
        }
    }

    /// The tokenizer the metadata describes.
    pub fn vocab(&self) -> Result<GgufVocab> {
        let Some(model) = self.string("tokenizer.ggml.model")? else {
            bail!("the file carries no tokenizer (tokenizer.ggml.model is missing)")
        };
        let strings = |key: &str| -> Result<Option<Vec<String>>> {
            self.array(key)?
                .map(|a| {
                    a.iter()
                        .map(|v| match v {
                            Value::String(s) => Ok(s.clone()),
                            v => {
                                bail!("metadata {key} must hold strings, got {:?}", v.value_type())
                            }
                        })
                        .collect()
                })
                .transpose()
        };
        let Some(tokens) = strings("tokenizer.ggml.tokens")? else {
            bail!("metadata tokenizer.ggml.tokens is missing")
        };
        let n = tokens.len();
        // One entry per token, each converted by `f` (None: the wrong type).
        fn per_token<T>(
            g: &Gguf,
            key: &str,
            n: usize,
            f: impl Fn(&Value) -> Option<T>,
        ) -> Result<Option<Vec<T>>> {
            let Some(a) = g.array(key)? else {
                return Ok(None);
            };
            if a.len() != n {
                bail!("metadata {key} has {} entries for {n} tokens", a.len())
            }
            a.iter()
                .map(|v| match f(v) {
                    Some(x) => Ok(x),
                    None => bail!("metadata {key} holds a {:?}", v.value_type()),
                })
                .collect::<Result<Vec<_>>>()
                .map(Some)
        }
        let scores = per_token(self, "tokenizer.ggml.scores", n, |v| match v {
            Value::F32(x) => Some(*x),
            _ => None,
        })?;
        let token_types = per_token(self, "tokenizer.ggml.token_type", n, |v| match v {
            Value::I32(x) => Some(*x),
            Value::U32(x) => i32::try_from(*x).ok(),
            _ => None,
        })?;
        let id = |key: &str| -> Result<Option<u32>> {
            match self.uint(key)? {
                None => Ok(None),
                Some(i) if (i as usize) < n => Ok(Some(i as u32)),
                Some(i) => bail!("metadata {key} = {i} is outside the {n} tokens"),
            }
        };
        Ok(GgufVocab {
            model: model.to_string(),
            pre: self.string("tokenizer.ggml.pre")?.map(str::to_string),
            scores,
            token_types,
            merges: strings("tokenizer.ggml.merges")?,
            bos: id("tokenizer.ggml.bos_token_id")?,
            eos: id("tokenizer.ggml.eos_token_id")?,
            unk: id("tokenizer.ggml.unknown_token_id")?,
            pad: id("tokenizer.ggml.padding_token_id")?,
            add_bos: self.boolean("tokenizer.ggml.add_bos_token")?,
            add_eos: self.boolean("tokenizer.ggml.add_eos_token")?,
            add_space_prefix: self.boolean("tokenizer.ggml.add_space_prefix")?,
            remove_extra_whitespaces: self.boolean("tokenizer.ggml.remove_extra_whitespaces")?,
            tokens,
        })
    }
}

/// The `tokenizer.ggml.*` entries of `v`.
pub(super) fn vocab_metadata(v: &GgufVocab) -> Result<Vec<(String, Value)>> {
    let strings = |xs: &[String]| Value::Array(xs.iter().cloned().map(Value::String).collect());
    let mut meta = vec![
        (
            "tokenizer.ggml.model".to_string(),
            Value::String(v.model.clone()),
        ),
        ("tokenizer.ggml.tokens".to_string(), strings(&v.tokens)),
    ];
    if let Some(pre) = &v.pre {
        meta.push(("tokenizer.ggml.pre".into(), Value::String(pre.clone())));
    }
    if let Some(types) = &v.token_types {
        let types = types.iter().map(|&t| Value::I32(t)).collect();
        meta.push(("tokenizer.ggml.token_type".into(), Value::Array(types)));
    }
    if let Some(scores) = &v.scores {
        let scores = scores.iter().map(|&s| Value::F32(s)).collect();
        meta.push(("tokenizer.ggml.scores".into(), Value::Array(scores)));
    }
    if let Some(merges) = &v.merges {
        meta.push(("tokenizer.ggml.merges".into(), strings(merges)));
    }
    let ids = [
        ("bos_token_id", v.bos),
        ("eos_token_id", v.eos),
        ("unknown_token_id", v.unk),
        ("padding_token_id", v.pad),
    ];
    for (name, id) in ids {
        if let Some(id) = id {
            meta.push((format!("tokenizer.ggml.{name}"), Value::U32(id)));
        }
    }
    let flags = [
        ("add_bos_token", v.add_bos),
        ("add_eos_token", v.add_eos),
        ("add_space_prefix", v.add_space_prefix),
        ("remove_extra_whitespaces", v.remove_extra_whitespaces),
    ];
    for (name, flag) in flags {
        if let Some(b) = flag {
            meta.push((format!("tokenizer.ggml.{name}"), Value::Bool(b)));
        }
    }
    Ok(meta)
}
