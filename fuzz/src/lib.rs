//! What the fuzz targets share: a scratch directory for the inputs that are read from files.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// A directory for this process's scratch files (under `$TMPDIR`; scripts/fuzz.sh points that
/// at a directory it removes afterwards, since libFuzzer exits without running destructors).
pub fn scratch_dir() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        tempfile::Builder::new()
            .prefix("perch-fuzz-")
            .tempdir()
            .expect("create a scratch directory")
    })
    .path()
}

/// Writes `data` to `name` in the scratch directory and returns its path.
pub fn scratch_file(name: &str, data: &[u8]) -> PathBuf {
    let path = scratch_dir().join(name);
    std::fs::write(&path, data).expect("write a scratch file");
    path
}
