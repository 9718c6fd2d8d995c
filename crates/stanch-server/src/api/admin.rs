//! Overrides: force, release, freeze, thaw, block, unblock, unblock-all, dry-run.
//! Each needs a `reason`, goes through the engine, and lands in the audit history.

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use serde::de::DeserializeOwned;
use stanch_api::admin::{
    AdminResponse, BlockRequest, DryRunRequest, ForceRequest, FreezeRequest, ReleaseRequest,
    ThawRequest, UnblockAllRequest, UnblockRequest, validate_reason,
};
use stanch_core::engine::check_command;
use stanch_core::{Command, Decision, Input};

use super::{AppState, body};
use crate::error::ApiError;

fn parse<T: DeserializeOwned>(
    state: &AppState,
    raw: Result<Bytes, BytesRejection>,
) -> Result<T, ApiError> {
    let raw = body(state, raw)?;
    serde_json::from_slice(&raw).map_err(|e| {
        let text = e.to_string();
        ApiError::invalid(format!(
            "body: {}",
            text.split(" at line ").next().unwrap_or(&text)
        ))
    })
}

async fn run(
    state: &AppState,
    reason: &str,
    command: Command,
) -> Result<(bool, Json<AdminResponse>), ApiError> {
    validate_reason(reason).map_err(ApiError::invalid)?;
    check_command(&state.config, &command).map_err(ApiError::invalid)?;
    let applied = state.engine.apply(Input::Command { command }).await?;
    let changed = applied
        .decisions
        .iter()
        .any(|d| matches!(d, Decision::Override { .. }));
    let effects = applied
        .decisions
        .iter()
        .filter(|d| {
            !matches!(
                d,
                Decision::Published {
                    lease_renewal: true,
                    ..
                }
            )
        })
        .map(ToString::to_string)
        .collect();
    Ok((
        changed,
        Json(AdminResponse {
            changed,
            version: applied.version,
            effects,
        }),
    ))
}

/// `POST /v1/admin/force`
pub(super) async fn force(
    State(s): State<AppState>,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Json<AdminResponse>, ApiError> {
    let r: ForceRequest = parse(&s, raw)?;
    let reason = r.reason.clone();
    Ok(run(
        &s,
        &reason,
        Command::Force {
            model: r.model,
            rung: r.rung,
            ttl: r.ttl,
            reason: r.reason,
        },
    )
    .await?
    .1)
}

/// `POST /v1/admin/release`
pub(super) async fn release(
    State(s): State<AppState>,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Json<AdminResponse>, ApiError> {
    let r: ReleaseRequest = parse(&s, raw)?;
    let reason = r.reason.clone();
    Ok(run(
        &s,
        &reason,
        Command::Release {
            model: r.model,
            reason: r.reason,
        },
    )
    .await?
    .1)
}

/// `POST /v1/admin/freeze`
pub(super) async fn freeze(
    State(s): State<AppState>,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Json<AdminResponse>, ApiError> {
    let r: FreezeRequest = parse(&s, raw)?;
    let reason = r.reason.clone();
    Ok(run(
        &s,
        &reason,
        Command::Freeze {
            model: r.model,
            ttl: r.ttl,
            reason: r.reason,
        },
    )
    .await?
    .1)
}

/// `POST /v1/admin/thaw`
pub(super) async fn thaw(
    State(s): State<AppState>,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Json<AdminResponse>, ApiError> {
    let r: ThawRequest = parse(&s, raw)?;
    let reason = r.reason.clone();
    Ok(run(
        &s,
        &reason,
        Command::Thaw {
            model: r.model,
            reason: r.reason,
        },
    )
    .await?
    .1)
}

/// `POST /v1/admin/block`
pub(super) async fn block(
    State(s): State<AppState>,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Json<AdminResponse>, ApiError> {
    let r: BlockRequest = parse(&s, raw)?;
    let reason = r.reason.clone();
    let command = Command::Block {
        endpoint: r.endpoint,
        model: r.model,
        ttl: r.ttl,
        reason: r.reason,
    };
    Ok(run(&s, &reason, command).await?.1)
}

/// `POST /v1/admin/unblock`: 404 when there is no such block, listing the blocks there are.
pub(super) async fn unblock(
    State(s): State<AppState>,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Json<AdminResponse>, ApiError> {
    let r: UnblockRequest = parse(&s, raw)?;
    let (reason, endpoint, model) = (r.reason.clone(), r.endpoint.clone(), r.model.clone());
    let (changed, response) = run(
        &s,
        &reason,
        Command::Unblock {
            endpoint: r.endpoint,
            model: r.model,
            reason: r.reason,
        },
    )
    .await?;
    if !changed {
        let blocked: Vec<String> = s
            .publisher
            .load()
            .blocks
            .iter()
            .map(|b| {
                format!(
                    "{} ({})",
                    b.endpoint,
                    b.model.as_deref().unwrap_or("all models")
                )
            })
            .collect();
        let which = format!("{endpoint} ({})", model.as_deref().unwrap_or("all models"));
        let list = if blocked.is_empty() {
            "none".to_owned()
        } else {
            blocked.join(", ")
        };
        return Err(ApiError::NotFound(format!(
            "no block on {which}; blocked now: {list}"
        )));
    }
    Ok(response)
}

/// `POST /v1/admin/unblock-all`
pub(super) async fn unblock_all(
    State(s): State<AppState>,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Json<AdminResponse>, ApiError> {
    let r: UnblockAllRequest = parse(&s, raw)?;
    let reason = r.reason.clone();
    Ok(run(&s, &reason, Command::UnblockAll { reason: r.reason })
        .await?
        .1)
}

/// `POST /v1/admin/dry-run`
pub(super) async fn dry_run(
    State(s): State<AppState>,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Json<AdminResponse>, ApiError> {
    let r: DryRunRequest = parse(&s, raw)?;
    let reason = r.reason.clone();
    Ok(run(
        &s,
        &reason,
        Command::DryRun {
            enabled: r.enabled,
            reason: r.reason,
        },
    )
    .await?
    .1)
}
