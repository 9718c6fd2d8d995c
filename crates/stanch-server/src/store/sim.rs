//! A simulated disk for fault injection: every [`Fs`] operation can be made to fail,
//! fail part-way, lose its fsync, or crash the "process", and the disk can fill up.
//!
//! It keeps, per file, what a reader sees (the page cache) apart from what survives a
//! crash (the durable image), and per directory which entries are durable, so a test
//! can ask "what is on the disk after a power cut here?" ([`SimFs::restarted`]).
//!
//! What it models, after Linux with ext4 or xfs:
//! - data is durable only after a successful fsync of it; before that, a crash may or
//!   may not have written it back ([`Writeback`] says which a restart assumes);
//! - a failed fsync keeps the data readable but loses it for good: the dirty pages are
//!   marked clean, so a later successful fsync does not make those bytes durable
//!   (they read back as zeros after a crash) unless they are written again;
//! - a write on a full disk writes what fits and fails with `StorageFull`;
//! - creating or renaming a file is durable only after an fsync of its directory.
//!
//! Where it simplifies: directories are durable as soon as they are created; there are
//! no hard links, permissions or short reads; writeback at a crash is all-or-nothing
//! per file, not per page.

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use super::fs::Fs;

/// What an operation does instead of succeeding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Fails with an I/O error before doing anything.
    Fail,
    /// Writes the first `per_mille`/1000 of its bytes, then fails as a full disk does.
    Partial {
        /// How much of the write reaches the file, in thousandths.
        per_mille: u16,
    },
    /// The write reaches the cache whole, but its fsync fails and loses it (see the
    /// module docs).
    SyncFails,
    /// The process dies during the operation, after `per_mille`/1000 of its bytes
    /// reached the cache; every later operation fails.
    Crash {
        /// How much of the write reaches the cache, in thousandths.
        per_mille: u16,
    },
}

/// What had reached the disk at a crash, beyond what was fsynced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Writeback {
    /// Nothing: only fsynced data and directory entries survive.
    None,
    /// Everything the cache held, except bytes whose fsync failed.
    All,
    /// Each file and entry one way or the other, chosen from the seed.
    Mixed(u64),
}

/// The simulated disk. Clones share it.
#[derive(Debug, Clone, Default)]
pub struct SimFs {
    disk: Arc<Mutex<Disk>>,
}

#[derive(Debug, Default)]
struct Disk {
    names: BTreeMap<PathBuf, usize>,
    durable_names: BTreeMap<PathBuf, usize>,
    inodes: Vec<Inode>,
    dirs: BTreeSet<PathBuf>,
    capacity: Option<u64>,
    faults: BTreeMap<u64, Fault>,
    ops: u64,
    crashed: bool,
    trace: Vec<String>,
}

#[derive(Debug, Default, Clone)]
struct Inode {
    /// What a reader sees.
    data: Vec<u8>,
    /// What survives a crash if nothing more is written back.
    durable: Vec<u8>,
    /// The first byte written since the last fsync; bytes from here on are dirty.
    /// A failed fsync marks them clean without writing them, as Linux does.
    dirty_from: Option<usize>,
}

impl Inode {
    /// What survives a crash if the dirty bytes were written back.
    fn cache_image(&self) -> Vec<u8> {
        let dirty = self.dirty_from.unwrap_or(usize::MAX);
        (0..self.data.len())
            .map(|i| {
                if i >= dirty {
                    self.data[i]
                } else {
                    self.durable.get(i).copied().unwrap_or(0)
                }
            })
            .collect()
    }

    fn sync(&mut self) {
        self.durable = self.cache_image();
        self.dirty_from = None;
    }

    /// A failed fsync: the dirty bytes are lost, and no longer dirty.
    fn lose_dirty(&mut self) {
        self.dirty_from = None;
    }

    fn mark_dirty(&mut self, from: usize) {
        self.dirty_from = Some(self.dirty_from.map_or(from, |d| d.min(from)));
    }

    fn append(&mut self, bytes: &[u8]) {
        self.mark_dirty(self.data.len());
        self.data.extend_from_slice(bytes);
    }

    fn set_len(&mut self, len: usize) {
        if len > self.data.len() {
            self.mark_dirty(self.data.len());
        }
        self.data.resize(len, 0);
    }
}

fn eio(what: &str) -> io::Error {
    io::Error::other(format!("simulated I/O error: {what}"))
}

fn no_space() -> io::Error {
    io::Error::new(
        io::ErrorKind::StorageFull,
        "simulated: no space left on device",
    )
}

fn crashed() -> io::Error {
    io::Error::other("simulated: the process has crashed")
}

