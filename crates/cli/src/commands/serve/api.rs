//! The OpenAI request bodies, read field by field so that every mistake is a 4xx that
//! names the parameter, and the error shape OpenAI's clients expect.

use super::tools::{Tool, ToolChoice, ToolFormat, ToolPlan};
use crate::text::grammar::GrammarSpec;
use crate::text::tokenizer::Tokenizer;
use crate::tokens;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use gpt_blocks::SamplingParams;
use serde_json::{json, Map, Value};

use crate::text::chat_template::{message, ChatTemplate, Conversation};

/// Most prompts in one completions request (each becomes a choice).
pub const MAX_PROMPTS: usize = 16;
/// Most stop strings, and the longest one in bytes.
pub const MAX_STOPS: usize = 16;
pub const MAX_STOP_BYTES: usize = 256;
/// Most messages in one chat request.
pub const MAX_MESSAGES: usize = 1024;
/// Most alternatives per token with logprobs.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// An error as OpenAI writes it: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    /// 400 `invalid_request_error` about `param`.
    pub fn invalid(param: Option<&str>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_string),
            code: None,
        }
    }

    /// Any status, with a type and a code.
    pub fn new(
        status: StatusCode,
        kind: &'static str,
        code: Option<&'static str>,
        message: impl Into<String>,
    ) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
            code,
        }
    }

    /// The JSON body.
    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, json_body(&self.body())).into_response()
    }
}

/// `application/json` of `v`.
pub fn json_body(v: &Value) -> impl IntoResponse {
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        v.to_string(),
    )
}

/// What the model knows that requests are checked against.
pub struct ModelInfo<'a> {
    pub tokenizer: Option<&'a Tokenizer>,
    pub chat: &'a ChatTemplate,
    pub n_positions: usize,
    pub vocab_size: usize,
    pub eos: Option<u32>,
    pub name: &'a str,
}

/// A checked request, ready to become jobs.
#[derive(Debug, Clone)]
pub struct Plan {
    /// One per choice.
    pub prompts: Vec<Vec<u32>>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop_ids: Vec<u32>,
    /// Texts that end a choice (not included in it).
    pub stops: Vec<String>,
    /// `Some(n)`: log-probabilities with `n` alternatives per token.
    pub logprobs: Option<usize>,
    pub stream: bool,
    /// `stream_options.include_usage`: a last chunk carrying only `usage`.
    pub include_usage: bool,
    /// What the text must follow (`response_format`, vLLM's `guided_*`, `tool_choice`),
    /// with the field that asked for it.
    pub grammar: Option<(&'static str, GrammarSpec)>,
    /// Tools the model may call, and how its replies carry the calls (chat only).
    pub tools: Option<ToolPlan>,
}

/// A request body's fields.
pub type Obj = Map<String, Value>;

fn opt<'a>(o: &'a Obj, name: &str) -> Option<&'a Value> {
    o.get(name).filter(|v| !v.is_null())
}

fn f64_field(o: &Obj, name: &'static str) -> Result<Option<f64>, ApiError> {
    match opt(o, name) {
        None => Ok(None),
        Some(v) => v
            .as_f64()
            .filter(|x| x.is_finite())
            .map(Some)
            .ok_or_else(|| {
                ApiError::invalid(Some(name), format!("`{name}` must be a number, got {v}"))
            }),
    }
}

/// An integer field, in a type that holds every integer JSON gives us (i64 and u64 alike),
/// so that no range check below sees a value wrapped around.
fn int_field(o: &Obj, name: &'static str) -> Result<Option<i128>, ApiError> {
    match opt(o, name) {
        None => Ok(None),
        Some(v) => match (v.as_i64(), v.as_u64()) {
            (Some(i), _) => Ok(Some(i.into())),
            (None, Some(u)) => Ok(Some(u.into())),
            _ => Err(ApiError::invalid(
                Some(name),
                format!("`{name}` must be an integer, got {v}"),
            )),
        },
    }
}

fn bool_field(o: &Obj, name: &'static str) -> Result<bool, ApiError> {
    match opt(o, name) {
        None => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(ApiError::invalid(
            Some(name),
            format!("`{name}` must be true or false, got {v}"),
        )),
    }
}

