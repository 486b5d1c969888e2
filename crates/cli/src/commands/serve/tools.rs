//! Tool calls: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`, in the format the
//! model's chat template teaches it, parsed back out of the reply into `tool_calls`.
//!
//! The formats of the families we load, recognised by what their templates print:
//! - Hermes / Qwen 2.5 / Qwen3 / SmolLM3: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
//!   one block per call;
//! - Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`;
//! - Llama 3.1–3.3: the whole reply is `{"name": ..., "parameters": {...}}` (optionally after
//!   `<|python_tag|>`).
//!
//! With `tool_choice` `required` or a named function, the reply is constrained (through
//! the same grammar path as `response_format`) to calls of the allowed functions whose
//! arguments follow their JSON schemas.

use serde_json::{json, Map, Value};

/// How a chat template's model writes tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    /// `<tool_call>{...}</tool_call>` blocks.
    Hermes,
    /// `[TOOL_CALLS][{...}, ...]`.
    Mistral,
    /// A bare `{"name": ..., "parameters": ...}` reply.
    Llama3,
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const MISTRAL_OPEN: &str = "[TOOL_CALLS]";
const PYTHON_TAG: &str = "<|python_tag|>";

impl ToolFormat {
    /// The format a template teaches, if it is one of ours.
    pub fn of_template(source: &str) -> Option<Self> {
        if source.contains(HERMES_OPEN) {
            Some(Self::Hermes)
        } else if source.contains(MISTRAL_OPEN) {
            Some(Self::Mistral)
        } else if source.contains(PYTHON_TAG) || source.contains("ipython") {
            Some(Self::Llama3)
        } else {
            None
        }
    }

    /// A Lark grammar (llguidance's) for replies that are only calls of `tools` (one, or
    /// several with `parallel`), each call's arguments following its function's schema.
    pub fn grammar(self, tools: &[Tool], parallel: bool) -> String {
        let args_key = match self {
            Self::Llama3 => "parameters",
            _ => "arguments",
        };
        let calls: Vec<Value> = tools
            .iter()
            .map(|t| {
                json!({"type": "object",
                    "properties": {"name": {"const": t.name}, args_key: t.parameters},
                    "required": ["name", args_key], "additionalProperties": false})
            })
            .collect();
        let mut call = json!({"anyOf": calls});
        call["x-guidance"] =
            json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "});
        match self {
            Self::Hermes => {
                let more = if parallel { " (\"\\n\" block)*" } else { "" };
                format!(
                    "start: block{more}\nblock: \"{HERMES_OPEN}\\n\" call \"\\n{HERMES_CLOSE}\"\ncall: %json {call}\n"
                )
            }
            Self::Mistral => {
                let mut list = json!({"type": "array", "items": call, "minItems": 1,
                    "x-guidance": call["x-guidance"].clone()});
                if !parallel {
                    list["maxItems"] = json!(1);
                }
                format!(
                    "start: \"{}\" calls\ncalls: %json {list}\n",
                    lark_str(MISTRAL_OPEN)
                )
            }
            Self::Llama3 => format!("start: call\ncall: %json {call}\n"),
        }
    }

    /// The part of `text` that is content, not calls, so far: up to where a call may begin
    /// (a partial opening marker at the end held back). Llama 3's calls are whole replies,
    /// so a reply that may still become one is held back entirely.
    pub fn content_so_far(self, text: &str) -> &str {
        let open = match self {
            Self::Hermes => HERMES_OPEN,
            Self::Mistral => MISTRAL_OPEN,
            Self::Llama3 => {
                let t = text.trim_start();
                let may_be_call = t.is_empty()
                    || t.starts_with('{')
                    || PYTHON_TAG.starts_with(t)
                    || t.starts_with(PYTHON_TAG);
                return if may_be_call { "" } else { text };
            }
        };
        if let Some(at) = text.find(open) {
            return &text[..at];
        }
        // Hold back the longest end of `text` that begins the marker.
        let keep = (1..open.len().min(text.len() + 1))
            .rev()
            .find(|&n| {
                text.is_char_boundary(text.len() - n) && open.starts_with(&text[text.len() - n..])
            })
            .unwrap_or(0);
        &text[..text.len() - keep]
    }

    /// The calls in a finished reply and the content around them. Calls whose JSON does not
    /// parse (the model wrote something else) stay in the content: never an invented call.
    pub fn parse(self, text: &str) -> (String, Vec<Call>) {
        match self {
            Self::Hermes => {
                let mut content = String::new();
                let mut calls = Vec::new();
                let mut rest = text;
                while let Some(at) = rest.find(HERMES_OPEN) {
                    let after = &rest[at + HERMES_OPEN.len()..];
                    let Some(end) = after.find(HERMES_CLOSE) else {
                        break;
                    };
                    match Call::from_json(after[..end].trim(), "arguments") {
                        Some(call) => {
                            content.push_str(&rest[..at]);
                            calls.push(call);
                        }
                        None => content
                            .push_str(&rest[..at + HERMES_OPEN.len() + end + HERMES_CLOSE.len()]),
                    }
                    rest = &after[end + HERMES_CLOSE.len()..];
                }
                content.push_str(rest);
                (content.trim().to_string(), calls)
            }
            Self::Mistral => {
                let Some(at) = text.find(MISTRAL_OPEN) else {
                    return (text.to_string(), Vec::new());
                };
                let list: Option<Vec<Value>> =
                    serde_json::from_str(text[at + MISTRAL_OPEN.len()..].trim()).ok();
                let calls: Option<Vec<Call>> =
                    list.and_then(|l| l.iter().map(|v| Call::from_value(v, "arguments")).collect());
                match calls {
                    Some(calls) if !calls.is_empty() => (text[..at].trim().to_string(), calls),
                    _ => (text.to_string(), Vec::new()),
                }
            }
            Self::Llama3 => {
                let t = text.trim();
                let t = t.strip_prefix(PYTHON_TAG).unwrap_or(t).trim();
                match Call::from_json(t, "parameters").or_else(|| Call::from_json(t, "arguments")) {
                    Some(call) => (String::new(), vec![call]),
                    None => (text.to_string(), Vec::new()),
                }
            }
        }
    }
}

