//! Where a decoding step's time goes: wall time spent in the model's projections and in
//! its attention steps, summed across calls, when built with the `profile` feature
//! (`gpt bench` prints it per token). Without the feature a [`Timer`] is empty and
//! [`take`] answers `None`: nothing is timed and nothing is stored.
//!
//! Only the calling thread's view is measured: a product's time includes waiting for the
//! helpers' last tiles, which is what the step waits for too. The parts nest nowhere
//! (a projection is never timed inside an attention step), so what is left of a step's
//! time is the rest: norms, activations, residual adds, rotations, embeddings, sampling.
//! docs/PERFORMANCE.md ("Where decoding's time goes") has results.

#[cfg(feature = "profile")]
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// A timed part of a decoding step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    /// A projection ([`crate::Proj::forward`]): the product, `x`'s quantization and the
    /// output tensor.
    Products,
    /// An attention step: the new keys and values written into the cache, and the
    /// attention over it (the fused decoding path of `mha`).
    Attention,
}

impl Part {
    /// Every part, in [`take`]'s order.
    pub const ALL: [Part; 2] = [Part::Products, Part::Attention];
}

#[cfg(feature = "profile")]
static TOTALS: [(AtomicU64, AtomicU64); 2] = [
    (AtomicU64::new(0), AtomicU64::new(0)),
    (AtomicU64::new(0), AtomicU64::new(0)),
];

/// Times one call of a part until dropped.
#[must_use = "a timer counts until it is dropped"]
pub struct Timer {
    #[cfg(feature = "profile")]
    start: (Part, std::time::Instant),
}

/// Starts timing a call of `part`.
#[inline]
pub fn time(part: Part) -> Timer {
    #[cfg(not(feature = "profile"))]
    let _ = part;
    Timer {
        #[cfg(feature = "profile")]
        start: (part, std::time::Instant::now()),
    }
}

#[cfg(feature = "profile")]
impl Drop for Timer {
    fn drop(&mut self) {
        let (part, t0) = self.start;
        let (ns, calls) = &TOTALS[part as usize];
        ns.fetch_add(t0.elapsed().as_nanos() as u64, Relaxed);
        calls.fetch_add(1, Relaxed);
    }
}

/// The time and call count of each part since the last `take` (in [`Part::ALL`]'s order),
/// and the counters set back to zero; `None` without the `profile` feature.
pub fn take() -> Option<[(Part, Duration, u64); 2]> {
    #[cfg(feature = "profile")]
    {
        Some(Part::ALL.map(|part| {
            let (ns, calls) = &TOTALS[part as usize];
            (
                part,
                Duration::from_nanos(ns.swap(0, Relaxed)),
                calls.swap(0, Relaxed),
            )
        }))
    }
    #[cfg(not(feature = "profile"))]
    None
}

#[cfg(all(test, feature = "profile"))]
mod tests {
    use super::*;

    #[test]
    fn timers_add_up_per_part() {
        take();
        for _ in 0..3 {
            let _t = time(Part::Attention);
            std::thread::sleep(Duration::from_millis(2));
        }
        let parts = take().expect("the profile feature is on");
        let (part, spent, calls) = parts[1];
        assert_eq!((part, calls), (Part::Attention, 3));
        assert!(spent >= Duration::from_millis(6), "{spent:?}");
        assert_eq!(take().expect("on")[1].2, 0, "take resets the counters");
    }
}
