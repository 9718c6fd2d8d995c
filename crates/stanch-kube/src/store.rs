//! State in the cluster: the [`StateStore`] of `stanch serve --store kubernetes`, in
//! ConfigMaps of the controller's namespace, so that an incident's state outlives the
//! pod, its node and its disk.
//!
//! - **The state object** (`{name}`, e.g. `stanch-state`) holds, under `data`:
//!   `holder`, the replica that wrote it last; `manifest`, the [`Manifest`] of the
//!   snapshot in force; and `journal`, the records since that snapshot, one JSON line
//!   each. Every write of it replaces it whole with the `resourceVersion` it was last
//!   seen at: a write is atomic (it lands whole or not at all, so no torn record
//!   exists), and of two writers, the second fails with `409 Conflict`.
//! - **Journal segments** (`{name}-journal-{seq}-{hash}`): when the journal in the state
//!   object would pass [`JOURNAL_MAX_BYTES`], what it holds moves to a segment of its
//!   own (written first, then named by the state object in the write that appends),
//!   so that a storm costs a small write per commit, not a snapshot of the whole
//!   state; at most [`MAX_SEGMENTS`], then a snapshot is written instead.
//! - **Snapshot shards** (`{name}-{hash}-{seq}-{i}`, labelled `stanch.dev/state`) hold
//!   the snapshot cut into pieces under an object's size limit ([`crate::shards`]).
//!   They are written first; switching the manifest in the state object is the one
//!   atomic step; shards no manifest names are deleted after, or at the next load.
//!
//! **Fencing.** [`StateStore::load`] takes the store over: it writes the state object
//! with this replica as `holder` before reading what it holds, so a write by the
//! replica that led before (paused, partitioned, or not yet aware it lost the lease)
//! fails from then on with `409`. On a `409`, the store reads the object again: held by
//! another, it is [`StoreError::Fenced`] for good (this replica must stop deciding);
//! held by itself, the write that seemed to fail had landed, and the records it holds
//! are not written twice. Besides, nothing is sent unless the guard given at
//! [`KubeStore::new`] says the replica still leads (the Lease, [`crate::lease`]).
//!
//! **Bounds.** The journal in the state object is kept under [`JOURNAL_MAX_BYTES`], in at
//! most [`MAX_SEGMENTS`] segments besides; a batch too large for that is written as a
//! snapshot instead ([`StateStore::prefers_snapshot`]). Every
//! call to the API server is bounded by the timeout given; a timeout or a lost answer
//! leaves the outcome unknown, so the next write reads the object first.
//!
//! **Followers.** [`StateStore::look`] reads what the leader wrote, without writing:
//! a follower replays it to serve the leader's table.
//!
//! Size: the store's layout, its writes and their settlement are one protocol, read together.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};
use serde::{Deserialize, Serialize};
use stanch_api::hash::Fnv64;
use stanch_core::EngineState;
use stanch_ports::store::{Loaded, Record, StateStore, StoreError};
use tracing::{info, warn};

use crate::shards::{self, MAX_SHARD_BYTES, Manifest};

/// The most bytes of journal the state object holds; past it, the journal so far is
/// moved to a segment of its own. With the manifest, the object stays well under a
/// ConfigMap's 1 MiB.
pub const JOURNAL_MAX_BYTES: usize = 64 * 1024;

/// The most journal segments kept before a snapshot is written instead (8 MiB of
/// journal): a long storm is compacted, a short one costs no snapshot.
pub const MAX_SEGMENTS: usize = 128;

/// The label on every object of a store, its value the state object's name.
pub const LABEL: &str = "stanch.dev/state";

/// The layout of a snapshot, so that a future one can be told apart.
const FORMAT: u32 = 1;

/// Whether this replica may write now: the Lease is held, its term not over.
pub type Guard = Arc<dyn Fn() -> bool + Send + Sync>;

/// A snapshot as its shards hold it, joined.
#[derive(Serialize, Deserialize)]
struct SnapshotDoc {
    format: u32,
    seq: u64,
    state: EngineState,
}

/// A full part of the journal, moved out of the state object into one of its own;
/// never changed after.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Segment {
    /// The object holding it.
    name: String,
    /// The last record's `seq`.
    last_seq: u64,
    /// Its length in bytes.
    bytes: usize,
    /// FNV-1a of its bytes, as 16 hex digits.
    hash: String,
}

