//! Attention for decoding: a few query rows per head (one per sequence and step) over a
//! long key/value cache, where [`super::prefill`]'s blocks of 64 query rows would each hold
//! one row.
//!
//! A task takes one key/value head of one sequence, every query head that shares it
//! (`n_rep` of them under grouped-query attention, each with its `tq ≤ 4` rows) and a
//! range of its keys. Keys and values are read from memory once for the whole group, 16
//! rows at a time (asked for ahead); a half-precision cache is widened in registers as the
//! products load it, each query head reading the 16 rows again from the first-level
//! cache; the scores of one query against 16 keys are summed across vector lanes together
//! (a transposing reduction: 45 instructions where 16 separate sums take about 130). A
//! long cache, or the keys of fewer key/value heads than threads, is split into ranges that
//! run in parallel, each keeping its rows' running maximum, sum and weighted values, merged
//! at the end through their log-sum-exp (flash-decoding).

use super::tiles::{soft_cap, FlashAttn, KvPtr, KvRows, Rows};
use gpt_kernels::simd;

/// Keys per block of the online softmax (the weighted values are rescaled once a block).
const BLOCK: usize = 128;
/// Key or value rows widened and multiplied together.
const SUB: usize = 16;
/// How many rows ahead of the one being read the keys are asked for, into the first-level
/// cache.
const AHEAD: usize = 3 * SUB;
/// How many rows ahead the keys and values are asked for into the second-level cache (the
/// range's first rows at its start), where decoding streams its weights from memory
/// (`gpt_kernels::team::streaming`) and the cache is read from there too. A core keeps
/// only a few dozen requests for the first level in flight, too few for memory's latency;
/// the second level takes more. On a Zen 4 decoding Qwen3-0.6B's attention took a quarter
/// less time so; a model whose weights and cache sit in the caches decoded 5% slower with
/// the requests (docs/PERFORMANCE.md, "Attention and small ops").
const FAR: usize = 128;
/// The fewest keys a range of a split cache holds: shorter ranges cost more in merging
/// than they gain in parallelism (docs/PERFORMANCE.md, "Attention and small ops").
const MIN_RANGE: usize = 256;
/// The same when there are fewer key/value heads than threads (Gemma 3 270M has one):
/// without splitting the keys, the other threads would only wait.
const MIN_RANGE_FEW: usize = 32;
/// Calls multiplying fewer (key, query head, dimension) triples than this run on the
/// calling thread. Even short caches gain from two threads; below this the hand-off is all
/// there is to measure.
const PARALLEL_WORK: usize = 512 * 64;

/// The shapes of a call: `q [b, h, tq, d]`, `k [b, h_kv, tk, d]`, `v [b, h_kv, tk, dv]`.
#[derive(Clone, Copy)]
pub(crate) struct Dims {
    pub b: usize,
    pub h: usize,
    pub h_kv: usize,
    pub tq: usize,
    pub tk: usize,
    pub d: usize,
    pub dv: usize,
}

/// The running softmax of one group's `nq = n_rep · tq` query rows over a range of keys.
struct Partial {
    /// `[nq]`: the largest visible score (`-inf` while none is).
    m: Vec<f32>,
    /// `[nq]`: `Σ exp(s - m)` over the visible keys.
    l: Vec<f32>,
    /// `[nq, dv]`: `Σ exp(s - m) · value`.
    acc: Vec<f32>,
}

impl Dims {
    /// Query heads per key/value head.
    fn n_rep(&self) -> usize {
        self.h / self.h_kv
    }
}

/// One call's operation and inputs.
#[derive(Clone, Copy)]
struct Call<'a> {
    op: &'a FlashAttn,
    /// Whether to ask for the rows [`FAR`] ahead.
    far: bool,
    q: Rows<'a>,
    k: KvRows<'a>,
    v: KvRows<'a>,
    dims: Dims,
}

/// Writes `out [b, h, tq, dv]` and each row's log-sum-exp `lse [b, h, tq]` (`+inf` for a
/// row that sees no key) as [`FlashAttn`]'s blocks would, without dropout.
pub(crate) fn run(
    op: &FlashAttn,
    q: Rows,
    k: KvRows,
    v: KvRows,
    dims: Dims,
    out: &mut [f32],
    lse: &mut [f32],
) {
    partials(op, q, k, v, dims).merge(out, lse);
}

/// Each task's running softmax over its range of keys: what [`Partials::merge`] turns into
/// the output. Holds nothing of `q`, so the queries' buffer may take the output.
pub(crate) struct Partials {
    parts: Vec<Partial>,
    /// Ranges per group: `parts` holds `b · h_kv` groups of them.
    ranges: usize,
    dims: Dims,
}

