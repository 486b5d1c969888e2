"""`gpt bench --device cuda` beside its two peers on the same GPU, in alternation:
transformers on the Hugging Face directory (its SDPA attention, in each of --dtypes), and
llama.cpp built with CUDA (scripts/llama_cuda_build.sh) on the same GGUF files (--kinds).

    python3 bench/gpu_compare.py [--gpt target/release/gpt] [--arch gpt2 llama qwen3]
                                 [--dtypes bf16] [--llama-cuda DIR --kinds f16 q8_0 q4_0]
                                 [--workloads 1x512x128 1x2048x0 16x128x128] [--rounds 2]
                                 [--attention reference|fused]

The checkpoints are bench/checkpoints.py's random-weight GPT-2 124M, SmolLM-135M (`llama`)
and Qwen3-0.6B geometry, made here by transformers if missing; the GGUF files are written
from them by `gpt convert --type KIND` (files llama.cpp runs as gpt does:
scripts/gguf_export_check.py), and gpt runs an f16 file in f16 as llama.cpp does. A
workload BATCHxPROMPTxNEW is BATCH prompts of PROMPT tokens, then NEW tokens decoded for
each (NEW may be 0: prefill alone); one whose positions exceed the model's context (GPT-2's
1,024) is skipped and said so, and a program that fails loses its own rows, not the run.

- gpt: one `gpt bench` per workload (its own median of --runs after a warm-up), prefill and
  decoding rates.
- transformers: a timed forward pass of the prompt with its KV cache (`logits_to_keep=1`),
  then `generate()` greedy with the same number of new tokens, its own prefill subtracted,
  each timed between `torch.cuda.synchronize()` calls (median of --runs after a warm-up).
- llama.cpp: `llama-batched-bench` (`-ngl 99`, its defaults otherwise: flash attention as it
  chooses, an f16 KV cache), the same workload twice in one process and the second timed
  (the first is its warm-up): BATCH separate prompts of PROMPT tokens, then NEW steps of
  BATCH tokens, as `gpt bench` does. (Its `llama-bench` runs one sequence only.)

Medians over rounds and the ratio gpt / peer (tokens/s: above 1, gpt is faster) are printed
as a table, and with --json written to a file (after each comparison).
"""
import argparse
import json
import os
import statistics
import subprocess
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from checkpoints import random_checkpoint  # bench/checkpoints.py, beside this script

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
p = argparse.ArgumentParser()
p.add_argument("--gpt", default=os.path.join(ROOT, "target", "release", "gpt"))
p.add_argument("--arch", nargs="+", default=["gpt2", "llama", "qwen3"],
               choices=["gpt2", "llama", "qwen3", "gemma3"])
p.add_argument("--dtypes", nargs="*", default=["bf16"], choices=["f32", "f16", "bf16"],
               help="transformers beside gpt in these dtypes (none: --dtypes with no value)")
p.add_argument("--llama-cuda", help="the folder of llama-batched-bench and its libraries "
               "(scripts/llama_cuda_build.sh); without it llama.cpp is not run")
p.add_argument("--kinds", nargs="+", default=["f16", "q8_0", "q4_0"],
               help="GGUF types for the llama.cpp comparison (gpt convert --type)")
p.add_argument("--gguf-dir", default="/tmp/gpu-compare-gguf")
p.add_argument("--rounds", type=int, default=2)
p.add_argument("--runs", type=int, default=3, help="timed runs per gpt bench and transformers")
p.add_argument("--device", default="cuda", help="cpu tries the script out without a GPU")
p.add_argument("--workloads", nargs="+", default=["1x512x128", "1x2048x0", "16x128x128"],
               help="BATCHxPROMPTxNEW each (NEW may be 0: prefill alone)")
p.add_argument("--attention", choices=["reference", "fused"], default="reference",
               help="fused: gpt runs with MHA_CUDA_ATTENTION=fused (mha's fused CUDA kernel)")
p.add_argument("--json", help="also write the rows to this file")
args = p.parse_args()
TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
# (batch, prompt_len, new_tokens)
WORKLOADS = [tuple(int(n) for n in w.split("x")) for w in args.workloads]


def prompt(vocab, b, n):
    # The same ids `gpt bench` uses.
    ids = [(i * 2654435761) % vocab for i in range(b * n)]
    return torch.tensor(ids, device=args.device).view(b, n)


def sync():
    if args.device == "cuda":
        torch.cuda.synchronize()


def timed(f):
    sync()
    t0 = time.perf_counter()
    f()
    sync()
    return time.perf_counter() - t0


@torch.inference_mode()
def transformers_rates(model, b, n, new):
    ids = prompt(model.config.vocab_size, b, n)
    mask = torch.ones_like(ids)
    prefill, decode = [], []
    for run in range(args.runs + 1):  # the first is a warm-up
        tp = timed(lambda: model(ids, use_cache=True, logits_to_keep=1))
        tg = tp
        if new:
            tg = timed(lambda: model.generate(ids, attention_mask=mask, do_sample=False,
                                              max_new_tokens=new, min_new_tokens=new,
                                              pad_token_id=0))
        if run:
            prefill.append(b * n / tp)
            decode.append(b * new / (tg - tp) if new else 0.0)
    return statistics.median(prefill), statistics.median(decode)


