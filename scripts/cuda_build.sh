#!/usr/bin/env bash
# Builds `gpt` with --features cuda on a machine with no GPU and no CUDA install, for a GPU
# machine to run (as the H100 lent to one session ran it: docs/PERFORMANCE.md, "On an
# NVIDIA GPU"). `.ci/cuda-toolkit`'s compiler, and to link against: cuBLAS, cuRAND and NVRTC
# from the registry's wheels (pinned to CUDA 13.0 like the toolkit) and a stub of the
# driver's libcuda.so, as the CUDA toolkit ships in lib/stubs (the wheels do not): every
# driver function cudarc binds, each returning an error, with the driver's soname, so the
# GPU machine's own libcuda.so.1 is loaded when the program runs.
#
#     CUDA_COMPUTE_CAP=90 scripts/cuda_build.sh      # -> target/cuda-release/release/gpt
#
# On the GPU machine the program needs libcublas.so.13, libcublasLt.so.13, libcurand.so.10
# and libcudart.so.13 on its library path (PyTorch's CUDA 13 wheels carry them).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=target/cuda-toolkit
eval "$(.ci/cuda-toolkit "$dir")"
"$dir/bin/pip" install -q --disable-pip-version-check \
  nvidia-cublas==13.0.2.14 nvidia-curand==10.4.5.25 nvidia-cuda-nvrtc==13.0.88 >&2
link=$PWD/target/cuda-link
mkdir -p "$link"
for lib in cublas.so.13 cublasLt.so.13 nvrtc.so.13 curand.so.10 cudart.so.13; do
  ln -sf "$CUDA_ROOT/lib/lib$lib" "$link/lib${lib%.so.*}.so"
done
cudarc=$(cargo metadata --format-version 1 --all-features | python3 -c \
  "import json, sys; print(next(p['manifest_path'] for p in json.load(sys.stdin)['packages'] if p['name'] == 'cudarc'))")
grep -o '^pub unsafe fn cu[A-Za-z0-9_]*' "$(dirname "$cudarc")/src/driver/sys/mod.rs" \
  | sed 's/pub unsafe fn //' | sort -u | sed 's/.*/int &(void) { return 999; }/' > "$link/stub.c"
cc -shared -fPIC -o "$link/libcuda.so" -Wl,-soname,libcuda.so.1 "$link/stub.c"
CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90} RUSTFLAGS="-L native=$link" \
  CARGO_TARGET_DIR=target/cuda-release cargo build --release -p gpt-blocks-cli --features cuda
