//! Checks a checkpoint's table of tensors against its configuration before anything is
//! allocated, so that a broken or hostile file is refused with a message instead of
//! aborting the process on a huge allocation.

use std::collections::HashMap;

use candle_core::{bail, DType, Result};

use mha::WeightLayout;

use crate::config::{GptConfig, NormKind, NormPlacement};
use crate::parts::block::Block;

/// One tensor a checkpoint of a configuration holds.
pub(crate) struct Expected<'a> {
    /// Name from the checkpoint's root: `transformer.wte.weight`, `lm_head.weight`.
    pub name: &'a str,
    /// Shape as stored (GPT-2's Conv1D weights `[in, out]`, `nn.Linear` `[out, in]`).
    pub shape: &'a [usize],
    /// A bias that nanoGPT's `bias=False` leaves out.
    pub is_bias: bool,
}

/// Receives `(name, shape, is_bias)` of each expected tensor.
type Emit<'a> = dyn FnMut(&str, &[usize], bool) -> Result<()> + 'a;

/// Calls `f` on every tensor the model reads, in order: embeddings first, then block after
/// block, with the names and shapes of `cfg`'s family. Walking lazily keeps a config
/// claiming a billion layers cheap: the first missing block stops it.
pub(crate) fn for_each_tensor(
    cfg: &GptConfig,
    mut f: impl FnMut(Expected<'_>) -> Result<()>,
) -> Result<()> {
    let names = cfg.family.names();
    let (v, d, i) = (cfg.vocab_size, cfg.n_embd, cfg.inner_dim());
    let mut one = |name: &str, shape: &[usize], is_bias| {
        f(Expected {
            name,
            shape,
            is_bias,
        })
    };
    // A projection from `d_in` to `d_out` as the family stores it.
    let proj =
        |one: &mut Emit, name: &str, (d_in, d_out): (usize, usize), conv1d: bool, bias: bool| {
            let shape = if conv1d { [d_in, d_out] } else { [d_out, d_in] };
            one(&format!("{name}.weight"), &shape, false)?;
            if bias {
                one(&format!("{name}.bias"), &[d_out], true)?;
            }
            Ok::<(), candle_core::Error>(())
        };
    one(&format!("{}.weight", names.embed.hf), &[v, d], false)?;
    if cfg.rope.is_none() {
        one(
            &format!("{}.weight", names.positions.hf),
            &[cfg.n_positions, d],
            false,
        )?;
    }
    let norm = |one: &mut Emit, name: &str| {
        one(&format!("{name}.weight"), &[d], false)?;
        if cfg.norm == NormKind::LayerNorm {
            one(&format!("{name}.bias"), &[d], true)?;
        }
        Ok::<(), candle_core::Error>(())
    };
    for layer in 0..cfg.n_layer {
        let p = format!("{}.{layer}", names.layers.hf);
        norm(&mut one, &format!("{p}.{}", names.attn_norm.hf))?;
        norm(&mut one, &format!("{p}.{}", names.mlp_norm.hf))?;
        if cfg.norm_placement == NormPlacement::Sandwich {
            norm(&mut one, &format!("{p}.{}", names.attn_post_norm.hf))?;
            norm(&mut one, &format!("{p}.{}", names.mlp_post_norm.hf))?;
        }
        match (cfg.is_conv(layer), names.short_conv) {
            (true, Some(sc)) => {
                let c = format!("{p}.{}", sc.module);
                let b = cfg.conv_bias;
                proj(
                    &mut one,
                    &format!("{c}.{}", sc.in_proj.hf),
                    (d, 3 * d),
                    false,
                    b,
                )?;
                one(
                    &format!("{c}.{}.weight", sc.conv.hf),
                    &[d, 1, cfg.conv_taps],
                    false,
                )?;
                if b {
                    one(&format!("{c}.{}.bias", sc.conv.hf), &[d], true)?;
                }
                proj(
                    &mut one,
                    &format!("{c}.{}", sc.out_proj.hf),
                    (d, d),
                    false,
                    b,
                )?;
            }
            (true, None) => bail!(
                "{} models have no convolution blocks",
                cfg.family.model_type()
            ),
            (false, _) => attention_tensors(cfg, &mut one, &p)?,
        }
        let m = &names.mlp_proj;
        let mp = format!("{p}.{}", names.mlp);
        // GPT-2's Conv1D MLP always has biases.
        let mlp_bias = cfg.mlp_bias || m.conv1d;
        let gate = m.gate.filter(|_| cfg.gated_mlp).map(|g| (g, (d, i)));
        for (name, io) in gate.into_iter().chain([(m.up, (d, i)), (m.down, (i, d))]) {
            proj(
                &mut one,
                &format!("{mp}.{}", name.hf),
                io,
                m.conv1d,
                mlp_bias,
            )?;
        }
    }
    if cfg.norm_placement != NormPlacement::Post {
        norm(&mut one, names.final_norm.hf)?;
    }
    if !cfg.tie_word_embeddings {
        one(&format!("{}.weight", names.head.hf), &[v, d], false)?;
    }
    Ok(())
}

/// The attention tensors of block `p` (its name from the root).
fn attention_tensors(cfg: &GptConfig, one: &mut Emit, p: &str) -> Result<()> {
    let names = cfg.family.names();
    let d = cfg.n_embd;
    let hd = cfg.head_dim();
    let (qw, kv) = (cfg.n_head * hd, cfg.kv_heads() * hd);
    let proj =
        |one: &mut Emit, name: &str, (d_in, d_out): (usize, usize), conv1d: bool, bias: bool| {
            let shape = if conv1d { [d_in, d_out] } else { [d_out, d_in] };
            one(&format!("{name}.weight"), &shape, false)?;
            if bias {
                one(&format!("{name}.bias"), &[d_out], true)?;
            }
            Ok::<(), candle_core::Error>(())
        };
    let a = format!("{p}.{}", names.attn);
    if let Some((qn, kn)) = Block::qk_norm_widths(cfg) {
        let an = &names.attn_proj;
        one(&format!("{a}.{}.weight", an.q_norm.hf), &[qn], false)?;
        one(&format!("{a}.{}.weight", an.k_norm.hf), &[kn], false)?;
    }
    let (qkv_b, o_b) = (cfg.attn_bias, cfg.attn_out_bias);
    match names.attn_layout() {
        WeightLayout::Gpt2Conv1d => {
            proj(
                one,
                &format!("{a}.{}", names.attn_proj.qkv.hf),
                (d, d + 2 * kv),
                true,
                qkv_b,
            )?;
            proj(
                one,
                &format!("{a}.{}", names.attn_proj.o.hf),
                (d, d),
                true,
                o_b,
            )?;
        }
        WeightLayout::HeadInterleavedQkv { qkv, o } => {
            proj(one, &format!("{a}.{qkv}"), (d, 3 * d), false, qkv_b)?;
            proj(one, &format!("{a}.{o}"), (d, d), false, o_b)?;
        }
        WeightLayout::Separate { q, k, v, o } => {
            proj(one, &format!("{a}.{q}"), (d, qw), false, qkv_b)?;
            proj(one, &format!("{a}.{k}"), (d, kv), false, qkv_b)?;
            proj(one, &format!("{a}.{v}"), (d, kv), false, qkv_b)?;
            proj(one, &format!("{a}.{o}"), (qw, d), false, o_b)?;
        }
        WeightLayout::TorchInProj => bail!("no model family stores torch in_proj weights"),
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
                "the checkpoint has no tensor {} (the {} config says {} layers, tie_word_embeddings={})",
                t.name,
                cfg.family.model_type(),
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
