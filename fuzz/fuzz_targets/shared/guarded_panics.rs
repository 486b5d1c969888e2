//! The tokenizer targets' panic hook: a panic inside the `tokenizers` crate under the
//! `gpt` binary's guard (`tokenizer_json::guarded`) becomes an error there, and its hook
//! stays quiet for it; libFuzzer's hook aborts on any panic, so it is kept for every other.

/// Installs the hook once; `guarded` is the guard's flag for the current thread.
pub fn guarded_panics_are_errors(guarded: fn() -> bool) {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let fuzzer_hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !guarded() {
                fuzzer_hook(info)
            }
        }));
    });
}
