//! Conversations rendered with the model's own chat template, as transformers'
//! `apply_chat_template` renders them: Jinja through `minijinja` with Hugging Face's
//! settings (`trim_blocks`, `lstrip_blocks`, loop controls) and the helpers its templates
//! call (`raise_exception`, `strftime_now`, a `tojson` that writes what Python's
//! `json.dumps` writes, Python's string methods). `gpt chat`, `gpt generate --chat` and
//! (later) the server's chat endpoint share this one path.
//!
//! Where the template comes from: `tokenizer_config.json`'s `chat_template` (a string, or
//! the list of named templates, of which `default` is used), a `chat_template.jinja` beside
//! it, or a GGUF file's `tokenizer.chat_template`. A model without one is given the plain
//! format [`PLAIN_TEMPLATE`]: one `Role: text` line per message, then `Assistant:`.

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use minijinja::value::{Kwargs, Serde, Value};
use minijinja::{Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};
use tokenizers::Tokenizer;

/// The format of models without a chat template: `System: …`, `User: …` and
/// `Assistant: …` lines, and `Assistant:` to prompt the reply.
pub const PLAIN_TEMPLATE: &str = "{% for m in messages %}{{ m.role | capitalize }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}";

/// Tokens that end a turn in the templates people use; those that the template writes
/// and the vocabulary has stop a reply.
const END_OF_TURN: [&str; 8] = [
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|end_of_text|>",
    "<|endoftext|>",
    "</s>",
];

/// Work a template may do per rendering (minijinja's fuel): a hostile template that loops
/// for ever ends with an error instead.
const FUEL: u64 = 50_000_000;

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
}

impl Message {
    /// A message from `role`.
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A model's chat template and the special tokens' texts it refers to.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    source: String,
    own: bool,
    bos: Option<String>,
    eos: Option<String>,
}

impl ChatTemplate {
    /// The model's template, or the plain format when it has none.
    pub fn new(template: Option<String>, bos: Option<String>, eos: Option<String>) -> Self {
        let own = template.is_some();
        Self {
            source: template.unwrap_or_else(|| PLAIN_TEMPLATE.to_string()),
            own,
            bos,
            eos,
        }
    }

