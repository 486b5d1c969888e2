//! The f32 GEMM of one prefill task over f16 or bf16 weights on CPUs with AVX2, FMA and F16C
//! but not AVX-512: `dst [m, n] = x [m, k] · w [k, n]` on the calling thread, for the spans of
//! [`crate::dense`]'s prefill products whose weights are half precision `[out, in]` (an
//! `nn.Linear`'s rows, as GGUF and safetensors store them). The arrangement of
//! [`super::avx512_gemm`] over eight lanes.
//!
//! Why not the `gemm` crate here, as for every other span on these CPUs: each task would
//! widen its span to f32 first (a copy of `n × k` values: 384 KiB of a 512 KiB L2 for 96
//! columns of 1024), and the crate then packs `x` (all `m × k` of it) again for every task.
//! Here no copy is made: each block of [`Half::KC`] inputs of the span is packed panel by
//! panel of 24 columns `[KC][24]` (the span's `n × KC` values, in L2), and `x` is read where
//! it lies, four rows at a time, each value broadcast to a 4 × 24 tile of 12 accumulators
//! against each panel in turn, so that the four rows' `KC` values stay in L1 while the
//! panels stream from L2. f16 panels keep their f16 values, widened by the tile as it
//! loads them; bf16 is widened as it is packed ([`Half`] says why). The tile takes 7 loads
//! (3 of weights, 4 broadcasts) for its 12 FMAs, where a 6 × 16 one takes 8: on a core
//! whose loads the host shares that is the difference that shows. All 16 registers hold
//! the tile's values, so its loop is written out in assembly: LLVM's own schedule keeps a
//! second broadcast in flight and spills an accumulator. docs/PERFORMANCE.md ("Dense
//! products") has what this gained and what else was tried.
//!
//! Sums run over `k` in blocks of `KC`, each block's partial sums added to `dst` in order;
//! the result differs from a single running sum by rounding only (the tests hold it to
//! the sums in f64).

use half::{bf16, f16};
use std::arch::x86_64::*;
use std::cell::RefCell;

/// Rows of `x` per tile.
const MR: usize = 4;
/// Columns per panel (three vectors of 8).
pub(crate) const PANEL: usize = 24;

thread_local! {
    /// A task's packed block of f32 panels, `KC × 24` values per panel.
    static PACKED_F32: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// The same of f16 panels.
    static PACKED_F16: RefCell<Vec<f16>> = const { RefCell::new(Vec::new()) };
}

/// A half-precision weight that [`gemm_half`] packs into panels of [`Half::Panel`].
///
/// f16 panels stay f16 and the tile widens each vector as it loads it: F16C's conversion
/// from memory does not compete with the FMAs, and panels of half the bytes halve what
/// the tile reads from L2. bf16 is widened as it is packed: its widening is two integer
/// operations per vector, which the tile cannot spare.
pub trait Half: Copy {
    /// What a packed panel holds.
    type Panel: Copy + Default + 'static;
    /// Inputs per packed block: 1024 f16 values or 512 f32 ones, so that a panel is 48 KiB
    /// and a 96-column span's block 192 KiB (in L2) either way.
    const KC: usize;
    /// Runs `f` on this thread's buffer of panels.
    fn with_panels<R>(f: impl FnOnce(&mut Vec<Self::Panel>) -> R) -> R;
    /// One value as a panel holds it.
    fn to_panel(self) -> Self::Panel;
    /// One 8 × 8 block of a panel: input `k` of `rows[j]` (a column's 8 inputs) into lane
    /// `j` of `out[k·width..]`.
    ///
    /// # Safety
    /// AVX2 and F16C; each of `rows` addresses 8 readable values, `out` 8 rows of `width`
    /// with 8 writable values each.
    unsafe fn pack8(rows: [*const Self; 8], out: *mut Self::Panel, width: usize);
    /// Eight panel values from `p`, as f32.
    ///
    /// # Safety
    /// AVX2 and F16C; `p` addresses 8 readable values.
    unsafe fn load8(p: *const Self::Panel) -> __m256;
    /// The sums of a whole 4 × 24 tile, `[row][vector]` row-major: `Σ_k a[i·lda + k] ·
    /// b[k·ldb + 8·v..][..8]`. Every register is in use (12 sums, 3 weight vectors, 1
    /// broadcast), in the order FMA after broadcast, one broadcast register.
    ///
    /// # Safety
    /// AVX2, FMA and F16C; `kc ≥ 1`; `a` has 4 rows of `kc` readable values at stride
    /// `lda`, and `b` `kc` rows of 24 at stride `ldb`.
    unsafe fn full_tile(
        a: *const f32,
        lda: usize,
        b: *const Self::Panel,
        ldb: usize,
        kc: usize,
    ) -> [__m256; 12];
}