fn not_found(path: &Path) -> io::Error {
    io::Error::new(
        io::ErrorKind::NotFound,
        format!("simulated: {} not found", path.display()),
    )
}

fn portion(len: usize, per_mille: u16) -> usize {
    len * usize::from(per_mille.min(1000)) / 1000
}

/// A deterministic choice from a seed and a key.
fn coin(seed: u64, key: &[u8]) -> bool {
    let mut bytes = seed.to_le_bytes().to_vec();
    bytes.extend_from_slice(key);
    stanch_api::hash::fnv64(&bytes) & 1 == 1
}

impl SimFs {
    /// An empty disk with no faults and no size limit.
    pub fn new() -> SimFs {
        SimFs::default()
    }

    fn disk(&self) -> MutexGuard<'_, Disk> {
        self.disk.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Makes operation number `op` (counting from 0, every call counts) fail as `fault`.
    pub fn fail_at(&self, op: u64, fault: Fault) {
        self.disk().faults.insert(op, fault);
    }

    /// Limits the bytes all files may hold together; `None` lifts the limit.
    pub fn set_capacity(&self, bytes: Option<u64>) {
        self.disk().capacity = bytes;
    }

    /// The bytes all files hold together, as [`SimFs::set_capacity`] counts them.
    pub fn used(&self) -> u64 {
        self.disk().used()
    }

    /// Operations done so far.
    pub fn ops(&self) -> u64 {
        self.disk().ops
    }

    /// Whether the process has crashed (by a [`Fault::Crash`] or [`SimFs::crash`]).
    pub fn has_crashed(&self) -> bool {
        self.disk().crashed
    }

    /// Crashes the process now: every later operation fails.
    pub fn crash(&self) {
        self.disk().crashed = true;
    }

    /// Every operation so far with its fault, for failure messages.
    pub fn trace(&self) -> Vec<String> {
        self.disk().trace.clone()
    }

    /// What a reader sees of `path` now.
    pub fn contents(&self, path: &Path) -> Option<Vec<u8>> {
        let disk = self.disk();
        disk.names.get(path).map(|&i| disk.inodes[i].data.clone())
    }

    /// Replaces the content of `path`, durably, outside the fault plan: to plant
    /// corrupt files.
    pub fn plant(&self, path: &Path, bytes: &[u8]) {
        let mut disk = self.disk();
        let ino = disk.inode_for(path);
        let inode = &mut disk.inodes[ino];
        inode.data = bytes.to_vec();
        inode.sync();
        disk.durable_names.insert(path.to_owned(), ino);
    }

    /// The disk after the machine lost power now, as the next process finds it: no
    /// faults, no size limit, nothing crashed.
    pub fn restarted(&self, writeback: Writeback) -> SimFs {
        let disk = self.disk();
        let take_cache = |key: &[u8]| match writeback {
            Writeback::None => false,
            Writeback::All => true,
            Writeback::Mixed(seed) => coin(seed, key),
        };
        let mut names = BTreeMap::new();
        let paths: BTreeSet<&PathBuf> =
            disk.names.keys().chain(disk.durable_names.keys()).collect();
        for path in paths {
            let key = path.as_os_str().as_encoded_bytes();
            let entry = if take_cache(&[key, b"/entry"].concat()) {
                disk.names.get(path)
            } else {
                disk.durable_names.get(path)
            };
            if let Some(&ino) = entry {
                names.insert(path.clone(), ino);
            }
        }
        let mut inodes = Vec::new();
        let mut renamed = BTreeMap::new();
        for (path, ino) in names {
            let inode = &disk.inodes[ino];
            let key = [path.as_os_str().as_encoded_bytes(), b"/data"].concat();
            let image = if take_cache(&key) {
                inode.cache_image()
            } else {
                inode.durable.clone()
            };
            renamed.insert(path, inodes.len());
            inodes.push(Inode {
                data: image.clone(),
                durable: image,
                ..Inode::default()
            });
        }
        SimFs {
            disk: Arc::new(Mutex::new(Disk {
                durable_names: renamed.clone(),
                names: renamed,
                inodes,
                dirs: disk.dirs.clone(),
                ..Disk::default()
            })),
        }
    }
}

impl Disk {
    /// Counts an operation and returns its planned fault.
    fn begin(&mut self, what: &str, path: &Path) -> io::Result<Option<Fault>> {
        if self.crashed {
            return Err(crashed());
        }
        let op = self.ops;
        self.ops += 1;
        let fault = self.faults.remove(&op);
        let note = fault.map_or(String::new(), |f| format!(" [{f:?}]"));
        self.trace
            .push(format!("{op}: {what} {}{note}", path.display()));
        if fault == Some(Fault::Fail) {
            return Err(eio(what));
        }
        Ok(fault)
    }

