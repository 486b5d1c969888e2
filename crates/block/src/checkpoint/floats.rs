//! Float elements read from a file's current position straight into the vector a tensor
//! keeps, converted on the way when stored in another float type: what every format reads
//! its float tensors with.

use std::io::Read;

use candle_core::{bail, DType, Device, Result, Tensor};

/// A CPU tensor of `shape` in `dtype` whose elements, stored as `stored` (f32, f16, bf16 or
/// f64), are read from `file`'s position straight into the vector the tensor keeps (a
/// [`gpt_kernels::memory::weight_vec`]), converted on the way when the two differ: no buffer of
/// bytes beside it, which Candle's `from_raw_buffer` would copy (a moment at twice the
/// tensor, and memory the allocator keeps), nor a tensor in the stored type.
pub(crate) fn read_floats(
    file: &mut impl Read,
    stored: DType,
    dtype: DType,
    shape: &[usize],
) -> Result<Tensor> {
    read_floats_into(file, stored, dtype, shape, true)
}

/// [`read_floats`] into a weight buffer (`weights`) or, for a passing part of a matrix, an
/// ordinary vector: a weight buffer's end pages are collapsed into huge pages.
pub(crate) fn read_floats_into(
    file: &mut impl Read,
    stored: DType,
    dtype: DType,
    shape: &[usize],
    weights: bool,
) -> Result<Tensor> {
    fn read<T: candle_core::WithDType>(
        file: &mut impl Read,
        stored: DType,
        shape: &[usize],
        weights: bool,
    ) -> Result<Tensor> {
        let (len, zero) = (shape.iter().product(), T::from_f64(0.0));
        let mut data = match weights {
            true => gpt_kernels::memory::weight_vec(len, zero),
            false => vec![zero; len],
        };
        read_stored(file, stored, &mut data)?;
        Tensor::from_vec(data, shape, &Device::Cpu)
    }
    match dtype {
        DType::F32 => read::<f32>(file, stored, shape, weights),
        DType::F16 => read::<half::f16>(file, stored, shape, weights),
        DType::BF16 => read::<half::bf16>(file, stored, shape, weights),
        DType::F64 => read::<f64>(file, stored, shape, weights),
        other => bail!("{other:?} is not a float format weights are read in"),
    }
}

/// Fills `out` with the elements stored next in `file` as `stored`, converted to `out`'s
/// float type where it differs.
pub(crate) fn read_stored<T: candle_core::WithDType>(
    file: &mut impl Read,
    stored: DType,
    out: &mut [T],
) -> Result<()> {
    match stored {
        s if s == T::DTYPE => read_into(file, out),
        DType::F32 => read_converted::<f32, T>(file, out),
        DType::F16 => read_converted::<half::f16, T>(file, out),
        DType::BF16 => read_converted::<half::bf16, T>(file, out),
        DType::F64 => read_converted::<f64, T>(file, out),
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

/// Fills `out` with the elements stored next in `file` as `S`, converted a chunk at a time
/// (no tensor of the whole matrix in its stored type beside the converted one), to the
/// values Candle's `to_dtype` gives.
fn read_converted<S: candle_core::WithDType, T: candle_core::WithDType>(
    file: &mut impl Read,
    out: &mut [T],
) -> Result<()> {
    // Half precision from f32, f16 or bf16 is rounded from the f32 value (exact in f32)
    // as Candle does: `half`'s conversions from f64 drop the low bits that decide a tie.
    let convert: fn(S) -> T = match (S::DTYPE, T::DTYPE) {
        (DType::F64, _) => |s| T::from_f64(s.to_f64()),
        (_, DType::F16) => |s| T::from_f64(half::f16::from_f32(s.to_f64() as f32).to_f64()),
        (_, DType::BF16) => |s| T::from_f64(half::bf16::from_f32(s.to_f64() as f32).to_f64()),
        _ => |s| T::from_f64(s.to_f64()),
    };
    let mut chunk = [S::from_f64(0.0); 4096];
    for dst in out.chunks_mut(chunk.len()) {
        let src = &mut chunk[..dst.len()];
        read_into(file, src)?;
        for (d, &s) in dst.iter_mut().zip(src.iter()) {
            *d = convert(s);
        }
    }
    Ok(())
}
