//! The instruction level the quantized kernels run at on this CPU, found once.

use std::sync::OnceLock;

/// The instruction sets the kernels of `packed` use, best last.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Level {
    Scalar,
    /// AVX2, FMA and F16C (`vpmaddubsw`, `vpmaddwd`).
    Avx2,
    /// AVX-512 with VNNI and byte operations (`vpdpbusd`).
    Avx512Vnni,
    /// The same with GFNI (`vgf2p8affineqb`, any linear map of a byte's bits in one
    /// instruction): q6_K's decoding unpacks its bit pairs with it.
    Avx512Gfni,
}

/// This CPU's level (looked up once: every product asks).
pub(super) fn level() -> Level {
    static LEVEL: OnceLock<Level> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx512f") && has!("avx512bw") && has!("avx512vnni") && has!("f16c") {
                return match has!("gfni") {
                    true => Level::Avx512Gfni,
                    false => Level::Avx512Vnni,
                };
            }
            if has!("avx2") && has!("fma") && has!("f16c") {
                return Level::Avx2;
            }
        }
        Level::Scalar
    })
}
