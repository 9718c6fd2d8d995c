//! What an outcome does to an endpoint: counts and estimates, runs of failures, and
//! the passive blocks they trigger (with backoff, jitter and the never-block list);
//! probes that lift a block early.

use std::sync::atomic::Ordering;
use std::time::Duration;

use stanch_api::Timestamp;
use stanch_api::hash::Fnv64;
use tokio::time::Instant;

use super::cost::FAILURE_PENALTY_MS;
use super::{Endpoint, Health, Kind, Work, glob, next_random};
use crate::config::BlockingPolicy;
use crate::outcome::Outcome;
use crate::table::Applied;
use crate::window::Window;

/// Failures in a row, and when the first of them was seen. A success ends the run
/// only if its request went out after that: one sent before may have been answered
/// before the fault began, and says nothing of the endpoint now.
#[derive(Debug, Clone, Copy)]
pub(super) struct Run {
    pub(super) began: Instant,
    pub(super) failures: u32,
}

/// A block the endpoint just got.
#[derive(Debug, Clone, PartialEq)]
pub struct NewBlock {
    /// Its length.
    pub ttl: Duration,
    /// Backoff level.
    pub strikes: u32,
    /// The trigger that fired.
    pub trigger: &'static str,
}

impl Endpoint {
    /// Records a probe's result while blocked; returns true when it lifted the block.
    /// Probes never count as traffic: not in totals, streaks or latency.
    pub fn probe_result(&self, ok: bool, needed: u32, now: Instant) -> bool {
        let mut h = self.health.lock().expect("endpoint lock");
        if h.blocked_until.is_none_or(|u| u <= now) {
            h.probe_streak = 0;
            return false;
        }
        h.probe_streak = if ok { h.probe_streak + 1 } else { 0 };
        if h.probe_streak < needed {
            return false;
        }
        // Lifted early; the slow start ramps its share up from here.
        h.blocked_until = None;
        h.block_ended = Some(now);
        h.run = None;
        h.probe_streak = 0;
        true
    }

    /// Whether the failure just recorded looks like a one-off to a request that has
    /// had `own` failures here: every failure of the current run is that request's,
    /// and no other request is in flight here. Failures of other requests in the run,
    /// or others out at the same time, say the endpoint is failing, not that one
    /// request was unlucky.
    pub fn one_off_failure(&self, own: u32) -> bool {
        let in_flight = self.in_flight.load(Ordering::Relaxed);
        let h = self.health.lock().expect("endpoint lock");
        in_flight == 0 && h.consecutive() <= own
    }

    /// Whether a local block holds at `now`.
    pub fn blocked(&self, now: Instant) -> Option<Instant> {
        let h = self.health.lock().expect("endpoint lock");
        h.blocked_until.filter(|u| *u > now)
    }

    /// The block the route table puts on this endpoint for its model at `now`, if any:
    /// a lookup in the table's index of blocks, not a scan of them.
    pub fn blocked_by(&self, table: &Applied, now: Timestamp) -> Option<Timestamp> {
        table.block_on(&self.url, &self.model, now)
    }

    /// Records the outcome, known at `now`, of an attempt sent at `sent`, with the
    /// latency it is judged by (a stream's time to first token); returns the block it
    /// triggered, if any.
    #[expect(
        clippy::too_many_arguments,
        reason = "one outcome with everything it says"
    )]
    pub fn record(
        &self,
        outcome: &Outcome,
        sent: Instant,
        latency: Duration,
        work: Work,
        policy: &BlockingPolicy,
        now: Instant,
        wall: Timestamp,
    ) -> Option<NewBlock> {
        let ms = latency.as_secs_f64() * 1e3;
        let mut h = self.health.lock().expect("endpoint lock");
        if !outcome.is_endpoint_failure() {
            if matches!(outcome, Outcome::Success) {
                h.success(sent, ms, work, policy, now, wall);
            }
            return None;
        }
        let in_a_row = h.failure(outcome, ms, policy, now, wall);
        if h.blocked_until.is_some_and(|u| u > now) {
            return None;
        }
        let trigger = trigger(&h, in_a_row, policy, now)?;
        if policy.never_block.iter().any(|p| glob(p, &self.url)) {
            return None;
        }
        let repeat = h
            .last_block
            .is_some_and(|t| now.duration_since(t) <= policy.backoff_reset.0);
        if repeat && self.alone {
            // Blocking the model's only endpoint longer leaves it nowhere to go.
            return None;
        }
        h.strikes = if repeat { h.strikes + 1 } else { 1 };
        let base = policy
            .ttl
            .0
            .saturating_mul(1 << (h.strikes - 1).min(16))
            .min(policy.max_ttl.0.max(policy.ttl.0));
        let ttl = jitter(base, policy.jitter, &self.url, h.strikes);
        h.blocked_until = Some(now + ttl);
        h.block_ended = Some(now + ttl);
        h.last_block = Some(now);
        h.run = None;
        h.window = Window::default();
        Some(NewBlock {
            ttl,
            strikes: h.strikes,
            trigger,
        })
    }
}

