//! Products with a block-quantized weight (ggml's q8_0, q4_0 and q5_0, and the k-quants
//! through Candle's block product) on the CPU, reading each weight block from where it is
//! stored: no dequantized or repacked copy of the matrix. This is the path of CPUs without
//! AVX2 (and of other architectures): where [`crate::quant::packed`] has kernels for the format
//! (every format it packs, with AVX2 or AVX-512 VNNI) the model holds the matrix packed
//! instead, and its kernels are the fast ones.
//!
//! As in ggml, each row of `x` is first quantized to 8 bits in blocks of 32 (q8_0: one
//! f16 scale per block), so the product of two blocks is an exact integer dot product of
//! 32 pairs times the two scales, summed in f32 as ggml's are. Weights are `[out, in]`, as
//! GGUF files and Candle's quantized matrices store them. Each thread takes a contiguous
//! range of output rows; a weight row is read from memory once and from L1 for every
//! further row of `x`. The references are Candle's quantized matrix product (which
//! quantizes `x` the same way) and the f64 product with the dequantized weight.

use std::ops::Range;

use candle_core::quantized::k_quants::GgmlType;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{bail, Result, Tensor};
use half::f16;

use super::input::QRows;
use crate::dense::{map_ranges, ranges};

/// Values per block, in both formats and in the quantized rows of `x`.
pub(crate) const QK: usize = 32;

/// The weight formats with kernels here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Format {
    /// An f16 scale and 32 signed bytes.
    Q8_0,
    /// An f16 scale and 32 4-bit values `q` (value `q - 8`), element `j` in the low
    /// nibble of byte `j` and element `j + 16` in its high nibble.
    Q4_0,
    /// An f16 scale, 32 high bits (bit `j` of a little-endian u32 for element `j`), then
    /// the low four bits as q4_0's: value `q - 16` for the 5-bit `q`.
    Q5_0,
}

impl Format {
    pub(crate) fn of(dtype: GgmlDType) -> Option<Self> {
        match dtype {
            GgmlDType::Q8_0 => Some(Self::Q8_0),
            GgmlDType::Q4_0 => Some(Self::Q4_0),
            GgmlDType::Q5_0 => Some(Self::Q5_0),
            _ => None,
        }
    }

    /// Bytes per block of 32 values.
    pub(crate) fn block_bytes(self) -> usize {
        match self {
            Self::Q8_0 => 2 + QK,
            Self::Q4_0 => 2 + QK / 2,
            Self::Q5_0 => 2 + 4 + QK / 2,
        }
    }
}

/// Whether [`qmatmul`] has kernels for `w`: a q8_0, q4_0 or q5_0 matrix on the CPU.
pub fn supported(w: &QTensor) -> bool {
    Format::of(w.dtype()).is_some() && crate::cpu_kernels(&w.device()) && w.shape().rank() == 2
}

/// `xs [m, in] · wᵀ` over output rows `rows` of `w` (`[out, in]`, q8_0, q4_0, q5_0): an
/// `[m, rows.len()]` f32 tensor, or `None` when `w` is of another format or not on the CPU
/// (the caller then uses Candle's product). Any `m` works; the kernels pay off while a
/// weight row read once serves every row of `x` from L1 (decoding, small batches).
pub fn qmatmul(xs: &Tensor, w: &QTensor, rows: Range<usize>) -> Result<Option<Tensor>> {
    let Some(format) = Format::of(w.dtype()) else {
        return Ok(None);
    };
    if !supported(w) || !crate::cpu_kernels(xs.device()) || w.shape().elem_count() == 0 {
        return Ok(None);
    }
    let (d_out, k) = w.shape().dims2()?;
    let (m, xk) = xs.dims2()?;
    if xk != k {
        bail!("quantized product: inputs [{m}, {xk}] for a weight [{d_out}, {k}]")
    }
    if rows.start > rows.end || rows.end > d_out {
        bail!("quantized product: rows {rows:?} of a weight with {d_out}")
    }
    if !k.is_multiple_of(QK) {
        bail!("quantized product: input width {k} is not a multiple of {QK}")
    }
    let data = w.data()?;
    let row_bytes = k / QK * format.block_bytes();
    if data.len() < d_out * row_bytes {
        bail!(
            "quantized product: {} bytes for a [{d_out}, {k}] {:?} weight",
            data.len(),
            w.dtype()
        )
    }
    let x = crate::dense::with_f32_values(xs, |x| Ok(QRows::new(x, k)))?;
    let weights = &data[rows.start * row_bytes..rows.end * row_bytes];
    let ys = product(format, weights, row_bytes, &x);
    Tensor::from_vec(ys, (m, rows.len()), xs.device()).map(Some)
}

