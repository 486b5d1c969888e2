//! `gpt` on GGUF files made by llama.cpp's converter and quantizer, and chatting
//! (`scripts/gguf_fixtures.py`): text encoded by the tokenizer built from the file's
//! metadata gives transformers' ids, greedy decoding gives llama.cpp's tokens, `--chat`
//! feeds the model what transformers' `apply_chat_template` gives for the template the file
//! carries, and `gpt chat` holds a conversation from piped input.

use std::path::PathBuf;
use std::process::Output;

use assert_cmd::Command;
use candle_core::{DType, Device, Tensor};

fn gguf(file: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../block/tests/fixtures/gguf")
        .join(file)
        .display()
        .to_string()
}

fn expected(name: &str) -> std::collections::HashMap<String, Tensor> {
    candle_core::safetensors::load(gguf(&format!("{name}.expected.safetensors")), &Device::Cpu)
        .unwrap()
}

fn ids(t: &Tensor) -> Vec<u32> {
    t.to_dtype(DType::U32).unwrap().to_vec1().unwrap()
}

fn gpt(args: &[&str], stdin: &str) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gpt"))
        .args(args)
        .env("RAYON_NUM_THREADS", "2")
        .write_stdin(stdin)
        .timeout(std::time::Duration::from_secs(120))
        .output()
        .unwrap()
}

fn ok(args: &[&str]) -> String {
    let out = gpt(args, "");
    assert!(
        out.status.success(),
        "gpt {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn json(line: &str) -> serde_json::Value {
    serde_json::from_str(line.trim()).unwrap()
}

const SAMPLE: &str =
    "ROMEO: But soft, what light through yonder window breaks? It is the east, and 42.";

#[test]
fn text_through_a_gguf_file_gives_transformers_ids_and_llama_cpp_tokens() {
    for (name, kind) in [("llama", "q8_0"), ("qwen2", "q8_0"), ("gpt2", "q8_0")] {
        let exp = expected(name);
        let file = gguf(&format!("{name}.{kind}.gguf"));
        let out = ok(&[
            "--model",
            &file,
            "generate",
            "--prompt",
            SAMPLE,
            "--temperature",
            "0",
            "--max-new-tokens",
            "1",
            "--format",
            "json",
        ]);
        let got: Vec<u32> = serde_json::from_value(json(&out)["prompt_ids"].clone()).unwrap();
        assert_eq!(got, ids(&exp["input_ids"]), "{name}: prompt ids");

        let prompt: Vec<String> = ids(&exp["input_ids"])[..8]
            .iter()
            .map(u32::to_string)
            .collect();
        let greedy = ids(&exp[&format!("llama_{kind}_greedy")]);
        let out = ok(&[
            "--model",
            &file,
            "generate",
            "--prompt-ids",
            &prompt.join(","),
            "--temperature",
            "0",
            "--max-new-tokens",
            &greedy.len().to_string(),
            "--format",
            "json",
        ]);
        let new: Vec<u32> = serde_json::from_value(json(&out)["new_ids"].clone()).unwrap();
        assert_eq!(
            new, greedy,
            "{name}.{kind}: greedy tokens against llama.cpp"
        );
    }
}

/// The template a GGUF file carries, rendered for a system and a user turn, gives the ids
/// transformers' `apply_chat_template` gives: Zephyr's roles (llama), and Gemma 3's, which has
/// no system role and folds the system turn into the first user turn (`<start_of_turn>model`).
#[test]
fn chat_renders_the_files_template_as_transformers_does() {
    for (name, file) in [("llama", "llama.q4_0.gguf"), ("gemma3", "gemma3.q8_0.gguf")] {
        let exp = expected(name);
        let out = ok(&[
            "--model",
            &gguf(file),
            "generate",
            "--chat",
            "--system",
            "Be brief.",
            "--prompt",
            "Hello there!",
            "--temperature",
            "0",
            "--max-new-tokens",
            "6",
            "--format",
            "json",
        ]);
        let got: Vec<u32> = serde_json::from_value(json(&out)["prompt_ids"].clone()).unwrap();
        assert_eq!(got, ids(&exp["chat_ids"]), "{file}");
        let text = ok(&["--model", &gguf(file), "inspect"]);
        assert!(
            text.contains("chat: the model's own template"),
            "{file}: {text}"
        );
    }
}

#[test]
fn every_subcommand_reads_gguf_files() {
    let file = gguf("neox.q8_0.gguf");
    let out = ok(&[
        "--model", &file, "score", "--text", SAMPLE, "--format", "json",
    ]);
    assert!(json(&out)["nll"].as_f64().unwrap().is_finite(), "{out}");
    let out = ok(&["--model", &file, "inspect", "--format", "json"]);
    assert_eq!(json(&out)["quantized"], true);
    // Matrices listed in the format the file stores them in, not dequantized.
    let tensors = json(&out)["tensors"].as_array().unwrap().clone();
    let q8 = tensors.iter().filter(|t| t["dtype"] == "q8_0").count();
    assert!(q8 > 0, "{out}");
    ok(&["--model", &file, "trace", "--prompt", "ROMEO"]);
    ok(&["--model", &file, "attention", "--prompt", "ROMEO: soft"]);
    ok(&[
        "--model",
        &file,
        "bench",
        "--prompt-len",
        "8",
        "--new-tokens",
        "4",
        "--runs",
        "1",
    ]);
}

#[test]
fn chat_holds_a_conversation_from_piped_input() {
    let input = "Hello!\n/system Answer in one word.\nWho are you?\n/reset\n/what\nBye\n";
    for file in [gguf("llama.q8_0.gguf"), String::new()] {
        let mut args = vec!["chat", "--max-new-tokens", "8", "--temperature", "0"];
        if !file.is_empty() {
            args.splice(0..0, ["--model", file.as_str()]);
        }
        let out = gpt(&args, input);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.contains("(system message set; conversation cleared)"),
            "{stdout}"
        );
        assert!(stdout.contains("(conversation cleared)"), "{stdout}");
        assert!(
            stdout.contains("(commands: /reset, /system TEXT, /exit)"),
            "{stdout}"
        );
        // Three replies, one line each (a reply may contain newlines of its own).
        assert!(stdout.lines().count() >= 6, "{stdout}");
    }
}

