//! The workspace's sources, for tests that read the code itself.

use std::path::{Path, PathBuf};

/// Every Rust file under `dir`, at any depth; `tests.rs` files too unless
/// `with_tests` is false. A missing folder has none.
pub fn rust_sources(dir: &Path, with_tests: bool) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut dirs = vec![dir.to_owned()];
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs")
                && (with_tests || path.file_name().is_some_and(|n| n != "tests.rs"))
            {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}
