//! An endpoint as `/v1/status` shows it.

use std::sync::atomic::Ordering;
use std::time::Duration;

use stanch_api::Timestamp;
use tokio::time::Instant;

use super::{Endpoint, Kind};

/// An endpoint's state, for `/v1/status`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct EndpointStatus {
    /// URL.
    pub url: String,
    /// Model.
    pub model: String,
    /// Pool.
    pub pool: String,
    /// `ok`, `blocked` or `slow_start`.
    pub state: &'static str,
    /// Seconds left on a local block.
    pub blocked_for_seconds: Option<u64>,
    /// Failures in a row.
    pub consecutive_failures: u32,
    /// Totals.
    pub successes: u64,
    /// Totals.
    pub failures: u64,
    /// The estimate whole answers are chosen by: milliseconds per unit of work.
    pub ms_per_token: Option<f64>,
    /// The estimate streams are chosen by: milliseconds to the first token.
    pub first_token_ms: Option<f64>,
    /// Requests in flight.
    pub in_flight: u32,
    /// When it last answered well.
    pub last_success: Option<Timestamp>,
    /// When it last failed, and how.
    pub last_failure: Option<(Timestamp, &'static str)>,
}

impl Endpoint {
    /// The endpoint's state for `/v1/status`.
    pub fn status(&self, now: Instant, slow_start: Duration) -> EndpointStatus {
        let h = self.health.lock().expect("endpoint lock");
        let blocked = h.blocked_until.filter(|u| *u > now);
        let ramping = h
            .block_ended
            .is_some_and(|e| e <= now && now.duration_since(e) < slow_start);
        EndpointStatus {
            url: self.url.clone(),
            model: self.model.clone(),
            pool: self.pool.clone(),
            state: if blocked.is_some() {
                "blocked"
            } else if ramping {
                "slow_start"
            } else {
                "ok"
            },
            blocked_for_seconds: blocked.map(|u| u.duration_since(now).as_secs()),
            consecutive_failures: h.consecutive(),
            successes: h.successes,
            failures: h.failures,
            ms_per_token: h.cost[Kind::Whole as usize].map(|c| c.at(now)),
            first_token_ms: h.cost[Kind::Stream as usize].map(|c| c.at(now)),
            in_flight: self.in_flight.load(Ordering::Relaxed),
            last_success: h.last_success,
            last_failure: h.last_failure,
        }
    }
}
