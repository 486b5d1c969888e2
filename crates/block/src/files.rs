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

use candle_core::{bail, DType, Device, Result, Shape, Tensor};
use safetensors::tensor::{Metadata, TensorInfo};

use crate::load::path_err;

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

/// A CPU tensor of `shape` whose elements, stored as `dtype` (f32, f16, bf16 or f64), are
/// read from `file`'s position straight into the vector the tensor keeps (a
/// [`mha::memory::weight_vec`]): no buffer of bytes beside it, which Candle's
/// `from_raw_buffer` would copy (a moment at twice the tensor, and memory the allocator
/// keeps).
pub(crate) fn read_floats(file: &mut impl Read, dtype: DType, shape: &[usize]) -> Result<Tensor> {
    fn read<T: candle_core::WithDType>(file: &mut impl Read, shape: &[usize]) -> Result<Tensor> {
        let mut data = mha::memory::weight_vec(shape.iter().product(), T::from_f64(0.0));
        read_into(file, &mut data)?;
        Tensor::from_vec(data, shape, &Device::Cpu)
    }
    match dtype {
        DType::F32 => read::<f32>(file, shape),
        DType::F16 => read::<half::f16>(file, shape),
        DType::BF16 => read::<half::bf16>(file, shape),
        DType::F64 => read::<f64>(file, shape),
        other => bail!("{other:?} is not a float format weights are read in"),
    }
}

/// Fills `out` with the elements stored next in `file` in `out`'s float type.
pub(crate) fn read_into<T: candle_core::WithDType>(
    file: &mut impl Read,
    out: &mut [T],
) -> Result<()> {
    // SAFETY: the float types are plain data: any bytes are valid values, and the slice
    // covers exactly `out`'s memory.
    let bytes = unsafe {
        std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(out))
    };
    Ok(file.read_exact(bytes)?)
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

    fn load(&self, name: &str, dtype: DType, dev: &Device) -> Result<Tensor> {
        let Some((i, info, base)) = self.index.get(name) else {
            bail!("cannot find tensor {name}")
        };
        let stored = model_dtype(name, info.dtype)?;
        let (path, file) = &self.files[*i];
        let (start, end) = info.data_offsets;
        let t = {
            let mut file = file
                .lock()
                .map_err(|_| path_err(path, "file lock poisoned"))?;
            file.seek(SeekFrom::Start(base + start as u64))
                .map_err(|e| path_err(path, e))?;
            read_floats(&mut *file, stored, &info.shape).map_err(|e| path_err(path, e))?
        };
        debug_assert_eq!(t.elem_count() * stored.size_in_bytes(), end - start);
        t.to_dtype(dtype)?.to_device(dev)
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
