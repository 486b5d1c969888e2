//! With the `cuda` feature: compiles `kernels/attention.cu` (the fused attention kernel of
//! `src/flash/cuda.rs`) to PTX with the CUDA toolkit's `nvcc` (`$NVCC`, else `nvcc` on the
//! path), for `$CUDA_COMPUTE_CAP` (as Candle's kernels take it, e.g. `90`; else the first
//! GPU `nvidia-smi` lists; else 80, whose PTX newer GPUs compile when it loads). Without
//! the feature it does nothing.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=kernels/attention.cu");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo:rerun-if-env-changed=NVCC");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let cap = std::env::var("CUDA_COMPUTE_CAP")
        .ok()
        .or_else(|| {
            let out = Command::new("nvidia-smi")
                .args(["--query-gpu=compute_cap", "--format=csv,noheader"])
                .output()
                .ok()?;
            let first = String::from_utf8(out.stdout)
                .ok()?
                .lines()
                .next()?
                .replace('.', "");
            (!first.is_empty()).then_some(first)
        })
        .unwrap_or_else(|| "80".to_string());
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".to_string());
    let out =
        PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("attention.ptx");
    let status = Command::new(&nvcc)
        .args([
            "--ptx",
            &format!("-arch=sm_{cap}"),
            "-O3",
            "kernels/attention.cu",
            "-o",
        ])
        .arg(&out)
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => panic!("{nvcc} failed ({s}) compiling kernels/attention.cu for sm_{cap}"),
        Err(e) => panic!("cannot run {nvcc} ({e}): the cuda feature needs the CUDA toolkit's nvcc"),
    }
}
