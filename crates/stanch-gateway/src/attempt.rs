//! Attempt: one attempt at an endpoint, and what decides the next. Within a target
//! (a pool of the plan), the balancer chooses among the endpoints not yet tried
//! ([`next`]); every attempt after the first waits a jittered backoff and spends from
//! the retry budget, and none starts past the request's deadline or its
//! `max_attempts`. An attempt is sent ([`send`]) and what comes back read and
//! classified: the head of a success, a whole answer ([`whole`]), or a [`Failure`]
//! that says what trying again can do. Every outcome is counted and fed to the
//! endpoint's passive blocking ([`record`]).
//!
//! A request's attempts are made by [`crate::serving`], working through its plan, and by
//! a broken stream looking for its continuation ([`crate::stream::continuation`]).

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderValue, header};
use axum::response::Response;
use bytes::Bytes;
use http_body_util::BodyExt;
use serde_json::Value;
use stanch_api::headers::RATE_LIMITED;
use stanch_log::Sources;
use stanch_net::body::{BodyError, BodyLimits, read_whole};
use stanch_net::timer::timeout_at;
use tokio::time::Instant;
use tracing::{debug, warn};

use crate::Gateway;
use crate::endpoints::{Endpoint, InFlight, Kind, Work, choose};
use crate::error::{Failure, Retry};
use crate::headers;
use crate::metrics::{AttemptLabels, KindLabel, Label, ModelLabel};
use crate::outcome::{Outcome, classify_status, retry_after};
use crate::request::Ctx;
use crate::route::Target;
use crate::upstream::{self, SendError};

/// The most of an upstream error body read, to classify it.
const ERROR_BODY_LIMIT: usize = 64 * 1024;

/// The endpoints a request has attempted.
#[derive(Default)]
pub(crate) struct Tried<'g> {
    /// Each attempted endpoint, once per attempt.
    pub(crate) all: Vec<&'g Arc<Endpoint>>,
    /// Those attempted again, once for each time.
    pub(crate) again: Vec<&'g Endpoint>,
}

impl Tried<'_> {
    pub(crate) fn has(&self, e: &Endpoint) -> bool {
        self.all.iter().any(|t| std::ptr::eq(t.as_ref(), e))
    }

    pub(crate) fn times_again(&self, e: &Endpoint) -> u32 {
        self.again.iter().filter(|t| std::ptr::eq(**t, e)).count() as u32
    }
}

pub(crate) fn count_retry(ctx: &Ctx<'_>) {
    ctx.gw
        .metrics
        .retries
        .get_or_create(&ModelLabel {
            model: Label::from(ctx.model),
        })
        .inc();
}

/// What to do next within the target `targets[t]`.
pub(crate) enum Next<'g> {
    /// Attempt this endpoint.
    Try(&'g Arc<Endpoint>),
    /// Nothing more in this pool: the next target.
    PoolDone,
    /// Every endpoint left here is blocked and a later target has an open one: that
    /// first, this after every other target.
    PassOver,
    /// No more attempts for this request (its deadline, its `max_attempts`, the
    /// retry budget).
    Stop,
}

/// The next endpoint to attempt in `targets[t]`, after the backoff a retry waits.
/// On the `last_resort` pass over targets passed over before, blocked endpoints are
/// attempted.
pub(crate) async fn next<'g>(
    ctx: &Ctx<'g>,
    targets: &[Target<'g>],
    t: usize,
    tried: &Tried<'_>,
    deadline: Instant,
    last_resort: bool,
) -> Next<'g> {
    let gw: &'g Gateway = ctx.gw;
    let (m, p) = targets[t];
    let endpoints = &gw.models[m].pools[p].1;
    let now = if ctx.attempts == 0 {
        ctx.started
    } else {
        Instant::now()
    };
    if ctx.attempts >= gw.config.retry.max_attempts || now >= deadline {
        return Next::Stop;
    }
    let candidates: Vec<&Endpoint> = endpoints
        .iter()
        .map(Arc::as_ref)
        .filter(|e| !tried.has(e))
        .collect();
    if candidates.is_empty() {
        return Next::PoolDone;
    }
    let kind = if ctx.stream {
        Kind::Stream
    } else {
        Kind::Whole
    };
    let slow_start = gw.config.blocking.slow_start.0;
    let blocked = |e: &Endpoint| ctx.table_block(e);
    let Some((chosen, all_blocked)) = choose(&candidates, blocked, kind, now, slow_start) else {
        return Next::PoolDone;
    };
    // Chosen before the backoff, so that passing over a blocked target spends no
    // retry and waits for nothing.
    if all_blocked && !last_resort {
        let open_later = targets[t + 1..]
            .iter()
            .flat_map(|(m2, p2)| &gw.models[*m2].pools[*p2].1)
            .any(|e| ctx.open(e, |e| tried.has(e), now));
        if open_later {
            return Next::PassOver;
        }
    }
    if ctx.attempts > 0 {
        if !gw.budget.try_retry(now) {
            gw.metrics.budget_exhausted.inc();
            return Next::Stop;
        }
        count_retry(ctx);
        tokio::time::sleep(backoff(gw, ctx.attempts)).await;
    }
    if all_blocked {
        gw.metrics.all_blocked.inc();
    }
    let endpoint = endpoints
        .iter()
        .find(|e| std::ptr::eq(e.as_ref(), chosen))
        .expect("chosen from this pool");
    Next::Try(endpoint)
}