impl Health {
    /// A success of a request sent at `sent`: its latency in the estimate of its kind,
    /// and the end of a run of failures that began before it was sent.
    fn success(
        &mut self,
        sent: Instant,
        ms: f64,
        work: Work,
        policy: &BlockingPolicy,
        now: Instant,
        wall: Timestamp,
    ) {
        match work {
            Work::Whole(units) => self.observe(Kind::Whole, ms / f64::from(units.max(1)), now),
            Work::FirstToken => self.observe(Kind::Stream, ms, now),
        }
        if self.run.is_some_and(|run| sent >= run.began) {
            self.run = None;
        }
        self.successes += 1;
        self.last_success = Some(wall);
        self.window.at(now, policy.window.0).0 += 1;
    }

    /// A failure: a peak in both estimates, one more in the run (returned), and a
    /// block of exactly the time a rate-limited answer asked for.
    fn failure(
        &mut self,
        outcome: &Outcome,
        ms: f64,
        policy: &BlockingPolicy,
        now: Instant,
        wall: Timestamp,
    ) -> u32 {
        // A failure is a peak in both estimates: the endpoint is avoided for a while,
        // whichever kind of request failed.
        for kind in [Kind::Whole, Kind::Stream] {
            self.observe(kind, ms.max(FAILURE_PENALTY_MS), now);
        }
        let run = self.run.get_or_insert(Run {
            began: now,
            failures: 0,
        });
        run.failures += 1;
        let in_a_row = run.failures;
        self.peak_streak = self.peak_streak.max(in_a_row);
        self.failures += 1;
        self.last_failure = Some((wall, outcome.label()));
        self.window.at(now, policy.window.0).1 += 1;
        if let Outcome::RateLimited {
            retry_after: Some(d),
        } = outcome
        {
            // The upstream said how long to stay away: a block of exactly that, no strike.
            let until = now + *d;
            if self.blocked_until.is_none_or(|u| u < until) {
                self.blocked_until = Some(until);
            }
        }
        in_a_row
    }

    /// Failures in a row now.
    pub(super) fn consecutive(&self) -> u32 {
        self.run.map_or(0, |run| run.failures)
    }
}

/// What, if anything, a failure `in_a_row` makes a block: consecutive failures, then
/// failures in the window, then the failure rate over the window's requests.
fn trigger(
    h: &Health,
    in_a_row: u32,
    policy: &BlockingPolicy,
    now: Instant,
) -> Option<&'static str> {
    let (successes, failures) = h
        .window
        .within(now, policy.window.0)
        .fold((0, 0), |(ok, failed), (o, f)| (ok + o, failed + f));
    let total = successes + failures;
    if policy.consecutive_failures > 0 && in_a_row >= policy.consecutive_failures {
        Some("consecutive_failures")
    } else if policy.window_failures > 0 && failures >= policy.window_failures {
        Some("window_failures")
    } else if policy.failure_rate > 0.0
        && total >= policy.min_requests
        && f64::from(failures) / f64::from(total) >= policy.failure_rate
    {
        Some("failure_rate")
    } else {
        None
    }
}

fn jitter(d: Duration, fraction: f64, url: &str, strikes: u32) -> Duration {
    let mut h = Fnv64::default();
    h.write(url.as_bytes());
    h.write(&strikes.to_le_bytes());
    h.write(&next_random().to_le_bytes());
    stanch_api::jitter::spread(d, fraction, h.finish())
}
