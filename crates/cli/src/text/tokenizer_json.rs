//! Reading `tokenizer.json` files from strangers.
//!
//! The `tokenizers` crate panics on some malformed files (fuzzing found
//! `decoders/mod.rs: expect("Helper")` on a file that is not JSON), so the text is first
//! checked to be JSON, and the parser then runs behind a panic guard: a bad file is an
//! error, never a crash. This file is also compiled into the `tokenizer` fuzz target.

use anyhow::{anyhow, Result};
use tokenizers::Tokenizer;

/// Largest tokenizer file read: real ones are a few MB (GPT-2's is 1.4 MB).
pub const MAX_TOKENIZER_BYTES: usize = 256 << 20;

/// Parses a `tokenizer.json`'s bytes.
pub fn parse(bytes: &[u8]) -> Result<Tokenizer> {
    if bytes.len() > MAX_TOKENIZER_BYTES {
        return Err(anyhow!(
            "{} bytes is larger than any tokenizer.json ({} MB at most)",
            bytes.len(),
            MAX_TOKENIZER_BYTES >> 20
        ));
    }
    serde_json::from_slice::<serde::de::IgnoredAny>(bytes).map_err(|e| anyhow!("not JSON: {e}"))?;
    guard(|| Tokenizer::from_bytes(bytes))?.map_err(|e| anyhow!("{e}"))
}

/// Encodes `text` as transformers 5's `tokenizer(text)` does: with the special tokens that
/// the tokenizer's own post-processor adds (Llama's template puts BOS first; GPT-2's adds
/// nothing). transformers 5 ignores `tokenizer_config.json`'s `add_bos_token` (checked with
/// 5.23), so it is not read here either.
pub fn encode(tok: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    encode_with(tok, text, true)
}

/// Encodes `text`, with the post-processor's special tokens or without them (a rendered
/// chat template writes its own, as `apply_chat_template` encodes it).
pub fn encode_with(tok: &Tokenizer, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
    let enc =
        guard(|| tok.encode(text, add_special_tokens))?.map_err(|e| anyhow!("tokenizing: {e}"))?;
    Ok(enc.get_ids().to_vec())
}

/// Decodes `ids`, keeping special tokens.
pub fn decode(tok: &Tokenizer, ids: &[u32]) -> Result<String> {
    guard(|| tok.decode(ids, false))?.map_err(|e| anyhow!("decoding: {e}"))
}

/// Runs `f`, turning a panic inside the tokenizers crate into an error. The panic hook is
/// silenced meanwhile so that the one line the user sees is the error.
fn guard<T>(f: impl FnOnce() -> T) -> Result<T> {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    std::panic::set_hook(hook);
    result.map_err(|panic| {
        let msg = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        anyhow!("the tokenizer is malformed (the tokenizers library failed: {msg})")
    })
}
