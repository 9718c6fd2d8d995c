//! Overrides: force, release, freeze, thaw, block, unblock, unblock-all, dry-run, and a
//! fail-back's skip or abort.
//! Each needs a `reason`, goes through the engine, and lands in the audit history.

use axum::Json;
use axum::extract::State;
use serde::de::DeserializeOwned;
use stanch_api::admin::{
    AdminResponse, BlockRequest, DryRunRequest, FailbackRequest, ForceRequest, FreezeRequest,
    ReleaseRequest, ThawRequest, UnblockAllRequest, UnblockRequest, validate_reason,
};
use stanch_core::engine::check_command;
use stanch_core::{Command, Decision, Input};

use super::{AppState, Body};
use crate::error::ApiError;

fn parse<T: DeserializeOwned>(raw: &[u8]) -> Result<T, ApiError> {
    stanch_api::from_json(raw).map_err(ApiError::invalid)
}

/// An override request: its reason, and the engine command it asks for.
pub(super) trait Override: DeserializeOwned {
    /// The operator's reason.
    fn reason(&self) -> &str;
    /// The command for the engine.
    fn into_command(self) -> Command;
}

macro_rules! overrides {
    ($($request:ty => |$r:ident| $command:expr;)*) => {$(
        impl Override for $request {
            fn reason(&self) -> &str {
                &self.reason
            }
            fn into_command(self) -> Command {
                let $r = self;
                $command
            }
        }
    )*};
}

overrides! {
    ForceRequest => |r| Command::Force { model: r.model, rung: r.rung, ttl: r.ttl, reason: r.reason };
    ReleaseRequest => |r| Command::Release { model: r.model, reason: r.reason };
    FreezeRequest => |r| Command::Freeze { model: r.model, ttl: r.ttl, reason: r.reason };
    ThawRequest => |r| Command::Thaw { model: r.model, reason: r.reason };
    FailbackRequest => |r| Command::Failback { model: r.model, order: r.action, reason: r.reason };
    BlockRequest => |r| Command::Block { endpoint: r.endpoint, model: r.model, ttl: r.ttl, reason: r.reason };
    UnblockRequest => |r| Command::Unblock { endpoint: r.endpoint, model: r.model, reason: r.reason };
    UnblockAllRequest => |r| Command::UnblockAll { reason: r.reason };
    DryRunRequest => |r| Command::DryRun { enabled: r.enabled, reason: r.reason };
}

/// Validates, applies and reports one override; also says whether it changed anything.
async fn run(
    state: &AppState,
    request: impl Override,
) -> Result<(bool, Json<AdminResponse>), ApiError> {
    validate_reason(request.reason()).map_err(ApiError::invalid)?;
    let command = request.into_command();
    check_command(&state.config.load(), &command).map_err(ApiError::invalid)?;
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

/// `POST /v1/admin/{force,release,freeze,thaw,block,unblock-all,dry-run}`.
pub(super) async fn apply<R: Override>(
    State(s): State<AppState>,
    Body(raw): Body,
) -> Result<Json<AdminResponse>, ApiError> {
    let request: R = parse(&raw)?;
    Ok(run(&s, request).await?.1)
}

/// `POST /v1/admin/block`: 409 when the block was not made, which happens only at
/// `blocking.max_blocks` with every block held an operator's.
pub(super) async fn block(
    State(s): State<AppState>,
    Body(raw): Body,
) -> Result<Json<AdminResponse>, ApiError> {
    let request: BlockRequest = parse(&raw)?;
    let (changed, response) = run(&s, request).await?;
    if !changed {
        let limit = s.config.load().blocking.max_blocks;
        return Err(ApiError::BlockLimit { limit });
    }
    Ok(response)
}

/// `POST /v1/admin/unblock`: 404 when there is no such block, listing the blocks there are.
pub(super) async fn unblock(
    State(s): State<AppState>,
    Body(raw): Body,
) -> Result<Json<AdminResponse>, ApiError> {
    let request: UnblockRequest = parse(&raw)?;
    let which = format!(
        "{} ({})",
        request.endpoint,
        request.model.as_deref().unwrap_or("all models")
    );
    let (changed, response) = run(&s, request).await?;
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
