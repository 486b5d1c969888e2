//! A chat template from a stranger (a GGUF file's `tokenizer.chat_template`, a
//! `tokenizer_config.json`), compiled and rendered through the same code the `gpt` binary
//! uses, with a conversation that has tools, null contents and non-ASCII text. Every
//! outcome must be a rendering or an error: no panic, no hang, no allocation past the fuel
//! (run with -rss_limit_mb to check the last).
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../crates/cli/src/text/jinja.rs"]
#[allow(dead_code)]
mod jinja;

fuzz_target!(|data: &[u8]| {
    let Ok(source) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(env) = jinja::environment() else {
        return;
    };
    let source = jinja::rewrite_generation(source);
    let Ok(template) = jinja::compile(&source) else {
        return;
    };
    let ctx = serde_json::json!({
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Météo à Paris ? 🙂"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "21"},
        ],
        "tools": [{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
        "documents": null,
        "add_generation_prompt": true,
        "bos_token": "<s>",
        "eos_token": "</s>",
    });
    let _ = jinja::render(&env, &template, jinja::from_json(&ctx));
});
