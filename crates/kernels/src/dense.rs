//! Products of a few rows with a weight matrix (decoding: one row per sequence) on the
//! CPU, f32, f16 or bf16, streaming the weight once from memory.
//!
//! With so few rows the product is bound by reading the weight, and a GEMM's packing and
//! tiling only get in the way (Candle also widens bf16 weights to f32 on every call).
//! Each thread takes a *contiguous* range of the weight's memory and walks it front to
//! back, which is what the hardware prefetchers follow best:
//! - `[in, out]` weights (GPT-2's Conv1D): a thread takes a range of input rows and adds
//!   `x[i]·w[i, :]` into its own partial output, four rows per pass; the partials are
//!   summed at the end (with the bias).
//! - `[out, in]` weights seen transposed (an `nn.Linear`, a tied LM head): a thread takes
//!   a range of output rows and computes their dot products with `x`, one row after
//!   another for one row of `x`, four at a time (reused from L1) for several.
//!
//! Sums are in f32 whatever the weight's dtype. bf16 is widened by a shift as it is read,
//! f16 by `vcvtph2ps` on CPUs with AVX-512 or AVX2 and F16C (elsewhere f16 stays on
//! Candle's f16 GEMM). Its reference is `matmul`; the tests hold it to that.
//!
//! A public module for the crates built on this one (their quantized and dense projections)
//! and for the benchmarks; [`crate::Proj`] picks it when it applies.

