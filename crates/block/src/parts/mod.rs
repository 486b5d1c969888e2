//! The parts a model is made of: norms, the MLP, and the block that joins them to the
//! attention (`mha`).

pub(crate) mod block;
pub(crate) mod mixer;
pub(crate) mod mlp;
pub(crate) mod norm;
pub(crate) mod short_conv;
