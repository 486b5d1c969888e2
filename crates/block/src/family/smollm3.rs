//! SmolLM3: Llama's tensor names and config, with layers that do not rotate (NoPE):
//! `no_rope_layers` (1 for a layer that rotates, 0 for one that does not, one per layer),
//! else every `no_rope_layer_interval`-th layer without rotation.

use candle_core::{bail, Result};
use serde_json::Value;

use super::fields::Fields;
use super::id::Family;
use super::llama;
use crate::config::GptConfig;

/// Reads a SmolLM3 `config.json`.
pub(super) fn read(f: &Fields) -> Result<GptConfig> {
    let cfg = llama::read(Family::SmolLm3, f)?;
    let n = cfg.n_layer;
    let (no_rope, no_rope_every) = match f.get("no_rope_layers") {
        Some(Value::Array(flags)) => {
            if flags.len() != n {
                bail!(
                    "config: no_rope_layers has {} entries for num_hidden_layers={n}",
                    flags.len()
                )
            }
            let pattern = flags
                .iter()
                .map(|v| match v.as_u64() {
                    Some(1) => Ok(false),
                    Some(0) => Ok(true),
                    _ => bail!("config: no_rope_layers entries must be 0 or 1, got {v}"),
                })
                .collect::<Result<Vec<bool>>>()?;
            (vec![(pattern, 1)], None)
        }
        Some(v) => bail!("config: no_rope_layers must be a list, got {v}"),
        // transformers: layer i rotates unless (i + 1) % interval == 0.
        None => match f.usize("no_rope_layer_interval")? {
            Some(0) => bail!("config: no_rope_layer_interval must be positive"),
            every => (Vec::new(), Some(every.unwrap_or(4))),
        },
    };
    Ok(GptConfig {
        no_rope,
        no_rope_every,
        ..cfg
    })
}
