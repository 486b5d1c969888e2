#!/usr/bin/env bash
# Builds `gpt` with --features cuda on a machine with no GPU and no CUDA install, for a GPU
# machine to run (as an H100 ran it: docs/PERFORMANCE.md, "On an
# NVIDIA GPU"). `.ci/cuda-toolkit`'s compiler, and to link against (`.ci/cuda-link`):
# cuBLAS, cuRAND and NVRTC from the registry's wheels (pinned to CUDA 13.0 like the
# toolkit) and a stub of the driver's libcuda.so, as the CUDA toolkit ships in lib/stubs
# (the wheels do not), so the GPU machine's own libcuda.so.1 is loaded when the program
# runs.
#
#     CUDA_COMPUTE_CAP=90 scripts/cuda_build.sh  # -> target/cuda-release/release/gpt, gpt.xz
#
# On the GPU machine the program needs libcublas.so.13, libcublasLt.so.13, libcurand.so.10
# and libcudart.so.13 on its library path (PyTorch's CUDA 13 wheels carry them).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=target/cuda-toolkit
eval "$(.ci/cuda-toolkit "$dir")"
"$dir/bin/pip" install -q --disable-pip-version-check \
  nvidia-cublas==13.0.2.14 nvidia-curand==10.4.5.25 nvidia-cuda-nvrtc==13.0.88 >&2
CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90} RUSTFLAGS="-L native=$(.ci/cuda-link)" \
  CARGO_TARGET_DIR=target/cuda-release cargo build --release -p gpt-blocks-cli --features cuda
# Packed for the GPU machine: the program (92 MB, most of it Candle's and mha's PTX) is more
# than a lease carries (64 MiB in all); packed, about 20 MB (scripts/gpu_lease.sh unpacks it).
xz -T0 -c target/cuda-release/release/gpt > target/cuda-release/gpt.xz
