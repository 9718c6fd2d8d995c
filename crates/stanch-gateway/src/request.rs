//! Request: what a request to a proxied API is as it goes through the gateway. The
//! [`Api`] it calls; the [`Refusal`] that turns it away before routing, the caller's
//! fault and never an upstream's; and, once admitted, the [`Ctx`] it carries through
//! routing, its attempts and its answer, with the route table read once for it.

use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use bytes::Bytes;
use stanch_api::{RouteTable, Timestamp};
use stanch_net::body::BodyError;
use tokio::time::Instant;

use crate::Gateway;
use crate::endpoints::Endpoint;
use crate::headers::Forward;

/// The proxied APIs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Api {
    /// `/v1/chat/completions`; the index of `Endpoint::paths`.
    Chat = 0,
    /// `/v1/completions`.
    Completions = 1,
    /// `/v1/embeddings`.
    Embeddings = 2,
}

impl Api {
    /// The API a path names.
    pub(crate) fn of_path(path: &str) -> Option<Api> {
        match path {
            "/v1/chat/completions" => Some(Api::Chat),
            "/v1/completions" => Some(Api::Completions),
            "/v1/embeddings" => Some(Api::Embeddings),
            _ => None,
        }
    }

    /// Its path.
    pub(crate) fn path(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Completions => "/v1/completions",
            Api::Embeddings => "/v1/embeddings",
        }
    }

    /// Whether the FAQ can answer it (a completion can be a canned text; an embedding
    /// cannot).
    pub(crate) fn answers_from_faq(self) -> bool {
        self != Api::Embeddings
    }
}

/// Why a request was turned away before routing. Its text is what the caller reads:
/// it names what was wrong, and never carries an I/O error's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Refusal {
    #[error("{0} takes POST")]
    MethodNotAllowed(&'static str),
    #[error("unknown API key")]
    UnknownKey,
    #[error("request bodies are limited to {0} bytes")]
    BodyTooLarge(usize),
    #[error("the request body did not arrive in time")]
    BodyTimeout,
    #[error("too many request bodies are arriving at once; retry")]
    Busy,
    #[error("the request body ended before its declared length")]
    BodyUnreadable,
    #[error(
        "the body must be a JSON object in UTF-8, with at most one `model` (a string) \
         and one `stream` (a boolean)"
    )]
    InvalidJson,
    #[error("model: required")]
    ModelRequired,
    #[error("model {0:?} is not served here")]
    ModelNotFound(String),
}

impl Refusal {
    /// The answer's status.
    pub(crate) fn status(&self) -> StatusCode {
        match self {
            Refusal::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            Refusal::UnknownKey => StatusCode::UNAUTHORIZED,
            Refusal::BodyTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Refusal::BodyTimeout => StatusCode::REQUEST_TIMEOUT,
            Refusal::Busy => StatusCode::SERVICE_UNAVAILABLE,
            Refusal::BodyUnreadable | Refusal::InvalidJson | Refusal::ModelRequired => {
                StatusCode::BAD_REQUEST
            }
            Refusal::ModelNotFound(_) => StatusCode::NOT_FOUND,
        }
    }

    /// OpenAI's error `code`, and the `kind` of
    /// `stanch_gateway_rejected_requests_total`.
    pub(crate) fn code(&self) -> &'static str {
        match self {
            Refusal::MethodNotAllowed(_) => "method_not_allowed",
            Refusal::UnknownKey => "invalid_api_key",
            Refusal::BodyTooLarge(_) => "body_too_large",
            Refusal::BodyTimeout => "body_timeout",
            Refusal::Busy => "busy",
            Refusal::BodyUnreadable => "body_unreadable",
            Refusal::InvalidJson => "invalid_json",
            Refusal::ModelRequired => "model_required",
            Refusal::ModelNotFound(_) => "model_not_found",
        }
    }

    /// Seconds for `Retry-After`, when trying again soon can help.
    pub(crate) fn retry_after(&self) -> Option<u32> {
        matches!(self, Refusal::Busy).then_some(1)
    }

    /// Whether the connection must close after the answer: the body was not read to
    /// its end, so the connection cannot carry another request.
    pub(crate) fn closes(&self) -> bool {
        matches!(self, Refusal::BodyTimeout | Refusal::Busy)
    }
}

