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
    /// Nothing there.
    #[error("not found: {0}")]
    NotFound(String),
    /// A fault worth retrying (the store cannot write, the engine is stopping).
    #[error("unavailable: {0}")]
    Unavailable(String),
}

impl ApiError {
    /// A malformed payload.
    pub fn invalid(detail: impl Into<String>) -> ApiError {
        ApiError::Invalid {
            kind: "invalid_payload",
            detail: detail.into(),
        }
    }

    /// A stable label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            ApiError::Invalid { kind, .. } => kind,
            ApiError::Unauthorized => "unauthorized",
            ApiError::TooLarge { .. } => "too_large",
            ApiError::NotFound(_) => "not_found",
            ApiError::Unavailable(_) => "unavailable",
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = match &self {
            ApiError::Invalid { .. } => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
        };
        let detail = match &self {
            ApiError::Invalid { detail, .. } => detail.clone(),
            ApiError::Unauthorized => "a valid bearer token is required".to_owned(),
            ApiError::TooLarge { limit } => format!("request body is larger than {limit} bytes"),
            ApiError::NotFound(what) => what.clone(),
            ApiError::Unavailable(why) => why.clone(),
        };
        let body = ErrorBody {
            error: self.kind().to_owned(),
            detail,
        };
        let mut response = (status, axum::Json(body)).into_response();
        if matches!(self, ApiError::Unauthorized) {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}