/// A retry's wait: `backoff_base` doubling with each attempt up to `backoff_max`,
/// jittered to between half and all of it.
pub(crate) fn backoff(gw: &Gateway, attempts: u32) -> Duration {
    let r = &gw.config.retry;
    let base = r
        .backoff_base
        .0
        .saturating_mul(1 << attempts.saturating_sub(1).min(16))
        .min(r.backoff_max.0);
    // Between half and all of it: three quarters, ±a third.
    stanch_api::jitter::spread(
        base.mul_f64(0.75),
        1.0 / 3.0,
        crate::endpoints::next_random(),
    )
}

/// Sends `body` to `endpoint` and waits for the head of a successful answer, within
/// `timeouts.first_byte` and the deadline; an error status is a [`Failure`], read and
/// classified. Gives the answer with when it was sent, counted in flight.
pub(crate) async fn send(
    ctx: &Ctx<'_>,
    endpoint: &Arc<Endpoint>,
    body: Bytes,
    deadline: Instant,
) -> Result<(hyper::Response<upstream::Body>, Instant, InFlight), Failure> {
    let gw = ctx.gw;
    let mut request = endpoint.post(ctx.api as usize, body);
    ctx.forward.onto(request.headers_mut());
    let in_flight = endpoint.start();
    let sent = Instant::now();
    let first_byte = (sent + gw.config.timeouts.first_byte.0).min(deadline);
    let response = match timeout_at(first_byte, endpoint.conns.send(request)).await {
        Err(_) => return Err(record(gw, endpoint, Failure::new(Outcome::NoHeaders), sent)),
        Ok(Err(e)) => {
            // A TLS failure is a configuration problem (trust, name) more than an outage:
            // worth a warning, but not one per request.
            if matches!(e, SendError::Tls(..)) && endpoint.conns.tls_warning_due() {
                warn!(endpoint = %endpoint.url, error = %e, source = %Sources(&e), "upstream attempt failed");
            } else {
                debug!(endpoint = %endpoint.url, error = %e, source = %Sources(&e), "upstream attempt failed");
            }
            let failure = Failure::new(Outcome::Connect);
            let failure = if e.is_transient() {
                failure.transient()
            } else {
                failure
            };
            return Err(record(gw, endpoint, failure.because(e), sent));
        }
        Ok(Ok(r)) => r,
    };
    if !response.status().is_success() {
        return Err(refused(gw, endpoint, response, sent).await);
    }
    Ok((response, sent, in_flight))
}

pub(crate) fn is_stream<B>(response: &hyper::Response<B>) -> bool {
    response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"))
}

/// The caller's bytes, untouched unless the upstream names the model differently.
pub(crate) fn payload(ctx: &Ctx<'_>, endpoint: &Endpoint) -> Bytes {
    match &endpoint.upstream_model {
        Some(name) if *name != ctx.requested => {
            let mut body: Value = serde_json::from_slice(&ctx.raw).unwrap_or_default();
            body["model"] = Value::String(name.clone());
            Bytes::from(serde_json::to_vec(&body).expect("JSON serializes"))
        }
        _ => ctx.raw.clone(),
    }
}

/// An error status, classified with the start of its body; a caller's fault keeps the
/// upstream's answer to pass on.
async fn refused(
    gw: &Gateway,
    endpoint: &Endpoint,
    response: hyper::Response<upstream::Body>,
    sent: Instant,
) -> Failure {
    let status = response.status();
    let wait = retry_after(
        response
            .headers()
            .get(header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok()),
    );
    let local = response
        .headers()
        .get(RATE_LIMITED)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"));
    let (head, body) = response.into_parts();
    let bytes = read_limited(body, Duration::from_secs(2)).await;
    let outcome = classify_status(status.as_u16(), wait, local, &bytes);
    let failure = record(gw, endpoint, Failure::new(outcome), sent);
    match failure.retry() {
        Retry::Elsewhere => failure,
        Retry::Never | Retry::LargerContext => {
            let mut answer = Response::new(Body::from(bytes));
            *answer.status_mut() = status;
            *answer.headers_mut() = headers::from_upstream(head.headers);
            failure.answered(answer)
        }
    }
}

