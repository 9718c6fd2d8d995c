//! The engine task: the only writer of engine state and of the published snapshot.
//!
//! Requests queue on a channel. The task takes every queued request at once (group
//! commit), applies each to the engine, appends the inputs that changed something to
//! the journal with one fsync, and only then publishes the new snapshot and answers.
//! An answer of success therefore means "durable". If the journal cannot be written,
//! the records stay buffered and are retried first on the next commit; nothing is
//! published meanwhile and requests get a retryable error.
//!
//! `run` here; `commit` (group commit, snapshots, the store's failures), `role`
//! (leading, following, handing over), `replay` (state rebuilt from the store) and
//! `observe` (what decisions tell the metrics and the log).

mod commit;
mod observe;
mod replay;
mod role;

use self::replay::snapshot_of;
use self::role::{FOLLOW_EVERY, Followed, role_changed};
use stanch_log::Sources;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use stanch_api::Timestamp;
use stanch_core::engine::ReportRefusals;
use stanch_core::{Config, Decision, Engine, Input};
use stanch_net::throttle::Throttled;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;
use tracing::{Instrument, error, info_span, warn};

use crate::history::History;
use crate::publish::Publisher;
use stanch_ports::clock::Clock;
use stanch_ports::leadership::{Leadership, Role};
use stanch_ports::store::{Record, StateStore, StoreError};

/// Requests taken in one commit at most.
const MAX_BATCH: usize = 512;
/// Journal records written between snapshots.
const SNAPSHOT_EVERY: u64 = 5_000;
/// Unwritten records held while the store fails; past this, inputs are refused.
const MAX_UNSYNCED: usize = 10_000;
/// The longest the task sleeps, so a stepped clock is noticed.
const MAX_SLEEP: Duration = Duration::from_secs(1);

/// What applying an input did.
#[derive(Debug, Clone)]
pub struct Applied {
    /// The decisions, in order.
    pub decisions: Vec<Decision>,
    /// The published route version after it.
    pub version: u64,
    /// What the engine left out of a report (nothing for other inputs).
    pub refused: ReportRefusals,
}

/// Why an input was not applied durably.
#[derive(Debug, Clone, thiserror::Error)]
pub enum EngineUnavailable {
    /// The state store cannot write; the input may be retried. The cause is logged,
    /// not carried: it is for operators, not for callers.
    #[error("the state store cannot write ({kind}); retry later")]
    Store {
        /// The failing operation, [`StoreError::kind`].
        kind: &'static str,
    },
    /// Another replica leads: only it takes inputs.
    #[error("this replica does not lead; retry (the leader takes it)")]
    NotLeader,
    /// The engine task has stopped.
    #[error("the engine is shutting down")]
    Stopped,
}

struct Job {
    input: Input,
    arrived: Instant,
    reply: oneshot::Sender<Result<Applied, EngineUnavailable>>,
}

/// A cheap handle for sending inputs to the engine task.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Job>,
}

impl EngineHandle {
    /// Applies `input` durably and returns what it decided.
    pub async fn apply(&self, input: Input) -> Result<Applied, EngineUnavailable> {
        let (reply, rx) = oneshot::channel();
        let job = Job {
            input,
            arrived: Instant::now(),
            reply,
        };
        self.tx
            .send(job)
            .await
            .map_err(|_| EngineUnavailable::Stopped)?;
        rx.await.map_err(|_| EngineUnavailable::Stopped)?
    }
}

/// Shared, read-mostly facts about the store's health.
#[derive(Debug)]
pub struct StoreHealth {
    /// `file` or `memory`.
    pub kind: &'static str,
    /// False while writes fail.
    pub healthy: AtomicBool,
    /// Set when the state was found unreadable (at start, or on taking charge).
    pub recovered_from_corruption: std::sync::Mutex<Option<String>>,
}