/// The sums of a whole 4 × 24 tile (`Half::full_tile`'s body) over panels whose values are
/// `$bytes` bytes, vectors 0, 1 and 2 of a row at `{b}` loaded into ymm12..14 by `$load0..2`.
macro_rules! full_tile {
    ($a:expr, $lda:expr, $b:expr, $ldb:expr, $kc:expr, $bytes:literal, $load0:literal, $load1:literal, $load2:literal) => {{
        debug_assert!($kc >= 1, "full_tile: the loop runs at least once");
        let z = _mm256_setzero_ps();
        let [mut c0, mut c1, mut c2, mut c3, mut c4, mut c5] = [z; 6];
        let [mut c6, mut c7, mut c8, mut c9, mut c10, mut c11] = [z; 6];
        // SAFETY: the caller's: rows 0 and 1 of `a` from `p0`, 2 and 3 from `p1`
        // (`lda` values apart), `kc` values each; `kc` rows of 24 values of `b`, `ldb`
        // values apart. Only registers are written; the loop counts `kc` down to 0 from at
        // least 1.
        unsafe {
            std::arch::asm!(
                "2:",
                $load0,
                $load1,
                $load2,
                "vbroadcastss ymm15, dword ptr [{p0}]",
                "vfmadd231ps {c0}, ymm12, ymm15",
                "vfmadd231ps {c1}, ymm13, ymm15",
                "vfmadd231ps {c2}, ymm14, ymm15",
                "vbroadcastss ymm15, dword ptr [{p0} + {lda}]",
                "vfmadd231ps {c3}, ymm12, ymm15",
                "vfmadd231ps {c4}, ymm13, ymm15",
                "vfmadd231ps {c5}, ymm14, ymm15",
                "vbroadcastss ymm15, dword ptr [{p1}]",
                "vfmadd231ps {c6}, ymm12, ymm15",
                "vfmadd231ps {c7}, ymm13, ymm15",
                "vfmadd231ps {c8}, ymm14, ymm15",
                "vbroadcastss ymm15, dword ptr [{p1} + {lda}]",
                "vfmadd231ps {c9}, ymm12, ymm15",
                "vfmadd231ps {c10}, ymm13, ymm15",
                "vfmadd231ps {c11}, ymm14, ymm15",
                "add {p0}, 4",
                "add {p1}, 4",
                "add {b}, {ldb}",
                "dec {k}",
                "jnz 2b",
                b = inout(reg) $b => _,
                p0 = inout(reg) $a => _,
                p1 = inout(reg) $a.add(2 * $lda) => _,
                lda = in(reg) $lda * 4,
                ldb = in(reg) $ldb * $bytes,
                k = inout(reg) $kc => _,
                c0 = inout(ymm_reg) c0,
                c1 = inout(ymm_reg) c1,
                c2 = inout(ymm_reg) c2,
                c3 = inout(ymm_reg) c3,
                c4 = inout(ymm_reg) c4,
                c5 = inout(ymm_reg) c5,
                c6 = inout(ymm_reg) c6,
                c7 = inout(ymm_reg) c7,
                c8 = inout(ymm_reg) c8,
                c9 = inout(ymm_reg) c9,
                c10 = inout(ymm_reg) c10,
                c11 = inout(ymm_reg) c11,
                out("ymm12") _,
                out("ymm13") _,
                out("ymm14") _,
                out("ymm15") _,
                options(nostack, readonly),
            );
        }
                [c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11]
    }};
}

