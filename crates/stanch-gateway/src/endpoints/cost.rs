//! The cost estimates an endpoint is chosen by: peak-EWMA latency per kind of request.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::time::Instant;

use super::{Endpoint, Health};

/// The time constant of a cost estimate: a peak fades, and an idle endpoint's cost
/// falls toward zero, by a factor e over this long. Finagle and linkerd use 10 s; a
/// shorter one brings an endpoint back sooner after a single slow answer.
pub const DECAY: Duration = Duration::from_secs(5);
/// The latency a failure counts as, so a failing endpoint is not preferred.
pub(super) const FAILURE_PENALTY_MS: f64 = 1000.0;

/// What a latency sample measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Work {
    /// A whole answer of this many units: output tokens, input tokens for embeddings,
    /// 1 when the answer does not say.
    Whole(u32),
    /// A stream's time to its first token.
    FirstToken,
}

/// Which estimate a request is chosen by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A whole answer: time per unit of work.
    Whole = 0,
    /// A stream: time to first token.
    Stream = 1,
}

/// Each sample moves the estimate at least this far toward it: at thousands of samples a
/// second, where the time between two is nothing, it is a plain EWMA; one scheduling
/// hiccup fades within a few samples instead of sidelining the endpoint for seconds.
const ALPHA: f64 = 0.3;
/// A sample above the estimate moves it at least this far: slowing down shows at once.
const ALPHA_UP: f64 = 0.5;

/// A latency estimate in milliseconds that leans toward peaks and forgets with time: a
/// sample blends in with a weight that grows with the time since the last (all of it
/// after long enough), at least [`ALPHA`], and at least [`ALPHA_UP`] when it is higher;
/// between samples the estimate decays toward zero.
#[derive(Debug, Clone, Copy)]
pub(super) struct PeakEwma {
    ms: f64,
    at: Instant,
}

impl PeakEwma {
    /// The estimate at `now`, decayed since its last sample.
    pub(super) fn at(self, now: Instant) -> f64 {
        self.ms * self.weight(now)
    }

    /// How much of the estimate is left after the time since its last sample.
    fn weight(self, now: Instant) -> f64 {
        let idle = now.saturating_duration_since(self.at).as_secs_f64();
        (-idle / DECAY.as_secs_f64()).exp()
    }

    pub(super) fn observe(estimate: Option<PeakEwma>, sample: f64, now: Instant) -> PeakEwma {
        let ms = match estimate {
            None => sample,
            Some(e) => {
                let current = e.at(now);
                let floor = if sample > current { ALPHA_UP } else { ALPHA };
                let alpha = (1.0 - e.weight(now)).max(floor);
                current + alpha * (sample - current)
            }
        };
        PeakEwma { ms, at: now }
    }
}

impl Endpoint {
    /// What choosing needs to know of this endpoint at `now`, read under one lock:
    /// the lock is shared by every worker thread, so each taking of it can cost a
    /// cache line's trip between cores.
    pub(super) fn look(&self, now: Instant) -> Look {
        let in_flight = self.in_flight.load(Ordering::Relaxed);
        let h = self.health.lock().expect("endpoint lock");
        Look {
            blocked: h.blocked_until.is_some_and(|u| u > now),
            // Failing right now with a request already out: it gets no second request
            // until one of them comes back well, so a fault costs its in-flight requests
            // plus one at a time, not a burst.
            suspect_busy: in_flight > 0 && h.run.is_some(),
            cost: h.cost,
            block_ended: h.block_ended,
            in_flight,
        }
    }

    /// The cost of sending here, lower is better: the estimate for `kind` × (requests
    /// in flight plus one) / capacity, over the weight and the slow-start ramp after a
    /// block. An unmeasured endpoint is taken to cost what `peer` (its rival) does.
    pub(super) fn score(
        &self,
        look: &Look,
        kind: Kind,
        peer: Option<f64>,
        now: Instant,
        slow_start: Duration,
    ) -> f64 {
        let latency = look.estimate(kind, now).or(peer).unwrap_or(1.0);
        let load = f64::from(look.in_flight + 1) / f64::from(self.capacity.max(1));
        let ramp = match look.block_ended {
            Some(ended) if !slow_start.is_zero() => {
                (now.duration_since(ended).as_secs_f64() / slow_start.as_secs_f64()).clamp(0.1, 1.0)
            }
            _ => 1.0,
        };
        latency * load / (f64::from(self.weight.max(1)) * ramp)
    }

    pub(super) fn success_rate(&self) -> f64 {
        let h = self.health.lock().expect("endpoint lock");
        let total = h.successes + h.failures;
        if total == 0 {
            1.0
        } else {
            h.successes as f64 / total as f64
        }
    }
}

/// An endpoint's state as [`choose`](super::choose) sees it.
pub(super) struct Look {
    pub(super) blocked: bool,
    pub(super) suspect_busy: bool,
    pub(super) cost: [Option<PeakEwma>; 2],
    pub(super) block_ended: Option<Instant>,
    pub(super) in_flight: u32,
}

impl Look {
    pub(super) fn estimate(&self, kind: Kind, now: Instant) -> Option<f64> {
        self.cost[kind as usize].map(|c| c.at(now))
    }
}

impl Health {
    pub(super) fn observe(&mut self, kind: Kind, ms: f64, now: Instant) {
        let slot = &mut self.cost[kind as usize];
        *slot = Some(PeakEwma::observe(*slot, ms, now));
    }
}