/// `gpt convert` writes the built-in model as GGUF; read back, it encodes as the built-in
/// model does, generates the same text from q5_0 (its own format: the same blocks), and
/// scores a text within 0.15 nats per token from f32 and q8_0 (the built-in model
/// quantizes its activations to 8 bits in q5_0 products, these compute otherwise: measured
/// 0.029 and 0.067 at most; greedy text from them parts from the built-in model's after a
/// few tokens on some CPUs).
#[test]
fn converted_built_in_model_generates_the_same_text() {
    let dir = tempfile::tempdir().unwrap();
    let text = "ROMEO: What light through yonder window breaks? It is the east.";
    let run = |model: Option<&str>, args: &[&str]| {
        let mut args = args.to_vec();
        args.extend(["--format", "json"]);
        if let Some(m) = model {
            args.splice(0..0, ["--model", m]);
        }
        json(&ok(&args))
    };
    let generate = [
        "generate",
        "--prompt",
        "ROMEO:",
        "--temperature",
        "0",
        "--max-new-tokens",
        "12",
    ];
    let reference = run(None, &generate);
    let scores =
        |model: Option<&str>| run(model, &["score", "--text", text])["token_logprobs"].clone();
    let reference_scores = scores(None);
    for kind in ["q5_0", "f32", "q8_0"] {
        let out = dir.path().join(format!("builtin.{kind}.gguf"));
        let out = out.to_str().unwrap();
        let stderr = gpt(&["convert", "--out", out, "--type", kind], "");
        assert!(
            stderr.status.success(),
            "{}",
            String::from_utf8_lossy(&stderr.stderr)
        );
        let got = run(Some(out), &generate);
        assert_eq!(got["prompt_ids"], reference["prompt_ids"], "{kind}");
        if kind == "q5_0" {
            assert_eq!(got["new_ids"], reference["new_ids"]);
            continue;
        }
        let (want, got) = (reference_scores.as_array().unwrap(), scores(Some(out)));
        let got = got.as_array().unwrap();
        assert_eq!(got.len(), want.len(), "{kind}");
        for (g, w) in got.iter().zip(want) {
            let (g, w) = (g.as_f64().unwrap(), w.as_f64().unwrap());
            assert!((g - w).abs() < 0.15, "{kind}: {g} against {w}");
        }
    }
    let out = gpt(
        &[
            "convert",
            "--out",
            dir.path().join("x.gguf").to_str().unwrap(),
            "--quantize",
            "q8_0",
        ],
        "",
    );
    assert!(!out.status.success());
}

