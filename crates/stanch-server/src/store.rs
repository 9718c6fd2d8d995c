//! State stores: where the engine's inputs and snapshots survive a restart.
//!
//! The engine is deterministic, so the store keeps a snapshot of its state plus a
//! journal of the inputs applied since; replaying the journal over the snapshot gives
//! back the exact state: rungs, timers, blocks, overrides, alerts, epoch and version.
//! An input is acknowledged only after its journal record is durable.
//!
//! The file store keeps, under the data dir:
//! - `state.json`: the snapshot, replaced atomically (write, fsync, rename, fsync dir);
//! - `journal.jsonl`: one JSON record per line, appended and fsynced per commit.
//!
//! A torn last journal line (a crash mid-write, never acknowledged) is dropped. Any
//! other unreadable content is moved aside and the controller starts a new epoch.

use std::fs::{self, File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use stanch_api::Timestamp;
use stanch_core::{EngineState, Input};

/// One journaled input.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// Position in the journal, increasing across snapshots.
    pub seq: u64,
    /// The time the engine applied it at.
    pub at: Timestamp,
    /// The input.
    pub input: Input,
}

/// What a store holds at start.
#[derive(Debug, Default)]
pub struct Loaded {
    /// The last snapshot and the journal position it covers.
    pub snapshot: Option<(EngineState, u64)>,
    /// Records to replay over it, in order.
    pub journal: Vec<Record>,
    /// Set when unreadable state was moved aside: what happened, for logs and status.
    pub corruption: Option<String>,
}

/// A state store failure.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Creating or opening the data directory failed.
    #[error("cannot open data directory {path}")]
    OpenDir {
        /// The directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Appending to the journal failed.
    #[error("cannot append to the journal {path}")]
    Append {
        /// The journal file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Writing a snapshot failed.
    #[error("cannot write the snapshot {path}")]
    Snapshot {
        /// The snapshot file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Reading state at start failed for a reason other than its content.
    #[error("cannot read state from {path}")]
    Load {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

impl StoreError {
    /// A stable label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            StoreError::OpenDir { .. } => "open_dir",
            StoreError::Append { .. } => "append",
            StoreError::Snapshot { .. } => "snapshot",
            StoreError::Load { .. } => "load",
        }
    }
}

/// Durable storage of the engine's inputs and snapshots.
pub trait StateStore: Send + 'static {
    /// `file` or `memory`.
    fn kind(&self) -> &'static str;
    /// Reads what is stored, moving aside what cannot be read.
    fn load(&mut self) -> Result<Loaded, StoreError>;
    /// Appends records; they are durable when this returns `Ok`.
    fn append(&mut self, records: &[Record]) -> Result<(), StoreError>;
    /// Replaces the snapshot with `state` (covering the journal up to `seq`) and
    /// drops the journal records it covers.
    fn snapshot(&mut self, state: &EngineState, seq: u64) -> Result<(), StoreError>;
}

/// Keeps everything in memory: for tests and throwaway runs. Nothing survives a restart.
#[derive(Debug, Default)]
pub struct MemoryStore {
    snapshot: Option<(EngineState, u64)>,
    journal: Vec<Record>,
}

impl StateStore for MemoryStore {
    fn kind(&self) -> &'static str {
        "memory"
    }

    fn load(&mut self) -> Result<Loaded, StoreError> {
        Ok(Loaded {
            snapshot: self.snapshot.clone(),
            journal: self.journal.clone(),
            corruption: None,
        })
    }

    fn append(&mut self, records: &[Record]) -> Result<(), StoreError> {
        self.journal.extend_from_slice(records);
        Ok(())
    }

    fn snapshot(&mut self, state: &EngineState, seq: u64) -> Result<(), StoreError> {
        self.snapshot = Some((state.clone(), seq));
        self.journal.retain(|r| r.seq > seq);
        Ok(())
    }
}

#[derive(Serialize, Deserialize)]
struct SnapshotFile {
    /// The format, so a future layout can be told apart.
    format: u32,
    seq: u64,
    state: EngineState,
}

const FORMAT: u32 = 1;

/// The file store. See the module docs for the layout.
#[derive(Debug)]
pub struct FileStore {
    dir: PathBuf,
    journal: Option<File>,
    clock_tag: String,
}

