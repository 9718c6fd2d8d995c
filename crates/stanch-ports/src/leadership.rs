//! Whether this replica decides.
//!
//! With several replicas, one (the leader) steps the engine and writes state; the
//! others follow. A follower refuses what would change state (alerts, reports,
//! overrides) with `503` and `Retry-After: 1`, naming the leader when it knows it
//! (`X-Stanch-Leader`), rather than forwarding it: Alertmanager retries a webhook that
//! failed with a 5xx, gateways send their next report a few seconds later, and an
//! operator's `stanch ctl` says where to go. Nothing is taken that the leader has not
//! made durable, so nothing acknowledged is lost across a change of leader. Reads
//! (routes, the watch, status) are served by every replica.
//!
//! Without a cluster there is one replica, always the leader ([`Leadership::single`]).

use std::sync::Arc;

use tokio::sync::watch;

/// This replica's part.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// It decides and writes.
    Leader,
    /// Another replica decides.
    Follower {
        /// The leader's identity, if known.
        leader: Option<String>,
    },
}

/// This replica's role, as the election last settled it; the engine task is told of
/// every change.
#[derive(Debug)]
pub struct Leadership {
    role: watch::Sender<Role>,
}

impl Leadership {
    /// A replica alone: always the leader.
    pub fn single() -> Arc<Leadership> {
        Arc::new(Leadership {
            role: watch::Sender::new(Role::Leader),
        })
    }

    /// A replica that follows until an election makes it the leader.
    pub fn following(leader: Option<String>) -> Arc<Leadership> {
        Arc::new(Leadership {
            role: watch::Sender::new(Role::Follower { leader }),
        })
    }

    /// Its role now.
    pub fn role(&self) -> Role {
        self.role.borrow().clone()
    }

    /// Whether it leads now.
    pub fn leads(&self) -> bool {
        *self.role.borrow() == Role::Leader
    }

    /// Sets its role (the election's outcome).
    pub fn set(&self, role: Role) {
        self.role.send_if_modified(|r| {
            let changed = *r != role;
            *r = role;
            changed
        });
    }

    /// Told of every change of role.
    pub fn subscribe(&self) -> watch::Receiver<Role> {
        self.role.subscribe()
    }
}