/// The body as a JSON object. Its fields are read one by one, so that a value JSON allows
/// and this server cannot hold (a number past f64's range, nesting past serde_json's depth)
/// is an error naming its field, not one about the whole body.
pub fn object(body: &[u8]) -> Result<Obj, ApiError> {
    use serde_json::value::RawValue;
    let raw: &RawValue = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(None, format!("the request body is not valid JSON: {e}")))?;
    let fields: Vec<(String, Box<RawValue>)> = match serde_json::from_str::<
        std::collections::BTreeMap<String, Box<RawValue>>,
    >(raw.get())
    {
        Ok(m) => m.into_iter().collect(),
        Err(_) => {
            return Err(ApiError::invalid(
                None,
                "the request body must be a JSON object",
            ))
        }
    };
    fields
        .into_iter()
        .map(
            |(name, raw)| match serde_json::from_str::<Value>(raw.get()) {
                Ok(v) => Ok((name, v)),
                Err(e) => Err(ApiError::invalid(
                    Some(&name),
                    format!("`{name}` cannot be read: {e}"),
                )),
            },
        )
        .collect()
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Checks `model` against the served name (absent means the served model).
pub fn check_model(o: &Obj, info: &ModelInfo) -> Result<(), ApiError> {
    match opt(o, "model") {
        None => Ok(()),
        Some(Value::String(m)) if m == info.name => Ok(()),
        Some(Value::String(m)) => Err(ApiError {
            param: Some("model".into()),
            ..ApiError::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                Some("model_not_found"),
                format!(
                    "the model `{m}` does not exist; this server serves `{}`",
                    info.name
                ),
            )
        }),
        Some(v) => Err(ApiError::invalid(
            Some("model"),
            format!("`model` must be a string, got {}", kind(v)),
        )),
    }
}

/// Parameters this server does not implement are refused unless they hold their
/// no-op value, so that a request is never silently answered as something else.
fn refuse_unsupported(o: &Obj) -> Result<(), ApiError> {
    for (name, neutral) in [
        ("echo", json!(false)),
        ("suffix", Value::Null),
        ("best_of", json!(1)),
        ("frequency_penalty", json!(0)),
        ("presence_penalty", json!(0)),
        ("functions", json!([])),
        ("logit_bias", json!({})),
    ] {
        if let Some(v) = opt(o, name) {
            let same = v == &neutral || (v.as_f64().is_some() && v.as_f64() == neutral.as_f64());
            if !same {
                let mut got = v.to_string();
                if got.len() > 200 {
                    let cut = (0..=200)
                        .rev()
                        .find(|&i| got.is_char_boundary(i))
                        .unwrap_or(0);
                    got.truncate(cut);
                    got.push_str("...");
                }
                return Err(ApiError::invalid(
                    Some(name),
                    format!("`{name}` is not supported by this server (got {got})"),
                ));
            }
        }
    }
    if let Some(n) = int_field(o, "n")? {
        if n != 1 {
            return Err(ApiError::invalid(
                Some("n"),
                format!("`n` must be 1: this server returns one choice per prompt (got {n})"),
            ));
        }
    }
    Ok(())
}

/// Sampling, stop and streaming fields shared by both endpoints.
/// The constraint a request puts on its text, if any: OpenAI's `response_format`
/// (`json_schema`, `json_object`; `text` is none) or vLLM's extensions `guided_json`,
/// `guided_regex` and `guided_grammar` (a Lark grammar). At most one.
fn grammar(o: &Obj) -> Result<Option<(&'static str, GrammarSpec)>, ApiError> {
    let bad = |name: &'static str, msg: String| ApiError::invalid(Some(name), msg);
    let mut found: Vec<(&'static str, GrammarSpec)> = Vec::new();
    if let Some(rf) = opt(o, "response_format") {
        let name = "response_format";
        let Value::Object(rf) = rf else {
            return Err(bad(
                name,
                format!("`{name}` must be an object, got {}", kind(rf)),
            ));
        };
        match rf.get("type").and_then(Value::as_str) {
            Some("text") => {}
            Some("json_object") => found.push((name, GrammarSpec::JsonObject)),
            Some("json_schema") => {
                let schema = rf
                    .get("json_schema")
                    .and_then(Value::as_object)
                    .and_then(|js| {
                        if let Some(strict) = js.get("strict").filter(|v| !v.is_null()) {
                            strict.as_bool()?;
                        }
                        js.get("schema")
                    });
                match schema {
                    Some(v @ (Value::Object(_) | Value::Bool(_))) => {
                        found.push((name, GrammarSpec::JsonSchema(v.clone())))
                    }
                    _ => {
                        return Err(bad(
                            name,
                            "`response_format.json_schema` must be an object with a `schema` (a JSON schema) and, if given, a boolean `strict`".into(),
                        ))
                    }
                }
            }
            _ => {
                return Err(bad(
                    name,
                    "`response_format.type` must be `text`, `json_object` or `json_schema`".into(),
                ))
            }
        }
    }
    if let Some(v) = opt(o, "guided_json") {
        let schema = match v {
            // vLLM takes the schema as an object or as its text.
            Value::String(text) => serde_json::from_str(text).ok(),
            v @ (Value::Object(_) | Value::Bool(_)) => Some(v.clone()),
            _ => None,
        };
        match schema {
            Some(schema) => found.push(("guided_json", GrammarSpec::JsonSchema(schema))),
            None => {
                return Err(bad(
                    "guided_json",
                    "`guided_json` must be a JSON schema".into(),
                ))
            }
        }
    }
    for (name, make) in [
        (
            "guided_regex",
            GrammarSpec::Regex as fn(String) -> GrammarSpec,
        ),
        ("guided_grammar", GrammarSpec::Lark),
    ] {
        if let Some(v) = opt(o, name) {
            match v.as_str() {
                Some(text) => found.push((name, make(text.to_string()))),
                None => return Err(bad(name, format!("`{name}` must be a string"))),
            }
        }
    }
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|f| f.0).collect();
        return Err(bad(
            found[1].0,
            format!("one constraint per request, got {}", names.join(" and ")),
        ));
    }
    Ok(found.pop())
}

