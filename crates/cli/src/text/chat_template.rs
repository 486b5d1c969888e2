//! Conversations rendered with the model's own chat template, as transformers'
//! `apply_chat_template` renders them: the messages as OpenAI's API and transformers take
//! them (JSON objects: `role`, `content` as text, `null` or parts, `tool_calls`,
//! `tool_call_id`, `reasoning_content`, ...), the `tools` and `documents`, further variables
//! (`enable_thinking`, `date_string`), the special tokens' texts, and `strftime_now`;
//! rendered with Jinja2's semantics ([`super::jinja`]). `gpt chat`, `gpt generate --chat`
//! and the server's chat endpoint share this one path.
//!
//! Where the template comes from: `tokenizer_config.json`'s `chat_template` (a string, or
//! the list of named templates, of which `default` is used), a `chat_template.jinja` beside
//! it, or a GGUF file's `tokenizer.chat_template`. A model without one is given the plain
//! format [`PLAIN_TEMPLATE`]: one `Role: text` line per message, then `Assistant:`.

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use minijinja::value::Value;
use minijinja::Error;
use serde_json::{json, Map, Value as Json};

use super::jinja;
use super::tokenizer::Tokenizer;

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

/// Where a message's reasoning may be, under the names templates read it by
/// (transformers' `_REASONING_FIELDS`).
const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

/// A message `{"role": role, "content": content}`.
pub fn message(role: &str, content: &str) -> Json {
    json!({"role": role, "content": content})
}

/// A conversation as OpenAI's API and transformers' `apply_chat_template` take it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Conversation {
    /// The messages, each a JSON object with a `role`.
    pub messages: Vec<Json>,
    /// The tools' JSON schemas (`{"type": "function", "function": {...}}`), or none.
    pub tools: Option<Vec<Json>>,
    /// Documents for retrieval-augmented templates (`{"title", "text"}`), or none.
    pub documents: Option<Vec<Json>>,
    /// Further variables the template reads (`enable_thinking`, `date_string`, ...).
    pub extra: Map<String, Json>,
}

impl Conversation {
    /// A conversation of `messages` alone.
    pub fn new(messages: Vec<Json>) -> Self {
        Self {
            messages,
            ..Self::default()
        }
    }