impl FileStore {
    /// A store under `dir`, created if missing. `tag` names moved-aside files
    /// (`state.json.corrupt-<tag>`); pass something unique such as the start time.
    pub fn open(dir: impl Into<PathBuf>, tag: impl Into<String>) -> Result<FileStore, StoreError> {
        let dir = dir.into();
        fs::create_dir_all(&dir).map_err(|source| StoreError::OpenDir {
            path: dir.clone(),
            source,
        })?;
        Ok(FileStore {
            dir,
            journal: None,
            clock_tag: tag.into(),
        })
    }

    /// The data directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn snapshot_path(&self) -> PathBuf {
        self.dir.join("state.json")
    }

    fn journal_path(&self) -> PathBuf {
        self.dir.join("journal.jsonl")
    }

    fn move_aside(&self, path: &Path) -> String {
        let aside = path.with_extension(format!("{}.corrupt-{}", extension(path), self.clock_tag));
        match fs::rename(path, &aside) {
            Ok(()) => aside.display().to_string(),
            Err(e) => format!("(could not move it aside: {e})"),
        }
    }

    fn journal_file(&mut self) -> Result<&mut File, StoreError> {
        if self.journal.is_none() {
            let path = self.journal_path();
            let file = OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .map_err(|source| StoreError::Append { path, source })?;
            self.journal = Some(file);
        }
        Ok(self.journal.as_mut().expect("just opened"))
    }

    /// Reads the journal, dropping a torn final line. Returns the records, or a
    /// description of the first unreadable line.
    fn read_journal(&self) -> Result<Result<Vec<Record>, String>, StoreError> {
        let path = self.journal_path();
        let file = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Ok(Vec::new())),
            Err(source) => return Err(StoreError::Load { path, source }),
        };
        let mut records = Vec::new();
        let mut good_len: u64 = 0;
        let mut reader = BufReader::new(file);
        let mut line = String::new();
        let mut number = 0;
        loop {
            line.clear();
            let n = reader
                .read_line(&mut line)
                .map_err(|source| StoreError::Load {
                    path: path.clone(),
                    source,
                })?;
            if n == 0 {
                break;
            }
            number += 1;
            let complete = line.ends_with('\n');
            match serde_json::from_str::<Record>(line.trim_end()) {
                Ok(record) if complete => {
                    records.push(record);
                    good_len += n as u64;
                }
                // The last line, cut short by a crash: it was never acknowledged.
                _ if !complete => {
                    truncate(&path, good_len).map_err(|source| StoreError::Load {
                        path: path.clone(),
                        source,
                    })?;
                    break;
                }
                Ok(_) => unreachable!("complete handled above"),
                Err(e) => return Ok(Err(format!("{} line {number}: {e}", path.display()))),
            }
        }
        Ok(Ok(records))
    }
}

