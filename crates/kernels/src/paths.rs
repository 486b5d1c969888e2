//! Which tensors this workspace's CPU kernels take: those on the CPU. Everything else runs
//! Candle's generic ops, as on a GPU. With `GPT_GENERIC_PATHS=1` in the environment the CPU
//! takes the generic ops too: the code a GPU runs, run and checked on a machine without one
//! (`crates/cli/tests/generic_paths.rs` holds it to the CPU kernels on every fixture model;
//! the family, Hugging Face and PyTorch tests run again with it).

use std::sync::LazyLock;

use candle_core::Device;

/// `GPT_GENERIC_PATHS=1`: the CPU takes the paths of other devices. Read once.
static GENERIC: LazyLock<bool> =
    LazyLock::new(|| std::env::var("GPT_GENERIC_PATHS").is_ok_and(|v| v == "1"));

/// True where this workspace's CPU kernels (and CPU-only layouts: packed weights, half
/// precision matrices under f32 activations, in-place reads) apply to tensors on `device`:
/// the CPU, unless `GPT_GENERIC_PATHS=1`.
#[inline]
pub fn cpu_kernels(device: &Device) -> bool {
    device.is_cpu() && !*GENERIC
}
