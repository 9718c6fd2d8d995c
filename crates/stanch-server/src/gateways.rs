//! Gateways as seen on the watch API: who they are, how they watch, which version
//! each applied or refused.
//!
//! HTTP watchers report in headers on every request; gRPC watchers in their stream's
//! messages. A gateway that holds a watch open (an SSE or gRPC stream, a long-poll
//! waiting) is connected and never stale, however long nothing is published.

use std::collections::HashMap;
use std::sync::Mutex;

use axum::http::HeaderMap;
use stanch_api::Timestamp;
use stanch_api::headers::{APPLIED_VERSION, GATEWAY_ID, REJECTED_REASON, REJECTED_VERSION};
use stanch_api::status::{GatewayStatus, WatchTransport};

/// Gateways remembered at most; the longest unseen of those without a watch open is
/// forgotten first.
const MAX_GATEWAYS: usize = 10_000;
/// A gateway with no watch open, unheard of for this long, is `stale`. Long-poll
/// gateways ask again at least every `watch.max_wait` (60 s at most by default).
pub const STALE_AFTER_SECS: u64 = 120;
/// A gateway with no watch open, unheard of for this long, is forgotten: pods come
/// and go, and the list shows the fleet there is.
pub const FORGET_AFTER_SECS: u64 = 3600;
/// The longest refusal reason kept.
const MAX_REASON_CHARS: usize = 256;
/// The longest gateway identity accepted.
pub const MAX_ID_LEN: usize = 128;

#[derive(Debug, Clone)]
struct Seen {
    transport: WatchTransport,
    /// Watches it holds open now.
    open: u32,
    applied: Option<u64>,
    rejected: Option<(u64, String)>,
    last_seen: Timestamp,
}

/// What one watch request or message says about its gateway.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// The version it applied (ACK).
    pub applied: Option<u64>,
    /// A version it refused (NACK), with why.
    pub rejected: Option<(u64, String)>,
}

/// Gateway convergence tracking.
#[derive(Debug, Default)]
pub struct Gateways {
    seen: Mutex<HashMap<String, Seen>>,
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| !v.is_empty())
}

/// Whether `id` can name a gateway: 1 to [`MAX_ID_LEN`] bytes, no control characters.
pub fn valid_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= MAX_ID_LEN && !id.chars().any(char::is_control)
}

/// `reason` as kept: control characters as spaces, at most [`MAX_REASON_CHARS`].
pub fn clean_reason(reason: &str) -> String {
    let reason = reason.trim();
    let reason = if reason.is_empty() {
        "no reason given"
    } else {
        reason
    };
    reason
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(MAX_REASON_CHARS)
        .collect()
}

