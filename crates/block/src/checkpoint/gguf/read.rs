//! Reading a GGUF file's tensors: each checked against the shape the config needs and
//! marked as read, block-quantized ones read straight into their blocks (or packed for this
//! CPU row by row), float ones straight into the tensor that keeps them.

use std::io::{Read, Seek, SeekFrom};

use candle_core::quantized::gguf_file;
use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{bail, DType, Device, Result, Tensor};
use gpt_kernels::quant::Packed;

use super::rope::rotary_order;
use super::{Gguf, Source};

/// Reads a CPU tensor's blocks, from the file's current position, straight into the
/// vector that keeps them. Candle's reader reads the bytes into a buffer and copies them
/// into the blocks, so each tensor is briefly held twice, and the freed buffers stay
/// resident. `None` for a
/// format whose block size this does not know (the caller then uses Candle's reader). The
/// byte range was checked when the file was opened.
pub(super) fn read_in_place(
    file: &mut impl Read,
    dtype: GgmlDType,
    shape: &[usize],
) -> Result<Option<QTensor>> {
    use candle_core::quantized::k_quants::*;
    use half::{bf16, f16};

    fn read<T: GgmlType + Send + Sync + 'static>(
        file: &mut impl Read,
        dtype: GgmlDType,
        shape: &[usize],
    ) -> Result<Option<QTensor>> {
        if std::mem::size_of::<T>() != dtype.type_size() {
            return Ok(None);
        }
        let elems: usize = shape.iter().product();
        let mut blocks = vec![T::zeros(); elems / dtype.block_size()];
        // SAFETY: every GGML block type is plain data (integers and halves, `repr(C)`
        // without padding: its size is the format's byte count, checked above), so any
        // bytes form valid blocks, and the slice covers exactly the vector's memory.
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(
                blocks.as_mut_ptr().cast::<u8>(),
                std::mem::size_of_val(blocks.as_slice()),
            )
        };
        file.read_exact(bytes)?;
        QTensor::new(QStorage::Cpu(Box::new(blocks)), shape).map(Some)
    }

    match dtype {
        GgmlDType::F32 => read::<f32>(file, dtype, shape),
        GgmlDType::F16 => read::<f16>(file, dtype, shape),
        GgmlDType::BF16 => read::<bf16>(file, dtype, shape),
        GgmlDType::Q4_0 => read::<BlockQ4_0>(file, dtype, shape),
        GgmlDType::Q4_1 => read::<BlockQ4_1>(file, dtype, shape),
        GgmlDType::Q5_0 => read::<BlockQ5_0>(file, dtype, shape),
        GgmlDType::Q5_1 => read::<BlockQ5_1>(file, dtype, shape),
        GgmlDType::Q8_0 => read::<BlockQ8_0>(file, dtype, shape),
        GgmlDType::Q8_1 => read::<BlockQ8_1>(file, dtype, shape),
        GgmlDType::Q2K => read::<BlockQ2K>(file, dtype, shape),
        GgmlDType::Q3K => read::<BlockQ3K>(file, dtype, shape),
        GgmlDType::Q4K => read::<BlockQ4K>(file, dtype, shape),
        GgmlDType::Q5K => read::<BlockQ5K>(file, dtype, shape),
        GgmlDType::Q6K => read::<BlockQ6K>(file, dtype, shape),
        GgmlDType::Q8K => read::<BlockQ8K>(file, dtype, shape),
    }
}

impl Gguf {
    /// The tensor `name`, checked to have `shape` (PyTorch order) and marked as read, with
    /// the file positioned at its first byte.
    pub(super) fn claim(
        &self,
        name: &str,
        shape: &[usize],
    ) -> Result<(&gguf_file::TensorInfo, std::sync::MutexGuard<'_, Source>)> {
        let Some(info) = self.content.tensor_infos.get(name) else {
            bail!("tensor {name} is missing")
        };
        if info.shape.dims() != shape {
            bail!(
                "tensor {name} has shape {:?}, the config needs {shape:?}",
                info.shape.dims()
            )
        }
        let poisoned = || candle_core::Error::Msg("the GGUF file's lock is poisoned".into());
        self.read
            .lock()
            .map_err(|_| poisoned())?
            .insert(name.to_string());
        let mut file = self.file.lock().map_err(|_| poisoned())?;
        file.seek(SeekFrom::Start(
            self.content.tensor_data_offset + info.offset,
        ))?;
        Ok((info, file))
    }

