#!/usr/bin/env bash
# llama.cpp built with CUDA, on a machine with no GPU and no CUDA install, for
# bench/gpu_compare.py to run beside gpt on a lent GPU, which has no CUDA compiler (ggml's
# CUDA kernels for one architecture compile in about 20 minutes on 2 cores, more than a
# whole lease). The compiler and libraries are scripts/cuda_build.sh's (CUDA 13.0 from the
# registry's wheels: nvcc, the runtime, cuBLAS); the driver's libcuda.so is a stub of
# every function cuda.h declares, under its soname, so that the GPU machine's own
# libcuda.so.1 is loaded when the programs run.
#
#     LLAMA_CPP=/path/to/llama.cpp CUDA_COMPUTE_CAP=90 scripts/llama_cuda_build.sh [OUT]
#
# LLAMA_CPP: the tree llama-cpp-python's source package vendors (as for
# scripts/gguf_fixtures.py: pip download --no-deps --no-binary llama-cpp-python
# llama-cpp-python==0.3.36 -d /tmp/lcp, then unpack it; LLAMA_CPP=.../vendor/llama.cpp).
# Needs cmake and ninja (from PyPI).
#
# Builds llama-bench and llama-batched-bench (shared libraries beside them) into OUT
# (default target/llama-cuda/bin) and packs them as OUT/../llama-cuda.tar.xz (22 MB for
# compute capability 9.0), small enough to carry to the GPU machine. There they need
# libcudart.so.13, libcublas.so.13 and libcublasLt.so.13 on the library path, as gpt does
# (PyTorch's CUDA 13 wheels carry them; scripts/gpu_lease.sh finds them).
# The CPU code is built for AVX2 (x86-64-v3), not for this machine: the GPU machine's host
# is another CPU, and every layer runs on the GPU (`-ngl 99`).
set -euo pipefail
cd "$(dirname "$0")/.."
src=$(cd "${LLAMA_CPP:?set LLAMA_CPP to the llama.cpp source tree}" && pwd -P)
out=$(mkdir -p "${1:-target/llama-cuda/bin}" && cd "${1:-target/llama-cuda/bin}" && pwd)
work=$(dirname "$out")
dir=target/cuda-toolkit
eval "$(.ci/cuda-toolkit "$dir")"
"$dir/bin/pip" install -q --disable-pip-version-check nvidia-cublas==13.0.2.14 >&2
lib=$CUDA_ROOT/lib

# The toolkit's layout, as nvcc and CMake's FindCUDAToolkit look for it: lib64, the
# libraries under their plain names, and in lib64/stubs the driver's: every name the
# preprocessed cuda.h declares as a function (after its macros map cuMemAlloc to
# cuMemAlloc_v2 and the like), each returning an error.
[ -e "$CUDA_ROOT/lib64" ] || ln -s lib "$CUDA_ROOT/lib64"
for name in cudart cublas cublasLt; do ln -sf "lib$name.so.13" "$lib/lib$name.so"; done
mkdir -p "$lib/stubs"
echo '#include <cuda.h>' | cc -E -I"$CUDA_ROOT/include" - \
  | grep -oE '\bcu[A-Z][A-Za-z0-9_]*[[:space:]]*\(' | tr -d '( \t' | sort -u \
  | sed 's/.*/int &(void) { return 999; }/' > "$lib/stubs/cuda.c"
cc -shared -fPIC -o "$lib/stubs/libcuda.so" -Wl,-soname,libcuda.so.1 "$lib/stubs/cuda.c"

cmake -S "$src" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DGGML_CUDA=ON -DCMAKE_CUDA_COMPILER="$CUDA_ROOT/bin/nvcc" \
  -DCMAKE_CUDA_ARCHITECTURES="${CUDA_COMPUTE_CAP:-90}-real" \
  -DCUDAToolkit_ROOT="$CUDA_ROOT" -DCMAKE_EXE_LINKER_FLAGS="-Wl,-rpath-link,$lib" \
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
  -DGGML_BMI2=ON -DGGML_OPENMP=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF >&2
cmake --build "$work/build" --target llama-bench llama-batched-bench -j "${JOBS:-2}" >&2
# The programs and their libraries (no OpenMP or OpenSSL ones: the GPU machine may lack
# them), to run with that folder on LD_LIBRARY_PATH.
cp -a "$work/build/bin/." "$out/"
tar -C "$work" -cJf "$work/llama-cuda.tar.xz" "$(basename "$out")"
ls -l "$work/llama-cuda.tar.xz" >&2