/// The state object as this replica last saw it.
#[derive(Debug, Clone, Default)]
struct Seen {
    /// Its `resourceVersion`; `None` when it does not exist.
    version: Option<String>,
    holder: String,
    manifest: Option<Manifest>,
    /// The journal's full parts, oldest first.
    segments: Vec<Segment>,
    /// The journal after them, one JSON record a line, each ending in `\n`.
    journal: String,
    /// The highest `seq` in the journal (or the manifest's when it is empty).
    last_seq: u64,
}

/// The Kubernetes state store. See the module docs.
pub struct KubeStore {
    api: Api<ConfigMap>,
    name: String,
    identity: String,
    runtime: tokio::runtime::Handle,
    guard: Guard,
    timeout: Duration,
    /// The state object as last written or read; `None` before the first load.
    seen: Option<Seen>,
    /// A write's outcome is unknown (a timeout, a lost answer): read before writing.
    uncertain: bool,
    /// Another replica took the store over; set for good.
    fenced: Arc<AtomicBool>,
    /// The `resourceVersion` of the state object at the last [`StateStore::look`].
    looked: Option<String>,
    /// The snapshot last read and the manifest naming it: a follower looking again
    /// reads only the journal while the snapshot stays.
    cached: Option<(Manifest, EngineState)>,
    /// Journal segments read, by name.
    segment_cache: BTreeMap<String, String>,
    /// The most bytes of journal the state object holds ([`JOURNAL_MAX_BYTES`]).
    journal_cap: usize,
}

