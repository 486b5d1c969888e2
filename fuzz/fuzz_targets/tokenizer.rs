//! A `tokenizer.json` from a stranger, read, encoded and decoded through the same code
//! the `gpt` binary uses.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../crates/cli/src/text/tokenizer_json.rs"]
#[allow(dead_code)]
mod tokenizer;

#[path = "shared/guarded_panics.rs"]
mod guarded_panics;

fuzz_target!(|data: &[u8]| {
    guarded_panics::guarded_panics_are_errors(tokenizer::guarded);
    let Ok(tok) = tokenizer::parse(data) else {
        return;
    };
    if let Ok(ids) = tokenizer::encode_with(&tok, "ROMEO: But soft, what light? \u{e9}\u{1F600}\n", true) {
        let _ = tokenizer::decode(&tok, &ids);
    }
    for id in [0u32, 1, 255, 50256, u32::MAX] {
        let _ = tokenizer::decode(&tok, &[id]);
    }
});