/// The tasks of [`run`], without the merge.
pub(crate) fn partials(op: &FlashAttn, q: Rows, k: KvRows, v: KvRows, dims: Dims) -> Partials {
    let call = Call {
        op,
        far: gpt_kernels::team::streaming(),
        q,
        k,
        v,
        dims,
    };
    let Dims {
        b, h, h_kv, tq, tk, ..
    } = dims;
    // The keys any row may see: the same for every sequence (key padding aside, which
    // masking handles).
    let keys = op.visibility(0, tk, 0).key_range(tq);
    let groups = b * h_kv;
    let work = b * h * keys.len() * dims.d;
    let threads = rayon::current_num_threads();
    let parallel = work >= PARALLEL_WORK && threads > 1;
    // Enough tasks to even out two or four threads, none shorter than `min_range` keys.
    let min_range = match groups < threads {
        true => MIN_RANGE_FEW,
        false => MIN_RANGE,
    };
    let ranges = match parallel {
        true => (4 * threads)
            .div_ceil(groups)
            .min(keys.len().div_ceil(min_range))
            .max(1),
        false => 1,
    };
    let span = keys.len().div_ceil(ranges).max(1);
    let task = |t: usize| {
        let (g, r) = (t / ranges, t % ranges);
        let start = (keys.start + r * span).min(keys.end);
        let end = (start + span).min(keys.end);
        call.group_range(g / h_kv, g % h_kv, start..end)
    };
    let parts = match parallel && groups * ranges > 1 {
        true => gpt_kernels::team::map(groups * ranges, task),
        false => (0..groups * ranges).map(task).collect(),
    };
    Partials {
        parts,
        ranges,
        dims,
    }
}

impl Partials {
    /// Writes every value of `out [b, h, tq, dv]` and of `lse [b, h, tq]` (what they held
    /// before does not matter).
    pub(crate) fn merge(&self, out: &mut [f32], lse: &mut [f32]) {
        let Dims {
            h, h_kv, tq, dv, ..
        } = self.dims;
        let (n_rep, nq) = (self.dims.n_rep(), self.dims.n_rep() * tq);
        // Each row's ranges: weights exp(m_r - m) bring them to the common maximum.
        for (g, parts) in self.parts.chunks(self.ranges).enumerate() {
            let (bi, hk) = (g / h_kv, g % h_kv);
            for qi in 0..nq {
                let row = (bi * h + hk * n_rep + qi / tq) * tq + qi % tq;
                let y = &mut out[row * dv..(row + 1) * dv];
                let m = parts.iter().fold(f32::NEG_INFINITY, |m, p| m.max(p.m[qi]));
                if m == f32::NEG_INFINITY {
                    // A row that saw no key gets zeros, and its weights are all 0.
                    y.fill(0.0);
                    lse[row] = f32::INFINITY;
                    continue;
                }
                if let [p] = parts {
                    // One range (a short cache): its sums are the row's.
                    y.copy_from_slice(&p.acc[qi * dv..(qi + 1) * dv]);
                    simd::scale(y, 1.0 / p.l[qi]);
                    lse[row] = m + p.l[qi].ln();
                    continue;
                }
                y.fill(0.0);
                let mut l = 0f32;
                for p in parts.iter().filter(|p| p.m[qi] > f32::NEG_INFINITY) {
                    let w = (p.m[qi] - m).exp();
                    l += w * p.l[qi];
                    for (y, &a) in y.iter_mut().zip(&p.acc[qi * dv..(qi + 1) * dv]) {
                        *y += w * a;
                    }
                }
                simd::scale(y, 1.0 / l);
                lse[row] = m + l.ln();
            }
        }
    }
}

