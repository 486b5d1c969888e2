//! A GGUF file's vocabulary from a stranger: arbitrary bytes where llama.cpp's format is
//! expected, its `tokenizer.ggml.*` metadata built into a tokenizer by the code the `gpt`
//! binary uses (byte-level BPE through the `tokenizers` crate, SentencePiece through our
//! own), then text encoded and ids decoded.
#![no_main]

use std::io::Write;

use libfuzzer_sys::fuzz_target;

// The `gpt` binary's text modules, at the root as `crates/cli/src/text/mod.rs` holds them
// side by side (they name each other through `super::`).
#[path = "../../crates/cli/src/text/gguf_tokenizer.rs"]
#[allow(dead_code)]
mod gguf_tokenizer;
#[path = "../../crates/cli/src/text/sentencepiece.rs"]
#[allow(dead_code)]
mod sentencepiece;
#[path = "../../crates/cli/src/text/tokenizer.rs"]
#[allow(dead_code)]
mod tokenizer;
#[path = "../../crates/cli/src/text/tokenizer_json.rs"]
#[allow(dead_code)]
mod tokenizer_json;

#[path = "shared/guarded_panics.rs"]
mod guarded_panics;

fuzz_target!(|data: &[u8]| {
    guarded_panics::guarded_panics_are_errors(tokenizer_json::guarded);
    let mut file = tempfile::Builder::new()
        .suffix(".gguf")
        .tempfile()
        .expect("temporary file");
    file.write_all(data).expect("write file");
    let Ok(gguf) = gpt_blocks::Gguf::open(file.path()) else {
        return;
    };
    let Ok(vocab) = gguf.vocab() else {
        return;
    };
    let Ok(tok) = gguf_tokenizer::from_vocab(&vocab) else {
        return;
    };
    for add_special in [false, true] {
        let text = "ROMEO: But soft, what light?  \u{e9}\u{1F600}\n\t<s></s><|endoftext|> x";
        if let Ok(ids) = tok.encode(text, add_special) {
            let _ = tok.decode(&ids);
        }
    }
    let n = tok.vocab_size() as u32;
    for id in [0, 1, 2, 255, n.saturating_sub(1), n, u32::MAX] {
        let _ = tok.decode(&[id]);
        let _ = tok.piece_bytes(id);
    }
});
