//! Checks a checkpoint's table of tensors against its configuration before anything is
//! allocated, so that a broken or hostile file is refused with a message instead of
//! aborting the process on a huge allocation.

use std::collections::HashMap;

use candle_core::{bail, DType, Result};

use crate::{GptConfig, NormPlacement};

/// One tensor a GPT-2 checkpoint of a configuration holds.
pub(crate) struct Expected<'a> {
    /// Name from the checkpoint's root: `transformer.wte.weight`, `lm_head.weight`.
    pub name: &'a str,
    /// Shape in Hugging Face's layout (Conv1D weights `[in, out]`).
    pub shape: &'a [usize],
    /// A bias that nanoGPT's `bias=False` leaves out.
    pub is_bias: bool,
}

/// Calls `f` on every tensor the model reads, in order: embeddings first, then block after
/// block. Walking lazily keeps a config claiming a billion layers cheap: the first missing
/// block stops it.
pub(crate) fn for_each_tensor(
    cfg: &GptConfig,
    mut f: impl FnMut(Expected<'_>) -> Result<()>,
) -> Result<()> {
    let (v, d, i) = (cfg.vocab_size, cfg.n_embd, cfg.inner_dim());
    let mut one = |name: &str, shape: &[usize], is_bias| {
        f(Expected {
            name,
            shape,
            is_bias,
        })
    };
    one("transformer.wte.weight", &[v, d], false)?;
    one("transformer.wpe.weight", &[cfg.n_positions, d], false)?;
    for layer in 0..cfg.n_layer {
        let p = format!("transformer.h.{layer}");
        for ln in ["ln_1", "ln_2"] {
            one(&format!("{p}.{ln}.weight"), &[d], false)?;
            one(&format!("{p}.{ln}.bias"), &[d], true)?;
        }
        for (name, d_in, d_out) in [
            ("attn.c_attn", d, 3 * d),
            ("attn.c_proj", d, d),
            ("mlp.c_fc", d, i),
            ("mlp.c_proj", i, d),
        ] {
            one(&format!("{p}.{name}.weight"), &[d_in, d_out], false)?;
            one(&format!("{p}.{name}.bias"), &[d_out], true)?;
        }
    }
    if cfg.norm_placement == NormPlacement::Pre {
        one("transformer.ln_f.weight", &[d], false)?;
        one("transformer.ln_f.bias", &[d], true)?;
    }
    if !cfg.tie_word_embeddings {
        one("lm_head.weight", &[v, d], false)?;
    }
    Ok(())
}

/// Checks that `stored` (name → shape, names from the root) holds every tensor of `cfg`
/// with the shape the configuration implies, and that the model fits in memory as `dtype`.
/// `optional_biases`: nanoGPT's `bias=False` checkpoints have none.
pub(crate) fn check_tensor_table(
    cfg: &GptConfig,
    stored: &HashMap<String, Vec<usize>>,
    dtype: DType,
    optional_biases: bool,
) -> Result<()> {
    let mut bytes: u128 = 0;
    for_each_tensor(cfg, |t| {
        match stored.get(t.name) {
            None if optional_biases && t.is_bias => {}
            None => bail!(
                "the checkpoint has no tensor {} (the config says n_layer={}, tie_word_embeddings={})",
                t.name,
                cfg.n_layer,
                cfg.tie_word_embeddings
            ),
            Some(shape) if shape != t.shape => bail!(
                "tensor {} is {shape:?} in the checkpoint but the config implies {:?}",
                t.name,
                t.shape
            ),
            Some(_) => {}
        }
        bytes +=
            t.shape.iter().map(|&n| n as u128).product::<u128>() * dtype.size_in_bytes() as u128;
        Ok(())
    })?;
    check_fits_in_memory(bytes, dtype)
}

/// Refuses a model larger than the memory this process may use.
pub(crate) fn check_fits_in_memory(bytes: u128, dtype: DType) -> Result<()> {
    if let Some(available) = available_memory() {
        if bytes > available as u128 {
            let gib = |b: u128| b as f64 / (1u64 << 30) as f64;
            bail!(
                "the model needs {:.2} GiB as {dtype:?} but only {:.2} GiB of memory is available",
                gib(bytes),
                gib(available as u128)
            )
        }
    }
    Ok(())
}

/// Memory available to this process: the kernel's `MemAvailable`, lowered by a cgroup
/// limit when there is one. `None` where neither can be read (then nothing is refused).
pub fn available_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    let mut available = kib.saturating_mul(1024);
    // cgroup v2, then v1; "max" or a huge v1 value means no limit.
    for path in [
        "/sys/fs/cgroup/memory.max",
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
    ] {
        if let Some(limit) = std::fs::read_to_string(path)
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
        {
            available = available.min(limit);
        }
    }
    Some(available)
}
