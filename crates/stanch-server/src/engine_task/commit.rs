//! Group commit: every queued input stepped, the changed ones appended to the
//! journal with one fsync, then published and answered; snapshots; and what a
//! failing or taken-over store does to all of that.

use std::sync::atomic::Ordering;

use stanch_api::Timestamp;
use stanch_core::engine::ReportRefusals;
use stanch_core::{Decision, Input};
use stanch_ports::store::{Record, StateStore, StoreError};
use tokio::sync::oneshot;
use tokio::time::Instant;
use tracing::{error, info, warn};

use super::replay::snapshot_of;
use super::{Applied, EngineTask, EngineUnavailable, Job, MAX_UNSYNCED};
use crate::metrics::KindLabel;
use stanch_log::Sources;

impl EngineTask {
    /// Steps every job and the tick at one time, writes what changed with one
    /// durable write, then publishes and answers; if the write fails, nothing is
    /// published, every job is refused, and the records are written first next time.
    pub(super) async fn commit(&mut self, jobs: Vec<Job>) {
        let now = self.clock.now();
        let answered = self.step_jobs(jobs, now);
        if self.unsynced.is_empty() {
            let version = self.engine.state().version;
            for waiting in answered {
                waiting.answer(version);
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
                let written = if wrote_snapshot {
                    None
                } else {
                    Some(records.len())
                };
                self.durable(written, decisions, answered, now).await;
            }
            Err(e) => {
                self.unsynced = records;
                self.unsynced_decisions = decisions;
                self.not_durable(&e, answered);
            }
        }
    }

    /// Steps each job (a report as the engine admits it) and then the tick, keeping
    /// the inputs that changed state as records to write; past [`MAX_UNSYNCED`]
    /// records held, a job is refused at once.
    fn step_jobs(&mut self, jobs: Vec<Job>, now: Timestamp) -> Vec<Waiting> {
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
                self.keep(input, now);
            }
            self.unsynced_decisions
                .push((now, step.decisions.clone(), dry_run));
            answered.push(Waiting {
                reply: job.reply,
                arrived: job.arrived,
                decisions: step.decisions,
                refused,
            });
        }
        let tick = self.engine.step(Input::Tick, now);
        if tick.changed {
            self.keep(Input::Tick, now);
            self.unsynced_decisions.push((now, tick.decisions, dry_run));
        }
        answered
    }

    /// Holds `input`, stepped at `now`, as the next record to write.
    fn keep(&mut self, input: Input, now: Timestamp) {
        self.unsynced.push(Record {
            seq: self.next_seq,
            at: now,
            input,
        });
        self.next_seq += 1;
    }

    /// After a durable write of `written` records (`None`: a snapshot): publish,
    /// answer, and take a snapshot when enough records have gone by.
    async fn durable(
        &mut self,
        written: Option<usize>,
        decisions: Vec<(Timestamp, Vec<Decision>, bool)>,
        answered: Vec<Waiting>,
        now: Timestamp,
    ) {
        self.health.healthy.store(true, Ordering::Relaxed);
        match written {
            None => {
                self.needs_snapshot = false;
                self.since_snapshot = 0;
            }
            Some(n) => self.since_snapshot += n as u64,
        }
        let all: Vec<Decision> = decisions.into_iter().flat_map(|(_, d, _)| d).collect();
        self.update_metrics(&all);
        self.publisher.publish(snapshot_of(&self.engine, now));
        let version = self.engine.state().version;
        for waiting in answered {
            self.metrics
                .publish_latency
                .observe(waiting.arrived.elapsed().as_secs_f64());
            waiting.answer(version);
        }
        if self.since_snapshot >= self.snapshot_every {
            self.snapshot().await;
        }
    }

    /// After a failed write: said once until the store recovers, counted, and every
    /// job refused with a retryable error.
    fn not_durable(&mut self, e: &StoreError, answered: Vec<Waiting>) {
        if self.health.healthy.swap(false, Ordering::Relaxed) {
            error!(error = %e, source = %Sources(e), "cannot write the journal; holding decisions unpublished and refusing acknowledgements until it recovers");
        }
        self.metrics
            .store_errors
            .get_or_create(&KindLabel { kind: e.kind() })
            .inc();
        for waiting in answered {
            let _ = waiting
                .reply
                .send(Err(EngineUnavailable::Store { kind: e.kind() }));
        }
        self.on_fenced(e);
    }

    /// Another replica took the store over: this one stops deciding at once, and does
    /// not take it back before its role changes.
    pub(super) fn on_fenced(&mut self, e: &StoreError) {
        if self.role.is_some() && matches!(e, StoreError::Fenced { .. }) {
            error!(error = %e, "the state store was taken over by another replica: no longer deciding");
            self.fenced = true;
            self.step_down();
        }
    }

    pub(super) async fn snapshot(&mut self) {
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
                warn!(error = %e, source = %Sources(&e), "cannot write a snapshot; the journal keeps growing until one succeeds");
                self.on_fenced(&e);
            }
        }
    }

    pub(super) async fn final_snapshot(&mut self) {
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

    /// Runs `f` on the store off the runtime's threads (its calls block: fsync, or a
    /// round trip to the API server), and puts the store back.
    pub(super) async fn with_store<T: Send + 'static>(
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
    pub(super) fn store_failed(&self, e: &StoreError) {
        self.metrics
            .store_errors
            .get_or_create(&KindLabel { kind: e.kind() })
            .inc();
    }
}

/// A job stepped, waiting for its input to be durable before it is answered.
struct Waiting {
    reply: oneshot::Sender<Result<Applied, EngineUnavailable>>,
    arrived: Instant,
    decisions: Vec<Decision>,
    refused: ReportRefusals,
}

impl Waiting {
    fn answer(self, version: u64) {
        let _ = self.reply.send(Ok(Applied {
            decisions: self.decisions,
            version,
            refused: self.refused,
        }));
    }
}