impl Call<'_> {
    /// The partial softmax of key/value head `hk` of sequence `bi` with its `n_rep` query
    /// heads over the keys `range`.
    fn group_range(&self, bi: usize, hk: usize, range: std::ops::Range<usize>) -> Partial {
        let Call {
            op,
            far,
            q,
            k,
            v,
            dims,
        } = *self;
        let Dims { tq, tk, d, dv, .. } = dims;
        let n_rep = dims.n_rep();
        let nq = n_rep * tq;
        let vis = op.visibility(bi, tk, 0);
        // Query row `qi` is row `qi % tq` of head `hk · n_rep + qi / tq`.
        let queries: Vec<&[f32]> = (0..nq)
            // SAFETY: every row of every head of `q` lies in its storage (see `Rows::ptr`).
            .map(|qi| unsafe {
                std::slice::from_raw_parts(q.ptr(bi, hk * n_rep + qi / tq, qi % tq), d)
            })
            .collect();
        let (kp, vp) = (k.ptr(bi, hk, 0), v.ptr(bi, hk, 0));
        let (k_st, v_st) = (k.st(), v.st());
        let mut scores = vec![0f32; nq * BLOCK.min(range.len())];
        // Scratch for a last block's key rows, allocated when first needed (rarely).
        let mut buf = Vec::new();
        let mut part = Partial {
            m: vec![f32::NEG_INFINITY; nq],
            l: vec![0f32; nq],
            acc: vec![0f32; nq * dv],
        };
        // Where the AVX-512 kernels take the rows, they read them in place whatever the
        // cache's precision, widened as they load (widening into `buf` first cost nearly as
        // much as the attention itself): 16 keys at a time, each query head of the group
        // reading them again from the first-level cache. Elsewhere the row kernels of
        // `gpt_kernels::simd` read them in place, four at a time.
        let (k16, v16) = (avx512_rows(d), avx512_rows(dv));
        // Without AVX-512, eight keys a call and register tiles of the weighted values as
        // AVX-512's kernels do over 16 lanes: `simd`'s row kernels, four rows a call,
        // spent more time in calls and spills than in products.
        let (k8, v8) = (!k16 && avx2_rows(d), !v16 && avx2_rows(dv));
        // A last block of fewer than SUB keys is read in place too where the storage holds
        // SUB rows from it (a cache allocated past its length, or the next head's rows):
        // the scores of the rows past the range are dropped.
        let whole = k.holds(bi, hk, range.start, range.len().next_multiple_of(SUB), d);
        if far {
            let first = FAR.min(range.len());
            prefetch_rows::<L2>(kp, k_st, range.start, first, d);
            prefetch_rows::<L2>(vp, v_st, range.start, first, dv);
        }
        prefetch_rows::<L1>(kp, k_st, range.start, (AHEAD - SUB).min(range.len()), d);
        for j0 in range.clone().step_by(BLOCK) {
            let bc = BLOCK.min(range.end - j0);
            let s = &mut scores[..nq * bc];
            // S[nq, bc] = scale · Q[nq, d] · K[j0.., d]ᵀ
            for sb in (0..bc).step_by(SUB) {
                let n = SUB.min(bc - sb);
                // The values these keys weigh, and the keys after them; the rows FAR on
                // into the second level.
                prefetch_rows::<L1>(vp, v_st, j0 + sb, n, dv);
                let next = (j0 + sb + AHEAD).min(range.end);
                prefetch_rows::<L1>(kp, k_st, next, SUB.min(range.end - next), d);
                if far {
                    let at = (j0 + sb + FAR).min(range.end);
                    prefetch_rows::<L2>(kp, k_st, at, SUB.min(range.end - at), d);
                    prefetch_rows::<L2>(vp, v_st, at, SUB.min(range.end - at), dv);
                }
                if k16 && n == SUB {
                    for (qi, x) in queries.iter().enumerate() {
                        let s = &mut s[qi * bc + sb..qi * bc + sb + SUB];
                        // SAFETY: key rows j0 + sb.. + SUB lie in the storage; `k16` held.
                        unsafe { scores16(kp, k_st, j0 + sb, x, op.scale, s) };
                    }
                } else if k16 {
                    // (A separate branch: the one above keeps its 16 scores' fixed count.)
                    let (p, st, j) = if whole {
                        (kp, k_st, j0 + sb)
                    } else {
                        // SAFETY: key rows j0 + sb.. + n lie in the storage; `k16` held.
                        unsafe { widen(kp, k_st, j0 + sb, n, d, &mut buf) };
                        (KvPtr::F32(buf.as_ptr()), d, 0)
                    };
                    for (qi, x) in queries.iter().enumerate() {
                        let s = &mut s[qi * bc + sb..qi * bc + sb + n];
                        // SAFETY: SUB rows from row `j` lie in the storage (`whole`) or in
                        // `buf` (`widen`); `k16` held.
                        unsafe { scores16(p, st, j, x, op.scale, s) };
                    }
                } else if k8 {
                    // Whole eights of keys by `avx2::scores8`, the rest four at a time.
                    let eights = n / 8 * 8;
                    for (qi, x) in queries.iter().enumerate() {
                        let s = &mut s[qi * bc + sb..qi * bc + sb + n];
                        // SAFETY: key rows j0 + sb.. + n lie in the storage; `k8` held.
                        unsafe {
                            for e in (0..eights).step_by(8) {
                                scores8(kp, k_st, j0 + sb + e, x, op.scale, &mut s[e..e + 8]);
                            }
                            scores_rows(kp, k_st, j0 + sb + eights, x, op.scale, &mut s[eights..]);
                        }
                    }
                } else {
                    for (qi, x) in queries.iter().enumerate() {
                        let s = &mut s[qi * bc + sb..qi * bc + sb + n];
                        // SAFETY: key rows j0 + sb.. + n lie in the storage.
                        unsafe { scores_rows(kp, k_st, j0 + sb, x, op.scale, s) };
                    }
                }
            }
            for qi in 0..nq {
                let row = &mut s[qi * bc..(qi + 1) * bc];
                soft_cap(row, op.softcap);
                let visible = vis.mask_row(row, qi % tq, j0);
                let m_new = part.m[qi].max(simd::max(&row[..visible]));
                if m_new == f32::NEG_INFINITY {
                    // Nothing visible yet: this block contributes nothing to the row.
                    row.fill(0.0);
                    continue;
                }
                let corr = (part.m[qi] - m_new).exp();
                // Hidden keys hold -inf and become exactly 0.
                let sum = simd::exp_sub_sum(row, m_new);
                part.l[qi] = part.l[qi] * corr + sum;
                part.m[qi] = m_new;
                if corr != 1.0 {
                    simd::scale(&mut part.acc[qi * dv..(qi + 1) * dv], corr);
                }
            }
            // ACC[nq, dv] += P[nq, bc] · V[j0.., dv]
            for sb in (0..bc).step_by(SUB) {
                let n = SUB.min(bc - sb);
                let acc = &mut part.acc;
                // SAFETY: value rows j0 + sb.. + n lie in the storage; `s` holds nq rows of
                // bc weights and `acc` nq rows of dv; `v16` held for the first, `v8` for
                // the second.
                unsafe {
                    if v16 {
                        add_weighted(vp, v_st, j0 + sb, n, s, bc, sb, acc, dv);
                    } else if v8 {
                        add_weighted8(vp, v_st, j0 + sb, n, s, bc, sb, acc, dv);
                    } else {
                        add_rows(vp, v_st, j0 + sb, n, s, bc, sb, acc, dv);
                    }
                }
            }
        }
        part
    }
}

