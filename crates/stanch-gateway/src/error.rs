//! Why an attempt at an endpoint failed, as a value, in the manner of Pingora's error
//! type: what happened (an [`Outcome`], which the metrics and passive blocking count),
//! what trying again can do about it ([`Retry`]), and the cause underneath (an I/O or
//! protocol error), kept for the log. The cause is never written into an answer: the
//! caller gets the gateway's own words, or the upstream's answer as it came.

use std::error::Error as StdError;
use std::fmt;
use std::time::Duration;

use axum::response::Response;

use crate::outcome::Outcome;

/// What trying again can do after a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Retry {
    /// Another endpoint may answer: the next one the plan and the budget allow.
    Elsewhere,
    /// The request is at fault (a 4xx the caller must fix): no endpoint would answer
    /// better, so the upstream's answer goes to the caller as it is.
    Never,
    /// The prompt is longer than the model's context: a model with a larger one
    /// (`larger_context`) may answer; without one, as [`Retry::Never`].
    LargerContext,
}

impl Outcome {
    /// What trying again can do after this outcome.
    pub(crate) fn retry(&self) -> Retry {
        match self {
            Outcome::CallerFault(_) => Retry::Never,
            Outcome::ContextTooLong => Retry::LargerContext,
            _ => Retry::Elsewhere,
        }
    }
}

/// A failed attempt.
pub(crate) struct Failure {
    /// What happened, as counted.
    pub(crate) outcome: Outcome,
    /// The upstream's answer, when it is one to pass on ([`Retry::Never`] and
    /// [`Retry::LargerContext`]).
    pub(crate) answer: Option<Response>,
    /// The connection broke under the exchange (a reset, a close before any answer)
    /// rather than being refused: the endpoint was there a moment ago.
    transient: bool,
    /// The error underneath, for the log.
    cause: Option<Box<dyn StdError + Send + Sync>>,
}

/// Why the same endpoint may be worth a second attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Again {
    /// A one-off fault: a 500, 502, 503 or 504, or a connection that broke before any
    /// answer. Worth one more try after the usual backoff.
    Transient,
    /// A 429 that said how long to stay away: worth waiting that long, never less.
    After(Duration),
}

impl Again {
    /// The least wait before the attempt.
    pub(crate) fn floor(self) -> Duration {
        match self {
            Again::Transient => Duration::ZERO,
            Again::After(d) => d,
        }
    }

    /// The metrics' label.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Again::Transient => "transient",
            Again::After(_) => "retry_after",
        }
    }
}

impl Failure {
    /// A failure with no cause beyond its outcome (a timeout, an error status).
    pub(crate) fn new(outcome: Outcome) -> Failure {
        Failure {
            outcome,
            answer: None,
            transient: false,
            cause: None,
        }
    }

    /// The same failure, marked as a connection that broke under the exchange.
    pub(crate) fn transient(self) -> Failure {
        Failure {
            transient: true,
            ..self
        }
    }

    /// The same failure, caused by `cause`.
    pub(crate) fn because(self, cause: impl Into<Box<dyn StdError + Send + Sync>>) -> Failure {
        Failure {
            cause: Some(cause.into()),
            ..self
        }
    }

    /// The same failure, with the upstream's answer to pass on.
    pub(crate) fn answered(self, answer: Response) -> Failure {
        Failure {
            answer: Some(answer),
            ..self
        }
    }

    /// What trying again can do.
    pub(crate) fn retry(&self) -> Retry {
        self.outcome.retry()
    }

    /// Whether the same endpoint may answer a second attempt, and why. Not for an
    /// endpoint that was too slow, refused the connection, or answered with a status
    /// that another try will not change (501, 505, quota, its credentials).
    pub(crate) fn again_here(&self) -> Option<Again> {
        match self.outcome {
            Outcome::ServerError(500 | 502 | 503 | 504) => Some(Again::Transient),
            Outcome::Connect if self.transient => Some(Again::Transient),
            Outcome::RateLimited {
                retry_after: Some(d),
            } => Some(Again::After(d)),
            _ => None,
        }
    }
}