/// A whole (non-streamed) answer, read within the deadline and `max_response_bytes`.
pub(crate) async fn whole(
    gw: &Gateway,
    endpoint: &Endpoint,
    response: hyper::Response<upstream::Body>,
    sent: Instant,
    deadline: Instant,
) -> Result<Response, Failure> {
    let limit = gw.config.max_response_bytes;
    let within = BodyLimits {
        max_bytes: limit,
        timeout: deadline.saturating_duration_since(Instant::now()),
        min_rate: 0,
    };
    let (head, body) = response.into_parts();
    let content_type = head.headers.get(header::CONTENT_TYPE).cloned();
    let answer = match read_whole(body, &within, None).await {
        Ok(answer) => answer,
        Err(e) => {
            let failure = match e {
                BodyError::TooLarge(_) => {
                    warn!(endpoint = %endpoint.url, limit, "an answer larger than max_response_bytes");
                    Failure::new(Outcome::TooLarge)
                }
                BodyError::Broken(e) => {
                    debug!(endpoint = %endpoint.url, error = %e, "the answer broke off");
                    Failure::new(Outcome::Truncated).because(e)
                }
                BodyError::TimedOut(_) | BodyError::Busy => Failure::new(Outcome::Stalled),
            };
            return Err(record(gw, endpoint, failure, sent));
        }
    };
    let now = Instant::now();
    let work = Work::Whole(crate::json::work_units(&answer));
    record_latency(
        gw,
        endpoint,
        &Outcome::Success,
        sent,
        now.duration_since(sent),
        work,
        now,
    );
    let mut r = Response::new(Body::from(answer));
    *r.headers_mut() = headers::from_upstream(head.headers);
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        content_type.unwrap_or(HeaderValue::from_static("application/json")),
    );
    Ok(r)
}

/// The start of an error body, at most `ERROR_BODY_LIMIT` bytes, whatever arrives
/// `within`: enough to classify it.
async fn read_limited(mut body: upstream::Body, within: Duration) -> Bytes {
    let mut out = Vec::new();
    let until = Instant::now() + within;
    while out.len() < ERROR_BODY_LIMIT {
        match timeout_at(until, body.frame()).await {
            Ok(Some(Ok(frame))) => {
                if let Ok(data) = frame.into_data() {
                    out.extend_from_slice(&data);
                }
            }
            Ok(Some(Err(_)) | None) | Err(_) => break,
        }
    }
    out.truncate(ERROR_BODY_LIMIT);
    Bytes::from(out)
}

/// Counts a failed attempt sent at `sent`, ending now, and feeds it to the endpoint's
/// passive blocking, for one unit of work; gives the failure back.
pub(crate) fn record(
    gw: &Gateway,
    endpoint: &Endpoint,
    failure: Failure,
    sent: Instant,
) -> Failure {
    let now = Instant::now();
    let latency = now.duration_since(sent);
    record_latency(
        gw,
        endpoint,
        &failure.outcome,
        sent,
        latency,
        Work::Whole(1),
        now,
    );
    failure
}

/// Counts the outcome of an attempt sent at `sent` and feeds it to the endpoint's
/// passive blocking, with the latency the endpoint is judged by and what it measured
/// (a stream's is its time to first token, however long the answer then took; a whole
/// answer's is per unit of its work).
pub(crate) fn record_latency(
    gw: &Gateway,
    endpoint: &Endpoint,
    outcome: &Outcome,
    sent: Instant,
    latency: Duration,
    work: Work,
    now: Instant,
) {
    match (outcome, endpoint.hot.get()) {
        (Outcome::Success, Some(hot)) => {
            hot.attempts_ok.inc();
        }
        _ => {
            gw.metrics
                .attempts
                .get_or_create(&AttemptLabels {
                    model: Label::from(&endpoint.model),
                    pool: Label::from(&endpoint.pool),
                    endpoint: Label::from(&endpoint.url),
                    outcome: outcome.label(),
                })
                .inc();
        }
    }
    let blocking = &gw.config.blocking;
    if let Some(block) =
        endpoint.record(outcome, sent, latency, work, blocking, now, gw.clock.now())
    {
        gw.metrics
            .blocks
            .get_or_create(&KindLabel {
                kind: block.trigger,
            })
            .inc();
        warn!(endpoint = %endpoint.url, model = %endpoint.model, ttl = ?block.ttl, strikes = block.strikes, trigger = block.trigger, "endpoint blocked");
    }
}