fn extension(path: &Path) -> String {
    path.extension()
        .map(|e| e.to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn truncate(path: &Path, len: u64) -> std::io::Result<()> {
    let file = OpenOptions::new().write(true).open(path)?;
    file.set_len(len)?;
    file.sync_all()
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

impl StateStore for FileStore {
    fn kind(&self) -> &'static str {
        "file"
    }

    fn load(&mut self) -> Result<Loaded, StoreError> {
        let snapshot_path = self.snapshot_path();
        let mut corruption = Vec::new();
        let snapshot = match fs::read(&snapshot_path) {
            Ok(bytes) => match serde_json::from_slice::<SnapshotFile>(&bytes) {
                Ok(file) if file.format == FORMAT => Some((file.state, file.seq)),
                Ok(file) => {
                    let aside = self.move_aside(&snapshot_path);
                    corruption.push(format!(
                        "snapshot format {} is not {FORMAT}; moved to {aside}",
                        file.format
                    ));
                    None
                }
                Err(e) => {
                    let aside = self.move_aside(&snapshot_path);
                    corruption.push(format!("snapshot unreadable ({e}); moved to {aside}"));
                    None
                }
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(source) => {
                return Err(StoreError::Load {
                    path: snapshot_path,
                    source,
                });
            }
        };
        let journal = match self.read_journal()? {
            Ok(records) => records,
            Err(what) => {
                let aside = self.move_aside(&self.journal_path());
                corruption.push(format!("journal unreadable ({what}); moved to {aside}"));
                Vec::new()
            }
        };
        if !corruption.is_empty() {
            // Half a history is worse than none: start over under a new epoch.
            if snapshot.is_some() {
                let aside = self.move_aside(&snapshot_path);
                corruption.push(format!("snapshot moved to {aside} with it"));
            }
            if !journal.is_empty() {
                let aside = self.move_aside(&self.journal_path());
                corruption.push(format!("journal moved to {aside} with it"));
            }
            return Ok(Loaded {
                snapshot: None,
                journal: Vec::new(),
                corruption: Some(corruption.join("; ")),
            });
        }
        let covered = snapshot.as_ref().map_or(0, |(_, seq)| *seq);
        let journal = journal.into_iter().filter(|r| r.seq > covered).collect();
        Ok(Loaded {
            snapshot,
            journal,
            corruption: None,
        })
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
        let path = self.journal_path();
        let file = self.journal_file()?;
        let result = file.write_all(&buf).and_then(|()| file.sync_data());
        if let Err(source) = result {
            // A partial write leaves a torn line; reopen so the next append starts clean.
            self.journal = None;
            if let Ok(meta) = fs::metadata(&path) {
                let len = meta.len().saturating_sub(buf.len() as u64);
                let _ = truncate(&path, len);
            }
            return Err(StoreError::Append { path, source });
        }
        Ok(())
    }

    fn snapshot(&mut self, state: &EngineState, seq: u64) -> Result<(), StoreError> {
        let path = self.snapshot_path();
        let tmp = path.with_extension("json.tmp");
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
        let mut file = File::create(&tmp).map_err(err)?;
        file.write_all(&body)
            .and_then(|()| file.sync_all())
            .map_err(err)?;
        fs::rename(&tmp, &path).map_err(err)?;
        sync_dir(&self.dir).map_err(err)?;
        // Every journal record is now covered by the snapshot. If the truncation is
        // lost in a crash, replay skips the covered records by their seq.
        self.journal = None;
        truncate(&self.journal_path(), 0)
            .or_else(|e| match e.kind() {
                std::io::ErrorKind::NotFound => Ok(()),
                _ => Err(e),
            })
            .map_err(err)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stanch_core::Engine;

    fn record(seq: u64) -> Record {
        Record {
            seq,
            at: Timestamp(seq as i64),
            input: Input::Tick,
        }
    }

    #[test]
    fn journal_and_snapshot_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = FileStore::open(dir.path(), "t").unwrap();
        store.append(&[record(1), record(2)]).unwrap();
        let state = Engine::fresh_state("e1".into(), Timestamp(0));
        store.snapshot(&state, 2).unwrap();
        store.append(&[record(3)]).unwrap();
        let loaded = FileStore::open(dir.path(), "t").unwrap().load().unwrap();
        assert_eq!(loaded.snapshot.unwrap().1, 2);
        assert_eq!(loaded.journal, vec![record(3)]);
        assert!(loaded.corruption.is_none());
    }

    #[test]
    fn torn_last_line_is_dropped_and_truncated() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = FileStore::open(dir.path(), "t").unwrap();
        store.append(&[record(1)]).unwrap();
        let path = dir.path().join("journal.jsonl");
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(br#"{"seq":2,"at":"2026-"#).unwrap();
        let loaded = FileStore::open(dir.path(), "t").unwrap().load().unwrap();
        assert_eq!(loaded.journal, vec![record(1)]);
        assert!(loaded.corruption.is_none());
        let text = fs::read_to_string(&path).unwrap();
        assert!(text.ends_with("}\n"), "torn tail truncated: {text:?}");
    }

    #[test]
    fn corrupt_snapshot_is_moved_aside_and_reported() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("state.json"), b"{ not json").unwrap();
        let loaded = FileStore::open(dir.path(), "t1").unwrap().load().unwrap();
        assert!(loaded.snapshot.is_none());
        let why = loaded.corruption.unwrap();
        assert!(why.contains("snapshot unreadable"), "{why}");
        assert!(dir.path().join("state.json.corrupt-t1").exists());
        assert!(!dir.path().join("state.json").exists());
    }

    #[test]
    fn corrupt_journal_line_in_the_middle_starts_over() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = FileStore::open(dir.path(), "t").unwrap();
        store.append(&[record(1)]).unwrap();
        let path = dir.path().join("journal.jsonl");
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(b"garbage\n").unwrap();
        store.append(&[record(3)]).unwrap();
        let loaded = FileStore::open(dir.path(), "t2").unwrap().load().unwrap();
        assert!(loaded.journal.is_empty());
        assert!(loaded.corruption.unwrap().contains("line 2"));
    }
}
