//! Paused time for code that has two clocks: the wall clock it reads through the
//! `Clock` port (`stanch_ports::clock::Clock`: terms, leases, TTLs, timestamps) and
//! tokio's timers it sleeps on (renewal periods, looks, ticks).
//!
//! [`Paused`] pauses tokio's clock and is a `Clock` read off it: the wall time it
//! gives is its start plus the time tokio's clock has moved since. One
//! [`Paused::advance`] (or a timer firing on its own while the runtime idles) moves
//! both together, so a renewal due "a third of the lease later" happens at the wall
//! time a third of the lease later, at no cost in real time, and in order.
//!
//! It fits code that runs in the test's own runtime and talks to nothing outside it
//! (a scripted service, channels). Where a test drives real sockets or processes,
//! tokio's paused clock would jump ahead while a peer is still answering; there the
//! controller's suites move a hand-held `stanch_ports::clock::ManualClock` instead.

use std::time::Duration;

use stanch_api::Timestamp;
use stanch_ports::clock::Clock;
use tokio::time::Instant;

/// tokio's clock, paused, and the wall clock that moves with it.
#[derive(Debug, Clone, Copy)]
pub struct Paused {
    start: Timestamp,
    origin: Instant,
}

impl Paused {
    /// Pauses tokio's clock and starts the wall clock at `start`.
    ///
    /// # Panics
    /// Outside a current-thread runtime (`#[tokio::test]`'s default), or when tokio's
    /// clock is already paused: two owners of one clock would not agree on its start.
    pub fn start(start: Timestamp) -> Paused {
        tokio::time::pause();
        Paused {
            start,
            origin: Instant::now(),
        }
    }

    /// Moves both clocks forward by `by` (and up to a millisecond more: tokio's timers
    /// fire on whole milliseconds), running every timer due on the way, each at its
    /// time.
    pub async fn advance(&self, by: Duration) {
        // A sleep on the paused clock, not `tokio::time::advance`: the runtime jumps
        // from timer to timer, so the tasks woken on the way see the time they were
        // due at, not the end.
        tokio::time::sleep(by).await;
    }

    /// How far both clocks have moved since the start.
    pub fn elapsed(&self) -> Duration {
        self.origin.elapsed()
    }
}

impl Clock for Paused {
    fn now(&self) -> Timestamp {
        let moved = i64::try_from(self.elapsed().as_millis()).unwrap_or(i64::MAX);
        Timestamp::from_millis(self.start.as_millis().saturating_add(moved))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicI64, Ordering};

    use super::*;

    fn at_epoch_second(s: i64) -> Timestamp {
        Timestamp::from_millis(s * 1_000)
    }

    /// Within tokio's millisecond.
    fn about(actual: i64, expected: i64) {
        assert!(
            (expected..=expected + 1).contains(&actual),
            "{actual} ms, not {expected}"
        );
    }

    #[tokio::test]
    async fn both_clocks_move_together_at_no_real_cost() {
        let time = Paused::start(at_epoch_second(1_000));
        assert_eq!(time.now(), at_epoch_second(1_000));
        time.advance(Duration::from_secs(3_600)).await;
        let elapsed = i64::try_from(time.elapsed().as_millis()).unwrap();
        about(elapsed, 3_600_000);
        assert_eq!(time.now().as_millis(), 1_000_000 + elapsed);
    }

    #[tokio::test]
    async fn a_task_woken_on_the_way_reads_the_time_it_was_due_at() {
        let time = Paused::start(at_epoch_second(0));
        let seen = Arc::new(AtomicI64::new(-1));
        let task = {
            let seen = seen.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(1_500)).await;
                seen.store(time.now().as_millis(), Ordering::SeqCst);
            })
        };
        time.advance(Duration::from_secs(10)).await;
        task.await.unwrap();
        about(seen.load(Ordering::SeqCst), 1_500);
        about(time.now().as_millis(), 10_000);
    }

    #[tokio::test]
    #[should_panic(expected = "time is already frozen")]
    async fn one_clock_has_one_owner() {
        let _first = Paused::start(at_epoch_second(0));
        let _second = Paused::start(at_epoch_second(0));
    }
}