impl fmt::Debug for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Failure")
            .field("outcome", &self.outcome)
            .field("answered", &self.answer.as_ref().map(Response::status))
            .field("transient", &self.transient)
            .field("cause", &self.cause)
            .finish()
    }
}

/// The outcome's label, then each cause in turn: `connect_error: HTTP exchange with
/// up:8000: connection: reset by peer`.
impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.outcome.label())?;
        let mut cause = self
            .cause
            .as_deref()
            .map(|c| c as &(dyn StdError + 'static));
        while let Some(c) = cause {
            write!(f, ": {c}")?;
            cause = c.source();
        }
        Ok(())
    }
}

impl StdError for Failure {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.cause
            .as_deref()
            .map(|c| c as &(dyn StdError + 'static))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("exchange with up:8000")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn a_failure_shows_its_outcome_then_every_cause() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset by peer");
        let failure = Failure::new(Outcome::Connect).because(Outer(io));
        assert_eq!(
            failure.to_string(),
            "connect_error: exchange with up:8000: reset by peer"
        );
        assert!(failure.source().is_some());
        assert_eq!(Failure::new(Outcome::NoHeaders).to_string(), "no_headers");
    }

    /// The upstream client's own errors keep their causes as sources, each told once.
    #[test]
    fn an_upstream_error_keeps_its_cause_as_a_source() {
        use crate::upstream::{SendError, h1};
        let io = || std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset by peer");
        let http = SendError::Http("up:8000".into(), h1::Error::Io(io()));
        let failure = Failure::new(Outcome::Connect).because(http);
        assert_eq!(
            failure.to_string(),
            "connect_error: HTTP exchange with up:8000: connection: reset by peer"
        );
        let connect = SendError::Connect("up:8000".into(), io());
        assert_eq!(connect.to_string(), "connect to up:8000");
        assert_eq!(
            stanch_log::Sources(&connect).to_string(),
            "reset by peer",
            "the cause is the source, not in the message"
        );
    }

    #[test]
    fn only_the_callers_faults_stop_the_retries() {
        for outcome in [
            Outcome::Connect,
            Outcome::NoHeaders,
            Outcome::ServerError(503),
            Outcome::RateLimited { retry_after: None },
            Outcome::Quota,
            Outcome::UpstreamAuth(401),
            Outcome::Truncated,
            Outcome::LocalRateLimited,
        ] {
            assert_eq!(outcome.retry(), Retry::Elsewhere, "{outcome:?}");
        }
        assert_eq!(Outcome::CallerFault(400).retry(), Retry::Never);
        assert_eq!(Outcome::ContextTooLong.retry(), Retry::LargerContext);
    }

    #[test]
    fn only_a_one_off_fault_or_a_said_wait_is_worth_the_same_endpoint_again() {
        let again = |f: Failure| f.again_here();
        for status in [500, 502, 503, 504] {
            assert_eq!(
                again(Failure::new(Outcome::ServerError(status))),
                Some(Again::Transient)
            );
        }
        assert_eq!(
            again(Failure::new(Outcome::Connect).transient()),
            Some(Again::Transient)
        );
        assert_eq!(
            again(Failure::new(Outcome::RateLimited {
                retry_after: Some(Duration::from_secs(2))
            })),
            Some(Again::After(Duration::from_secs(2)))
        );
        for outcome in [
            Outcome::ServerError(501),
            Outcome::ServerError(505),
            Outcome::Connect,
            Outcome::RateLimited { retry_after: None },
            Outcome::NoHeaders,
            Outcome::FirstTokenTimeout,
            Outcome::Quota,
            Outcome::UpstreamAuth(401),
            Outcome::CallerFault(400),
            Outcome::Stalled,
            Outcome::Truncated,
        ] {
            assert_eq!(again(Failure::new(outcome.clone())), None, "{outcome:?}");
        }
        assert_eq!(
            Again::After(Duration::from_secs(2)).floor(),
            Duration::from_secs(2)
        );
        assert_eq!(Again::Transient.floor(), Duration::ZERO);
    }
}