/// `xs [m, in] · wᵀ` over output rows `rows` of a k-quant `w` (`[out, in]`: q2_K–q6_K, `in`
/// a multiple of 256) by Candle's block product (`k_quants::matmul`: ggml's kernels, four
/// weight rows per call) on the blocks as stored, or `None` for other weights. Candle's
/// own `QMatMul` would repack a q4_K matrix into tiles on first use and multiply those: a
/// second copy of the weight, and on an AVX2 CPU slower decoding than this product.
pub fn kquant_matmul(xs: &Tensor, w: &QTensor, rows: Range<usize>) -> Result<Option<Tensor>> {
    struct Product;
    impl BlockProduct for Product {
        fn run<T: GgmlType>(&self, x: &[f32], m: usize, k: usize, w: &[T]) -> Result<Vec<f32>> {
            let n = w.len() / (k / T::BLCK_SIZE);
            let mut ys = vec![0f32; m * n];
            candle_core::quantized::k_quants::matmul((m, k, n), x, w, &mut ys)?;
            Ok(ys)
        }
    }
    match w.dtype() {
        GgmlDType::Q2K | GgmlDType::Q3K | GgmlDType::Q4K | GgmlDType::Q5K | GgmlDType::Q6K => {
            with_blocks(xs, w, rows, Product)
        }
        _ => Ok(None),
    }
}

/// `xs [m, in] · wᵀ` over output rows `rows` of a block-quantized `w` (`[out, in]`) for
/// many rows of `x` (a prefill): each GEMM task of [`crate::dense::prefill_rows`]
/// dequantizes its span of rows (Candle's `to_float`) into its thread's buffer and
/// multiplies it there. `None` for a format this does not read.
pub fn prefill_dequantized(xs: &Tensor, w: &QTensor, rows: Range<usize>) -> Result<Option<Tensor>> {
    struct Dequantized;
    impl BlockProduct for Dequantized {
        fn run<T: GgmlType>(&self, x: &[f32], m: usize, k: usize, w: &[T]) -> Result<Vec<f32>> {
            let nb = k / T::BLCK_SIZE;
            let row = |o: usize, dst: &mut [f32]| T::to_float(&w[o * nb..][..nb], dst);
            Ok(crate::dense::prefill_rows(x, m, k, w.len() / nb, &row))
        }
    }
    with_blocks(xs, w, rows, Dequantized)
}

/// A product of rows of `x` with the rows of a block-quantized weight, as Candle's blocks.
trait BlockProduct {
    /// `x [m, k] · wᵀ`, `[m, n]` for the `n` rows of `k / T::BLCK_SIZE` blocks in `w`.
    fn run<T: GgmlType>(&self, x: &[f32], m: usize, k: usize, w: &[T]) -> Result<Vec<f32>>;
}

