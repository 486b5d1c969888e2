"""Where decoding's time goes, against the read floor: `gpt bench` built with the `profile`
feature splits each decoding step into projections, attention and the rest; the read floor
(bench/floors.py, torch summing 1 GiB with the same threads) is measured just before and
after each run, their mean. Per run it prints decoding's share of the floor (as
`bench/gguf_compare.py` does: tokens/s x tensor bytes / bandwidth), the projections' own
share (tensor bytes / their time / bandwidth: 1.0 = the products alone read the weights as
fast as a plain sum does), and the milliseconds per step of each part; then medians.

    cargo build --release --bin gpt --features profile
    /tmp/ref/bin/python bench/decode_split.py [--rounds 3] A.gguf [B.gguf ...]

Decodes 128 tokens after 16 (`gpt bench --prompt-len 16 --new-tokens 128`, f16 KV cache,
2 threads), the models in turn within each round. Needs REFERENCE.md's Python environment
(torch) and llama.cpp's `gguf-py` (the tree of scripts/gguf_fixtures.py) for the files'
tensor bytes.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
p = argparse.ArgumentParser()
p.add_argument("models", nargs="+")
p.add_argument("--rounds", type=int, default=3)
p.add_argument("--threads", type=int, default=2)
args = p.parse_args()

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import gguf_fixtures  # noqa: E402  (where llama.cpp's tree is)
import torch  # noqa: E402
from floors import read_floor  # noqa: E402  (bench/floors.py, beside this script)

sys.path.insert(0, os.path.join(gguf_fixtures.LLAMA_CPP, "gguf-py"))
from gguf import GGUFReader  # noqa: E402  (llama.cpp's own reader)

torch.set_num_threads(args.threads)
weights = {m: sum(int(t.n_bytes) for t in GGUFReader(m).tensors) for m in args.models}
rows = {m: [] for m in args.models}
for _ in range(args.rounds):
    for m in args.models:
        before = read_floor()
        cmd = [os.path.join(ROOT, "target", "release", "gpt"), "bench", "--model", m,
               "--prompt-len", "16", "--new-tokens", "128", "--runs", "1",
               "--threads", str(args.threads), "--kv-dtype", "f16", "--format", "json"]
        out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        floor = (before + read_floor()) / 2
        split = out.get("decode_ms_per_step")
        if split is None:
            sys.exit("gpt was built without the profile feature: "
                     "cargo build --release --bin gpt --features profile")
        row = (out["decode_tokens_per_s"] * weights[m] / floor,
               weights[m] / (split["projections"] * 1e-3) / floor,
               split["projections"], split["attention"], split["rest"], floor / 1e9)
        rows[m].append(row)
        print(f"{os.path.basename(m)}: {row[0]:.2f} of the floor, projections {row[1]:.2f}; "
              f"ms per step: projections {row[2]:.2f}, attention {row[3]:.3f}, "
              f"rest {row[4]:.3f}; floor {row[5]:.1f} GB/s", flush=True)

print("\n| file | of floor | projections of floor | projections ms | attention ms | rest ms "
      "| floor GB/s |")
print("|---|---|---|---|---|---|---|")
for m in args.models:
    c = list(zip(*rows[m]))
    med = [statistics.median(x) for x in c]
    print(f"| {os.path.basename(m)} | {med[0]:.2f} ({min(c[0]):.2f}–{max(c[0]):.2f}) | "
          f"{med[1]:.2f} | {med[2]:.2f} | {med[3]:.3f} | {med[4]:.3f} | "
          f"{min(c[5]):.0f}–{max(c[5]):.0f} |")
