//! A model's tokenizer: a `tokenizer.json` (Hugging Face directories, the built-in model, and
//! GGUF files of byte-level BPE vocabularies), or a GGUF file's SentencePiece vocabulary.

use std::sync::OnceLock;

use anyhow::{anyhow, Result};

use super::sentencepiece::{PieceKind, SentencePiece};
use super::tokenizer_json;

/// A tokenizer of either kind, with one way to encode and decode.
#[derive(Debug)]
pub enum Tokenizer {
    /// Through the `tokenizers` crate.
    Json(Box<JsonTokenizer>),
    /// SentencePiece BPE exactly as SentencePiece computes it ([`SentencePiece`]).
    SentencePiece(Box<SentencePieceTokenizer>),
}

/// A `tokenizer.json`'s tokenizer, and a copy that reads special tokens as text (built when
/// first asked for).
#[derive(Debug)]
pub struct JsonTokenizer {
    tok: tokenizers::Tokenizer,
    literal: OnceLock<tokenizers::Tokenizer>,
}

/// A SentencePiece vocabulary and the special tokens encoding adds.
#[derive(Debug, Clone)]
pub struct SentencePieceTokenizer {
    /// The vocabulary.
    pub sp: SentencePiece,
    /// Beginning of text, put first when `add_bos`.
    pub bos: Option<u32>,
    /// End of text, put last when `add_eos`.
    pub eos: Option<u32>,
    /// Whether encoding with special tokens puts BOS first.
    pub add_bos: bool,
    /// Whether encoding with special tokens puts EOS last.
    pub add_eos: bool,
}

impl From<tokenizers::Tokenizer> for Tokenizer {
    fn from(tok: tokenizers::Tokenizer) -> Self {
        Self::Json(Box::new(JsonTokenizer {
            tok,
            literal: OnceLock::new(),
        }))
    }
}

impl Tokenizer {
    /// Encodes `text` as transformers 5's `tokenizer(text)` and llama.cpp's tokenizer do:
    /// special tokens written in the text become those tokens, and with `add_special` the
    /// ones the tokenizer adds around a text (BOS for Llama-style ones) are added.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        self.encode_with(text, add_special, true)
    }

    /// As [`Tokenizer::encode`]; without `parse_special`, special tokens written in the text
    /// are encoded as text (SentencePiece's own `encode`, llama.cpp's `parse_special: false`).
    pub fn encode_with(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>> {
        match self {
            Self::Json(j) => {
                let tok = match parse_special {
                    true => &j.tok,
                    false => j.literal.get_or_init(|| {
                        let mut t = j.tok.clone();
                        t.set_encode_special_tokens(true);
                        t
                    }),
                };
                tokenizer_json::encode_with(tok, text, add_special)
            }
            Self::SentencePiece(s) => {
                let mut ids = Vec::new();
                if add_special && s.add_bos {
                    ids.extend(s.bos);
                }
                ids.extend(s.sp.encode(text, parse_special));
                if add_special && s.add_eos {
                    ids.extend(s.eos);
                }
                Ok(ids)
            }
        }
    }

    /// The text of `ids`, special tokens shown. Ids outside the vocabulary are errors.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.check(ids)?;
        match self {
            Self::Json(j) => tokenizer_json::decode(&j.tok, ids),
            Self::SentencePiece(s) => s.sp.decode(ids, true),
        }
    }

    fn check(&self, ids: &[u32]) -> Result<()> {
        let n = self.vocab_size();
        match ids.iter().find(|&&i| i as usize >= n) {
            Some(bad) => Err(anyhow!(
                "token id {bad} is outside the tokenizer's vocabulary (0..{n})"
            )),
            None => Ok(()),
        }
    }

    /// The id of a token's text (`<|im_end|>`, `</s>`).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        match self {
            Self::Json(j) => j.tok.token_to_id(token),
            Self::SentencePiece(s) => s.sp.id(token),
        }
    }

    /// The bytes one token stands for in text, as llama.cpp's `token_to_piece` gives them:
    /// ` Hello` for `ĠHello` or `▁Hello`, one byte for a byte token (maybe not UTF-8 alone),
    /// a special token's own text.
    pub fn piece_bytes(&self, id: u32) -> Result<Vec<u8>> {
        self.check(&[id])?;
        match self {
            Self::Json(j) => {
                let token = j.tok.id_to_token(id).unwrap_or_default();
                let special = j
                    .tok
                    .get_added_tokens_decoder()
                    .get(&id)
                    .is_some_and(|t| t.special);
                match (is_byte_level(&j.tok), special) {
                    (true, false) => {
                        Ok(byte_level_bytes(&token).unwrap_or_else(|| token.into_bytes()))
                    }
                    _ => Ok(tokenizer_json::decode(&j.tok, &[id])?.into_bytes()),
                }
            }
            Self::SentencePiece(s) => {
                let piece = s.sp.piece(id).unwrap_or_default();
                Ok(match s.sp.kind(id) {
                    Some(PieceKind::Byte) => s.sp.decode_bytes(id),
                    Some(PieceKind::Normal | PieceKind::UserDefined | PieceKind::Unused) => {
                        piece.replace('\u{2581}', " ").into_bytes()
                    }
                    _ => piece.as_bytes().to_vec(),
                })
            }
        }
    }

    /// Every special token's text by id (`<|im_end|>`, `</s>`): the tokens no text is
    /// made of.
    pub fn special_texts(&self) -> std::collections::HashMap<u32, String> {
        match self {
            Self::Json(j) => j
                .tok
                .get_added_tokens_decoder()
                .into_iter()
                .filter(|(_, t)| t.special)
                .map(|(id, t)| (id, t.content))
                .collect(),
            Self::SentencePiece(s) => (0..s.sp.len() as u32)
                .filter(|&id| {
                    matches!(s.sp.kind(id), Some(PieceKind::Control | PieceKind::Unknown))
                })
                .filter_map(|id| Some((id, s.sp.piece(id)?.to_string())))
                .collect(),
        }
    }

    /// Number of tokens, added ones included.
    pub fn vocab_size(&self) -> usize {
        match self {
            Self::Json(j) => j.tok.get_vocab_size(true),
            Self::SentencePiece(s) => s.sp.len(),
        }
    }

    /// The `tokenizers` tokenizer, when this is one.
    pub fn json(&self) -> Option<&tokenizers::Tokenizer> {
        match self {
            Self::Json(j) => Some(&j.tok),
            Self::SentencePiece(_) => None,
        }
    }
}

