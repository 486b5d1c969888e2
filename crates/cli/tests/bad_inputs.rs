//! Runs `gpt` on every file of the bad-input corpus in `tests/bad-inputs/` (made by
//! `scripts/bad_inputs.py`, listed in its `cases.json`): each must end with exit code 1,
//! one line `error: …` naming the problem, no panic, within seconds and under a memory cap.

use std::path::Path;
use std::time::{Duration, Instant};

use assert_cmd::Command;

/// Address-space cap for each run: far below what any of the hostile files asks for.
const MEMORY_CAP_KB: u64 = 4 << 20;

#[test]
fn every_bad_input_is_one_clear_error() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/bad-inputs");
    let manifest = std::fs::read_to_string(dir.join("cases.json")).unwrap();
    let cases: serde_json::Value = serde_json::from_str(&manifest).unwrap();
    let cases = cases.as_array().unwrap();
    assert!(cases.len() >= 25, "the corpus lost cases: {}", cases.len());
    let mut failures = Vec::new();
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let expect = case["expect"].as_str().unwrap();
        let args: Vec<&str> = case["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect();
        // `ulimit -v` through sh: an unbounded allocation fails instead of swapping.
        let start = Instant::now();
        let out = Command::new("sh")
            .arg("-c")
            .arg(format!("ulimit -v {MEMORY_CAP_KB} && exec \"$0\" \"$@\""))
            .arg(env!("CARGO_BIN_EXE_gpt"))
            .args(&args)
            .current_dir(&dir)
            .env("RAYON_NUM_THREADS", "1")
            .timeout(Duration::from_secs(30))
            .output()
            .unwrap();
        let took = start.elapsed();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let lines: Vec<&str> = stderr.lines().collect();
        let good = out.status.code() == Some(1)
            && lines.len() == 1
            && lines[0].starts_with("error: ")
            && lines[0].contains(expect)
            && !stderr.contains("panicked")
            && !stderr.contains("internal error");
        if !good {
            failures.push(format!(
                "{name}: gpt {args:?} -> {:?} in {took:?}, stderr {stderr:?} (expected one line with {expect:?})",
                out.status.code()
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