fn common_fields(o: &Obj, plan: &mut Plan, info: &ModelInfo) -> Result<(), ApiError> {
    refuse_unsupported(o)?;
    plan.grammar = grammar(o)?;
    let temperature = f64_field(o, "temperature")?.unwrap_or(1.0);
    if temperature < 0.0 {
        return Err(ApiError::invalid(
            Some("temperature"),
            format!("`temperature` must be >= 0, got {temperature}"),
        ));
    }
    let top_p = f64_field(o, "top_p")?;
    if let Some(p) = top_p {
        if !(p > 0.0 && p <= 1.0) {
            return Err(ApiError::invalid(
                Some("top_p"),
                format!("`top_p` must be in (0, 1], got {p}"),
            ));
        }
    }
    // vLLM's extension: 0 or -1 means no limit. Past the vocabulary, every token is kept.
    let top_k = match int_field(o, "top_k")? {
        None | Some(0) | Some(-1) => None,
        Some(k) if k > 0 => Some(usize::try_from(k).unwrap_or(usize::MAX)),
        Some(k) => {
            return Err(ApiError::invalid(
                Some("top_k"),
                format!("`top_k` must be a positive integer (0 or -1 for no limit), got {k}"),
            ))
        }
    };
    // Checked as the f32 the sampler multiplies by: 1e300 would become inf and 1e-50 zero.
    let asked = f64_field(o, "repetition_penalty")?.unwrap_or(1.0);
    let repeat_penalty = asked as f32;
    if !(repeat_penalty > 0.0 && repeat_penalty.is_finite()) {
        return Err(ApiError::invalid(
            Some("repetition_penalty"),
            format!(
                "`repetition_penalty` must be a positive number within f32's range (about 1.2e-38 to 3.4e38), got {asked}"
            ),
        ));
    }
    // Any integer JSON can carry: a negative seed is its two's complement, as in NumPy.
    let seed = match int_field(o, "seed")? {
        Some(s) => s as u64,
        None => fresh_seed(),
    };
    plan.sampling = SamplingParams {
        temperature,
        top_k,
        top_p,
        repeat_penalty,
        seed,
    };
    plan.stops = match opt(o, "stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => {
            if items.len() > MAX_STOPS {
                return Err(ApiError::invalid(
                    Some("stop"),
                    format!("at most {MAX_STOPS} stop strings, got {}", items.len()),
                ));
            }
            items
                .iter()
                .map(|s| match s {
                    Value::String(s) => Ok(s.clone()),
                    v => Err(ApiError::invalid(
                        Some("stop"),
                        format!("`stop` must hold strings, got {}", kind(v)),
                    )),
                })
                .collect::<Result<_, _>>()?
        }
        Some(v) => {
            return Err(ApiError::invalid(
                Some("stop"),
                format!(
                    "`stop` must be a string or a list of strings, got {}",
                    kind(v)
                ),
            ))
        }
    };
    if let Some(bad) = plan
        .stops
        .iter()
        .find(|s| s.is_empty() || s.len() > MAX_STOP_BYTES)
    {
        return Err(ApiError::invalid(
            Some("stop"),
            format!(
                "stop strings must have 1 to {MAX_STOP_BYTES} bytes, got one of {}",
                bad.len()
            ),
        ));
    }
    plan.stream = bool_field(o, "stream")?;
    plan.include_usage = match opt(o, "stream_options") {
        None => false,
        Some(Value::Object(so)) => bool_field(so, "include_usage").map_err(|e| ApiError {
            param: Some("stream_options.include_usage".into()),
            ..e
        })?,
        Some(v) => {
            return Err(ApiError::invalid(
                Some("stream_options"),
                format!("`stream_options` must be an object, got {}", kind(v)),
            ))
        }
    };
    plan.stop_ids = info.eos.into_iter().collect();
    Ok(())
}