    fn used(&self) -> u64 {
        self.names
            .values()
            .map(|&i| self.inodes[i].data.len() as u64)
            .sum()
    }

    fn room(&self) -> usize {
        self.capacity.map_or(usize::MAX, |c| {
            usize::try_from(c.saturating_sub(self.used())).unwrap_or(usize::MAX)
        })
    }

    fn parent_exists(&self, path: &Path) -> bool {
        path.parent()
            .is_none_or(|p| p.as_os_str().is_empty() || self.dirs.contains(p))
    }

    fn inode_for(&mut self, path: &Path) -> usize {
        if let Some(&ino) = self.names.get(path) {
            return ino;
        }
        self.inodes.push(Inode::default());
        let ino = self.inodes.len() - 1;
        self.names.insert(path.to_owned(), ino);
        ino
    }

    /// Writes `bytes` at the end of `ino` as far as the fault and the space allow,
    /// then fsyncs it unless the fault says otherwise.
    fn write(&mut self, ino: usize, bytes: &[u8], fault: Option<Fault>) -> io::Result<()> {
        let mut n = bytes.len();
        let mut error = None;
        if let Some(Fault::Partial { per_mille }) = fault {
            n = portion(n, per_mille);
            error = Some(no_space());
        }
        if let Some(Fault::Crash { per_mille }) = fault {
            n = portion(n, per_mille);
        }
        let room = self.room();
        if n > room {
            n = room;
            error = Some(no_space());
        }
        self.inodes[ino].append(&bytes[..n]);
        if matches!(fault, Some(Fault::Crash { .. })) {
            self.crashed = true;
            return Err(crashed());
        }
        if let Some(e) = error {
            return Err(e);
        }
        self.finish_sync(ino, fault)
    }

    fn finish_sync(&mut self, ino: usize, fault: Option<Fault>) -> io::Result<()> {
        if fault == Some(Fault::SyncFails) {
            self.inodes[ino].lose_dirty();
            return Err(eio("fsync"));
        }
        self.inodes[ino].sync();
        Ok(())
    }

    fn crash_if(&mut self, fault: Option<Fault>) -> io::Result<()> {
        if matches!(fault, Some(Fault::Crash { .. })) {
            self.crashed = true;
            return Err(crashed());
        }
        Ok(())
    }
}

