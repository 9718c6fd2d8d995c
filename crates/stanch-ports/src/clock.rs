//! The one place that reads the wall clock, shared by the controller and the gateway.
//!
//! Everything else gets time from a [`Clock`], so the engine stays deterministic and
//! tests can set the time.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use stanch_api::Timestamp;

/// A source of wall-clock time.
pub trait Clock: Send + Sync + 'static {
    /// The current time.
    fn now(&self) -> Timestamp;
}

/// The system clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    #[expect(
        clippy::disallowed_methods,
        reason = "the one sanctioned wall-clock read"
    )]
    fn now(&self) -> Timestamp {
        let since_epoch = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        Timestamp::from_millis(i64::try_from(since_epoch.as_millis()).unwrap_or(i64::MAX))
    }
}

/// A clock tests move by hand.
#[derive(Debug, Clone)]
pub struct ManualClock(Arc<AtomicI64>);

impl ManualClock {
    /// A clock stopped at `t`.
    pub fn new(t: Timestamp) -> ManualClock {
        ManualClock(Arc::new(AtomicI64::new(t.as_millis())))
    }

    /// Moves the clock forward.
    pub fn advance(&self, d: Duration) {
        self.0.fetch_add(
            i64::try_from(d.as_millis()).unwrap_or(i64::MAX),
            Ordering::SeqCst,
        );
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        Timestamp::from_millis(self.0.load(Ordering::SeqCst))
    }
}
