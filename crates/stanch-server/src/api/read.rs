//! Status, history, metrics and probes.

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use stanch_api::status::{StatusReport, StoreStatus};

use super::{AppState, Params};
use crate::error::ApiError;
use crate::history::Page;

/// `GET /v1/status`
pub(super) async fn status(State(state): State<AppState>) -> Result<Json<StatusReport>, ApiError> {
    let snap = super::table(&state)?;
    let now = state.clock.now();
    let mut blocked = snap.blocks.clone();
    for b in &mut blocked {
        b.seconds_left = b.until.since(now).as_secs();
    }
    Ok(Json(StatusReport {
        epoch: snap.table.epoch.clone(),
        version: snap.table.version,
        generated_at: snap.table.generated_at,
        now,
        dry_run: snap.dry_run.clone(),
        global_freeze: snap.global_freeze.clone(),
        models: snap.models.clone(),
        blocked,
        gateways: state.gateways.list(now, snap.table.version),
        alerts: snap.alerts.clone(),
        store: StoreStatus {
            kind: state.store.kind.to_owned(),
            healthy: state
                .store
                .healthy
                .load(std::sync::atomic::Ordering::Relaxed),
            recovered_from_corruption: state.store.recovered_from_corruption(),
        },
    }))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct HistoryQuery {
    /// Entries at most (default 100, at most 1000).
    limit: Option<usize>,
    /// Only this model's entries.
    model: Option<String>,
    /// Entries after this sequence number, oldest first: a cursor.
    after: Option<u64>,
    /// Entries before this sequence number (the newest of them).
    before: Option<u64>,
}

/// `GET /v1/history`
pub(super) async fn history(
    State(state): State<AppState>,
    Params(q): Params<HistoryQuery>,
) -> Result<Response, ApiError> {
    let limit = q.limit.unwrap_or(100).clamp(1, 1000);
    let page = Page {
        limit,
        model: q.model.as_deref(),
        after: q.after,
        before: q.before,
    };
    let entries = state.history.list(page);
    let mut response = Json(entries).into_response();
    if let Some((oldest, newest)) = state.history.span() {
        let headers = response.headers_mut();
        headers.insert(HISTORY_OLDEST, HeaderValue::from(oldest));
        headers.insert(HISTORY_NEWEST, HeaderValue::from(newest));
    }
    Ok(response)
}

/// The oldest seq kept: a cursor below it minus one has missed dropped entries.
const HISTORY_OLDEST: &str = "x-stanch-history-oldest";
/// The newest seq.
const HISTORY_NEWEST: &str = "x-stanch-history-newest";

/// `GET /metrics`
pub(super) async fn metrics(State(state): State<AppState>) -> Response {
    let snap = state.publisher.load();
    state.gateways.export(state.clock.now(), snap.table.version);
    let mut response = state.metrics.encode().into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
    );
    response
}

/// `GET /healthz`: the process is alive.
pub(super) async fn healthz() -> &'static str {
    "ok\n"
}

/// `GET /readyz`: ready while the state store writes.
pub(super) async fn readyz(State(state): State<AppState>) -> Response {
    if state
        .store
        .healthy
        .load(std::sync::atomic::Ordering::Relaxed)
    {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: the state store cannot write\n",
        )
            .into_response()
    }
}