/// Whether the tokenizer maps bytes to characters as GPT-2 does (its decoder is ByteLevel).
fn is_byte_level(tok: &tokenizers::Tokenizer) -> bool {
    matches!(
        tok.get_decoder(),
        Some(tokenizers::DecoderWrapper::ByteLevel(_))
    )
}

/// The bytes of a byte-level token (`Ġ` is the space): GPT-2's `bytes_to_unicode` reversed.
fn byte_level_bytes(token: &str) -> Option<Vec<u8>> {
    static TABLE: OnceLock<std::collections::HashMap<char, u8>> = OnceLock::new();
    let table = TABLE.get_or_init(|| {
        // Printable bytes stand for themselves; the others are shifted past U+0100.
        let mut shown: Vec<u32> = (b'!'..=b'~')
            .chain(0xA1..=0xAC)
            .chain(0xAE..=0xFF)
            .map(u32::from)
            .collect();
        let mut chars: Vec<u32> = shown.clone();
        let mut n = 0;
        for b in 0..=255u32 {
            if !shown.contains(&b) {
                shown.push(b);
                chars.push(256 + n);
                n += 1;
            }
        }
        shown
            .into_iter()
            .zip(chars)
            .filter_map(|(b, c)| Some((char::from_u32(c)?, b as u8)))
            .collect()
    });
    token.chars().map(|c| table.get(&c).copied()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GPT-2's table: `Ġ` is the space, `Ċ` the newline, printable ASCII itself.
    #[test]
    fn byte_level_tokens_map_back_to_bytes() {
        assert_eq!(byte_level_bytes("ĠHello").unwrap(), b" Hello");
        assert_eq!(byte_level_bytes("Ċ").unwrap(), b"\n");
        assert_eq!(byte_level_bytes("Ã©").unwrap(), "é".as_bytes());
        assert_eq!(byte_level_bytes("Ā").unwrap(), [0u8]);
        assert!(byte_level_bytes("▁").is_none());
    }
}
