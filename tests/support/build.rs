//! Builds `cuda_emulation.cpp`: mha's CUDA attention kernel compiled for the CPU with the
//! CUDA built-ins it uses emulated, linked into this test-only package for
//! `tests/cuda_attention.rs`.

fn main() {
    let kernel = "crates/mha/kernels/attention.cu";
    let harness = "tests/support/cuda_emulation.cpp";
    println!("cargo:rerun-if-changed={kernel}");
    println!("cargo:rerun-if-changed={harness}");
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .opt_level(1)
        .file(harness)
        .compile("mha_cuda_emulation");
    println!("cargo:rustc-link-lib=pthread");
}
