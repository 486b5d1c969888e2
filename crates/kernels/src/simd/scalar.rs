//! The row kernels as plain loops: the reference every instruction set's version is held
//! to, what `mod.rs` compiles for each feature level (inlined into a function with those
//! features enabled), and the tails the wide kernels leave. Rust does not reassociate
//! float sums, so reductions keep 16 partial accumulators that the compiler maps to vector
//! lanes.

const LANES: usize = 16;

/// `exp(x)` for f32 in the Cephes style: `2^n · p(r)` with `|r| <= ln2/2`, accurate to
/// about 2 ulp on `[-87, 88]`; `-inf` and anything below -87 (where `exp` < 1.7e-38)
/// gives exactly 0.
#[inline(always)]
pub(super) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding 1.5·2^23 rounds to the nearest integer and leaves it in the low mantissa bits.
    const MAGIC: f32 = 12_582_912.0;
    let xc = x.clamp(-87.0, 88.0);
    let t = xc * LOG2E + MAGIC;
    let n = t - MAGIC;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let e = p * r * r + r + 1.0;
    let ni = t.to_bits() as i32 - MAGIC.to_bits() as i32;
    let scale = f32::from_bits(((ni + 127) << 23) as u32);
    if x < -87.0 {
        0.0
    } else {
        e * scale
    }
}

#[inline(always)]
pub(super) fn sum_impl(xs: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let mut chunks = xs.chunks_exact(LANES);
    for c in &mut chunks {
        for i in 0..LANES {
            acc[i] += c[i];
        }
    }
    acc.iter().sum::<f32>() + chunks.remainder().iter().sum::<f32>()
}

#[inline(always)]
pub(super) fn softmax_grad_impl(p: &[f32], dp: &mut [f32], delta: f32) {
    for (g, &x) in dp.iter_mut().zip(p) {
        *g = x * (*g - delta);
    }
}

#[inline(always)]
pub(super) fn max_impl(xs: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let mut chunks = xs.chunks_exact(LANES);
    for c in &mut chunks {
        for i in 0..LANES {
            acc[i] = if c[i] > acc[i] { c[i] } else { acc[i] };
        }
    }
    let m = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |a, &x| a.max(x));
    acc.iter().fold(m, |a, &x| a.max(x))
}

#[inline(always)]
pub(super) fn argmax_impl(xs: &[f32]) -> usize {
    let m = max_impl(xs);
    // The first block holding the largest value, by a branch-free test per block (which
    // vectorises), then its place in that block.
    let mut at = 0;
    for c in xs.chunks(4 * LANES) {
        if c.iter().fold(false, |any, &x| any | (x == m)) {
            return at + c.iter().position(|&x| x == m).unwrap_or(0);
        }
        at += c.len();
    }
    0
}

#[inline(always)]
pub(super) fn exp_sub_sum_impl(xs: &mut [f32], m: f32) -> f32 {
    let mut acc = [0f32; LANES];
    let mut chunks = xs.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for i in 0..LANES {
            let e = exp(c[i] - m);
            c[i] = e;
            acc[i] += e;
        }
    }
    let mut sum = 0f32;
    for x in chunks.into_remainder() {
        *x = exp(*x - m);
        sum += *x;
    }
    acc.iter().sum::<f32>() + sum
}

#[inline(always)]
pub(super) fn scale_impl(xs: &mut [f32], s: f32) {
    for x in xs {
        *x *= s;
    }
}

/// GPT-2's GELU, `0.5·x·(1 + tanh(u))` with `u = sqrt(2/π)·(x + 0.044715·x³)`, written
/// as `x / (1 + exp(-2u))` (the same function: `1 + tanh(u) = 2 / (1 + exp(-2u))`), so
/// that it costs one vectorised `exp` and one division.
#[inline(always)]
pub(super) fn gelu_tanh_impl(xs: &[f32], ys: &mut [f32]) {
    const C: f32 = 0.797_884_6; // sqrt(2/π)
    for (y, &x) in ys.iter_mut().zip(xs) {
        let u = C * (x + 0.044_715 * x * x * x);
        *y = x / (1.0 + exp(-2.0 * u));
    }
}

