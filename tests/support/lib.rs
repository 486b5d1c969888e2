//! Nothing here: the workspace root exists for its tests in `tests/`.
