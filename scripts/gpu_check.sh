#!/usr/bin/env bash
# GPU checks, for a machine with an NVIDIA GPU (the `device` tool lends one to some
# sessions). Builds `gpt` with --features cuda (toolkit: the system's, or the registry
# wheels `.ci/cuda-toolkit` installs), then on every fixture model compares the GPU with
# the CPU -- per-token log-probabilities of a fixed sequence within 1e-3 absolute (f32;
# 2e-2 for q8_0 files, whose GPU kernels quantize activations differently) and 16 greedy
# tokens equal -- and runs `gpt bench` on the GPU (f32, f16, bf16; a GPT-2 124M directory
# given as $1 as well).
#
#     scripts/gpu_check.sh [path/to/gpt2-124m]
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${CUDA_COMPUTE_CAP:-}" ]; then
  CUDA_COMPUTE_CAP=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n1 | tr -d .)
  export CUDA_COMPUTE_CAP
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
cargo build --release -p gpt-blocks-cli --features cuda
gpt=target/release/gpt
fix=crates/block/tests/fixtures
models=("" "$fix/tiny" "$fix/inverse_layer_scale")
for f in "$fix"/families/*/; do [ -f "$f/config.json" ] && models+=("${f%/}"); done
models+=("$fix/gguf/llama.f32.gguf" "$fix/gguf/qwen2.q8_0.gguf" "$fix/gguf/gpt2.q8_0.gguf")
fail=0
for m in "${models[@]}"; do
  args=(); [ -n "$m" ] && args=(--model "$m")
  name=${m:-built-in}
  tol=1e-3; case "$m" in *q8_0*) tol=2e-2 ;; esac
  for dev in cpu cuda; do
    "$gpt" "${args[@]}" --device $dev score --ids 1,2,3,4,5,6,7,8,9,10,11,12 --format json > "/tmp/gpu_check.$dev.score"
    "$gpt" "${args[@]}" --device $dev generate --prompt-ids 1,2,3 --max-new-tokens 16 \
      --temperature 0 --format json 2>/dev/null > "/tmp/gpu_check.$dev.gen"
  done
  if python3 - "$tol" <<'PY'
import json, sys
tol = float(sys.argv[1])
cpu, gpu = (json.load(open(f"/tmp/gpu_check.{d}.score")) for d in ("cpu", "cuda"))
diff = max(abs(a - b) for a, b in zip(cpu["token_logprobs"], gpu["token_logprobs"]))
ids = [json.load(open(f"/tmp/gpu_check.{d}.gen"))["new_ids"] for d in ("cpu", "cuda")]
print(f"  log-prob max |cpu - cuda| = {diff:.2e} (tolerance {tol:g}); greedy tokens "
      + ("equal" if ids[0] == ids[1] else f"differ: {ids}"))
sys.exit(0 if diff <= tol and ids[0] == ids[1] else 1)
PY
  then echo "ok   $name"; else echo "FAIL $name"; fail=1; fi
done
for dtype in f32 f16 bf16; do
  echo "gpt bench, built-in model, cuda $dtype:"
  "$gpt" --device cuda --dtype $dtype bench --prompt-len 128 --new-tokens 64
done
if [ -n "${1:-}" ]; then
  for dtype in f32 f16 bf16; do
    echo "gpt bench, $1, cuda $dtype:"
    "$gpt" --model "$1" --device cuda --dtype $dtype bench --prompt-len 512 --new-tokens 128
  done
fi
exit $fail