impl fmt::Debug for KubeStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KubeStore")
            .field("name", &self.name)
            .field("identity", &self.identity)
            .field("fenced", &self.fenced.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// How a write of the state object ended, when it did not fail.
#[derive(Debug, PartialEq, Eq)]
enum Written {
    Done,
    /// It conflicted with a write of this replica's own that had landed: now seen.
    Again,
}

/// Why an API call failed, for [`StoreError::Remote`].
#[derive(Debug, thiserror::Error)]
enum Failure {
    #[error(transparent)]
    Api(#[from] kube::Error),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("the lease is not held: this replica does not lead")]
    NotLeading,
    #[error("{0}")]
    Content(String),
}

impl KubeStore {
    /// A store in the state object `name` of `api`'s namespace, written as `identity`
    /// (the pod's name), sending only while `guard` says this replica leads, every
    /// call bounded by `timeout`. Its methods block: call them off the runtime's
    /// threads (the engine task does, on `spawn_blocking`), never on them.
    pub fn new(
        api: Api<ConfigMap>,
        name: impl Into<String>,
        identity: impl Into<String>,
        guard: Guard,
        timeout: Duration,
    ) -> KubeStore {
        KubeStore {
            api,
            name: name.into(),
            identity: identity.into(),
            runtime: tokio::runtime::Handle::current(),
            guard,
            timeout,
            seen: None,
            uncertain: false,
            fenced: Arc::new(AtomicBool::new(false)),
            looked: None,
            cached: None,
            segment_cache: BTreeMap::new(),
            journal_cap: JOURNAL_MAX_BYTES,
        }
    }

    /// Holds at most `bytes` of journal in the state object (instead of
    /// [`JOURNAL_MAX_BYTES`]): tests use it to make segments of a few records.
    pub fn with_journal_cap(mut self, bytes: usize) -> KubeStore {
        self.journal_cap = bytes.clamp(1, JOURNAL_MAX_BYTES);
        self
    }

    /// Set once another replica has taken the store over: this one must stop deciding.
    pub fn fenced(&self) -> Arc<AtomicBool> {
        self.fenced.clone()
    }

    /// Runs one API call on the runtime, bounded by the timeout.
    fn call<T>(&self, call: impl Future<Output = Result<T, kube::Error>>) -> Result<T, Failure> {
        let timeout = self.timeout;
        self.runtime.block_on(async move {
            match tokio::time::timeout(timeout, call).await {
                Ok(result) => result.map_err(Failure::Api),
                Err(_) => Err(Failure::Timeout(timeout)),
            }
        })
    }

    fn remote(&self, operation: &'static str, object: &str, e: Failure) -> StoreError {
        StoreError::Remote {
            operation,
            object: object.to_owned(),
            source: Box::new(e),
        }
    }

    fn fenced_by(&self, holder: String) -> StoreError {
        self.fenced.store(true, Ordering::Relaxed);
        StoreError::Fenced {
            object: self.name.clone(),
            holder,
        }
    }

    /// The state object now, parsed; `Ok(None)` when it does not exist.
    fn read(&self) -> Result<Option<(Seen, ConfigMap)>, Failure> {
        let Some(object) = self.call(self.api.get_opt(&self.name))? else {
            return Ok(None);
        };
        let data = object.data.clone().unwrap_or_default();
        let text = |key: &str| data.get(key).cloned().unwrap_or_default();
        let manifest = match data.get("manifest").filter(|m| !m.is_empty()) {
            None => None,
            Some(m) => Some(
                serde_json::from_str::<Manifest>(m)
                    .map_err(|e| Failure::Content(format!("its manifest: {e}")))?,
            ),
        };
        let segments: Vec<Segment> = match data.get("segments").filter(|m| !m.is_empty()) {
            None => Vec::new(),
            Some(list) => serde_json::from_str(list)
                .map_err(|e| Failure::Content(format!("its journal segments: {e}")))?,
        };
        let journal = text("journal");
        let last_seq = last_seq(&journal)
            .map_err(Failure::Content)?
            .or_else(|| segments.last().map(|s| s.last_seq))
            .unwrap_or_else(|| manifest.as_ref().map_or(0, |m| m.seq));
        let seen = Seen {
            version: object.metadata.resource_version.clone(),
            holder: text("holder"),
            manifest,
            segments,
            journal,
            last_seq,
        };
        Ok(Some((seen, object)))
    }

    /// The state object as `seen` says, to write.
    fn object(&self, seen: &Seen) -> ConfigMap {
        let mut data = BTreeMap::new();
        data.insert("holder".to_owned(), self.identity.clone());
        if let Some(m) = &seen.manifest {
            data.insert(
                "manifest".to_owned(),
                serde_json::to_string(m).expect("a manifest serializes"),
            );
        }
        if !seen.segments.is_empty() {
            data.insert(
                "segments".to_owned(),
                serde_json::to_string(&seen.segments).expect("segments serialize"),
            );
        }
        data.insert("journal".to_owned(), seen.journal.clone());
        ConfigMap {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                resource_version: seen.version.clone(),
                labels: Some(BTreeMap::from([(LABEL.to_owned(), self.name.clone())])),
                ..ObjectMeta::default()
            },
            data: Some(data),
            ..ConfigMap::default()
        }
    }

    /// Writes the state object as `next` (with this replica as holder), preconditioned
    /// on the version last seen. On success `next` is what is seen. On a conflict the
    /// object is read again: held by another replica, this one is fenced; held by this
    /// one (a write whose answer was lost had landed), what it holds is seen and
    /// [`Written::Again`] says to make the write anew from it.
    fn write(&mut self, operation: &'static str, mut next: Seen) -> Result<Written, StoreError> {
        if !(self.guard)() {
            return Err(self.remote(operation, &self.name, Failure::NotLeading));
        }
        let object = self.object(&next);
        let params = PostParams::default();
        let sent = match &next.version {
            Some(_) => self.call(self.api.replace(&self.name, &params, &object)),
            None => self.call(self.api.create(&params, &object)),
        };
        match sent {
            Ok(written) => {
                next.version = written.metadata.resource_version;
                next.holder = self.identity.clone();
                self.seen = Some(next);
                self.uncertain = false;
                Ok(Written::Done)
            }
            Err(Failure::Api(kube::Error::Api(status))) if status.code == 409 => {
                self.uncertain = true;
                self.settle(operation)?;
                Ok(Written::Again)
            }
            Err(e) => {
                // A 4xx from the API server means it was not written; anything else
                // (a 5xx such as etcd's `504 Timeout`, a timeout here, a broken
                // connection) leaves it unknown.
                self.uncertain = match &e {
                    Failure::Api(kube::Error::Api(s)) => !(400..500).contains(&s.code),
                    Failure::NotLeading | Failure::Content(_) => false,
                    Failure::Api(_) | Failure::Timeout(_) => true,
                };
                Err(self.remote(operation, &self.name, e))
            }
        }
    }

    /// Makes `attempt` (which builds the next state object from what is seen) and
    /// writes it, making it once more if a write of this replica's own was found to
    /// have landed.
    fn write_from_seen(
        &mut self,
        operation: &'static str,
        attempt: impl Fn(&Self, Seen) -> Result<Option<Seen>, StoreError>,
    ) -> Result<(), StoreError> {
        self.settle(operation)?;
        for _ in 0..2 {
            let Some(next) = attempt(self, self.seen())? else {
                return Ok(());
            };
            if self.write(operation, next)? == Written::Done {
                return Ok(());
            }
        }
        Err(self.remote(
            operation,
            &self.name,
            Failure::Content("written by this replica twice while being written".into()),
        ))
    }

    /// After an unknown outcome: reads the state object, and takes what it holds as
    /// seen if this replica still holds it; fenced for good if another does.
    fn settle(&mut self, operation: &'static str) -> Result<(), StoreError> {
        if !self.uncertain {
            return Ok(());
        }
        let read = self
            .read()
            .map_err(|e| self.remote(operation, &self.name, e))?;
        match read {
            Some((seen, _)) if seen.holder != self.identity => Err(self.fenced_by(seen.holder)),
            Some((seen, _)) => {
                self.seen = Some(seen);
                self.uncertain = false;
                Ok(())
            }
            None => Err(self.fenced_by("(deleted)".to_owned())),
        }
    }

    /// The seen state object; the store must have been loaded.
    fn seen(&self) -> Seen {
        self.seen.clone().unwrap_or_default()
    }

    /// The snapshot `manifest` names, read from its shards and checked.
    fn read_snapshot(&mut self, manifest: &Manifest) -> Result<(EngineState, u64), Failure> {
        if let Some((cached, state)) = &self.cached
            && cached == manifest
        {
            return Ok((state.clone(), manifest.seq));
        }
        let mut shards = BTreeMap::new();
        for shard in &manifest.shards {
            if let Some(object) = self.call(self.api.get_opt(&shard.name))? {
                let text = object
                    .data
                    .and_then(|mut d| d.remove("state"))
                    .unwrap_or_default();
                shards.insert(shard.name.clone(), text);
            }
        }
        let text = shards::join(manifest, |n| shards.get(n).map(String::as_str))
            .map_err(|e| Failure::Content(e.to_string()))?;
        let doc: SnapshotDoc = serde_json::from_str(&text)
            .map_err(|e| Failure::Content(format!("the snapshot does not parse: {e}")))?;
        if doc.format != FORMAT || doc.seq != manifest.seq {
            return Err(Failure::Content(format!(
                "the snapshot is format {} at seq {}, the manifest says format {FORMAT} at seq {}",
                doc.format, doc.seq, manifest.seq
            )));
        }
        self.cached = Some((manifest.clone(), doc.state.clone()));
        Ok((doc.state, doc.seq))
    }

    /// A journal segment's text, checked against its entry; segments never change, so
    /// each is read once.
    fn read_segment(&mut self, segment: &Segment) -> Result<String, Failure> {
        if let Some(text) = self.segment_cache.get(&segment.name) {
            return Ok(text.clone());
        }
        let text = self
            .call(self.api.get_opt(&segment.name))?
            .and_then(|o| o.data)
            .and_then(|mut d| d.remove("journal"))
            .ok_or_else(|| {
                Failure::Content(format!("journal segment {} is missing", segment.name))
            })?;
        if text.len() != segment.bytes || hash_of(&text) != segment.hash {
            return Err(Failure::Content(format!(
                "journal segment {} does not match its entry",
                segment.name
            )));
        }
        self.segment_cache
            .insert(segment.name.clone(), text.clone());
        Ok(text)
    }

    /// What `seen` holds: its snapshot and the journal records after it.
    fn loaded(&mut self, seen: &Seen) -> Result<Loaded, Failure> {
        let snapshot = match &seen.manifest {
            Some(m) => Some(self.read_snapshot(m)?),
            None => None,
        };
        let after = snapshot.as_ref().map_or(0, |(_, seq)| *seq);
        let mut journal = Vec::new();
        for segment in seen.segments.iter().filter(|g| g.last_seq > after) {
            let text = self.read_segment(segment)?;
            journal.extend(
                records(&text).map_err(|e| Failure::Content(format!("{}: {e}", segment.name)))?,
            );
        }
        journal.extend(records(&seen.journal).map_err(Failure::Content)?);
        journal.retain(|r| r.seq > after);
        Ok(Loaded {
            snapshot,
            journal,
            corruption: None,
        })
    }

    /// Copies the unreadable state object to `{name}-unreadable-{version}` for a
    /// human to look at; the name of the copy.
    fn move_aside(&self, object: &ConfigMap) -> Result<String, Failure> {
        let version = object.metadata.resource_version.clone().unwrap_or_default();
        let name = format!("{}-unreadable-{version}", self.name);
        let copy = ConfigMap {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                labels: Some(BTreeMap::from([(LABEL.to_owned(), self.name.clone())])),
                ..ObjectMeta::default()
            },
            data: object.data.clone(),
            ..ConfigMap::default()
        };
        match self.call(self.api.create(&PostParams::default(), &copy)) {
            Ok(_) => Ok(name),
            Err(Failure::Api(kube::Error::Api(s))) if s.is_already_exists() => Ok(name),
            Err(e) => Err(e),
        }
    }

    /// Writes `journal` (whose last record is `last_seq`) as a segment of its own:
    /// named by its content, so writing it again is harmless.
    fn write_segment(&self, journal: &str, last_seq: u64) -> Result<Segment, StoreError> {
        let hash = hash_of(journal);
        let name = format!("{}-journal-{last_seq}-{hash}", self.name);
        let object = ConfigMap {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                labels: Some(BTreeMap::from([(LABEL.to_owned(), self.name.clone())])),
                ..ObjectMeta::default()
            },
            data: Some(BTreeMap::from([("journal".to_owned(), journal.to_owned())])),
            ..ConfigMap::default()
        };
        match self.call(self.api.create(&PostParams::default(), &object)) {
            Ok(_) => {}
            Err(Failure::Api(kube::Error::Api(s))) if s.is_already_exists() => {}
            Err(e) => return Err(self.remote("append", &name, e)),
        }
        Ok(Segment {
            name,
            last_seq,
            bytes: journal.len(),
            hash,
        })
    }

    /// The state object is unreadable: copied aside, and replaced by an empty one
    /// (a new epoch) at the version read.
    fn start_over(&self, object: &ConfigMap, why: &str) -> Result<(Seen, Loaded), StoreError> {
        let aside = self
            .move_aside(object)
            .map_err(|e| self.remote("load", &self.name, e))?;
        let fresh = Seen {
            version: object.metadata.resource_version.clone(),
            ..Seen::default()
        };
        let loaded = Loaded {
            corruption: Some(format!("{why}; the state object was copied to {aside}")),
            ..Loaded::default()
        };
        Ok((fresh, loaded))
    }

    /// Deletes the shards and journal segments of this store that `seen` does not name:
    /// left by a write that failed after them. Best effort, since an orphan costs only
    /// space and the next load tries again.
    fn delete_orphans(&self, seen: &Seen) {
        let params = ListParams::default().labels(&format!("{LABEL}={}", self.name));
        let listed = match self.call(self.api.list(&params)) {
            Ok(list) => list,
            Err(e) => {
                warn!(error = %e, "cannot list the state's shards; old ones stay until the next snapshot");
                return;
            }
        };
        let prefix = format!("{}-", self.name);
        let names: Vec<String> = listed
            .items
            .into_iter()
            .filter_map(|o| o.metadata.name)
            .filter(|n| is_shard_name(n, &prefix) || is_segment_name(n, &prefix))
            .collect();
        let mut named: Vec<&str> = seen
            .manifest
            .iter()
            .flat_map(|m| m.shards.iter().map(|s| s.name.as_str()))
            .collect();
        named.extend(seen.segments.iter().map(|g| g.name.as_str()));
        for orphan in names.iter().filter(|n| !named.contains(&n.as_str())) {
            if let Err(e) = self.call(self.api.delete(orphan, &DeleteParams::default())) {
                warn!(object = %orphan, error = %e, "cannot delete an old part of the state");
            }
        }
    }
}