impl Half for f16 {
    type Panel = f16;
    const KC: usize = 1024;
    fn with_panels<R>(f: impl FnOnce(&mut Vec<f16>) -> R) -> R {
        PACKED_F16.with(|buf| f(&mut buf.borrow_mut()))
    }
    fn to_panel(self) -> f16 {
        self
    }
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn pack8(rows: [*const f16; 8], out: *mut f16, width: usize) {
        // SAFETY: the caller's: 8 values (16 bytes) at each row and each row of `out`.
        unsafe {
            let mut r = [_mm_setzero_si128(); 8];
            for (r, row) in r.iter_mut().zip(rows) {
                *r = _mm_loadu_si128(row.cast());
            }
            let t = transpose8x16(r);
            for (k, t) in t.iter().enumerate() {
                _mm_storeu_si128(out.add(k * width).cast(), *t);
            }
        }
    }
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn load8(p: *const f16) -> __m256 {
        // SAFETY: the caller's: 8 values (16 bytes) at `p`.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn full_tile(
        a: *const f32,
        lda: usize,
        b: *const f16,
        ldb: usize,
        kc: usize,
    ) -> [__m256; 12] {
        // Each weight vector widened as it is loaded.
        full_tile!(
            a,
            lda,
            b,
            ldb,
            kc,
            2,
            "vcvtph2ps ymm12, xmmword ptr [{b}]",
            "vcvtph2ps ymm13, xmmword ptr [{b} + 16]",
            "vcvtph2ps ymm14, xmmword ptr [{b} + 32]"
        )
    }
}

impl Half for bf16 {
    type Panel = f32;
    const KC: usize = 512;
    fn with_panels<R>(f: impl FnOnce(&mut Vec<f32>) -> R) -> R {
        PACKED_F32.with(|buf| f(&mut buf.borrow_mut()))
    }
    fn to_panel(self) -> f32 {
        self.to_f32()
    }
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn pack8(rows: [*const bf16; 8], out: *mut f32, width: usize) {
        // SAFETY: the caller's: 8 values (16 bytes) at each row and each row of `out`. A
        // bf16 is an f32's upper half.
        unsafe {
            let mut r = [_mm256_setzero_ps(); 8];
            for (r, row) in r.iter_mut().zip(rows) {
                let v = _mm256_cvtepu16_epi32(_mm_loadu_si128(row.cast()));
                *r = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(v));
            }
            let t = transpose8(r);
            for (k, t) in t.iter().enumerate() {
                _mm256_storeu_ps(out.add(k * width), *t);
            }
        }
    }
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load8(p: *const f32) -> __m256 {
        // SAFETY: the caller's.
        unsafe { _mm256_loadu_ps(p) }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn full_tile(
        a: *const f32,
        lda: usize,
        b: *const f32,
        ldb: usize,
        kc: usize,
    ) -> [__m256; 12] {
        full_tile!(
            a,
            lda,
            b,
            ldb,
            kc,
            4,
            "vmovups ymm12, [{b}]",
            "vmovups ymm13, [{b} + 32]",
            "vmovups ymm14, [{b} + 64]"
        )
    }
}