use candle_core::{CpuStorage, DType, Result, Storage, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;
use std::mem::MaybeUninit;

use crate::shared::SharedOut;
use crate::simd::{self, Widen};

/// The most rows this path takes, for weights seen transposed (`[out, in]` stored): the
/// dot products beat `gemm` at 1, 4 and 8 rows (`benches/matvec.rs`).
pub const MAX_ROWS: usize = 8;
/// The most rows for `[in, out]` weights: the row updates beat `gemm` at 1 row, match
/// it at 2 and lose from 4, where each weight tile is re-read per row from L1 and a
/// GEMM's register blocking does better.
pub const MAX_ROWS_IN_OUT: usize = 2;

/// Output elements per tile in `rows_times_w`, over all rows of `x`: 24 KiB of f32 that
/// stay in L1 while the weight streams past. One row of `x` takes GPT-2's weight rows
/// (up to 3072 wide) whole: narrower tiles would make every few KiB a new stream for the
/// prefetchers, which read it slower (docs/PERFORMANCE.md, "Dense products").
const TILE: usize = 6144;

/// A weight dtype with product kernels.
pub(crate) trait Elem: Widen {
    const ZERO: Self;
    fn axpy4(y: &mut [f32], a: [f32; 4], w: [&[Self]; 4]);
    /// `out[r·cols + j] = x_r · data[first + j·stride ..]` for the `m` rows of `x`.
    #[allow(clippy::too_many_arguments)]
    fn dot_rows(
        x: &[f32],
        m: usize,
        data: &[Self],
        first: usize,
        stride: usize,
        out: &mut [f32],
        cols: usize,
    );
}

impl Elem for f32 {
    const ZERO: Self = 0.0;
    fn axpy4(y: &mut [f32], a: [f32; 4], w: [&[f32]; 4]) {
        simd::axpy4(y, a, w)
    }
    fn dot_rows(
        x: &[f32],
        m: usize,
        data: &[f32],
        first: usize,
        stride: usize,
        out: &mut [f32],
        cols: usize,
    ) {
        simd::dot_rows(x, m, data, first, stride, out, cols)
    }
}

impl Elem for bf16 {
    const ZERO: Self = bf16::ZERO;
    fn axpy4(y: &mut [f32], a: [f32; 4], w: [&[bf16]; 4]) {
        simd::axpy4_bf16(y, a, w)
    }
    fn dot_rows(
        x: &[f32],
        m: usize,
        data: &[bf16],
        first: usize,
        stride: usize,
        out: &mut [f32],
        cols: usize,
    ) {
        simd::dot_rows_bf16(x, m, data, first, stride, out, cols)
    }
}

impl Elem for f16 {
    const ZERO: Self = f16::ZERO;
    fn axpy4(y: &mut [f32], a: [f32; 4], w: [&[f16]; 4]) {
        simd::axpy4_f16(y, a, w)
    }
    fn dot_rows(
        x: &[f32],
        m: usize,
        data: &[f16],
        first: usize,
        stride: usize,
        out: &mut [f32],
        cols: usize,
    ) {
        simd::dot_rows_f16(x, m, data, first, stride, out, cols)
    }
}

/// Whether [`few_rows_matmul`] should take `xs · w_t` rather than `matmul`: few rows, and a
/// weight large enough to be split across threads, or bf16 (which Candle's matmul widens to f32
/// on every call) or f16 where this has kernels for it (Candle's f16 GEMM sums in f16: its
/// error grows with the width, see the tests). Small f32 weights (under `PARALLEL_MIN`) stay on
/// `gemm`, which runs them on one thread with less overhead.
pub fn preferred(xs: &Tensor, w_t: &Tensor) -> bool {
    let half = match w_t.dtype() {
        DType::BF16 => true,
        DType::F16 => simd::f16_kernels(),
        _ => false,
    };
    xs.rank() == 2
        && xs.dim(0).is_ok_and(|m| m <= MAX_ROWS)
        && (half || w_t.elem_count() >= PARALLEL_MIN)
}

/// `xs [m, in] · w_t [in, out] (+ b [out])` for `m <= MAX_ROWS` (`MAX_ROWS_IN_OUT` when `w_t`
/// is stored `[in, out]`), or `None` when the operands are not f32, bf16 or (on CPUs with
/// AVX-512, or AVX2 and F16C) f16 CPU tensors in a layout this handles, or a gradient is
/// needed: the caller then uses `matmul`. `xs` and `b` are in the weight's dtype, or f32 with a
/// half-precision weight (f32 activations, as llama.cpp runs f16 models); the result is in
/// `xs`'s dtype.
pub fn few_rows_matmul(xs: &Tensor, w_t: &Tensor, b: Option<&Tensor>) -> Result<Option<Tensor>> {
    let (m, d_in) = xs.dims2()?;
    let (w_in, d_out) = w_t.dims2()?;
    let dtype = xs.dtype();
    let w_dtype = w_t.dtype();
    let on_cpu = |t: &Tensor| crate::cpu_kernels(t.device()) && !t.track_op();
    let activation = |t: &Tensor| on_cpu(t) && (t.dtype() == w_dtype || t.dtype() == DType::F32);
    if m == 0
        || m > MAX_ROWS
        || d_in == 0
        || d_out == 0
        || w_in != d_in
        || !matches!(w_dtype, DType::F32 | DType::F16 | DType::BF16)
        || (w_dtype == DType::F16 && !simd::f16_kernels())
        || !activation(xs)
        || !on_cpu(w_t)
        || !b.is_none_or(|b| activation(b) && b.dims() == [d_out])
    {
        return Ok(None);
    }
    let mut ys = match b {
        Some(b) => b.to_dtype(DType::F32)?.to_vec1::<f32>()?.repeat(m),
        None => vec![0f32; m * d_out],
    };
    // `x` read where it is (a decoding step's rows are f32 and contiguous).
    let done = with_f32_values(xs, |x| {
        let (storage, layout) = w_t.storage_and_layout();
        let (start, stride) = (layout.start_offset(), layout.stride());
        Ok(match &*storage {
            Storage::Cpu(CpuStorage::F32(w)) => {
                product(x, m, w, start, stride, d_in, d_out, &mut ys)
            }
            Storage::Cpu(CpuStorage::BF16(w)) => {
                product(x, m, w, start, stride, d_in, d_out, &mut ys)
            }
            Storage::Cpu(CpuStorage::F16(w)) => {
                product(x, m, w, start, stride, d_in, d_out, &mut ys)
            }
            _ => false,
        })
    })?;
    if !done {
        return Ok(None);
    }
    Tensor::from_vec(ys, (m, d_out), xs.device())?
        .to_dtype(dtype)
        .map(Some)
}

/// `f` on the values of `xs` as f32, row-major: borrowed from the tensor's storage when it
/// holds them contiguous in f32 on the CPU (a prefill's activations, which a copy would
/// hold twice for a moment), else converted once.
pub fn with_f32_values<T>(xs: &Tensor, f: impl FnOnce(&[f32]) -> Result<T>) -> Result<T> {
    let xs = xs.to_dtype(DType::F32)?.contiguous()?;
    let (storage, layout) = xs.storage_and_layout();
    if let Storage::Cpu(CpuStorage::F32(all)) = &*storage {
        let at = layout.start_offset();
        if let Some(x) = all.get(at..at + xs.elem_count()) {
            return f(x);
        }
    }
    drop(storage);
    f(&xs.flatten_all()?.to_vec1::<f32>()?)
}

/// Weights (f32 elements) a task of [`prefill_matmul`] takes at a time: 384 KiB, which
/// stay in a 1 MiB L2 beside the GEMM's packed rows while it reads them once per block of
/// rows. The tasks run single-threaded GEMMs side by side, where one parallel GEMM over
/// large widened slabs left the threads waiting on each other and the widened copies
/// outside the cache (docs/PERFORMANCE.md, "Dense products").
const TASK_SLAB: usize = 96 << 10;
/// The fewest output columns of a task.
const MIN_COLS: usize = 48;

thread_local! {
    static SLAB_BUF: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// A part's outputs in [`rows_dot_w`], before they are added to the result.
    static DOT_BUF: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// A task's gate outputs in a SwiGLU product ([`OutputAct::SwiGlu`]).
    static GATE_BUF: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// An activation a prefill product applies to its outputs as each task writes them, while
/// they are in cache: no second `[rows, out]` tensor and no second pass over memory
/// ([`crate::Proj::forward_act`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputAct {
    /// GPT-2's tanh GELU, `gelu_tanh(x·w + b)`.
    GeluTanh,
    /// SwiGLU: the weight's outputs are the gate's, then the up projection's
    /// (`[in, 2·inner]`); the result is `silu(gate)·up`, `[rows, inner]`.
    SwiGlu,
}

/// `xs [m, in] · w_t [in, out]` for f32 rows and an f32, f16 or bf16 weight on the CPU,
/// any number of rows (a prefill): tasks on the pool each take a span of output columns
/// and multiply it by the f32 GEMM on their own thread; half-precision weights are first
/// widened to f32, a span at a time, into a buffer the task's thread reuses. Widening
/// costs a few percent of a product with hundreds of rows; the f32 GEMM is several times
/// Candle's f16 one on CPUs without AVX-512 FP16, and the small reused buffers keep the
/// widened copy from costing memory or fresh pages (a tied head widened whole would be
/// twice its half-precision size). `None` when the operands are not such tensors, a gradient is
/// needed, or the weight has neither unit-stride rows nor columns: the caller then uses
/// `matmul` (converting a half-precision weight).
pub fn prefill_matmul(xs: &Tensor, w_t: &Tensor) -> Result<Option<Tensor>> {
    prefill_fused(xs, w_t, None, None)
}

/// [`prefill_matmul`] with the bias `b [out]` added and `act` applied by each task to the
/// span it has just written (an [`OutputAct::SwiGlu`] product returns `[m, out / 2]`, its
/// bias is the gate's and the up projection's, `[out]`). The same sums as the product,
/// `broadcast_add` and the activation's kernel in turn, without their `[m, out]` tensors:
/// SwiGLU's gate-and-up output, twice the MLP's width for every row, is never whole.
pub fn prefill_fused(
    xs: &Tensor,
    w_t: &Tensor,
    b: Option<&Tensor>,
    act: Option<OutputAct>,
) -> Result<Option<Tensor>> {
    let (m, d_in) = xs.dims2()?;
    let (w_in, d_out) = w_t.dims2()?;
    let plain = |t: &Tensor| crate::cpu_kernels(t.device()) && !t.track_op();
    let swiglu = act == Some(OutputAct::SwiGlu);
    if m == 0
        || d_in == 0
        || d_out == 0
        || w_in != d_in
        || (swiglu && d_out % 2 != 0)
        || xs.dtype() != DType::F32
        || !matches!(w_t.dtype(), DType::F32 | DType::F16 | DType::BF16)
        || !plain(xs)
        || !plain(w_t)
        || !b.is_none_or(|b| plain(b) && b.dims() == [d_out])
    {
        return Ok(None);
    }
    let bias = b
        .map(|b| b.to_dtype(DType::F32)?.to_vec1::<f32>())
        .transpose()?;
    let xs = xs.contiguous()?;
    let (x_storage, x_layout) = xs.storage_and_layout();
    let Storage::Cpu(CpuStorage::F32(x)) = &*x_storage else {
        return Ok(None);
    };
    let Some(x) = x.get(x_layout.start_offset()..x_layout.start_offset() + m * d_in) else {
        return Ok(None);
    };
    let (w_storage, w_layout) = w_t.storage_and_layout();
    let view = View {
        start: w_layout.start_offset(),
        s0: w_layout.stride()[0],
        s1: w_layout.stride()[1],
        d_in,
        d_out,
    };
    let width = if swiglu { d_out / 2 } else { d_out };
    let epilogue = Epilogue {
        bias: bias.as_deref(),
        act,
    };
    // Not zeroed first: the tasks write every element, and zeroing took a pass over every
    // product's output in a prefill.
    let mut ys = Vec::with_capacity(m * width);
    let out = &mut ys.spare_capacity_mut()[..m * width];
    let done = match &*w_storage {
        Storage::Cpu(CpuStorage::F32(w)) => span_products(x, m, w, view, epilogue, out),
        Storage::Cpu(CpuStorage::F16(w)) => span_products(x, m, w, view, epilogue, out),
        Storage::Cpu(CpuStorage::BF16(w)) => span_products(x, m, w, view, epilogue, out),
        _ => false,
    };
    drop((x_storage, w_storage));
    if !done {
        return Ok(None);
    }
    // SAFETY: `span_products` returned true, so its tasks wrote all m × width elements
    // (each every row of its span of columns; the spans cover the width).
    unsafe { ys.set_len(m * width) };
    Tensor::from_vec(ys, (m, width), xs.device()).map(Some)
}

/// What [`span_products`] does to each span after its product: the bias (`[out]` of the
/// weight), then the activation.
#[derive(Clone, Copy)]
struct Epilogue<'a> {
    bias: Option<&'a [f32]>,
    act: Option<OutputAct>,
}