/// Whether `name` is a journal segment's, `{prefix}journal-{seq}-{hash}`.
fn is_segment_name(name: &str, prefix: &str) -> bool {
    let Some(rest) = name
        .strip_prefix(prefix)
        .and_then(|r| r.strip_prefix("journal-"))
    else {
        return false;
    };
    rest.split_once('-').is_some_and(|(seq, hash)| {
        !seq.is_empty()
            && seq.bytes().all(|b| b.is_ascii_digit())
            && hash.len() == 16
            && hash.bytes().all(|b| b.is_ascii_hexdigit())
    })
}

/// Whether `name` is a shard's, `{prefix}{hash}-{seq}-{i}`, and not the state object's
/// or a moved-aside copy's.
fn is_shard_name(name: &str, prefix: &str) -> bool {
    let Some(rest) = name.strip_prefix(prefix) else {
        return false;
    };
    let parts: Vec<&str> = rest.split('-').collect();
    parts.len() == 3
        && parts[0].len() == 16
        && parts[0].bytes().all(|b| b.is_ascii_hexdigit())
        && parts[1..]
            .iter()
            .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
}

/// FNV-1a of `text`, as 16 hex digits.
fn hash_of(text: &str) -> String {
    let mut hash = Fnv64::default();
    hash.write(text.as_bytes());
    format!("{:016x}", hash.finish())
}