/// A seed for a request that gave none: different on every request, as OpenAI's are.
fn fresh_seed() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut rng =
        gpt_blocks::SplitMix64(nanos ^ COUNTER.fetch_add(1, Ordering::Relaxed).rotate_left(32));
    rng.next_u64()
}

fn empty_plan() -> Plan {
    Plan {
        prompts: Vec::new(),
        max_tokens: 0,
        sampling: SamplingParams::default(),
        stop_ids: Vec::new(),
        stops: Vec::new(),
        logprobs: None,
        stream: false,
        include_usage: false,
        grammar: None,
        tools: None,
    }
}

/// Checks the prompt against the vocabulary and the context and settles `max_tokens`
/// (`default` when the request gives none: `None` means all the room left). A context
/// overflow names the prompt's field (`prompt_param`) when the prompt alone fills the
/// context, else the length field that asked for too much.
fn fit(
    plan: &mut Plan,
    o: &Obj,
    names: &[&'static str],
    prompt_param: &'static str,
    default: Option<usize>,
    info: &ModelInfo,
) -> Result<(), ApiError> {
    let mut asked = None;
    for &name in names {
        if let Some(n) = int_field(o, name)? {
            if n < 1 {
                return Err(ApiError::invalid(
                    Some(name),
                    format!("`{name}` must be at least 1, got {n}"),
                ));
            }
            asked = Some((name, u64::try_from(n).unwrap_or(u64::MAX)));
        }
    }
    let longest = plan.prompts.iter().map(Vec::len).max().unwrap_or(0);
    let ctx = info.n_positions;
    for p in &plan.prompts {
        if p.is_empty() {
            return Err(ApiError::invalid(
                Some("prompt"),
                "the prompt encodes to no tokens; give some text",
            ));
        }
        if let Some(&bad) = p.iter().find(|&&t| t as usize >= info.vocab_size) {
            return Err(ApiError::invalid(
                Some("prompt"),
                format!(
                    "token id {bad} is outside the vocabulary (0..{})",
                    info.vocab_size
                ),
            ));
        }
    }
    let too_long = |param: &str, asked: u64| {
        ApiError {
        code: Some("context_length_exceeded"),
        ..ApiError::invalid(
            Some(param),
            format!(
                "this model's maximum context length is {ctx} tokens; the prompt has {longest} and {asked} more were requested"
            ),
        )
    }
    };
    if longest >= ctx {
        return Err(too_long(prompt_param, 1));
    }
    let room = (ctx - longest) as u64;
    plan.max_tokens = match (asked, default) {
        (Some((name, n)), _) if n > room => return Err(too_long(name, n)),
        (Some((_, n)), _) => n as usize,
        (None, Some(d)) => d.min(room as usize),
        (None, None) => room as usize,
    };
    Ok(())
}

/// `POST /v1/completions`.
pub fn completions(o: &Obj, info: &ModelInfo) -> Result<Plan, ApiError> {
    check_model(o, info)?;
    if opt(o, "tools").is_some_and(|t| t != &json!([])) {
        return Err(ApiError::invalid(
            Some("tools"),
            "`tools` belongs to /v1/chat/completions (completions take no tools)",
        ));
    }
    let mut plan = empty_plan();
    common_fields(o, &mut plan, info)?;
    let text = |s: &str| -> Result<Vec<u32>, ApiError> {
        tokens::encode(info.tokenizer, s)
            .map_err(|e| ApiError::invalid(Some("prompt"), format!("{e:#}")))
    };
    let ids = |items: &[Value]| -> Result<Vec<u32>, ApiError> {
        items
            .iter()
            .map(|t| {
                t.as_u64()
                    .filter(|&t| t <= u32::MAX as u64)
                    .map(|t| t as u32)
                    .ok_or_else(|| {
                        ApiError::invalid(
                            Some("prompt"),
                            format!("token ids must be non-negative integers, got {t}"),
                        )
                    })
            })
            .collect()
    };
    plan.prompts = match opt(o, "prompt") {
        None => return Err(ApiError::invalid(Some("prompt"), "`prompt` is required")),
        Some(Value::String(s)) => vec![text(s)?],
        Some(Value::Array(items)) if items.is_empty() => {
            return Err(ApiError::invalid(
                Some("prompt"),
                "`prompt` must not be an empty list",
            ))
        }
        Some(Value::Array(items)) if items.iter().all(Value::is_number) => vec![ids(items)?],
        Some(Value::Array(items)) => {
            if items.len() > MAX_PROMPTS {
                return Err(ApiError::invalid(
                    Some("prompt"),
                    format!(
                        "at most {MAX_PROMPTS} prompts per request, got {}",
                        items.len()
                    ),
                ));
            }
            items
                .iter()
                .map(|p| match p {
                    Value::String(s) => text(s),
                    Value::Array(t) => ids(t),
                    v => Err(ApiError::invalid(
                        Some("prompt"),
                        format!(
                            "a list of prompts must hold strings or lists of token ids, got {}",
                            kind(v)
                        ),
                    )),
                })
                .collect::<Result<_, _>>()?
        }
        Some(v) => {
            return Err(ApiError::invalid(
                Some("prompt"),
                format!(
                    "`prompt` must be a string, a list of strings, or token ids; got {}",
                    kind(v)
                ),
            ))
        }
    };
    plan.logprobs = match int_field(o, "logprobs")? {
        None => None,
        Some(n) if (0..=MAX_TOP_LOGPROBS as i128).contains(&n) => Some(n as usize),
        Some(n) => {
            return Err(ApiError::invalid(
                Some("logprobs"),
                format!("`logprobs` must be 0 to {MAX_TOP_LOGPROBS}, got {n}"),
            ))
        }
    };
    // OpenAI's default for completions.
    fit(&mut plan, o, &["max_tokens"], "prompt", Some(16), info)?;
    Ok(plan)
}

/// `POST /v1/chat/completions`.
pub fn chat(o: &Obj, info: &ModelInfo) -> Result<Plan, ApiError> {
    check_model(o, info)?;
    let mut plan = empty_plan();
    common_fields(o, &mut plan, info)?;
    let messages = messages(o)?;
    let (offered, tool_plan) = tools(o, info)?;
    if let Some(grammar) = tool_plan.as_ref().and_then(ToolPlan::grammar) {
        if let Some((field, _)) = plan.grammar {
            return Err(ApiError::invalid(
                Some("tool_choice"),
                format!("`tool_choice` that forces a call cannot go with `{field}`"),
            ));
        }
        plan.grammar = Some(("tool_choice", GrammarSpec::Lark(grammar)));
    }
    plan.tools = tool_plan;
    let conv = Conversation {
        tools: offered,
        ..Conversation::new(messages)
    };
    let ids = info
        .chat
        .prompt_ids(info.tokenizer, &conv)
        .map_err(|e| ApiError::invalid(Some("messages"), format!("{e:#}")))?;
    plan.prompts = vec![ids];
    plan.stop_ids = info.chat.stop_ids(info.tokenizer, info.eos);
    plan.stops.extend(info.chat.stop_texts());
    let logprobs = bool_field(o, "logprobs")?;
    plan.logprobs = match (logprobs, int_field(o, "top_logprobs")?) {
        (false, None) => None,
        (false, Some(_)) => {
            return Err(ApiError::invalid(
                Some("top_logprobs"),
                "`top_logprobs` needs `logprobs: true`",
            ))
        }
        (true, None) => Some(0),
        (true, Some(n)) if (0..=MAX_TOP_LOGPROBS as i128).contains(&n) => Some(n as usize),
        (true, Some(n)) => {
            return Err(ApiError::invalid(
                Some("top_logprobs"),
                format!("`top_logprobs` must be 0 to {MAX_TOP_LOGPROBS}, got {n}"),
            ))
        }
    };
    fit(
        &mut plan,
        o,
        &["max_tokens", "max_completion_tokens"],
        "messages",
        None,
        info,
    )?;
    Ok(plan)
}

/// `messages`: roles `system` (`developer` is its newer name), `user`, `assistant`;
/// content a string or a list of text parts.
/// Most tools a request may offer.
const MAX_TOOLS: usize = 512;

/// `tools`, `tool_choice` and `parallel_tool_calls`: the tools as the chat template gets them
/// (`None` when there are none), and the plan for the reply (`None` when no call may come:
/// no tools, or `tool_choice` `none`).
fn tools(o: &Obj, info: &ModelInfo) -> Result<(Option<Vec<Value>>, Option<ToolPlan>), ApiError> {
    let bad = |name: &'static str, m: String| ApiError::invalid(Some(name), m);
    let list = match opt(o, "tools") {
        None => {
            return match opt(o, "tool_choice") {
                None => Ok((None, None)),
                Some(Value::String(s)) if s == "none" || s == "auto" => Ok((None, None)),
                Some(_) => Err(bad("tool_choice", "`tool_choice` needs `tools`".into())),
            }
        }
        Some(Value::Array(list)) if list.is_empty() => return Ok((None, None)),
        Some(Value::Array(list)) => list,
        Some(v) => {
            return Err(bad(
                "tools",
                format!("`tools` must be a list, got {}", kind(v)),
            ))
        }
    };
    if list.len() > MAX_TOOLS {
        return Err(bad(
            "tools",
            format!("at most {MAX_TOOLS} tools, got {}", list.len()),
        ));
    }
    let mut tools = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let f = t
            .get("function")
            .filter(|_| t.get("type").and_then(Value::as_str) == Some("function"));
        let name = f.and_then(|f| f.get("name")).and_then(Value::as_str);
        let (Some(f), Some(name)) = (f, name) else {
            return Err(bad(
                "tools",
                format!("tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"),
            ));
        };
        let parameters = match f.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object"}),
            Some(p @ Value::Object(_)) => p.clone(),
            Some(_) => {
                return Err(bad(
                    "tools",
                    format!("tools[{i}].function.parameters must be a JSON schema"),
                ))
            }
        };
        if tools.iter().any(|t: &Tool| t.name == name) {
            return Err(bad(
                "tools",
                format!("tools[{i}]: `{name}` is offered twice"),
            ));
        }
        tools.push(Tool {
            name: name.to_string(),
            parameters,
        });
    }
    let choice = match opt(o, "tool_choice") {
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            "none" => return Ok((Some(list.clone()), None)),
            s => return Err(bad("tool_choice", format!("`tool_choice` must be none, auto, required or a function, got `{s}`"))),
        },
        Some(v) => match v.get("function").and_then(|f| f.get("name")).and_then(Value::as_str) {
            Some(name) if tools.iter().any(|t| t.name == name) => ToolChoice::Function(name.to_string()),
            Some(name) => return Err(bad("tool_choice", format!("`tool_choice` names `{name}`, which is not among `tools`"))),
            None => return Err(bad("tool_choice", "`tool_choice` must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}".into())),
        },
    };
    let parallel = match opt(o, "parallel_tool_calls") {
        None => true,
        Some(Value::Bool(b)) => *b,
        Some(v) => {
            return Err(bad(
                "parallel_tool_calls",
                format!("`parallel_tool_calls` must be a boolean, got {}", kind(v)),
            ))
        }
    };
    let source = info.chat.own_template().unwrap_or("");
    if !source.contains("tools") {
        return Err(bad(
            "tools",
            "this model's chat template takes no tools".into(),
        ));
    }
    let Some(format) = ToolFormat::of_template(source) else {
        return Err(bad(
            "tools",
            "this model's chat template writes tool calls in a format this server does not read (it reads Hermes/Qwen <tool_call>, Mistral [TOOL_CALLS] and Llama 3 JSON)".into(),
        ));
    };
    Ok((
        Some(list.clone()),
        Some(ToolPlan {
            format,
            choice,
            tools,
            parallel,
        }),
    ))
}

