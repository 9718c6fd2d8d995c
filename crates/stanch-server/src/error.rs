//! The HTTP edge's one error type.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use stanch_api::ErrorBody;

/// What went wrong with a request, as the client sees it.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The request is malformed; `kind` is stable, `detail` names the field.
    #[error("{kind}: {detail}")]
    Invalid {
        /// e.g. `invalid_payload`.
        kind: &'static str,
        /// What and where.
        detail: String,
    },
    /// No valid bearer token for the route's role.
    #[error("unauthorized")]
    Unauthorized,
    /// The body is larger than allowed.
    #[error("body larger than {limit} bytes")]
    TooLarge {
        /// The limit.
        limit: usize,
    },
    /// The body did not arrive by its deadline.
    #[error("the request body did not arrive in time")]
    BodyTimeout,
    /// Too many bodies are arriving at once (their memory budget is spent); retry.
    #[error("too many request bodies are arriving at once; retry")]
    Busy,
    /// Nothing there.
    #[error("not found: {0}")]
    NotFound(String),
    /// A fault worth retrying (the store cannot write, the engine is stopping).
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// New alerts were refused: the engine holds `alerts.max_active` already. The rest
    /// of the batch was taken, durably; a retry is answered the same until alerts
    /// resolve.
    #[error(
        "{refused} new alert(s) refused at the alert limit ({limit} active or {max_bytes} bytes held)"
    )]
    AlertLimit {
        /// New alerts refused.
        refused: usize,
        /// `alerts.max_active` in force.
        limit: usize,
        /// `alerts.max_bytes` in force.
        max_bytes: usize,
    },
    /// An operator's block was not made: the engine holds `blocking.max_blocks`
    /// blocks, every one of them an operator's. Nothing changed.
    #[error("block refused at the block limit ({limit} blocks)")]
    BlockLimit {
        /// The limit in force.
        limit: usize,
    },
    /// A controller without tokens refused a request a web page could have made: a
    /// name that is not loopback (DNS rebinding) or another site's `Origin`.
    #[error("{kind}: {detail}")]
    Forbidden {
        /// `not_loopback_host` or `cross_site`.
        kind: &'static str,
        /// What to do instead.
        detail: String,
    },
    /// A controller without tokens takes state changes only as JSON.
    #[error("the body must be JSON")]
    UnsupportedMediaType,
    /// This replica follows; the leader takes writes.
    #[error("this replica is not the leader")]
    NotLeader {
        /// The leader's identity, if known.
        leader: Option<String>,
    },
}

impl ApiError {
    /// A malformed payload.
    pub fn invalid(detail: impl std::fmt::Display) -> ApiError {
        ApiError::Invalid {
            kind: "invalid_payload",
            detail: detail.to_string(),
        }
    }

    /// A stable label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            ApiError::Invalid { kind, .. } => kind,
            ApiError::Unauthorized => "unauthorized",
            ApiError::TooLarge { .. } => "too_large",
            ApiError::BodyTimeout => "body_timeout",
            ApiError::Busy => "busy",
            ApiError::NotFound(_) => "not_found",
            ApiError::Unavailable(_) => "unavailable",
            ApiError::NotLeader { .. } => "not_leader",
            ApiError::AlertLimit { .. } => "alert_limit",
            ApiError::BlockLimit { .. } => "block_limit",
            ApiError::Forbidden { kind, .. } => kind,
            ApiError::UnsupportedMediaType => "unsupported_media_type",
        }
    }
}

/// The leader's identity, on a follower's refusal.
pub const LEADER: &str = "x-stanch-leader";

impl IntoResponse for ApiError {
    // Size: one arm per error, each its status, code and headers.
    fn into_response(self) -> Response {
        let status = match &self {
            ApiError::Invalid { .. } => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::BodyTimeout => StatusCode::REQUEST_TIMEOUT,
            ApiError::Busy => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::BlockLimit { .. } => StatusCode::CONFLICT,
            ApiError::Forbidden { .. } => StatusCode::FORBIDDEN,
            ApiError::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::Unavailable(_) | ApiError::NotLeader { .. } | ApiError::AlertLimit { .. } => {
                StatusCode::SERVICE_UNAVAILABLE
            }
        };
        let detail = match &self {
            ApiError::Invalid { detail, .. } => detail.clone(),
            ApiError::Unauthorized => "a valid bearer token is required".to_owned(),
            ApiError::TooLarge { limit } => format!("request body is larger than {limit} bytes"),
            ApiError::BodyTimeout => format!("{self}; send it faster or in full"),
            ApiError::Busy => self.to_string(),
            ApiError::NotFound(what) => what.clone(),
            ApiError::Unavailable(why) => why.clone(),
            ApiError::AlertLimit {
                refused,
                limit,
                max_bytes,
            } => format!(
                "{refused} new alert(s) refused: the active alerts are at a limit \
                 (alerts.max_active, {limit} alerts, or alerts.max_bytes, {max_bytes} \
                 bytes); the rest of the notification is kept; a rule with that many \
                 alerts, or that large, is routed to stanch (its alertnames are in the \
                 history)"
            ),
            ApiError::BlockLimit { limit } => format!(
                "not blocked: {limit} blocks are held (blocking.max_blocks), every one an \
                 operator's; unblock one, or raise the limit"
            ),
            ApiError::Forbidden { detail, .. } => detail.clone(),
            ApiError::UnsupportedMediaType => "without tokens, a request that changes state \
                must say `Content-Type: application/json`"
                .to_owned(),
            ApiError::NotLeader { leader } => match leader {
                Some(l) => format!("this replica is not the leader ({l} is); retry"),
                None => {
                    "this replica is not the leader, and no leader is known yet; retry".to_owned()
                }
            },
        };
        let body = ErrorBody {
            error: self.kind().to_owned(),
            detail,
        };
        let mut response = (status, axum::Json(body)).into_response();
        let headers = response.headers_mut();
        match self {
            ApiError::Unauthorized => {
                headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            }
            // The rest of the body was never read: the connection cannot carry another
            // request.
            ApiError::BodyTimeout | ApiError::TooLarge { .. } => {
                headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            ApiError::Busy => {
                headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
                headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            }
            ApiError::Unavailable(_) => {
                headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            }
            // Room is made by resolutions, not by the second: no reason to hurry back.
            ApiError::AlertLimit { .. } => {
                headers.insert(header::RETRY_AFTER, HeaderValue::from_static("30"));
            }
            ApiError::NotLeader { leader } => {
                headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
                if let Some(value) = leader.and_then(|l| HeaderValue::from_str(&l).ok()) {
                    headers.insert(LEADER, value);
                }
            }
            _ => {}
        }
        response
    }
}
