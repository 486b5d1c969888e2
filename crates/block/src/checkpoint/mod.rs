//! Checkpoints, one module per file format (Hugging Face safetensors, nanoGPT, GGUF), each
//! going open → config → check → build, and the one entry point that picks among them
//! ([`load()`](crate::load)).
//!
//! Every file is treated as hostile: its table of tensors is checked against the config
//! (names, shapes, byte ranges, the memory they need) before anything is allocated for it.

pub(crate) mod arena;
pub(crate) mod check;
pub(crate) mod floats;
pub(crate) mod gguf;
pub(crate) mod io;
pub(crate) mod load;
pub(crate) mod nanogpt;
pub(crate) mod options;
pub(crate) mod safetensors;
