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
mod tests {
    use proptest::prelude::*;

    use super::*;

    const LEASE: Duration = Duration::from_secs(15);
    const SKEW: Duration = Duration::from_secs(1);

    fn at(ms: i64) -> Timestamp {
        Timestamp::from_millis(1_764_460_800_000 + ms)
    }

    #[test]
    fn a_free_lease_is_taken_renewed_and_followed() {
        let mut a = Elector::new("a", LEASE, SKEW);
        let b = Elector::new("b", LEASE, SKEW);
        let Step::Acquire(spec) = a.step(None, at(0)) else {
            panic!("a free lease is taken")
        };
        assert_eq!(spec.holder_identity.as_deref(), Some("a"));
        assert_eq!(spec.lease_transitions, Some(0));
        a.written(at(0));
        assert!(a.leads(at(0)) && a.leads(at(13_999)) && !a.leads(at(14_000)));
        assert_eq!(
            b.step(Some(&spec), at(5_000)),
            Step::Follow {
                holder: "a".into(),
                until: at(15_000)
            }
        );
        let Step::Renew(renewed) = a.step(Some(&spec), at(5_000)) else {
            panic!("the holder renews")
        };
        assert_eq!(renewed.acquire_time, spec.acquire_time, "same term's start");
        // Expired: taken over, one more transition.
        let Step::Acquire(taken) = b.step(Some(&spec), at(15_001)) else {
            panic!("an expired lease is taken")
        };
        assert_eq!(taken.lease_transitions, Some(1));
    }

    #[test]
    fn a_released_lease_is_taken_at_the_next_look() {
        let mut a = Elector::new("a", LEASE, SKEW);
        let b = Elector::new("b", LEASE, SKEW);
        let Step::Acquire(spec) = a.step(None, at(0)) else {
            panic!()
        };
        a.written(at(0));
        let released = a.release(&spec, at(2_000)).expect("a holds it");
        assert!(!a.leads(at(2_000)), "the term ends at the release");
        assert!(matches!(
            b.step(Some(&released), at(2_500)),
            Step::Acquire(_)
        ));
        assert!(
            b.clone().release(&spec, at(0)).is_none(),
            "b holds nothing to release"
        );
    }

    /// A replica and what it believes.
    struct Replica {
        elector: Elector,
        /// Its clock's offset from true time, within the skew (halved: the skew bounds
        /// the difference between two replicas' clocks).
        offset: i64,
        /// True time until which it is paused (a GC pause, a stalled node).
        paused_until: i64,
        next_look: i64,
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        /// Three replicas with skewed clocks, random pauses and slow writes, sharing
        /// one Lease written by compare-and-set: at no moment do two of them lead.
        /// And the lease does not go unheld for long while someone is up.
        #[test]
        fn two_replicas_never_lead_at_once(
            offsets in proptest::collection::vec(-500i64..=500, 3),
            pauses in proptest::collection::vec((0i64..60_000, 0i64..40_000), 0..6),
            delays in proptest::collection::vec(0i64..3_000, 64),
        ) {
            let mut replicas: Vec<Replica> = offsets
                .iter()
                .enumerate()
                .map(|(i, &offset)| Replica {
                    elector: Elector::new(format!("r{i}"), LEASE, SKEW),
                    offset,
                    paused_until: 0,
                    next_look: 0,
                })
                .collect();
            // The Lease: its spec and resourceVersion.
            let mut lease: Option<(LeaseSpec, u64)> = None;
            // Writes in flight: (lands at, replica, spec, read at version, sent at).
            let mut in_flight: Vec<(i64, usize, LeaseSpec, u64, Timestamp)> = Vec::new();
            let mut writes = 0usize;
            let mut unheld_since: Option<i64> = None;
            for now in (0..120_000).step_by(100) {
                for &(start, length) in &pauses {
                    let victim = (start as usize / 100) % replicas.len();
                    if now == start - start % 100 {
                        replicas[victim].paused_until = start + length;
                    }
                }
                // Writes land, each by compare-and-set on the version it read.
                let mut landed = Vec::new();
                in_flight.retain(|w| {
                    let due = w.0 <= now;
                    if due {
                        landed.push(w.clone());
                    }
                    !due
                });
                for (_, i, spec, read_at, sent) in landed {
                    let current = lease.as_ref().map_or(0, |(_, v)| *v);
                    if current == read_at {
                        lease = Some((spec, current + 1));
                        replicas[i].elector.written(sent);
                    } else {
                        replicas[i].elector.lost();
                    }
                }
                // Replicas that are up look at the lease when due.
                for (i, r) in replicas.iter_mut().enumerate() {
                    if now < r.paused_until || now < r.next_look {
                        continue;
                    }
                    let local = at(now + r.offset);
                    r.next_look = now + 1_000;
                    let read_at = lease.as_ref().map_or(0, |(_, v)| *v);
                    match r.elector.step(lease.as_ref().map(|(s, _)| s), local) {
                        Step::Acquire(spec) | Step::Renew(spec) => {
                            let delay = delays[writes % delays.len()];
                            writes += 1;
                            in_flight.push((now + delay, i, spec, read_at, local));
                        }
                        Step::Follow { .. } => r.elector.lost(),
                    }
                }
                let leaders: Vec<usize> = replicas
                    .iter()
                    .enumerate()
                    .filter(|(_, r)| r.elector.leads(at(now + r.offset)))
                    .map(|(i, _)| i)
                    .collect();
                prop_assert!(leaders.len() <= 1, "at {} ms, {:?} all lead", now, leaders);
                let anyone_up = replicas.iter().any(|r| now >= r.paused_until);
                match (leaders.is_empty() && anyone_up, unheld_since) {
                    (true, None) => unheld_since = Some(now),
                    (true, Some(since)) => prop_assert!(
                        now - since <= 2 * LEASE.as_millis() as i64 + 4_000,
                        "no leader from {} to {} ms with a replica up", since, now
                    ),
                    (false, _) => unheld_since = None,
                }
            }
        }
    }
}
