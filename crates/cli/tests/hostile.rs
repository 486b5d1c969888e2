//! `gpt serve` against hostile clients: resets mid-body and mid-stream, disconnect storms,
//! floods of idle and half-open connections, extreme numbers in every numeric field, bad
//! requests beside good ones, departures from the queue, SIGTERM under slow clients, a soak
//! with random disconnects. After each: the process lives, `/health` and a completion
//! answer, nothing is left queued or running, and nothing internal failed.
//!
//! Every server listens on 127.0.0.1 with a port the OS picks; every client loop is
//! bounded in count, and every read and wait in time.

mod server;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Barrier, OnceLock};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use server::Server;

const PROMPT: &str = "ROMEO:";

fn connect(addr: &str) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(30))).unwrap();
    s
}

/// Closes with a reset (`SO_LINGER` 0), as a client that crashed or was killed does.
fn reset(s: TcpStream) {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: setsockopt on a socket we own, with a value of the size it names.
    let rc = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0, "setsockopt SO_LINGER");
    drop(s);
}

/// A request's head (`Content-Length` given, or none when `len` is `None`).
fn head(path: &str, len: Option<usize>, extra: &str) -> String {
    let len = len.map_or(String::new(), |n| format!("Content-Length: {n}\r\n"));
    format!("POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{len}{extra}\r\n")
}

/// Sends a streaming request and reads until `chunks` chunks of generated text arrived.
fn stream_until(addr: &str, body: &Value, chunks: usize) -> TcpStream {
    stream_seen(addr, body, chunks).0
}

/// [`stream_until`], with what was read so far (a short reply may arrive whole in it).
fn stream_seen(addr: &str, body: &Value, chunks: usize) -> (TcpStream, String) {
    let body = body.to_string();
    let mut s = connect(addr);
    s.write_all(head("/v1/completions", Some(body.len()), "").as_bytes())
        .unwrap();
    s.write_all(body.as_bytes()).unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while String::from_utf8_lossy(&seen).matches("\"text\"").count() < chunks {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0 && seen.len() < 1 << 20, "the stream ended early");
        seen.extend_from_slice(&buf[..n]);
    }
    (s, String::from_utf8_lossy(&seen).into_owned())
}

/// Everything the server sends until it closes the connection (or 30 s pass).
fn read_all(s: &mut TcpStream) -> String {
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

fn greedy(server: &Server, prompt: &str, n: usize) -> String {
    let v = server.complete(json!({"prompt": prompt, "max_tokens": n, "temperature": 0}));
    v["choices"][0]["text"].as_str().unwrap().to_string()
}

/// A random-weight model that decodes slowly enough (a width of 512 and 2,048 positions:
/// ~700 tokens/s on 2 threads) for a request to hold its batch slot for seconds. Made once
/// per build by `gpt train` (one step) under the target directory.
fn slow_model() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("hostile-slow-model");
        if dir.join("model.safetensors").exists() {
            return dir;
        }
        let data = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("hostile-slow-model.txt");
        std::fs::write(
            &data,
            "ROMEO: what light through yonder window breaks?\n".repeat(2000),
        )
        .unwrap();
        let tokenizer =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/default/tokenizer.json");
        let out = Command::new(env!("CARGO_BIN_EXE_gpt"))
            .args([
                "--threads",
                "2",
                "train",
                "--arch",
                "llama",
                "--n-layer",
                "4",
            ])
            .args(["--n-embd", "512", "--n-head", "8", "--block-size", "2048"])
            .args(["--steps", "1", "--batch-size", "1", "--quiet", "--data"])
            .arg(&data)
            .arg("--tokenizer")
            .arg(&tokenizer)
            .arg("--out")
            .arg(&dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        dir
    })
    .clone()
}