/// `s` as the inside of a Lark string literal.
fn lark_str(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

/// A function the client offers.
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    pub name: String,
    /// Its arguments' JSON schema (`{"type": "object"}` when not given).
    pub parameters: Value,
}

/// A call the model made: the function's name and its arguments (a JSON object).
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    pub name: String,
    pub arguments: Value,
}

impl Call {
    fn from_json(text: &str, args_key: &str) -> Option<Self> {
        Self::from_value(&serde_json::from_str(text).ok()?, args_key)
    }

    fn from_value(v: &Value, args_key: &str) -> Option<Self> {
        let name = v.get("name")?.as_str()?.to_string();
        let arguments = match v.get(args_key) {
            Some(a @ Value::Object(_)) => a.clone(),
            // Some models write the arguments as a JSON string.
            Some(Value::String(s)) => match serde_json::from_str(s).ok()? {
                a @ Value::Object(_) => a,
                _ => return None,
            },
            None | Some(Value::Null) => Value::Object(Map::new()),
            _ => return None,
        };
        Some(Self { name, arguments })
    }

    /// OpenAI's `tool_calls` entry (`arguments` as JSON text).
    pub fn to_openai(&self, id: &str, index: Option<usize>) -> Value {
        let mut v = json!({"id": id, "type": "function",
            "function": {"name": self.name, "arguments": self.arguments.to_string()}});
        if let Some(i) = index {
            v["index"] = json!(i);
        }
        v
    }
}

/// What a request asks of tools.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolPlan {
    pub format: ToolFormat,
    /// `tool_choice`: `auto`, `required`, or one function by name (`none` makes no plan).
    pub choice: ToolChoice,
    pub tools: Vec<Tool>,
    pub parallel: bool,
}

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    Auto,
    Required,
    Function(String),
}

impl ToolPlan {
    /// The grammar a reply must follow: none for `auto`.
    pub fn grammar(&self) -> Option<String> {
        match &self.choice {
            ToolChoice::Auto => None,
            ToolChoice::Required => Some(self.format.grammar(&self.tools, self.parallel)),
            ToolChoice::Function(name) => {
                let only: Vec<Tool> = self
                    .tools
                    .iter()
                    .filter(|t| &t.name == name)
                    .cloned()
                    .collect();
                Some(self.format.grammar(&only, false))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_come_from_templates() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat/templates");
        let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap();
        assert_eq!(
            ToolFormat::of_template(&read("Qwen-Qwen2.5-7B-Instruct.jinja")),
            Some(ToolFormat::Hermes)
        );
        assert_eq!(
            ToolFormat::of_template(&read("Qwen-Qwen3-0.6B.jinja")),
            Some(ToolFormat::Hermes)
        );
        assert_eq!(
            ToolFormat::of_template(&read("Mistral-Small-3.2-24B-Instruct-2506.jinja")),
            Some(ToolFormat::Mistral)
        );
        assert_eq!(ToolFormat::of_template("{{ messages[0].content }}"), None);
    }

    #[test]
    fn replies_parse_into_calls_and_content() {
        let text = "Let me look.\n<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Verona\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"time\", \"arguments\": \"{\\\"tz\\\": \\\"CET\\\"}\"}\n</tool_call>";
        let (content, calls) = ToolFormat::Hermes.parse(text);
        assert_eq!(content, "Let me look.");
        assert_eq!(calls.len(), 2);
        assert_eq!(
            calls[0],
            Call {
                name: "weather".into(),
                arguments: json!({"city": "Verona"})
            }
        );
        assert_eq!(calls[1].arguments, json!({"tz": "CET"}));
        // Not JSON: content, not a call.
        let bad = "<tool_call>{\"name\": \"weather\", \"arguments\": {city}}</tool_call>";
        assert_eq!(ToolFormat::Hermes.parse(bad), (bad.to_string(), vec![]));
        let (content, calls) =
            ToolFormat::Mistral.parse("[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"x\": 1}}]");
        assert_eq!((content.as_str(), calls.len()), ("", 1));
        let (_, calls) =
            ToolFormat::Llama3.parse("<|python_tag|>{\"name\": \"f\", \"parameters\": {}}");
        assert_eq!(
            calls,
            vec![Call {
                name: "f".into(),
                arguments: json!({})
            }]
        );
        assert_eq!(ToolFormat::Llama3.parse("Hello").1, vec![]);
    }

    #[test]
    fn streamed_content_stops_where_a_call_may_begin() {
        let h = ToolFormat::Hermes;
        assert_eq!(h.content_so_far("Sure. <tool"), "Sure. ");
        assert_eq!(h.content_so_far("Sure. <tool_call>{\"na"), "Sure. ");
        assert_eq!(h.content_so_far("a < b"), "a < b");
        assert_eq!(ToolFormat::Llama3.content_so_far("{\"name\""), "");
        assert_eq!(ToolFormat::Llama3.content_so_far("Hi there"), "Hi there");
    }
}
