//! The state rebuilt from the store: its journal replayed over its snapshot, under
//! the configuration its inputs were first stepped under.

use stanch_api::Timestamp;
use stanch_api::status::AlertSummary;
use stanch_core::{Config, Engine, Input};
use stanch_ports::store::Loaded;
use stanch_ports::store::Record;
use tracing::{error, info, warn};

use super::{EngineTask, new_epoch};
use crate::publish::Snapshot;

impl EngineTask {
    /// Puts the engine in the state `loaded` holds: the journal replayed over the
    /// snapshot under the configuration in force when it was taken, then the desired
    /// configuration put in force as an input if it differs. The input (if any) is
    /// queued to be written; with no snapshot yet, the next write is one. Returns the
    /// table of what is durable, before that input.
    pub(super) fn restore(&mut self, loaded: Loaded, now: Timestamp) -> Snapshot {
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
    pub(super) fn record_history(&mut self) {
        for (at, ds, dry) in std::mem::take(&mut self.unsynced_decisions) {
            if let Err(e) = self.history.record(at, &ds, dry) {
                warn!(error = %e, "cannot write the history file; entries kept in memory only");
            }
        }
    }
}

/// An engine with a store's state replayed.
pub(super) struct Replayed {
    pub(super) engine: Engine,
    /// The last journal position applied.
    pub(super) seq: u64,
    /// The state came from a snapshot (else from nothing).
    pub(super) snapshotted: bool,
    /// Journal records replayed.
    pub(super) replayed: usize,
}

/// The engine `loaded` makes: its journal replayed over its snapshot (or over a fresh
/// state under `config`), under the configuration its inputs were first stepped
/// under: the one in force when the snapshot was taken.
pub(super) fn replay(loaded: Loaded, config: &Config, now: Timestamp) -> Replayed {
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

pub(super) fn snapshot_of(engine: &Engine, now: Timestamp) -> Snapshot {
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
