//! The state store: where the engine's inputs and snapshots survive a restart.
//!
//! The engine is deterministic, so a store keeps a snapshot of its state plus a
//! journal of the inputs applied since; replaying the journal over the snapshot gives
//! back the exact state: rungs, timers, blocks, overrides, alerts, epoch and version.
//! An input is acknowledged only after its journal record is durable.
//!
//! Implementations: [`MemoryStore`] here, the file store in `stanch-server`, the
//! Kubernetes store in `stanch-kube`.

use std::path::PathBuf;

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
    /// Appending to the journal failed; nothing of the batch is acknowledged.
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
    /// A store in a remote service (the Kubernetes API) could not do an operation;
    /// what was durable before still is.
    #[error("cannot {operation} the state object {object}")]
    Remote {
        /// `load`, `append`, `snapshot` or `look`.
        operation: &'static str,
        /// The object it concerns.
        object: String,
        /// The cause.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Another replica took the store over: this one no longer leads and must not
    /// write again until it loads the store anew.
    #[error("the state object {object} was taken over by {holder}")]
    Fenced {
        /// The state object.
        object: String,
        /// The replica that holds it now.
        holder: String,
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
            StoreError::Remote { .. } => "remote",
            StoreError::Fenced { .. } => "fenced",
        }
    }
}

/// Durable storage of the engine's inputs and snapshots.
pub trait StateStore: Send + 'static {
    /// `file`, `memory` or `kubernetes`.
    fn kind(&self) -> &'static str;
    /// Reads what is stored, moving aside what cannot be read.
    fn load(&mut self) -> Result<Loaded, StoreError>;
    /// Appends records; they are durable when this returns `Ok`. On `Err` none of them
    /// is acknowledged, what was durable before still is, and the same records may be
    /// appended again.
    fn append(&mut self, records: &[Record]) -> Result<(), StoreError>;
    /// Replaces the snapshot with `state` (covering the journal up to `seq`) and
    /// drops the journal records it covers. On `Err` the records stay durable in the
    /// journal.
    fn snapshot(&mut self, state: &EngineState, seq: u64) -> Result<(), StoreError>;
    /// Whether this store would rather take a snapshot than `records` in its journal
    /// (its journal is near a size limit): the engine task then writes a snapshot,
    /// which covers them.
    fn prefers_snapshot(&self, records: &[Record]) -> bool {
        let _ = records;
        false
    }
    /// For a replica that follows another's writes: what is stored now if it changed
    /// since the last look, `None` if not. Writes nothing. A store only this process
    /// writes never changes under it.
    fn look(&mut self) -> Result<Option<Loaded>, StoreError> {
        Ok(None)
    }
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
