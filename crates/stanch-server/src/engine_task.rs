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
use stanch_core::{Config, Decision, Engine, Input};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tracing::{Instrument, error, info, info_span, warn};

use crate::clock::Clock;
use crate::history::History;
use crate::metrics::{ActionLabel, KindLabel, ModelLabel, TransitionLabels};
use crate::publish::{Publisher, Snapshot};
use crate::store::{Record, StateStore, StoreError};

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
    /// Set when the state was unreadable at start.
    pub recovered_from_corruption: Option<String>,
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
    /// Loads state from `store` (replaying its journal), and builds the task.
    pub fn start(
        config: Config,
        mut store: Box<dyn StateStore>,
        history: Arc<History>,
        metrics: Arc<crate::metrics::Metrics>,
        clock: Arc<dyn Clock>,
    ) -> Result<Started, StoreError> {
        let loaded = store.load()?;
        let now = clock.now();
        if let Some(why) = &loaded.corruption {
            error!(store = store.kind(), problem = %why, "state was unreadable: starting over under a new epoch; versions restart");
            metrics.state_corrupt_recovered.set(1);
        }
        let snapshot_seq = loaded.snapshot.as_ref().map(|(_, seq)| *seq);
        let (state, mut seq) = match loaded.snapshot {
            Some((state, seq)) => (state, seq),
            None => (Engine::fresh_state(new_epoch(now), now), 0),
        };
        // The journal is replayed under the configuration its inputs were first stepped
        // under: the one in force when the snapshot was taken.
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
        // What is durable now; published as it is if the start's own records cannot
        // be written, so no version is shown that a crash could take back.
        let restored = snapshot_of(&engine, now);
        // The configuration given at start is the one in force from now on; if it is
        // not the one the journal left, the change is an input like any policy change.
        let first_input = if engine.config() == &config {
            Input::Tick
        } else {
            Input::Configure {
                config: Box::new(config),
            }
        };
        let reconfigured = !matches!(first_input, Input::Tick);
        let first = engine.step(first_input.clone(), now);
        info!(
            epoch = %engine.state().epoch,
            version = engine.state().version,
            replayed,
            alerts = engine.state().alerts.len(),
            "state restored"
        );
        let health = Arc::new(StoreHealth {
            kind: store.kind(),
            healthy: AtomicBool::new(true),
            recovered_from_corruption: loaded.corruption,
        });
        let mut next_seq = seq + 1;
        let mut unsynced = Vec::new();
        if first.changed {
            unsynced.push(Record {
                seq: next_seq,
                at: now,
                input: first_input,
            });
            next_seq += 1;
        }
        // A history without a snapshot has its epoch nowhere on disk: until one is
        // written, every durable write is a snapshot (it covers every record).
        let mut needs_snapshot = snapshot_seq.is_none();
        let written = if needs_snapshot {
            store.snapshot(engine.state(), next_seq - 1)
        } else {
            store.append(&unsynced).map(|()| {
                // Compact at start so replay stays short across restarts.
                if let Err(e) = store.snapshot(engine.state(), next_seq - 1) {
                    warn!(error = %e, source = %ErrorChain(&e), "cannot write a snapshot at start; the journal keeps everything");
                }
            })
        };
        let published = match written {
            Ok(()) => {
                // A change of policy at start is in the history, once it is durable.
                if reconfigured
                    && let Err(e) = history.record(now, &first.decisions, engine.dry_run())
                {
                    warn!(error = %e, "cannot write the history file; entries kept in memory only");
                }
                unsynced.clear();
                needs_snapshot = false;
                snapshot_of(&engine, now)
            }
            Err(e) => {
                error!(error = %e, source = %ErrorChain(&e), "cannot write state at start; serving the restored table, refusing input until the store recovers");
                health.healthy.store(false, Ordering::Relaxed);
                restored
            }
        };
        let publisher = Arc::new(Publisher::new(published));
        let (tx, rx) = mpsc::channel(4096);
        let task = EngineTask {
            engine,
            store: Some(store),
            next_seq,
            since_snapshot: 0,
            snapshot_every: SNAPSHOT_EVERY,
            needs_snapshot,
            unsynced,
            unsynced_decisions: Vec::new(),
            history,
            publisher: publisher.clone(),
            metrics,
            clock,
            health: health.clone(),
            rx,
        };
        task.update_metrics(&first.decisions);
        Ok(Started {
            handle: EngineHandle { tx },
            task,
            publisher,
            health,
        })
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

    /// Runs until `shutdown` resolves, then writes a final snapshot.
    pub async fn run(mut self, shutdown: impl std::future::Future<Output = ()>) {
        let span = info_span!("engine");
        async move {
            tokio::pin!(shutdown);
            loop {
                let sleep = self.sleep_duration();
                let mut jobs = Vec::new();
                tokio::select! {
                    biased;
                    () = &mut shutdown => break,
                    job = self.rx.recv() => match job {
                        Some(job) => jobs.push(job),
                        None => break,
                    },
                    () = tokio::time::sleep(sleep) => {}
                }
                while jobs.len() < MAX_BATCH {
                    match self.rx.try_recv() {
                        Ok(job) => jobs.push(job),
                        Err(_) => break,
                    }
                }
                self.commit(jobs).await;
            }
            self.final_snapshot().await;
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
            let step = self.engine.step(job.input.clone(), now);
            if step.changed {
                self.unsynced.push(Record {
                    seq: self.next_seq,
                    at: now,
                    input: job.input,
                });
                self.next_seq += 1;
            }
            self.unsynced_decisions
                .push((now, step.decisions.clone(), dry_run));
            answered.push((job.reply, job.arrived, step.decisions));
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
            for (reply, _, decisions) in answered {
                let _ = reply.send(Ok(Applied { decisions, version }));
            }
            self.unsynced_decisions.clear();
            return;
        }

        let records = std::mem::take(&mut self.unsynced);
        let decisions = std::mem::take(&mut self.unsynced_decisions);
        let snapshot = self
            .needs_snapshot
            .then(|| (self.engine.state().clone(), self.next_seq - 1));
        let wrote_snapshot = snapshot.is_some();
        let mut store = self.store.take().expect("store present between commits");
        let history = self.history.clone();
        let joined = tokio::task::spawn_blocking(move || {
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
            (store, result, records, decisions)
        })
        .await;
        let (store, result, records, decisions) = match joined {
            Ok(parts) => parts,
            Err(e) => panic!("state store task panicked: {e}"),
        };
        self.store = Some(store);
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
                for (reply, arrived, decisions) in answered {
                    self.metrics
                        .publish_latency
                        .observe(arrived.elapsed().as_secs_f64());
                    let _ = reply.send(Ok(Applied { decisions, version }));
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
                for (reply, _, _) in answered {
                    let _ = reply.send(Err(EngineUnavailable::Store { kind: e.kind() }));
                }
            }
        }
    }

    async fn snapshot(&mut self) {
        let state = self.engine.state().clone();
        let seq = self.next_seq - 1;
        let mut store = self.store.take().expect("store present between commits");
        let (store, result) = tokio::task::spawn_blocking(move || {
            let r = store.snapshot(&state, seq);
            (store, r)
        })
        .await
        .expect("snapshot task");
        self.store = Some(store);
        match result {
            Ok(()) => self.since_snapshot = 0,
            Err(e) => {
                self.metrics
                    .store_errors
                    .get_or_create(&KindLabel { kind: e.kind() })
                    .inc();
                warn!(error = %e, source = %ErrorChain(&e), "cannot write a snapshot; the journal keeps growing until one succeeds");
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

    fn update_metrics(&self, decisions: &[Decision]) {
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
                            model: model.clone(),
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
                            action: action.clone(),
                        })
                        .inc();
                    info!(decision = %d, "override applied");
                }
                Decision::FlapPinned { .. } => warn!(decision = %d, "flap guard engaged"),
                _ => {}
            }
        }
        for (name, route) in &s.published.models {
            m.model_rung
                .get_or_create(&ModelLabel {
                    model: name.clone(),
                })
                .set(route.rung.index() as i64);
        }
        for (name, st) in &s.models {
            m.flap_pinned
                .get_or_create(&ModelLabel {
                    model: name.clone(),
                })
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

fn snapshot_of(engine: &Engine, now: Timestamp) -> Snapshot {
    let s = engine.state();
    let alerts = AlertSummary {
        active: s.alerts.len(),
        unmapped: s.alerts.values().filter(|r| r.condition.is_none()).count(),
    };
    Snapshot::new(
        engine.route_table(),
        engine.model_status(),
        engine.block_status(now),
        s.dry_run.clone(),
        s.global_freeze.clone(),
        alerts,
    )
}