    /// From a Hugging Face directory: `tokenizer_config.json` and `chat_template.jinja`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer_config.json");
        let config: serde_json::Value = match std::fs::read_to_string(&path) {
            Ok(text) => serde_json::from_str(&text)
                .with_context(|| format!("{}: not valid JSON", path.display()))?,
            Err(_) => serde_json::Value::Null,
        };
        let token = |key: &str| match &config[key] {
            serde_json::Value::String(s) => Some(s.clone()),
            v => v["content"].as_str().map(str::to_string),
        };
        let template = match &config["chat_template"] {
            serde_json::Value::String(s) => Some(s.clone()),
            serde_json::Value::Array(named) => named
                .iter()
                .find(|t| t["name"] == "default")
                .or_else(|| named.first())
                .and_then(|t| t["template"].as_str())
                .map(str::to_string),
            serde_json::Value::Null => None,
            v => bail!(
                "{}: chat_template must be a string or a list, got {v}",
                path.display()
            ),
        };
        let template = match template {
            Some(t) => Some(t),
            None => std::fs::read_to_string(dir.join("chat_template.jinja")).ok(),
        };
        Ok(Self::new(template, token("bos_token"), token("eos_token")))
    }

    /// The model's own template, when it has one.
    pub fn own_template(&self) -> Option<&str> {
        self.own.then_some(self.source.as_str())
    }

    /// Whether the model has a template of its own (else the plain format is used).
    pub fn is_own(&self) -> bool {
        self.own
    }

    /// `messages` as the template writes them; with `add_generation_prompt`, followed by
    /// what opens the assistant's reply. `extra` adds variables (`date_string`, say).
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        extra: &[(&str, Value)],
    ) -> Result<String> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()?;
        env.set_syntax(syntax);
        env.set_fuel(Some(FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template("chat", &self.source)
            .map_err(|e| anyhow!("the chat template does not parse: {e}"))?;
        let mut ctx = vec![
            ("messages", Value::from(Serde(messages))),
            ("add_generation_prompt", Value::from(add_generation_prompt)),
            (
                "bos_token",
                Value::from(self.bos.clone().unwrap_or_default()),
            ),
            (
                "eos_token",
                Value::from(self.eos.clone().unwrap_or_default()),
            ),
            ("tools", Value::from(())),
            ("documents", Value::from(())),
        ];
        ctx.extend(extra.iter().map(|(k, v)| (*k, v.clone())));
        let ctx: std::collections::BTreeMap<&str, Value> = ctx.into_iter().collect();
        let tmpl = env.get_template("chat")?;
        tmpl.render(ctx)
            .map_err(|e| anyhow!("the chat template failed: {}", describe(&e)))
    }

    /// Tokens that end the assistant's turn: the model's end of text, and the end-of-turn
    /// tokens the template writes.
    pub fn stop_ids(&self, tokenizer: Option<&Tokenizer>, eos: Option<u32>) -> Vec<u32> {
        let mut ids: Vec<u32> = eos.into_iter().collect();
        if let Some(tok) = tokenizer {
            let written = |t: &str| {
                self.source.contains(t)
                    || (self.eos.as_deref() == Some(t) && self.source.contains("eos_token"))
            };
            for t in END_OF_TURN.iter().filter(|t| written(t)) {
                ids.extend(tok.token_to_id(t));
            }
        }
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// The ids of `messages` rendered with the prompt for the reply: the template writes
    /// the special tokens itself, so the tokenizer adds none (as `apply_chat_template`
    /// encodes); the plain format is encoded like any text.
    pub fn prompt_ids(
        &self,
        tokenizer: Option<&Tokenizer>,
        messages: &[Message],
    ) -> Result<Vec<u32>> {
        let Some(tok) = tokenizer else {
            bail!("chat needs a tokenizer, and this model has none")
        };
        let text = self.render(messages, true, &[])?;
        crate::tokenizer::encode_with(tok, &text, !self.own)
    }

    /// Texts that end the reply: in the plain format, the next turn's label.
    pub fn stop_texts(&self) -> Vec<String> {
        match self.own {
            true => Vec::new(),
            false => vec!["\nUser:".into(), "\nSystem:".into()],
        }
    }
}

/// The error and the causes minijinja chains to it, on one line.
fn describe(e: &Error) -> String {
    let mut out = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        out.push_str(&format!(": {s}"));
        source = s.source();
    }
    out
}

/// `raise_exception(message)`: templates refuse a conversation they cannot render.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)`: the current UTC date and time, in Python's `strftime` format
/// (`%d %b %Y` in Llama 3's templates).
fn strftime_now(format: String) -> Result<Value, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?
        .as_secs();
    Ok(Value::from(strftime(&format, secs)))
}

/// Python's `strftime` for the common fields, from seconds since 1970 (UTC).
fn strftime(format: &str, secs: u64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let days = secs / 86_400;
    let (h, m, s) = (secs % 86_400 / 3600, secs % 3600 / 60, secs % 60);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let month_name = MONTHS[(month - 1) as usize];
    let weekday = DAYS[(days % 7) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('b') => out.push_str(&month_name[..3]),
            Some('B') => out.push_str(month_name),
            Some('a') => out.push_str(&weekday[..3]),
            Some('A') => out.push_str(weekday),
            Some('H') => out.push_str(&format!("{h:02}")),
            Some('M') => out.push_str(&format!("{m:02}")),
            Some('S') => out.push_str(&format!("{s:02}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// `tojson`, as transformers defines it: `json.dumps(value, ensure_ascii=False,
/// indent=indent, sort_keys=sort_keys)` (`", "` and `": "` between items without an indent,
/// `","` with one), not minijinja's HTML-safe compact form.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let mut out = String::new();
    write_json(&mut out, &json, indent, 0, sort_keys.unwrap_or(false));
    Ok(Value::from_safe_string(out))
}

fn write_json(
    out: &mut String,
    v: &serde_json::Value,
    indent: Option<usize>,
    level: usize,
    sort: bool,
) {
    use serde_json::Value as J;
    let newline = |out: &mut String, level: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * level));
        }
    };
    let sep = if indent.is_some() { "," } else { ", " };
    match v {
        J::Null => out.push_str("null"),
        J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        J::Number(n) => out.push_str(&n.to_string()),
        J::String(s) => write_json_string(out, s),
        J::Array(items) if items.is_empty() => out.push_str("[]"),
        J::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, level + 1);
                write_json(out, item, indent, level + 1, sort);
            }
            newline(out, level);
            out.push(']');
        }
        J::Object(map) if map.is_empty() => out.push_str("{}"),
        J::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            if sort {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, level + 1);
                write_json_string(out, k);
                out.push_str(": ");
                write_json(out, item, indent, level + 1, sort);
            }
            newline(out, level);
            out.push('}');
        }
    }
}

