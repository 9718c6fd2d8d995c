//! The audit history as adapters subscribe to it.

use stanch_api::Timestamp;
use stanch_core::Decision;

/// Decisions made durable at one moment, as subscribers get them.
#[derive(Debug, Clone)]
pub struct Recorded {
    /// When they were made.
    pub at: Timestamp,
    /// The decisions, in order (lease renewals left out).
    pub decisions: Vec<Decision>,
}
