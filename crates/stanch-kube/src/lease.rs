//! Leader election on a `coordination.k8s.io/v1` Lease, as a state machine without
//! I/O: what to write, and whether this replica may decide and write now.
//!
//! Every replica reads the Lease and [`Elector::step`]s: it renews a lease it holds,
//! takes one that is free or expired, and otherwise follows its holder until the lease
//! would expire. Every write of the Lease carries the `resourceVersion` it was read
//! at, so of two replicas taking an expired lease at once, one write fails with 409
//! and that replica follows.
//!
//! **Fencing.** A replica leads only while [`Elector::leads`]: until the time it sent
//! its last successful write, plus the lease duration, less the clock skew allowed
//! between replicas. It measures from the moment it *sent* the write, so a write that
//! took long to land shortens its term rather than stretching it, and a replica that
//! paused past its term wakes up no longer leading: it must read and renew before it
//! writes again, and the renewal fails if another has taken over. A follower takes an
//! expired lease only after `renewTime + leaseDuration` by its own clock; with clocks
//! within the skew of each other, the old term has ended by then.
//!
//! **Handover.** [`Elector::release`] gives the lease up (SIGTERM): it writes the
//! lease as expired, so a successor takes it at its next look, in about a second
//! rather than a lease duration.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::LeaseSpec;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use stanch_api::Timestamp;

/// What to do about the Lease as last read.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// Write this spec (with the resourceVersion read): taking the lease.
    Acquire(LeaseSpec),
    /// Write this spec (with the resourceVersion read): renewing the lease held.
    Renew(LeaseSpec),
    /// Another replica holds a live lease; look again by `until`, when it would expire.
    Follow {
        /// The holder.
        holder: String,
        /// When its lease expires unless renewed.
        until: Timestamp,
    },
}

/// One replica's side of the election.
#[derive(Debug, Clone)]
pub struct Elector {
    identity: String,
    duration: Duration,
    skew: Duration,
    /// When the last successful write of the lease was sent.
    term_from: Option<Timestamp>,
}

impl Elector {
    /// A candidate named `identity` (its pod name), for leases of `duration`, with
    /// replicas' clocks within `skew` of each other.
    pub fn new(identity: impl Into<String>, duration: Duration, skew: Duration) -> Elector {
        Elector {
            identity: identity.into(),
            duration,
            skew: skew.min(duration / 2),
            term_from: None,
        }
    }

    /// Its identity.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// How often to renew: a third of the lease, so two renewals can fail before it
    /// lapses.
    pub fn renew_every(&self) -> Duration {
        self.duration / 3
    }

    /// What to do about `lease` (`None`: there is none yet) at `now`.
    pub fn step(&self, lease: Option<&LeaseSpec>, now: Timestamp) -> Step {
        let holder = lease
            .and_then(|l| l.holder_identity.as_deref())
            .filter(|h| !h.is_empty());
        let expires = lease.and_then(expiry);
        let spec = |acquired: Option<MicroTime>, transitions: i32| LeaseSpec {
            holder_identity: Some(self.identity.clone()),
            lease_duration_seconds: Some(
                i32::try_from(self.duration.as_secs()).unwrap_or(i32::MAX),
            ),
            acquire_time: acquired.or_else(|| Some(crate::micro_time(now))),
            renew_time: Some(crate::micro_time(now)),
            lease_transitions: Some(transitions),
            ..LeaseSpec::default()
        };
        let transitions = lease.and_then(|l| l.lease_transitions).unwrap_or(0);
        match (holder, expires) {
            (Some(h), _) if h == self.identity => Step::Renew(spec(
                lease.and_then(|l| l.acquire_time.clone()),
                transitions,
            )),
            (Some(h), Some(until)) if until > now => Step::Follow {
                holder: h.to_owned(),
                until,
            },
            // Free, expired, or released.
            (previous, _) => Step::Acquire(spec(
                None,
                if previous.is_some() || lease.is_some() {
                    transitions.saturating_add(1)
                } else {
                    0
                },
            )),
        }
    }

    /// The write of an `Acquire` or `Renew` sent at `sent` succeeded: a term begins (or
    /// goes on) from `sent`.
    pub fn written(&mut self, sent: Timestamp) {
        self.term_from = Some(sent);
    }

    /// The write failed (another replica wrote first), or the lease was found held by
    /// another: no term.
    pub fn lost(&mut self) {
        self.term_from = None;
    }

    /// Whether this replica may decide and write at `now`.
    pub fn leads(&self, now: Timestamp) -> bool {
        self.term_ends().is_some_and(|end| now < end)
    }

    /// When its term ends (exclusive), if it has one: the send time of its last
    /// successful write, plus the lease duration, less the skew allowed.
    pub fn term_ends(&self) -> Option<Timestamp> {
        self.term_from
            .map(|from| from + self.duration.saturating_sub(self.skew))
    }

    /// The spec that gives `lease` up, if this replica holds it: expired at once, so a
    /// successor takes it at its next look. The term ends now, whether the write lands
    /// or not.
    pub fn release(&mut self, lease: &LeaseSpec, now: Timestamp) -> Option<LeaseSpec> {
        self.term_from = None;
        (lease.holder_identity.as_deref() == Some(self.identity.as_str())).then(|| LeaseSpec {
            holder_identity: None,
            renew_time: Some(crate::micro_time(now)),
            lease_duration_seconds: Some(1),
            ..lease.clone()
        })
    }
}

/// When a lease expires unless renewed: its renewal plus its duration.
fn expiry(lease: &LeaseSpec) -> Option<Timestamp> {
    let renewed = lease.renew_time.as_ref()?;
    let seconds = u64::try_from(lease.lease_duration_seconds?).unwrap_or(0);
    let renewed = Timestamp::from_millis(renewed.0.as_millisecond());
    Some(renewed + Duration::from_secs(seconds))
}

#[cfg(test)]
mod tests;
