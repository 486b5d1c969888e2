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

thread_local! {
    /// Set while [`guard`] runs on this thread.
    static GUARDED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether this thread is inside [`guard`]: a panic hook that prints should stay quiet then,
/// since the panic becomes an error (the `gpt` binary's hook asks). A flag per thread, not a
/// swapped hook: the hook is the whole process's, and the server tokenizes on many threads.
pub fn guarded() -> bool {
    GUARDED.with(|g| g.get())
}

/// Runs `f`, turning a panic inside the tokenizers crate into an error.
fn guard<T>(f: impl FnOnce() -> T) -> Result<T> {
    let before = GUARDED.with(|g| g.replace(true));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    GUARDED.with(|g| g.set(before));
    result.map_err(|panic| {
        let msg = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        anyhow!("the tokenizer is malformed (the tokenizers library failed: {msg})")
    })
}
