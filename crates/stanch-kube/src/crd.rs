//! The custom resources, group `stanch.dev`, version `v1alpha1`:
//!
//! - [`StanchPolicy`] (`spol`), namespaced, one per model: what a `models` entry of the
//!   configuration file holds (its pools in failover order, fallback model, FAQ set,
//!   alias exemptions, its own ladder timings) and mapping rules for its alerts. Its
//!   status is the model's place on the ladder as published, with Kubernetes
//!   conditions.
//! - [`StanchRouteTable`] (`srt`), namespaced, one per controller: its status is the
//!   published route table, the same JSON the HTTP watch serves.
//!
//! The schemas carry what the API server can check on its own: required fields,
//! enums, lengths and counts (which also bound the cost of the CEL rules), and
//! `x-kubernetes-validations` where a rule spans fields. Everything else is checked by
//! the controller with the configuration file's rules ([`crate::policy`]).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use stanch_api::{RouteTable, Rung, Timestamp};

/// The API group of every stanch resource.
pub const GROUP: &str = "stanch.dev";

/// A model's serving policy: the `StanchPolicy` resource's spec.
#[expect(
    clippy::duplicated_attributes,
    reason = "kube's `printcolumn` is given once per column"
)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "stanch.dev",
    version = "v1alpha1",
    kind = "StanchPolicy",
    doc = "A model's serving policy, and its place on the degradation ladder.",
    plural = "stanchpolicies",
    shortname = "spol",
    category = "stanch",
    namespaced,
    status = "StanchPolicyStatus",
    printcolumn(name = "Model", type_ = "string", json_path = ".spec.model"),
    printcolumn(name = "Rung", type_ = "string", json_path = ".status.rung"),
    printcolumn(name = "Pool", type_ = "string", json_path = ".status.activePool"),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[x_kube(validation = Rule::new("!has(self.fallback) || self.fallback != self.model").message("a model cannot fall back to itself"))]
#[x_kube(validation = Rule::new("self.pools.all(p, self.pools.filter(q, q.name == p.name).size() == 1)").message("pool names are unique"))]
#[serde(rename_all = "camelCase")]
pub struct StanchPolicySpec {
    /// The model's name, as clients request it.
    #[schemars(length(min = 1, max = 253), regex(pattern = PRINTABLE))]
    pub model: String,
    /// Its pools, in failover order: the first is the primary.
    #[schemars(length(min = 1, max = 16))]
    pub pools: Vec<PolicyPool>,
    /// Where non-VIP traffic goes when the model is degraded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253), regex(pattern = PRINTABLE))]
    pub fallback: Option<String>,
    /// The FAQ set answered from on the static rung.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub faq: Option<String>,
    /// Tenant classes that keep this model while it is degraded (default `[vip]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 16))]
    pub alias_exempt: Option<Vec<String>>,
    /// This model's own ladder timings, over the controller's `ladder`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ladder: Option<PolicyLadder>,
    /// Rules mapping alerts to actions on this model, tried after the `action` label
    /// convention.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub mappings: Vec<PolicyMapping>,
}

/// A pool of a model.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PolicyPool {
    /// The pool's name, as alerts and gateways name it (`dc-a`).
    #[schemars(length(min = 1, max = 63), regex(pattern = PRINTABLE))]
    pub name: String,
    /// Its endpoints as gateways name them (URL or host:port), which enables the
    /// guard against blocking a pool's only endpoint.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 256))]
    pub endpoints: Vec<String>,
}

/// A duration as stanch writes it: `30s`, `5m`, `1h30m`.
const DURATION: &str = r"^([0-9]+(\.[0-9]+)?(ns|us|ms|s|m|h|d|w) *)+$";
/// A name with no control characters (a model's, a pool's, a FAQ set's), as the
/// controller's configuration requires: such names become metric label values and
/// log fields.
const PRINTABLE: &str = r"^[^\x00-\x1F\x7F]+$";

/// A model's own ladder timings; each one given replaces the controller's.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PolicyLadder {
    /// A higher rung's conditions must stay clear this long before stepping down.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = DURATION))]
    pub recover_after: Option<String>,
    /// The least time a rung is held before stepping down from it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = DURATION))]
    pub min_dwell: Option<String>,
    /// The flap guard.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flap: Option<PolicyFlap>,
    /// Backoff of `recoverAfter` for repeated degradation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backoff: Option<PolicyBackoff>,
}

/// More than `maxTransitions` within `window` pins the model for `hold`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PolicyFlap {
    /// Rung changes allowed within `window`.
    #[schemars(range(min = 2, max = 1000))]
    pub max_transitions: u32,
    /// The counting window.
    #[schemars(regex(pattern = DURATION))]
    pub window: String,
    /// How long the model is held at the highest rung seen.
    #[schemars(regex(pattern = DURATION))]
    pub hold: String,
}

