//! `gpt serve` end to end: a real server process on 127.0.0.1 with a port the OS picks,
//! driven over HTTP (and by the official `openai` Python client), every request and loop
//! bounded in count and time. Outputs are checked against `gpt generate` on the same
//! prompts; batching against each request run alone.

mod server;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use server::{generate, Server};

const PROMPT: &str = "ROMEO:";

/// Text of the first choice.
fn text(v: &Value) -> &str {
    v["choices"][0]["text"].as_str().unwrap()
}

/// Greedy and seeded completions equal `gpt generate`; chat equals `gpt generate --chat`;
/// streaming gives the same text; stop strings cut; batched requests equal requests alone.
#[test]
fn answers_equal_gpt_generate_and_batching_changes_nothing() {
    let server = Server::start(&[]);
    assert_eq!(server.call("GET", "/health", None, None).0, 200);
    let (status, models) = server.call("GET", "/v1/models", None, None);
    assert_eq!(status, 200);
    assert!(models.contains("\"id\":\"gpt-default\""), "{models}");

    let greedy = generate(&[
        "--prompt",
        PROMPT,
        "--max-new-tokens",
        "24",
        "--temperature",
        "0",
    ]);
    let v = server.complete(
        json!({"model": "gpt-default", "prompt": PROMPT, "max_tokens": 24, "temperature": 0}),
    );
    assert_eq!(text(&v), greedy);
    assert_eq!(v["usage"]["completion_tokens"], 24);
    assert_eq!(v["choices"][0]["finish_reason"], "length");

    let seeded = generate(&[
        "--prompt",
        PROMPT,
        "--max-new-tokens",
        "24",
        "--temperature",
        "0.8",
        "--seed",
        "5",
    ]);
    let v =
        server.complete(json!({"prompt": PROMPT, "max_tokens": 24, "temperature": 0.8, "seed": 5}));
    assert_eq!(text(&v), seeded);

    let chat = generate(&[
        "--chat",
        "--prompt",
        PROMPT,
        "--max-new-tokens",
        "24",
        "--temperature",
        "0",
    ]);
    let (status, v) = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 24, "temperature": 0}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], chat.as_str());
    assert_eq!(v["object"], "chat.completion");

    // Streaming: the same text in several events, usage at the end, then [DONE].
    let (status, body) = server.call(
        "POST",
        "/v1/completions",
        Some(
            &json!({"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "stream": true})
                .to_string(),
        ),
        None,
    );
    assert_eq!(status, 200);
    let events: Vec<&str> = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let streamed: String = chunks.iter().map(text).collect();
    assert_eq!(streamed, greedy);
    assert!(chunks.len() > 2);
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 24);

    // A stop string in the middle of the greedy text ends it there.
    let cut = greedy
        .char_indices()
        .nth(greedy.chars().count() / 2)
        .unwrap()
        .0;
    let stop: String = greedy[cut..].chars().take(3).collect();
    let v = server
        .complete(json!({"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "stop": stop}));
    assert_eq!(text(&v), &greedy[..greedy.find(&stop).unwrap()]);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");

    // Eight clients at once, each with its own prompt: each gets what it gets alone.
    let prompts: Vec<String> = (0..8)
        .map(|i| {
            format!(
                "{PROMPT} {}",
                ["I", "the", "a", "my", "O", "what", "no", "good"][i]
            )
        })
        .collect();
    let alone: Vec<String> = prompts
        .iter()
        .map(|p| {
            text(&server.complete(json!({"prompt": p, "max_tokens": 40, "temperature": 0})))
                .to_string()
        })
        .collect();
    let before = server.metric("gpt_step_batch_size_count");
    let together: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| {
                let server = &server;
                s.spawn(move || {
                    text(&server.complete(json!({"prompt": p, "max_tokens": 40, "temperature": 0})))
                        .to_string()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(together, alone);
    let (_, metrics) = server.call("GET", "/metrics", None, None);
    // Steps taken with one sequence are fewer than all steps: some ran batched.
    let single = metrics
        .lines()
        .find_map(|l| {
            l.strip_prefix("gpt_step_batch_size_bucket{le=\"1\"} ")?
                .parse::<f64>()
                .ok()
        })
        .unwrap();
    let steps = server.metric("gpt_step_batch_size_count");
    assert!(
        steps > before && single < steps,
        "no step ran more than one sequence:\n{metrics}"
    );
    assert!(metrics.contains("gpt_requests_total{endpoint=\"completions\",status=\"200\"}"));
}

/// Every mistake is a 4xx in OpenAI's error shape, hostile requests included, and the server
/// keeps serving.
#[test]
fn bad_and_hostile_requests_get_clean_errors() {
    let server = Server::start(&["--header-timeout", "1"]);
    let cases: Vec<(String, u16, &str)> = vec![
        ("{not json".into(), 400, "not valid JSON"),
        ("[1, 2]".into(), 400, "JSON object"),
        (
            r#"{"prompt": "x", "temperature": "hot"}"#.into(),
            400,
            "temperature",
        ),
        (
            r#"{"prompt": "x", "temperature": -0.5}"#.into(),
            400,
            "temperature",
        ),
        (r#"{"prompt": "x", "top_p": 1.5}"#.into(), 400, "top_p"),
        (
            r#"{"prompt": "x", "max_tokens": -3}"#.into(),
            400,
            "max_tokens",
        ),
        (
            r#"{"prompt": "x", "max_tokens": 1e300}"#.into(),
            400,
            "max_tokens",
        ),
        (r#"{"prompt": "x", "n": 3}"#.into(), 400, "`n` must be 1"),
        (
            r#"{"prompt": [5000000]}"#.into(),
            400,
            "outside the vocabulary",
        ),
        (
            r#"{"prompt": "x", "model": "gpt-4"}"#.into(),
            404,
            "does not exist",
        ),
        (
            r#"{"prompt": "x", "max_tokens": 100000}"#.into(),
            400,
            "maximum context length",
        ),
        (
            format!(r#"{{"prompt": "{}"}}"#, "word ".repeat(2000)),
            400,
            "maximum context length",
        ),
        (
            json!({"prompt": "x", "stop": vec!["s"; 10_000]}).to_string(),
            400,
            "stop strings",
        ),
        (r#"{"prompt": "x", "seed": "seven"}"#.into(), 400, "seed"),
        (
            r#"{"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": {"if": {}}}}}"#.into(),
            400,
            "`response_format` cannot be enforced: Unimplemented keys: [\"if\"]",
        ),
        (
            r#"{"prompt": "x", "guided_regex": "(unclosed"}"#.into(),
            400,
            "`guided_regex` cannot be enforced",
        ),
    ];
    for (body, status, needle) in &cases {
        let (got, text) = server.call("POST", "/v1/completions", Some(body), None);
        assert_eq!(got, *status, "{}: {text}", &body[..body.len().min(80)]);
        let v: Value = serde_json::from_str(&text).unwrap();
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(needle), "{needle:?} not in {msg:?}");
        assert!(v["error"]["type"].is_string());
    }
    // Asked for JSON, a client gets JSON: an object of the schema, ending where it closes.
    let schema = json!({"type": "object", "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"], "additionalProperties": false});
    let (status, v) = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 30,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}),
    );
    assert_eq!(status, 200, "{v}");
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    let reply: Value = serde_json::from_str(content).unwrap();
    assert!(
        reply["ok"].is_boolean() && reply.as_object().unwrap().len() == 1,
        "{reply}"
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let (status, v) = server.post("/v1/chat/completions", &json!({"messages": "hello"}));
    assert_eq!(
        (status, v["error"]["param"].as_str()),
        (400, Some("messages"))
    );
    // Not UTF-8, too large, wrong method, no such path.
    let raw = |bytes: &[u8]| -> String {
        let mut s = TcpStream::connect(server.base.trim_start_matches("http://")).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let head = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            bytes.len()
        );
        s.write_all(head.as_bytes()).unwrap();
        let _ = s.write_all(bytes);
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        out
    };
    let reply = raw(b"{\"prompt\": \"\xff\xfe\"}");
    assert!(reply.starts_with("HTTP/1.1 400"), "{reply}");
    let reply = raw(&vec![b' '; 3 << 20]);
    assert!(
        reply.starts_with("HTTP/1.1 413"),
        "{}",
        &reply[..reply.len().min(200)]
    );
    assert_eq!(server.call("GET", "/v1/completions", None, None).0, 405);
    let (status, body) = server.call("GET", "/v2/nothing", None, None);
    assert_eq!(status, 404);
    assert!(body.contains("\"error\""));

    // A client that sends half its headers and stalls is cut off after --header-timeout.
    let start = Instant::now();
    let mut slow = TcpStream::connect(server.base.trim_start_matches("http://")).unwrap();
    slow.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    slow.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    let mut buf = Vec::new();
    let _ = slow.read_to_end(&mut buf);
    assert!(
        start.elapsed() < Duration::from_secs(15),
        "slow client kept for {:?}",
        start.elapsed()
    );
    // Still serving.
    let v = server.complete(json!({"prompt": PROMPT, "max_tokens": 3}));
    assert_eq!(v["usage"]["completion_tokens"], 3);
}

/// Past --max-queue, 429s; the requests that were taken all finish well-formed.
#[test]
fn a_full_queue_answers_429() {
    let server = Server::start(&["--max-batch", "1", "--max-queue", "1"]);
    let statuses: Vec<(u16, Value)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..6)
            .map(|_| {
                let server = &server;
                s.spawn(move || {
                    server.post(
                        "/v1/completions",
                        &json!({"prompt": PROMPT, "max_tokens": 200, "temperature": 0}),
                    )
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let rejected: Vec<&Value> = statuses
        .iter()
        .filter(|(s, _)| *s == 429)
        .map(|(_, v)| v)
        .collect();
    assert!(
        !rejected.is_empty(),
        "no 429 from 6 requests with a queue of 1: {statuses:?}"
    );
    for v in rejected {
        assert_eq!(v["error"]["code"], "queue_full");
    }
    for (s, v) in &statuses {
        assert!(
            *s == 429 || (*s == 200 && v["usage"]["completion_tokens"] == 200),
            "{s} {v}"
        );
    }
    assert_eq!(server.metric("gpt_queue_length"), 0.0);
}

/// With --api-key, /v1 needs `Authorization: Bearer KEY`; /health does not.
#[test]
fn api_key_is_checked() {
    let server = Server::start(&["--api-key", "s3cret"]);
    let body = json!({"prompt": PROMPT, "max_tokens": 2}).to_string();
    assert_eq!(
        server.call("POST", "/v1/completions", Some(&body), None).0,
        401
    );
    assert_eq!(
        server
            .call("POST", "/v1/completions", Some(&body), Some("wrong"))
            .0,
        401
    );
    assert_eq!(server.call("GET", "/v1/models", None, Some("s3cre")).0, 401);
    assert_eq!(
        server
            .call("POST", "/v1/completions", Some(&body), Some("s3cret"))
            .0,
        200
    );
    assert_eq!(server.call("GET", "/health", None, None).0, 200);
}

/// A streaming client that disconnects frees its slot at once (the sequence stops
/// decoding), and SIGTERM lets an in-flight request finish, then exits cleanly.
#[test]
fn disconnects_free_slots_and_sigterm_drains() {
    let mut server = Server::start(&[]);
    let addr = server.base.trim_start_matches("http://").to_string();
    let body =
        json!({"prompt": PROMPT, "max_tokens": 250, "temperature": 0, "stream": true}).to_string();
    let mut s = TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // Read until the first token has arrived: the sequence is then in the running batch.
    let mut seen = Vec::new();
    let mut buf = [0u8; 256];
    while !String::from_utf8_lossy(&seen).contains("\"text\"") {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0 && seen.len() < 1 << 16, "no token arrived");
        seen.extend_from_slice(&buf[..n]);
    }
    drop(s);
    // The generated-token count stops short of the 250 asked for.
    let deadline = Instant::now() + Duration::from_secs(20);
    while server.metric("gpt_batch_size") > 0.0 {
        assert!(Instant::now() < deadline, "the slot was not freed");
        std::thread::sleep(Duration::from_millis(20));
    }
    let generated = server.metric("gpt_generated_tokens_total");
    assert!(
        generated < 250.0,
        "the disconnected sequence ran to the end ({generated} tokens)"
    );

    // SIGTERM while a stream is being read: it still completes, then the process exits 0.
    let mut s = TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("\"text\"") {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0 && seen.len() < 1 << 16, "no token arrived");
        seen.extend_from_slice(&buf[..n]);
    }
    // SAFETY: signalling our own child process.
    unsafe {
        libc::kill(server.child.id() as libc::pid_t, libc::SIGTERM);
    }
    std::thread::sleep(Duration::from_millis(300));
    let deadline = Instant::now() + Duration::from_secs(30);
    while !String::from_utf8_lossy(&seen).contains("data: [DONE]") {
        assert!(Instant::now() < deadline, "the stream did not finish");
        let n = s.read(&mut buf).unwrap();
        assert!(
            n > 0,
            "the stream was cut: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }
    let seen = String::from_utf8_lossy(&seen);
    assert!(seen.contains("\"completion_tokens\":250"), "{seen}");
    let exit = server.terminate(Duration::from_secs(30));
    assert!(exit.success(), "{exit:?}");
}

/// The official `openai` Python client, pinned in tests/openai/requirements.txt and
/// installed into a virtual environment under the target directory on first use.
#[test]
fn the_openai_python_client_works() {
    let Some(python) = openai_python() else {
        return;
    };
    let server = Server::start(&[]);
    let expected = json!({
        "prompt": PROMPT,
        "greedy": generate(&["--prompt", PROMPT, "--max-new-tokens", "24", "--temperature", "0"]),
        "seeded": generate(&["--prompt", PROMPT, "--max-new-tokens", "24", "--temperature", "0.8", "--seed", "5"]),
        "chat": generate(&["--chat", "--system", "Answer briefly.", "--prompt", PROMPT, "--max-new-tokens", "24", "--temperature", "0"]),
    });
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("expected.json");
    std::fs::write(&path, expected.to_string()).unwrap();
    let out = Command::new(&python)
        .arg(openai_dir().join("client_checks.py"))
        .arg(server.url("/v1"))
        .arg(&path)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "openai client checks failed:\n{stdout}\n{stderr}"
    );
    eprintln!("{stdout}");
}

fn openai_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/openai")
}

/// A Python with the pinned `openai` client, or `None` (with the reason printed) when this
/// machine has no Python.
fn openai_python() -> Option<PathBuf> {
    let python = ["python3", "python"].into_iter().find(|p| {
        Command::new(p)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    });
    let Some(python) = python else {
        eprintln!("skipped: no python3 on this machine, so the openai client cannot run");
        return None;
    };
    let venv = Path::new(env!("CARGO_TARGET_TMPDIR")).join("openai-venv");
    let bin = venv.join("bin/python");
    let requirements = openai_dir().join("requirements.txt");
    let stamp = venv.join("requirements.txt");
    let wanted = std::fs::read_to_string(&requirements).unwrap();
    if std::fs::read_to_string(&stamp).ok().as_deref() != Some(wanted.as_str()) {
        let run = |cmd: &mut Command| {
            let out = cmd.output().unwrap();
            assert!(
                out.status.success(),
                "{cmd:?} failed:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        let _ = std::fs::remove_dir_all(&venv);
        run(Command::new(python).args(["-m", "venv"]).arg(&venv));
        run(Command::new(&bin)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "-r",
            ])
            .arg(&requirements));
        std::fs::write(&stamp, wanted).unwrap();
    }
    Some(bin)
}

/// `/tokenize` and `/detokenize` in llama-server's shapes: ids as the `tokenizers` crate
/// gives them for the built-in tokenizer.json, pieces that make up the text, mixed content
/// (text and ids), ids back to text, and bad fields as 400s naming them.
#[test]
fn tokenize_and_detokenize_endpoints() {
    let server = Server::start(&[]);
    let text = "ROMEO: But soft!  — 🦙";
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/default/tokenizer.json");
    let reference = tokenizers::Tokenizer::from_file(path).unwrap();
    let want: Vec<u32> = reference.encode(text, false).unwrap().get_ids().to_vec();
    let (status, v) = server.post("/tokenize", &json!({"content": text}));
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["tokens"], json!(want));
    let (_, v) = server.post("/tokenize", &json!({"content": text, "with_pieces": true}));
    let mut bytes = Vec::new();
    for t in v["tokens"].as_array().unwrap() {
        match &t["piece"] {
            Value::String(s) => bytes.extend(s.as_bytes()),
            p => bytes.extend(serde_json::from_value::<Vec<u8>>(p.clone()).unwrap()),
        }
    }
    assert_eq!(String::from_utf8(bytes).unwrap(), text);
    let (_, v) = server.post("/tokenize", &json!({"content": ["ROMEO:", 7, " hi"]}));
    let mut mixed = reference
        .encode("ROMEO:", false)
        .unwrap()
        .get_ids()
        .to_vec();
    mixed.push(7);
    mixed.extend(reference.encode(" hi", false).unwrap().get_ids());
    assert_eq!(v["tokens"], json!(mixed));
    let (status, v) = server.post("/detokenize", &json!({"tokens": want}));
    assert_eq!((status, v["content"].as_str()), (200, Some(text)));
    for (path, body, param) in [
        ("/tokenize", r#"{"content": 5}"#, "content"),
        ("/tokenize", r#"{"content": ["a", 99999999]}"#, "content"),
        (
            "/tokenize",
            r#"{"content": "a", "with_pieces": "yes"}"#,
            "with_pieces",
        ),
        ("/detokenize", r#"{"tokens": [-1]}"#, "tokens"),
        ("/detokenize", r#"{"tokens": [1, 1e400]}"#, "tokens"),
    ] {
        let (status, text) = server.call("POST", path, Some(body), None);
        assert_eq!(status, 400, "{path} {body}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["param"], param, "{path} {body}: {text}");
    }
}

/// A 10-turn chat replayed turn by turn: each turn's request holds the whole history, so
/// from the second turn on the prompt begins as the previous turn's sequence did. The
/// replies (greedy and seeded turns) are the same with the prompt cache as without it, and
/// with it most of each later prompt comes from the cache (`usage.prompt_tokens_details`
/// and `/metrics` say how much).
#[test]
fn a_chat_replayed_with_the_prompt_cache_gets_the_same_replies() {
    const TOPICS: [&str; 10] = [
        "the king",
        "the sea",
        "love",
        "the night",
        "war",
        "a ring",
        "the moon",
        "honour",
        "a letter",
        "the crown",
    ];
    let chat = |server: &Server| -> Vec<(String, u64, u64)> {
        let mut messages = vec![json!({"role": "system", "content": "Answer as the Prince."})];
        let mut turns = Vec::new();
        for (turn, topic) in TOPICS.iter().enumerate() {
            messages.push(json!({"role": "user", "content": format!("Speak of {topic}.")}));
            let temperature = if turn % 2 == 0 { 0.0 } else { 0.8 };
            let body = json!({"messages": messages, "max_tokens": 5,
                "temperature": temperature, "seed": turn});
            let (status, v) = server.post("/v1/chat/completions", &body);
            assert_eq!(status, 200, "{v}");
            let reply = v["choices"][0]["message"]["content"].as_str().unwrap();
            messages.push(json!({"role": "assistant", "content": reply}));
            let usage = &v["usage"];
            let cached = usage["prompt_tokens_details"]["cached_tokens"].as_u64();
            let prompt = usage["prompt_tokens"].as_u64().unwrap();
            turns.push((reply.to_string(), prompt, cached.unwrap()));
        }
        turns
    };
    let cached_server = Server::start(&[]);
    let with = chat(&cached_server);
    let without = chat(&Server::start(&["--cache-mem", "0"]));
    let replies = |t: &[(String, u64, u64)]| t.iter().map(|x| x.0.clone()).collect::<Vec<_>>();
    assert_eq!(replies(&with), replies(&without));
    assert!(without.iter().all(|t| t.2 == 0), "{without:?}");
    assert_eq!(with[0].2, 0);
    for (prompt_tokens, cached) in with[1..].iter().map(|t| (t.1, t.2)) {
        assert!(
            cached < prompt_tokens && 2 * cached >= prompt_tokens,
            "{with:?}"
        );
    }
    let hits: u64 = with.iter().map(|t| t.2).sum();
    assert_eq!(
        cached_server.metric("gpt_prompt_cache_hit_tokens_total"),
        hits as f64
    );
    assert!(cached_server.metric("gpt_prompt_cache_bytes") > 0.0);
    cached_server.assert_no_internal_errors();
}

/// A stream of distinct prompts into a prompt cache of 1 MiB (about 50 positions of the
/// built-in model): what it holds never passes its budget, and it keeps serving.
#[test]
fn the_prompt_cache_stays_within_its_budget() {
    let server = Server::start(&["--cache-mem", "1"]);
    for i in 0..24 {
        let prompt = format!("{i} {} and {}", "ROMEO ".repeat(i % 5 + 4), i * 7919);
        let v = server.complete(json!({"prompt": prompt, "max_tokens": 4, "temperature": 0}));
        assert_eq!(v["usage"]["completion_tokens"], 4);
        let bytes = server.metric("gpt_prompt_cache_bytes");
        assert!(bytes > 0.0 && bytes <= (1 << 20) as f64, "{bytes}");
    }
    server.assert_no_internal_errors();
}

/// Twelve clients at once, each with its own question after one long shared system prompt:
/// the prompt is computed once (the first of them prefills it, the others restore it), and
/// every reply equals the same request to a server without the prompt cache.
#[test]
fn clients_sharing_a_system_prompt_compute_it_once() {
    let system = "You are the Chorus. Speak of the house of York and of Lancaster, of crowns \
                  and of fields, of the night before the battle and of the morning after it.";
    let ask = |server: &Server| -> Vec<(String, u64)> {
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..12)
                .map(|i| {
                    s.spawn(move || {
                        let body = json!({"messages": [
                            {"role": "system", "content": system},
                            {"role": "user", "content": format!("Question {i}: who is king?")}],
                            "max_tokens": 6, "temperature": 0.7, "seed": i});
                        let (status, v) = server.post("/v1/chat/completions", &body);
                        assert_eq!(status, 200, "{v}");
                        let cached = &v["usage"]["prompt_tokens_details"]["cached_tokens"];
                        let reply = v["choices"][0]["message"]["content"].as_str().unwrap();
                        (reply.to_string(), cached.as_u64().unwrap())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    };
    let server = Server::start(&["--max-batch", "16"]);
    let with = ask(&server);
    let without = ask(&Server::start(&["--cache-mem", "0"]));
    let replies = |r: &[(String, u64)]| r.iter().map(|x| x.0.clone()).collect::<Vec<_>>();
    assert_eq!(replies(&with), replies(&without));
    // However the twelve arrived, at most one prefilled the system prompt per admission,
    // and at least the last eleven (or all twelve) found it.
    let hits = with.iter().filter(|r| r.1 >= 30).count();
    assert!(hits >= 11, "{with:?}");
    server.assert_no_internal_errors();
}

/// The built-in model's weights and tokenizer with a longer context and Qwen 2.5's chat
/// template, which describes tools and asks for `<tool_call>` blocks.
fn tool_model(dir: &Path) -> String {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/default");
    for f in ["model.safetensors", "tokenizer.json"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    config["max_position_embeddings"] = json!(1024);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let template = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/chat/templates/Qwen-Qwen2.5-7B-Instruct.jinja"),
    )
    .unwrap();
    let tc = json!({"chat_template": template, "eos_token": "<|im_end|>"});
    std::fs::write(dir.join("tokenizer_config.json"), tc.to_string()).unwrap();
    dir.to_str().unwrap().to_string()
}

/// Tool calls round-trip on a model whose template has tools: `tool_choice: required` (and
/// a named function) always yields a call whose arguments follow the function's schema,
/// whole and streamed; the call and its result go back as history (`tool_calls` with
/// arguments as JSON text, a `role: tool` message) and the model answers; bad tool fields
/// are 400s naming them.
#[test]
fn tool_calls_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&["--model", &tool_model(dir.path())]);
    let weather = json!({"type": "function", "function": {"name": "weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12},
            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"], "additionalProperties": false}}});
    let time = json!({"type": "function", "function": {"name": "time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["CET", "UTC"]}},
            "required": ["zone"], "additionalProperties": false}}});
    let question = json!({"role": "user", "content": "What is the weather in Verona?"});
    let check_call = |call: &Value, want: Option<&str>| -> Value {
        let name = call["function"]["name"].as_str().unwrap();
        let args: Value =
            serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
        assert!(want.is_none_or(|w| w == name), "{call}");
        match name {
            "weather" => {
                assert!(
                    args["city"].as_str().unwrap().chars().count() <= 12,
                    "{args}"
                );
                assert!((1..=7).contains(&args["days"].as_i64().unwrap()), "{args}");
                assert_eq!(args.as_object().unwrap().len(), 2);
            }
            "time" => assert!(["CET", "UTC"].contains(&args["zone"].as_str().unwrap())),
            other => panic!("called {other}"),
        }
        assert_eq!(call["type"], "function");
        args
    };
    for seed in 0..6 {
        let choice = if seed % 2 == 0 {
            json!("required")
        } else {
            json!({"type": "function", "function": {"name": "time"}})
        };
        let want = (seed % 2 == 1).then_some("time");
        let body = json!({"messages": [question], "tools": [weather, time], "tool_choice": choice,
            "parallel_tool_calls": false, "max_tokens": 150, "temperature": 1.0, "seed": seed});
        let (status, v) = server.post("/v1/chat/completions", &body);
        assert_eq!(status, 200, "{v}");
        let choice = &v["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
        let calls = choice["message"]["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 1, "{v}");
        check_call(&calls[0], want);
        assert!(choice["message"]["content"].is_null(), "{v}");
    }
    // Streamed: the same call, in the last delta.
    let body = json!({"messages": [question], "tools": [weather], "tool_choice": "required",
        "parallel_tool_calls": false, "max_tokens": 150, "seed": 9, "stream": true});
    let (status, text) = server.call(
        "POST",
        "/v1/chat/completions",
        Some(&body.to_string()),
        None,
    );
    assert_eq!(status, 200);
    let chunks: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|l| *l != "[DONE]")
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let last = &chunks.last().unwrap()["choices"][0];
    assert_eq!(last["finish_reason"], "tool_calls");
    let call = &last["delta"]["tool_calls"][0];
    assert_eq!(call["index"], 0);
    let args = check_call(call, Some("weather"));
    let (_, whole) = server.post(
        "/v1/chat/completions",
        &json!({"messages": [question], "tools": [weather], "tool_choice": "required",
            "parallel_tool_calls": false, "max_tokens": 150, "seed": 9}),
    );
    assert_eq!(
        whole["choices"][0]["message"]["tool_calls"][0]["function"],
        call["function"]
    );
    // The call and its result go back; the model answers in text.
    let id = call["id"].as_str().unwrap();
    let history = json!([question,
        {"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function",
            "function": {"name": "weather", "arguments": args.to_string()}}]},
        {"role": "tool", "tool_call_id": id, "content": "{\"sky\": \"clear\", \"high\": 21}"}]);
    let (status, v) = server.post(
        "/v1/chat/completions",
        &json!({"messages": history, "tools": [weather], "tool_choice": "none", "max_tokens": 12,
            "temperature": 0}),
    );
    assert_eq!(status, 200, "{v}");
    assert!(v["choices"][0]["message"]["content"].is_string(), "{v}");
    assert!(
        v["choices"][0]["message"].get("tool_calls").is_none(),
        "{v}"
    );
    // The tool result is in the prompt: more tokens than the question alone.
    let (_, alone) = server.post(
        "/v1/chat/completions",
        &json!({"messages": [question], "tools": [weather], "tool_choice": "none", "max_tokens": 1}),
    );
    assert!(v["usage"]["prompt_tokens"].as_u64() > alone["usage"]["prompt_tokens"].as_u64());
    for (body, param) in [
        (
            json!({"messages": [question], "tools": [{"type": "function"}]}),
            "tools",
        ),
        (
            json!({"messages": [question], "tools": [weather], "tool_choice": "sometimes"}),
            "tool_choice",
        ),
        (
            json!({"messages": [question], "tools": [weather],
            "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            "tool_choice",
        ),
        (
            json!({"messages": [question], "tools": [weather, weather]}),
            "tools",
        ),
        (
            json!({"messages": [question], "tool_choice": "required"}),
            "tool_choice",
        ),
        (
            json!({"messages": [question, {"role": "assistant", "tool_calls": [{"type": "function",
            "function": {"name": "weather", "arguments": "{not json"}}]}]}),
            "messages",
        ),
        (
            json!({"messages": [question], "tools": [weather], "tool_choice": "required",
            "response_format": {"type": "json_object"}}),
            "tool_choice",
        ),
        (
            json!({"messages": [question], "tools": vec![weather.clone(); 600]}),
            "tools",
        ),
    ] {
        let (status, v) = server.post("/v1/chat/completions", &body);
        assert_eq!(
            (status, v["error"]["param"].as_str()),
            (400, Some(param)),
            "{v}"
        );
    }
    // The built-in model's plain format takes no tools.
    let plain = Server::start(&[]);
    let (status, v) = plain.post(
        "/v1/chat/completions",
        &json!({"messages": [question], "tools": [weather]}),
    );
    assert_eq!(
        (status, v["error"]["param"].as_str()),
        (400, Some("tools")),
        "{v}"
    );
    server.assert_no_internal_errors();
}