/// Rows `j..j + n` (`n ≤ SUB`) of one head's keys (`width` values each, `st` apart) as the
/// first `n` f32 rows of `buf`, `width` apart (grown to SUB rows first: [`scores16`] reads
/// SUB, and the sums of the rows past `n`, whatever they hold, are dropped).
///
/// # Safety
/// [`avx512_rows`] holds for `width`; the rows lie inside the storage `p` points into.
unsafe fn widen(p: KvPtr, st: usize, j: usize, n: usize, width: usize, buf: &mut Vec<f32>) {
    if buf.len() < SUB * width {
        buf.resize(SUB * width, 0.0);
    }
    // `half`'s slice conversion takes 8 values a call, not inlined: it was a sixth of
    // decoding SmolLM-135M over 1024 cached positions.
    #[cfg(target_arch = "x86_64")]
    match p {
        KvPtr::F16(p) => avx512::widen(p.add(j * st), st, n, width, buf),
        KvPtr::BF16(p) => avx512::widen(p.add(j * st), st, n, width, buf),
        KvPtr::F32(p) => avx512::widen(p.add(j * st), st, n, width, buf),
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, st, j, n, width); // `avx512_rows` is false there
}

/// [`prefetch_rows`] into the first-level cache.
#[cfg(target_arch = "x86_64")]
const L1: i32 = std::arch::x86_64::_MM_HINT_T0;
/// [`prefetch_rows`] into the second-level cache.
#[cfg(target_arch = "x86_64")]
const L2: i32 = std::arch::x86_64::_MM_HINT_T1;
#[cfg(not(target_arch = "x86_64"))]
const L1: i32 = 0;
#[cfg(not(target_arch = "x86_64"))]
const L2: i32 = 0;

/// Asks for rows `j..j + n` (`width` values each, `st` apart) at `p` to be brought into
/// cache level `LEVEL` ([`L1`] or [`L2`]). The rows of a long cache come from memory, and
/// its short streams (one head's rows, a few kilobytes) end before the hardware's
/// prefetchers get going: the loads of the widening pass waited on memory for most of its
/// time.
fn prefetch_rows<const LEVEL: i32>(p: KvPtr, st: usize, j: usize, n: usize, width: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::_mm_prefetch;
        let (base, size) = match p {
            KvPtr::F32(p) => (p.cast::<u8>(), 4),
            KvPtr::F16(p) => (p.cast::<u8>(), 2),
            KvPtr::BF16(p) => (p.cast::<u8>(), 2),
        };
        for r in j..j + n {
            let row = base.wrapping_add(r * st * size);
            for at in (0..width * size).step_by(64) {
                // SAFETY: a prefetch is a hint that never faults, whatever the address.
                unsafe { _mm_prefetch::<LEVEL>(row.wrapping_add(at).cast()) };
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, st, j, n, width);
}

/// Whether the AVX-512 kernels take rows of `width` values: the CPU has AVX-512F and
/// `width` is a multiple of 16.
fn avx512_rows(width: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    if width.is_multiple_of(16) {
        return std::arch::is_x86_feature_detected!("avx512f");
    }
    let _ = width;
    false
}

/// Whether [`avx2`]'s kernels take rows of `width` values where AVX-512's do not: the CPU
/// has AVX2, FMA and F16C and `width` is a multiple of 8.
fn avx2_rows(width: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    if width.is_multiple_of(8) {
        return std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c");
    }
    let _ = width;
    false
}

/// `s[i] = scale · x · row(j + i)` for the first `s.len() ≤ SUB` of the SUB rows from row
/// `j` at `p` (`st` apart; f32, or half precision widened as it loads), read in place.
///
/// # Safety
/// [`avx512_rows`] holds for `x.len()`; rows `j..j + SUB` lie in the storage.
unsafe fn scores16(p: KvPtr, st: usize, j: usize, x: &[f32], scale: f32, s: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        let sums = match p {
            KvPtr::F16(p) => avx512::scores16(p.add(j * st), st, x),
            KvPtr::BF16(p) => avx512::scores16(p.add(j * st), st, x),
            KvPtr::F32(p) => avx512::scores16(p.add(j * st), st, x),
        };
        for (s, v) in s.iter_mut().zip(sums) {
            *s = v * scale;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, st, j, x, scale, s); // `avx512_rows` is false there
}

/// `acc[i] += Σ_r w[i·bc + sb + r] · row(j + r)` for the `acc.len() / dv` query rows `i`
/// and the `n` rows from row `j` at `p` (`st` apart, `dv` values each; f32, or half
/// precision widened as it loads), read in place.
///
/// # Safety
/// [`avx512_rows`] holds for `dv`; rows `j..j + n` lie in the storage; `w` holds
/// `acc.len() / dv` rows of `bc` weights.
#[allow(clippy::too_many_arguments)]
unsafe fn add_weighted(
    p: KvPtr,
    st: usize,
    j: usize,
    n: usize,
    w: &[f32],
    bc: usize,
    sb: usize,
    acc: &mut [f32],
    dv: usize,
) {
    #[cfg(target_arch = "x86_64")]
    match p {
        KvPtr::F16(p) => avx512::add_weighted(p.add(j * st), st, n, w, bc, sb, acc, dv),
        KvPtr::BF16(p) => avx512::add_weighted(p.add(j * st), st, n, w, bc, sb, acc, dv),
        KvPtr::F32(p) => avx512::add_weighted(p.add(j * st), st, n, w, bc, sb, acc, dv),
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, st, j, n, w, bc, sb, acc, dv); // `avx512_rows` is false there
}

/// [`scores16`] over 8 rows without AVX-512.
///
/// # Safety
/// [`avx2_rows`] holds for `x.len()`; rows `j..j + 8` lie in the storage; `s` holds 8.
unsafe fn scores8(p: KvPtr, st: usize, j: usize, x: &[f32], scale: f32, s: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        let sums = match p {
            KvPtr::F16(p) => avx2::scores8(p.add(j * st), st, x),
            KvPtr::BF16(p) => avx2::scores8(p.add(j * st), st, x),
            KvPtr::F32(p) => avx2::scores8(p.add(j * st), st, x),
        };
        for (s, v) in s.iter_mut().zip(sums) {
            *s = v * scale;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, st, j, x, scale, s); // `avx2_rows` is false there
}

/// [`add_weighted`] without AVX-512.
///
/// # Safety
/// [`avx2_rows`] holds for `dv`; as [`add_weighted`] otherwise.
#[allow(clippy::too_many_arguments)]
unsafe fn add_weighted8(
    p: KvPtr,
    st: usize,
    j: usize,
    n: usize,
    w: &[f32],
    bc: usize,
    sb: usize,
    acc: &mut [f32],
    dv: usize,
) {
    #[cfg(target_arch = "x86_64")]
    match p {
        KvPtr::F16(p) => avx2::add_weighted(p.add(j * st), st, n, w, bc, sb, acc, dv),
        KvPtr::BF16(p) => avx2::add_weighted(p.add(j * st), st, n, w, bc, sb, acc, dv),
        KvPtr::F32(p) => avx2::add_weighted(p.add(j * st), st, n, w, bc, sb, acc, dv),
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, st, j, n, w, bc, sb, acc, dv); // `avx2_rows` is false there
}

/// Rows `j..j + 4` at `p` (`st` apart, `width` values each), the last of them repeated
/// where fewer than four remain before row `end`.
///
/// # Safety
/// Rows `j..end` lie in the storage `p` points into; `j < end`.
unsafe fn rows4<'a, T>(p: *const T, st: usize, j: usize, end: usize, width: usize) -> [&'a [T]; 4] {
    [0, 1, 2, 3].map(|i| std::slice::from_raw_parts(p.add((j + i).min(end - 1) * st), width))
}