/// The records of a journal, in order; an unreadable line is an error.
fn records(journal: &str) -> Result<Vec<Record>, String> {
    journal
        .lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(i, line)| {
            serde_json::from_str(line).map_err(|e| format!("journal line {}: {e}", i + 1))
        })
        .collect()
}

/// The `seq` of a journal's last record, read from its last line alone: the state
/// object is read at every look and before every write after a doubt, and the whole
/// journal is parsed only when its records are wanted.
fn last_seq(journal: &str) -> Result<Option<u64>, String> {
    #[derive(Deserialize)]
    struct Seq {
        seq: u64,
    }
    let Some(line) = journal.lines().rev().find(|l| !l.trim().is_empty()) else {
        return Ok(None);
    };
    serde_json::from_str::<Seq>(line)
        .map(|r| Some(r.seq))
        .map_err(|e| format!("journal's last line: {e}"))
}

/// `records` as journal lines.
fn lines(records: &[Record]) -> String {
    let mut text = String::new();
    for r in records {
        text.push_str(&serde_json::to_string(r).expect("records serialize"));
        text.push('\n');
    }
    text
}

impl StateStore for KubeStore {
    fn kind(&self) -> &'static str {
        "kubernetes"
    }

    fn load(&mut self) -> Result<Loaded, StoreError> {
        let read = self.read();
        let (seen, loaded) = match read {
            Ok(None) => (Seen::default(), Loaded::default()),
            Ok(Some((seen, object))) => match self.loaded(&seen) {
                Ok(loaded) => (seen, loaded),
                Err(Failure::Content(why)) => self.start_over(&object, &why)?,
                Err(e) => return Err(self.remote("load", &self.name, e)),
            },
            Err(Failure::Content(why)) => {
                // It exists but does not parse: read it raw to move it aside.
                let object = self
                    .call(self.api.get(&self.name))
                    .map_err(|e| self.remote("load", &self.name, e))?;
                self.start_over(&object, &why)?
            }
            Err(e) => return Err(self.remote("load", &self.name, e)),
        };
        // Take it over before trusting what it holds: a write by the replica that led
        // before fails from now on, so nothing lands after this read. Written with the
        // version read, the write succeeds only if the object still holds what was read.
        let previous = seen.holder.clone();
        self.uncertain = false;
        self.seen = Some(seen.clone());
        if self.write("load", seen)? == Written::Again {
            // Read, then changed by an earlier life of this replica: read it anew.
            return Err(self.remote(
                "load",
                &self.name,
                Failure::Content("changed while being taken over; loading again".into()),
            ));
        }
        if !previous.is_empty() && previous != self.identity {
            info!(from = %previous, "state store taken over");
        }
        self.delete_orphans(&self.seen());
        Ok(loaded)
    }

    fn append(&mut self, records: &[Record]) -> Result<(), StoreError> {
        self.write_from_seen("append", |this, mut next| {
            // A batch written before whose answer was lost is in already.
            let new: Vec<Record> = records
                .iter()
                .filter(|r| r.seq > next.last_seq)
                .cloned()
                .collect();
            let Some(last) = new.last() else {
                return Ok(None);
            };
            let added = lines(&new);
            if !next.journal.is_empty() && next.journal.len() + added.len() > this.journal_cap {
                // The journal so far becomes a segment; the state object names it in
                // the same write that appends, so it is read only once named.
                let segment = this.write_segment(&next.journal, next.last_seq)?;
                next.segments.push(segment);
                next.journal.clear();
            }
            next.last_seq = last.seq;
            next.journal.push_str(&added);
            Ok(Some(next))
        })
    }

    fn snapshot(&mut self, state: &EngineState, seq: u64) -> Result<(), StoreError> {
        self.settle("snapshot")?;
        if !(self.guard)() {
            return Err(self.remote("snapshot", &self.name, Failure::NotLeading));
        }
        let doc = SnapshotDoc {
            format: FORMAT,
            seq,
            state: state.clone(),
        };
        let text = serde_json::to_string(&doc).expect("engine state serializes");
        let mut hash = Fnv64::default();
        hash.write(text.as_bytes());
        let prefix = format!("{}-{:016x}", self.name, hash.finish());
        let (pieces, manifest) = shards::split(&text, seq, &prefix, MAX_SHARD_BYTES)
            .map_err(|e| self.remote("snapshot", &self.name, Failure::Content(e.to_string())))?;
        // The shards first: nothing reads them before the manifest names them.
        for (name, piece) in pieces {
            let shard = ConfigMap {
                metadata: ObjectMeta {
                    name: Some(name.clone()),
                    labels: Some(BTreeMap::from([(LABEL.to_owned(), self.name.clone())])),
                    ..ObjectMeta::default()
                },
                data: Some(BTreeMap::from([("state".to_owned(), piece)])),
                ..ConfigMap::default()
            };
            match self.call(self.api.create(&PostParams::default(), &shard)) {
                Ok(_) => {}
                // Named by the content's hash: one that exists holds this content.
                Err(Failure::Api(kube::Error::Api(s))) if s.is_already_exists() => {}
                Err(e) => return Err(self.remote("snapshot", &name, e)),
            }
        }
        let old = self.seen().manifest;
        // Then the switch: the manifest, and the journal cut to what the snapshot does
        // not cover, in one write.
        let old_segments = self.seen().segments;
        self.write_from_seen("snapshot", |this, seen| {
            let kept: Vec<Record> = records(&seen.journal)
                .map_err(|e| this.remote("snapshot", &this.name, Failure::Content(e)))?
                .into_iter()
                .filter(|r| r.seq > seq)
                .collect();
            Ok(Some(Seen {
                last_seq: kept.last().map_or(seq.max(seen.last_seq), |r| r.seq),
                journal: lines(&kept),
                manifest: Some(manifest.clone()),
                // A segment the snapshot does not cover whole stays named.
                segments: seen
                    .segments
                    .iter()
                    .filter(|g| g.last_seq > seq)
                    .cloned()
                    .collect(),
                ..seen
            }))
        })?;
        let named = self.seen().segments;
        for segment in old_segments.iter().filter(|g| !named.contains(g)) {
            self.segment_cache.remove(&segment.name);
            if let Err(e) = self.call(self.api.delete(&segment.name, &DeleteParams::default())) {
                warn!(segment = %segment.name, error = %e, "cannot delete a journal segment the snapshot covers");
            }
        }
        // The shards of the snapshot replaced go now; any others left by a crash, at
        // the next load.
        let current = self.seen().manifest;
        for shard in old.iter().flat_map(|m| &m.shards) {
            let named = current
                .as_ref()
                .is_some_and(|m| m.shards.iter().any(|s| s.name == shard.name));
            if !named
                && let Err(e) = self.call(self.api.delete(&shard.name, &DeleteParams::default()))
            {
                warn!(shard = %shard.name, error = %e, "cannot delete an old shard of the state");
            }
        }
        Ok(())
    }

    fn prefers_snapshot(&self, records: &[Record]) -> bool {
        let (journal, segments) = self
            .seen
            .as_ref()
            .map_or((0, 0), |s| (s.journal.len(), s.segments.len()));
        let incoming: usize = records
            .iter()
            .map(|r| serde_json::to_string(r).map_or(0, |l| l.len() + 1))
            .sum();
        // Too large for the state object even alone, or no room for one more segment.
        incoming > self.journal_cap
            || (journal + incoming > self.journal_cap && segments >= MAX_SEGMENTS)
    }

    fn look(&mut self) -> Result<Option<Loaded>, StoreError> {
        let read = self
            .read()
            .map_err(|e| self.remote("look", &self.name, e))?;
        let Some((seen, _)) = read else {
            return Ok(None);
        };
        if seen.version.is_some() && seen.version == self.looked {
            return Ok(None);
        }
        let loaded = self
            .loaded(&seen)
            .map_err(|e| self.remote("look", &self.name, e))?;
        self.looked = seen.version;
        Ok(Some(loaded))
    }
}
