//! Override API request and response bodies (`/v1/admin/*`).
//!
//! Every override names a `reason`: it is written to the audit history and shown in
//! the status. Bodies refuse unknown fields, so a typo is an error, not a no-op.

use serde::{Deserialize, Serialize};

use crate::{HumanDuration, Rung};

/// `POST /v1/admin/force`: pin a model to a rung.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForceRequest {
    /// The model to pin.
    pub model: String,
    /// The rung to pin it at.
    pub rung: Rung,
    /// When the pin ends on its own; without it, it lasts until released.
    #[serde(default)]
    pub ttl: Option<HumanDuration>,
    /// Why, for the audit history.
    pub reason: String,
}

/// `POST /v1/admin/release`: end a model's pin; automation takes over from its rung.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReleaseRequest {
    /// The pinned model.
    pub model: String,
    /// Why, for the audit history.
    pub reason: String,
}

/// `POST /v1/admin/freeze`: automation stops moving one model, or every model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FreezeRequest {
    /// The model to freeze; `None` freezes everything.
    #[serde(default)]
    pub model: Option<String>,
    /// When the freeze ends on its own.
    #[serde(default)]
    pub ttl: Option<HumanDuration>,
    /// Why, for the audit history.
    pub reason: String,
}

/// `POST /v1/admin/thaw`: end a freeze.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ThawRequest {
    /// The model to thaw; `None` ends the global freeze.
    #[serde(default)]
    pub model: Option<String>,
    /// Why, for the audit history.
    pub reason: String,
}

/// `POST /v1/admin/block`: soft-block an endpoint by hand.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlockRequest {
    /// The endpoint as gateways name it.
    pub endpoint: String,
    /// Block it for this model only; `None` blocks it for every model.
    #[serde(default)]
    pub model: Option<String>,
    /// How long; defaults to the configured block time.
    #[serde(default)]
    pub ttl: Option<HumanDuration>,
    /// Why, for the audit history.
    pub reason: String,
}

/// `POST /v1/admin/unblock`: lift one block.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UnblockRequest {
    /// The blocked endpoint.
    pub endpoint: String,
    /// The model of a per-model block; `None` lifts the endpoint-wide block.
    #[serde(default)]
    pub model: Option<String>,
    /// Why, for the audit history.
    pub reason: String,
}

/// `POST /v1/admin/unblock-all`: lift every block.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UnblockAllRequest {
    /// Why, for the audit history.
    pub reason: String,
}

/// `POST /v1/admin/dry-run`: decide and report, but publish nothing new.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DryRunRequest {
    /// On or off.
    pub enabled: bool,
    /// Why, for the audit history.
    pub reason: String,
}

/// What an operator does to a fail-back under way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FailbackAction {
    /// Return the rest of the traffic now: the step down, without the remaining gates.
    Skip,
    /// Give it up: all of the traffic back where it was, the window started over with
    /// backoff, as when a gate fails.
    Abort,
}

impl FailbackAction {
    /// Its name in requests: `skip`, `abort`.
    pub const fn as_str(self) -> &'static str {
        match self {
            FailbackAction::Skip => "skip",
            FailbackAction::Abort => "abort",
        }
    }
}

impl std::str::FromStr for FailbackAction {
    type Err = UnknownFailbackAction;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        [FailbackAction::Skip, FailbackAction::Abort]
            .into_iter()
            .find(|a| a.as_str() == s)
            .ok_or_else(|| UnknownFailbackAction(s.to_owned()))
    }
}

/// A fail-back action that is neither `skip` nor `abort`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a fail-back action: skip or abort")]
pub struct UnknownFailbackAction(String);

/// `POST /v1/admin/failback`: skip to the end of a model's fail-back, or abort it. (A
/// freeze pauses one; a thaw resumes it.)
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FailbackRequest {
    /// The model failing back.
    pub model: String,
    /// `skip` or `abort`.
    pub action: FailbackAction,
    /// Why, for the audit history.
    pub reason: String,
}

/// The answer to every admin request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdminResponse {
    /// False when the request asked for what was already so.
    pub changed: bool,
    /// The route version after the request.
    pub version: u64,
    /// What happened, one line each, for humans.
    pub effects: Vec<String>,
}

/// The longest `ttl` an override may have: 30 days. Longer is what "until released"
/// (no `ttl`) is for.
pub const MAX_TTL: HumanDuration = HumanDuration::secs(30 * 86_400);

/// The longest `reason`, in characters (Unicode scalar values), as the OpenAPI
/// document's `maxLength` counts them.
pub const MAX_REASON_CHARS: usize = 1024;

/// Checks the `reason` every override must carry.
pub fn validate_reason(reason: &str) -> Result<(), crate::Invalid> {
    let trimmed = reason.trim();
    if trimmed.is_empty() {
        Err(crate::Invalid::new(
            "reason",
            "must say why (it goes into the audit history)",
        ))
    } else if reason.chars().count() > MAX_REASON_CHARS {
        Err(crate::Invalid::new(
            "reason",
            format!("at most {MAX_REASON_CHARS} characters"),
        ))
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reason_is_limited_in_characters_not_bytes() {
        assert!(validate_reason(&"集".repeat(MAX_REASON_CHARS)).is_ok());
        let err = validate_reason(&"集".repeat(MAX_REASON_CHARS + 1)).unwrap_err();
        assert_eq!(err.field, "reason", "{err}");
        assert!(validate_reason("  ").is_err());
    }
}
