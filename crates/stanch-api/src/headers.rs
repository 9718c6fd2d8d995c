//! HTTP header names of the watch protocol and the data plane.

/// Sent by a gateway on watch requests: its stable identity (pod name, host name).
pub const GATEWAY_ID: &str = "x-stanch-gateway";
/// Sent by a gateway on watch requests: the route version it has applied (ACK).
pub const APPLIED_VERSION: &str = "x-stanch-applied-version";
/// Sent by a gateway on watch requests: a route version it failed to apply (NACK).
pub const REJECTED_VERSION: &str = "x-stanch-rejected-version";
/// Sent by a gateway with [`REJECTED_VERSION`]: why it failed to apply it.
pub const REJECTED_REASON: &str = "x-stanch-rejected-reason";
/// On SSE route streams: the controller's heartbeat interval, in milliseconds. A
/// watcher that hears nothing (no event, no heartbeat) for two of them takes the
/// connection for dead and opens another.
pub const HEARTBEAT: &str = "x-stanch-heartbeat";
/// On every route response: the route table's epoch.
pub const EPOCH: &str = "x-stanch-epoch";
/// On every route response and every gateway response: the route table version.
pub const ROUTE_VERSION: &str = "x-stanch-route-version";
/// On degraded gateway responses: `true` (alias model) or `static` (FAQ answer).
pub const DEGRADED: &str = "x-llm-degraded";
/// On responses a local rate limiter generated: never counted as an upstream failure.
pub const RATE_LIMITED: &str = "x-rate-limited";
/// On a gateway's health probes: never counted as traffic.
pub const PROBE: &str = "x-stanch-probe";
