"""Alternate two `gpt` builds (or two environments) on the same decoding work and report
the paired ratios: the way each change in docs/PERFORMANCE.md was measured.

    python3 bench/ab.py N A B [-- extra gpt bench flags]

A and B are each a `gpt` binary path, optionally followed by environment settings
separated by spaces, e.g. `"/tmp/gpt-old"` and `"target/release/gpt"`, or
`"target/release/gpt"` and `"target/release/gpt MIMALLOC_LARGE_OS_PAGES=1"`. Each of the
N rounds runs A then B once (`gpt bench --prompt-len 16 --new-tokens 128 --runs 1
--threads 2`, on $AB_MODEL); the medians and the median of the N ratios B/A are printed.
With AB_WORK=prefill the work is a prefill of 512 tokens instead (`--prompt-len 512
--new-tokens 0`), and its speed is compared; AB_SHAPE=PROMPT,NEW sets other lengths
(`AB_SHAPE=1024,64`: decoding after a long context). Each side's peak RSS (from `gpt bench`) is
printed beside its speed. Needs only the Python standard library.
"""
import json
import os
import statistics
import subprocess
import sys

args = sys.argv[1:]
extra = []
if "--" in args:
    extra = args[args.index("--") + 1:]
    args = args[:args.index("--")]
n, configs = int(args[0]), args[1:3]
model = os.environ.get("AB_MODEL", "/tmp/gpt2-124m-random")
prefill = os.environ.get("AB_WORK", "decode") == "prefill"
shape = ["512", "0"] if prefill else ["16", "128"]
shape = os.environ.get("AB_SHAPE", ",".join(shape)).split(",")
metric = "prefill_tokens_per_s" if prefill else "decode_tokens_per_s"
res = [[], []]
rss = [[], []]
for _ in range(n):
    for k, config in enumerate(configs):
        binary, *settings = config.split()
        env = dict(os.environ, **dict(s.split("=", 1) for s in settings))
        cmd = [binary, "bench", "--model", model, "--prompt-len", shape[0], "--new-tokens", shape[1],
               "--runs", "1", "--threads", "2", "--format", "json", *extra]
        out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
        res[k].append(json.loads(out)[metric])
        rss[k].append((json.loads(out)["peak_rss_bytes"] or 0) / 2**20)
for config, r, m in zip(configs, res, rss):
    print(f"{config!r:50} median {statistics.median(r):.1f} tok/s  {[round(x, 1) for x in r]}")
    print(f"{'':50} peak RSS median {statistics.median(m):.0f} MiB  {[round(x) for x in m]}")
ratios = [b / a for a, b in zip(*res)]
print(f"paired ratio B/A: median {statistics.median(ratios):.3f} "
      f"(range {min(ratios):.2f}-{max(ratios):.2f})")