fn messages(o: &Obj) -> Result<Vec<serde_json::Value>, ApiError> {
    let bad = |m: String| ApiError::invalid(Some("messages"), m);
    let items = match opt(o, "messages") {
        Some(Value::Array(items)) if !items.is_empty() => items,
        Some(Value::Array(_)) => return Err(bad("`messages` must not be empty".into())),
        None => return Err(bad("`messages` is required".into())),
        Some(v) => return Err(bad(format!("`messages` must be a list, got {}", kind(v)))),
    };
    if items.len() > MAX_MESSAGES {
        return Err(bad(format!(
            "at most {MAX_MESSAGES} messages, got {}",
            items.len()
        )));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let role = match m.get("role") {
                Some(Value::String(r)) => match r.as_str() {
                    "system" | "developer" => "system",
                    "user" => "user",
                    "assistant" => "assistant",
                    "tool" => "tool",
                    r => {
                        return Err(bad(format!(
                            "messages[{i}]: role `{r}` is not supported (system, developer, user, assistant, tool)"
                        )))
                    }
                },
                _ => return Err(bad(format!("messages[{i}] needs a string `role`"))),
            };
            let content = match m.get("content") {
                Some(Value::String(s)) => s.clone(),
                None | Some(Value::Null) => String::new(),
                Some(Value::Array(parts)) => parts
                    .iter()
                    .map(|p| match (p.get("type").and_then(Value::as_str), p.get("text")) {
                        (Some("text"), Some(Value::String(t))) => Ok(t.as_str()),
                        _ => Err(bad(format!(
                            "messages[{i}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported"
                        ))),
                    })
                    .collect::<Result<Vec<_>, _>>()?
                    .concat(),
                Some(v) => {
                    return Err(bad(format!(
                        "messages[{i}]: `content` must be a string or a list of parts, got {}",
                        kind(v)
                    )))
                }
            };
            let mut msg = message(role, &content);
            if role == "tool" {
                for key in ["tool_call_id", "name"] {
                    match m.get(key) {
                        None | Some(Value::Null) => {}
                        Some(v @ Value::String(_)) => msg[key] = v.clone(),
                        Some(_) => return Err(bad(format!("messages[{i}]: `{key}` must be a string"))),
                    }
                }
            }
            if let Some(calls) = m.get("tool_calls").filter(|v| !v.is_null()) {
                if role != "assistant" {
                    return Err(bad(format!("messages[{i}]: only assistant messages have `tool_calls`")));
                }
                msg["tool_calls"] = history_calls(calls).map_err(|e| bad(format!("messages[{i}].tool_calls: {e}")))?;
            }
            Ok(msg)
        })
        .collect()
}

