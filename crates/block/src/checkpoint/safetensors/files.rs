//! Safetensors files read tensor by tensor with ordinary reads, not a memory map.
//!
//! A mapped file's touched pages count in the process's resident memory next to the
//! copies Candle makes of them, so a mapped load peaks at twice the weights. Reading each
//! tensor into its own buffer peaks at the weights plus one tensor.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;
use std::sync::Mutex;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{bail, DType, Device, Result, Shape, Tensor};
use gpt_kernels::quant::Packed;
use safetensors::tensor::{Metadata, TensorInfo};

use crate::checkpoint::floats::{read_floats, read_floats_into, read_stored};
use crate::checkpoint::io::path_err;

/// The safetensors format's own limit on the JSON header.
const MAX_HEADER_BYTES: u64 = 100 << 20;

/// The headers of one or more safetensors files, and the open files.
pub(crate) struct FileTensors {
    files: Vec<(PathBuf, Mutex<File>)>,
    /// Name → (file index, info, absolute offset of the file's data section).
    index: HashMap<String, (usize, TensorInfo, u64)>,
}

/// The dtype a stored tensor loads as; model weights are floats.
pub(crate) fn model_dtype(name: &str, stored: safetensors::Dtype) -> Result<DType> {
    use safetensors::Dtype as S;
    Ok(match stored {
        S::F32 => DType::F32,
        S::F16 => DType::F16,
        S::BF16 => DType::BF16,
        S::F64 => DType::F64,
        other => {
            bail!("tensor {name} has dtype {other:?}; model weights must be f32, f16, bf16 or f64")
        }
    })
}

impl FileTensors {
    /// Opens the files and checks their headers against their lengths: the header fits,
    /// every tensor's byte range matches its shape and dtype, the ranges tile the data
    /// section, and the data section ends where the file does.
    pub fn open(paths: &[PathBuf]) -> Result<Self> {
        let mut files = Vec::new();
        let mut index = HashMap::new();
        for (i, path) in paths.iter().enumerate() {
            let bad = |e: &dyn std::fmt::Display| {
                path_err(path, format!("not a valid safetensors file: {e}"))
            };
            let mut file = File::open(path).map_err(|e| path_err(path, e))?;
            let len = file.metadata().map_err(|e| path_err(path, e))?.len();
            let mut n = [0u8; 8];
            file.read_exact(&mut n).map_err(|e| bad(&e))?;
            let n = u64::from_le_bytes(n);
            if n > MAX_HEADER_BYTES || n > len.saturating_sub(8) {
                bail!(
                    "{}",
                    bad(&format!("header of {n} bytes in a file of {len}"))
                )
            }
            let mut header = vec![0u8; n as usize];
            file.read_exact(&mut header).map_err(|e| bad(&e))?;
            // Deserializing validates every tensor's offsets against its shape and dtype.
            let meta: Metadata = serde_json::from_slice(&header).map_err(|e| bad(&e))?;
            if 8 + n + meta.data_len() as u64 != len {
                bail!(
                    "{}",
                    bad(&format!(
                        "the tensors end at byte {} but the file has {len}",
                        8 + n + meta.data_len() as u64
                    ))
                )
            }
            for (name, info) in meta.tensors() {
                index.insert(name, (i, info.clone(), 8 + n));
            }
            files.push((path.clone(), Mutex::new(file)));
        }
        Ok(Self { files, index })
    }

    /// `(name, dtype, shape)` of every tensor.
    pub fn infos(&self) -> impl Iterator<Item = (&str, safetensors::Dtype, &[usize])> {
        self.index
            .iter()
            .map(|(name, (_, info, _))| (name.as_str(), info.dtype, info.shape.as_slice()))
    }

    /// `read(file, info, stored dtype)` with the file positioned at tensor `name`'s
    /// elements; its errors name the file.
    fn read_tensor<R>(
        &self,
        name: &str,
        read: impl FnOnce(&mut File, &TensorInfo, DType) -> Result<R>,
    ) -> Result<R> {
        let Some((i, info, base)) = self.index.get(name) else {
            bail!("cannot find tensor {name}")
        };
        let stored = model_dtype(name, info.dtype)?;
        let (path, file) = &self.files[*i];
        let mut file = file
            .lock()
            .map_err(|_| path_err(path, "file lock poisoned"))?;
        file.seek(SeekFrom::Start(base + info.data_offsets.0 as u64))
            .map_err(|e| path_err(path, e))?;
        read(&mut file, info, stored).map_err(|e| path_err(path, e))
    }

