//! The shape of a family's table of tensor names: every part of the model with its name in
//! a Hugging Face checkpoint and in llama.cpp's GGUF files. Each family's file holds its
//! table (`NAMES`), as llama.cpp keeps one per architecture.

use mha::WeightLayout;

/// A tensor's (or module's) name in a Hugging Face checkpoint and in a GGUF file, without
/// the `.weight` / `.bias` suffix; `""` where the format has no such part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Name {
    /// Relative to the checkpoint's root for model-level parts, to the block for block
    /// parts (`input_layernorm`), to the attention or MLP module for their projections.
    pub hf: &'static str,
    /// llama.cpp's name: `token_embd`; block parts go under `blk.{i}.`.
    pub gguf: &'static str,
}

/// Shorthand for the tables.
pub(crate) const fn name(hf: &'static str, gguf: &'static str) -> Name {
    Name { hf, gguf }
}

/// A part the family does not have.
pub(crate) const NONE: Name = name("", "");

/// How a Hugging Face checkpoint stores the attention's projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum QkvLayout {
    /// `q`, `k`, `v` and `o` as separate `nn.Linear`s.
    Separate,
    /// GPT-2: `qkv` and `o` as Conv1D (`[in, out]`).
    Conv1d,
    /// GPT-NeoX: `qkv` one `nn.Linear` whose rows are grouped by head.
    HeadInterleaved,
}

/// The attention's projections.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AttnNames {
    pub layout: QkvLayout,
    pub q: Name,
    pub k: Name,
    pub v: Name,
    /// The fused projection (GGUF's `attn_qkv`, GPT-2's `c_attn`, NeoX's
    /// `query_key_value`).
    pub qkv: Name,
    pub o: Name,
    /// The q/k norms' weights (under the attention module), for families that have them.
    pub q_norm: Name,
    pub k_norm: Name,
}

/// The MLP's projections, and how their weights are stored.
#[derive(Debug, Clone, Copy)]
pub(crate) struct MlpNames {
    pub up: Name,
    /// `None` for a family without a gated MLP.
    pub gate: Option<Name>,
    pub down: Name,
    /// GPT-2's Conv1D stores weights `[in, out]`; `nn.Linear` stores `[out, in]`.
    pub conv1d: bool,
}

/// Projections a Hugging Face checkpoint stores fused though the model keeps them apart
/// (Phi-3): `qkv` (under the attention) holds the rows of q, k and v, one after the
/// other; `gate_up` (under the MLP) the gate's rows, then the up projection's.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StoredFused {
    pub qkv: &'static str,
    pub gate_up: &'static str,
}

/// LFM2's short-convolution mixer: `module` under the block (Hugging Face only), its
/// projections and taps under it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ShortConvNames {
    pub module: &'static str,
    pub in_proj: Name,
    pub conv: Name,
    pub out_proj: Name,
}

/// Where a family keeps each tensor.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TensorNames {
    /// Token embedding `[vocab, d]`.
    pub embed: Name,
    /// Learned position embedding `[n_positions, d]`, for models without rotary positions.
    pub positions: Name,
    /// Block `i` lives under `{layers}.{i}`.
    pub layers: Name,
    /// Norm of the attention (before it; after it for post-norm models).
    pub attn_norm: Name,
    /// The attention module under the block (Hugging Face only: GGUF names are flat).
    pub attn: &'static str,
    /// The attention's projections, under `attn`.
    pub attn_proj: AttnNames,
    /// Norm of the MLP (before it; after it for [`NormPlacement::PostBranch`]).
    ///
    /// [`NormPlacement::PostBranch`]: crate::config::NormPlacement::PostBranch
    pub mlp_norm: Name,
    /// Sandwich norms: the norms on the attention's and the MLP's outputs.
    pub attn_post_norm: Name,
    pub mlp_post_norm: Name,
    /// The MLP module under the block (Hugging Face only).
    pub mlp: &'static str,
    /// The MLP's projections, under `mlp`.
    pub mlp_proj: MlpNames,
    /// Final norm.
    pub final_norm: Name,
    /// Untied LM head `[vocab, d]` (an `nn.Linear` without bias).
    pub head: Name,
    /// Projections stored fused in Hugging Face files, served apart as they are read.
    pub stored_fused: Option<StoredFused>,
    /// The short-convolution blocks' parts, for families that have them.
    pub short_conv: Option<ShortConvNames>,
}

impl TensorNames {
    /// The first component of every Hugging Face name (`transformer`, `model`,
    /// `gpt_neox`), which some checkpoints leave out.
    pub fn root(&self) -> &'static str {
        self.embed.hf.split('.').next().unwrap_or("")
    }

    /// The attention weights' layout in a Hugging Face checkpoint.
    pub fn attn_layout(&self) -> WeightLayout {
        let a = &self.attn_proj;
        match a.layout {
            QkvLayout::Conv1d => WeightLayout::Gpt2Conv1d,
            QkvLayout::HeadInterleaved => WeightLayout::HeadInterleavedQkv {
                qkv: a.qkv.hf.into(),
                o: a.o.hf.into(),
            },
            QkvLayout::Separate => WeightLayout::separate(a.q.hf, a.k.hf, a.v.hf, a.o.hf),
        }
    }

    /// The GGUF name of block `i`'s `part`.
    pub fn gguf_block(&self, i: usize, part: Name) -> String {
        format!("{}.{i}.{}", self.layers.gguf, part.gguf)
    }
}

/// llama.cpp's names, the same in every architecture it writes: the GGUF side of each
/// family's table.
pub(crate) mod gguf {
    pub const TOKEN_EMBD: &str = "token_embd";
    pub const POSITION_EMBD: &str = "position_embd";
    pub const BLK: &str = "blk";
    pub const ATTN_NORM: &str = "attn_norm";
    pub const ATTN_Q: &str = "attn_q";
    pub const ATTN_K: &str = "attn_k";
    pub const ATTN_V: &str = "attn_v";
    pub const ATTN_QKV: &str = "attn_qkv";
    pub const ATTN_OUTPUT: &str = "attn_output";
    pub const FFN_NORM: &str = "ffn_norm";
    pub const FFN_GATE: &str = "ffn_gate";
    pub const FFN_UP: &str = "ffn_up";
    pub const FFN_DOWN: &str = "ffn_down";
    pub const OUTPUT_NORM: &str = "output_norm";
    pub const OUTPUT: &str = "output";
    /// Llama 3's per-frequency rotary divisors (no Hugging Face tensor: its config says it).
    pub const ROPE_FREQS: &str = "rope_freqs";
    pub const ROPE_FACTORS_LONG: &str = "rope_factors_long";
    pub const ROPE_FACTORS_SHORT: &str = "rope_factors_short";
    pub const ATTN_Q_NORM: &str = "attn_q_norm";
    pub const ATTN_K_NORM: &str = "attn_k_norm";
    pub const ATTN_POST_NORM: &str = "post_attention_norm";
    pub const FFN_POST_NORM: &str = "post_ffw_norm";
    pub const SHORTCONV_IN_PROJ: &str = "shortconv.in_proj";
    pub const SHORTCONV_CONV: &str = "shortconv.conv";
    pub const SHORTCONV_OUT_PROJ: &str = "shortconv.out_proj";
}