/// `s[i] = scale · x · row(j + i)` for the `s.len()` rows from row `j` at `p`, `st` apart,
/// read in place four at a time by `simd::dot4` (f32, f16 or bf16).
///
/// # Safety
/// Rows `j..j + s.len()` (`x.len()` values each) lie in the storage `p` points into.
unsafe fn scores_rows(p: KvPtr, st: usize, j: usize, x: &[f32], scale: f32, s: &mut [f32]) {
    let (end, d) = (j + s.len(), x.len());
    for (at, s) in (j..end).step_by(4).zip(s.chunks_mut(4)) {
        let dots = match p {
            KvPtr::F32(p) => simd::dot4(x, rows4(p, st, at, end, d)),
            KvPtr::F16(p) => simd::dot4_f16(x, rows4(p, st, at, end, d)),
            KvPtr::BF16(p) => simd::dot4_bf16(x, rows4(p, st, at, end, d)),
        };
        // (A last call short of four rows repeated its last: those sums are dropped.)
        for (s, v) in s.iter_mut().zip(dots) {
            *s = v * scale;
        }
    }
}

/// [`add_weighted`] of the `n` rows from row `j` at `p` (`st` apart, `dv` values each),
/// read in place without AVX-512, four at a time by `simd::axpy4` (f32, f16 or bf16): a
/// last call short of four rows repeats its last row with weight 0. (One value at a time,
/// a half-precision cache's rest took a call to `half`'s conversion per value: 14% of this
/// function's samples in decoding, whose ranges rarely hold a multiple of four rows.)
///
/// # Safety
/// Rows `j..j + n` lie in the storage `p` points into; `w` holds `acc.len() / dv` rows of
/// `bc` weights.
#[allow(clippy::too_many_arguments)]
unsafe fn add_rows(
    p: KvPtr,
    st: usize,
    j: usize,
    n: usize,
    w: &[f32],
    bc: usize,
    sb: usize,
    acc: &mut [f32],
    dv: usize,
) {
    for (y, w) in acc.chunks_exact_mut(dv).zip(w.chunks_exact(bc)) {
        let w = &w[sb..sb + n];
        for i in (0..n).step_by(4) {
            // Weights past the range are 0: their rows (the last one repeated) add nothing.
            let a = [0, 1, 2, 3].map(|r| w.get(i + r).copied().unwrap_or(0.0));
            match p {
                KvPtr::F32(p) => simd::axpy4(y, a, rows4(p, st, j + i, j + n, dv)),
                KvPtr::F16(p) => simd::axpy4_f16(y, a, rows4(p, st, j + i, j + n, dv)),
                KvPtr::BF16(p) => simd::axpy4_bf16(y, a, rows4(p, st, j + i, j + n, dv)),
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use gpt_kernels::simd::avx512::Load;

    /// Rows `0..n` at `p` (`st` apart, `width` values each, a multiple of 16) as f32 rows of
    /// `buf`, `width` apart.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn widen<E: Load>(p: *const E, st: usize, n: usize, width: usize, buf: &mut [f32]) {
        for (r, dst) in buf.chunks_exact_mut(width).take(n).enumerate() {
            let src = p.add(r * st);
            for c in (0..width).step_by(16) {
                _mm512_storeu_ps(dst.as_mut_ptr().add(c), E::load16(src.add(c)));
            }
        }
    }

    /// Lanes 0, 2 of `x` and `y` plus lanes 1, 3 (of 128 bits): `[x0+x1, x2+x3, y0+y1, y2+y3]`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn pair(x: __m512, y: __m512) -> __m512 {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(x, y),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y),
        )
    }

    /// Lane `j` of the result: the sum of the 16 lanes of `t[j]`. Pairs of registers are
    /// interleaved and added, halving the registers and doubling the sums each holds, four
    /// times (as a 16 × 16 transpose would, adding as it goes). No closures: one would be
    /// compiled without AVX-512 and pass the vectors in another convention.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn reduce16(t: &[__m512; 16]) -> __m512 {
        // Lanes of 128 bits: [a0+a2, b0+b2, a1+a3, b1+b3] for a = t[2i], b = t[2i + 1].
        let mut u = [_mm512_setzero_ps(); 8];
        for i in 0..8 {
            let (a, b) = (t[2 * i], t[2 * i + 1]);
            u[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
        }
        // Lanes of 128 bits: the sums over that lane of keys 4i..4i + 4.
        let mut w = [_mm512_setzero_ps(); 4];
        for i in 0..4 {
            let (a, b) = (_mm512_castps_pd(u[2 * i]), _mm512_castps_pd(u[2 * i + 1]));
            // Interleaved as pairs of lanes, added as f32.
            w[i] = _mm512_add_ps(
                _mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)),
            );
        }
        pair(pair(w[0], w[1]), pair(w[2], w[3]))
    }

    #[cfg(test)]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn reduce_rows(v: &[f32]) -> [f32; 16] {
        let mut t = [_mm512_setzero_ps(); 16];
        for (j, t) in t.iter_mut().enumerate() {
            *t = _mm512_loadu_ps(v.as_ptr().add(16 * j));
        }
        let mut out = [0f32; 16];
        _mm512_storeu_ps(out.as_mut_ptr(), reduce16(&t));
        out
    }

    /// The dot products of `x` (a multiple of 16 long) with 16 rows `st` apart (f32, or
    /// half precision widened as they are read).
    #[target_feature(enable = "avx512f")]
    pub unsafe fn scores16<E: Load>(rows: *const E, st: usize, x: &[f32]) -> [f32; 16] {
        let mut t = [_mm512_setzero_ps(); 16];
        for c in (0..x.len()).step_by(16) {
            let xv = _mm512_loadu_ps(x.as_ptr().add(c));
            for (j, t) in t.iter_mut().enumerate() {
                *t = _mm512_fmadd_ps(xv, E::load16(rows.add(j * st + c)), *t);
            }
        }
        let mut out = [0f32; 16];
        _mm512_storeu_ps(out.as_mut_ptr(), reduce16(&t));
        out
    }

    /// `Q` query rows by `16·C` columns from `c0`: `acc[q] += Σ_j p[q][j] · row(j)`, the
    /// accumulators held in registers across the `n` rows.
    #[target_feature(enable = "avx512f")]
    #[inline]
    #[allow(clippy::needless_range_loop)] // a[q][c] beside acc[q], p[q] and v[c]
    unsafe fn tile<E: Load, const Q: usize, const C: usize>(
        rows: *const E,
        st: usize,
        n: usize,
        p: [*const f32; Q],
        acc: [*mut f32; Q],
        c0: usize,
    ) {
        let mut a = [[_mm512_setzero_ps(); C]; Q];
        for q in 0..Q {
            for c in 0..C {
                a[q][c] = _mm512_loadu_ps(acc[q].add(c0 + 16 * c));
            }
        }
        for j in 0..n {
            let r = rows.add(j * st + c0);
            let mut v = [_mm512_setzero_ps(); C];
            for (c, v) in v.iter_mut().enumerate() {
                *v = E::load16(r.add(16 * c));
            }
            for q in 0..Q {
                let w = _mm512_set1_ps(*p[q].add(j));
                for c in 0..C {
                    a[q][c] = _mm512_fmadd_ps(w, v[c], a[q][c]);
                }
            }
        }
        for q in 0..Q {
            for c in 0..C {
                _mm512_storeu_ps(acc[q].add(c0 + 16 * c), a[q][c]);
            }
        }
    }

    /// As [`super::add_weighted`], `dv` a multiple of 16, the rows f32 or half precision:
    /// up to four query rows by 64 columns at a time (16 accumulators), then 16 columns at
    /// a time.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn add_weighted<E: Load>(
        rows: *const E,
        st: usize,
        n: usize,
        p: &[f32],
        bc: usize,
        sb: usize,
        acc: &mut [f32],
        dv: usize,
    ) {
        let nq = acc.len() / dv;
        let (pp, ap) = (p.as_ptr(), acc.as_mut_ptr());
        for q0 in (0..nq).step_by(4) {
            let ps = |i: usize| pp.add((q0 + i) * bc + sb);
            let accs = |i: usize| ap.add((q0 + i) * dv);
            macro_rules! tiles {
                ($q:literal) => {{
                    let p: [*const f32; $q] = std::array::from_fn(ps);
                    let a: [*mut f32; $q] = std::array::from_fn(accs);
                    let mut c0 = 0;
                    while c0 + 64 <= dv {
                        tile::<E, $q, 4>(rows, st, n, p, a, c0);
                        c0 += 64;
                    }
                    while c0 < dv {
                        tile::<E, $q, 1>(rows, st, n, p, a, c0);
                        c0 += 16;
                    }
                }};
            }
            match nq - q0 {
                1 => tiles!(1),
                2 => tiles!(2),
                3 => tiles!(3),
                _ => tiles!(4),
            }
        }
    }
}