/// A JSON string as Python writes it with `ensure_ascii=False`.
fn write_json_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    //! Real chat templates (Llama 3.2, Qwen2.5, SmolLM3 from llama.cpp's models/templates;
    //! Zephyr/TinyLlama and SmolLM2 as their tokenizer_config.json publish them) rendered
    //! here and by transformers' `apply_chat_template(tokenize=False,
    //! add_generation_prompt=True)` (scripts/gguf_fixtures.py): equal, byte for byte, over
    //! conversations with a system message, several turns and non-ASCII text.
    use std::path::PathBuf;

    use super::*;

    fn fixtures() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat")
    }

    #[test]
    fn real_templates_render_as_transformers_renders_them() {
        let cases: Vec<serde_json::Value> = serde_json::from_str(
            &std::fs::read_to_string(fixtures().join("expected.json")).unwrap(),
        )
        .unwrap();
        let mut templates = std::collections::BTreeSet::new();
        for case in &cases {
            let name = case["template"].as_str().unwrap();
            templates.insert(name);
            let source = std::fs::read_to_string(fixtures().join(format!("{name}.jinja"))).unwrap();
            let chat = ChatTemplate::new(
                Some(source),
                case["bos_token"].as_str().map(str::to_string),
                case["eos_token"].as_str().map(str::to_string),
            );
            let messages: Vec<Message> = serde_json::from_value(case["messages"].clone()).unwrap();
            let got = chat
                .render(
                    &messages,
                    true,
                    &[("date_string", Value::from("26 Jul 2024"))],
                )
                .unwrap();
            assert_eq!(
                got,
                case["rendered"].as_str().unwrap(),
                "{name}: {messages:?}"
            );
        }
        assert!(templates.len() >= 4, "{templates:?}");
    }

    #[test]
    fn plain_format_and_helpers() {
        let chat = ChatTemplate::new(None, None, None);
        let msgs = [
            Message::new("system", "Be brief."),
            Message::new("user", "Hi"),
        ];
        assert_eq!(
            chat.render(&msgs, true, &[]).unwrap(),
            "System: Be brief.\nUser: Hi\nAssistant:"
        );
        assert_eq!(chat.stop_texts(), ["\nUser:", "\nSystem:"]);
        // 2024-07-26 12:34:56 UTC, a Friday.
        assert_eq!(
            strftime("%d %b %Y %A %H:%M:%S %%", 1_721_997_296),
            "26 Jul 2024 Friday 12:34:56 %"
        );
        let refuse = ChatTemplate::new(
            Some("{{ raise_exception('no system role') }}".into()),
            None,
            None,
        );
        let e = refuse.render(&msgs, true, &[]).unwrap_err().to_string();
        assert!(e.contains("no system role"), "{e}");
        let json = ChatTemplate::new(
            Some("{{ {'a': [1, 'é\"'], 'b': none} | tojson }}".into()),
            None,
            None,
        );
        assert_eq!(
            json.render(&[], false, &[]).unwrap(),
            r#"{"a": [1, "é\""], "b": null}"#
        );
        let forever = ChatTemplate::new(
            Some(
                "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
                    .into(),
            ),
            None,
            None,
        );
        assert!(forever.render(&[], false, &[]).is_err());
        let broken = ChatTemplate::new(Some("{% for %}".into()), None, None);
        assert!(broken
            .render(&[], false, &[])
            .unwrap_err()
            .to_string()
            .contains("does not parse"));
    }
}
