//! The blocks' float matrices of a model loaded for inference, side by side in one buffer.

use std::collections::HashMap;

use candle_core::{bail, Result, Tensor};

/// The blocks' float matrices of a model loaded for inference, read side by side into one
/// buffer per precision (a [`gpt_kernels::memory::weight_vec`]), each matrix a view into it: q, k
/// and v of a block next to each other, then its output projection, gate and up next to
/// each other, then down. Read into buffers of their own (a small model's matrices are a
/// few MiB or less), the matrices had the two huge pages at their ends collapsed with
/// whatever shared them (the allocator's gaps, freed temporaries; resident from then on),
/// and fusing q/k/v and gate/up for inference copied them into new matrices. Here the
/// fused matrices are views of the buffer as read, and only the buffer's own two end pages
/// are shared (docs/PERFORMANCE.md, "Memory").
#[derive(Default)]
pub(crate) struct FloatArena {
    /// Each matrix's buffer (1-D), the offset of its first element there, its `[rows, cols]`.
    pub(crate) slots: HashMap<String, (Tensor, usize, [usize; 2])>,
}

impl FloatArena {
    /// The matrices `parts` (`(name, [rows, cols])`) stacked by rows as one `[Σ rows, cols]`
    /// view, taken out of the arena, when they are all there and side by side in that order;
    /// `None` otherwise (the caller reads them as it would without an arena). A stored
    /// shape other than the one asked for is an error.
    pub(crate) fn take(&mut self, parts: &[(String, [usize; 2])]) -> Result<Option<Tensor>> {
        let mut span: Option<(&Tensor, usize, usize, usize)> = None; // (buffer, first, end, rows)
        for (name, want) in parts {
            let Some((buf, at, dims)) = self.slots.get(name) else {
                return Ok(None);
            };
            if dims != want {
                bail!("tensor {name} has shape {dims:?}, the config needs {want:?}")
            }
            let len = dims[0] * dims[1];
            span = match span {
                None => Some((buf, *at, at + len, dims[0])),
                Some((b, first, end, rows)) if b.id() == buf.id() && end == *at => {
                    Some((b, first, end + len, rows + dims[0]))
                }
                Some(_) => return Ok(None),
            };
        }
        let Some((buf, first, end, rows)) = span else {
            return Ok(None);
        };
        let view = buf
            .narrow(0, first, end - first)?
            .reshape((rows, parts[0].1[1]))?;
        for (name, _) in parts {
            self.slots.remove(name);
        }
        Ok(Some(view))
    }
}