/// [`avx512`]'s kernels over eight lanes, for CPUs with AVX2, FMA and F16C alone.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use gpt_kernels::simd::Load8 as Load;

    /// Lane `j` of the result: the sum of the 8 lanes of `t[j]`. Pairs are added
    /// horizontally (twice), then the two 128-bit halves of each result added: a transpose
    /// of 8 × 8 that adds as it goes. (No closures, as in `avx512::reduce16`.)
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn reduce8(t: &[__m256; 8]) -> __m256 {
        // [a01, a23, b01, b23 | a45, a67, b45, b67] for a = t[2i], b = t[2i + 1].
        let u = [0, 1, 2, 3].map(|i| _mm256_hadd_ps(t[2 * i], t[2 * i + 1]));
        // [t0, t1, t2, t3 | t0, t1, t2, t3] (each a half's sum), and t4..t7.
        let (v0, v1) = (_mm256_hadd_ps(u[0], u[1]), _mm256_hadd_ps(u[2], u[3]));
        _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(v0, v1),
            _mm256_permute2f128_ps::<0x31>(v0, v1),
        )
    }

    #[cfg(test)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn reduce_rows(v: &[f32]) -> [f32; 8] {
        let mut t = [_mm256_setzero_ps(); 8];
        for (j, t) in t.iter_mut().enumerate() {
            *t = _mm256_loadu_ps(v.as_ptr().add(8 * j));
        }
        let mut out = [0f32; 8];
        _mm256_storeu_ps(out.as_mut_ptr(), reduce8(&t));
        out
    }

    /// The dot products of `x` (a multiple of 8 long) with 8 rows `st` apart (f32, or half
    /// precision widened as they are read): 8 accumulators and `x`, 10 of the 16 registers.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn scores8<E: Load>(rows: *const E, st: usize, x: &[f32]) -> [f32; 8] {
        let mut t = [_mm256_setzero_ps(); 8];
        for c in (0..x.len()).step_by(8) {
            let xv = _mm256_loadu_ps(x.as_ptr().add(c));
            for (j, t) in t.iter_mut().enumerate() {
                *t = _mm256_fmadd_ps(xv, E::load8(rows.add(j * st + c)), *t);
            }
        }
        let mut out = [0f32; 8];
        _mm256_storeu_ps(out.as_mut_ptr(), reduce8(&t));
        out
    }

    /// `Q` query rows by `8·C` columns from `c0`: `acc[q] += Σ_j p[q][j] · row(j)`, the
    /// accumulators held in registers across the `n` rows (`Q·C + C + 1` of the 16).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    #[allow(clippy::needless_range_loop)] // a[q][c] beside acc[q], p[q] and v[c]
    unsafe fn tile<E: Load, const Q: usize, const C: usize>(
        rows: *const E,
        st: usize,
        n: usize,
        p: [*const f32; Q],
        acc: [*mut f32; Q],
        c0: usize,
    ) {
        let mut a = [[_mm256_setzero_ps(); C]; Q];
        for q in 0..Q {
            for c in 0..C {
                a[q][c] = _mm256_loadu_ps(acc[q].add(c0 + 8 * c));
            }
        }
        for j in 0..n {
            let r = rows.add(j * st + c0);
            let mut v = [_mm256_setzero_ps(); C];
            for (c, v) in v.iter_mut().enumerate() {
                *v = E::load8(r.add(8 * c));
            }
            for q in 0..Q {
                let w = _mm256_set1_ps(*p[q].add(j));
                for c in 0..C {
                    a[q][c] = _mm256_fmadd_ps(w, v[c], a[q][c]);
                }
            }
        }
        for q in 0..Q {
            for c in 0..C {
                _mm256_storeu_ps(acc[q].add(c0 + 8 * c), a[q][c]);
            }
        }
    }

    /// As [`super::add_weighted`], `dv` a multiple of 8: one or two query rows by 32
    /// columns at a time, three or four by 16, then 8 columns at a time.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn add_weighted<E: Load>(
        rows: *const E,
        st: usize,
        n: usize,
        p: &[f32],
        bc: usize,
        sb: usize,
        acc: &mut [f32],
        dv: usize,
    ) {
        let nq = acc.len() / dv;
        let (pp, ap) = (p.as_ptr(), acc.as_mut_ptr());
        for q0 in (0..nq).step_by(4) {
            let ps = |i: usize| pp.add((q0 + i) * bc + sb);
            let accs = |i: usize| ap.add((q0 + i) * dv);
            macro_rules! tiles {
                ($q:literal, $c:literal) => {{
                    let p: [*const f32; $q] = std::array::from_fn(ps);
                    let a: [*mut f32; $q] = std::array::from_fn(accs);
                    let mut c0 = 0;
                    while c0 + 8 * $c <= dv {
                        tile::<E, $q, $c>(rows, st, n, p, a, c0);
                        c0 += 8 * $c;
                    }
                    while c0 < dv {
                        tile::<E, $q, 1>(rows, st, n, p, a, c0);
                        c0 += 8;
                    }
                }};
            }
            match nq - q0 {
                1 => tiles!(1, 4),
                2 => tiles!(2, 4),
                3 => tiles!(3, 2),
                _ => tiles!(4, 2),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, salt: u32) -> Vec<f32> {
        (0..n as u32)
            .map(|i| ((i.wrapping_mul(2_654_435_761) ^ salt) % 1000) as f32 / 250.0 - 2.0)
            .collect()
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn reduce16_sums_each_register() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            return;
        }
        let v: Vec<f32> = values(256, 1);
        // SAFETY: AVX-512F is present; 256 values are 16 rows of 16.
        let got = unsafe { avx512::reduce_rows(&v) };
        for j in 0..16 {
            let want: f32 = v[j * 16..(j + 1) * 16].iter().sum();
            assert!((got[j] - want).abs() < 1e-4, "{j}: {got:?}");
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn reduce8_sums_each_register() {
        if !avx2_rows(8) {
            return;
        }
        let v: Vec<f32> = values(64, 2);
        // SAFETY: AVX2, FMA and F16C are present; 64 values are 8 rows of 8.
        let got = unsafe { avx2::reduce_rows(&v) };
        for j in 0..8 {
            let want: f32 = v[j * 8..(j + 1) * 8].iter().sum();
            assert!((got[j] - want).abs() < 1e-4, "{j}: {got:?}");
        }
    }

    /// Every reader of a cache (the row kernels; AVX2's where the CPU has it and the width
    /// is a multiple of 8; AVX-512's where the CPU has it and the width is a multiple of
    /// 16, a short block's keys through `widen` too): f32, f16 and bf16 rows, counts that
    /// are not multiples of four, against the f64 sums of the same values as stored.
    #[test]
    fn readers_equal_f64_sums() {
        use half::{bf16, f16};
        for (width, st, n) in [
            (64, 80, 16),
            (64, 64, 5),
            (24, 24, 13),
            (16, 40, 1),
            (128, 128, 7),
        ] {
            // SUB rows from row 2: the first rows of the storage are not the first read.
            let j = 2;
            let stored = values((SUB + j) * st, 7);
            let x = values(width, 3);
            let f16s: Vec<f16> = stored.iter().map(|&v| f16::from_f32(v)).collect();
            let bf16s: Vec<bf16> = stored.iter().map(|&v| bf16::from_f32(v)).collect();
            let cases: [(KvPtr, Vec<f32>); 3] = [
                (KvPtr::F32(stored.as_ptr()), stored.clone()),
                (
                    KvPtr::F16(f16s.as_ptr()),
                    f16s.iter().map(|v| v.to_f32()).collect(),
                ),
                (
                    KvPtr::BF16(bf16s.as_ptr()),
                    bf16s.iter().map(|v| v.to_f32()).collect(),
                ),
            ];
            for (p, rows) in cases {
                let check_scores = |s: &[f32], how: &str| {
                    for (i, &got) in s.iter().enumerate() {
                        let want: f64 = (0..width)
                            .map(|c| x[c] as f64 * rows[(j + i) * st + c] as f64)
                            .sum::<f64>()
                            * 0.5;
                        assert!(
                            (got as f64 - want).abs() < 1e-4,
                            "{how} scores width {width} n {n} row {i}: {got} vs {want}"
                        );
                    }
                };
                let mut s = vec![0f32; n];
                // SAFETY: rows j..j + n of `st` values lie in the storage.
                unsafe { scores_rows(p, st, j, &x, 0.5, &mut s) };
                check_scores(&s, "rows");
                if avx2_rows(width) {
                    let mut s8 = vec![0f32; 8];
                    // SAFETY: rows j..j + 8 lie in the storage; `avx2_rows` held.
                    unsafe { scores8(p, st, j, &x, 0.5, &mut s8) };
                    check_scores(&s8, "avx2");
                }
                if avx512_rows(width) {
                    s.fill(0.0);
                    // SAFETY: rows j..j + SUB lie in the storage; `avx512_rows` held.
                    unsafe { scores16(p, st, j, &x, 0.5, &mut s) };
                    check_scores(&s, "avx512");
                    s.fill(0.0);
                    let mut buf = vec![f32::NAN; 3];
                    // SAFETY: rows j..j + n lie in the storage; `avx512_rows` held.
                    unsafe { widen(p, st, j, n, width, &mut buf) };
                    // SAFETY: `widen` left SUB rows of `width` values in `buf`.
                    unsafe { scores16(KvPtr::F32(buf.as_ptr()), width, 0, &x, 0.5, &mut s) };
                    check_scores(&s, "widened");
                }
                for nq in 1..=6 {
                    let bc = n + 3;
                    let w = values(nq * bc, 11);
                    let before = values(nq * width, 5);
                    let check = |acc: &[f32], how: &str| {
                        for q in 0..nq {
                            for c in 0..width {
                                let want = before[q * width + c] as f64
                                    + (0..n)
                                        .map(|i| {
                                            w[q * bc + 2 + i] as f64 * rows[(j + i) * st + c] as f64
                                        })
                                        .sum::<f64>();
                                let got = acc[q * width + c] as f64;
                                assert!(
                                    (got - want).abs() < 1e-4,
                                    "{how} values width {width} nq {nq} n {n}: {got} vs {want}"
                                );
                            }
                        }
                    };
                    let mut acc = before.clone();
                    // SAFETY: as above; w holds nq rows of bc, acc nq rows of width.
                    unsafe { add_rows(p, st, j, n, &w, bc, 2, &mut acc, width) };
                    check(&acc, "rows");
                    if avx2_rows(width) {
                        let mut acc = before.clone();
                        // SAFETY: as above; `avx2_rows` held.
                        unsafe { add_weighted8(p, st, j, n, &w, bc, 2, &mut acc, width) };
                        check(&acc, "avx2");
                    }
                    if avx512_rows(width) {
                        let mut acc = before.clone();
                        // SAFETY: as above; `avx512_rows` held.
                        unsafe { add_weighted(p, st, j, n, &w, bc, 2, &mut acc, width) };
                        check(&acc, "avx512");
                    }
                }
            }
        }
    }
}
