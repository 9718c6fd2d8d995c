//! The file store: a snapshot and a journal under the data directory.
//!
//! - `state.json`: the snapshot, replaced atomically (write and fsync a temporary
//!   file, rename it over, fsync the directory);
//! - `journal.jsonl`: one JSON record per line, appended and fsynced per commit.
//!
//! The journal's good length (every byte of it whole, synced records) is kept in
//! memory. An append that fails is cut back to exactly that length, never to a length
//! computed from what the failed write may have written, so a partial write on a full
//! disk cannot reach into records already acknowledged. If the cut itself fails, the
//! next append makes it first and writes nothing until it succeeds.
//!
//! Reading back at start works on bytes, not text: a torn last line (a crash
//! mid-append, never acknowledged) is dropped whatever bytes it holds, including half
//! a UTF-8 character. Any other unreadable content is moved aside and the controller
//! starts a new epoch. Records are replayed in increasing `seq`; one whose `seq` is not
//! above the one before (a batch written twice) is skipped.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use stanch_core::EngineState;

use super::fs::{Fs, RealFs};
use stanch_ports::store::{Loaded, Record, StateStore, StoreError};

#[derive(Serialize, Deserialize)]
struct SnapshotFile {
    /// The format, so a future layout can be told apart.
    format: u32,
    seq: u64,
    state: EngineState,
}

const FORMAT: u32 = 1;
const SNAPSHOT: &str = "state.json";
const SNAPSHOT_TMP: &str = "state.json.tmp";
const JOURNAL: &str = "journal.jsonl";

/// The journal is never compacted below this many bytes, so that a small state is not
/// snapshotted at every commit.
pub const JOURNAL_MIN_BYTES: u64 = 16 << 20;

/// The file store. See the module docs for the layout.
#[derive(Debug)]
pub struct FileStore {
    fs: Arc<dyn Fs>,
    dir: PathBuf,
    tag: String,
    /// The journal's length known to be whole and durable; `None` until read.
    good_len: Option<u64>,
    /// The journal may hold bytes past `good_len` (a failed append or cut): they are
    /// cut off before anything else is appended.
    dirty: bool,
    /// Whether the journal's directory entry is known to be durable.
    entry_durable: bool,
    /// The size of the last snapshot read or written, which the journal's is held to.
    snapshot_len: u64,
}

impl FileStore {
    /// A store under `dir` on the real filesystem, created if missing. `tag` names
    /// moved-aside files (`state.json.corrupt-<tag>`); pass something unique such as
    /// the start time.
    pub fn open(dir: impl Into<PathBuf>, tag: impl Into<String>) -> Result<FileStore, StoreError> {
        FileStore::open_on(Arc::new(RealFs), dir, tag)
    }

    /// The same on any [`Fs`]: a simulated disk in fault-injection tests.
    pub fn open_on(
        fs: Arc<dyn Fs>,
        dir: impl Into<PathBuf>,
        tag: impl Into<String>,
    ) -> Result<FileStore, StoreError> {
        let dir = dir.into();
        fs.create_dir_all(&dir)
            .map_err(|source| StoreError::OpenDir {
                path: dir.clone(),
                source,
            })?;
        Ok(FileStore {
            fs,
            dir,
            tag: tag.into(),
            good_len: None,
            dirty: false,
            entry_durable: false,
            snapshot_len: 0,
        })
    }

    /// The data directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Moves an unreadable file aside (durably), so the new epoch does not write
    /// after it and a human can look at it.
    fn move_aside(&self, name: &str) -> Result<String, StoreError> {
        let path = self.path(name);
        let aside = self.path(&format!("{name}.corrupt-{}", self.tag));
        let load = |source| StoreError::Load {
            path: path.clone(),
            source,
        };
        self.fs.rename(&path, &aside).map_err(load)?;
        self.fs.sync_dir(&self.dir).map_err(load)?;
        Ok(aside.display().to_string())
    }

    /// Reads the journal, cutting a torn final line off. Returns the records, or a
    /// description of the first unreadable line.
    fn read_journal(&mut self) -> Result<Result<Vec<Record>, String>, StoreError> {
        let path = self.path(JOURNAL);
        let bytes = match self.fs.read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                self.good_len = Some(0);
                self.entry_durable = false;
                return Ok(Ok(Vec::new()));
            }
            Err(source) => return Err(StoreError::Load { path, source }),
        };
        self.entry_durable = true;
        let parsed = parse_journal(&bytes);
        if let Ok((_, good)) = &parsed {
            self.good_len = Some(*good);
            if *good < bytes.len() as u64 {
                // The last line, cut short by a crash: it was never acknowledged. If
                // the cut fails now, the first append makes it.
                self.dirty = self.fs.truncate_sync(&path, *good).is_err();
            }
        }
        Ok(parsed
            .map(|(records, _)| records)
            .map_err(|what| format!("{} {what}", path.display())))
    }

    fn read_snapshot(&mut self) -> Result<Result<Option<(EngineState, u64)>, String>, StoreError> {
        let path = self.path(SNAPSHOT);
        let bytes = match self.fs.read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Ok(None)),
            Err(source) => return Err(StoreError::Load { path, source }),
        };
        self.snapshot_len = bytes.len() as u64;
        Ok(match serde_json::from_slice::<SnapshotFile>(&bytes) {
            Ok(file) if file.format == FORMAT => Ok(Some((file.state, file.seq))),
            Ok(file) => Err(format!("snapshot format {} is not {FORMAT}", file.format)),
            Err(e) => Err(format!("snapshot unreadable ({e})")),
        })
    }

    /// Cuts the journal back to its good length if a failure left more.
    fn repair(&mut self, path: &Path) -> Result<u64, std::io::Error> {
        let good = match self.good_len {
            Some(len) => len,
            None => match self.fs.len(path) {
                Ok(len) => len,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
                Err(e) => return Err(e),
            },
        };
        self.good_len = Some(good);
        if self.dirty {
            match self.fs.truncate_sync(path, good) {
                Ok(()) => {}
                // No journal at all: nothing to cut; the next append creates it.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    self.good_len = Some(0);
                    self.entry_durable = false;
                }
                Err(e) => return Err(e),
            }
            self.dirty = false;
        }
        Ok(self.good_len.unwrap_or(good))
    }
}