/// SwiGLU's product `silu(g)·u = g·u / (1 + exp(-g))`, one vectorised `exp` and one
/// division per element.
#[inline(always)]
pub(super) fn silu_mul_impl(g: &[f32], u: &[f32], ys: &mut [f32]) {
    for ((y, &g), &u) in ys.iter_mut().zip(g).zip(u) {
        *y = g * u / (1.0 + exp(-g));
    }
}

/// SwiGLU's backward: with `s = 1 / (1 + exp(-g))`, `d(silu(g)·u)/du = g·s` and
/// `d/dg = u·s·(1 + g·(1 - s))`; `dg` holds the output's gradient on entry and the
/// gate's on return, `du` receives the up projection's.
#[inline(always)]
pub(super) fn silu_mul_grad_impl(g: &[f32], u: &[f32], dg: &mut [f32], du: &mut [f32]) {
    for (((dg, du), &g), &u) in dg.iter_mut().zip(du.iter_mut()).zip(g).zip(u) {
        let s = 1.0 / (1.0 + exp(-g));
        let dy = *dg;
        *du = dy * g * s;
        *dg = dy * u * s * (1.0 + g * (1.0 - s));
    }
}

/// [`gelu_tanh_impl`] over `xs` itself (a product's outputs, as it writes them).
#[inline(always)]
pub(super) fn gelu_tanh_in_place_impl(xs: &mut [f32]) {
    const C: f32 = 0.797_884_6; // sqrt(2/π)
    for x in xs {
        let u = C * (*x + 0.044_715 * *x * *x * *x);
        *x /= 1.0 + exp(-2.0 * u);
    }
}

/// [`silu_mul_impl`] into `u` itself.
#[inline(always)]
pub(super) fn silu_mul_in_place_impl(g: &[f32], u: &mut [f32]) {
    for (u, &g) in u.iter_mut().zip(g) {
        *u = g * *u / (1.0 + exp(-g));
    }
}

/// `xs[i] += b[i]`.
#[inline(always)]
pub(super) fn add_impl(xs: &mut [f32], b: &[f32]) {
    for (x, &b) in xs.iter_mut().zip(b) {
        *x += b;
    }
}

/// `gs[i] *= d gelu_tanh(x) / dx` at `x = xs[i]`: with `s = 1 / (1 + exp(-2u))` the GELU
/// is `x·s`, whose derivative is `s + 2·x·s·(1 - s)·u'`, again one `exp`.
#[inline(always)]
pub(super) fn gelu_tanh_grad_impl(xs: &[f32], gs: &mut [f32]) {
    const C: f32 = 0.797_884_6; // sqrt(2/π)
    for (g, &x) in gs.iter_mut().zip(xs) {
        let x2 = x * x;
        let u = C * (x + 0.044_715 * x2 * x);
        let s = 1.0 / (1.0 + exp(-2.0 * u));
        let du = C * (1.0 + 3.0 * 0.044_715 * x2);
        *g *= s + 2.0 * x * s * (1.0 - s) * du;
    }
}

/// A weight element the product kernels widen to f32 as they read it.
pub trait Widen: Copy + Send + Sync + 'static {
    /// The value as f32.
    fn widen(self) -> f32;
}

impl Widen for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}

