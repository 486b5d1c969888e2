"""`gpt bench` against llama.cpp's `llama-bench` on the same GGUF files, same threads, in
alternation: decoding 128 tokens after a 16-token context, a 512-token prefill and, with
`--depths 1024`, decoding 64 tokens after a 1024-token context (`llama-bench -d`).

    cargo build --release --bin gpt
    /tmp/ref/bin/python bench/gguf_compare.py [--arch gpt2|llama] [--kinds q8_0 q4_k_m] [--rounds 3]

The Python environment is REFERENCE.md's plus `sentencepiece` and `protobuf` (the Llama
geometry's tokenizer goes through transformers' SentencePiece converter; without protobuf
it falls back to a tiktoken reader and fails). `--kinds` takes f32, f16, q8_0 and any type
`llama-quantize` knows (q4_0, q4_k_m, q5_k_m, ...).

llama.cpp: the tree vendored by the `llama-cpp-python` source package (see
scripts/gguf_fixtures.py), with `llama-bench` and `llama-quantize` built by CMake from PyPI:

    cmake -S $(realpath .../vendor/llama.cpp) -B /tmp/lcp/build -G Ninja \\
        -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF
    cmake --build /tmp/lcp/build --target llama-bench llama-quantize -j 2

The GGUF files come from llama.cpp's own converter (f32) and quantizer, made once from the
random-weight checkpoints of bench/checkpoints.py (GPT-2 124M, SmolLM-135M's Llama
geometry, Qwen3-0.6B's, Gemma-3-270M's), so both programs read the very same bytes. llama-bench keeps its defaults (f16
KV cache, flash attention); `gpt bench` gets the same cache precision (`--kv-dtype f16`,
`--gpt-kv-dtype` to change it). Peak RSS of each run comes from `gpt bench` itself and from
`/usr/bin/time -f %M` for llama-bench. Medians over the rounds and the ratio gpt / llama.cpp
(tokens/s, higher is better for gpt) are printed.

Decoding reads every weight once per token, so its ceiling is the memory read bandwidth
over the file's tensor bytes: the read floor, measured (torch summing 1 GiB with the same
threads) just before and after each decoding pair, their mean. "of floor" is tokens/s x
tensor bytes / bandwidth: 1.0 would be decoding as fast as the weights can be read.
Where a shared machine's memory rate moves within seconds (a virtual machine's neighbours),
a floor taken around the pair misjudges the decoding between; so each round also runs
`gpt bench --read-floor`, which reads 256 MiB on its decoding threads after every decoding
step: "of interleaved floor" is that run's tokens/s x tensor bytes / the rate of those reads.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
p = argparse.ArgumentParser()
p.add_argument("--arch", choices=["gpt2", "llama", "qwen3", "gemma3"], default="gpt2")
p.add_argument("--kinds", nargs="+", default=["q8_0", "q4_k_m"])
p.add_argument("--threads", type=int, default=2)
p.add_argument("--rounds", type=int, default=3)
p.add_argument("--llama-build", default="/tmp/lcp/build/bin")
p.add_argument("--gpt-kv-dtype", default="f16", choices=["f32", "f16", "bf16"])
p.add_argument("--depths", type=int, nargs="*", default=[],
               help="also decode 64 tokens after this many cached positions (llama-bench -d)")
args = p.parse_args()

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import gguf_fixtures  # noqa: E402  (llama.cpp's converter, in this process)
import torch  # noqa: E402
from checkpoints import random_checkpoint  # noqa: E402  (bench/checkpoints.py, beside this script)
from floors import read_floor  # noqa: E402  (bench/floors.py)

hf = random_checkpoint(args.arch)

sys.path.insert(0, os.path.join(gguf_fixtures.LLAMA_CPP, "gguf-py"))
from gguf import GGUFReader  # noqa: E402  (llama.cpp's own reader)

torch.set_num_threads(args.threads)


def tensor_bytes(path):
    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors)


def with_tokenizer():
    """The converter needs a tokenizer; the benchmark feeds token ids, so the small ones of
    scripts/gguf_fixtures.py do (the converter pads the vocabulary to the model's)."""
    if os.path.exists(os.path.join(hf, "tokenizer.json")):
        return
    text = "\n".join(gguf_fixtures.corpus()) * 3
    if args.arch in ("gpt2", "qwen3", "gemma3"):
        gguf_fixtures.bpe_tokenizer(text, 320).save_pretrained(hf)
    else:
        import shutil
        import tempfile
        tok, model = gguf_fixtures.spm_tokenizer(text, 640, tempfile.mkdtemp())
        tok.save_pretrained(hf)
        shutil.copy(model, os.path.join(hf, "tokenizer.model"))


def gguf(kind):
    path = f"{hf}.{kind}.gguf"
    if os.path.exists(path):
        return path
    if kind in ("f32", "f16", "q8_0"):
        cfg = json.load(open(os.path.join(hf, "config.json")))
        if "n_ctx" not in cfg and "n_positions" in cfg:
            cfg["n_ctx"] = cfg["n_positions"]  # the converter still reads GPT-2's n_ctx
            json.dump(cfg, open(os.path.join(hf, "config.json"), "w"), indent=2)
        with_tokenizer()
        if args.arch == "gemma3":
            # Gemma 3's converter cuts the embedding to the tokenizer's vocabulary; the
            # benchmark keeps the model's 262,144 rows (the converter pads the vocabulary).
            sys.path.insert(0, gguf_fixtures.LLAMA_CPP)
            import conversion.base as base
            import conversion.gemma as gemma

            def keep_rows(self, data_torch, name, bid):
                if name.endswith("norm.weight"):
                    data_torch = data_torch + 1.0
                yield from base.TextModel.modify_tensors(self, data_torch, name, bid)
            gemma.Gemma3Model.modify_tensors = keep_rows
        gguf_fixtures.convert(hf, path, kind)
    else:
        subprocess.run([os.path.join(args.llama_build, "llama-quantize"), gguf("f32"), path,
                        kind.upper()], check=True, capture_output=True)
    return path


def ours(path, n, new, floor=False):
    """(tokens/s, peak RSS in MiB), and with `floor` the read rate between decoding steps."""
    cmd = [os.path.join(ROOT, "target", "release", "gpt"), "bench", "--model", path,
           "--prompt-len", str(n), "--new-tokens", str(new), "--runs", "1",
           "--threads", str(args.threads), "--kv-dtype", args.gpt_kv_dtype, "--format", "json"]
    out = json.loads(subprocess.run(cmd + ["--read-floor"] * floor, check=True,
                                    capture_output=True, text=True).stdout)
    rate = out["decode_tokens_per_s"] if new else out["prefill_tokens_per_s"]
    return rate, out["peak_rss_bytes"] / 2**20, out.get("read_floor_bytes_per_s")


def theirs(path, n, new):
    bench = [os.path.join(args.llama_build, "llama-bench"), "-m", path, "-t", str(args.threads),
             "-r", "1", "-o", "json"]
    bench += ["-p", "0", "-n", str(new), "-d", str(n)] if new else ["-p", str(n), "-n", "0"]
    run = subprocess.run(["/usr/bin/time", "-f", "%M", *bench], check=True, capture_output=True,
                         text=True)
    rss = int(run.stderr.strip().splitlines()[-1]) / 1024
    return json.loads(run.stdout)[0]["avg_ts"], rss


shapes = [("decode 128 after 16", 16, 128), ("prefill 512", 512, 0)]
shapes += [(f"decode 64 after {n}", n, 64) for n in args.depths]
workloads = [(f"{kind}: {name}", gguf(kind), n, new) for kind in args.kinds for name, n, new in shapes]
results = {w[0]: {"gpt": [], "llama.cpp": [], "gpt rss": [], "llama.cpp rss": [], "gpt floor": [],
                  "llama.cpp floor": [], "gpt interleaved": []} for w in workloads}
for r in range(args.rounds):
    for name, path, n, new in workloads:
        # The read floor counts weights only: decoding after a long context reads the
        # cache as well, so it gets none.
        floored = new and n <= 16
        before = read_floor() if floored else None
        o, t = ours(path, n, new), theirs(path, n, new)
        res = results[name]
        res["gpt"].append(o[0])
        res["gpt rss"].append(o[1])
        res["llama.cpp"].append(t[0])
        res["llama.cpp rss"].append(t[1])
        floor = ""
        if floored:
            per_token = (before + read_floor()) / 2 / tensor_bytes(path)
            res["gpt floor"].append(o[0] / per_token)
            res["llama.cpp floor"].append(t[0] / per_token)
            tok_s, _, rate = ours(path, n, new, floor=True)
            res["gpt interleaved"].append(tok_s * tensor_bytes(path) / rate)
            floor = (f" (floor {per_token:.1f} tok/s; gpt {res['gpt interleaved'][-1]:.2f} of "
                     f"{rate / 1e9:.1f} GB/s interleaved)")
        print(f"round {r + 1} {name}: gpt {o[0]:.1f} tok/s, llama.cpp {t[0]:.1f} tok/s{floor}, "
              f"ratio {o[0] / t[0]:.2f}; RSS {o[1]:.0f} / {t[1]:.0f} MiB", flush=True)

print(f"\n{args.arch}, {args.threads} threads, median of {args.rounds} rounds, "
      f"gpt with a {args.gpt_kv_dtype} KV cache")
print("| workload | gpt tok/s | llama.cpp tok/s | gpt / llama.cpp | of floor gpt / llama.cpp "
      "| gpt of interleaved floor | peak RSS gpt / llama.cpp |")
print("|---|---|---|---|---|---|---|")
for name, res in results.items():
    g, l = statistics.median(res["gpt"]), statistics.median(res["llama.cpp"])
    floor = " "
    if res["gpt floor"]:
        by_round = ", ".join(f"{x:.2f}" for x in res["gpt floor"])
        floor = (f"{statistics.median(res['gpt floor']):.2f} / "
                 f"{statistics.median(res['llama.cpp floor']):.2f} (gpt by round {by_round})")
    inter = " "
    if res["gpt interleaved"]:
        by_round = ", ".join(f"{x:.2f}" for x in res["gpt interleaved"])
        inter = f"{statistics.median(res['gpt interleaved']):.2f} ({by_round})"
    rss = (statistics.median(res["gpt rss"]), statistics.median(res["llama.cpp rss"]))
    print(f"| {name} | {g:.1f} | {l:.1f} | {g / l:.2f} | {floor} | {inter} | "
          f"{rss[0]:.0f} / {rss[1]:.0f} MiB ({rss[0] / rss[1]:.2f}) |")
