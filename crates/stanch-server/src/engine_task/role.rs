//! Leading and following: a replica that shares its store with others takes charge
//! when the election says it leads, follows the leader's writes otherwise, and steps
//! down the moment it finds the store taken over.

use std::sync::atomic::Ordering;
use std::time::Duration;

use stanch_api::Timestamp;
use stanch_core::Input;
use stanch_core::engine::ReportRefusals;
use stanch_ports::leadership::Role;
use stanch_ports::store::{Loaded, StoreError};
use tokio::sync::watch;
use tracing::{debug, info, warn};

use super::replay::{replay, snapshot_of};
use super::{Applied, EngineTask, EngineUnavailable, Job};
use stanch_log::Sources;

/// Where a follower's engine stands in the leader's history.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Followed {
    /// The journal position of the snapshot replayed from (`None`: from nothing).
    pub(super) snapshot: Option<u64>,
    /// The last journal position applied.
    pub(super) last: u64,
}

/// How often a follower looks at what the leader wrote.
pub(super) const FOLLOW_EVERY: Duration = Duration::from_millis(500);

impl EngineTask {
    /// Takes charge when this replica has become the leader; stops deciding when it
    /// no longer is.
    pub(super) async fn settle_role(&mut self) {
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
    pub(super) async fn take_charge(&mut self) {
        let now = self.clock.now();
        let loaded = self.with_store(|store| store.load()).await;
        let loaded = match loaded {
            Ok(loaded) => loaded,
            Err(e) => {
                self.fenced = matches!(e, StoreError::Fenced { .. });
                self.store_failed(&e);
                warn!(error = %e, source = %Sources(&e), "leading, but cannot take the state store over; trying again");
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
    pub(super) fn step_down(&mut self) {
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
    pub(super) fn refuse(&mut self, jobs: Vec<Job>) {
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
    pub(super) async fn follow(&mut self) {
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
                debug!(error = %e, source = %Sources(&e), "cannot read the leader's state; serving the last table read");
            }
        }
    }

    /// Brings the follower's engine to what `loaded` holds: only the records after the
    /// last one applied when the snapshot is the one replayed from and the journal
    /// still holds that record; else a replay from the snapshot.
    pub(super) fn catch_up(&mut self, loaded: Loaded, now: Timestamp) {
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
}

/// Resolves when the role changed; never without roles.
pub(super) async fn role_changed(role: &mut Option<watch::Receiver<Role>>) {
    match role {
        Some(rx) => {
            if rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
        None => std::future::pending().await,
    }
}
