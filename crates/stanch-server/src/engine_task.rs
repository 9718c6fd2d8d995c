//! The engine task: the only writer of engine state and of the published snapshot.
//!
//! Requests queue on a channel. The task takes every queued request at once (group
//! commit), applies each to the engine, appends the inputs that changed something to
//! the journal with one fsync, and only then publishes the new snapshot and answers.
//! An answer of success therefore means "durable". If the journal cannot be written,
//! the records stay buffered and are retried first on the next commit; nothing is
//! published meanwhile and requests get a retryable error.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use stanch_api::Timestamp;
use stanch_api::status::AlertSummary;
use stanch_core::engine::ReportRefusals;
use stanch_core::{Config, Decision, Engine, Input};
use stanch_net::throttle::Throttled;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;
use tracing::{Instrument, debug, error, info, info_span, warn};

use crate::history::History;
use crate::metrics::{ActionLabel, KindLabel, ModelLabel, RejectLabels, TransitionLabels};
use crate::publish::{Publisher, Snapshot};
use stanch_ports::clock::Clock;
use stanch_ports::leadership::{Leadership, Role};
use stanch_ports::store::{Loaded, Record, StateStore, StoreError};

/// An error's causes, joined, for a log line.
pub(crate) struct ErrorChain<'a>(pub &'a dyn std::error::Error);

impl std::fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut source = self.0.source();
        let mut first = true;
        while let Some(e) = source {
            if !first {
                f.write_str(": ")?;
            }
            write!(f, "{e}")?;
            first = false;
            source = e.source();
        }
        Ok(())
    }
}

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

/// Where a follower's engine stands in the leader's history.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Followed {
    /// The journal position of the snapshot replayed from (`None`: from nothing).
    snapshot: Option<u64>,
    /// The last journal position applied.
    last: u64,
}