impl<E> From<BodyError<E>> for Refusal {
    fn from(e: BodyError<E>) -> Refusal {
        match e {
            BodyError::TooLarge(limit) => Refusal::BodyTooLarge(limit),
            BodyError::TimedOut(_) => Refusal::BodyTimeout,
            BodyError::Busy => Refusal::Busy,
            // Its cause (a reset, a short body) is the caller's own connection's.
            BodyError::Broken(_) => Refusal::BodyUnreadable,
        }
    }
}

/// What an admitted request carries through routing, its attempts and its answer.
pub(crate) struct Ctx<'g> {
    pub(crate) gw: &'g Arc<Gateway>,
    pub(crate) api: Api,
    /// The model as the caller named it.
    pub(crate) requested: String,
    /// The model it resolves to here (a name in the gateway's configuration).
    pub(crate) model: &'g str,
    /// The model whose plan serves it: `model`, or its alias while degraded.
    pub(crate) serving: &'g str,
    /// The request body as the caller sent it.
    pub(crate) raw: Bytes,
    pub(crate) stream: bool,
    /// The route table in force for this request, read once as it was admitted.
    pub(crate) table: Option<Arc<crate::table::Applied>>,
    /// The wall-clock time the table is judged at (leases, blocks).
    pub(crate) wall: Timestamp,
    pub(crate) version: u64,
    pub(crate) started: Instant,
    /// Served by the model's alias (the ladder's degraded rung).
    pub(crate) degraded: bool,
    pub(crate) attempts: u32,
    /// The caller's tenant (an index into `Gateway::tenants`), if its key is known.
    pub(crate) tenant: Option<usize>,
    /// What of the caller's headers goes upstream, and the request's id.
    pub(crate) forward: Forward,
}

impl Ctx<'_> {
    /// The caller's tenant name, for logs (never its key).
    pub(crate) fn tenant_name(&self) -> &str {
        self.tenant
            .map_or("anonymous", |i| self.gw.tenants[i].name.as_str())
    }

    /// Whether the caller is a VIP tenant (exempt from degradation where the table
    /// says so).
    pub(crate) fn vip(&self) -> bool {
        self.tenant.is_some_and(|i| self.gw.tenants[i].vip)
    }

    /// The route table this request is routed by, if any.
    pub(crate) fn route_table(&self) -> Option<&RouteTable> {
        self.table.as_deref().map(|a| &**a)
    }

    /// Time left on the block this request's route table puts on `e`, if any.
    pub(crate) fn table_block(&self, e: &Endpoint) -> Option<Duration> {
        let until = e.blocked_by(self.table.as_deref()?, self.wall)?;
        Some(until.since(self.wall))
    }

    /// Whether `e` is open to this request at `now`: not attempted yet (per `tried`),
    /// and blocked neither by its own failures nor by the route table.
    pub(crate) fn open(
        &self,
        e: &Endpoint,
        tried: impl Fn(&Endpoint) -> bool,
        now: Instant,
    ) -> bool {
        !tried(e) && e.blocked(now).is_none() && self.table_block(e).is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_api_is_found_by_its_own_path() {
        for api in [Api::Chat, Api::Completions, Api::Embeddings] {
            assert_eq!(Api::of_path(api.path()), Some(api));
        }
        assert_eq!(Api::of_path("/v1/models"), None);
    }

    /// A refusal's answer follows from its kind: what the caller can do about it,
    /// and nothing of the server's insides.
    #[test]
    fn refusals_say_what_was_wrong_and_what_to_do() {
        let busy = Refusal::from(BodyError::<()>::Busy);
        assert_eq!(
            (busy.status(), busy.retry_after(), busy.closes()),
            (StatusCode::SERVICE_UNAVAILABLE, Some(1), true)
        );
        let broken = Refusal::from(BodyError::Broken(std::io::Error::other(
            "connection reset by peer (os error 104)",
        )));
        assert_eq!(broken, Refusal::BodyUnreadable);
        assert!(!broken.to_string().contains("os error"), "{broken}");
        assert_eq!(
            Refusal::from(BodyError::<()>::TooLarge(1024)).to_string(),
            "request bodies are limited to 1024 bytes"
        );
        let unknown = Refusal::ModelNotFound("qwen\n-72b".into());
        assert_eq!(unknown.status(), StatusCode::NOT_FOUND);
        assert_eq!(
            unknown.to_string(),
            r#"model "qwen\n-72b" is not served here"#
        );
        assert!(!Refusal::ModelRequired.closes() && Refusal::BodyTimeout.closes());
    }
}