/// `p` on the rows `rows` of `w` seen as Candle's blocks of its format (any format with a
/// block type; `None` for others, a width that is not whole blocks, or storage that is
/// not whole aligned blocks).
fn with_blocks(
    xs: &Tensor,
    w: &QTensor,
    rows: Range<usize>,
    p: impl BlockProduct,
) -> Result<Option<Tensor>> {
    use candle_core::quantized::k_quants::{
        BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1,
        BlockQ6K, BlockQ8_0,
    };
    fn run<T: GgmlType>(
        p: &impl BlockProduct,
        x: &[f32],
        (m, k): (usize, usize),
        data: &[u8],
        rows: Range<usize>,
    ) -> Result<Option<Vec<f32>>> {
        // SAFETY: the blocks are plain `repr(C)` structs of integers and f16 values, for
        // which every bit pattern is valid; `align_to` only yields whole, aligned blocks.
        let (head, blocks, _) = unsafe { data.align_to::<T>() };
        let nb = k / T::BLCK_SIZE;
        if !head.is_empty() || !k.is_multiple_of(T::BLCK_SIZE) || blocks.len() < rows.end * nb {
            return Ok(None);
        }
        p.run(x, m, k, &blocks[rows.start * nb..rows.end * nb])
            .map(Some)
    }
    let (d_out, k) = w.shape().dims2()?;
    let (m, xk) = xs.dims2()?;
    if !crate::cpu_kernels(&w.device()) || !crate::cpu_kernels(xs.device()) || xk != k || k == 0 {
        return Ok(None);
    }
    if rows.start > rows.end || rows.end > d_out {
        bail!("quantized product: rows {rows:?} of a weight with {d_out}")
    }
    let data = w.data()?;
    let ys = crate::dense::with_f32_values(xs, |x| {
        let (x, r, mk) = (x, rows.clone(), (m, k));
        match w.dtype() {
            GgmlDType::Q4_0 => run::<BlockQ4_0>(&p, x, mk, &data, r),
            GgmlDType::Q4_1 => run::<BlockQ4_1>(&p, x, mk, &data, r),
            GgmlDType::Q5_0 => run::<BlockQ5_0>(&p, x, mk, &data, r),
            GgmlDType::Q5_1 => run::<BlockQ5_1>(&p, x, mk, &data, r),
            GgmlDType::Q8_0 => run::<BlockQ8_0>(&p, x, mk, &data, r),
            GgmlDType::Q2K => run::<BlockQ2K>(&p, x, mk, &data, r),
            GgmlDType::Q3K => run::<BlockQ3K>(&p, x, mk, &data, r),
            GgmlDType::Q4K => run::<BlockQ4K>(&p, x, mk, &data, r),
            GgmlDType::Q5K => run::<BlockQ5K>(&p, x, mk, &data, r),
            GgmlDType::Q6K => run::<BlockQ6K>(&p, x, mk, &data, r),
            _ => Ok(None),
        }
    })?;
    ys.map(|ys| Tensor::from_vec(ys, (m, rows.len()), xs.device()))
        .transpose()
}

/// `[m, n]`: every row of `x` against the `n` weight rows of `row_bytes` bytes in `w`.
fn product(format: Format, w: &[u8], row_bytes: usize, x: &QRows) -> Vec<f32> {
    let (m, n) = (x.rows(), w.len() / row_bytes.max(1));
    if m == 0 || n == 0 {
        return vec![0.0; m * n];
    }
    let parts = ranges(n, 64, n * x.k);
    let blocks = map_ranges(&parts, |lo, hi| {
        let n = hi - lo;
        let mut out = vec![0f32; m * n];
        for i in 0..n {
            let row = &w[(lo + i) * row_bytes..][..row_bytes];
            for r in 0..m {
                out[r * n + i] = dot(format, row, x.row(r));
            }
        }
        out
    });
    if let [block] = &blocks[..] {
        return block.clone();
    }
    let mut ys = vec![0f32; m * n];
    for (&(lo, hi), block) in parts.iter().zip(&blocks) {
        for r in 0..m {
            ys[r * n + lo..r * n + hi].copy_from_slice(&block[r * (hi - lo)..][..hi - lo]);
        }
    }
    ys
}

/// One weight row (`w`, whole blocks) against one quantized row of `x`: an exact integer
/// sum per block, scaled in f32.
fn dot(format: Format, w: &[u8], (xq, xd, _): (&[i8], &[f32], &[i32])) -> f32 {
    debug_assert!(w.len() >= xd.len() * format.block_bytes() && xq.len() >= xd.len() * QK);
    let mut acc = 0f32;
    for (b, block) in w
        .chunks_exact(format.block_bytes())
        .take(xd.len())
        .enumerate()
    {
        let dw = f16::from_le_bytes([block[0], block[1]]).to_f32();
        let x = &xq[b * QK..][..QK];
        let sum: i32 = match format {
            Format::Q8_0 => block[2..]
                .iter()
                .zip(x)
                .map(|(&w, &x)| w as i8 as i32 * x as i32)
                .sum(),
            Format::Q4_0 => (0..QK / 2)
                .map(|j| {
                    let q = block[2 + j];
                    ((q & 15) as i32 - 8) * x[j] as i32 + ((q >> 4) as i32 - 8) * x[j + 16] as i32
                })
                .sum(),
            Format::Q5_0 => {
                let qh = u32::from_le_bytes([block[2], block[3], block[4], block[5]]);
                let high = |j: usize| ((qh >> j) & 1) as i32 * 16;
                (0..QK / 2)
                    .map(|j| {
                        let q = block[6 + j];
                        ((q & 15) as i32 + high(j) - 16) * x[j] as i32
                            + ((q >> 4) as i32 + high(j + 16) - 16) * x[j + 16] as i32
                    })
                    .sum()
            }
        };
        acc += sum as f32 * (dw * xd[b]);
    }
    acc
}

