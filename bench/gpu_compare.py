"""`gpt bench --device cuda` against Hugging Face transformers on the same GPU, same
checkpoint, same dtype, in alternation.

    python3 bench/gpu_compare.py [--gpt target/release/gpt] [--arch gpt2 llama] [--rounds 2]
                                 [--attention reference|fused]

The checkpoints are bench/checkpoints.py's random-weight GPT-2 124M and SmolLM-135M
geometry (made here by transformers if missing). For each weight dtype (f32, f16, bf16) and
batch (1 and 8), one `gpt bench` run (its own median of --runs 3 after a warm-up) gives the
prefill rate of a 512-token prompt (128 per row at batch 8) and the decoding rate of the
new tokens after it (128 at batch 1, 64 at batch 8; `--workloads` for others); transformers
does the same work: a timed forward pass of the prompt with its KV cache (`logits_to_keep=1`), then `generate()`
greedy with the same number of new tokens, its own prefill subtracted, each timed between
`torch.cuda.synchronize()` calls (median of 3 after a warm-up). Medians over rounds and the
ratio gpt / transformers (tokens/s, higher is better for gpt) are printed.
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

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
p = argparse.ArgumentParser()
p.add_argument("--gpt", default=os.path.join(ROOT, "target", "release", "gpt"))
p.add_argument("--arch", nargs="+", default=["gpt2", "llama"], choices=["gpt2", "llama"])
p.add_argument("--dtypes", nargs="+", default=["f32", "f16", "bf16"])
p.add_argument("--rounds", type=int, default=2)
p.add_argument("--device", default="cuda", help="cpu tries the script out without a GPU")
p.add_argument("--workloads", nargs="+", default=["1x512x128", "8x128x64"],
               help="BATCHxPROMPTxNEW each (NEW may be 0: prefill alone)")
p.add_argument("--attention", choices=["reference", "fused"], default="reference",
               help="fused: gpt runs with MHA_CUDA_ATTENTION=fused (mha's fused CUDA kernel)")
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
def theirs(model, b, n, new, runs=3):
    ids = prompt(model.config.vocab_size, b, n)
    mask = torch.ones_like(ids)
    prefill, decode = [], []
    for run in range(runs + 1):  # the first is a warm-up
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


def ours(path, dtype, b, n, new):
    cmd = [args.gpt, "--model", path, "--device", args.device, "--dtype", dtype, "bench",
           "--batch", str(b), "--prompt-len", str(n), "--new-tokens", str(new), "--runs", "3",
           "--format", "json"]
    env = dict(os.environ, MHA_CUDA_ATTENTION=args.attention)
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True,
                                    env=env).stdout)
    return out["prefill_tokens_per_s"], out["decode_tokens_per_s"]


where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
print(f"torch {torch.__version__}, {where}, {args.rounds} rounds, gpt's attention: "
      f"{args.attention}")
print(f"{'model':6} {'dtype':5} {'workload':22} {'gpt tok/s':>10} {'transformers':>13} "
      f"{'ratio':>6}")
for arch in args.arch:
    path = random_checkpoint(arch)
    for dtype in args.dtypes:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=TORCH_DTYPES[dtype])
        model = model.to(args.device).eval()
        rows = {w: ([], []) for w in WORKLOADS}
        for _ in range(args.rounds):
            for w in WORKLOADS:
                rows[w][0].append(ours(path, dtype, *w))
                rows[w][1].append(theirs(model, *w))
        for (b, n, new), (o, t) in rows.items():
            rows_of = [(0, f"b{b} prefill {n}"), (1, f"b{b} decode {new} after {n}")]
            for k, what in rows_of[:1 + (new > 0)]:
                om = statistics.median(x[k] for x in o)
                tm = statistics.median(x[k] for x in t)
                print(f"{arch:6} {dtype:5} {what:22} {om:10.1f} {tm:13.1f} {om / tm:6.2f}",
                      flush=True)
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()
