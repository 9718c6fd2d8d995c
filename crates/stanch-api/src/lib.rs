//! Wire types shared by the stanch controller, gateways and clients.
//!
//! This crate owns the shapes that cross a process boundary: the route table that
//! gateways apply, the watch headers, the Alertmanager and Prometheus alert payloads
//! stanch accepts, the admin request bodies and the status report. It owns their
//! parsing and validation at the edge (so that bad input gets an error naming the
//! offending field), and nothing else: no decisions, no IO.

pub mod admin;
pub mod alerts;
pub mod clock;
pub mod duration;
pub mod glob;
pub mod hash;
pub mod headers;
pub mod labels;
pub mod reports;
pub mod routes;
pub mod status;
pub mod time;

pub use duration::HumanDuration;
pub use labels::{Fingerprint, Labels};
pub use routes::{BlockedEndpoint, ModelRoute, RouteTable, Rung};
pub use time::Timestamp;

/// The JSON body of every 4xx and 5xx answer from the controller.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ErrorBody {
    /// A stable machine-readable kind, such as `invalid_payload` or `unauthorized`.
    pub error: String,
    /// What was wrong and where, for a human.
    pub detail: String,
}
