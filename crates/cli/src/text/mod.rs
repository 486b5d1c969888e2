//! Text in and out of a model: tokenizers (a `tokenizer.json`, or a GGUF file's vocabulary:
//! byte-level BPE through the `tokenizers` crate, SentencePiece BPE through our own
//! [`sentencepiece`]) and chat templates.

pub mod chat_template;
pub mod gguf_tokenizer;
pub mod grammar;
pub mod jinja;
pub mod sentencepiece;
pub mod tokenizer;
pub mod tokenizer_json;
