//! Gateways as seen on the watch API: who they are, how they watch, which version
//! each applied or refused.
//!
//! HTTP watchers report in headers on every request; gRPC watchers in their stream's
//! messages. A gateway that holds a watch open (an SSE or gRPC stream, a long-poll
//! waiting) is connected and never stale, however long nothing is published.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::http::HeaderMap;
use stanch_api::Timestamp;
use stanch_api::headers::{APPLIED_VERSION, GATEWAY_ID, REJECTED_REASON, REJECTED_VERSION};
use stanch_api::status::{GatewayStatus, WatchTransport};

use crate::metrics::Metrics;

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
#[derive(Debug)]
pub struct Gateways {
    seen: Mutex<HashMap<String, Seen>>,
    /// Gateways remembered at most (see [`Gateways::new`]).
    capacity: usize,
    /// Where refusals are counted and the fleet's gauges set.
    metrics: Arc<Metrics>,
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

/// `reason` as kept: control characters as spaces, at most 256 characters
/// (`MAX_REASON_CHARS`).
pub fn clean_reason(reason: &str) -> String {
    let reason = reason.trim();
    let reason = if reason.is_empty() {
        "no reason given"
    } else {
        reason
    };
    stanch_api::text::printable(reason, MAX_REASON_CHARS)
}

impl Gateways {
    /// No gateway seen yet. At most `max_watchers` watches are open at once
    /// (`watch.max_watchers`); twice as many gateways are remembered, so that when the
    /// list is full there is always one without a watch open to forget, and a gateway
    /// holding a watch is never dropped from it, however large the fleet.
    pub fn new(metrics: Arc<Metrics>, max_watchers: usize) -> Gateways {
        Gateways {
            seen: Mutex::default(),
            capacity: max_watchers.saturating_mul(2).max(2),
            metrics,
        }
    }

    /// Records what a watch request's headers say; `None` when they name no gateway
    /// (or a malformed one, which is ignored), else its identity.
    pub fn observe<'h>(
        &self,
        headers: &'h HeaderMap,
        transport: WatchTransport,
        now: Timestamp,
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
        self.record(id, transport, report, now);
        Some(id)
    }

    /// Records that gateway `id` (a [`valid_id`]) was heard from over `transport`.
    /// While it holds a watch open, its transport is that watch's: the requests an
    /// SSE gateway acknowledges with do not make it a long-poll one. A refusal is
    /// counted once per version (HTTP gateways repeat theirs on every request).
    ///
    /// While it holds a gRPC watch open, only that watch speaks for it: its Acks and
    /// Nacks arrive on the stream the gateway opened, where a version named in the
    /// headers of some other request, by anyone with the read token, is only a claim.
    /// So such a request cannot show the gateway converged, or behind.
    pub fn record(&self, id: &str, transport: WatchTransport, report: Report, now: Timestamp) {
        let mut seen = self.seen.lock().expect("gateways lock");
        // The common case, a gateway heard from again, allocates nothing.
        let entry = match seen.get_mut(id) {
            Some(entry) => entry,
            None => {
                if seen.len() >= self.capacity && !make_room(&mut seen, self.capacity) {
                    return;
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
        if entry.open > 0
            && entry.transport == WatchTransport::Grpc
            && transport != WatchTransport::Grpc
        {
            return;
        }
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
        if new_refusal {
            self.metrics.count_nack(transport);
        }
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
        let mut seen = self.live(now);
        let mut out: Vec<GatewayStatus> = seen
            .iter_mut()
            .map(|(id, s)| s.status(id, now, version))
            .collect();
        out.sort_by(|a, b| a.id.cmp(&b.id));
        out
    }

    /// The map, with those past [`FORGET_AFTER_SECS`] forgotten.
    fn live(&self, now: Timestamp) -> std::sync::MutexGuard<'_, HashMap<String, Seen>> {
        let mut seen = self.seen.lock().expect("gateways lock");
        seen.retain(|_, s| s.open > 0 || now.since(s.last_seen).as_secs() <= FORGET_AFTER_SECS);
        seen
    }

    /// Sets the fleet's gauges: gateways by state and transport, and the most any that
    /// is not stale is behind (one that has applied none counts as behind by the whole
    /// published version). Every series is set, to zero when none counts, so none goes
    /// stale. Counts in place: a scrape copies no gateway.
    pub fn export(&self, now: Timestamp, version: u64) {
        use crate::metrics::{GatewayLabels, TransportLabel};
        const STATES: [&str; 3] = ["converged", "lagging", "stale"];
        let mut counts = [[0i64; 3]; WatchTransport::ALL.len()];
        let mut max_lag = [0u64; WatchTransport::ALL.len()];
        for s in self.live(now).values() {
            let t = s.transport.index();
            let (stale, converged) = (s.stale(now), s.applied == Some(version));
            counts[t][if stale {
                2
            } else if converged {
                0
            } else {
                1
            }] += 1;
            if !stale {
                let lag = s.applied.map_or(version, |a| version.saturating_sub(a));
                max_lag[t] = max_lag[t].max(lag);
            }
        }
        for transport in WatchTransport::ALL {
            let t = transport.index();
            for (kind, n) in STATES.into_iter().zip(counts[t]) {
                self.metrics
                    .gateways
                    .get_or_create(&GatewayLabels {
                        kind,
                        transport: transport.as_str(),
                    })
                    .set(n);
            }
            self.metrics
                .gateway_max_lag
                .get_or_create(&TransportLabel {
                    transport: transport.as_str(),
                })
                .set(i64::try_from(max_lag[t]).unwrap_or(i64::MAX));
        }
    }
}

/// Forgets the longest unseen gateways without a watch open, a sixteenth of
/// `capacity` at a time, so that a full list pays for one scan every so many new
/// gateways, not one for each. `false` if every gateway holds a watch (which
/// [`Gateways::new`]'s capacity rules out).
fn make_room(seen: &mut HashMap<String, Seen>, capacity: usize) -> bool {
    let mut closed: Vec<(Timestamp, &String)> = seen
        .iter()
        .filter(|(_, s)| s.open == 0)
        .map(|(id, s)| (s.last_seen, id))
        .collect();
    if closed.is_empty() {
        return false;
    }
    let batch = (capacity / 16).clamp(1, closed.len());
    closed.select_nth_unstable(batch - 1);
    let gone: Vec<String> = closed[..batch]
        .iter()
        .map(|(_, id)| (*id).clone())
        .collect();
    for id in gone {
        seen.remove(&id);
    }
    true
}

impl Seen {
    fn stale(&self, now: Timestamp) -> bool {
        self.open == 0 && now.since(self.last_seen).as_secs() > STALE_AFTER_SECS
    }

    fn status(&self, id: &str, now: Timestamp, version: u64) -> GatewayStatus {
        GatewayStatus {
            id: id.to_owned(),
            transport: self.transport,
            connected: self.open > 0,
            applied_version: self.applied,
            lag: self.applied.map(|a| version.saturating_sub(a)),
            rejected: self.rejected.clone(),
            last_seen: self.last_seen,
            age_seconds: now.since(self.last_seen).as_secs(),
            converged: self.applied == Some(version),
            stale: self.stale(now),
        }
    }
}

#[cfg(test)]
mod tests;