    pub(crate) fn load(&self, name: &str, dtype: DType, dev: &Device) -> Result<Tensor> {
        let t = self.read_tensor(name, |file, info, stored| {
            // Floats are read as `dtype` directly; anything else converts from as stored.
            let read_as = match dtype.is_float() {
                true => dtype,
                false => stored,
            };
            read_floats(file, stored, read_as, &info.shape)
        })?;
        t.to_dtype(dtype)?.to_device(dev)
    }

    /// The matrices `parts` (`(name, [rows, cols])`, shapes as checked against the header)
    /// read one after the other into one weight buffer of `dtype`, a 1-D CPU tensor,
    /// converted on the way where stored otherwise.
    pub(crate) fn read_arena(&self, parts: &[(&str, [usize; 2])], dtype: DType) -> Result<Tensor> {
        fn read<T: candle_core::WithDType>(
            st: &FileTensors,
            parts: &[(&str, [usize; 2])],
        ) -> Result<Tensor> {
            let total = parts.iter().map(|(_, [r, c])| r * c).sum();
            let mut data = gpt_kernels::memory::weight_vec(total, T::from_f64(0.0));
            let mut at = 0;
            for &(name, [rows, cols]) in parts {
                let slot = &mut data[at..at + rows * cols];
                st.read_tensor(name, |file, info, stored| {
                    if info.shape != [rows, cols] {
                        bail!(
                            "tensor {name} is {:?}, expected {:?}",
                            info.shape,
                            [rows, cols]
                        )
                    }
                    read_stored(file, stored, slot)
                })?;
                at += rows * cols;
            }
            Tensor::from_vec(data, total, &Device::Cpu)
        }
        match dtype {
            DType::F32 => read::<f32>(self, parts),
            DType::F16 => read::<half::f16>(self, parts),
            DType::BF16 => read::<half::bf16>(self, parts),
            DType::F64 => read::<f64>(self, parts),
            other => bail!("{other:?} is not a float format weights are read in"),
        }
    }
}

impl FileTensors {
    /// The matrix `name` `[n, k]` quantized to `q` and packed for this CPU's kernels, read
    /// 16 rows at a time (each row as `dtype`, then widened to f32 and quantized, the bytes
    /// [`mha::Proj::quantize`] gives the whole matrix): no f32 copy of the matrix is ever
    /// whole. `None` when it is not there, not a matrix, or `q` does not pack here for its
    /// width (the caller quantizes it as it would have).
    pub(crate) fn packed_rows(
        &self,
        name: &str,
        dtype: DType,
        q: GgmlDType,
    ) -> Result<Option<Packed>> {
        let Some((_, info, _)) = self.index.get(name) else {
            return Ok(None);
        };
        let &[n, k] = info.shape.as_slice() else {
            return Ok(None);
        };
        let Some(q) = mha::Proj::quantized_as(q, k).filter(|&q| Packed::packs_here(q)) else {
            return Ok(None);
        };
        let row_bytes = k / q.block_size() * q.type_size();
        self.read_tensor(name, |file, _, stored| {
            Packed::from_rows(q, n, k, |chunk| {
                let rows = chunk.len() / row_bytes;
                let t = read_floats_into(file, stored, dtype, &[rows, k], false)?;
                let t = t.to_dtype(DType::F32)?;
                chunk.copy_from_slice(&QTensor::quantize(&t, q)?.data()?);
                Ok(())
            })
        })
    }
}

impl candle_nn::var_builder::SimpleBackend for FileTensors {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> Result<Tensor> {
        let t = self.load(name, dtype, dev)?;
        if t.shape() != &s {
            bail!("tensor {name} is {:?}, expected {:?}", t.dims(), s.dims())
        }
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> Result<Tensor> {
        self.load(name, dtype, dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }
}