#[cfg(test)]
pub(crate) mod tests {
    use super::super::input::*;
    use super::*;
    use candle_core::quantized::QMatMul;
    use candle_core::{DType, Device, Module};

    /// Values of every kind in blocks of `block`: ordinary ones, halves of the step, zeros
    /// of both signs, subnormals, the largest floats, infinities and NaN, blocks that are
    /// all zero or all subnormal.
    fn awkward_rows(block: usize) -> Vec<f32> {
        let specials = [
            0.0,
            -0.0,
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            1e-40,
            -1e-45,
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
            -15.5,
            127.0,
        ];
        let mut x: Vec<f32> = (0..block * 24)
            .map(|i| ((i * 7919 % 1013) as f32 - 506.0) / 3.7)
            .collect();
        for (b, xb) in x.chunks_exact_mut(block).enumerate() {
            match b {
                0 => xb.fill(0.0),
                1 => xb
                    .iter_mut()
                    .enumerate()
                    .for_each(|(i, v)| *v = (i as f32 + 1.0) * -1e-42),
                2..=13 => xb[b * 5 % block] = specials[b - 2],
                // Two at once: NaN twice, both infinities, NaN and infinity, ±MAX.
                14..=17 => {
                    let pairs = [
                        (f32::NAN, f32::NAN),
                        (f32::INFINITY, f32::NEG_INFINITY),
                        (f32::NAN, f32::INFINITY),
                        (f32::MAX, -f32::MAX),
                    ];
                    (xb[3], xb[block - 2]) = pairs[b - 14];
                }
                _ => {}
            }
        }
        x
    }

    /// A quantizer of blocks: values, scales and sums.
    pub(crate) type Quantizer = fn(&[f32], &mut [i8], &mut [f32], &mut [i32]);

