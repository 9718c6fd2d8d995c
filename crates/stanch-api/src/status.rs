//! The status report (`GET /v1/status`) and history entries (`GET /v1/history`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{Fingerprint, HumanDuration, Labels, Rung, Timestamp};

/// Everything an on-call engineer needs to see at once.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatusReport {
    /// The route table's epoch.
    pub epoch: String,
    /// The published route version.
    pub version: u64,
    /// When the published version was made.
    pub generated_at: Timestamp,
    /// When this report was made.
    pub now: Timestamp,
    /// Set while dry-run is on: decisions are reported, not published.
    pub dry_run: Option<OverrideInfo>,
    /// Set while every model is frozen.
    pub global_freeze: Option<OverrideInfo>,
    /// Per model.
    pub models: BTreeMap<String, ModelStatus>,
    /// Active endpoint blocks.
    pub blocked: Vec<BlockStatus>,
    /// Gateways seen on the watch API, with the version each applied.
    pub gateways: Vec<GatewayStatus>,
    /// Active alerts by what they map to.
    pub alerts: AlertSummary,
    /// The state store's health.
    pub store: StoreStatus,
}

/// One model's state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelStatus {
    /// The rung in force (published, unless dry-run).
    pub rung: Rung,
    /// The rung automation decided; differs from `rung` only in dry-run.
    pub decided_rung: Rung,
    /// The pool serving the model: the largest share when its traffic is split.
    pub pool: String,
    /// Each pool's share of the model's traffic while it is split (as published);
    /// empty when `pool` takes it all.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shares: Vec<crate::routes::PoolShare>,
    /// The alias model while degraded.
    pub alias: Option<String>,
    /// Since when.
    pub since: Timestamp,
    /// Why.
    pub reason: String,
    /// When the published entry's lease ends.
    pub lease_until: Timestamp,
    /// An operator's pin, if any.
    pub force: Option<ForceInfo>,
    /// A freeze of this model, if any.
    pub freeze: Option<OverrideInfo>,
    /// Set while the flap guard holds the model.
    pub pinned: Option<PinInfo>,
    /// The stabilization window in force, after backoff.
    pub recover_after: HumanDuration,
    /// Unhealthy pools of this model.
    pub unhealthy_pools: Vec<String>,
    /// Alerts acting on this model.
    pub alerts: Vec<Fingerprint>,
    /// Those alerts, each with what it means for the model.
    #[serde(default)]
    pub conditions: Vec<ConditionStatus>,
    /// The next step down the ladder, once the conditions behind the rung have
    /// cleared: `None` while they hold, on the normal rung, and under an override.
    #[serde(default)]
    pub step_down: Option<StepDown>,
    /// A fail-back under way, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failback: Option<FailbackStatus>,
}

/// An alert acting on a model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConditionStatus {
    /// The alert's fingerprint.
    pub fingerprint: Fingerprint,
    /// Its `alertname` label, if any.
    pub alertname: Option<String>,
    /// Its labels.
    pub labels: Labels,
    /// When the alert's condition started (the sender's `startsAt`).
    pub starts_at: Timestamp,
    /// What it means here, e.g. `qwen-72b pool dc-a failing`.
    pub effect: String,
}

/// A step down the ladder the model will take on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepDown {
    /// The rung it steps down to.
    pub to: Rung,
    /// When, if no alert needs the current rung again before then.
    pub at: Timestamp,
}

/// A fail-back under way: the traffic returning to a lower rung in gated steps.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailbackStatus {
    /// The rung the model is on and leaving.
    pub from: Rung,
    /// The rung the traffic returns to.
    pub to: Rung,
    /// The percentage of the traffic back.
    pub percent: u8,
    /// When this step began.
    pub since: Timestamp,
    /// When its gate is first judged (the step's hold over).
    pub judged_at: Timestamp,
    /// The outcomes seen where the traffic returns since the step began:
    /// (successes, failures); `None` when no endpoints are configured there.
    pub outcomes: Option<(u64, u64)>,
}

/// An override's who, why and until when.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OverrideInfo {
    /// Why.
    pub reason: String,
    /// Since when.
    pub since: Timestamp,
    /// When it ends on its own, if ever.
    pub until: Option<Timestamp>,
}

/// A forced rung.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForceInfo {
    /// The pinned rung.
    pub rung: Rung,
    /// Who, why, until when.
    #[serde(flatten)]
    pub info: OverrideInfo,
}

/// The flap guard's hold.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PinInfo {
    /// The model cannot go below this rung until `until`.
    pub rung: Rung,
    /// When the hold ends.
    pub until: Timestamp,
    /// Transitions counted in the window when it tripped.
    pub transitions: usize,
}