    /// Reads one tensor, checking its shape (PyTorch order).
    pub(super) fn qtensor(&self, name: &str, shape: &[usize], device: &Device) -> Result<QTensor> {
        let (info, mut file) = self.claim(name, shape)?;
        if gpt_kernels::cpu_kernels(device) {
            if let Some(q) = read_in_place(&mut *file, info.ggml_dtype, shape)? {
                return Ok(q);
            }
        }
        info.read(&mut *file, self.content.tensor_data_offset, device)
    }

    /// A block-quantized matrix packed for this CPU's kernels straight from the
    /// file, a group of rows at a time (no buffer or `QTensor` the size of the matrix beside
    /// it), or `None` when the tensor is of another format, the device not the CPU or the
    /// CPU without the kernels (the caller then reads a `QTensor`). Checks as
    /// [`Self::qtensor`]. `heads`: the rows are llama.cpp's rotary layout of that many
    /// heads, put back in Hugging Face's order as they are read (0: as stored).
    /// `settled`: in a slab beside the model's other matrices, as inference keeps them
    /// ([`Packed::from_rows_settled`]).
    pub(super) fn packed(
        &self,
        name: &str,
        shape: &[usize],
        heads: usize,
        device: &Device,
        settled: bool,
    ) -> Result<Option<Packed>> {
        let &[n, k] = shape else {
            return Ok(None);
        };
        self.packed_parts(&[(name, [n, k], heads)], device, settled)
    }

    /// Matrices `parts` (`(name, [rows, cols], rotary heads or 0)`) stacked as one packed
    /// matrix `[Σ rows, cols]`, read straight from the file as [`Self::packed`] reads one (a
    /// fused q/k/v or gate/up projection, with no copy of its parts): `None` when one of
    /// them would not be packed alone, they differ in format or width, or a part but the
    /// last has rows that do not fill its last tile of 16 (as [`Packed::concat`] refuses).
    pub(super) fn packed_parts(
        &self,
        parts: &[(&str, [usize; 2], usize)],
        device: &Device,
        settled: bool,
    ) -> Result<Option<Packed>> {
        let infos: Option<Vec<_>> = parts
            .iter()
            .map(|(name, ..)| self.content.tensor_infos.get(*name))
            .collect();
        let (Some(infos), Some(&(_, [_, k], _))) = (infos, parts.first()) else {
            return Ok(None);
        };
        let dtype = infos[0].ggml_dtype;
        let stacks = parts
            .iter()
            .zip(&infos)
            .enumerate()
            .all(|(i, ((_, [n, w], _), info))| {
                info.ggml_dtype == dtype && *w == k && (i + 1 == parts.len() || n % 16 == 0)
            });
        if !stacks || !gpt_kernels::cpu_kernels(device) || !Packed::packs_here(dtype) {
            return Ok(None);
        }
        // Each part checked and marked as read: its first byte, its row's bytes and, for
        // rotary rows, the stored row each row of the matrix comes from.
        let row_bytes = k / dtype.block_size() * dtype.type_size();
        let mut spans = Vec::with_capacity(parts.len());
        for &(name, [rows, cols], heads) in parts {
            let (info, file) = self.claim(name, &[rows, cols])?;
            drop(file);
            let order = match heads {
                0 => None,
                h => Some(rotary_order(rows, h, false)?),
            };
            spans.push((self.content.tensor_data_offset + info.offset, rows, order));
        }
        let n = parts.iter().map(|(_, [rows, _], _)| rows).sum();
        let poisoned = || candle_core::Error::Msg("the GGUF file's lock is poisoned".into());
        let mut file = self.file.lock().map_err(|_| poisoned())?;
        // The parts' rows one after the other, whatever rows a call asks for. A part in
        // rotary order is read whole first (a layer's q or k), its rows then served in
        // Hugging Face's order. (The byte ranges were checked when the file was opened.)
        let (mut part, mut at, mut left) = (0, 0, 0);
        let mut whole: Vec<u8> = Vec::new();
        let read = |out: &mut [u8]| -> Result<()> {
            let mut done = 0;
            while done < out.len() {
                if left == 0 {
                    let Some((start, rows, order)) = spans.get(part) else {
                        bail!("packing read past the last of {} parts", spans.len())
                    };
                    file.seek(SeekFrom::Start(*start))?;
                    (part, at, left) = (part + 1, 0, rows * row_bytes);
                    whole.clear();
                    if order.is_some() {
                        whole.resize(left, 0);
                        file.read_exact(&mut whole)?;
                    }
                }
                let order = spans[part - 1].2.as_deref();
                let take = match order {
                    None => left.min(out.len() - done),
                    // Up to the end of the row.
                    Some(_) => (row_bytes - at % row_bytes).min(out.len() - done),
                };
                let dst = &mut out[done..done + take];
                match order {
                    None => file.read_exact(dst)?,
                    Some(order) => {
                        let src = order[at / row_bytes] * row_bytes + at % row_bytes;
                        dst.copy_from_slice(&whole[src..src + take]);
                    }
                }
                (done, at, left) = (done + take, at + take, left - take);
            }
            Ok(())
        };
        match settled {
            true => Packed::from_rows_settled(dtype, n, k, read),
            false => Packed::from_rows(dtype, n, k, read),
        }
    }