impl Widen for half::bf16 {
    /// bf16 is the top half of an f32: a shift, which vectorises (NaN stays NaN).
    #[inline(always)]
    fn widen(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
}

impl Widen for half::f16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

/// `y += a[0]·w[0] + a[1]·w[1] + a[2]·w[2] + a[3]·w[3]` (each `w[j]` at least as long as
/// `y`): four weight rows per pass, so `y` is loaded and stored once per four rows.
#[inline(always)]
pub(super) fn axpy4_impl<W: Widen>(y: &mut [f32], a: [f32; 4], w: [&[W]; 4]) {
    let n = y.len();
    let (w0, w1, w2, w3) = (&w[0][..n], &w[1][..n], &w[2][..n], &w[3][..n]);
    for c in 0..n {
        y[c] += a[0] * w0[c].widen()
            + a[1] * w1[c].widen()
            + a[2] * w2[c].widen()
            + a[3] * w3[c].widen();
    }
}

/// `y += a·w` over the shorter of the two.
#[inline(always)]
pub(super) fn axpy_impl(y: &mut [f32], a: f32, w: &[f32]) {
    for (y, &w) in y.iter_mut().zip(w) {
        *y += a * w;
    }
}

/// The dot products of `x` with four rows (each at least as long as `x`): `x` is read
/// once for the four.
#[inline(always)]
pub(super) fn dot4_impl<W: Widen>(x: &[f32], w: [&[W]; 4]) -> [f32; 4] {
    let len = x.len();
    let (w0, w1, w2, w3) = (&w[0][..len], &w[1][..len], &w[2][..len], &w[3][..len]);
    // One accumulator per row, one lane per vector lane.
    let (mut a0, mut a1, mut a2, mut a3) =
        ([0f32; LANES], [0f32; LANES], [0f32; LANES], [0f32; LANES]);
    let n = len / LANES * LANES;
    for i in (0..n).step_by(LANES) {
        // Slices of exactly LANES elements: the conversions cannot fail.
        let xv: &[f32; LANES] = x[i..i + LANES].try_into().unwrap();
        let r0: &[W; LANES] = w0[i..i + LANES].try_into().unwrap();
        let r1: &[W; LANES] = w1[i..i + LANES].try_into().unwrap();
        let r2: &[W; LANES] = w2[i..i + LANES].try_into().unwrap();
        let r3: &[W; LANES] = w3[i..i + LANES].try_into().unwrap();
        for l in 0..LANES {
            a0[l] += xv[l] * r0[l].widen();
            a1[l] += xv[l] * r1[l].widen();
            a2[l] += xv[l] * r2[l].widen();
            a3[l] += xv[l] * r3[l].widen();
        }
    }
    let tail = |r: &[W]| -> f32 { x[n..].iter().zip(&r[n..]).map(|(a, b)| a * b.widen()).sum() };
    [
        a0.iter().sum::<f32>() + tail(w0),
        a1.iter().sum::<f32>() + tail(w1),
        a2.iter().sum::<f32>() + tail(w2),
        a3.iter().sum::<f32>() + tail(w3),
    ]
}

/// The dot product of `x` with one row (at least as long as `x`), two vectors per step:
/// one sequential stream, which the prefetchers follow better than four rows side by
/// side when no other row of `x` reuses the weights.
#[inline(always)]
pub(super) fn dot_impl<W: Widen>(x: &[f32], w: &[W]) -> f32 {
    let len = x.len();
    let w = &w[..len];
    let (mut a0, mut a1) = ([0f32; LANES], [0f32; LANES]);
    let n = len / (2 * LANES) * (2 * LANES);
    for i in (0..n).step_by(2 * LANES) {
        // Slices of exactly 2·LANES elements: the conversions cannot fail.
        let xv: &[f32; 2 * LANES] = x[i..i + 2 * LANES].try_into().unwrap();
        let r: &[W; 2 * LANES] = w[i..i + 2 * LANES].try_into().unwrap();
        for l in 0..LANES {
            a0[l] += xv[l] * r[l].widen();
            a1[l] += xv[LANES + l] * r[LANES + l].widen();
        }
    }
    let tail: f32 = x[n..].iter().zip(&w[n..]).map(|(a, b)| a * b.widen()).sum();
    a0.iter().zip(&a1).map(|(a, b)| a + b).sum::<f32>() + tail
}

// Concrete instances for `dispatch!`; inlined, so each is compiled for the features of
// the function it lands in.
#[inline(always)]
pub(super) fn axpy4_f32_impl(y: &mut [f32], a: [f32; 4], w: [&[f32]; 4]) {
    axpy4_impl(y, a, w)
}
#[inline(always)]
pub(super) fn axpy4_bf16_impl(y: &mut [f32], a: [f32; 4], w: [&[half::bf16]; 4]) {
    axpy4_impl(y, a, w)
}
#[inline(always)]
pub(super) fn dot4_f32_impl(x: &[f32], w: [&[f32]; 4]) -> [f32; 4] {
    dot4_impl(x, w)
}
#[inline(always)]
pub(super) fn dot_f32_impl(x: &[f32], w: &[f32]) -> f32 {
    dot_impl(x, w)
}
#[inline(always)]
pub(super) fn dot_bf16_impl(x: &[f32], w: &[half::bf16]) -> f32 {
    dot_impl(x, w)
}
#[inline(always)]
pub(super) fn dot4_bf16_impl(x: &[f32], w: [&[half::bf16]; 4]) -> [f32; 4] {
    dot4_impl(x, w)
}
