//! The file operations the file store needs, behind one seam so tests can fail them.
//!
//! Each operation is a whole durable step as the store uses it (append *and* fsync,
//! write *and* fsync), because that is what the store's guarantees are stated in: a
//! test that fails "the fsync of this append" fails this one call. [`RealFs`] is the
//! operating system; `sim::SimFs` (feature `fault-injection`) is a simulated disk
//! that can fail, fill up or crash at any operation.
//!
//! What every implementation promises, and what the store assumes of it:
//! - after an `Ok` from [`Fs::append_sync`], [`Fs::write_sync`] or [`Fs::truncate_sync`]
//!   the file's content survives a crash;
//! - after an error from them, the file may hold any prefix of what was asked, durable
//!   or not, and (as Linux does after a failed writeback) bytes that were read back
//!   from the cache may be gone after a crash even if a later fsync succeeds: only
//!   rewriting them makes them durable;
//! - a rename is atomic, and durable once [`Fs::sync_dir`] on its directory succeeds;
//!   a file created in a directory is durable only after that too.

use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::Path;

/// File operations, each one durable step. See the module docs for the contract.
pub trait Fs: Send + Sync + fmt::Debug + 'static {
    /// Creates `dir` and its parents.
    fn create_dir_all(&self, dir: &Path) -> io::Result<()>;
    /// The whole content of `path`; `NotFound` when there is none.
    fn read(&self, path: &Path) -> io::Result<Vec<u8>>;
    /// The length of `path`; `NotFound` when there is none.
    fn len(&self, path: &Path) -> io::Result<u64>;
    /// Appends `bytes` (creating the file if missing) and fsyncs its data.
    fn append_sync(&self, path: &Path, bytes: &[u8]) -> io::Result<()>;
    /// Creates or replaces the content of `path` with `bytes` and fsyncs it.
    fn write_sync(&self, path: &Path, bytes: &[u8]) -> io::Result<()>;
    /// Cuts `path` to `len` bytes and fsyncs it.
    fn truncate_sync(&self, path: &Path, len: u64) -> io::Result<()>;
    /// Renames `from` to `to`, replacing `to`, atomically.
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// Makes the directory's entries (creations, renames) durable.
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
}

/// The operating system's filesystem.
#[derive(Debug, Clone, Copy, Default)]
pub struct RealFs;

impl Fs for RealFs {
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        fs::create_dir_all(dir)
    }

    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        fs::read(path)
    }

    fn len(&self, path: &Path) -> io::Result<u64> {
        fs::metadata(path).map(|m| m.len())
    }

    fn append_sync(&self, path: &Path, bytes: &[u8]) -> io::Result<()> {
        // The fsync goes through the descriptor that wrote: a writeback error is
        // reported to the descriptors open when it happened.
        let mut file = OpenOptions::new().create(true).append(true).open(path)?;
        file.write_all(bytes)?;
        file.sync_data()
    }

    fn write_sync(&self, path: &Path, bytes: &[u8]) -> io::Result<()> {
        let mut file = File::create(path)?;
        file.write_all(bytes)?;
        file.sync_all()
    }

    fn truncate_sync(&self, path: &Path, len: u64) -> io::Result<()> {
        let file = OpenOptions::new().write(true).open(path)?;
        file.set_len(len)?;
        file.sync_all()
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        fs::rename(from, to)
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        File::open(dir)?.sync_all()
    }
}