/// An endpoint block with its time left.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockStatus {
    /// The endpoint.
    pub endpoint: String,
    /// Its model, or `None` for every model.
    pub model: Option<String>,
    /// When it ends.
    pub until: Timestamp,
    /// Seconds left.
    pub seconds_left: u64,
    /// How many times in a row it was blocked (backoff level).
    pub strikes: u32,
    /// Why.
    pub reason: String,
    /// Who asked for it.
    #[serde(default)]
    pub source: BlockOrigin,
    /// The alert that asked, for a block from an alert.
    #[serde(default)]
    pub alert: Option<Fingerprint>,
    /// When it began.
    #[serde(default)]
    pub since: Timestamp,
}

/// Who asked for an endpoint block.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BlockOrigin {
    /// A `block-endpoint` alert.
    Alert,
    /// The gateways' merged outcome reports.
    Fleet,
    /// An operator through the admin API.
    Operator,
    /// Not told (a controller older than this field).
    #[default]
    Unknown,
}

impl BlockOrigin {
    /// The name used in JSON and tables.
    pub fn as_str(self) -> &'static str {
        match self {
            BlockOrigin::Alert => "alert",
            BlockOrigin::Fleet => "fleet",
            BlockOrigin::Operator => "operator",
            BlockOrigin::Unknown => "unknown",
        }
    }
}

/// How a gateway follows the route table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WatchTransport {
    /// Plain `GET /v1/routes`, no wait.
    Poll,
    /// `GET /v1/routes?after=V&wait=…`.
    LongPoll,
    /// `GET /v1/routes/stream`.
    Sse,
    /// The gRPC `WatchRoutes` stream.
    Grpc,
}

impl WatchTransport {
    /// Every transport.
    pub const ALL: [WatchTransport; 4] = [
        WatchTransport::Poll,
        WatchTransport::LongPoll,
        WatchTransport::Sse,
        WatchTransport::Grpc,
    ];

    /// Its place in [`WatchTransport::ALL`].
    pub const fn index(self) -> usize {
        self as usize
    }

    /// The wire name (`poll`, `long_poll`, `sse`, `grpc`), also the metrics label.
    pub const fn as_str(self) -> &'static str {
        match self {
            WatchTransport::Poll => "poll",
            WatchTransport::LongPoll => "long_poll",
            WatchTransport::Sse => "sse",
            WatchTransport::Grpc => "grpc",
        }
    }
}

/// A gateway's view of the route table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GatewayStatus {
    /// Its identity (`X-Stanch-Gateway`, or the gRPC `Hello`).
    pub id: String,
    /// How it watches: the transport of its open stream, else of its last request.
    pub transport: WatchTransport,
    /// True while it holds a watch open (an SSE or gRPC stream, a long-poll waiting).
    pub connected: bool,
    /// The version it last said it applied.
    pub applied_version: Option<u64>,
    /// How many versions its applied one is behind the published one (`None` before it
    /// says it applied any).
    pub lag: Option<u64>,
    /// The last version it said it could not apply (NACK), with why.
    pub rejected: Option<(u64, String)>,
    /// When it was last heard from.
    pub last_seen: Timestamp,
    /// Seconds since then.
    pub age_seconds: u64,
    /// True when its applied version is the published one.
    pub converged: bool,
    /// True when it holds no watch open and has not been heard from for the stale
    /// deadline: it may be gone, or cut off from the controller.
    pub stale: bool,
}

/// Counts of active alerts.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AlertSummary {
    /// Active alerts in all.
    pub active: usize,
    /// Active alerts that map to no condition.
    pub unmapped: usize,
}

/// The state store's health.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreStatus {
    /// `file` or `memory`.
    pub kind: String,
    /// True when the last write succeeded.
    pub healthy: bool,
    /// Set when the state was unreadable at start and a new epoch began.
    pub recovered_from_corruption: Option<String>,
}

/// One entry of the audit history.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HistoryEntry {
    /// Position in the history, increasing.
    pub seq: u64,
    /// When.
    pub at: Timestamp,
    /// `alert`, `transition`, `pool`, `block`, `unblock`, `override`, `pin`, ...
    pub kind: String,
    /// The model concerned, if one.
    pub model: Option<String>,
    /// One line for humans.
    pub summary: String,
    /// The full decision: rule, thresholds, alerts.
    pub detail: serde_json::Value,
    /// True when made in dry-run (reported, not published).
    #[serde(default)]
    pub dry_run: bool,
}