/// `dst[r·ds + j] = Σ_k x[r·d_in + k] · w[j·cs + k]` for `r < m`, `j < n`, `k < d_in`:
/// half-precision weights stored by columns (`[n, in]`, column `j` at `w[j·cs..]`). Each
/// element of `dst` is written before it is read, so `dst` may start uninitialised.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `dst` has `m` rows of stride `ds` with `n` writable
/// columns that no other thread touches; `x` holds `m × d_in` values and `w` at least
/// `(n − 1)·cs + d_in`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn gemm_half<H: Half>(
    x: &[f32],
    m: usize,
    d_in: usize,
    dst: *mut f32,
    ds: usize,
    n: usize,
    w: &[H],
    cs: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    if d_in == 0 {
        for r in 0..m {
            // SAFETY: row r's n columns are the caller's to write.
            unsafe { std::ptr::write_bytes(dst.add(r * ds), 0, n) };
        }
        return;
    }
    // Panels of 24 columns (the last 8, 16 or 24 wide), panel p at `p × 24 × kc` in `buf`.
    let panels = n.div_ceil(PANEL);
    H::with_panels(|buf| {
        if buf.len() < panels * PANEL * H::KC {
            buf.resize(panels * PANEL * H::KC, H::Panel::default());
        }
        let mut k0 = 0;
        while k0 < d_in {
            let kc = H::KC.min(d_in - k0);
            // The block's weights, every panel `[kc][cols to 8]` one after another (in L2).
            for p in 0..panels {
                let j0 = p * PANEL;
                // SAFETY: the caller's `w` holds the span; the buffer holds every panel.
                unsafe {
                    pack::<H>(
                        w,
                        cs,
                        k0,
                        kc,
                        j0,
                        PANEL.min(n - j0),
                        &mut buf[p * PANEL * kc..],
                    )
                };
            }
            let mut r0 = 0;
            while r0 < m {
                let rows = MR.min(m - r0);
                // Rows r0.. of `x` (kc values each, in L1) against every panel in turn.
                for p in 0..panels {
                    let j0 = p * PANEL;
                    let cols = PANEL.min(n - j0);
                    let b = buf[p * PANEL * kc..].as_ptr();
                    // SAFETY: rows r0.. of `x` from column k0 (kc values each), the panel,
                    // and rows r0.. of `dst` from column j0 (`cols` of them), all within
                    // the caller's bounds.
                    unsafe {
                        tile::<H>(
                            rows,
                            cols,
                            x.as_ptr().add(r0 * d_in + k0),
                            d_in,
                            b,
                            cols.next_multiple_of(8),
                            kc,
                            dst.add(r0 * ds + j0),
                            ds,
                            k0 > 0,
                        )
                    };
                }
                r0 += rows;
            }
            k0 += kc;
        }
    })
}

/// Packs inputs `k0..k0 + kc` of columns `j0..j0 + cols` (`cols ≤ 24`, column `j` at
/// `w[j·cs..]`) into `buf` as `[kc][width]`, `width` the columns rounded up to 8, lanes past
/// `cols` zero: 8 × 8 blocks transposed in registers ([`Half::pack8`]), the edges one value
/// at a time.
///
/// # Safety
/// AVX2 and F16C; `w` holds every column of the block; `buf` holds `kc × width` values.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,f16c")]
unsafe fn pack<H: Half>(
    w: &[H],
    cs: usize,
    k0: usize,
    kc: usize,
    j0: usize,
    cols: usize,
    buf: &mut [H::Panel],
) {
    let width = cols.next_multiple_of(8);
    let panel = &mut buf[..kc * width];
    let mut jb = 0;
    while jb < width {
        let mut kb = 0;
        while kb < kc {
            if jb + 8 <= cols && kb + 8 <= kc {
                let rows: [*const H; 8] =
                    std::array::from_fn(|jj| w[(j0 + jb + jj) * cs + k0 + kb..][..8].as_ptr());
                let out = panel[kb * width + jb..][..7 * width + 8].as_mut_ptr();
                // SAFETY: each row's 8 values were just sliced, and `out`'s 8 rows of
                // `width` (8 values each).
                unsafe { H::pack8(rows, out, width) };
            } else {
                for kk in kb..(kb + 8).min(kc) {
                    for jj in jb..jb + 8 {
                        panel[kk * width + jj] = match jj < cols {
                            true => w[(j0 + jj) * cs + k0 + kk].to_panel(),
                            false => H::Panel::default(),
                        };
                    }
                }
            }
            kb += 8;
        }
        jb += 8;
    }
}