def gpt_rates(path, dtype, b, n, new):
    cmd = [args.gpt, "--model", path, "--device", args.device, "bench", "--batch", str(b),
           "--prompt-len", str(n), "--new-tokens", str(new), "--runs", str(args.runs),
           "--format", "json"]
    if dtype:
        cmd[5:5] = ["--dtype", dtype]
    env = dict(os.environ, MHA_CUDA_ATTENTION=args.attention)
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True,
                                    env=env).stdout)
    return out["prefill_tokens_per_s"], out["decode_tokens_per_s"]


def llama_rates(path, b, n, new):
    exe = os.path.join(args.llama_cuda, "llama-batched-bench")
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = ":".join(x for x in [args.llama_cuda, env.get("LD_LIBRARY_PATH")]
                                      if x)
    cmd = [exe, "-m", path, "-ngl", "99", "-c", str(b * (n + new + 16)), "-b", "2048",
           "-npp", f"{n},{n}", "-ntg", str(new), "-npl", str(b), "--output-format", "jsonl"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    rows = [json.loads(line) for line in (out.stdout + out.stderr).splitlines()
            if line.startswith("{")]
    if len(rows) != 2:
        raise SystemExit(f"llama-batched-bench gave {len(rows)} rows, not 2: {' '.join(cmd)}")
    return rows[1]["speed_pp"], rows[1]["speed_tg"] if new else 0.0


def gguf(arch, path, kind):
    os.makedirs(args.gguf_dir, exist_ok=True)
    out = os.path.join(args.gguf_dir, f"{arch}.{kind}.gguf")
    if not os.path.exists(out):
        subprocess.run([args.gpt, "--model", path, "--device", "cpu", "convert", "--type", kind,
                        "--out", out + ".part"], check=True, capture_output=True, text=True)
        os.replace(out + ".part", out)
    return out


def fits(path, b, n, new):
    cfg = AutoConfig.from_pretrained(path)
    ctx = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions")
    if n + new > ctx:
        print(f"{os.path.basename(path)}: {b}x{n}x{new} skipped, past its {ctx} positions")
        return False
    return True


table = []


def compare(arch, workloads, what, peer, ours, theirs):
    """Alternates `ours(w)` and `theirs(w)` over the workloads for --rounds; prints and
    keeps the medians."""
    rows = {w: ([], []) for w in workloads}
    for _ in range(args.rounds):
        for w in rows:
            try:
                got = ours(*w), theirs(*w)
            except subprocess.CalledProcessError as e:
                # One failing program or workload loses its own rows, not the run's.
                err = (e.stderr or "").strip().splitlines()[-3:]
                print(f"{arch:6} {what:6} {peer:12} {w}: failed: {' '.join(e.cmd)}: "
                      f"{' | '.join(err)}", flush=True)
                continue
            rows[w][0].append(got[0])
            rows[w][1].append(got[1])
    for (b, n, new), (o, t) in rows.items():
        if not o:
            continue
        parts = [(0, f"b{b} prefill {n}"), (1, f"b{b} decode {new} after {n}")]
        for k, work in parts[:1 + (new > 0)]:
            om = statistics.median(x[k] for x in o)
            tm = statistics.median(x[k] for x in t)
            row = dict(arch=arch, weights=what, peer=peer, workload=work, gpt=om, peer_rate=tm,
                       ratio=om / tm, by_round=[x[k] / y[k] for x, y in zip(o, t)])
            table.append(row)
            print(f"{arch:6} {what:6} {peer:12} {work:24} {om:10.1f} {tm:10.1f} "
                  f"{om / tm:6.2f}  ({' '.join(f'{r:.2f}' for r in row['by_round'])})",
                  flush=True)
    if args.json:  # after every comparison: a run cut short keeps what it measured
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)


where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
print(f"torch {torch.__version__}, {where}, {args.rounds} rounds, gpt's attention: "
      f"{args.attention}")
print(f"{'model':6} {'weights':6} {'peer':12} {'workload':24} {'gpt tok/s':>10} "
      f"{'peer tok/s':>10} {'ratio':>6}  (by round)")
for arch in args.arch:
    path = random_checkpoint(arch)
    workloads = [w for w in WORKLOADS if fits(path, *w)]
    for dtype in args.dtypes:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=TORCH_DTYPES[dtype],
                                                     attn_implementation="sdpa")
        model = model.to(args.device).eval()
        compare(arch, workloads, dtype, "transformers",
                lambda b, n, new: gpt_rates(path, dtype, b, n, new),
                lambda b, n, new: transformers_rates(model, b, n, new))
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if args.llama_cuda:
        for kind in args.kinds:
            try:
                file = gguf(arch, path, kind)
            except subprocess.CalledProcessError as e:
                print(f"{arch}: gpt convert --type {kind} failed: {e.stderr.strip()}")
                continue
            # An f16 file computes in f16 on the GPU (as llama.cpp does); gpt's default
            # there would widen its matrices to f32. Block formats take f32 activations.
            dtype = "f16" if kind == "f16" else None
            compare(arch, workloads, kind, "llama.cpp",
                    lambda b, n, new: gpt_rates(file, dtype, b, n, new),
                    lambda b, n, new: llama_rates(file, b, n, new))