    /// `vector` (the dispatched quantizer: AVX-512 or AVX2 where the CPU has it) and
    /// `scalar` (the same loop compiled for the baseline) give the same bytes, scales and
    /// sums, bit for bit, on [`awkward_rows`] in blocks of `block` with `sums` sums each.
    pub(crate) fn assert_same_quantization(
        block: usize,
        sums: usize,
        vector: Quantizer,
        scalar: Quantizer,
    ) {
        let x = awkward_rows(block);
        let n = x.len() / block;
        let mut outs =
            [0, 1].map(|v| (vec![v as i8; x.len()], vec![v as f32; n], vec![v; n * sums]));
        for (f, (q, d, s)) in [vector, scalar].into_iter().zip(&mut outs) {
            f(&x, q, d, s);
        }
        let [(q0, d0, s0), (q1, d1, s1)] = outs;
        assert_eq!(q0, q1);
        assert_eq!(s0, s1);
        let bits = |d: &[f32]| d.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&d0), bits(&d1));
    }

    #[test]
    fn vector_quantizer_equals_the_scalar_code() {
        assert_same_quantization(QK, 1, quantize_blocks, quantize_blocks_impl);
        // And what `abs_max` and `saturate_i8` stand for.
        let x = awkward_rows(QK);
        for xb in x.chunks_exact(QK) {
            let reference = xb.iter().fold(0f32, |a, &v| a.max(v.abs()));
            assert_eq!(abs_max(xb).to_bits(), reference.to_bits());
        }
        for v in [0.4, -0.6, 127.9, 128.0, -128.9, -129.0, 1e30, -1e30]
            .into_iter()
            .chain(x.iter().copied())
        {
            assert_eq!(saturate_i8(v), v as i8, "{v}");
        }
    }

    /// A `[n, k]` weight of standard normal values (with a few large ones, so blocks have
    /// different scales), quantized by Candle.
    fn weight(n: usize, k: usize, dtype: GgmlDType, seed: u64) -> (Vec<f32>, QTensor) {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, (n, k), &dev).unwrap();
        let spikes = (Tensor::rand(0f32, 1.0, (n, k), &dev)
            .unwrap()
            .ge(0.99)
            .unwrap())
        .to_dtype(DType::F32)
        .unwrap()
            * (seed as f64 + 4.0);
        let w = (w + spikes.unwrap()).unwrap();
        let q = QTensor::quantize(&w, dtype).unwrap();
        let wd = q
            .dequantize(&dev)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        (wd, q)
    }

    #[test]
    fn products_match_candle_and_the_f64_product() {
        let dev = Device::Cpu;
        // Odd block counts (k = 96, 800) exercise the one-block tails.
        for (dtype, (m, k, n)) in [GgmlDType::Q8_0, GgmlDType::Q4_0, GgmlDType::Q5_0]
            .into_iter()
            .flat_map(|d| [(1, 768, 300), (3, 96, 70), (8, 800, 129), (17, 256, 5)].map(|s| (d, s)))
        {
            let (wd, q) = weight(n, k, dtype, m as u64);
            let x = Tensor::randn(0f32, 1.0, (m, k), &dev).unwrap();
            let xv: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
            // Candle's product quantizes x the same way: the same numbers up to the order
            // of the sums. (Its q5_0 product takes blocks in pairs: an odd count fails its
            // debug assertion.)
            let ys = qmatmul(&x, &q, 0..n).unwrap().unwrap();
            if dtype != GgmlDType::Q5_0 || (k / QK).is_multiple_of(2) {
                let theirs = QMatMul::from_qtensor(q).unwrap().forward(&x).unwrap();
                let diff = (&ys - &theirs).unwrap().abs().unwrap().max_all().unwrap();
                assert!(
                    diff.to_scalar::<f32>().unwrap() < 1e-3,
                    "{dtype:?} {m}x{k}x{n} against Candle"
                );
            }
            // Against the exact product with the dequantized weight, x's 8-bit rounding
            // (half a step, amax/254, per value) bounds the error: Σ |w|·amax/254.
            let ys: Vec<f32> = ys.flatten_all().unwrap().to_vec1().unwrap();
            for r in 0..m {
                for o in 0..n {
                    let (xr, wr) = (&xv[r * k..][..k], &wd[o * k..][..k]);
                    let exact: f64 = xr.iter().zip(wr).map(|(&a, &b)| a as f64 * b as f64).sum();
                    let bound: f64 = xr
                        .chunks(QK)
                        .zip(wr.chunks(QK))
                        .map(|(xb, wb)| {
                            let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs())) as f64;
                            wb.iter().map(|&w| w.abs() as f64).sum::<f64>() * amax / 254.0 * 1.01
                        })
                        .sum();
                    let got = ys[r * n + o] as f64;
                    assert!(
                        (got - exact).abs() <= bound + 1e-4,
                        "{dtype:?}: {got} vs {exact} (bound {bound})"
                    );
                }
            }
        }
    }

    /// The k-quants through Candle's block product on the stored blocks: what Candle's
    /// `QMatMul` gives (its repacked q4_K tiles sum in another order), for a range of rows
    /// too; other formats and widths are left to the caller.
    #[test]
    fn k_quants_multiply_as_candle_does() {
        let dev = Device::Cpu;
        for dtype in [
            GgmlDType::Q2K,
            GgmlDType::Q3K,
            GgmlDType::Q4K,
            GgmlDType::Q5K,
            GgmlDType::Q6K,
        ] {
            for (m, k, n) in [(1, 512, 37), (3, 256, 18)] {
                let (_, q) = weight(n, k, dtype, 7);
                let x = Tensor::randn(0f32, 1.0, (m, k), &dev).unwrap();
                let ys = kquant_matmul(&x, &q, 0..n).unwrap().unwrap();
                let part = kquant_matmul(&x, &q, 5..n - 3).unwrap().unwrap();
                let theirs = QMatMul::from_qtensor(q).unwrap().forward(&x).unwrap();
                let scale = theirs
                    .abs()
                    .unwrap()
                    .max_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap();
                let diff = |a: &Tensor, b: &Tensor| {
                    let d = (a - b).unwrap().abs().unwrap().max_all().unwrap();
                    d.to_scalar::<f32>().unwrap()
                };
                assert!(diff(&ys, &theirs) <= 1e-5 * scale, "{dtype:?} {m}x{k}x{n}");
                let narrow = ys.narrow(1, 5, n - 8).unwrap();
                assert_eq!(diff(&part, &narrow), 0.0, "{dtype:?}: rows 5..{}", n - 3);
            }
        }
        let x = Tensor::zeros((1, 64), DType::F32, &dev).unwrap();
        let (_, q8) = weight(4, 64, GgmlDType::Q8_0, 0);
        assert!(kquant_matmul(&x, &q8, 0..4).unwrap().is_none());
        let x = Tensor::zeros((1, 256), DType::F32, &dev).unwrap();
        let (_, q) = weight(4, 256, GgmlDType::Q4K, 0);
        assert!(kquant_matmul(&x, &q, 2..5).is_err(), "rows past the weight");
    }

    /// A prefill's product with each task dequantizing its own rows: the f32 product with
    /// Candle's dequantized weight, for every block format, a range of rows, and enough
    /// rows and columns for several tasks on the pool.
    #[test]
    fn prefill_products_are_those_of_the_dequantized_weight() {
        let dev = Device::Cpu;
        for dtype in [
            GgmlDType::Q4_0,
            GgmlDType::Q4_1,
            GgmlDType::Q5_0,
            GgmlDType::Q5_1,
            GgmlDType::Q8_0,
            GgmlDType::Q2K,
            GgmlDType::Q3K,
            GgmlDType::Q4K,
            GgmlDType::Q5K,
            GgmlDType::Q6K,
        ] {
            let (m, k, n) = (40, 512, 300);
            let (_, q) = weight(n, k, dtype, 3);
            let x = Tensor::randn(0f32, 1.0, (m, k), &dev).unwrap();
            let dense = q.dequantize(&dev).unwrap().to_dtype(DType::F64).unwrap();
            let want = x
                .to_dtype(DType::F64)
                .unwrap()
                .matmul(&dense.t().unwrap())
                .unwrap();
            let scale = want
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap();
            for (lo, hi) in [(0, n), (17, 251)] {
                let got = prefill_dequantized(&x, &q, lo..hi).unwrap().unwrap();
                let diff = (got.to_dtype(DType::F64).unwrap()
                    - want.narrow(1, lo, hi - lo).unwrap())
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap();
                assert!(
                    diff <= 1e-5 * scale,
                    "{dtype:?} rows {lo}..{hi}: {diff} of {scale}"
                );
            }
        }
        let x = Tensor::zeros((2, 256), DType::F32, &dev).unwrap();
        let (_, q) = weight(4, 256, GgmlDType::Q4_0, 0);
        assert!(
            prefill_dequantized(&x, &q, 2..5).is_err(),
            "rows past the weight"
        );
    }

    #[test]
    fn rows_quantize_as_candle_quantizes_them() {
        // Candle's q8_0 quantizer is ggml's (`roundf`): the same bytes and scales, ties
        // and values just below them included.
        let mut x: Vec<f32> = (0..32 * 64)
            .map(|i| ((i * 37 % 255) as f32 - 127.0) / 13.0)
            .collect();
        // A block whose values land exactly on halves of its step, and one just below.
        for (j, v) in x[..32].iter_mut().enumerate() {
            *v = j as f32 - 15.5;
        }
        x[31] = 127.0;
        for (j, v) in x[32..64].iter_mut().enumerate() {
            // The float just below each half, toward zero (0.49999997 for 0.5).
            let h = j as f32 - 15.5;
            *v = f32::from_bits(h.abs().to_bits() - 1).copysign(h);
        }
        x[63] = 127.0;
        let ours = QRows::new(&x, x.len());
        let t = Tensor::from_vec(x.clone(), (1, x.len()), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&t, GgmlDType::Q8_0).unwrap();
        let data = q.data().unwrap();
        for (b, block) in data.chunks_exact(34).enumerate() {
            let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
            assert_eq!(d, ours.d[b], "block {b}");
            let theirs: Vec<i8> = block[2..].iter().map(|&q| q as i8).collect();
            assert_eq!(&ours.q[b * 32..][..32], &theirs[..], "block {b}");
        }
    }

    #[test]
    fn a_row_range_is_those_rows_of_the_whole_product() {
        let dev = Device::Cpu;
        let (_, q) = weight(200, 128, GgmlDType::Q8_0, 1);
        let x = Tensor::randn(0f32, 1.0, (2, 128), &dev).unwrap();
        let all = qmatmul(&x, &q, 0..200).unwrap().unwrap();
        let part = qmatmul(&x, &q, 37..101).unwrap().unwrap();
        let diff = (all.narrow(1, 37, 64).unwrap() - part).unwrap();
        assert_eq!(
            diff.abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap(),
            0.0
        );
    }

    #[test]
    fn other_formats_and_mismatched_inputs_are_refused() {
        let dev = Device::Cpu;
        let (_, q) = weight(16, 256, GgmlDType::Q4K, 0);
        let x = Tensor::zeros((1, 256), DType::F32, &dev).unwrap();
        assert!(qmatmul(&x, &q, 0..16).unwrap().is_none());
        let (_, q) = weight(16, 64, GgmlDType::Q8_0, 0);
        assert!(qmatmul(&x, &q, 0..16).is_err());
        let x = Tensor::zeros((1, 64), DType::F32, &dev).unwrap();
        assert!(qmatmul(&x, &q, 0..17).is_err());
    }
}
