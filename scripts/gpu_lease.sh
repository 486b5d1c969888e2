#!/usr/bin/env bash
# What a lent GPU checks, in one command that fits a lease (the device machine runs a
# command for at most 10 minutes and lends 15 in all), from programs built here, where the
# GPU machine (no Rust, no network, no CUDA compiler) cannot build them:
#
#     CUDA_COMPUTE_CAP=90 scripts/cuda_build.sh                     # gpt
#     LLAMA_CPP=... CUDA_COMPUTE_CAP=90 scripts/llama_cuda_build.sh # llama.cpp, packed
#
# then, on the GPU machine, carrying target/cuda-release/gpt.xz and
# target/llama-cuda/llama-cuda.tar.xz (about 20 MB each; unpacked here with Python's lzma,
# as the machine may have no xz):
#
#     scripts/gpu_lease.sh OUT [check] [compare]     # both by default
#
# check: scripts/gpu_check.sh (every fixture on the GPU against the CPU, attention by the
# reference path and by mha's fused kernels). compare: bench/gpu_compare.py, one round,
# gpt beside transformers (bf16) and beside llama.cpp (f16, q8_0, q4_0) on SmolLM-135M,
# Qwen3-0.6B and GPT-2 124M geometry, with attention by the fused kernels when the check
# passed with them, else by the reference path. Each part has a time limit; logs and
# the comparison's rows (JSON) go to OUT. The libraries both programs load (the CUDA 13
# runtime, cuBLAS, cuRAND, NVRTC) are taken from the GPU machine's PyTorch wheels, or
# from LD_LIBRARY_PATH where those lack one.
set -uo pipefail
cd "$(dirname "$0")/.."
out=$(mkdir -p "${1:?usage: scripts/gpu_lease.sh OUT [check] [compare]}" && cd "$1" && pwd)
shift
parts=${*:-check compare}
gpt=$PWD/target/cuda-release/release/gpt
if [ ! -x "$gpt" ] && [ -f target/cuda-release/gpt.xz ]; then
  mkdir -p "$(dirname "$gpt")"
  python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" \
    target/cuda-release/gpt.xz "$gpt" && chmod +x "$gpt"
fi
[ -x "$gpt" ] || { echo "no $gpt: build it with scripts/cuda_build.sh and carry it" >&2; exit 1; }
# Where the Python packages hold each library both programs load (gpt: all five).
libs=$(python3 - <<'PY'
import glob, os, site, sys
dirs, missing = set(), []
for name in ("libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13", "libcurand.so.10",
             "libnvrtc.so.13"):
    found = [p for root in site.getsitepackages()
             for p in glob.glob(f"{root}/nvidia/**/{name}", recursive=True)]
    dirs.update(os.path.dirname(p) for p in found[:1])
    missing += [] if found else [name]
print(":".join(sorted(dirs)))
if missing:
    sys.exit(f"not among the Python packages: {' '.join(missing)} (CUDA 13's; set "
             "LD_LIBRARY_PATH to where they are and run again)")
PY
) || [ -n "${LD_LIBRARY_PATH:-}" ] || exit 1
export LD_LIBRARY_PATH=$libs${libs:+${LD_LIBRARY_PATH:+:}}${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader \
  | tee "$out/gpu.txt"
attention=reference
if [[ " $parts " == *" check "* ]]; then
  GPT=$gpt GPU_CHECK_BENCH=0 timeout 270 scripts/gpu_check.sh > "$out/check.log" 2>&1
  echo "check: exit $?" | tee -a "$out/check.log"
  # The fused kernels are timed only where every fixture ran and passed with them.
  models=$(sed -n 's/^models: //p' "$out/check.log")
  if [ -n "$models" ] && [ "$(grep -c '^ok .*(fused attention)$' "$out/check.log")" = "$models" ]
  then
    attention=fused
  fi
fi
if [[ " $parts " == *" compare "* ]]; then
  llama=$PWD/target/llama-cuda
  [ -x "$llama/bin/llama-batched-bench" ] \
    || python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" \
      "$llama/llama-cuda.tar.xz" "$llama"
  # The Llama geometries first: a run cut short by its limit keeps the rows it finished
  # (the JSON is written after each comparison).
  (cd bench && timeout 300 python3 gpu_compare.py --gpt "$gpt" --rounds 1 --runs 2 \
      --arch llama qwen3 gpt2 --attention $attention --llama-cuda "$llama/bin" \
      --json "$out/compare.json") \
    > "$out/compare.log" 2>&1
  echo "compare: exit $?" | tee -a "$out/compare.log"
fi
tail -n 40 "$out"/*.log
