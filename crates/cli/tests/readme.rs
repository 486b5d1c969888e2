//! Every command the README shows as run (`$ gpt …` in its `console` blocks) runs as shown:
//! from the workspace root, with files it writes (`--out`) put in a temporary directory,
//! and succeeds. Where the output cannot depend on the CPU's rounding (`inspect`,
//! `tokenize`), the lines shown must be the lines printed, up to a `...` line. `sh` blocks
//! are illustrations (hub models, servers) and are not run.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// One `$ ` line of a console block and the lines shown after it.
struct Shown {
    line: String,
    output: Vec<String>,
}

fn readme() -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    std::fs::read_to_string(root.join("README.md")).unwrap()
}

fn console_commands(readme: &str) -> Vec<Shown> {
    let mut out = Vec::new();
    let mut in_console = false;
    for line in readme.lines() {
        if line.starts_with("```") {
            in_console = line == "```console";
            continue;
        }
        if !in_console {
            continue;
        }
        match line.strip_prefix("$ ") {
            Some(cmd) => out.push(Shown {
                line: cmd.to_string(),
                output: Vec::new(),
            }),
            None => {
                let last = out.last_mut().expect("output before any command");
                last.output.push(line.to_string());
            }
        }
    }
    out
}

/// Splits a command line as a POSIX shell would for the quoting the README uses:
/// words, '…' and "…" (with \" inside).
fn words(line: &str) -> Vec<String> {
    let (mut out, mut cur, mut any) = (Vec::new(), String::new(), false);
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            ' ' if !cur.is_empty() || any => {
                out.push(std::mem::take(&mut cur));
                any = false;
            }
            ' ' => {}
            '\'' => {
                any = true;
                for c in chars.by_ref() {
                    if c == '\'' {
                        break;
                    }
                    cur.push(c);
                }
            }
            '"' => {
                any = true;
                while let Some(c) = chars.next() {
                    match c {
                        '"' => break,
                        '\\' => cur.extend(chars.next()),
                        c => cur.push(c),
                    }
                }
            }
            c => cur.push(c),
        }
    }
    if !cur.is_empty() || any {
        out.push(cur);
    }
    out
}

/// `printf`'s escapes the README uses.
fn printf(format: &str) -> String {
    format.replace("\\n", "\n").replace("\\t", "\t")
}

#[test]
fn the_readme_commands_run_as_shown() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let tmp = tempfile::tempdir().unwrap();
    let shown = console_commands(&readme());
    assert!(
        shown.len() >= 8,
        "the README shows {} commands",
        shown.len()
    );
    // Files the commands write, by the name the README gives them.
    let mut written: HashMap<String, PathBuf> = HashMap::new();
    for s in &shown {
        let (stdin, cmd) = match s.line.split_once(" | ") {
            Some((feed, cmd)) => {
                let w = words(feed);
                assert_eq!(w[0], "printf", "{}", s.line);
                (Some(printf(&w[1])), cmd)
            }
            None => (None, s.line.as_str()),
        };
        let mut args = words(cmd);
        assert_eq!(args[0], "gpt", "README commands run gpt: {}", s.line);
        for i in 1..args.len() {
            if args[i - 1] == "--out" {
                let path = tmp.path().join(&args[i]);
                written.insert(args[i].clone(), path.clone());
                args[i] = path.display().to_string();
            } else if let Some(path) = written.get(&args[i]) {
                args[i] = path.display().to_string();
            }
        }
        let mut child = Command::new(env!("CARGO_BIN_EXE_gpt"))
            .args(&args[1..])
            .current_dir(&root)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut pipe = child.stdin.take().unwrap();
        if let Some(text) = stdin {
            pipe.write_all(text.as_bytes()).unwrap();
        }
        drop(pipe);
        let out = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "`{}` failed: {}",
            s.line,
            String::from_utf8_lossy(&out.stderr)
        );
        if !s.output.is_empty() {
            assert!(!stdout.trim().is_empty(), "`{}` printed nothing", s.line);
        }
        if matches!(
            args.get(1).map(String::as_str),
            Some("inspect" | "tokenize")
        ) {
            let printed: Vec<&str> = stdout.lines().collect();
            for (i, want) in s.output.iter().enumerate() {
                if want == "..." {
                    break;
                }
                assert_eq!(
                    printed.get(i),
                    Some(&want.as_str()),
                    "`{}` line {i}",
                    s.line
                );
            }
        }
    }
}

#[test]
fn words_split_as_a_shell_does() {
    assert_eq!(
        words(r#"gpt generate --prompt "To be, or \"not\"" --x 'a b' c"#),
        [
            "gpt",
            "generate",
            "--prompt",
            "To be, or \"not\"",
            "--x",
            "a b",
            "c"
        ]
    );
    assert_eq!(printf("Who art thou?\\n"), "Who art thou?\n");
}