/// An assistant message's `tool_calls` as chat templates read them (transformers' form):
/// each call's `arguments` a JSON object, not the JSON text OpenAI's clients send.
fn history_calls(calls: &Value) -> Result<Value, String> {
    let Value::Array(calls) = calls else {
        return Err("must be a list".into());
    };
    calls
        .iter()
        .enumerate()
        .map(|(j, c)| {
            let f = c
                .get("function")
                .ok_or_else(|| format!("[{j}] needs a `function`"))?;
            let name = f
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| format!("[{j}].function needs a string `name`"))?;
            let arguments = match f.get("arguments") {
                None | Some(Value::Null) => json!({}),
                Some(a @ Value::Object(_)) => a.clone(),
                Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
                    Ok(a @ Value::Object(_)) => a,
                    _ => return Err(format!("[{j}].function.arguments is not a JSON object")),
                },
                Some(_) => return Err(format!("[{j}].function.arguments must be JSON text")),
            };
            let mut call =
                json!({"type": "function", "function": {"name": name, "arguments": arguments}});
            if let Some(id) = c.get("id").and_then(Value::as_str) {
                call["id"] = json!(id);
            }
            Ok(call)
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Value::Array)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info<'a>(chat: &'a ChatTemplate) -> ModelInfo<'a> {
        ModelInfo {
            tokenizer: None,
            chat,
            n_positions: 32,
            vocab_size: 100,
            eos: Some(0),
            name: "m",
        }
    }

    fn parse(body: &str) -> Result<Plan, ApiError> {
        let chat = ChatTemplate::new(None, None, None);
        completions(&object(body.as_bytes())?, &info(&chat))
    }

    #[test]
    fn token_prompts_defaults_and_limits() {
        let p =
            parse(r#"{"model": "m", "prompt": [1, 2, 3], "temperature": 0, "seed": 7}"#).unwrap();
        assert_eq!(p.prompts, vec![vec![1, 2, 3]]);
        assert_eq!(p.max_tokens, 16);
        assert_eq!(p.sampling.seed, 7);
        assert_eq!(p.stop_ids, vec![0]);
        let p =
            parse(r#"{"prompt": [[1], [2, 3]], "max_tokens": 29, "stop": ["a", "b"]}"#).unwrap();
        assert_eq!(p.prompts.len(), 2);
        assert_eq!(p.max_tokens, 29);
        assert_eq!(p.stops, ["a", "b"]);
    }

    /// Each mistake is a 4xx naming its parameter.
    #[test]
    fn mistakes_name_their_parameter() {
        let cases = [
            (
                r#"{"prompt": [1], "temperature": -1}"#,
                Some("temperature"),
                400,
            ),
            (
                r#"{"prompt": [1], "temperature": "hot"}"#,
                Some("temperature"),
                400,
            ),
            (r#"{"prompt": [1], "top_p": 0}"#, Some("top_p"), 400),
            (r#"{"prompt": [1], "top_k": -3}"#, Some("top_k"), 400),
            (
                r#"{"prompt": [1], "max_tokens": -1}"#,
                Some("max_tokens"),
                400,
            ),
            (
                r#"{"prompt": [1], "max_tokens": 32}"#,
                Some("max_tokens"),
                400,
            ),
            (r#"{"prompt": [1], "n": 2}"#, Some("n"), 400),
            (r#"{"prompt": [1], "echo": true}"#, Some("echo"), 400),
            (
                r#"{"prompt": [1], "presence_penalty": 0.5}"#,
                Some("presence_penalty"),
                400,
            ),
            (r#"{"prompt": [100]}"#, Some("prompt"), 400),
            (r#"{"prompt": [-1]}"#, Some("prompt"), 400),
            (r#"{"prompt": []}"#, Some("prompt"), 400),
            (r#"{"prompt": "text"}"#, Some("prompt"), 400), // no tokenizer
            (r#"{"prompt": [1], "stop": [""]}"#, Some("stop"), 400),
            (r#"{"prompt": [1], "stop": 5}"#, Some("stop"), 400),
            (r#"{"prompt": [1], "logprobs": 21}"#, Some("logprobs"), 400),
            (
                r#"{"prompt": [1], "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}"#,
                Some("response_format"),
                400,
            ),
            (
                r#"{"prompt": [1], "response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}}"#,
                Some("response_format"),
                400,
            ),
            (
                r#"{"prompt": [1], "response_format": {"type": "xml"}}"#,
                Some("response_format"),
                400,
            ),
            (
                r#"{"prompt": [1], "guided_regex": 5}"#,
                Some("guided_regex"),
                400,
            ),
            (
                r#"{"prompt": [1], "guided_json": "{not json"}"#,
                Some("guided_json"),
                400,
            ),
            (
                r#"{"prompt": [1], "guided_regex": "a", "response_format": {"type": "json_object"}}"#,
                Some("guided_regex"),
                400,
            ),
            (
                r#"{"prompt": [1], "response_format": "json"}"#,
                Some("response_format"),
                400,
            ),
            (r#"{"prompt": [1], "model": "other"}"#, Some("model"), 404),
            (r#"{"max_tokens": 1}"#, Some("prompt"), 400),
        ];
        for (body, param, status) in cases {
            let e = parse(body).expect_err(body);
            assert_eq!(
                (e.param.as_deref(), e.status.as_u16()),
                (param, status),
                "{body}: {}",
                e.message
            );
        }
        let many = format!(r#"{{"prompt": [1], "stop": {:?}}}"#, vec!["x"; 10_000]);
        assert_eq!(parse(&many).unwrap_err().param.as_deref(), Some("stop"));
        assert!(parse("[1]").unwrap_err().message.contains("JSON object"));
        assert!(parse("{\"prompt\": NaN}")
            .unwrap_err()
            .message
            .contains("not valid JSON"));
        // Neutral values of unsupported parameters are fine.
        parse(r#"{"prompt": [1], "echo": false, "n": 1, "presence_penalty": 0, "best_of": 1}"#)
            .unwrap();
        let plan = parse(r#"{"prompt": [1], "response_format": {"type": "text"}}"#).unwrap();
        assert_eq!(plan.grammar, None);
        let plan = parse(r#"{"prompt": [1], "response_format": {"type": "json_object"}}"#);
        assert_eq!(
            plan.unwrap().grammar,
            Some(("response_format", GrammarSpec::JsonObject))
        );
        let body = r#"{"prompt": [1], "response_format": {"type": "json_schema",
            "json_schema": {"name": "x", "strict": true, "schema": {"type": "string"}}}}"#;
        let want = GrammarSpec::JsonSchema(json!({"type": "string"}));
        assert_eq!(
            parse(body).unwrap().grammar,
            Some(("response_format", want.clone()))
        );
        let body = r#"{"prompt": [1], "guided_json": "{\"type\": \"string\"}"}"#;
        assert_eq!(parse(body).unwrap().grammar, Some(("guided_json", want)));
        let body = r#"{"prompt": [1], "guided_grammar": "start: \"a\""}"#;
        let want = GrammarSpec::Lark("start: \"a\"".into());
        assert_eq!(parse(body).unwrap().grammar, Some(("guided_grammar", want)));
    }

    #[test]
    fn chat_messages_are_checked() {
        let chat = ChatTemplate::new(None, None, None);
        let info = info(&chat);
        let run = |body: &str| super::chat(&object(body.as_bytes()).unwrap(), &info);
        for (body, what) in [
            (r#"{"messages": []}"#, "must not be empty"),
            (
                r#"{"messages": [{"role": "function", "content": "x"}]}"#,
                "not supported",
            ),
            (
                r#"{"messages": [{"content": "x"}]}"#,
                "needs a string `role`",
            ),
            (
                r#"{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}"#,
                "only text parts",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}]}"#,
                "needs a tokenizer",
            ),
        ] {
            let e = run(body).unwrap_err();
            assert!(e.message.contains(what), "{body}: {}", e.message);
            assert_eq!(e.param.as_deref(), Some("messages"));
        }
    }
}
