//! The memory-read floor of decoding: how fast this process's threads read memory that no
//! cache holds, measured between decoding steps.
//!
//! Decoding one token reads every weight once, so its speed is bounded by the rate memory
//! delivers them. On a shared machine that rate moves between runs, and even within one (a
//! virtual machine's neighbours take the memory bus in bursts of seconds), so a floor
//! measured before or after a benchmark misjudges the decoding between. `gpt bench
//! --read-floor` reads [`ReadFloor`]'s buffer once after each decoding step instead, on the
//! threads the products run on, so both see the same machine.

use std::time::{Duration, Instant};

use crate::memory;

/// A buffer far larger than the caches, on the huge pages the weights get, to be read whole.
pub struct ReadFloor {
    buf: Vec<f32>,
}

/// Bytes of the buffer: eight times and more the last-level cache of the CPUs that run
/// small models (32 MiB on a Zen 4 chiplet), so that what one read leaves cached is
/// little of what the next one reads.
const BYTES: usize = 256 << 20;

impl Default for ReadFloor {
    fn default() -> Self {
        Self::new()
    }
}

impl ReadFloor {
    /// Allocates the buffer and writes each of its pages, so that none is first touched
    /// while timed.
    pub fn new() -> Self {
        Self {
            buf: memory::packed_weight_vec(BYTES / 4, 1f32),
        }
    }

    /// Bytes each [`read`](Self::read) reads.
    pub fn bytes(&self) -> usize {
        std::mem::size_of_val(self.buf.as_slice())
    }

    /// Reads the whole buffer, in one contiguous part per thread of the decoding products,
    /// and returns the time it took.
    pub fn read(&self) -> Duration {
        let parts = rayon::current_num_threads().max(1);
        let t0 = Instant::now();
        let sums = crate::team::map(parts, |i| sum(self.part(i, parts)));
        let elapsed = t0.elapsed();
        std::hint::black_box(sums);
        elapsed
    }

    /// Part `i` of `parts` nearly equal, contiguous parts of the buffer.
    fn part(&self, i: usize, parts: usize) -> &[f32] {
        let len = self.buf.len().div_ceil(parts);
        let start = (i * len).min(self.buf.len());
        &self.buf[start..(start + len).min(self.buf.len())]
    }
}

/// Sums `v` in 32 independent lanes: the loads bound it, not the chain of additions, at any
/// vector width the compiler picks.
fn sum(v: &[f32]) -> f32 {
    let mut acc = [0f32; 32];
    let chunks = v.chunks_exact(32);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for (a, x) in acc.iter_mut().zip(c) {
            *a += x;
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sum_adds_every_value_once() {
        // 100 values: three whole chunks of 32 and a tail of 4.
        let v: Vec<f32> = (1..=100).map(|i| i as f32).collect();
        assert_eq!(sum(&v), 5050.0);
        assert_eq!(sum(&v[..4]), 10.0);
        assert_eq!(sum(&[]), 0.0);
    }

    #[test]
    fn parts_cover_the_buffer_once_in_order() {
        let floor = ReadFloor::new();
        assert_eq!(floor.bytes(), BYTES);
        let all = floor.buf.as_ptr_range();
        for parts in [1, 2, 3, 7, 64] {
            let mut next = all.start;
            for i in 0..parts {
                let p = floor.part(i, parts).as_ptr_range();
                assert_eq!(
                    p.start, next,
                    "part {i} of {parts} starts where the last ended"
                );
                next = p.end;
            }
            assert_eq!(next, all.end, "{parts} parts end at the buffer's end");
        }
        assert!(floor.read() > Duration::ZERO);
    }
}