/// A weight element [`prefill_matmul`] reads: f32 in place, f16 and bf16 widened (stored by
/// columns, on CPUs with AVX2 but not AVX-512, by [`simd::avx2_gemm`]: bf16 as it packs,
/// f16 as its tiles load).
trait SpanElem: Sync + Sized {
    /// The weights themselves when they are f32 already.
    fn as_f32(data: &[Self]) -> Option<&[f32]>;
    /// `dst = x · w` for the span `w` of `n` columns stored at stride `cs` (`[n, in]`) by
    /// [`simd::avx2_gemm`]; false (nothing done) for f32.
    ///
    /// # Safety
    /// As [`simd::avx2_gemm::gemm_half`]'s.
    #[cfg(target_arch = "x86_64")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn avx2_columns(
        _x: &[f32],
        _m: usize,
        _d_in: usize,
        _dst: *mut f32,
        _ds: usize,
        _n: usize,
        _w: &[Self],
        _cs: usize,
    ) -> bool {
        false
    }
    fn widen(src: &[Self], dst: &mut [f32]);
}

impl SpanElem for f32 {
    fn as_f32(data: &[f32]) -> Option<&[f32]> {
        Some(data)
    }
    fn widen(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src)
    }
}

impl SpanElem for f16 {
    fn as_f32(_: &[f16]) -> Option<&[f32]> {
        None
    }
    fn widen(src: &[f16], dst: &mut [f32]) {
        simd::widen_f16(src, dst)
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn avx2_columns(
        x: &[f32],
        m: usize,
        d_in: usize,
        dst: *mut f32,
        ds: usize,
        n: usize,
        w: &[f16],
        cs: usize,
    ) -> bool {
        // SAFETY: the caller's.
        unsafe { simd::avx2_gemm::gemm_half(x, m, d_in, dst, ds, n, w, cs) };
        true
    }
}

impl SpanElem for bf16 {
    fn as_f32(_: &[bf16]) -> Option<&[f32]> {
        None
    }
    fn widen(src: &[bf16], dst: &mut [f32]) {
        simd::widen_bf16(src, dst)
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn avx2_columns(
        x: &[f32],
        m: usize,
        d_in: usize,
        dst: *mut f32,
        ds: usize,
        n: usize,
        w: &[bf16],
        cs: usize,
    ) -> bool {
        // SAFETY: the caller's.
        unsafe { simd::avx2_gemm::gemm_half(x, m, d_in, dst, ds, n, w, cs) };
        true
    }
}

/// An `[in, out]` view into a weight's storage.
#[derive(Clone, Copy)]
struct View {
    start: usize,
    s0: usize,
    s1: usize,
    d_in: usize,
    d_out: usize,
}

/// `ys = epilogue(x [m, in] · w)` span by span; false (nothing done) when the view has
/// neither unit-stride rows nor columns or does not lie in `data`. `ys` is `[m, out]`, or
/// `[m, out / 2]` for SwiGLU, whose task for output columns `c0..c0 + n` multiplies the
/// gate's columns `c0..` and the up projection's `out / 2 + c0..`. It need not be
/// initialised: when this returns true, every element has been written.
fn span_products<E: SpanElem>(
    x: &[f32],
    m: usize,
    data: &[E],
    v: View,
    epilogue: Epilogue,
    ys: &mut [MaybeUninit<f32>],
) -> bool {
    let View {
        start,
        s0,
        s1,
        d_in,
        d_out,
    } = v;
    let fits = |n: usize, s: usize, len: usize| start + (n - 1) * s + len <= data.len();
    // `[out, in]` stored, seen transposed: column o is data[start + o·s1..][..in].
    let by_columns = s0 == 1 && s1 >= d_in && fits(d_out, s1, d_in);
    // `[in, out]` stored (Conv1D, or a view into it): row i is data[start + i·s0..][..out].
    let by_rows = s1 == 1 && s0 >= d_out && fits(d_in, s0, d_out);
    if !by_columns && !by_rows {
        return false;
    }
    let swiglu = epilogue.act == Some(OutputAct::SwiGlu);
    // Output columns.
    let width = if swiglu { d_out / 2 } else { d_out };
    // (A SwiGLU task runs two products of its width, the gate's and the up projection's,
    // each of about TASK_SLAB weights.)
    // Half-precision columns on AVX2 without AVX-512 take our GEMM as they are packed, in
    // spans of its whole panels; every other span the GEMM of `gemm_span`.
    #[cfg(target_arch = "x86_64")]
    let (avx2_half, unit) = match E::as_f32(data).is_none() && by_columns && avx2_half_gemm() {
        true => (true, simd::avx2_gemm::PANEL),
        false => (false, 16),
    };
    #[cfg(not(target_arch = "x86_64"))]
    let unit = 16;
    let (spans, parallel) = spans(d_in, width, d_in * d_out, unit);
    let out = SharedOut(ys.as_mut_ptr().cast::<f32>());
    // SAFETY (each call): `dst` has m rows of stride `ds` with n writable columns, which no
    // other task writes (each owns its columns of `ys`, or its thread's gate buffer); `x`
    // holds m × in, and `w` the span (`fits` above, or the widened copy).
    let product = |dst: *mut f32, ds: usize, n: usize, w: &[f32], rs: usize, cs: usize| unsafe {
        gemm_span(x, m, d_in, dst, ds, n, w, rs, cs)
    };
    // The weight's columns c..c + n into `dst`, widened through `buf` when half precision.
    let columns = |dst: *mut f32, ds: usize, c: usize, n: usize, buf: &mut Vec<f32>| {
        if let Some(w) = E::as_f32(data) {
            return match by_columns {
                true => product(dst, ds, n, &w[start + c * s1..], 1, s1),
                false => product(dst, ds, n, &w[start + c..], s0, 1),
            };
        }
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as `product`'s; the span's n columns of d_in values lie in `data` (`fits`),
        // and the CPU has AVX2, FMA and F16C.
        if avx2_half
            && unsafe { E::avx2_columns(x, m, d_in, dst, ds, n, &data[start + c * s1..], s1) }
        {
            return;
        }
        if buf.len() < d_in * n {
            buf.resize(d_in * n, 0.0);
        }
        let slab = &mut buf[..d_in * n];
        // The span widened as `[n, in]` (by columns) or `[in, n]` (by rows).
        match by_columns {
            true => {
                for (j, dst) in slab.chunks_mut(d_in).enumerate() {
                    E::widen(&data[start + (c + j) * s1..][..d_in], dst);
                }
                product(dst, ds, n, slab, 1, d_in)
            }
            false => {
                for (i, dst) in slab.chunks_mut(n).enumerate() {
                    E::widen(&data[start + i * s0 + c..][..n], dst);
                }
                product(dst, ds, n, slab, n, 1)
            }
        }
    };
    let task = |&(c0, c1): &(usize, usize)| {
        let n = c1 - c0;
        // SAFETY: column c0 of row 0 lies in `ys` (m × width, c0 < width).
        let own = unsafe { out.at(c0) };
        SLAB_BUF.with(|buf| {
            let mut buf = buf.borrow_mut();
            if !swiglu {
                columns(own, width, c0, n, &mut buf);
                let act = epilogue.act;
                for r in 0..m {
                    // SAFETY: row r's columns c0..c1 of `ys`, written by this task alone.
                    let row = unsafe { std::slice::from_raw_parts_mut(own.add(r * width), n) };
                    if let Some(b) = epilogue.bias {
                        simd::add(row, &b[c0..c1]);
                    }
                    if act == Some(OutputAct::GeluTanh) {
                        simd::gelu_tanh_in_place(row);
                    }
                }
                return;
            }
            GATE_BUF.with(|gate| {
                let mut gate = gate.borrow_mut();
                if gate.len() < m * n {
                    gate.resize(m * n, 0.0);
                }
                let gate = &mut gate[..m * n];
                columns(gate.as_mut_ptr(), n, c0, n, &mut buf);
                columns(own, width, width + c0, n, &mut buf);
                for (r, g) in gate.chunks_mut(n).enumerate() {
                    // SAFETY: row r's columns c0..c1 of `ys`, written by this task alone.
                    let up = unsafe { std::slice::from_raw_parts_mut(own.add(r * width), n) };
                    if let Some(b) = epilogue.bias {
                        simd::add(g, &b[c0..c1]);
                        simd::add(up, &b[width + c0..width + c1]);
                    }
                    simd::silu_mul_in_place(g, up);
                }
            })
        })
    };
    match parallel && spans.len() > 1 {
        true => spans.par_iter().for_each(task),
        false => spans.iter().for_each(task),
    }
    true
}

/// Column spans of a prefill product's tasks (in whole groups of `unit` columns: the
/// panel of the GEMM that runs them) for an `[in, width]` product, and whether they run on the pool (a weight of `weights` values
/// at least `PARALLEL_MIN`): tasks of about `TASK_SLAB` weights, as many as a multiple of
/// the threads (a GQA model's k and v projections are small: one task would leave a thread
/// idle), of at least `MIN_COLS` columns (the `gemm` crate, where it runs, packs `x` again
/// for every task).
pub(crate) fn spans(
    d_in: usize,
    width: usize,
    weights: usize,
    unit: usize,
) -> (Vec<(usize, usize)>, bool) {
    let parallel = weights >= PARALLEL_MIN;
    let threads = if parallel {
        rayon::current_num_threads().max(1)
    } else {
        1
    };
    let most = (width / MIN_COLS).max(1);
    let mut tasks = (d_in * width).div_ceil(TASK_SLAB).next_multiple_of(threads);
    if tasks > most {
        tasks = if most >= threads {
            most / threads * threads
        } else {
            most
        };
    }
    // As even as whole groups allow.
    let units = width.div_ceil(unit);
    let tasks = tasks.min(units);
    let spans = (0..tasks)
        .map(|t| {
            (
                units * t / tasks * unit,
                (units * (t + 1) / tasks * unit).min(width),
            )
        })
        .collect();
    (spans, parallel)
}

/// `dst[r·ds + j] = (x · w)[r, j]` for `x` `[m, in]` and the `[in, n]` span `w` whose
/// element (k, j) is `w[k·rs + j·cs]` (`dst` is written before it is read, so it may start
/// uninitialised), on this thread: by [`simd::avx512_gemm`] where the
/// CPU has AVX-512F and the span is stored by columns (`rs == 1`: an `nn.Linear`'s rows,
/// every half-precision or dequantized span widened), else by the `gemm` crate's f32 GEMM.
/// Spans stored by rows (GPT-2's f32 Conv1D weights) stay on the crate: ours, reading them
/// in place, was 0.67–0.98× its speed from 16 to 512 rows and 0.7× in batch-8 decoding
/// (docs/PERFORMANCE.md, "Dense products").
///
/// # Safety
/// `dst` has `m` rows of stride `ds` with `n` writable columns that no other thread
/// touches; `x` holds `m × in` values and `w` every element the strides address.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_span(
    x: &[f32],
    m: usize,
    d_in: usize,
    dst: *mut f32,
    ds: usize,
    n: usize,
    w: &[f32],
    rs: usize,
    cs: usize,
) {
    #[cfg(target_arch = "x86_64")]
    if rs == 1 && std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the caller's, and the CPU has just been seen to have AVX-512F.
        return unsafe { simd::avx512_gemm::gemm(x, m, d_in, dst, ds, n, w, rs, cs) };
    }
    // SAFETY: the caller's.
    unsafe {
        gemm::gemm(
            m,
            n,
            d_in,
            dst,
            1,
            ds as isize,
            false,
            x.as_ptr(),
            1,
            d_in as isize,
            w.as_ptr(),
            cs as isize,
            rs as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// Whether half-precision spans stored by columns take [`simd::avx2_gemm`]: AVX2, FMA and
/// F16C without AVX-512F (which takes [`simd::avx512_gemm`] over the widened span).
#[cfg(target_arch = "x86_64")]
fn avx2_half_gemm() -> bool {
    simd::avx2_kernels() && !std::arch::is_x86_feature_detected!("avx512f")
}

/// `x [m, in] · wᵀ` (`[m, out]`) for a weight `[out, in]` whose rows `row(o, dst)` writes
/// as f32: [`prefill_matmul`]'s tasks, each writing its span of rows into its thread's
/// buffer (in L2) and multiplying it there, where a whole dequantized copy of a quantized
/// matrix would be made first, on one thread, and read back from memory.
pub fn prefill_rows(
    x: &[f32],
    m: usize,
    d_in: usize,
    d_out: usize,
    row: &(dyn Fn(usize, &mut [f32]) + Sync),
) -> Vec<f32> {
    assert!(
        x.len() >= m * d_in,
        "prefill_rows: x holds fewer than m rows"
    );
    if m == 0 || d_in == 0 || d_out == 0 {
        return vec![0f32; m * d_out];
    }
    // Not zeroed first: the tasks write every element.
    let mut ys = Vec::<f32>::with_capacity(m * d_out);
    let (spans, parallel) = spans(d_in, d_out, d_in * d_out, 16);
    let out = SharedOut(ys.as_mut_ptr());
    let task = |&(c0, c1): &(usize, usize)| {
        let n = c1 - c0;
        SLAB_BUF.with(|buf| {
            let mut buf = buf.borrow_mut();
            if buf.len() < d_in * n {
                buf.resize(d_in * n, 0.0);
            }
            // The span as `[n, in]`.
            let slab = &mut buf[..d_in * n];
            for (j, dst) in slab.chunks_mut(d_in).enumerate() {
                row(c0 + j, dst);
            }
            // SAFETY: columns c0..c1 of the m rows of `ys` (`[m, out]`), this task's alone;
            // `slab` holds the span's n × in values.
            unsafe { gemm_span(x, m, d_in, out.at(c0), d_out, n, slab, 1, d_in) };
        })
    };
    match parallel && spans.len() > 1 {
        true => spans.par_iter().for_each(task),
        false => spans.iter().for_each(task),
    }
    // SAFETY: the tasks have written all m × out elements (each every row of its span of
    // columns; the spans cover the width).
    unsafe { ys.set_len(m * d_out) };
    ys
}

/// `ys += x · w` with `w` the `[in, out]` view at `start` with `stride` into `data`;
/// false (and nothing done) when the view has neither unit-stride rows nor columns, or
/// has rows and more than `MAX_ROWS_IN_OUT` of them are asked for.
#[allow(clippy::too_many_arguments)]
fn product<E: Elem>(
    x: &[f32],
    m: usize,
    data: &[E],
    start: usize,
    stride: &[usize],
    d_in: usize,
    d_out: usize,
    ys: &mut [f32],
) -> bool {
    let fits = |n: usize, s: usize, len: usize| start + (n - 1) * s + len <= data.len();
    if m <= MAX_ROWS_IN_OUT && stride[1] == 1 && stride[0] >= d_out && fits(d_in, stride[0], d_out)
    {
        // Row i of `[in, out]` is data[start + i·s0 ..][..out].
        rows_times_w(
            x,
            m,
            d_in,
            d_out,
            &|i| &data[start + i * stride[0]..][..d_out],
            ys,
        );
        true
    } else if stride[0] == 1 && stride[1] >= d_in && fits(d_out, stride[1], d_in) {
        // Column o of `[in, out]` (row o of the stored `[out, in]`) is data[start + o·s1 ..][..in].
        rows_dot_w(x, m, d_in, d_out, data, start, stride[1], ys);
        true
    } else {
        false
    }
}

/// Weights smaller than this (in elements) are read on the calling thread, where handing
/// a product to the pool and back costs more than reading them; and f32 ones stay on
/// `gemm` (see [`preferred`]). Chosen by decoding speed on small models; the
/// measurements are in docs/PERFORMANCE.md ("Dense products").
const PARALLEL_MIN: usize = 1 << 16;

/// Splits `0..n` into one contiguous range per thread (at least `min` long), or a single
/// range when the product reads fewer than `PARALLEL_MIN` weights. For products whose
/// threads each sum into their own partial result; those whose ranges write separate
/// outputs take [`balanced_ranges`].
pub(crate) fn ranges(n: usize, min: usize, weights: usize) -> Vec<(usize, usize)> {
    split(n, min, weights, 1)
}

/// Ranges per thread in [`balanced_ranges`]: fine enough that the faster thread finds
/// work left, coarse enough that claiming a part costs little (two and eight decoded
/// slower; docs/PERFORMANCE.md).
const PARTS_PER_THREAD: usize = 4;

/// [`ranges`] cut `PARTS_PER_THREAD` times finer, for the decoding product of `[out, in]`
/// float weights, whose ranges write separate outputs: a thread that is done with its share
/// takes the next part not yet claimed, where with one range each the first to finish waits
/// for the other. A thread starts late (woken by the first) and its reads compete with a
/// neighbour's on a shared machine; with one range each, every product of a token waits
/// on the slower thread. The quantized products keep one range per thread: their tiles
/// decode slower in parts (`quant::packed`).
pub(crate) fn balanced_ranges(n: usize, min: usize, weights: usize) -> Vec<(usize, usize)> {
    split(n, min, weights, PARTS_PER_THREAD)
}

fn split(n: usize, min: usize, weights: usize, per_thread: usize) -> Vec<(usize, usize)> {
    let threads = rayon::current_num_threads();
    let parts = if weights < PARALLEL_MIN || threads == 1 {
        1
    } else {
        (threads * per_thread).clamp(1, (n / min.max(1)).max(1))
    };
    (0..parts)
        .map(|p| (n * p / parts, n * (p + 1) / parts))
        .filter(|(a, b)| a < b)
        .collect()
}

/// `f` over the ranges, the results in order: on the decoding team (`team.rs`: helpers that
/// spin between products instead of sleeping) when there are several, here when there is one.
pub(crate) fn map_ranges<T: Send>(
    ranges: &[(usize, usize)],
    f: impl Fn(usize, usize) -> T + Sync,
) -> Vec<T> {
    match ranges {
        [(lo, hi)] => vec![f(*lo, *hi)],
        _ => crate::team::map(ranges.len(), |i| f(ranges[i].0, ranges[i].1)),
    }
}

/// `ys [m, out] += x [m, in] · w`, `w` given by its input rows.
fn rows_times_w<'a, E: Elem>(
    x: &[f32],
    m: usize,
    d_in: usize,
    d_out: usize,
    row: &(dyn Fn(usize) -> &'a [E] + Sync),
    ys: &mut [f32],
) {
    // Each thread takes a contiguous range of rows and walks it as four streams, one per
    // quarter of the range, four rows per pass: rows lo + j, lo + q + j, lo + 2q + j and
    // lo + 3q + j. Each stream runs through a quarter of the memory front to back, where
    // four neighbouring rows would each be a short stream of d_out elements, which the
    // prefetchers follow worse (`benches/matvec.rs`).
    let parts = ranges(d_in, 16, d_in * d_out);
    // Each thread's rows go into its own partial sum `[m, out]`.
    let partials = map_ranges(&parts, |lo, hi| {
        let q = (hi - lo).div_ceil(4);
        // The last quarter is short when 4 does not divide the range; its missing rows are
        // zero rows with a zero factor (zero times an infinite weight would be NaN).
        let zeros = vec![E::ZERO; if (hi - lo) % 4 == 0 { 0 } else { d_out }];
        let mut acc = vec![0f32; m * d_out];
        for j in 0..q {
            let i = [0, 1, 2, 3].map(|s| lo + s * q + j);
            let w = i.map(|i| if i < hi { row(i) } else { &zeros[..] });
            let mut a = [[0f32; 4]; MAX_ROWS_IN_OUT];
            for (r, a) in a.iter_mut().enumerate().take(m) {
                for s in 0..4 {
                    a[s] = if i[s] < hi { x[r * d_in + i[s]] } else { 0.0 };
                }
            }
            // Column tiles keep the m outputs' tiles in L1 while every row of `x` uses
            // the four weight rows' tiles.
            let tile = (TILE / m).next_multiple_of(16);
            for c0 in (0..d_out).step_by(tile) {
                let c1 = (c0 + tile).min(d_out);
                let wt = w.map(|row| &row[c0..c1]);
                for (r, a) in a.iter().enumerate().take(m) {
                    E::axpy4(&mut acc[r * d_out + c0..r * d_out + c1], *a, wt);
                }
            }
        }
        acc
    });
    for p in &partials {
        simd::axpy(ys, 1.0, p);
    }
}

/// `ys [m, out] += x [m, in] · w`, `w` given by its output columns: column `o` is
/// `data[start + o·s1 ..][..in]`.
#[allow(clippy::too_many_arguments)]
fn rows_dot_w<E: Elem>(
    x: &[f32],
    m: usize,
    d_in: usize,
    d_out: usize,
    data: &[E],
    start: usize,
    s1: usize,
    ys: &mut [f32],
) {
    // Each part computes the outputs of its columns for every row, `[m, hi - lo]`, into
    // its thread's buffer and adds them to its columns of `ys`: the sums land while the
    // other thread still works, not on the calling thread after both are done.
    let ranges = balanced_ranges(d_out, 64, d_in * d_out);
    let out = SharedOut(ys.as_mut_ptr());
    assert!(
        ys.len() >= m * d_out,
        "rows_dot_w: ys holds fewer than m rows"
    );
    // Decoding on several threads: a waiting helper reads ahead the start of the next
    // product's second range (see `team::hint`), as the quantized products' helpers do.
    let next = match (m, ranges.get(1)) {
        (1, Some(&(lo, hi))) => {
            let size = std::mem::size_of::<E>();
            let at = |c: usize| data.as_ptr() as usize + (start + c * s1) * size;
            let half = (hi - lo) / 2;
            let streams = [
                (at(lo), half * s1 * size),
                (at(lo + half), (hi - lo - half) * s1 * size),
            ];
            let bytes = d_out * s1 * size;
            crate::team::follow((data.as_ptr() as usize, start), bytes, streams)
        }
        _ => None,
    };
    map_ranges(&ranges, |lo, hi| {
        let n = hi - lo;
        DOT_BUF.with(|buf| {
            let mut buf = buf.borrow_mut();
            if buf.len() < m * n {
                buf.resize(m * n, 0.0);
            }
            let block = &mut buf[..m * n];
            // One row of `x` reads the columns two at a time, from the two halves of the
            // range (two streams, `simd::avx512::dot_rows`); several widen
            // each 16-value slice of four columns once for up to four rows
            // (`simd::avx512::dot_rows_multi`).
            E::dot_rows(&x[..m * d_in], m, data, start + lo * s1, s1, block, n);
            for r in 0..m {
                // SAFETY: row r's columns lo..hi of `ys` (checked to hold m rows of d_out),
                // written by this part alone; `ys` outlives the parts.
                let y = unsafe { std::slice::from_raw_parts_mut(out.at(r * d_out + lo), n) };
                simd::axpy(y, 1.0, &block[r * n..][..n]);
            }
        })
    });
    if let Some(next) = next {
        crate::team::hint(next);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both splits tile `0..n` in order with non-empty parts of at least `min` (unless
    /// `n` is shorter), one part below `PARALLEL_MIN` weights, at most a thread's share each.
    #[test]
    fn ranges_tile_the_rows() {
        let threads = rayon::current_num_threads();
        for n in [1, 3, 63, 64, 65, 576, 1000, 3072, 49_152] {
            for min in [1, 4, 16, 64] {
                for weights in [n, PARALLEL_MIN - 1, PARALLEL_MIN, 1 << 24] {
                    for (per_thread, parts) in [
                        (1, ranges(n, min, weights)),
                        (PARTS_PER_THREAD, balanced_ranges(n, min, weights)),
                    ] {
                        let what = format!("n {n}, min {min}, weights {weights}, {per_thread}");
                        assert_eq!(parts.first().map(|p| p.0), Some(0), "{what}");
                        assert_eq!(parts.last().map(|p| p.1), Some(n), "{what}");
                        assert!(parts.windows(2).all(|w| w[0].1 == w[1].0), "{what}");
                        assert!(parts.iter().all(|&(a, b)| b - a >= min.min(n)), "{what}");
                        let most = match weights < PARALLEL_MIN || threads == 1 {
                            true => 1,
                            false => threads * per_thread,
                        };
                        assert!(parts.len() <= most, "{what}: {} parts", parts.len());
                    }
                }
            }
        }
    }
}