/// Each repeat within `resetAfter` multiplies by `factor`, up to `max`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PolicyBackoff {
    /// The multiplier per repeat.
    #[schemars(range(min = 1, max = 100))]
    pub factor: u32,
    /// The cap.
    #[schemars(regex(pattern = DURATION))]
    pub max: String,
    /// A repeat later than this starts over.
    #[schemars(regex(pattern = DURATION))]
    pub reset_after: String,
}

/// What an alert asks stanch to do.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyAction {
    /// A pool is failing: route elsewhere.
    TriggerFailover,
    /// The model is saturated: send non-VIP traffic to its fallback model.
    TriggerModelDegradation,
    /// The model is failing everywhere: answer from the FAQ.
    TriggerStaticFallback,
    /// An endpoint is failing: soft-block it.
    BlockEndpoint,
}

/// A rule mapping alerts you already have to an action on this model.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[x_kube(validation = Rule::new("!(has(self.pool) && has(self.poolLabel))").message("give pool or poolLabel, not both"))]
#[x_kube(validation = Rule::new("!(has(self.shift) && has(self.shiftLabel))").message("give shift or shiftLabel, not both"))]
#[x_kube(validation = Rule::new("self.action == 'trigger-failover' || !(has(self.shift) || has(self.shiftLabel))").message("only trigger-failover moves a share of a pool's traffic"))]
#[x_kube(validation = Rule::new("self.action != 'block-endpoint' || has(self.endpointLabel)").message("block-endpoint needs endpointLabel, the label naming the endpoint"))]
#[serde(rename_all = "camelCase")]
pub struct PolicyMapping {
    /// A name for status and history.
    #[schemars(length(min = 1, max = 63))]
    pub name: String,
    /// Alertmanager-syntax matchers, all of which an alert must satisfy
    /// (`alertname="PoolDown"`, `severity=~"critical|page"`).
    #[schemars(length(min = 1, max = 16))]
    pub matchers: Vec<String>,
    /// What a matching alert asks for.
    pub action: PolicyAction,
    /// The pool it names (failover).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// The alert label naming the pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_label: Option<String>,
    /// The percentage of the pool's traffic to move to the next pool (failover; all of
    /// it when not given): 75 keeps a quarter on a slow pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100))]
    pub shift: Option<u8>,
    /// The alert label giving that percentage (`75` or `75%`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shift_label: Option<String>,
    /// The alert label naming the endpoint (block-endpoint).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint_label: Option<String>,
    /// The model to degrade to, instead of the policy's fallback.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback_model: Option<String>,
}

/// A model's place on the ladder as published, and whether its spec is in force.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StanchPolicyStatus {
    /// The generation of the spec this status is of.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The rung gateways route by.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rung: Option<Rung>,
    /// The pool traffic goes to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_pool: Option<String>,
    /// The model non-VIP traffic goes to, when degraded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alias: Option<String>,
    /// Why the model is on its rung.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// When it moved to its rung.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<Timestamp>,
    /// Until when gateways honour the entry without hearing from the controller.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_until: Option<Timestamp>,
    /// An operator's override holds the model.
    #[serde(default)]
    pub overridden: bool,
    /// The model is frozen: the controller moves it nowhere.
    #[serde(default)]
    pub frozen: bool,
    /// The model's endpoints blocked now.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub blocked_endpoints: Vec<PolicyBlock>,
    /// `Ready` (the spec is valid and in force), `Degraded` (off the normal rung),
    /// `Overridden` (an operator holds it).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// A blocked endpoint of the model.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PolicyBlock {
    /// The endpoint, as gateways name it.
    pub endpoint: String,
    /// When the block ends.
    pub until: Timestamp,
    /// Why it was blocked.
    pub reason: String,
}

/// The route-table resource's spec: nothing to set; the controller owns the resource.
#[derive(
    CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema,
)]
#[kube(
    group = "stanch.dev",
    version = "v1alpha1",
    kind = "StanchRouteTable",
    doc = "The route table a stanch controller publishes, as every gateway applies it.",
    plural = "stanchroutetables",
    shortname = "srt",
    category = "stanch",
    namespaced,
    status = "StanchRouteTableStatus",
    printcolumn(
        name = "Version",
        type_ = "integer",
        json_path = ".status.table.version"
    ),
    printcolumn(name = "Epoch", type_ = "string", json_path = ".status.table.epoch"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
pub struct StanchRouteTableSpec {}

/// The published route table.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StanchRouteTableStatus {
    /// The table, exactly as `GET /v1/routes` serves it (its fields as on that wire).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub table: Option<RouteTable>,
}