/// How often a follower looks at what the leader wrote.
const FOLLOW_EVERY: Duration = Duration::from_millis(500);

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
                    warn!(error = %e, source = %ErrorChain(&e), "cannot write a snapshot at start; the journal keeps everything");
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
                error!(error = %e, source = %ErrorChain(&e), "cannot write state at start; serving the restored table, refusing input until the store recovers");
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

    /// Puts the engine in the state `loaded` holds: the journal replayed over the
    /// snapshot under the configuration in force when it was taken, then the desired
    /// configuration put in force as an input if it differs. The input (if any) is
    /// queued to be written; with no snapshot yet, the next write is one. Returns the
    /// table of what is durable, before that input.
    fn restore(&mut self, loaded: Loaded, now: Timestamp) -> Snapshot {
        if let Some(why) = loaded.corruption.clone() {
            error!(store = self.health.kind, problem = %why, "state was unreadable: starting over under a new epoch; versions restart");
            self.metrics.state_corrupt_recovered.set(1);
            *self
                .health
                .recovered_from_corruption
                .lock()
                .unwrap_or_else(|e| e.into_inner()) = Some(why);
        }
        let Replayed {
            engine,
            seq,
            snapshotted,
            replayed,
        } = replay(loaded, &self.desired, now);
        self.engine = engine;
        // Durable now; published as it is if the records below cannot be written, so
        // no version is shown that a crash could take back.
        let restored = snapshot_of(&self.engine, now);
        let first_input = if self.engine.config() == &self.desired {
            Input::Tick
        } else {
            Input::Configure {
                config: Box::new(self.desired.clone()),
            }
        };
        let reconfigured = !matches!(first_input, Input::Tick);
        let first = self.engine.step(first_input.clone(), now);
        info!(
            epoch = %self.engine.state().epoch,
            version = self.engine.state().version,
            replayed,
            alerts = self.engine.state().alerts.len(),
            "state restored"
        );
        self.next_seq = seq + 1;
        // A history without a snapshot has its epoch nowhere durable: until one is
        // written, every durable write is a snapshot (it covers every record).
        self.needs_snapshot = !snapshotted;
        self.unsynced.clear();
        self.unsynced_decisions.clear();
        if first.changed {
            self.unsynced.push(Record {
                seq: self.next_seq,
                at: now,
                input: first_input,
            });
            self.next_seq += 1;
        }
        // A change of policy at start is in the history, once it is durable.
        if reconfigured {
            self.unsynced_decisions
                .push((now, first.decisions.clone(), self.engine.dry_run()));
        }
        self.update_metrics(&first.decisions);
        restored
    }

    /// Records the decisions waiting for their write, which landed.
    fn record_history(&mut self) {
        for (at, ds, dry) in std::mem::take(&mut self.unsynced_decisions) {
            if let Err(e) = self.history.record(at, &ds, dry) {
                warn!(error = %e, "cannot write the history file; entries kept in memory only");
            }
        }
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

    /// Takes charge when this replica has become the leader; stops deciding when it
    /// no longer is.
    async fn settle_role(&mut self) {
        let Some(role) = &self.role else { return };
        let leads = *role.borrow() == Role::Leader;
        if !leads {
            self.fenced = false;
            if self.deciding {
                self.step_down();
            }
        } else if !self.deciding && !self.fenced {
            self.take_charge().await;
        }
    }

    /// Loads the store (taking it over) and decides from what it holds.
    async fn take_charge(&mut self) {
        let now = self.clock.now();
        let loaded = self.with_store(|store| store.load()).await;
        let loaded = match loaded {
            Ok(loaded) => loaded,
            Err(e) => {
                self.fenced = matches!(e, StoreError::Fenced { .. });
                self.store_failed(&e);
                warn!(error = %e, source = %ErrorChain(&e), "leading, but cannot take the state store over; trying again");
                return;
            }
        };
        let restored = self.restore(loaded, now);
        self.publisher.publish(restored);
        self.health.healthy.store(true, Ordering::Relaxed);
        self.deciding = true;
        self.since_snapshot = 0;
        info!(
            version = self.engine.state().version,
            "leading: deciding from the state in the store"
        );
        if self.needs_snapshot {
            // Nothing was stored yet: the epoch is made durable before anything else.
            self.snapshot().await;
        } else {
            self.commit(Vec::new()).await;
        }
    }

    /// Another replica leads now: what was not written is dropped (none of it was
    /// acknowledged), and the engine follows the store again.
    fn step_down(&mut self) {
        if !self.unsynced.is_empty() {
            warn!(
                unwritten = self.unsynced.len(),
                "no longer leading: inputs not yet written are dropped (none was acknowledged)"
            );
        } else {
            info!("no longer leading: following the leader's writes");
        }
        self.unsynced.clear();
        self.unsynced_decisions.clear();
        self.deciding = false;
        // Its engine went past what it followed: the next look replays.
        self.followed = None;
    }

    /// Answers inputs that reached a follower: a new configuration is kept for when it
    /// takes charge; anything else is for the leader.
    fn refuse(&mut self, jobs: Vec<Job>) {
        let version = self.engine.state().version;
        for job in jobs {
            let answer = match job.input {
                Input::Configure { config } => {
                    self.desired = *config;
                    Ok(Applied {
                        decisions: Vec::new(),
                        version,
                        refused: ReportRefusals::default(),
                    })
                }
                _ => Err(EngineUnavailable::NotLeader),
            };
            let _ = job.reply.send(answer);
        }
    }

    /// Replays what the leader wrote, if it changed, and publishes it.
    async fn follow(&mut self) {
        let now = self.clock.now();
        let looked = self.with_store(|store| store.look()).await;
        match looked {
            Ok(None) => {}
            Ok(Some(loaded)) => {
                self.catch_up(loaded, now);
                self.publisher.publish(snapshot_of(&self.engine, now));
                self.update_metrics(&[]);
                // Ready once it serves the leader's table; a later failure to look
                // keeps that table served (gateways keep it anyway) and is logged.
                self.health.healthy.store(true, Ordering::Relaxed);
            }
            Err(e) => {
                self.store_failed(&e);
                debug!(error = %e, source = %ErrorChain(&e), "cannot read the leader's state; serving the last table read");
            }
        }
    }

    /// Brings the follower's engine to what `loaded` holds: only the records after the
    /// last one applied when the snapshot is the one replayed from and the journal
    /// still holds that record; else a replay from the snapshot.
    fn catch_up(&mut self, loaded: Loaded, now: Timestamp) {
        let snapshot = loaded.snapshot.as_ref().map(|(_, seq)| *seq);
        let last = loaded
            .journal
            .last()
            .map(|r| r.seq)
            .or(snapshot)
            .unwrap_or(0);
        let continues = self.followed.is_some_and(|f| {
            f.snapshot == snapshot
                && f.last <= last
                && (Some(f.last) == snapshot
                    || f.last == 0
                    || loaded.journal.iter().any(|r| r.seq == f.last))
        });
        match self.followed {
            Some(f) if continues => {
                for record in loaded.journal.into_iter().filter(|r| r.seq > f.last) {
                    self.engine.step(record.input, record.at);
                }
            }
            _ => self.engine = replay(loaded, &self.desired, now).engine,
        }
        self.followed = Some(Followed { snapshot, last });
    }

    /// Runs `f` on the store off the runtime's threads (its calls block: fsync, or a
    /// round trip to the API server), and puts the store back.
    async fn with_store<T: Send + 'static>(
        &mut self,
        f: impl FnOnce(&mut dyn StateStore) -> T + Send + 'static,
    ) -> T {
        let mut store = self.store.take().expect("store present between calls");
        let (store, out) = tokio::task::spawn_blocking(move || {
            let out = f(store.as_mut());
            (store, out)
        })
        .await
        .unwrap_or_else(|e| panic!("state store task panicked: {e}"));
        self.store = Some(store);
        out
    }

    /// Counts a store failure.
    fn store_failed(&self, e: &StoreError) {
        self.metrics
            .store_errors
            .get_or_create(&KindLabel { kind: e.kind() })
            .inc();
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

    async fn commit(&mut self, jobs: Vec<Job>) {
        let now = self.clock.now();
        let dry_run = self.engine.dry_run();
        let mut answered = Vec::with_capacity(jobs.len());
        for job in jobs {
            if self.unsynced.len() >= MAX_UNSYNCED {
                let _ = job
                    .reply
                    .send(Err(EngineUnavailable::Store { kind: "backlog" }));
                continue;
            }
            // A report is journaled as the engine took it, never as it was sent.
            let (admitted, refused) = self.engine.admit(job.input);
            self.count_refused(&refused);
            let input = admitted.input().clone();
            let step = self.engine.step_admitted(admitted, now);
            if step.changed {
                self.unsynced.push(Record {
                    seq: self.next_seq,
                    at: now,
                    input,
                });
                self.next_seq += 1;
            }
            self.unsynced_decisions
                .push((now, step.decisions.clone(), dry_run));
            answered.push((job.reply, job.arrived, step.decisions, refused));
        }
        let tick = self.engine.step(Input::Tick, now);
        if tick.changed {
            self.unsynced.push(Record {
                seq: self.next_seq,
                at: now,
                input: Input::Tick,
            });
            self.next_seq += 1;
            self.unsynced_decisions.push((now, tick.decisions, dry_run));
        }
        if self.unsynced.is_empty() {
            let version = self.engine.state().version;
            for (reply, _, decisions, refused) in answered {
                let _ = reply.send(Ok(Applied {
                    decisions,
                    version,
                    refused,
                }));
            }
            self.unsynced_decisions.clear();
            return;
        }

        let records = std::mem::take(&mut self.unsynced);
        let decisions = std::mem::take(&mut self.unsynced_decisions);
        // A store whose journal is near its size limit takes a snapshot instead,
        // which covers the records.
        let prefers_snapshot = self
            .store
            .as_ref()
            .is_some_and(|s| s.prefers_snapshot(&records));
        let snapshot = (self.needs_snapshot || prefers_snapshot)
            .then(|| (self.engine.state().clone(), self.next_seq - 1));
        let wrote_snapshot = snapshot.is_some();
        let history = self.history.clone();
        let (result, records, decisions) = self
            .with_store(move |store| {
                let result = match &snapshot {
                    Some((state, seq)) => store.snapshot(state, *seq),
                    None => store.append(&records),
                };
                if result.is_ok() {
                    for (at, ds, dry) in &decisions {
                        if let Err(e) = history.record(*at, ds, *dry) {
                            warn!(error = %e, "cannot write the history file; entries kept in memory only");
                        }
                    }
                }
                (result, records, decisions)
            })
            .await;
        match result {
            Ok(()) => {
                self.health.healthy.store(true, Ordering::Relaxed);
                if wrote_snapshot {
                    self.needs_snapshot = false;
                    self.since_snapshot = 0;
                } else {
                    self.since_snapshot += records.len() as u64;
                }
                let all: Vec<Decision> = decisions.into_iter().flat_map(|(_, d, _)| d).collect();
                self.update_metrics(&all);
                self.publisher.publish(snapshot_of(&self.engine, now));
                let version = self.engine.state().version;
                for (reply, arrived, decisions, refused) in answered {
                    self.metrics
                        .publish_latency
                        .observe(arrived.elapsed().as_secs_f64());
                    let _ = reply.send(Ok(Applied {
                        decisions,
                        version,
                        refused,
                    }));
                }
                if self.since_snapshot >= self.snapshot_every {
                    self.snapshot().await;
                }
            }
            Err(e) => {
                if self.health.healthy.swap(false, Ordering::Relaxed) {
                    error!(error = %e, source = %ErrorChain(&e), "cannot write the journal; holding decisions unpublished and refusing acknowledgements until it recovers");
                }
                self.metrics
                    .store_errors
                    .get_or_create(&KindLabel { kind: e.kind() })
                    .inc();
                self.unsynced = records;
                self.unsynced_decisions = decisions;
                for (reply, _, _, _) in answered {
                    let _ = reply.send(Err(EngineUnavailable::Store { kind: e.kind() }));
                }
                self.on_fenced(&e);
            }
        }
    }

    /// Another replica took the store over: this one stops deciding at once, and does
    /// not take it back before its role changes.
    fn on_fenced(&mut self, e: &StoreError) {
        if self.role.is_some() && matches!(e, StoreError::Fenced { .. }) {
            error!(error = %e, "the state store was taken over by another replica: no longer deciding");
            self.fenced = true;
            self.step_down();
        }
    }

    async fn snapshot(&mut self) {
        let state = self.engine.state().clone();
        let seq = self.next_seq - 1;
        let result = self
            .with_store(move |store| store.snapshot(&state, seq))
            .await;
        match result {
            Ok(()) => {
                self.since_snapshot = 0;
                if self.needs_snapshot {
                    // The first durable write of a new history: it covers every record.
                    self.needs_snapshot = false;
                    self.unsynced.clear();
                    self.record_history();
                    self.publisher
                        .publish(snapshot_of(&self.engine, self.clock.now()));
                }
            }
            Err(e) => {
                self.store_failed(&e);
                warn!(error = %e, source = %ErrorChain(&e), "cannot write a snapshot; the journal keeps growing until one succeeds");
                self.on_fenced(&e);
            }
        }
    }

    async fn final_snapshot(&mut self) {
        if self.unsynced.is_empty() {
            self.snapshot().await;
            info!(
                version = self.engine.state().version,
                "engine stopped; state saved"
            );
        } else {
            warn!(
                unwritten = self.unsynced.len(),
                "engine stopped with unwritten records; the store was failing"
            );
        }
    }

    /// Counts what the engine left out of a report, and says so at most once a minute.
    fn count_refused(&mut self, refused: &ReportRefusals) {
        if refused.total() == 0 {
            return;
        }
        for (kind, n) in refused.by_reason() {
            if n > 0 {
                self.metrics
                    .reports_refused
                    .get_or_create(&KindLabel { kind })
                    .inc_by(n as u64);
            }
        }
        if let Some(held) = self.reports_refused_said.ready(Instant::now()) {
            warn!(
                unknown_model = refused.unknown_model,
                unknown_endpoint = refused.unknown_endpoint,
                limit = refused.limit,
                held_back = held,
                "report entries not counted: models not managed here, endpoints outside the configured pools, or new endpoints beyond blocking.fleet.max_endpoints"
            );
        }
    }

    fn update_metrics(&mut self, decisions: &[Decision]) {
        let m = &self.metrics;
        let s = self.engine.state();
        for d in decisions {
            m.decisions
                .get_or_create(&KindLabel { kind: d.kind() })
                .inc();
            match d {
                Decision::Transition {
                    model, from, to, ..
                } => {
                    let direction = if to > from { "up" } else { "down" };
                    m.transitions
                        .get_or_create(&TransitionLabels {
                            model: model.into(),
                            direction,
                        })
                        .inc();
                    info!(model = %model, from = %from, to = %to, decision = %d, "ladder moved");
                }
                Decision::Blocked { .. } => {
                    m.blocks.inc();
                    info!(decision = %d, "endpoint blocked");
                }
                Decision::AlertActive {
                    unmapped: Some(_), ..
                } => {
                    m.alerts_unmapped.inc();
                }
                Decision::Override { action, .. } => {
                    m.overrides
                        .get_or_create(&ActionLabel {
                            action: action.into(),
                        })
                        .inc();
                    info!(decision = %d, "override applied");
                }
                Decision::FlapPinned { .. } => warn!(decision = %d, "flap guard engaged"),
                Decision::AlertLimit {
                    source, refused, ..
                } => {
                    m.alerts_rejected
                        .get_or_create(&RejectLabels {
                            source: source.as_str(),
                            reason: "limit",
                        })
                        .inc_by(*refused as u64);
                    warn!(decision = %d, "alert limit reached (alerts.max_active or alerts.max_bytes)");
                }
                Decision::BlockLimit { refused, .. } => {
                    m.blocks_refused
                        .get_or_create(&KindLabel { kind: "limit" })
                        .inc_by(*refused as u64);
                    if let Some(held) = self.block_limit_said.ready(Instant::now()) {
                        warn!(decision = %d, held_back = held, "block limit reached (blocking.max_blocks)");
                    }
                }
                _ => {}
            }
        }
        for (name, route) in &s.published.models {
            m.model_rung
                .get_or_create(&ModelLabel { model: name.into() })
                .set(route.rung.index() as i64);
        }
        for (name, st) in &s.models {
            m.flap_pinned
                .get_or_create(&ModelLabel { model: name.into() })
                .set(i64::from(st.pin.is_some()));
        }
        let frozen = if s.global_freeze.is_some() {
            s.models.len()
        } else {
            s.models.values().filter(|m| m.freeze.is_some()).count()
        };
        m.frozen.set(frozen as i64);
        m.dry_run.set(i64::from(s.dry_run.is_some()));
        m.alerts_active.set(s.alerts.len() as i64);
        m.blocks_active.set(s.blocks.len() as i64);
        m.route_version
            .set(i64::try_from(s.version).unwrap_or(i64::MAX));
    }
}