    /// The format `name` is stored in, if the file has it.
    pub(super) fn stored(&self, name: &str) -> Option<GgmlDType> {
        self.content.tensor_infos.get(name).map(|i| i.ggml_dtype)
    }

    /// A norm weight, bias or embedding, dequantized to `dtype`.
    pub(super) fn dense(
        &self,
        name: &str,
        shape: &[usize],
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        if let Some(t) = self.float_in_place(name, shape, dtype, device)? {
            return Ok(t);
        }
        float_tensor(&self.qtensor(name, shape, device)?, dtype, device)
    }

    /// A CPU tensor stored as f32, f16 or bf16 and wanted in that precision, read straight
    /// into the vector the tensor keeps; `None` otherwise (the caller goes through a
    /// `QTensor`, which a float tensor would copy: the tensor held twice for a moment, and
    /// the allocator keeps what it once held).
    pub(super) fn float_in_place(
        &self,
        name: &str,
        shape: &[usize],
        dtype: DType,
        device: &Device,
    ) -> Result<Option<Tensor>> {
        if !gpt_kernels::cpu_kernels(device)
            || self.stored(name).and_then(stored_float) != Some(dtype)
        {
            return Ok(None);
        }
        let (_, mut file) = self.claim(name, shape)?;
        // The byte range was checked when the file was opened.
        crate::checkpoint::floats::read_floats(&mut *file, dtype, dtype, shape).map(Some)
    }

    /// `parts` (`(name, [rows, cols], rotary heads or 0)`) read one after the other into one
    /// weight buffer, a 1-D tensor; a part stored in another shape is an error.
    pub(super) fn read_arena<T: candle_core::WithDType>(
        &self,
        parts: &[(&str, [usize; 2], usize)],
    ) -> Result<Tensor> {
        let total = parts.iter().map(|(_, [r, c], _)| r * c).sum();
        let mut data = gpt_kernels::memory::weight_vec(total, T::zero());
        let mut at = 0;
        for &(name, [rows, cols], heads) in parts {
            let slot = &mut data[at..at + rows * cols];
            {
                // The byte range was checked when the file was opened.
                let (_, mut file) = self.claim(name, &[rows, cols])?;
                crate::checkpoint::floats::read_into(&mut *file, slot)?;
            }
            if heads > 0 {
                // llama.cpp's rotary rows back in Hugging Face's order, as `select_rows`.
                let read = slot.to_vec();
                for (dst, src) in rotary_order(rows, heads, false)?.into_iter().enumerate() {
                    slot[dst * cols..(dst + 1) * cols]
                        .copy_from_slice(&read[src * cols..(src + 1) * cols]);
                }
            }
            at += rows * cols;
        }
        Tensor::from_vec(data, total, &Device::Cpu)
    }
}

/// The dtype a float matrix stored as `t` is kept in when the model computes in `dtype`:
/// half precision stays half on the CPU under f32 activations, anything else is `dtype`.
pub(super) fn matrix_dtype(t: GgmlDType, dtype: DType, device: &Device) -> DType {
    match (t, dtype) {
        (GgmlDType::F16, DType::F32) if gpt_kernels::cpu_kernels(device) => DType::F16,
        (GgmlDType::BF16, DType::F32) if gpt_kernels::cpu_kernels(device) => DType::BF16,
        _ => dtype,
    }
}

/// The dtype a float GGUF tensor is stored in; `None` for block formats.
pub(super) fn stored_float(t: GgmlDType) -> Option<DType> {
    match t {
        GgmlDType::F32 => Some(DType::F32),
        GgmlDType::F16 => Some(DType::F16),
        GgmlDType::BF16 => Some(DType::BF16),
        _ => None,
    }
}

/// A float tensor in `dtype`: its bytes as they are when the formats agree (dequantizing
/// goes through f32, a transient 4 bytes an element), else dequantized and converted.
pub(super) fn float_tensor(q: &QTensor, dtype: DType, device: &Device) -> Result<Tensor> {
    if stored_float(q.dtype()) == Some(dtype) && gpt_kernels::cpu_kernels(device) {
        return Tensor::from_raw_buffer(&q.data()?, dtype, q.shape().dims(), device);
    }
    q.dequantize(device)?.to_dtype(dtype)
}
