//! File helpers every format shares: errors that name their file, and writes that never
//! leave a half-written file behind.

use std::path::{Path, PathBuf};

use candle_core::Result;

/// An error that names the file it is about.
pub(crate) fn path_err(path: &Path, e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("{}: {e}", path.display()))
}

/// Writes through `write` to `path.tmp`, then renames it over `path`.
pub fn write_atomic(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    write(&tmp)?;
    std::fs::rename(&tmp, path).map_err(|e| path_err(path, e))
}
