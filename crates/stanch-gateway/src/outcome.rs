//! What an upstream attempt came to, and what that means for the endpoint and the request.

use std::time::Duration;

/// The outcome of one upstream attempt.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// A complete answer.
    Success,
    /// 429 from a local rate limiter in front of the endpoint (`X-Rate-Limited: true`):
    /// not the endpoint's answer, so it never counts against it; the request moves on.
    LocalRateLimited,
    /// 429; maybe with how long to stay away.
    RateLimited {
        /// From `Retry-After`.
        retry_after: Option<Duration>,
    },
    /// 402, or `insufficient_quota`: billing, not load.
    Quota,
    /// A 5xx.
    ServerError(u16),
    /// 401/403 from upstream: the gateway's key for it is wrong.
    UpstreamAuth(u16),
    /// Could not connect, or the connection broke before a response.
    Connect,
    /// No response headers within `first_byte`.
    NoHeaders,
    /// No first token within `first_token`.
    FirstTokenTimeout,
    /// The stream stopped sending for `stream_idle`.
    Stalled,
    /// The stream ended before its final chunk.
    Truncated,
    /// A whole (non-streamed) answer larger than `max_response_bytes`.
    TooLarge,
    /// The caller's fault (400, 404, 413, 422, content policy): not the endpoint's.
    CallerFault(u16),
    /// The prompt is longer than the model's context.
    ContextTooLong,
}

/// Every outcome label, so that counters can start at zero: a series that exists before
/// the first failure lets `rate()` see that failure on the very next scrape.
pub const LABELS: [&str; 14] = [
    "success",
    "local_rate_limited",
    "rate_limited",
    "quota",
    "server_error",
    "upstream_auth",
    "connect_error",
    "no_headers",
    "first_token_timeout",
    "stalled",
    "truncated",
    "too_large",
    "caller_fault",
    "context_too_long",
];

impl Outcome {
    /// Counts against the endpoint for passive blocking.
    pub fn is_endpoint_failure(&self) -> bool {
        !matches!(
            self,
            Outcome::Success
                | Outcome::CallerFault(_)
                | Outcome::ContextTooLong
                | Outcome::LocalRateLimited
        )
    }

    /// The endpoint must not be tried again for this request (it was too slow).
    pub fn excludes_endpoint(&self) -> bool {
        matches!(self, Outcome::NoHeaders | Outcome::FirstTokenTimeout)
    }

    /// A stable label for metrics and logs.
    pub fn label(&self) -> &'static str {
        match self {
            Outcome::Success => "success",
            Outcome::LocalRateLimited => "local_rate_limited",
            Outcome::RateLimited { .. } => "rate_limited",
            Outcome::Quota => "quota",
            Outcome::ServerError(_) => "server_error",
            Outcome::UpstreamAuth(_) => "upstream_auth",
            Outcome::Connect => "connect_error",
            Outcome::NoHeaders => "no_headers",
            Outcome::FirstTokenTimeout => "first_token_timeout",
            Outcome::Stalled => "stalled",
            Outcome::Truncated => "truncated",
            Outcome::TooLarge => "too_large",
            Outcome::CallerFault(_) => "caller_fault",
            Outcome::ContextTooLong => "context_too_long",
        }
    }
}

/// Classifies an error status with its body (for OpenAI's error `code`); `local` is a
/// response marked `X-Rate-Limited: true`.
pub fn classify_status(
    status: u16,
    retry_after: Option<Duration>,
    local: bool,
    body: &[u8],
) -> Outcome {
    let code = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["error"]["code"].as_str().map(str::to_owned))
        .unwrap_or_default();
    match status {
        402 => Outcome::Quota,
        429 if local => Outcome::LocalRateLimited,
        429 if code == "insufficient_quota" => Outcome::Quota,
        429 => Outcome::RateLimited { retry_after },
        401 | 403 => Outcome::UpstreamAuth(status),
        400 if code == "context_length_exceeded" => Outcome::ContextTooLong,
        408 => Outcome::NoHeaders,
        400..=499 => Outcome::CallerFault(status),
        _ => Outcome::ServerError(status),
    }
}

/// `Retry-After` in seconds (HTTP dates are treated as absent).
pub fn retry_after(value: Option<&str>) -> Option<Duration> {
    value
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(Duration::from_secs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classification() {
        assert_eq!(
            classify_status(429, None, false, b""),
            Outcome::RateLimited { retry_after: None }
        );
        assert_eq!(
            classify_status(
                429,
                None,
                false,
                br#"{"error":{"code":"insufficient_quota"}}"#
            ),
            Outcome::Quota
        );
        assert_eq!(classify_status(402, None, false, b""), Outcome::Quota);
        assert_eq!(
            classify_status(503, None, false, b""),
            Outcome::ServerError(503)
        );
        assert_eq!(
            classify_status(
                400,
                None,
                false,
                br#"{"error":{"code":"context_length_exceeded"}}"#
            ),
            Outcome::ContextTooLong
        );
        assert_eq!(
            classify_status(
                400,
                None,
                false,
                br#"{"error":{"code":"content_policy_violation"}}"#
            ),
            Outcome::CallerFault(400)
        );
        assert!(!Outcome::CallerFault(400).is_endpoint_failure());
        assert_eq!(
            classify_status(429, None, true, b""),
            Outcome::LocalRateLimited
        );
        assert!(!Outcome::LocalRateLimited.is_endpoint_failure());
        assert_eq!(
            classify_status(503, None, true, b""),
            Outcome::ServerError(503),
            "only a 429 is a rate limiter's answer"
        );
        assert!(Outcome::UpstreamAuth(401).is_endpoint_failure());
        assert!(Outcome::FirstTokenTimeout.excludes_endpoint());
        assert_eq!(retry_after(Some("3")), Some(Duration::from_secs(3)));
        for o in [
            Outcome::Success,
            Outcome::LocalRateLimited,
            Outcome::Quota,
            Outcome::ServerError(500),
            Outcome::Connect,
            Outcome::Stalled,
            Outcome::Truncated,
        ] {
            assert!(LABELS.contains(&o.label()), "{}", o.label());
        }
        assert_eq!(retry_after(Some("Wed, 21 Oct 2015 07:28:00 GMT")), None);
    }
}