impl Fs for SimFs {
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        let mut disk = self.disk();
        let fault = disk.begin("create_dir_all", dir)?;
        disk.crash_if(fault)?;
        for d in dir.ancestors() {
            if !d.as_os_str().is_empty() {
                disk.dirs.insert(d.to_owned());
            }
        }
        Ok(())
    }

    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        let mut disk = self.disk();
        let fault = disk.begin("read", path)?;
        disk.crash_if(fault)?;
        match disk.names.get(path) {
            Some(&ino) => Ok(disk.inodes[ino].data.clone()),
            None => Err(not_found(path)),
        }
    }

    fn len(&self, path: &Path) -> io::Result<u64> {
        let mut disk = self.disk();
        let fault = disk.begin("len", path)?;
        disk.crash_if(fault)?;
        match disk.names.get(path) {
            Some(&ino) => Ok(disk.inodes[ino].data.len() as u64),
            None => Err(not_found(path)),
        }
    }

    fn append_sync(&self, path: &Path, bytes: &[u8]) -> io::Result<()> {
        let mut disk = self.disk();
        let fault = disk.begin("append_sync", path)?;
        if !disk.parent_exists(path) {
            return Err(not_found(path));
        }
        let ino = disk.inode_for(path);
        disk.write(ino, bytes, fault)
    }

    fn write_sync(&self, path: &Path, bytes: &[u8]) -> io::Result<()> {
        let mut disk = self.disk();
        let fault = disk.begin("write_sync", path)?;
        if !disk.parent_exists(path) {
            return Err(not_found(path));
        }
        let ino = disk.inode_for(path);
        disk.inodes[ino].set_len(0);
        disk.write(ino, bytes, fault)
    }

    fn truncate_sync(&self, path: &Path, len: u64) -> io::Result<()> {
        let mut disk = self.disk();
        let fault = disk.begin("truncate_sync", path)?;
        let Some(&ino) = disk.names.get(path) else {
            return Err(not_found(path));
        };
        let len = usize::try_from(len).map_err(|_| no_space())?;
        disk.inodes[ino].set_len(len);
        disk.crash_if(fault)?;
        disk.finish_sync(ino, fault)
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let mut disk = self.disk();
        let fault = disk.begin("rename", from)?;
        let Some(ino) = disk.names.remove(from) else {
            return Err(not_found(from));
        };
        disk.names.insert(to.to_owned(), ino);
        disk.crash_if(fault)
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        let mut disk = self.disk();
        let fault = disk.begin("sync_dir", dir)?;
        disk.crash_if(fault)?;
        if fault == Some(Fault::SyncFails) {
            return Err(eio("fsync of a directory"));
        }
        let in_dir = |p: &Path| p.parent() == Some(dir);
        let Disk {
            names,
            durable_names,
            ..
        } = &mut *disk;
        durable_names.retain(|p, _| !in_dir(p) || names.contains_key(p));
        for (p, &ino) in names.iter().filter(|(p, _)| in_dir(p)) {
            durable_names.insert(p.clone(), ino);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir() -> (SimFs, PathBuf) {
        let fs = SimFs::new();
        let dir = PathBuf::from("/data");
        fs.create_dir_all(&dir).unwrap();
        (fs, dir)
    }

    #[test]
    fn only_synced_data_and_entries_survive_without_writeback() {
        let (fs, dir) = dir();
        let f = dir.join("a");
        fs.append_sync(&f, b"one\n").unwrap();
        // Created but its directory never synced: gone after a power cut.
        assert!(fs.restarted(Writeback::None).contents(&f).is_none());
        fs.sync_dir(&dir).unwrap();
        fs.fail_at(fs.ops(), Fault::Partial { per_mille: 500 });
        assert!(fs.append_sync(&f, b"two\n").is_err());
        assert_eq!(fs.contents(&f).unwrap(), b"one\ntw");
        assert_eq!(
            fs.restarted(Writeback::None).contents(&f).unwrap(),
            b"one\n"
        );
        assert_eq!(
            fs.restarted(Writeback::All).contents(&f).unwrap(),
            b"one\ntw"
        );
    }

    #[test]
    fn a_failed_fsync_loses_its_bytes_even_after_a_later_fsync() {
        let (fs, dir) = dir();
        let f = dir.join("a");
        fs.append_sync(&f, b"one\n").unwrap();
        fs.sync_dir(&dir).unwrap();
        fs.fail_at(fs.ops(), Fault::SyncFails);
        assert!(fs.append_sync(&f, b"two\n").is_err());
        fs.append_sync(&f, b"three\n").unwrap();
        assert_eq!(fs.contents(&f).unwrap(), b"one\ntwo\nthree\n");
        assert_eq!(
            fs.restarted(Writeback::None).contents(&f).unwrap(),
            b"one\n\0\0\0\0three\n"
        );
        // Cutting the lost bytes off and writing them again makes them durable.
        fs.fail_at(fs.ops(), Fault::SyncFails);
        assert!(fs.append_sync(&f, b"four\n").is_err());
        fs.truncate_sync(&f, 14).unwrap();
        fs.append_sync(&f, b"four\n").unwrap();
        assert_eq!(
            fs.restarted(Writeback::None).contents(&f).unwrap(),
            b"one\n\0\0\0\0three\nfour\n"
        );
    }

    #[test]
    fn a_full_disk_writes_what_fits() {
        let (fs, dir) = dir();
        let f = dir.join("a");
        fs.set_capacity(Some(6));
        let err = fs.append_sync(&f, b"0123456789").unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::StorageFull);
        assert_eq!(fs.contents(&f).unwrap(), b"012345");
        fs.set_capacity(None);
        fs.append_sync(&f, b"6").unwrap();
    }

    #[test]
    fn a_rename_is_durable_after_its_directory_is_synced() {
        let (fs, dir) = dir();
        let (tmp, f) = (dir.join("t"), dir.join("f"));
        fs.write_sync(&f, b"old").unwrap();
        fs.sync_dir(&dir).unwrap();
        fs.write_sync(&tmp, b"new").unwrap();
        fs.rename(&tmp, &f).unwrap();
        assert_eq!(fs.contents(&f).unwrap(), b"new");
        assert_eq!(fs.restarted(Writeback::None).contents(&f).unwrap(), b"old");
        fs.sync_dir(&dir).unwrap();
        let after = fs.restarted(Writeback::None);
        assert_eq!(after.contents(&f).unwrap(), b"new");
        assert!(after.contents(&tmp).is_none());
    }

    #[test]
    fn a_crash_stops_every_later_operation() {
        let (fs, dir) = dir();
        let f = dir.join("a");
        fs.fail_at(fs.ops(), Fault::Crash { per_mille: 1000 });
        assert!(fs.append_sync(&f, b"x").is_err());
        assert!(fs.has_crashed());
        assert!(fs.read(&f).is_err());
        assert_eq!(fs.trace().len(), 2, "{:?}", fs.trace());
    }
}
