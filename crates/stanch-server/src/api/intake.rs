//! Alert intake: Alertmanager's webhook and Prometheus' own push.
//!
//! 200 only once the alerts are durable; 400 naming the field for a malformed
//! payload; 413 above the size limit; 503 when the store cannot write, or when new
//! alerts found the engine at its alert limit (Alertmanager retries 5xx; what was
//! taken is kept either way). Never 429: a rate limit here would drop the alert that
//! matters.

use axum::Json;
use axum::extract::State;
use stanch_api::alerts::{self, IntakeResponse, ParsedBatch, PayloadError};
use stanch_core::{Decision, Input};
use tracing::warn;

use super::{AppState, Body};
use crate::error::ApiError;
use crate::metrics::{RejectLabels, SourceLabel};

/// `POST /v1/alerts/alertmanager`
pub(super) async fn alertmanager(
    State(state): State<AppState>,
    Body(raw): Body,
) -> Result<Json<IntakeResponse>, ApiError> {
    let batch =
        alerts::parse_alertmanager_webhook(&raw).map_err(|e| refused(&state, "alertmanager", e))?;
    if batch.truncated_alerts > 0
        && let Some(reconcile) = &state.reconcile
    {
        warn!(
            truncated = batch.truncated_alerts,
            "Alertmanager truncated a notification; reconciling"
        );
        reconcile.notify_one();
    }
    ingest(&state, "alertmanager", batch).await
}

/// `POST /api/v2/alerts`
pub(super) async fn prometheus(
    State(state): State<AppState>,
    Body(raw): Body,
) -> Result<Json<IntakeResponse>, ApiError> {
    let now = state.clock.now();
    let batch =
        alerts::parse_prometheus_push(&raw, now).map_err(|e| refused(&state, "prometheus", e))?;
    ingest(&state, "prometheus", batch).await
}

fn refused(state: &AppState, source: &'static str, e: PayloadError) -> ApiError {
    state
        .metrics
        .alerts_rejected
        .get_or_create(&RejectLabels {
            source,
            reason: e.kind(),
        })
        .inc();
    warn!(source, error = %e, "alert payload refused");
    ApiError::invalid(e.to_string())
}

async fn ingest(
    state: &AppState,
    source: &'static str,
    batch: ParsedBatch,
) -> Result<Json<IntakeResponse>, ApiError> {
    for r in &batch.rejected {
        state
            .metrics
            .alerts_rejected
            .get_or_create(&RejectLabels {
                source,
                reason: "bad_alert",
            })
            .inc();
        warn!(source, detail = %r.detail, "alert refused; the rest of the batch is kept");
    }
    let accepted = batch.alerts.len();
    let applied = if accepted == 0 {
        None
    } else {
        let input = Input::Alerts {
            alerts: batch.alerts,
        };
        Some(state.engine.apply(input).await?)
    };
    state
        .metrics
        .alerts_received
        .get_or_create(&SourceLabel { source })
        .inc_by(accepted as u64);
    let version = match applied {
        None => state.publisher.load().table.version,
        Some(applied) => {
            // The engine counted and logged them; the sender must learn that it was
            // not heard in full, and retry.
            if let Some(limit) = applied.decisions.iter().find_map(|d| match d {
                Decision::AlertLimit {
                    refused,
                    limit,
                    max_bytes,
                    ..
                } if *refused > 0 => Some(ApiError::AlertLimit {
                    refused: *refused,
                    limit: *limit,
                    max_bytes: *max_bytes,
                }),
                _ => None,
            }) {
                return Err(limit);
            }
            applied.version
        }
    };
    Ok(Json(IntakeResponse {
        accepted,
        rejected: batch.rejected,
        version,
    }))
}

/// `POST /v1/reports`: a gateway's per-endpoint outcome counts.
pub(super) async fn reports(
    State(state): State<AppState>,
    Body(raw): Body,
) -> Result<Json<stanch_api::reports::ReportResponse>, ApiError> {
    let batch: stanch_api::reports::ReportBatch =
        stanch_api::from_json(&raw).map_err(ApiError::invalid)?;
    batch.validate().map_err(ApiError::invalid)?;
    let sent = batch.endpoints.len();
    let applied = state
        .engine
        .apply(Input::Reports {
            gateway: batch.gateway,
            endpoints: batch.endpoints,
        })
        .await?;
    let refused = applied.refused.total();
    Ok(Json(stanch_api::reports::ReportResponse {
        accepted: sent - refused,
        refused,
        version: applied.version,
    }))
}
