//! A `tokenizer.json` from a stranger, read, encoded and decoded through the same code
//! the `gpt` binary uses.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../crates/cli/src/text/tokenizer_json.rs"]
#[allow(dead_code)]
mod tokenizer;

/// A panic inside the `tokenizers` crate under the reader's guard becomes an error, as in
/// `gpt` (whose panic hook stays quiet for it): libFuzzer's hook, which aborts on any panic,
/// is kept for every other.
fn guarded_panics_are_errors() {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let fuzzer_hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !tokenizer::guarded() {
                fuzzer_hook(info)
            }
        }));
    });
}

fuzz_target!(|data: &[u8]| {
    guarded_panics_are_errors();
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
