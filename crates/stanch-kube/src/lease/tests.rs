//! The tests of `lease`.

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