    /// A conversation from JSON: a list of messages, or an object with `messages` and
    /// optionally `tools`, `documents` and further variables (as `chat_template_kwargs` or
    /// at the top level), as an OpenAI request body has them.
    pub fn from_json(v: &Json) -> Result<Self> {
        let (messages, rest) = match v {
            Json::Array(m) => (m.clone(), Map::new()),
            Json::Object(o) => match o.get("messages") {
                Some(Json::Array(m)) => (m.clone(), o.clone()),
                _ => bail!("a conversation needs `messages`, a list of messages"),
            },
            _ => bail!("a conversation is a list of messages or an object with `messages`"),
        };
        for (i, m) in messages.iter().enumerate() {
            match m.get("role") {
                Some(Json::String(_)) => {}
                _ => bail!("messages[{i}] needs a string `role`"),
            }
        }
        let list = |key: &str| -> Result<Option<Vec<Json>>> {
            match rest.get(key) {
                None | Some(Json::Null) => Ok(None),
                Some(Json::Array(items)) => Ok(Some(items.clone())),
                Some(_) => bail!("`{key}` must be a list"),
            }
        };
        let mut extra = Map::new();
        if let Some(kw) = rest.get("chat_template_kwargs") {
            match kw {
                Json::Object(kw) => extra.extend(kw.clone()),
                _ => bail!("`chat_template_kwargs` must be an object"),
            }
        }
        Ok(Self {
            tools: list("tools")?,
            documents: list("documents")?,
            messages,
            extra,
        })
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

    /// The conversation as the template writes it; with `add_generation_prompt`, followed
    /// by what opens the assistant's reply.
    pub fn render(&self, conv: &Conversation, add_generation_prompt: bool) -> Result<String> {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        self.render_at(conv, add_generation_prompt, now)
    }

    /// [`ChatTemplate::render`] with the clock `strftime_now` reads set to `now` (seconds
    /// since 1970, UTC).
    pub fn render_at(
        &self,
        conv: &Conversation,
        add_generation_prompt: bool,
        now: u64,
    ) -> Result<String> {
        let mut env = jinja::environment()?;
        env.add_function("strftime_now", move |format: String| {
            Ok::<_, Error>(Value::from(strftime(&format, now)))
        });
        let source = jinja::rewrite_generation(&self.source);
        let tmpl = jinja::compile(&source)
            .map_err(|e| anyhow!("the chat template does not parse: {}", describe(&e)))?;
        let list = |items: &Option<Vec<Json>>| match items {
            Some(items) => jinja::from_json(&Json::Array(items.clone())),
            None => jinja::from_json(&Json::Null),
        };
        let messages: Vec<Json> = conv
            .messages
            .iter()
            .map(|m| alias_reasoning(&drop_nulls(m)))
            .collect();
        // As transformers: the special tokens, then the caller's variables over them, then
        // the conversation's own.
        let mut ctx: Vec<(String, Value)> = Vec::new();
        for (name, text) in [("bos_token", &self.bos), ("eos_token", &self.eos)] {
            if let Some(t) = text {
                ctx.push((name.into(), Value::from(t.as_str())));
            }
        }
        ctx.extend(
            conv.extra
                .iter()
                .map(|(k, v)| (k.clone(), jinja::from_json(v))),
        );
        ctx.push(("messages".into(), jinja::from_json(&Json::Array(messages))));
        ctx.push(("tools".into(), list(&conv.tools)));
        ctx.push(("documents".into(), list(&conv.documents)));
        ctx.push((
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        ));
        let ctx: std::collections::BTreeMap<String, Value> = ctx.into_iter().collect();
        jinja::render(&env, &tmpl, Value::from(ctx))
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

    /// The ids of the conversation rendered with the prompt for the reply: the template
    /// writes the special tokens itself, so the tokenizer adds none (as
    /// `apply_chat_template` encodes); the plain format is encoded like any text.
    pub fn prompt_ids(
        &self,
        tokenizer: Option<&Tokenizer>,
        conv: &Conversation,
    ) -> Result<Vec<u32>> {
        let Some(tok) = tokenizer else {
            bail!("chat needs a tokenizer, and this model has none")
        };
        let text = self.render(conv, true)?;
        tok.encode(&text, !self.own)
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

/// transformers' `_normalize_chat_messages`: a message's keys whose value is `null` are
/// dropped (OpenAI's clients send `"content": null` beside `tool_calls`; templates handle
/// the key missing, not `None`). Only the message's own keys: nested nulls stay.
fn drop_nulls(m: &Json) -> Json {
    match m {
        Json::Object(map) => Json::Object(
            map.iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        ),
        other => other.clone(),
    }
}

/// transformers' `_alias_reasoning_fields`: a message with reasoning under any of its names
/// gets it as `thinking` (first, unless there) and as `reasoning_content` (gpt-oss's
/// templates read one, others the other).
fn alias_reasoning(m: &Json) -> Json {
    let Json::Object(map) = m else {
        return m.clone();
    };
    let reasoning = REASONING_FIELDS
        .iter()
        .find_map(|k| map.get(*k).filter(|v| !v.is_null()));
    let Some(r) = reasoning else {
        return m.clone();
    };
    let mut out = Map::new();
    out.insert("thinking".into(), r.clone());
    for (k, v) in map {
        out.insert(k.clone(), v.clone());
    }
    out.insert("reasoning_content".into(), r.clone());
    Json::Object(out)
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

#[cfg(test)]
mod tests {
    //! The differential test against transformers: 73 real chat templates (llama.cpp's
    //! models/templates, Zephyr's, SmolLM2's and Gemma 3's) × 10 conversations (system, several turns,
    //! tool calls with mapping and string arguments and their results, null content,
    //! non-ASCII, an assistant turn last, reasoning, documents, text parts) × both settings
    //! of `add_generation_prompt`, rendered by transformers' `apply_chat_template`
    //! (scripts/chat_template_fixtures.py; the clock fixed at 2024-07-26 12:00 UTC): the
    //! same text byte for byte, or both refuse.
    use std::path::PathBuf;

    use super::*;

    fn fixtures() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat")
    }

    /// 2024-07-26 12:00:00 UTC.
    const FIXED_NOW: u64 = 1_721_995_200;

    #[test]
    fn real_templates_render_as_transformers_renders_them() {
        let read = |f: &str| -> Json {
            serde_json::from_str(&std::fs::read_to_string(fixtures().join(f)).unwrap()).unwrap()
        };
        let conversations = read("conversations.json");
        let cases = read("expected.json");
        let cases = cases.as_array().unwrap();
        let mut templates = std::collections::BTreeMap::new();
        let mut failures = Vec::new();
        let (mut same, mut refused) = (0, 0);
        for case in cases {
            let name = case["template"].as_str().unwrap();
            let source = templates.entry(name.to_string()).or_insert_with(|| {
                std::fs::read_to_string(fixtures().join(format!("templates/{name}.jinja"))).unwrap()
            });
            let chat = ChatTemplate::new(
                Some(source.clone()),
                case["bos_token"].as_str().map(str::to_string),
                case["eos_token"].as_str().map(str::to_string),
            );
            let c = &conversations[case["conversation"].as_u64().unwrap() as usize];
            let mut conv = Conversation::from_json(c).unwrap();
            conv.extra = c["extra"].as_object().cloned().unwrap_or_default();
            let agp = case["add_generation_prompt"].as_bool().unwrap();
            let ours = chat.render_at(&conv, agp, FIXED_NOW);
            let what = format!("{name} conversation {} agp {agp}", case["conversation"]);
            match (ours, case["text"].as_str(), case["error"].as_str()) {
                (Ok(a), Some(b), _) if a == b => same += 1,
                (Err(_), None, Some(_)) => refused += 1,
                (Ok(a), Some(b), _) => {
                    let at = a.chars().zip(b.chars()).take_while(|(x, y)| x == y).count();
                    let tail = |s: &str| {
                        s.chars()
                            .skip(at.saturating_sub(20))
                            .take(60)
                            .collect::<String>()
                    };
                    failures.push(format!(
                        "{what}: differs at char {at}: ours {:?} theirs {:?}",
                        tail(&a),
                        tail(b)
                    ));
                }
                (Ok(_), None, Some(e)) => {
                    failures.push(format!("{what}: we render, transformers refuses ({e})"))
                }
                (Err(e), Some(_), _) => {
                    failures.push(format!("{what}: we refuse ({e:#}), transformers renders"))
                }
                (_, None, None) => failures.push(format!("{what}: bad fixture")),
            }
        }
        assert!(
            templates.len() >= 40 && cases.len() >= 40 * 10,
            "{}",
            templates.len()
        );
        // The one difference we cannot remove: functionary v3.1 prints tools with
        // `"…"|safe + t["function"] | tojson()`, and Python's `Markup.__add__` HTML-escapes
        // the JSON it is added to (`&#34;` for each quote) whatever the environment says;
        // minijinja's `+` never escapes and cannot be hooked. Listed exactly, so that any
        // other difference fails, and so does this one disappearing.
        let known = |f: &String| {
            f.starts_with("meetkai-functionary-medium-v3.1 conversation 3 ")
                || f.starts_with("meetkai-functionary-medium-v3.1 conversation 4 ")
        };
        let known_count = failures.iter().filter(|f| known(f)).count();
        assert_eq!(
            known_count, 4,
            "the Markup difference changed: {failures:#?}"
        );
        failures.retain(|f| !known(f));
        assert!(
            failures.is_empty(),
            "{} of {} renderings differ from transformers ({same} equal, {refused} refused by both); the first:\n{}",
            failures.len(),
            cases.len(),
            failures[..failures.len().min(12)].join("\n")
        );
    }

    #[test]
    fn plain_format_and_helpers() {
        let chat = ChatTemplate::new(None, None, None);
        let conv = Conversation::new(vec![message("system", "Be brief."), message("user", "Hi")]);
        assert_eq!(
            chat.render(&conv, true).unwrap(),
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
        let e = refuse.render(&conv, true).unwrap_err().to_string();
        assert!(e.contains("no system role"), "{e}");
        let empty = Conversation::default();
        let forever = ChatTemplate::new(
            Some(
                "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
                    .into(),
            ),
            None,
            None,
        );
        assert!(forever.render(&empty, false).is_err());
        let broken = ChatTemplate::new(Some("{% for %}".into()), None, None);
        assert!(broken
            .render(&empty, false)
            .unwrap_err()
            .to_string()
            .contains("does not parse"));
    }

    /// Reasoning under any of its names reaches templates under both, as transformers gives it.
    #[test]
    fn reasoning_is_aliased_as_transformers_does() {
        let m = json!({"role": "assistant", "reasoning": "r", "content": "c"});
        assert_eq!(
            serde_json::to_string(&alias_reasoning(&m)).unwrap(),
            r#"{"thinking":"r","role":"assistant","reasoning":"r","content":"c","reasoning_content":"r"}"#
        );
        let conv = Conversation::from_json(&json!({
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function"}],
            "chat_template_kwargs": {"enable_thinking": false}
        }))
        .unwrap();
        assert_eq!(conv.tools.as_ref().map(Vec::len), Some(1));
        assert_eq!(conv.extra["enable_thinking"], json!(false));
        assert!(Conversation::from_json(&json!([{"content": "x"}])).is_err());
        assert!(Conversation::from_json(&json!({"messages": [], "tools": 3})).is_err());
    }
}