impl StoreHealth {
    /// What was unreadable and moved aside, if anything was.
    pub fn recovered_from_corruption(&self) -> Option<String> {
        self.recovered_from_corruption
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// Everything the task needs.
pub struct EngineTask {
    engine: Engine,
    store: Option<Box<dyn StateStore>>,
    next_seq: u64,
    since_snapshot: u64,
    snapshot_every: u64,
    /// No snapshot is durable yet (a first start, or one that failed): the next
    /// durable write is a snapshot, so the epoch is on disk before any record.
    needs_snapshot: bool,
    unsynced: Vec<Record>,
    unsynced_decisions: Vec<(Timestamp, Vec<Decision>, bool)>,
    history: Arc<History>,
    publisher: Arc<Publisher>,
    metrics: Arc<crate::metrics::Metrics>,
    clock: Arc<dyn Clock>,
    health: Arc<StoreHealth>,
    rx: mpsc::Receiver<Job>,
    /// With replicas sharing a store: this replica's role. `None` alone: it decides.
    role: Option<watch::Receiver<Role>>,
    /// The engine holds the store's state taken over by this replica, and decides.
    /// A follower's engine only replays what the leader wrote.
    deciding: bool,
    /// The store was taken over by another replica during this term: not taken back
    /// before the role changes, so that two replicas never fight over it.
    fenced: bool,
    /// The configuration to put in force on taking charge: the one given at start, or
    /// given since while following.
    desired: Config,
    /// While following: the snapshot the engine was replayed from and the last record
    /// applied, so that a look applies only the records written since.
    followed: Option<Followed>,
    /// The warning that report entries were refused, said at most once a minute.
    reports_refused_said: Throttled,
    /// The warning that the block limit refused blocks, said at most once a minute.
    block_limit_said: Throttled,
}

/// The result of starting the engine: its handle and the shared read side.
pub struct Started {
    /// Send inputs here.
    pub handle: EngineHandle,
    /// The task; run it with [`EngineTask::run`].
    pub task: EngineTask,
    /// The published snapshot.
    pub publisher: Arc<Publisher>,
    /// The store's health.
    pub health: Arc<StoreHealth>,
}

/// A new epoch name: the start time and process id, in hex.
pub fn new_epoch(now: Timestamp) -> String {
    format!("{:x}-{:04x}", now.as_millis(), std::process::id() & 0xffff)
}

impl EngineTask {
    /// Loads state from `store` (replaying its journal), and builds the task of a
    /// replica alone: it decides from the start.
    pub fn start(
        config: Config,
        mut store: Box<dyn StateStore>,
        history: Arc<History>,
        metrics: Arc<crate::metrics::Metrics>,
        clock: Arc<dyn Clock>,
    ) -> Result<Started, StoreError> {
        let loaded = store.load()?;
        let now = clock.now();
        let (mut task, started) = EngineTask::build(config, store, history, metrics, clock, None);
        let restored = task.restore(loaded, now);
        // The start's own records are written before anything is served; if they
        // cannot be, the restored table (what is durable) is.
        let mut store = task.store.take().expect("the store, at start");
        let written = if task.needs_snapshot {
            store.snapshot(task.engine.state(), task.next_seq - 1)
        } else {
            store.append(&task.unsynced).map(|()| {
                // Compact at start so replay stays short across restarts.
                if let Err(e) = store.snapshot(task.engine.state(), task.next_seq - 1) {
                    warn!(error = %e, source = %Sources(&e), "cannot write a snapshot at start; the journal keeps everything");
                }
            })
        };
        task.store = Some(store);
        match written {
            Ok(()) => {
                task.record_history();
                task.unsynced.clear();
                task.needs_snapshot = false;
                task.publisher.publish(snapshot_of(&task.engine, now));
            }
            Err(e) => {
                error!(error = %e, source = %Sources(&e), "cannot write state at start; serving the restored table, refusing input until the store recovers");
                task.health.healthy.store(false, Ordering::Relaxed);
                task.publisher.publish(restored);
            }
        }
        Ok(started.with(task))
    }

    /// Builds the task of a replica sharing `store` with others: it follows what the
    /// leader writes (serving its table, refusing inputs) while `leadership` says
    /// another leads, and takes the store over and decides while it leads. Nothing is
    /// read here: the task looks, or loads, once it runs. Until it has read the
    /// leader's state it is not ready.
    pub fn start_shared(
        config: Config,
        store: Box<dyn StateStore>,
        history: Arc<History>,
        metrics: Arc<crate::metrics::Metrics>,
        clock: Arc<dyn Clock>,
        leadership: &Leadership,
    ) -> Started {
        let (task, started) = EngineTask::build(
            config,
            store,
            history,
            metrics,
            clock,
            Some(leadership.subscribe()),
        );
        task.health.healthy.store(false, Ordering::Relaxed);
        started.with(task)
    }

    /// The task with a fresh engine, and the parts others share.
    fn build(
        config: Config,
        store: Box<dyn StateStore>,
        history: Arc<History>,
        metrics: Arc<crate::metrics::Metrics>,
        clock: Arc<dyn Clock>,
        role: Option<watch::Receiver<Role>>,
    ) -> (EngineTask, Parts) {
        let now = clock.now();
        let engine = Engine::new(
            config.clone(),
            Engine::fresh_state(new_epoch(now), now),
            now,
        );
        let health = Arc::new(StoreHealth {
            kind: store.kind(),
            healthy: AtomicBool::new(true),
            recovered_from_corruption: std::sync::Mutex::new(None),
        });
        // A replica alone publishes what it restores before anything reads it; one
        // that follows has no table until it has read the leader's.
        let placeholder = snapshot_of(&engine, now);
        let publisher = Arc::new(match role {
            None => Publisher::new(placeholder),
            Some(_) => Publisher::pending(placeholder),
        });
        let (tx, rx) = mpsc::channel(4096);
        let task = EngineTask {
            engine,
            store: Some(store),
            next_seq: 1,
            since_snapshot: 0,
            snapshot_every: SNAPSHOT_EVERY,
            needs_snapshot: true,
            unsynced: Vec::new(),
            unsynced_decisions: Vec::new(),
            history,
            publisher: publisher.clone(),
            metrics,
            clock,
            health: health.clone(),
            rx,
            deciding: role.is_none(),
            role,
            fenced: false,
            desired: config,
            followed: None,
            reports_refused_said: Throttled::every(Duration::from_secs(60)),
            block_limit_said: Throttled::every(Duration::from_secs(60)),
        };
        let parts = Parts {
            handle: EngineHandle { tx },
            publisher,
        };
        (task, parts)
    }

    /// The decision history it records to.
    pub fn history(&self) -> Arc<History> {
        self.history.clone()
    }

    /// The engine's state as restored (before [`EngineTask::run`]): for status at start
    /// and for tests that check what survived.
    pub fn state(&self) -> &stanch_core::EngineState {
        self.engine.state()
    }

    /// Writes a snapshot (and empties the journal) after every `records` journal
    /// records instead of the default 5,000: tests use it to exercise compaction.
    pub fn set_snapshot_every(&mut self, records: u64) {
        self.snapshot_every = records.max(1);
    }

    /// Runs until `shutdown` resolves, then writes a final snapshot if it decides.
    pub async fn run(mut self, shutdown: impl std::future::Future<Output = ()>) {
        let span = info_span!("engine");
        async move {
            tokio::pin!(shutdown);
            loop {
                let sleep = if self.deciding {
                    self.sleep_duration()
                } else {
                    FOLLOW_EVERY
                };
                let mut jobs = Vec::new();
                let mut look = false;
                tokio::select! {
                    biased;
                    () = &mut shutdown => break,
                    () = role_changed(&mut self.role) => look = true,
                    job = self.rx.recv() => match job {
                        Some(job) => jobs.push(job),
                        None => break,
                    },
                    () = tokio::time::sleep(sleep) => look = true,
                }
                while jobs.len() < MAX_BATCH {
                    match self.rx.try_recv() {
                        Ok(job) => jobs.push(job),
                        Err(_) => break,
                    }
                }
                self.settle_role().await;
                if self.deciding {
                    self.commit(jobs).await;
                } else {
                    self.refuse(jobs);
                    if look {
                        self.follow().await;
                    }
                }
            }
            if self.deciding {
                self.final_snapshot().await;
            }
        }
        .instrument(span)
        .await;
    }

    fn sleep_duration(&self) -> Duration {
        let now = self.clock.now();
        let wake = self
            .engine
            .next_wakeup()
            .map_or(MAX_SLEEP, |w| w.since(now));
        // Wake a millisecond late rather than early: the deadline is inclusive.
        (wake + Duration::from_millis(1)).min(MAX_SLEEP)
    }
}

/// The shared parts of a task being built.
struct Parts {
    handle: EngineHandle,
    publisher: Arc<Publisher>,
}

impl Parts {
    fn with(self, task: EngineTask) -> Started {
        Started {
            handle: self.handle,
            health: task.health.clone(),
            publisher: self.publisher,
            task,
        }
    }
}
