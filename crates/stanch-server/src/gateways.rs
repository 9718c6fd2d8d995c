//! Gateways as seen on the watch API: who they are, which version each applied.

use std::collections::HashMap;
use std::sync::Mutex;

use axum::http::HeaderMap;
use stanch_api::Timestamp;
use stanch_api::headers::{APPLIED_VERSION, GATEWAY_ID, REJECTED_REASON, REJECTED_VERSION};
use stanch_api::status::GatewayStatus;

/// Gateways remembered at most; the longest unseen is forgotten first.
const MAX_GATEWAYS: usize = 10_000;
/// A gateway unheard of for this long is `stale`.
const STALE_AFTER_SECS: u64 = 120;

#[derive(Debug, Clone)]
struct Seen {
    applied: Option<u64>,
    rejected: Option<(u64, String)>,
    last_seen: Timestamp,
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

impl Gateways {
    /// Records what a watch request's headers say. Malformed identities are ignored.
    pub fn observe(&self, headers: &HeaderMap, now: Timestamp) {
        let Some(id) = header(headers, GATEWAY_ID) else {
            return;
        };
        if id.len() > 128 || id.chars().any(|c| c.is_control()) {
            return;
        }
        let applied = header(headers, APPLIED_VERSION).and_then(|v| v.parse().ok());
        let rejected = header(headers, REJECTED_VERSION)
            .and_then(|v| v.parse().ok())
            .map(|v| {
                let why = header(headers, REJECTED_REASON).unwrap_or("no reason given");
                (v, why.chars().take(256).collect())
            });
        let mut seen = self.seen.lock().expect("gateways lock");
        // The common case, a gateway polling again, allocates nothing.
        if let Some(entry) = seen.get_mut(id) {
            entry.last_seen = now;
            if applied.is_some() {
                entry.applied = applied;
            }
            if rejected.is_some() {
                entry.rejected = rejected;
            }
            return;
        }
        if seen.len() >= MAX_GATEWAYS
            && let Some(oldest) = seen
                .iter()
                .min_by_key(|(_, s)| s.last_seen)
                .map(|(k, _)| k.clone())
        {
            seen.remove(&oldest);
        }
        let entry = seen.entry(id.to_owned()).or_insert(Seen {
            applied: None,
            rejected: None,
            last_seen: now,
        });
        entry.last_seen = now;
        if applied.is_some() {
            entry.applied = applied;
        }
        if rejected.is_some() {
            entry.rejected = rejected;
        }
    }

    /// Every gateway with its convergence on `version`, sorted by id.
    pub fn list(&self, now: Timestamp, version: u64) -> Vec<GatewayStatus> {
        let seen = self.seen.lock().expect("gateways lock");
        let mut out: Vec<GatewayStatus> = seen
            .iter()
            .map(|(id, s)| GatewayStatus {
                id: id.clone(),
                applied_version: s.applied,
                rejected: s.rejected.clone(),
                last_seen: s.last_seen,
                age_seconds: now.since(s.last_seen).as_secs(),
                converged: s.applied == Some(version),
            })
            .collect();
        out.sort_by(|a, b| a.id.cmp(&b.id));
        out
    }

    /// Counts of (converged, lagging, stale).
    pub fn convergence(&self, now: Timestamp, version: u64) -> (i64, i64, i64) {
        let (mut converged, mut lagging, mut stale) = (0, 0, 0);
        for g in self.list(now, version) {
            if g.age_seconds > STALE_AFTER_SECS {
                stale += 1;
            } else if g.converged {
                converged += 1;
            } else {
                lagging += 1;
            }
        }
        (converged, lagging, stale)
    }
}
