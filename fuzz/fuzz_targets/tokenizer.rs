//! A `tokenizer.json` from a stranger, read, encoded and decoded through the same code
//! the `gpt` binary uses.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../crates/cli/src/tokenizer.rs"]
#[allow(dead_code)]
mod tokenizer;

fuzz_target!(|data: &[u8]| {
    let Ok(tok) = tokenizer::parse(data) else {
        return;
    };
    if let Ok(ids) = tokenizer::encode(&tok, "ROMEO: But soft, what light? \u{e9}\u{1F600}\n") {
        let _ = tokenizer::decode(&tok, &ids);
    }
    for id in [0u32, 1, 255, 50256, u32::MAX] {
        let _ = tokenizer::decode(&tok, &[id]);
    }
});
