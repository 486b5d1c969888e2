//! The README's two commands work from the workspace root of a fresh clone. The test
//! command is what CI runs; the run command is checked here without a release build:
//! `cargo run --bin gpt` only looks for `gpt` in the workspace's *default* members (with
//! a root package, that is the root package alone unless `default-members` says more),
//! so the check asks Cargo itself which members those are.

use std::path::Path;
use std::process::Command;

fn quick_start() -> Vec<String> {
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap();
    let start = readme
        .find("## Quick start")
        .expect("README has a Quick start");
    let block = &readme[start..];
    let open = block.find("```sh\n").expect("a sh block") + 6;
    let close = open + block[open..].find("```").unwrap();
    block[open..close]
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .map(str::to_string)
        .collect()
}

#[test]
fn quick_start_has_the_run_and_test_commands() {
    let cmds = quick_start();
    assert_eq!(cmds.len(), 2, "{cmds:?}");
    assert!(cmds[0].starts_with("cargo run --release --bin gpt -- generate --prompt "));
    assert_eq!(cmds[1], "cargo test --workspace");
}

#[test]
fn cargo_run_bin_gpt_finds_gpt_from_the_workspace_root() {
    let root = env!("CARGO_MANIFEST_DIR");
    let out = Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--no-deps",
            "--format-version",
            "1",
            "--offline",
        ])
        .current_dir(root)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let defaults: Vec<&str> = meta["workspace_default_members"]
        .as_array()
        .expect("cargo reports workspace_default_members")
        .iter()
        .map(|m| m.as_str().unwrap())
        .collect();
    let gpt_bins: Vec<&serde_json::Value> = meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| defaults.contains(&p["id"].as_str().unwrap()))
        .flat_map(|p| p["targets"].as_array().unwrap())
        .filter(|t| t["name"] == "gpt" && t["kind"].as_array().unwrap().iter().any(|k| k == "bin"))
        .collect();
    assert_eq!(
        gpt_bins.len(),
        1,
        "default members {defaults:?} hold no single `gpt` binary"
    );
}