/// Resets in the middle of a body, of the headers, and of a stream; requests abandoned
/// before their answer; a storm of concurrent streaming clients vanishing at random points.
/// The server lives on, and its answers and memory are what they were.
#[test]
fn resets_and_disconnect_storms_never_end_the_server() {
    // The prompt cache keeps what departed requests computed, up to its budget: a small one
    // here, counted in the allowance below.
    let mut server = Server::start(&["--cache-mem", "4"]);
    let addr = server.addr();
    let before = greedy(&server, PROMPT, 12);
    // Warm: the allocator's arenas and the HTTP side's buffers at their working size.
    for _ in 0..20 {
        greedy(&server, PROMPT, 12);
    }
    let rss_before = server.rss_kib();

    for round in 0..30 {
        // The case that ended the process: a declared body cut short, then a reset.
        let mut s = connect(&addr);
        s.write_all(head("/v1/completions", Some(100), "").as_bytes())
            .unwrap();
        s.write_all(b"{\"prompt\":1").unwrap();
        if round % 2 == 1 {
            std::thread::sleep(Duration::from_millis(5)); // the 400 is on its way back
        }
        reset(s);
        // Half a request line, then a reset.
        let mut s = connect(&addr);
        s.write_all(b"POST /v1/compl").unwrap();
        reset(s);
    }
    for chunks in 1..=10 {
        let body = json!({"prompt": PROMPT, "max_tokens": 200, "stream": true});
        reset(stream_until(&addr, &body, chunks));
    }
    // Whole requests abandoned before their answer: closed, and reset.
    for i in 0..20 {
        let body = json!({"prompt": PROMPT, "max_tokens": 200}).to_string();
        let mut s = connect(&addr);
        s.write_all(head("/v1/completions", Some(body.len()), "").as_bytes())
            .unwrap();
        s.write_all(body.as_bytes()).unwrap();
        match i % 2 {
            0 => drop(s),
            _ => reset(s),
        }
    }
    server.assert_alive();

    // The storm: 64 streaming clients at once, each leaving after its own number of chunks,
    // half with a reset and half with a close; a few never read at all.
    let barrier = Arc::new(Barrier::new(64));
    let storm: Vec<_> = (0..64)
        .map(|i| {
            let (addr, barrier) = (addr.clone(), barrier.clone());
            std::thread::spawn(move || {
                let body = json!({"prompt": PROMPT, "max_tokens": 120, "stream": true, "seed": i});
                barrier.wait();
                let s = match i % 8 {
                    0 => {
                        let body = body.to_string();
                        let mut s = connect(&addr);
                        s.write_all(head("/v1/completions", Some(body.len()), "").as_bytes())
                            .unwrap();
                        s.write_all(body.as_bytes()).unwrap();
                        s
                    }
                    _ => stream_until(&addr, &body, 1 + i % 7),
                };
                match i % 2 {
                    0 => reset(s),
                    _ => drop(s),
                }
            })
        })
        .collect();
    for t in storm {
        t.join().unwrap();
    }
    server.settle();
    assert_eq!(greedy(&server, PROMPT, 12), before);
    // Near its level before: what a leak of the departed requests' caches or buffers would
    // add is far more (each stream held up to 120 tokens of 8 layers' keys and values).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let rss_after = server.rss_kib();
        if rss_after <= rss_before + rss_before / 5 + (8 + 4) * 1024 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "RSS grew from {rss_before} to {rss_after} KiB"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // The storm's connections close (the one asking for /metrics stays).
    while server.metric("gpt_open_connections") > 1.0 {
        assert!(Instant::now() < deadline, "connections left open");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Idle connections, half-sent headers, half-sent bodies and clients that shut down their
/// side, together far past --max-connections: a normal client is still served at once
/// (the oldest idle connections make room), and so is a streaming one.
#[test]
fn floods_of_idle_and_half_open_connections_do_not_lock_out_a_client() {
    let mut server = Server::start(&["--max-connections", "16", "--header-timeout", "60"]);
    let addr = server.addr();
    let before = greedy(&server, PROMPT, 8);
    let mut flood = Vec::new();
    for i in 0..80 {
        let mut s = connect(&addr);
        match i % 4 {
            0 => {}
            1 => s
                .write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                .unwrap(),
            2 => {
                s.write_all(head("/v1/completions", Some(1000), "").as_bytes())
                    .unwrap();
                s.write_all(b"{\"prompt\": ").unwrap();
            }
            _ => s.shutdown(Shutdown::Write).unwrap(),
        }
        flood.push(s);
    }
    // Each of these opens a connection of its own while the flood holds every place.
    for _ in 0..5 {
        assert_eq!(greedy(&server, PROMPT, 8), before);
    }
    let body = json!({"prompt": PROMPT, "max_tokens": 8, "stream": true, "temperature": 0});
    // The whole reply may come in the first read: what was seen counts too.
    let (mut s, seen) = stream_seen(&addr, &body, 1);
    let all = seen + &read_all(&mut s);
    assert!(all.contains("data: [DONE]"), "{all}");
    assert!(server.metric("gpt_open_connections") <= 16.0);
    drop(flood);
    server.settle();
}

/// Every numeric field, on both endpoints, with numbers at and past the edges of f64, f32,
/// i64 and u64, and with values of the wrong type: a 200, or a 400 naming that field;
/// never a 5xx. The ones the sampler cannot use are 400s.
#[test]
fn extreme_numbers_are_400s_naming_their_field() {
    let mut server = Server::start(&[]);
    let values = [
        "1e300",
        "-1e300",
        "1e-50",
        "5e-324",
        "-0.0",
        "0",
        "-1",
        "1.5",
        "1e400",
        "-1e400",
        "3.5e38",
        "1e-45",
        "9223372036854775807",
        "9223372036854775808",
        "18446744073709551615",
        "18446744073709551616",
        "-9223372036854775809",
        "true",
        "\"1\"",
        "[1]",
        "{}",
    ];
    let completions = [
        "temperature",
        "top_p",
        "top_k",
        "repetition_penalty",
        "seed",
        "max_tokens",
        "n",
        "best_of",
        "logprobs",
        "frequency_penalty",
        "presence_penalty",
        "stream_options",
        "prompt",
    ];
    let chat = [
        "temperature",
        "top_p",
        "repetition_penalty",
        "max_tokens",
        "max_completion_tokens",
        "top_logprobs",
        "logprobs",
        "n",
    ];
    let mut cases = Vec::new();
    for value in values {
        for field in completions {
            let (max, rest) = match field {
                "max_tokens" => (value.to_string(), String::new()),
                "stream_options" => (
                    "2".into(),
                    format!(r#", "stream": true, "stream_options": {{"include_usage": {value}}}"#),
                ),
                "prompt" => ("2".into(), String::new()),
                _ => ("2".into(), format!(r#", "{field}": {value}"#)),
            };
            let prompt = match field {
                "prompt" => format!("[1, {value}]"),
                _ => "\"ROMEO:\"".into(),
            };
            cases.push((
                "/v1/completions",
                field,
                value,
                format!(r#"{{"prompt": {prompt}, "max_tokens": {max}{rest}}}"#),
            ));
        }
        for field in chat {
            let extra = match field {
                "top_logprobs" => format!(r#", "logprobs": true, "top_logprobs": {value}"#),
                "max_tokens" | "max_completion_tokens" => format!(r#", "{field}": {value}"#),
                _ => format!(r#", "max_tokens": 2, "{field}": {value}"#),
            };
            cases.push((
                "/v1/chat/completions",
                field,
                value,
                format!(r#"{{"messages": [{{"role": "user", "content": "hi"}}]{extra}}}"#),
            ));
        }
    }
    // The sampler multiplies by the penalty as an f32: these must not reach it.
    let must_refuse = [
        ("repetition_penalty", "1e300"),
        ("repetition_penalty", "1e-50"),
        ("repetition_penalty", "5e-324"),
        ("repetition_penalty", "3.5e38"),
        ("repetition_penalty", "1e400"),
        ("repetition_penalty", "0"),
        ("repetition_penalty", "-0.0"),
        ("temperature", "-1e300"),
        ("temperature", "1e400"),
        ("max_tokens", "18446744073709551616"),
        ("max_tokens", "18446744073709551615"),
        ("seed", "1e400"),
        ("prompt", "18446744073709551616"),
        ("top_k", "-9223372036854775809"),
    ];
    let mut refused = 0;
    for (path, field, value, body) in &cases {
        let (status, text) = server.call("POST", path, Some(body), None);
        match status {
            200 => {
                let v: Value = serde_json::from_str(text.lines().next().unwrap_or(""))
                    .or_else(|_| serde_json::from_str(&text))
                    .unwrap_or(Value::Null);
                assert!(
                    !must_refuse.contains(&(field, value)),
                    "{path} {field}={value} was accepted: {body}"
                );
                assert!(v.is_object() || text.starts_with("data: "), "{text}");
            }
            400 => {
                refused += 1;
                let v: Value = serde_json::from_str(&text).unwrap();
                // A nested field is named by its path (`stream_options.include_usage`).
                let param = v["error"]["param"].as_str().unwrap_or("");
                assert!(
                    param == *field || param.starts_with(&format!("{field}.")),
                    "{path} {body}: {text}"
                );
            }
            _ => panic!("{path} {body}: {status} {text}"),
        }
    }
    assert!(refused > cases.len() / 3, "only {refused} refused");
    server.settle();
}

/// Bad requests sent at the same moment as good ones: each bad one is a 400 for its own
/// client, naming its field, and every good one gets exactly the answer it gets alone.
#[test]
fn a_bad_request_does_not_fail_its_neighbours() {
    let mut server = Server::start(&[]);
    let prompts = [
        "ROMEO:",
        "JULIET:",
        "Good morrow",
        "What",
        "O",
        "My lord",
        "Come",
        "Ay",
    ];
    let alone: Vec<String> = prompts.iter().map(|p| greedy(&server, p, 10)).collect();
    let bad = [
        ("repetition_penalty", json!(1e300)),
        ("repetition_penalty", json!(1e-50)),
        ("repetition_penalty", json!(5e-324)),
        ("temperature", json!(-1)),
        ("top_p", json!(2)),
        ("top_k", json!(-5)),
        ("logprobs", json!(99)),
        ("max_tokens", json!(100_000)),
    ];
    for round in 0..4 {
        let barrier = Arc::new(Barrier::new(prompts.len() + bad.len()));
        let mut threads = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            let (url, barrier, p) = (server.url("/v1/completions"), barrier.clone(), *p);
            threads.push(std::thread::spawn(move || {
                let body = json!({"prompt": p, "max_tokens": 10, "temperature": 0, "repetition_penalty": 1.0});
                barrier.wait();
                let r = ureq::post(&url)
                    .timeout(Duration::from_secs(60))
                    .send_json(body)
                    .unwrap();
                let v: Value = r.into_json().unwrap();
                (i, None, v["choices"][0]["text"].as_str().unwrap().to_string())
            }));
        }
        for (field, value) in bad.iter().cloned() {
            let (url, barrier) = (server.url("/v1/completions"), barrier.clone());
            threads.push(std::thread::spawn(move || {
                let mut body = json!({"prompt": "ROMEO:", "max_tokens": 10});
                body[field] = value;
                barrier.wait();
                match ureq::post(&url)
                    .timeout(Duration::from_secs(60))
                    .send_json(body)
                {
                    Err(ureq::Error::Status(400, r)) => {
                        let v: Value = r.into_json().unwrap();
                        let param = v["error"]["param"].as_str().unwrap_or("").to_string();
                        (usize::MAX, Some(field), param)
                    }
                    other => panic!("{field}: {other:?}"),
                }
            }));
        }
        for t in threads {
            match t.join().unwrap() {
                (i, None, text) => assert_eq!(text, alone[i], "round {round}, {}", prompts[i]),
                (_, Some(field), param) => assert_eq!(param, field),
            }
        }
    }
    server.settle();
}

/// With the batch held by a long generation, requests that wait in the queue and then
/// leave give their places back at once: the gauge drops to zero, the next requests are
/// queued instead of refused, and nothing they held stays open.
#[test]
fn departed_clients_give_their_queue_places_back() {
    let model = slow_model();
    let mut server = Server::start(&[
        "--model",
        model.to_str().unwrap(),
        "--max-batch",
        "1",
        "--max-queue",
        "8",
    ]);
    let addr = server.addr();
    let long = json!({"prompt": PROMPT, "max_tokens": 2000, "stream": true, "temperature": 0});
    let holder = stream_until(&addr, &long, 1);
    let wait = |server: &Server, name: &str, want: f64| {
        let deadline = Instant::now() + Duration::from_secs(10);
        while server.metric(name) != want {
            assert!(
                Instant::now() < deadline,
                "{name} stayed {} (want {want})",
                server.metric(name)
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    for round in 0..2 {
        let body = json!({"prompt": PROMPT, "max_tokens": 4, "stream": round == 0}).to_string();
        let waiting: Vec<TcpStream> = (0..8)
            .map(|_| {
                let mut s = connect(&addr);
                s.write_all(head("/v1/completions", Some(body.len()), "").as_bytes())
                    .unwrap();
                s.write_all(body.as_bytes()).unwrap();
                s
            })
            .collect();
        wait(&server, "gpt_queue_length", 8.0);
        let (status, _) = server.call("POST", "/v1/completions", Some(&body), None);
        assert_eq!(status, 429, "the queue should be full");
        for (i, s) in waiting.into_iter().enumerate() {
            match i % 2 {
                0 => reset(s),
                _ => drop(s),
            }
        }
        wait(&server, "gpt_queue_length", 0.0);
        // The holder's connection and the one asking for /metrics.
        wait(&server, "gpt_open_connections", 2.0);
    }
    // Places free again: these are queued, not refused, and answered once the batch frees.
    let body = json!({"prompt": PROMPT, "max_tokens": 3});
    let queued: Vec<_> = (0..8)
        .map(|_| {
            let url = server.url("/v1/completions");
            let body = body.clone();
            std::thread::spawn(move || {
                ureq::post(&url)
                    .timeout(Duration::from_secs(120))
                    .send_json(body)
                    .map(|r| r.status())
                    .map_err(|e| e.to_string())
            })
        })
        .collect();
    wait(&server, "gpt_queue_length", 8.0);
    // The same load under vLLM's names, as an inference gateway reads it.
    let (_, text) = server.call("GET", "/metrics", None, None);
    let gauge = |name: &str| -> f64 {
        text.lines()
            .find(|l| l.starts_with(&format!("{name}{{model_name=")))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("{name} not in /metrics:\n{text}"))
    };
    assert_eq!(gauge("vllm:num_requests_waiting"), 8.0);
    assert_eq!(gauge("vllm:num_requests_running"), 1.0);
    let usage = gauge("vllm:kv_cache_usage_perc");
    assert!(usage > 0.0 && usage <= 1.0, "{usage}");
    assert_eq!(
        server.metric("gpt_batch_size"),
        1.0,
        "the long generation ended before the checks did; they checked nothing"
    );
    reset(holder);
    for t in queued {
        assert_eq!(t.join().unwrap(), Ok(200));
    }
    server.settle();
}

/// SIGTERM with slow clients of every kind holding connections and a long generation
/// running: the process exits with status 0 within --shutdown-grace + 1 s.
#[test]
fn sigterm_under_slow_clients_exits_within_the_grace_period() {
    let model = slow_model();
    let mut server = Server::start(&[
        "--model",
        model.to_str().unwrap(),
        "--shutdown-grace",
        "2",
        "--header-timeout",
        "60",
    ]);
    let addr = server.addr();
    let mut slow = Vec::new();
    for i in 0..30 {
        let mut s = connect(&addr);
        match i % 3 {
            0 => s
                .write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                .unwrap(),
            1 => {
                s.write_all(head("/v1/completions", Some(500), "").as_bytes())
                    .unwrap();
                s.write_all(b"{\"prompt\": \"RO").unwrap();
            }
            _ => {}
        }
        slow.push(s);
    }
    // A stream that is read, one that is never read after its first token, and a whole
    // request: each would run for seconds past the grace period.
    let long = json!({"prompt": PROMPT, "max_tokens": 2000, "stream": true, "temperature": 0});
    let mut read = stream_until(&addr, &long, 1);
    slow.push(stream_until(&addr, &long, 1));
    // Greedy, as the streams: a sampled continuation may draw the end token early and
    // finish inside the grace period.
    let whole = json!({"prompt": PROMPT, "max_tokens": 2000, "temperature": 0}).to_string();
    let mut w = connect(&addr);
    w.write_all(head("/v1/completions", Some(whole.len()), "").as_bytes())
        .unwrap();
    w.write_all(whole.as_bytes()).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let start = Instant::now();
    let status = server.terminate(Duration::from_secs(10));
    let took = start.elapsed();
    eprintln!("exit {took:?} after SIGTERM (grace 2 s)");
    assert!(status.success(), "{status:?}");
    assert!(
        took <= Duration::from_secs(3),
        "the server took {took:?} to exit with a grace of 2 s"
    );
    // The cut generations were told, not left hanging.
    let rest = read_all(&mut read);
    assert!(
        rest.contains("shut down"),
        "{}",
        &rest[rest.len().saturating_sub(300)..]
    );
    let reply = read_all(&mut w);
    assert!(reply.starts_with("HTTP/1.1 503"), "{reply}");
    server.assert_no_internal_errors();
}

/// A declared body over the limit is refused before it is sent (no `100 Continue`); one
/// sent chunked past it is a 413; broken framing, or a body cut short, a 400.
#[test]
fn oversized_and_malformed_bodies_are_refused_up_front() {
    let mut server = Server::start(&[]);
    let addr = server.addr();
    for expect in ["Expect: 100-continue\r\n", ""] {
        let mut s = connect(&addr);
        s.write_all(head("/v1/completions", Some(2 << 20), expect).as_bytes())
            .unwrap();
        let reply = read_all(&mut s);
        assert!(reply.starts_with("HTTP/1.1 413"), "{reply}");
        assert!(!reply.contains("100 Continue"), "{reply}");
    }
    let chunked = "Transfer-Encoding: chunked\r\n";
    let mut s = connect(&addr);
    s.write_all(head("/v1/completions", None, chunked).as_bytes())
        .unwrap();
    s.write_all(b"zz\r\nnot a chunk\r\n").unwrap();
    let reply = read_all(&mut s);
    assert!(reply.starts_with("HTTP/1.1 400"), "{reply}");
    let mut s = connect(&addr);
    s.write_all(head("/v1/completions", None, chunked).as_bytes())
        .unwrap();
    let chunk = vec![b' '; 64 << 10];
    let mut reply = String::new();
    for _ in 0..32 {
        let sent = s
            .write_all(format!("{:x}\r\n", chunk.len()).as_bytes())
            .and_then(|_| s.write_all(&chunk))
            .and_then(|_| s.write_all(b"\r\n"));
        if sent.is_err() {
            break; // the server answered and closed
        }
    }
    let _ = s.shutdown(Shutdown::Write);
    reply.push_str(&read_all(&mut s));
    assert!(reply.starts_with("HTTP/1.1 413"), "{reply}");
    let mut s = connect(&addr);
    s.write_all(head("/v1/completions", Some(100), "").as_bytes())
        .unwrap();
    s.write_all(b"{\"prompt\": 1").unwrap();
    s.shutdown(Shutdown::Write).unwrap();
    let reply = read_all(&mut s);
    assert!(reply.starts_with("HTTP/1.1 400"), "{reply}");
    server.settle();
}

/// 2,000 requests of every kind from 4 clients at once, a quarter of them abandoned at a
/// random point: the server lives, and its memory after request 2,000 is within 10% of
/// what it was after request 500.
#[test]
fn a_soak_of_mixed_requests_with_random_disconnects_holds_memory() {
    // A prompt cache of 4 MiB, full well before request 500 (the built-in model's keys and
    // values take 20 KB a position): what it holds does not grow after.
    let mut server = Server::start(&["--cache-mem", "4"]);
    let addr = server.addr();
    let run = |from: usize, to: usize| {
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let addr = addr.clone();
                std::thread::spawn(move || {
                    for i in (from + t..to).step_by(4) {
                        soak_request(&addr, i);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
    };
    run(0, 500);
    server.settle();
    let at_500 = server.rss_kib();
    run(500, 2000);
    server.settle();
    let at_2000 = server.rss_kib();
    eprintln!("RSS after request 500: {at_500} KiB, after 2000: {at_2000} KiB");
    assert!(
        at_2000 * 10 < at_500 * 11,
        "RSS grew from {at_500} to {at_2000} KiB"
    );
}

/// Request `i` of the soak: its kind and where it is abandoned follow from `i` (a small
/// hash), so every run sends the same mix.
fn soak_request(addr: &str, i: usize) {
    let h = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
    let max = 1 + (h % 12) as usize;
    let (path, body) = match h % 5 {
        0 => (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Speak."}], "max_tokens": max, "stream": h.is_multiple_of(2)}),
        ),
        1 => (
            "/v1/completions",
            json!({"prompt": "ROMEO:", "max_tokens": max, "repetition_penalty": 1e300}),
        ),
        2 => (
            "/v1/completions",
            json!({"prompt": ["ROMEO:", "JULIET:"], "max_tokens": max, "logprobs": 2}),
        ),
        _ => (
            "/v1/completions",
            json!({"prompt": "ROMEO:", "max_tokens": max, "stream": h % 2 == 1, "seed": i}),
        ),
    };
    let body = body.to_string();
    let mut s = connect(addr);
    s.write_all(head(path, Some(body.len()), "Connection: close\r\n").as_bytes())
        .unwrap();
    match (h >> 8) % 8 {
        // Abandoned mid-body, right after sending, or after the first bytes of the answer.
        0 => {
            s.write_all(&body.as_bytes()[..body.len() / 2]).unwrap();
            reset(s);
        }
        1 => {
            s.write_all(body.as_bytes()).unwrap();
            reset(s);
        }
        2 => {
            s.write_all(body.as_bytes()).unwrap();
            let mut buf = [0u8; 64];
            let _ = s.read(&mut buf);
            drop(s);
        }
        _ => {
            s.write_all(body.as_bytes()).unwrap();
            let reply = read_all(&mut s);
            let status = &reply[..reply.len().min(12)];
            assert!(
                status == "HTTP/1.1 200" || status == "HTTP/1.1 400",
                "request {i}: {reply}"
            );
        }
    }
}

/// Hostile constraints: a schema nested 10,000 deep, a regex of most of a megabyte, a
/// regex and a grammar that explode, a schema of 5,000 properties, 10,000 tools, bad
/// types. Each is a 4xx naming its field within a bounded time (or, for what compiles, a
/// bounded answer), and the server keeps serving with bounded memory.
#[test]
fn hostile_constraints_are_refused_or_bounded() {
    let mut server = Server::start(&[]);
    let rss = server.rss_kib();
    let deep = format!(
        "{}{}",
        "{\"type\": \"array\", \"items\": ".repeat(10_000),
        "true".to_string() + &"}".repeat(10_000)
    );
    let deep_body = format!(
        r#"{{"prompt": "x", "max_tokens": 4, "response_format": {{"type": "json_schema", "json_schema": {{"name": "d", "schema": {deep}}}}}}}"#
    );
    let huge_regex = "(a|b)".repeat(170_000);
    let properties: serde_json::Map<String, Value> = (0..5_000)
        .map(|i| {
            (
                format!("p{i}"),
                json!({"type": "string", "pattern": format!("x{{{i}}}")}),
            )
        })
        .collect();
    let many_props = json!({"type": "object", "properties": properties,
        "required": (0..5_000).map(|i| format!("p{i}")).collect::<Vec<_>>()});
    let tools: Vec<Value> = (0..10_000)
        .map(|i| json!({"type": "function", "function": {"name": format!("f{i}")}}))
        .collect();
    let cases: Vec<(String, &str)> = vec![
        (deep_body, "response_format"),
        (json!({"prompt": "x", "guided_regex": huge_regex}).to_string(), "guided_regex"),
        (
            json!({"prompt": "x", "guided_regex": "((a{1,1000}){1,1000}){1,1000}"}).to_string(),
            "guided_regex",
        ),
        (
            json!({"prompt": "x", "guided_grammar": format!("start: {}", "(\"a\" | \"b\" ".repeat(3000) + &")".repeat(3000))}).to_string(),
            "guided_grammar",
        ),
        (
            json!({"prompt": "x", "max_tokens": 4, "response_format": {"type": "json_schema", "json_schema": {"name": "m", "schema": many_props}}}).to_string(),
            "response_format",
        ),
        (json!({"prompt": "x", "tools": tools}).to_string(), "tools"),
        (json!({"prompt": "x", "guided_grammar": ["start"]}).to_string(), "guided_grammar"),
        (json!({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": "object"}}}).to_string(), "response_format"),
    ];
    for (body, field) in &cases {
        let started = Instant::now();
        let (status, text) = server.call("POST", "/v1/completions", Some(body), None);
        let took = started.elapsed();
        assert!(took < Duration::from_secs(60), "{field}: {took:?}");
        if status == 200 {
            // Compiled within the library's limits: a bounded answer.
            let v: Value = serde_json::from_str(&text).unwrap();
            assert!(
                v["usage"]["completion_tokens"].as_u64().unwrap() <= 16,
                "{text}"
            );
            continue;
        }
        assert!(
            (400..500).contains(&status),
            "{field}: {status} {}",
            &text[..text.len().min(300)]
        );
        let v: Value = serde_json::from_str(&text).unwrap();
        let param = v["error"]["param"].as_str();
        // A body past the size limit, or nested past what the JSON reader takes, is refused
        // before its fields are read.
        assert!(param == Some(field) || param.is_none(), "{field}: {text}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(!msg.contains('\n') && msg.len() < 1000, "{field}: {msg}");
    }
    server.assert_alive();
    assert!(!greedy(&server, PROMPT, 8).is_empty());
    let grown = server.rss_kib().saturating_sub(rss);
    assert!(grown < 512 * 1024, "RSS grew by {grown} KiB");
    server.assert_no_internal_errors();
}