impl Gateways {
    /// Records what a watch request's headers say; `None` when they name no gateway
    /// (or a malformed one, which is ignored), else its identity.
    pub fn observe<'h>(
        &self,
        headers: &'h HeaderMap,
        transport: WatchTransport,
        now: Timestamp,
        metrics: &crate::metrics::Metrics,
    ) -> Option<&'h str> {
        let id = header(headers, GATEWAY_ID).filter(|id| valid_id(id))?;
        let report = Report {
            applied: header(headers, APPLIED_VERSION).and_then(|v| v.parse().ok()),
            rejected: header(headers, REJECTED_VERSION)
                .and_then(|v| v.parse().ok())
                .map(|v| {
                    (
                        v,
                        clean_reason(header(headers, REJECTED_REASON).unwrap_or("")),
                    )
                }),
        };
        if self.record(id, transport, report, now) {
            metrics.count_nack(transport);
        }
        Some(id)
    }

    /// Records that gateway `id` (a [`valid_id`]) was heard from over `transport`.
    /// While it holds a watch open, its transport is that watch's: the requests an
    /// SSE gateway acknowledges with do not make it a long-poll one. Returns whether
    /// the report refuses a version not refused before (a NACK to count).
    pub fn record(
        &self,
        id: &str,
        transport: WatchTransport,
        report: Report,
        now: Timestamp,
    ) -> bool {
        let mut seen = self.seen.lock().expect("gateways lock");
        // The common case, a gateway heard from again, allocates nothing.
        let entry = match seen.get_mut(id) {
            Some(entry) => entry,
            None => {
                if seen.len() >= MAX_GATEWAYS
                    && let Some(oldest) = seen
                        .iter()
                        .min_by_key(|(_, s)| (s.open > 0, s.last_seen))
                        .map(|(k, _)| k.clone())
                {
                    seen.remove(&oldest);
                }
                seen.entry(id.to_owned()).or_insert(Seen {
                    transport,
                    open: 0,
                    applied: None,
                    rejected: None,
                    last_seen: now,
                })
            }
        };
        entry.last_seen = now;
        if entry.open == 0 {
            entry.transport = transport;
        }
        if report.applied.is_some() {
            entry.applied = report.applied;
        }
        let new_refusal = report
            .rejected
            .as_ref()
            .is_some_and(|(v, _)| entry.rejected.as_ref().is_none_or(|(had, _)| had != v));
        if report.rejected.is_some() {
            entry.rejected = report.rejected;
        }
        new_refusal
    }

    /// Counts a watch that gateway `id` holds open over `transport` (recorded first
    /// with [`Gateways::record`]); [`Gateways::closed`] counts it out. The first watch
    /// open names the transport: an SSE gateway's acknowledging requests do not.
    pub fn opened(&self, id: &str, transport: WatchTransport) {
        if let Some(entry) = self.seen.lock().expect("gateways lock").get_mut(id) {
            if entry.open == 0 {
                entry.transport = transport;
            }
            entry.open += 1;
        }
    }

    /// A watch [`Gateways::opened`] ended.
    pub fn closed(&self, id: &str, now: Timestamp) {
        if let Some(entry) = self.seen.lock().expect("gateways lock").get_mut(id) {
            entry.open = entry.open.saturating_sub(1);
            entry.last_seen = now;
        }
    }

    /// Every gateway with its convergence on `version`, sorted by id. Forgets those
    /// past [`FORGET_AFTER_SECS`].
    pub fn list(&self, now: Timestamp, version: u64) -> Vec<GatewayStatus> {
        let mut seen = self.seen.lock().expect("gateways lock");
        seen.retain(|_, s| s.open > 0 || now.since(s.last_seen).as_secs() <= FORGET_AFTER_SECS);
        let mut out: Vec<GatewayStatus> = seen
            .iter()
            .map(|(id, s)| {
                let age_seconds = now.since(s.last_seen).as_secs();
                GatewayStatus {
                    id: id.clone(),
                    transport: s.transport,
                    connected: s.open > 0,
                    applied_version: s.applied,
                    lag: s.applied.map(|a| version.saturating_sub(a)),
                    rejected: s.rejected.clone(),
                    last_seen: s.last_seen,
                    age_seconds,
                    converged: s.applied == Some(version),
                    stale: s.open == 0 && age_seconds > STALE_AFTER_SECS,
                }
            })
            .collect();
        out.sort_by(|a, b| a.id.cmp(&b.id));
        out
    }

    /// Sets the fleet's gauges: gateways by state and transport, and the most any is
    /// behind. Every series is set, to zero when none counts, so none goes stale.
    pub fn export(&self, now: Timestamp, version: u64, metrics: &crate::metrics::Metrics) {
        use crate::metrics::{GatewayLabels, TransportLabel};
        let summary = self.summary(now, version);
        for transport in WatchTransport::ALL {
            for kind in ["converged", "lagging", "stale"] {
                let n = summary
                    .by_state
                    .get(&(transport, kind))
                    .copied()
                    .unwrap_or(0);
                metrics
                    .gateways
                    .get_or_create(&GatewayLabels {
                        kind,
                        transport: transport.as_str(),
                    })
                    .set(n);
            }
            let lag = summary.max_lag.get(&transport).copied().unwrap_or(0);
            metrics
                .gateway_max_lag
                .get_or_create(&TransportLabel {
                    transport: transport.as_str(),
                })
                .set(i64::try_from(lag).unwrap_or(i64::MAX));
        }
    }

    /// What the metrics say of the fleet, by transport.
    pub fn summary(&self, now: Timestamp, version: u64) -> Summary {
        let mut summary = Summary::default();
        for g in self.list(now, version) {
            let state = if g.stale {
                "stale"
            } else if g.converged {
                "converged"
            } else {
                "lagging"
            };
            *summary.by_state.entry((g.transport, state)).or_default() += 1;
            if !g.stale {
                let lag = g.lag.unwrap_or(version);
                let max = summary.max_lag.entry(g.transport).or_default();
                *max = (*max).max(lag);
            }
        }
        summary
    }
}

/// The fleet in numbers.
#[derive(Debug, Default)]
pub struct Summary {
    /// Gateways by (transport, `converged` | `lagging` | `stale`).
    pub by_state: std::collections::BTreeMap<(WatchTransport, &'static str), i64>,
    /// The most versions any gateway that is not stale is behind, by transport (one
    /// that has applied none counts as behind by the whole published version).
    pub max_lag: std::collections::BTreeMap<WatchTransport, u64>,
}