/// Splits a journal into records. `Ok` carries the records and the length of the whole
/// lines; `Err` says which complete line is unreadable. Never fails on a torn last line.
fn parse_journal(bytes: &[u8]) -> Result<(Vec<Record>, u64), String> {
    let mut records: Vec<Record> = Vec::new();
    let mut good = 0usize;
    for (index, line) in bytes.split_inclusive(|&b| b == b'\n').enumerate() {
        let Some(body) = line.strip_suffix(b"\n") else {
            break; // Torn: no newline yet.
        };
        let record: Record =
            serde_json::from_slice(body).map_err(|e| format!("line {}: {e}", index + 1))?;
        good += line.len();
        if records.last().is_some_and(|last| record.seq <= last.seq) {
            continue; // Written twice after a failure that was not cut off in time.
        }
        records.push(record);
    }
    Ok((records, good as u64))
}

impl StateStore for FileStore {
    fn kind(&self) -> &'static str {
        "file"
    }

    fn load(&mut self) -> Result<Loaded, StoreError> {
        let snapshot = self.read_snapshot()?;
        let journal = self.read_journal()?;
        let mut corruption = Vec::new();
        let (snapshot, journal) = match (snapshot, journal) {
            (Ok(snapshot), Ok(journal)) => (snapshot, journal),
            (snapshot, journal) => {
                // Half a history is worse than none: move both aside and start over
                // under a new epoch.
                for (name, problem, present) in [
                    (
                        SNAPSHOT,
                        snapshot.as_ref().err(),
                        matches!(snapshot, Ok(Some(_)) | Err(_)),
                    ),
                    (JOURNAL, journal.as_ref().err(), self.entry_durable),
                ] {
                    if !present {
                        continue;
                    }
                    let aside = self.move_aside(name)?;
                    corruption.push(match problem {
                        Some(what) => format!("{what}; moved to {aside}"),
                        None => format!("{name} moved to {aside} with it"),
                    });
                }
                self.good_len = Some(0);
                self.dirty = false;
                self.entry_durable = false;
                return Ok(Loaded {
                    snapshot: None,
                    journal: Vec::new(),
                    corruption: Some(corruption.join("; ")),
                });
            }
        };
        let covered = snapshot.as_ref().map_or(0, |(_, seq)| *seq);
        let journal = journal.into_iter().filter(|r| r.seq > covered).collect();
        Ok(Loaded {
            snapshot,
            journal,
            corruption: None,
        })
    }

    fn prefers_snapshot(&self, _: &[Record]) -> bool {
        self.good_len.unwrap_or(0) > JOURNAL_MIN_BYTES.max(self.snapshot_len.saturating_mul(2))
    }

    fn append(&mut self, records: &[Record]) -> Result<(), StoreError> {
        if records.is_empty() {
            return Ok(());
        }
        let mut buf = Vec::with_capacity(records.len() * 256);
        for record in records {
            serde_json::to_writer(&mut buf, record).expect("records serialize");
            buf.push(b'\n');
        }
        let path = self.path(JOURNAL);
        let fail = |source| StoreError::Append {
            path: path.clone(),
            source,
        };
        let good = self.repair(&path).map_err(fail)?;
        if let Err(source) = self.fs.append_sync(&path, &buf) {
            // Any prefix of the batch may be in the file, durable or not, and none of
            // it is acknowledged: cut back to what was.
            self.dirty = true;
            let _ = self.repair(&path);
            return Err(fail(source));
        }
        if !self.entry_durable {
            // A new journal file exists only once its directory says so.
            if let Err(source) = self.fs.sync_dir(&self.dir) {
                self.dirty = true;
                let _ = self.repair(&path);
                return Err(fail(source));
            }
            self.entry_durable = true;
        }
        self.good_len = Some(good + buf.len() as u64);
        Ok(())
    }

    fn snapshot(&mut self, state: &EngineState, seq: u64) -> Result<(), StoreError> {
        let path = self.path(SNAPSHOT);
        let tmp = self.path(SNAPSHOT_TMP);
        let err = |source| StoreError::Snapshot {
            path: path.clone(),
            source,
        };
        let body = serde_json::to_vec(&SnapshotFile {
            format: FORMAT,
            seq,
            state: state.clone(),
        })
        .expect("state serializes");
        self.fs.write_sync(&tmp, &body).map_err(err)?;
        self.fs.rename(&tmp, &path).map_err(err)?;
        self.fs.sync_dir(&self.dir).map_err(err)?;
        self.snapshot_len = body.len() as u64;
        // Every journal record is now covered by a durable snapshot. If the cut is
        // lost in a crash, replay skips the covered records by their seq; if it fails
        // now, the next append makes it first.
        let journal = self.path(JOURNAL);
        self.good_len = Some(0);
        self.dirty = false;
        match self.fs.truncate_sync(&journal, 0) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(source) => {
                self.dirty = true;
                Err(err(source))
            }
        }
    }
}

#[cfg(test)]
mod tests;
