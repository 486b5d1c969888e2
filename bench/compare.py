"""`gpt bench` against Hugging Face transformers on the same checkpoint, same machine, in
alternation.

    /tmp/ref/bin/python bench/compare.py [--arch gpt2|llama] [--model DIR] [--threads 2] [--rounds 3]

Without --model, a checkpoint with random weights is made by transformers (not committed):
GPT-2 124M in /tmp/gpt2-124m-random, or with --arch llama SmolLM-135M's Llama geometry (30
layers, width 576, 9 heads over 3 key/value heads, MLP 1536, vocabulary 49152, tied
embeddings) in /tmp/smollm-135m-random. Each round runs every workload once through
`target/release/gpt bench` (build it first: cargo build --release --bin gpt) and once
through transformers (f32, torch.set_num_threads = --threads, inference_mode, KV cache,
greedy, `generate()` for decoding); the medians over rounds and the ratio ours / theirs (in tokens/s, higher is
better for us) are printed.
"""
import argparse
import json
import os
import statistics
import subprocess
import time

import torch
from transformers import AutoModelForCausalLM

from checkpoints import random_checkpoint  # bench/checkpoints.py, beside this script
from floors import read_floor  # bench/floors.py

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
p = argparse.ArgumentParser()
p.add_argument("--arch", choices=["gpt2", "llama"], default="gpt2")
p.add_argument("--model")
p.add_argument("--threads", type=int, default=2)
p.add_argument("--rounds", type=int, default=3)
args = p.parse_args()
args.model = random_checkpoint(args.arch, args.model)
torch.set_num_threads(args.threads)
model = AutoModelForCausalLM.from_pretrained(args.model).eval()
vocab = model.config.vocab_size

# (name, batch, prompt_len, new_tokens, extra `gpt` flags); transformers always runs f32.
workloads = [
    ("prefill 512, last logits", 1, 512, 0, []),
    ("decode b1: 16 + 128 new", 1, 16, 128, []),
    ("decode b1, gpt f16 weights", 1, 16, 128, ["--dtype", "f16"]),
    ("decode b1, gpt bf16 weights", 1, 16, 128, ["--dtype", "bf16"]),
    ("decode b1, gpt q8_0 weights", 1, 16, 128, ["--quantize", "q8_0"]),
    ("decode b8: 16 + 64 new", 8, 16, 64, []),
]
if args.arch == "llama":
    # The rows the families issue asks for.
    workloads = [w for w in workloads if w[0] in (
        "prefill 512, last logits", "decode b1: 16 + 128 new", "decode b1, gpt q8_0 weights")]


def prompt(b, n):
    # The same ids `gpt bench` uses.
    ids = [(i * 2654435761) % vocab for i in range(b * n)]
    return torch.tensor(ids).view(b, n)


@torch.inference_mode()
def theirs(b, n, new):
    ids = prompt(b, n)
    t0 = time.perf_counter()
    out = model(ids, use_cache=True, logits_to_keep=1)
    t1 = time.perf_counter()
    if not new:
        return b * n / (t1 - t0), 0.0
    # Decode as people run it: generate() with its cache, greedy; its own prefill is
    # subtracted using the prefill just timed.
    t2 = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                   min_new_tokens=new, pad_token_id=0)
    t3 = time.perf_counter()
    return b * n / (t1 - t0), b * new / ((t3 - t2) - (t1 - t0))


def ours(b, n, new, extra):
    cmd = [os.path.join(ROOT, "target", "release", "gpt"), "bench", "--model", args.model,
           "--batch", str(b), "--prompt-len", str(n), "--new-tokens", str(new), "--runs", "1",
           "--threads", str(args.threads), "--format", "json", *extra]
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    return out["prefill_tokens_per_s"], out["decode_tokens_per_s"], out["peak_rss_bytes"]


@torch.inference_mode()
def gemm_floor():
    """The f32 GEMM rate with these threads: torch.mm on GPT-2's MLP shape (median of 10)."""
    a, w = torch.randn(512, 768), torch.randn(768, 3072)
    torch.mm(a, w)
    rates = []
    for _ in range(10):
        t0 = time.perf_counter()
        torch.mm(a, w)
        rates.append(2 * 512 * 768 * 3072 / (time.perf_counter() - t0))
    return statistics.median(rates)


f32_bytes = sum(p.numel() for p in model.parameters()) * 4
theirs(1, 8, 2)  # warm-up
results = {w[0]: {"ours": [], "theirs": [], "rss": []} for w in workloads}
# The read floor moves from minute to minute with the neighbours' load: f32 decoding is
# compared with the floor measured just before and just after it (their mean).
bandwidths, gemms, of_floor = [], [], []
for r in range(args.rounds):
    gemms.append(gemm_floor())
    for name, b, n, new, extra in workloads:
        f32_decode = name == "decode b1: 16 + 128 new"
        before = read_floor() if f32_decode else None
        o = ours(b, n, new, extra)
        if f32_decode:
            bandwidths.append((before + read_floor()) / 2)
        t = theirs(b, n, new)
        key = 1 if new else 0
        results[name]["ours"].append(o[key])
        results[name]["theirs"].append(t[key])
        results[name]["rss"].append(o[2])
        if f32_decode:
            of_floor.append(o[key] / (bandwidths[-1] / f32_bytes))

bandwidth, gemm = statistics.median(bandwidths), statistics.median(gemms)
print(f"threads {args.threads}, {args.rounds} rounds, torch {torch.__version__}, model {args.model}")
print(f"floors: memory read {bandwidth / 1e9:.1f} GB/s -> f32 decode b1 at most "
      f"{bandwidth / f32_bytes:.1f} tok/s ({f32_bytes / 1e6:.0f} MB of weights per token); "
      f"torch f32 GEMM [512x768]x[768x3072] {gemm / 1e9:.0f} GFLOP/s (medians over rounds; "
      f"read {', '.join(f'{b / 1e9:.1f}' for b in bandwidths)} GB/s)")
print(f"f32 decode b1 against the read floor of its round: "
      f"{', '.join(f'{x:.2f}' for x in of_floor)} (median {statistics.median(of_floor):.2f})")
print(f"{'workload':30} {'gpt tok/s':>10} {'transformers':>13} {'ratio':>6} {'gpt peak RSS':>13}")
for name, *_ in workloads:
    o = statistics.median(results[name]["ours"])
    t = statistics.median(results[name]["theirs"])
    rss = max(results[name]["rss"]) / 2**20
    print(f"{name:30} {o:10.1f} {t:13.1f} {o / t:6.2f} {rss:10.0f} MiB")