/// One tile of `rows ≤ 4` rows and `cols ≤ 24` columns: the kernel for its shape.
///
/// # Safety
/// As [`micro`]'s.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<H: Half>(
    rows: usize,
    cols: usize,
    a: *const f32,
    lda: usize,
    b: *const H::Panel,
    ldb: usize,
    kc: usize,
    c: *mut f32,
    ldc: usize,
    add: bool,
) {
    let vectors = cols.div_ceil(8);
    // The last vector's lanes within the span: lane i is on where its sign bit is set.
    let on = (cols - 1) % 8 + 1;
    let last = _mm256_cmpgt_epi32(
        _mm256_set1_epi32(on as i32),
        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
    );
    macro_rules! by_vectors {
        ($r:literal) => {
            // SAFETY (each): the caller's.
            match vectors {
                1 => unsafe { micro::<H, $r, 1>(a, lda, b, ldb, kc, c, ldc, last, add) },
                2 => unsafe { micro::<H, $r, 2>(a, lda, b, ldb, kc, c, ldc, last, add) },
                _ => unsafe { micro::<H, $r, 3>(a, lda, b, ldb, kc, c, ldc, last, add) },
            }
        };
    }
    match rows {
        1 => by_vectors!(1),
        2 => by_vectors!(2),
        3 => by_vectors!(3),
        _ => by_vectors!(4),
    }
}

/// `c[i][..] (+)= Σ_k a[i·lda + k] · b[k·ldb + ..]` for `R` rows and `V` vectors of 8
/// columns, the last stored under `last` (a panel's columns past the span are zeros).
///
/// # Safety
/// AVX2, FMA and F16C; `a` has `R` rows of `kc ≥ 1` readable values at stride `lda`, `b`
/// has `kc` rows at stride `ldb` of `8·V` readable values, and `c` has `R` rows at stride
/// `ldc` with `8·(V − 1)` writable columns plus the lanes of `last`.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn micro<H: Half, const R: usize, const V: usize>(
    a: *const f32,
    lda: usize,
    b: *const H::Panel,
    ldb: usize,
    kc: usize,
    c: *mut f32,
    ldc: usize,
    last: __m256i,
    add: bool,
) {
    let mut acc = [[_mm256_setzero_ps(); V]; R];
    if R == 4 && V == 3 {
        // SAFETY: the caller's, for the whole tile.
        let sums = unsafe { H::full_tile(a, lda, b, ldb, kc) };
        for (i, acc) in acc.iter_mut().enumerate() {
            acc.copy_from_slice(&sums[i * V..(i + 1) * V]);
        }
    } else {
        for k in 0..kc {
            // SAFETY (the loads): row k of `b` and column k of the R rows of `a`.
            let bp = unsafe { b.add(k * ldb) };
            let mut bv = [_mm256_setzero_ps(); V];
            for (v, bv) in bv.iter_mut().enumerate() {
                *bv = unsafe { H::load8(bp.add(8 * v)) };
            }
            for (i, acc) in acc.iter_mut().enumerate() {
                let av = _mm256_set1_ps(unsafe { *a.add(i * lda + k) });
                for (acc, bv) in acc.iter_mut().zip(&bv) {
                    *acc = _mm256_fmadd_ps(av, *bv, *acc);
                }
            }
        }
    }
    let all = _mm256_set1_epi32(-1);
    for (i, acc) in acc.iter().enumerate() {
        for (v, acc) in acc.iter().enumerate() {
            let mask = if v + 1 == V { last } else { all };
            // SAFETY: row i's vector v of `c`, under the lanes the caller allows.
            unsafe {
                let p = c.add(i * ldc + 8 * v);
                let sum = match add {
                    true => _mm256_add_ps(*acc, _mm256_maskload_ps(p, mask)),
                    false => *acc,
                };
                _mm256_maskstore_ps(p, mask, sum);
            }
        }
    }
}

