//! A `gpt serve` child process for the end-to-end tests (`serve.rs`, `hostile.rs`): on
//! 127.0.0.1 with a port the OS picks, killed when dropped, every wait bounded.

#![allow(dead_code)] // each test binary uses its own part of it

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

/// A `gpt serve` child process, killed when dropped.
pub struct Server {
    pub child: Child,
    pub base: String,
    /// The server's log so far.
    log: Arc<Mutex<Vec<String>>>,
}

impl Server {
    pub fn start(args: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_gpt"))
            .args([
                "--threads",
                "2",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
            ])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = mpsc::channel();
        let log = Arc::new(Mutex::new(Vec::new()));
        // Reads the server's log until it closes; the address goes to the test.
        let lines = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(addr) = line.strip_prefix("listening on ") {
                    let _ = tx.send(addr.to_string());
                }
                lines.lock().unwrap().push(line);
            }
        });
        let base = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("the server did not start listening within 60 s");
        assert!(base.starts_with("http://127.0.0.1:"), "{base}");
        Server { child, base, log }
    }

    /// `host:port`.
    pub fn addr(&self) -> String {
        self.base.trim_start_matches("http://").to_string()
    }

    /// Fails if the server has logged a panic or an internal error.
    pub fn assert_no_internal_errors(&self) {
        let log = self.log.lock().unwrap();
        let bad: Vec<&String> = log
            .iter()
            .filter(|l| l.contains("panicked") || l.contains("internal error"))
            .collect();
        assert!(bad.is_empty(), "the server logged: {bad:?}");
    }

    /// Resident memory of the server process, in KiB (Linux's /proc).
    pub fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS in /proc/PID/status")
    }

    /// Fails unless the process is still running.
    pub fn assert_alive(&mut self) {
        let status = self.child.try_wait().unwrap();
        assert!(status.is_none(), "the server exited: {status:?}");
    }

    /// Waits (up to 30 s) until nothing is queued or running, then checks that the server
    /// answers `/health` and a completion.
    pub fn settle(&mut self) {
        self.assert_alive();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let (queued, running) = (
                self.metric("gpt_queue_length"),
                self.metric("gpt_batch_size"),
            );
            if queued == 0.0 && running == 0.0 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "still {queued} queued and {running} running after 30 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(self.call("GET", "/health", None, None).0, 200);
        let v = self
            .complete(serde_json::json!({"prompt": "ROMEO:", "max_tokens": 4, "temperature": 0}));
        assert!(v["usage"]["completion_tokens"].as_u64() >= Some(1), "{v}");
        self.assert_no_internal_errors();
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// Status and body of a request (any status).
    pub fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&str>,
        key: Option<&str>,
    ) -> (u16, String) {
        let mut req = ureq::request(method, &self.url(path)).timeout(Duration::from_secs(60));
        if let Some(k) = key {
            req = req.set("Authorization", &format!("Bearer {k}"));
        }
        let res = match body {
            Some(b) => req.set("Content-Type", "application/json").send_string(b),
            None => req.call(),
        };
        match res {
            Ok(r) => (r.status(), r.into_string().unwrap()),
            Err(ureq::Error::Status(code, r)) => (code, r.into_string().unwrap()),
            Err(e) => panic!("{method} {path}: {e}"),
        }
    }

    pub fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let (status, text) = self.call("POST", path, Some(&body.to_string()), None);
        let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        (status, v)
    }

    pub fn complete(&self, body: Value) -> Value {
        let (status, v) = self.post("/v1/completions", &body);
        assert_eq!(status, 200, "{v}");
        v
    }

    pub fn metric(&self, name: &str) -> f64 {
        let (_, text) = self.call("GET", "/metrics", None, None);
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("{name} not in /metrics"))
    }

    /// SIGTERM, then the exit status (within `limit`).
    pub fn terminate(&mut self, limit: Duration) -> ExitStatus {
        // SAFETY: sending a signal to our own child process.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                start.elapsed() < limit,
                "the server did not stop within {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What `gpt generate` prints (its JSON `text`) for these arguments.
pub fn generate(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_gpt"))
        .args(["--threads", "2", "generate", "--format", "json"])
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v["text"].as_str().unwrap().to_string()
}
