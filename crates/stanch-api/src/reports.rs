//! Gateway outcome reports (`POST /v1/reports`): what each replica saw of each endpoint,
//! so the controller can block an endpoint fleet-wide when one replica discovers it.

use serde::{Deserialize, Serialize};

/// One gateway's counts since its previous report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReportBatch {
    /// The reporting gateway's identity.
    pub gateway: String,
    /// Per (endpoint, model).
    pub endpoints: Vec<EndpointReport>,
}

/// Counts for one endpoint serving one model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointReport {
    /// The endpoint as the gateway names it (its URL).
    pub endpoint: String,
    /// The model.
    pub model: String,
    /// Successful answers since the last report.
    pub successes: u64,
    /// Endpoint failures since the last report (caller faults excluded).
    pub failures: u64,
    /// The longest run of failures in a row since the last report, including a run
    /// still going (a gateway's own block may have ended it; the run still counts).
    /// The controller holds it to what the reports can show: a run grows by at most
    /// the `failures` of each report, so it is counted as at most this gateway's
    /// previous run plus `failures`.
    pub consecutive_failures: u32,
}

/// The answer to a report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReportResponse {
    /// Endpoint entries taken (entries naming one pair twice are added together).
    pub accepted: usize,
    /// Entries not counted: for a model the controller does not manage, for an
    /// endpoint outside the model's configured pools, or for a new endpoint beyond
    /// the controller's `blocking.fleet.max_endpoints`. Not retried: sending them
    /// again changes nothing.
    #[serde(default)]
    pub refused: usize,
    /// The route version after them.
    pub version: u64,
}

/// The most endpoints one report may carry.
pub const MAX_REPORT_ENDPOINTS: usize = 10_000;

/// The largest count of successes or failures one report may carry for an endpoint:
/// a billion, more than any gateway answers between two reports.
pub const MAX_REPORT_COUNT: u64 = 1_000_000_000;

impl ReportBatch {
    /// Checks a report from the wire; the error names the field.
    pub fn validate(&self) -> Result<(), crate::Invalid> {
        use crate::Invalid;
        if self.gateway.trim().is_empty() || self.gateway.len() > 128 {
            return Err(Invalid::new("gateway", "1 to 128 characters"));
        }
        if self.endpoints.len() > MAX_REPORT_ENDPOINTS {
            return Err(Invalid::new(
                "endpoints",
                format!("at most {MAX_REPORT_ENDPOINTS}"),
            ));
        }
        for (i, e) in self.endpoints.iter().enumerate() {
            if !crate::routes::valid_endpoint(&e.endpoint) {
                return Err(Invalid::new(
                    format!("endpoints[{i}].endpoint"),
                    format!(
                        "1 to {} bytes, no control characters",
                        crate::routes::MAX_ENDPOINT_BYTES
                    ),
                ));
            }
            if e.model.trim().is_empty() || e.model.len() > crate::routes::MAX_MODEL_BYTES {
                return Err(Invalid::new(
                    format!("endpoints[{i}].model"),
                    format!("1 to {} bytes", crate::routes::MAX_MODEL_BYTES),
                ));
            }
            for (field, n) in [("successes", e.successes), ("failures", e.failures)] {
                if n > MAX_REPORT_COUNT {
                    return Err(Invalid::new(
                        format!("endpoints[{i}].{field}"),
                        format!("at most {MAX_REPORT_COUNT}"),
                    ));
                }
            }
            if u64::from(e.consecutive_failures) > MAX_REPORT_COUNT {
                return Err(Invalid::new(
                    format!("endpoints[{i}].consecutive_failures"),
                    format!("at most {MAX_REPORT_COUNT}"),
                ));
            }
        }
        Ok(())
    }
}
