//! How many `vpdpbusd` (AVX-512 VNNI) a core retires per nanosecond: with both operands in
//! registers, with the broadcast value of `x` folded in from memory (`{1to16}`, one load
//! per instruction, as the packed kernels first did), and with one broadcast into a
//! register shared by two instructions (the prefill kernels since, `x86::q4k_pair`); and
//! a multiply-add beside them to gauge the clock. Twelve independent sums each, so that
//! latency does not bound them. Then the prefill kernel's own pattern, with and without its
//! scaling after each 32 values. docs/PERFORMANCE.md has what an Ice Lake Xeon gave.
//!
//! `cargo run --release -p gpt-kernels --example vnni_rate`

#[cfg(target_arch = "x86_64")]
mod rates {
    use std::arch::x86_64::*;

    /// `n` rounds of 12 `vpdpbusd`, all operands in registers.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn registers(n: usize) -> i32 {
        let a = _mm512_set1_epi32(0x0102_0304);
        let mut acc = [_mm512_setzero_si512(); 12];
        for i in 0..n {
            let b = _mm512_set1_epi32(i as i32);
            for acc in &mut acc {
                *acc = _mm512_dpbusd_epi32(*acc, a, b);
            }
        }
        acc.iter().fold(0, |s, &v| s ^ _mm512_reduce_add_epi32(v))
    }

    /// `n` rounds of 12 `vpdpbusd`, each broadcasting its own 4 bytes of `x` from memory.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn folded(n: usize, x: &[i32; 1024]) -> i32 {
        let a = _mm512_set1_epi32(0x0102_0304);
        let mut acc = [_mm512_setzero_si512(); 12];
        for i in 0..n {
            let at = (i * 12) & 511;
            for (k, acc) in acc.iter_mut().enumerate() {
                *acc = _mm512_dpbusd_epi32(*acc, a, _mm512_set1_epi32(x[at + k]));
            }
        }
        acc.iter().fold(0, |s, &v| s ^ _mm512_reduce_add_epi32(v))
    }

    /// `n` rounds of 12 `vpdpbusd`, each broadcast of `x` used by two (two columns).
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn shared(n: usize, x: &[i32; 1024]) -> i32 {
        let a = [
            _mm512_set1_epi32(0x0102_0304),
            _mm512_set1_epi32(0x0403_0201),
        ];
        let mut acc = [_mm512_setzero_si512(); 12];
        for i in 0..n {
            let at = (i * 6) & 511;
            for (k, acc) in acc.chunks_exact_mut(2).enumerate() {
                let b = _mm512_set1_epi32(x[at + k]);
                acc[0] = _mm512_dpbusd_epi32(acc[0], a[0], b);
                acc[1] = _mm512_dpbusd_epi32(acc[1], a[1], b);
            }
        }
        acc.iter().fold(0, |s, &v| s ^ _mm512_reduce_add_epi32(v))
    }

    /// The prefill kernel's pattern (`x86::q4k_pair` at 4 rows), with its data in L1: per
    /// group two columns' 64 operand bytes loaded, 4 bytes of each of 4 rows of `x`
    /// broadcast, 8 `vpdpbusd` into 8 sums; 8 groups (a sub-block of 32 values), then with
    /// `EPILOGUE` the sums scaled as `scale_pair` does, else only kept.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn kernel<const EPILOGUE: bool>(n: usize, w: &[u8; 8192], x: &[i32; 1024]) -> i32 {
        let mut out = _mm512_setzero_si512();
        let mut sums = [_mm512_setzero_ps(); 8];
        for i in 0..n / 8 {
            // Sub-block `blk` of 8 per column (512 operand bytes each), 32 bytes of x at `at`.
            let (blk, at) = (i & 7, (i * 8) & 127);
            let mut s = [_mm512_setzero_si512(); 8];
            for g in 0..8 {
                let w0 = _mm512_loadu_si512(w.as_ptr().add(512 * blk + 64 * g).cast());
                let w1 = _mm512_loadu_si512(w.as_ptr().add(4096 + 512 * blk + 64 * g).cast());
                for r in 0..4 {
                    let v = _mm512_set1_epi32(x[256 * r + at + g]);
                    s[2 * r] = _mm512_dpbusd_epi32(s[2 * r], w0, v);
                    s[2 * r + 1] = _mm512_dpbusd_epi32(s[2 * r + 1], w1, v);
                }
            }
            if EPILOGUE {
                // As `scale_pair`: each sum to f32, times the sub-block's scale, less its
                // minimum times the row's sum of x.
                let sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                    w.as_ptr().add(16 * blk).cast(),
                )));
                let m = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                    w.as_ptr().add(256 + 16 * blk).cast(),
                )));
                for (k, v) in s.iter().enumerate() {
                    let xs = _mm512_set1_ps(x[k] as f32);
                    sums[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(*v), sc, sums[k]);
                    sums[k] = _mm512_fnmadd_ps(m, xs, sums[k]);
                }
            } else {
                for v in s {
                    out = _mm512_xor_si512(out, v);
                }
            }
        }
        _mm512_reduce_add_epi32(out)
            + sums.iter().map(|&v| _mm512_reduce_add_ps(v)).sum::<f32>() as i32
    }

    /// `n` rounds of 12 f32 multiply-adds.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn fma(n: usize) -> f32 {
        let m = _mm512_set1_ps(0.999_999);
        let mut acc = [_mm512_set1_ps(1.0); 12];
        for _ in 0..n {
            for acc in &mut acc {
                *acc = _mm512_fmadd_ps(*acc, m, m);
            }
        }
        acc.iter().map(|&v| _mm512_reduce_add_ps(v)).sum()
    }
}

#[cfg(target_arch = "x86_64")]
fn main() {
    use std::time::Instant;
    let vnni = ["avx512f", "avx512bw", "avx512vnni"];
    if !(is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vnni"))
    {
        println!("this CPU lacks one of {vnni:?}");
        return;
    }
    let x: [i32; 1024] = std::array::from_fn(|i| i as i32);
    let n = 20_000_000;
    // (`black_box`: each round runs again, not folded into the first.)
    let (n, x) = (std::hint::black_box(n), &x);
    let ns = |f: &dyn Fn() -> f32| {
        let t = Instant::now();
        std::hint::black_box(f());
        t.elapsed().as_secs_f64() * 1e9 / (12 * n) as f64
    };
    for _ in 0..3 {
        // SAFETY: the CPU has the features (checked above).
        let r = ns(&|| unsafe { rates::registers(std::hint::black_box(n)) } as f32);
        let f = ns(&|| unsafe { rates::folded(std::hint::black_box(n), x) } as f32);
        let s = ns(&|| unsafe { rates::shared(std::hint::black_box(n), x) } as f32);
        let m = ns(&|| unsafe { rates::fma(std::hint::black_box(n)) });
        let w = [3u8; 8192];
        // 12·n / 8 rounds of 8 groups of 8: 12·n instructions.
        let k = ns(
            &|| unsafe { rates::kernel::<false>(std::hint::black_box(12 * n / 8), &w, x) } as f32,
        );
        let e = ns(
            &|| unsafe { rates::kernel::<true>(std::hint::black_box(12 * n / 8), &w, x) } as f32,
        );
        println!("kernel pattern {k:.3}, with the epilogue {e:.3}");
        println!(
            "ns per instruction: vpdpbusd in registers {r:.3}, broadcast from memory {f:.3}, \
             a broadcast shared by two {s:.3}; vfmadd {m:.3}"
        );
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn main() {
    println!("an x86-64 measurement");
}