/// The weights built into `gpt` are the q5_0 conversion of the f16 directory beside them,
/// byte for byte: the two cannot drift apart. (After retraining, rewrite the file with
/// `gpt --model crates/cli/models/default convert --type q5_0 --out
/// crates/cli/models/default/model.q5_0.gguf`.)
#[test]
fn built_in_weights_are_the_q5_0_conversion_of_the_directory() {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/default");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("default.q5_0.gguf");
    let model = src.to_str().unwrap();
    let convert = ["--model", model, "convert", "--type", "q5_0", "--out"];
    let status = gpt(&[&convert[..], &[out.to_str().unwrap()]].concat(), "");
    assert!(status.status.success(), "{status:?}");
    let built_in = std::fs::read(src.join("model.q5_0.gguf")).unwrap();
    assert!(
        std::fs::read(&out).unwrap() == built_in,
        "models/default/model.q5_0.gguf is not the q5_0 conversion of models/default"
    );
}

/// A directory's `tokenizer_config.json` template is used, and a conversation it refuses
/// (`raise_exception`) is reported without ending the chat.
#[test]
fn chat_reports_a_conversation_the_template_refuses() {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../block/tests/fixtures/families/llama_tokenizer");
    let dir = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    let template = "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}";
    let config =
        serde_json::json!({"bos_token": "<s>", "eos_token": "</s>", "chat_template": template});
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
    let model = dir.path().to_str().unwrap();
    let out = gpt(
        &[
            "--model",
            model,
            "chat",
            "--max-new-tokens",
            "4",
            "--temperature",
            "0",
        ],
        "/system Be brief.\nHello\n/reset\nHello\n",
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("(not sent: ") && stdout.contains("System role not supported"),
        "{stdout}"
    );
    // After /reset the system message is still set, so the template refuses again.
    assert_eq!(stdout.matches("(not sent: ").count(), 2, "{stdout}");
}

/// A GGUF file whose matrices are f16 keeps them (and the token table) in f16 on the CPU
/// and computes in f32: its norms, biases and position table (stored f32) load in f32.
/// `--dtype bf16` converts the matrices. (A GPT-2, for its biases and position table.)
#[test]
fn half_precision_files_keep_half_matrices_on_the_cpu() {
    let gpt2 = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../block/tests/fixtures/tiny");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("tiny.f16.gguf");
    let out = out.to_str().unwrap();
    let model = gpt2.to_str().unwrap();
    assert!(gpt(
        &["--model", model, "convert", "--out", out, "--type", "f16"],
        ""
    )
    .status
    .success());
    // (dtypes of the matrices, dtypes of the vectors)
    let dtypes = |extra: &[&str]| {
        let mut args = vec!["--model", out, "inspect", "--format", "json"];
        args.extend_from_slice(extra);
        let tensors = json(&ok(&args))["tensors"].clone();
        let mut by_rank = (Vec::new(), Vec::new());
        for t in tensors.as_array().unwrap() {
            let dtype = t["dtype"].as_str().unwrap().to_string();
            let table = t["name"].as_str().unwrap().contains("wpe");
            let list = match t["shape"].as_array().unwrap().len() {
                2 if !table => &mut by_rank.0,
                _ => &mut by_rank.1,
            };
            if !list.contains(&dtype) {
                list.push(dtype);
            }
        }
        by_rank
    };
    let f = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(dtypes(&[]), (f(&["f16"]), f(&["f32"])));
    assert_eq!(dtypes(&["--dtype", "f32"]), (f(&["f16"]), f(&["f32"])));
    // Everything loads in bf16, then the norms and the position table go to f32 (biases
    // stay bf16 and are widened when added).
    assert_eq!(
        dtypes(&["--dtype", "bf16"]),
        (f(&["bf16"]), f(&["bf16", "f32"]))
    );
}
