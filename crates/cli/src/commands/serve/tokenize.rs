//! `POST /tokenize` and `POST /detokenize` in llama-server's request and response shapes:
//! `{"content": "text" | ["text", 15, ...], "add_special": false, "parse_special": true,
//! "with_pieces": false}` gives `{"tokens": [ids]}` (with pieces, `[{"id", "piece"}]`, a
//! piece being its text or, when not UTF-8 alone, its bytes); `{"tokens": [ids]}` gives
//! `{"content": "text"}`.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

use super::api::{self, json_body, ApiError};
use super::body;
use super::shared::{authorize, Shared};
use crate::text::tokenizer::Tokenizer;
use crate::tokens::piece_json;

/// `POST /tokenize`.
pub async fn tokenize(State(s): State<Arc<Shared>>, headers: HeaderMap, body: Body) -> Response {
    respond(s, headers, body, tokenize_body).await
}

/// `POST /detokenize`.
pub async fn detokenize(State(s): State<Arc<Shared>>, headers: HeaderMap, body: Body) -> Response {
    respond(s, headers, body, detokenize_body).await
}

async fn respond(
    s: Arc<Shared>,
    headers: HeaderMap,
    body: Body,
    f: fn(&api::Obj, &Tokenizer) -> Result<Value, ApiError>,
) -> Response {
    let run = async {
        authorize(&s, &headers)?;
        body::check_declared(&headers)?;
        let bytes = body::read(body).await?;
        let s2 = s.clone();
        // Tokenizing a megabyte is CPU work: off the async threads.
        tokio::task::spawn_blocking(move || {
            let o = api::object(&bytes)?;
            let Some(tok) = s2.tokenizer.as_deref() else {
                return Err(ApiError::invalid(None, "this model has no tokenizer"));
            };
            f(&o, tok)
        })
        .await
        .map_err(|_| ApiError::invalid(None, "the request could not be read"))?
    };
    match run.await {
        Ok(v) => json_body(&v).into_response(),
        Err(e) => e.into_response(),
    }
}

fn flag(o: &api::Obj, name: &'static str, default: bool) -> Result<bool, ApiError> {
    match o.get(name) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(ApiError::invalid(
            Some(name),
            format!("`{name}` must be true or false, got {v}"),
        )),
    }
}

fn tokenize_body(o: &api::Obj, tok: &Tokenizer) -> Result<Value, ApiError> {
    let add_special = flag(o, "add_special", false)?;
    let parse_special = flag(o, "parse_special", true)?;
    let with_pieces = flag(o, "with_pieces", false)?;
    let bad = |m: String| ApiError::invalid(Some("content"), m);
    let encode = |text: &str, add: bool| {
        tok.encode_with(text, add, parse_special)
            .map_err(|e| bad(format!("{e:#}")))
    };
    // As llama.cpp's `tokenize_mixed`: strings and ids in order, the special tokens added
    // only for a string first.
    let ids: Vec<u32> = match o.get("content") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => encode(s, add_special)?,
        Some(Value::Array(parts)) => {
            let mut ids = Vec::new();
            for (i, p) in parts.iter().enumerate() {
                match p {
                    Value::String(s) => ids.extend(encode(s, add_special && i == 0)?),
                    v => match v.as_u64().filter(|&id| (id as usize) < tok.vocab_size()) {
                        Some(id) => ids.push(id as u32),
                        None => {
                            return Err(bad(format!(
                                "content[{i}] must be text or a token id in 0..{}, got {v}",
                                tok.vocab_size()
                            )))
                        }
                    },
                }
            }
            ids
        }
        Some(v) => return Err(bad(format!("`content` must be text or a list, got {v}"))),
    };
    if !with_pieces {
        return Ok(json!({ "tokens": ids }));
    }
    let tokens = ids
        .iter()
        .map(|&id| {
            let piece = tok.piece_bytes(id).map_err(|e| bad(format!("{e:#}")))?;
            Ok(json!({"id": id, "piece": piece_json(piece)}))
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    Ok(json!({ "tokens": tokens }))
}

fn detokenize_body(o: &api::Obj, tok: &Tokenizer) -> Result<Value, ApiError> {
    let bad = |m: String| ApiError::invalid(Some("tokens"), m);
    let ids: Vec<u32> = match o.get("tokens") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| {
                v.as_u64()
                    .filter(|&id| (id as usize) < tok.vocab_size())
                    .map(|id| id as u32)
                    .ok_or_else(|| {
                        bad(format!(
                            "`tokens` must hold token ids in 0..{}, got {v}",
                            tok.vocab_size()
                        ))
                    })
            })
            .collect::<Result<_, _>>()?,
        Some(v) => return Err(bad(format!("`tokens` must be a list of ids, got {v}"))),
    };
    let content = tok.decode(&ids).map_err(|e| bad(format!("{e:#}")))?;
    Ok(json!({ "content": content }))
}