/// Resolves when the role changed; never without roles.
async fn role_changed(role: &mut Option<watch::Receiver<Role>>) {
    match role {
        Some(rx) => {
            if rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
        None => std::future::pending().await,
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

/// An engine with a store's state replayed.
struct Replayed {
    engine: Engine,
    /// The last journal position applied.
    seq: u64,
    /// The state came from a snapshot (else from nothing).
    snapshotted: bool,
    /// Journal records replayed.
    replayed: usize,
}

/// The engine `loaded` makes: its journal replayed over its snapshot (or over a fresh
/// state under `config`), under the configuration its inputs were first stepped
/// under: the one in force when the snapshot was taken.
fn replay(loaded: Loaded, config: &Config, now: Timestamp) -> Replayed {
    let snapshotted = loaded.snapshot.is_some();
    let (state, mut seq) = match loaded.snapshot {
        Some((state, seq)) => (state, seq),
        None => (Engine::fresh_state(new_epoch(now), now), 0),
    };
    let replay_config = state
        .config
        .as_deref()
        .cloned()
        .unwrap_or_else(|| config.clone());
    let mut engine = Engine::new(replay_config, state, now);
    let replayed = loaded.journal.len();
    for record in loaded.journal {
        engine.step(record.input, record.at);
        seq = record.seq;
    }
    Replayed {
        engine,
        seq,
        snapshotted,
        replayed,
    }
}

fn snapshot_of(engine: &Engine, now: Timestamp) -> Snapshot {
    let s = engine.state();
    let alerts = AlertSummary {
        active: s.alerts.len(),
        unmapped: s.alerts.values().filter(|r| r.condition.is_none()).count(),
    };
    Snapshot::new(
        engine.route_table(),
        engine.model_status(now),
        engine.block_status(now),
        s.dry_run.clone(),
        s.global_freeze.clone(),
        alerts,
    )
}
