//! The watch protocol: the route table, long-poll, and SSE.
//!
//! Delivery is latest-only: a watcher wakes on a version number and reads the current
//! snapshot, so a slow client skips versions instead of queueing them, and the writer
//! never waits for anyone.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::Response;
use bytes::Bytes;
use serde::Deserialize;
use stanch_api::HumanDuration;
use stanch_api::hash::Fnv64;
use stanch_api::status::WatchTransport;

use super::{AppState, Params, WatcherGuard};
use crate::error::ApiError;
use crate::publish::Snapshot;

/// The long-poll wait when the client names none.
const DEFAULT_WAIT: Duration = Duration::from_secs(30);

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RoutesQuery {
    /// The version the client has.
    after: Option<u64>,
    /// How long to wait for a newer one.
    wait: Option<HumanDuration>,
    /// The epoch the client's version belongs to.
    epoch: Option<String>,
}

fn table_response(snap: &Snapshot, status: StatusCode) -> Response {
    let body = if status == StatusCode::OK {
        Body::from(snap.json.clone())
    } else {
        Body::empty()
    };
    let mut response = Response::new(body);
    *response.status_mut() = status;
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    for (name, value) in &snap.headers {
        h.insert(name.clone(), value.clone());
    }
    response
}

/// `GET /v1/routes`, with `?after=V&wait=30s` for a long-poll.
pub(super) async fn routes(
    State(state): State<AppState>,
    Params(query): Params<RoutesQuery>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let transport = if query.after.is_some() {
        WatchTransport::LongPoll
    } else {
        WatchTransport::Poll
    };
    let gateway = state
        .gateways
        .observe(&headers, transport, state.clock.now())
        .map(str::to_owned);
    let snap = super::table(&state)?;
    let Some(after) = query.after else {
        let unchanged = headers
            .get(header::IF_NONE_MATCH)
            .and_then(|v| v.to_str().ok())
            == Some(snap.etag.as_str());
        let status = if unchanged {
            StatusCode::NOT_MODIFIED
        } else {
            StatusCode::OK
        };
        return Ok(table_response(&snap, status));
    };
    // Anything other than the client's own version is news: newer, or from an
    // epoch the client does not know.
    let news = |s: &Snapshot| {
        s.table.version != after || query.epoch.as_ref().is_some_and(|e| *e != s.table.epoch)
    };
    if news(&snap) {
        return Ok(table_response(&snap, StatusCode::OK));
    }
    let wait = query
        .wait
        .map_or(DEFAULT_WAIT, |w| w.0)
        .min(state.server.watch.max_wait.0);
    let wait = jittered(wait, &state, &headers);
    // Header values are slices of the connection's read buffer: holding them through
    // the wait would pin that buffer and make the connection allocate another.
    drop(headers);
    drop(snap);
    let _guard = WatcherGuard::admit(&state, transport, gateway)?;
    let mut rx = state.publisher.subscribe();
    let deadline = tokio::time::sleep(wait);
    tokio::pin!(deadline);
    loop {
        // Checked after subscribing, so a version published in between is not missed.
        let snap = state.publisher.load();
        if news(&snap) {
            return Ok(table_response(&snap, StatusCode::OK));
        }
        tokio::select! {
            changed = rx.changed() => {
                if changed.is_err() {
                    return Err(ApiError::Unavailable("the controller is shutting down".into()));
                }
            }
            () = &mut deadline => return Ok(table_response(&state.publisher.load(), StatusCode::NOT_MODIFIED)),
        }
    }
}

/// Spreads long-poll timeouts by ±10 % so a fleet of gateways does not reconnect in step.
fn jittered(wait: Duration, state: &AppState, headers: &HeaderMap) -> Duration {
    let mut h = Fnv64::default();
    h.write(&state.clock.now().as_millis().to_le_bytes());
    if let Some(id) = headers.get(stanch_api::headers::GATEWAY_ID) {
        h.write(id.as_bytes());
    }
    stanch_api::jitter::spread(wait, 0.1, h.finish())
}

/// An SSE comment line that keeps idle streams open through proxies.
const HEARTBEAT: &[u8] = b":heartbeat\n\n";

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct StreamQuery {
    /// The epoch of the version in `Last-Event-ID`.
    epoch: Option<String>,
}

/// `GET /v1/routes/stream`: one SSE event per version, `id:` the version.
///
/// A watcher resumes with `Last-Event-ID: <version>` and, so that a table of another
/// epoch with the same number is not taken for the one it holds, `?epoch=<epoch>`.
///
/// Each event is rendered once per version and the same buffer is sent to every
/// watcher, so a thousand watchers cost a thousand reference counts, not a thousand
/// copies of the table.
pub(super) async fn stream(
    State(state): State<AppState>,
    Params(query): Params<StreamQuery>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let gateway = state
        .gateways
        .observe(&headers, WatchTransport::Sse, state.clock.now())
        .map(str::to_owned);
    super::table(&state)?;
    let guard = WatcherGuard::admit(&state, WatchTransport::Sse, gateway)?;
    let resume: Option<u64> = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok());
    let heartbeat = state.server.watch.heartbeat.0;
    let watch = SseWatch {
        rx: state.publisher.subscribe(),
        publisher: Arc::clone(&state.publisher),
        // A stream resumed without its epoch (an `EventSource`, an older gateway)
        // takes the version for the current epoch's.
        sent: resume.map(|v| (query.epoch.map(Arc::from), v)),
        heartbeat: tokio::time::interval_at(tokio::time::Instant::now() + heartbeat, heartbeat),
        _guard: guard,
    };
    let events = futures_util::stream::unfold(watch, |mut w| async move {
        let chunk = w.next().await?;
        Some((Ok::<Bytes, Infallible>(chunk), w))
    });
    let mut response = Response::new(Body::from_stream(events));
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    // Tell nginx-style proxies not to buffer the stream.
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    // How often the watcher hears from us, so it can tell a dead connection.
    h.insert(
        stanch_api::headers::HEARTBEAT,
        HeaderValue::from(heartbeat.as_millis().min(u128::from(u64::MAX)) as u64),
    );
    Ok(response)
}

/// One SSE watcher's state: latest-only, so nothing queues up for a slow client.
struct SseWatch {
    rx: tokio::sync::watch::Receiver<u64>,
    publisher: Arc<crate::publish::Publisher>,
    /// The last (epoch, version) sent: the snapshot's own epoch (no copy), or what
    /// the resuming watcher named, if anything.
    sent: Option<(Option<Arc<str>>, u64)>,
    heartbeat: tokio::time::Interval,
    _guard: WatcherGuard,
}

impl SseWatch {
    /// The next chunk to send: the current version if not sent yet, else a heartbeat
    /// or whatever is published next. `None` when the controller shuts down.
    async fn next(&mut self) -> Option<Bytes> {
        loop {
            let snap = self.publisher.load();
            let already = self.sent.as_ref().is_some_and(|(epoch, version)| {
                *version == snap.table.version
                    && epoch.as_ref().is_none_or(|e| **e == *snap.table.epoch)
            });
            if !already {
                self.sent = Some((Some(snap.epoch.clone()), snap.table.version));
                return Some(snap.sse_event.clone());
            }
            tokio::select! {
                changed = self.rx.changed() => changed.ok()?,
                _ = self.heartbeat.tick() => return Some(Bytes::from_static(HEARTBEAT)),
            }
        }
    }
}
