//! An output vector that parallel tasks write in disjoint parts, for the products of
//! [`crate::dense`] and [`crate::quant`].

/// A pointer to an output vector whose elements parallel tasks write, each its own.
pub(crate) struct SharedOut(pub(crate) *mut f32);

// SAFETY: each task writes its own elements (the products split their outputs by columns
// or rows), and the vector outlives them (the parallel loops return when they are done).
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// Element `i` (a method, so closures capture the whole `Sync` struct).
    ///
    /// # Safety
    /// `i` must lie inside the vector.
    pub(crate) unsafe fn at(&self, i: usize) -> *mut f32 {
        unsafe { self.0.add(i) }
    }
}
