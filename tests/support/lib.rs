//! Nothing here: the workspace root exists for its tests in `tests/`.

// The workspace README's examples run as doctests.
#[doc = include_str!("../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