/// The transpose of 8 vectors of 8 16-bit values: lane `j` of output `k` is lane `k` of
/// input `j`.
#[inline]
#[target_feature(enable = "avx2")]
fn transpose8x16(r: [__m128i; 8]) -> [__m128i; 8] {
    // t[2i] holds elements 0..4 of rows 2i and 2i + 1 interleaved, t[2i + 1] elements 4..8.
    let mut t = [_mm_setzero_si128(); 8];
    for i in 0..4 {
        t[2 * i] = _mm_unpacklo_epi16(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm_unpackhi_epi16(r[2 * i], r[2 * i + 1]);
    }
    // Then by 32-bit pairs: u[4h + e] holds elements 2e and 2e + 1 of rows 4h..4h + 4.
    let mut u = [_mm_setzero_si128(); 8];
    for h in 0..2 {
        let (a, b, c, d) = (t[4 * h], t[4 * h + 2], t[4 * h + 1], t[4 * h + 3]);
        u[4 * h] = _mm_unpacklo_epi32(a, b);
        u[4 * h + 1] = _mm_unpackhi_epi32(a, b);
        u[4 * h + 2] = _mm_unpacklo_epi32(c, d);
        u[4 * h + 3] = _mm_unpackhi_epi32(c, d);
    }
    // Output 2e takes the low halves of u[e] and u[4 + e], output 2e + 1 their high halves.
    let mut out = [_mm_setzero_si128(); 8];
    for e in 0..4 {
        out[2 * e] = _mm_unpacklo_epi64(u[e], u[4 + e]);
        out[2 * e + 1] = _mm_unpackhi_epi64(u[e], u[4 + e]);
    }
    out
}

/// The transpose of 8 vectors of 8: lane `j` of output `k` is lane `k` of input `j`.
#[inline]
#[target_feature(enable = "avx2")]
fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
    // Pairs of rows interleaved: in each 128-bit half H, t[2i] holds elements 4H and 4H + 1
    // of rows 2i and 2i + 1, t[2i + 1] elements 4H + 2 and 4H + 3.
    let mut t = [_mm256_setzero_ps(); 8];
    for i in 0..4 {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    // Then by 64-bit pairs: u[4i + e], in half H, holds element 4H + e of rows 4i..4i + 4.
    let mut u = [_mm256_setzero_ps(); 8];
    for i in 0..2 {
        let (a, b, c, d) = (t[4 * i], t[4 * i + 2], t[4 * i + 1], t[4 * i + 3]);
        u[4 * i] = _mm256_shuffle_ps::<0x44>(a, b);
        u[4 * i + 1] = _mm256_shuffle_ps::<0xee>(a, b);
        u[4 * i + 2] = _mm256_shuffle_ps::<0x44>(c, d);
        u[4 * i + 3] = _mm256_shuffle_ps::<0xee>(c, d);
    }
    // Output e takes half 0 of u[e] and u[4 + e]; output 4 + e their halves 1.
    let mut out = [_mm256_setzero_ps(); 8];
    for e in 0..4 {
        out[e] = _mm256_permute2f128_ps::<0x20>(u[e], u[4 + e]);
        out[4 + e] = _mm256_permute2f128_ps::<0x31>(u[e], u[4 + e]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sums in f64 over the half-precision weights' exact values.
    fn reference<H: Half + Into<f32>>(
        x: &[f32],
        m: usize,
        k: usize,
        w: &[H],
        cs: usize,
        n: usize,
    ) -> Vec<f64> {
        let mut out = vec![0f64; m * n];
        for r in 0..m {
            for j in 0..n {
                out[r * n + j] = (0..k)
                    .map(|i| x[r * k + i] as f64 * w[j * cs + i].into() as f64)
                    .sum();
            }
        }
        out
    }

    fn values(len: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(1);
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    fn here() -> bool {
        std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
    }

    #[test]
    fn transpose_of_eight_vectors() {
        if !here() {
            return;
        }
        let v: Vec<f32> = (0..64).map(|i| i as f32).collect();
        // SAFETY: AVX2 was just seen; every load and store is 8 values of 64.
        let got = unsafe {
            let r: [__m256; 8] = std::array::from_fn(|j| _mm256_loadu_ps(v[j * 8..].as_ptr()));
            let t = transpose8(r);
            let mut out = vec![0f32; 64];
            for (k, t) in t.iter().enumerate() {
                _mm256_storeu_ps(out[k * 8..].as_mut_ptr(), *t);
            }
            out
        };
        for k in 0..8 {
            for j in 0..8 {
                assert_eq!(got[k * 8 + j], v[j * 8 + k], "({k}, {j})");
            }
        }
    }

    #[test]
    fn transpose_of_eight_half_vectors() {
        if !here() {
            return;
        }
        let v: Vec<u16> = (0..64).collect();
        // SAFETY: AVX2 was just seen; every load and store is 8 values of 64.
        let got = unsafe {
            let r: [__m128i; 8] =
                std::array::from_fn(|j| _mm_loadu_si128(v[j * 8..].as_ptr().cast()));
            let t = transpose8x16(r);
            let mut out = vec![0u16; 64];
            for (k, t) in t.iter().enumerate() {
                _mm_storeu_si128(out[k * 8..].as_mut_ptr().cast(), *t);
            }
            out
        };
        for k in 0..8 {
            for j in 0..8 {
                assert_eq!(got[k * 8 + j], v[j * 8 + k], "({k}, {j})");
            }
        }
    }

    /// Every tile shape (rows 1..4 past multiples of 4, 1..3 vectors and masked lanes), `k`
    /// across block boundaries and past multiples of 8, columns packed and strided, into a
    /// wider `dst`, for weights of type `H` made by `from`.
    fn products_of<H: Half + Into<f32>>(from: fn(f32) -> H) {
        for (m, k, n) in [
            (1, 1, 1),
            (7, 16, 16),
            (13, 130, 64),
            (6, 1030, 70),
            (17, 300, 131),
            (12, 520, 200),
            (5, 17, 33),
            (8, 600, 9),
        ] {
            let x = values(m * k, (m * 31 + k) as u32);
            for cs in [k, k + 3] {
                let w: Vec<H> = values((n - 1) * cs + k, (n * 7 + cs) as u32)
                    .into_iter()
                    .map(from)
                    .collect();
                let ds = n + 5;
                let mut dst = vec![f32::NAN; m * ds];
                // SAFETY: AVX2, FMA and F16C were seen by the caller; dst holds m rows of
                // ds ≥ n, x m × k, and w (n − 1)·cs + k.
                unsafe { gemm_half(&x, m, k, dst.as_mut_ptr(), ds, n, &w, cs) };
                let want = reference(&x, m, k, &w, cs, n);
                for r in 0..m {
                    for j in 0..n {
                        let (g, e) = (dst[r * ds + j] as f64, want[r * n + j]);
                        assert!(
                            (g - e).abs() <= 1e-5 * (1.0 + e.abs()) * (k as f64).sqrt(),
                            "m {m} k {k} n {n} cs {cs} ({r}, {j}): {g} vs {e}"
                        );
                    }
                    assert!(
                        dst[r * ds + n..(r + 1) * ds].iter().all(|v| v.is_nan()),
                        "wrote past n"
                    );
                }
            }
        }
    }

    #[test]
    fn products_equal_the_sums() {
        if !here() {
            return;
        }
        products_of(f16::from_f32);
        products_of(bf16::from_f32);
    }
}
