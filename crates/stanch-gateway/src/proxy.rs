//! One request's way through the gateway: apply the route table, choose an endpoint,
//! classify what happened, retry elsewhere within the budget, fall back to the next
//! pool, the fallback model, and finally the FAQ.
//!
//! Streams are committed to an upstream only when its first token arrives, so a slow
//! or failed start is retried without the caller noticing. Once bytes have reached
//! the caller, a failure ends the stream with an explicit SSE error event (never a
//! silently truncated answer presented as complete). A final chunk without
//! `data: [DONE]` is complete: the gateway adds `[DONE]` promptly.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;
use hyper::body::{Body as _, Frame, Incoming};
use hyper::{Method, Request};
use prometheus_client::metrics::counter::Counter;
use secrecy::ExposeSecret;
use serde_json::{Value, json};
use stanch_api::headers::{DEGRADED, RATE_LIMITED, ROUTE_VERSION};
use stanch_api::{RouteTable, Rung, Timestamp};
use stanch_net::body::{BodyError, BodyLimits, read_whole};
use stanch_net::timer::timeout_at;
use subtle::ConstantTimeEq;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::endpoints::{Endpoint, Kind, Work, choose};
use crate::headers::{self, Forward, REQUEST_ID};
use crate::metrics::{AttemptLabels, KindLabel, ModelLabel, RequestLabels};
use crate::outcome::{Outcome, classify_status, retry_after};
use crate::sse::{Event, Parser};
use crate::upstream::{self, SendError};
use crate::{Gateway, openai_error};

/// Header names, parsed once: a `&str` name is parsed again on every insert.
static ROUTE_VERSION_HEADER: HeaderName = HeaderName::from_static(ROUTE_VERSION);
static DEGRADED_HEADER: HeaderName = HeaderName::from_static(DEGRADED);
static ATTEMPTS_HEADER: HeaderName = HeaderName::from_static("x-stanch-attempts");

/// The most of a stream passed to the caller in one write.
const BATCH_LIMIT: usize = 64 * 1024;
/// The event that ends an OpenAI stream.
const DONE: &[u8] = b"data: [DONE]\n\n";
/// How long to wait for `[DONE]` after the final chunk before adding it ourselves.
const DONE_GRACE: Duration = Duration::from_millis(200);
/// The most of an upstream error body read, to classify it.
const ERROR_BODY_LIMIT: usize = 64 * 1024;

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

    fn answers_from_faq(self) -> bool {
        self != Api::Embeddings
    }
}

/// The block the route table puts on an endpoint for its model, if any.
pub(crate) fn table_block(table: &RouteTable, e: &Endpoint, now: Timestamp) -> Option<Timestamp> {
    table
        .blocked
        .iter()
        .filter(|b| b.until > now && b.model.as_ref().is_none_or(|m| *m == e.model))
        // A block names the endpoint by URL or by host:port, which the URL ends with
        // right after `//` (compared in place: this runs for every candidate).
        .filter(|b| {
            e.url == b.endpoint
                || e.url
                    .strip_suffix(b.endpoint.as_str())
                    .is_some_and(|scheme| scheme.ends_with("//"))
        })
        .map(|b| b.until)
        .min()
}

/// What one request carries through its attempts.
struct Ctx<'g> {
    gw: &'g Arc<Gateway>,
    api: Api,
    requested: String,
    model: String,
    /// The request body as the caller sent it.
    raw: Bytes,
    stream: bool,
    version: u64,
    started: Instant,
    degraded: bool,
    attempts: u32,
    /// The caller's tenant (an index into `Gateway::tenants`), if its key is known.
    tenant: Option<usize>,
    /// What of the caller's headers goes upstream, and the request's id.
    forward: Forward,
}

impl Ctx<'_> {
    /// The caller's tenant name, for logs (never its key).
    fn tenant_name(&self) -> &str {
        self.tenant
            .map_or("anonymous", |i| self.gw.tenants[i].name.as_str())
    }
}

enum Attempt {
    /// The answer (or a stream committed to the caller).
    Answer(Response),
    /// The caller's fault: passed on unchanged.
    Caller(Outcome, Response),
    /// The endpoint failed; try elsewhere.
    Failed(Outcome),
}

/// A request turned away before routing: the caller's fault, never an upstream's.
struct Rejected {
    status: StatusCode,
    /// OpenAI's error code, and the `kind` of `stanch_gateway_rejected_requests_total`.
    code: &'static str,
    message: String,
    /// Seconds for `Retry-After`, when trying again later can help.
    retry_after: Option<u32>,
    /// The request was not read to its end: the connection cannot carry another.
    close: bool,
}

impl Rejected {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Rejected {
        Rejected {
            status,
            code,
            message: message.into(),
            retry_after: None,
            close: false,
        }
    }

    fn retry_after(self, seconds: u32) -> Rejected {
        Rejected {
            retry_after: Some(seconds),
            ..self
        }
    }

    fn closing(self) -> Rejected {
        Rejected {
            close: true,
            ..self
        }
    }
}

/// Serves a request to one of the proxied routes.
///
/// What routing needs of the request's head (the method, the caller's key) is taken
/// before anything is awaited, and the head is dropped then: its header values share
/// hyper's read buffer, and the future awaited from here on holds only the body.
pub(crate) fn handle(
    gw: Arc<Gateway>,
    api: Api,
    request: Request<Incoming>,
) -> impl Future<Output = Response> + Send + 'static {
    let (parts, body) = request.into_parts();
    let forward = Forward::from_caller(&parts.headers);
    let admitted = if parts.method == Method::POST {
        Ok(tenant(&gw, &parts.headers))
    } else {
        Err(Rejected::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
            format!("{} takes POST", parts.uri.path()),
        ))
    };
    drop(parts);
    async move {
        let request_id = forward.request_id.clone();
        let routed = match admitted {
            Ok(tenant) => route(&gw, api, body, tenant, forward).await,
            Err(rejected) => Err(rejected),
        };
        routed.unwrap_or_else(|r| reject(&gw, r, request_id))
    }
}

/// The answer to a request turned away before routing.
fn reject(gw: &Gateway, r: Rejected, request_id: HeaderValue) -> Response {
    gw.metrics
        .rejected
        .get_or_create(&KindLabel { kind: r.code })
        .inc();
    info!(target: "access", outcome = r.code, status = r.status.as_u16(), request_id = access_id(&request_id), "request rejected");
    let mut response = openai_error(r.status, "invalid_request_error", r.code, &r.message);
    response
        .headers_mut()
        .insert(REQUEST_ID.clone(), request_id);
    if r.status == StatusCode::METHOD_NOT_ALLOWED {
        response
            .headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("POST"));
    }
    if let Some(seconds) = r.retry_after {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
    }
    if r.close {
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    // Answered before routing, but still say which table was in force.
    with_route_version(gw, &mut response);
    response
}

/// The caller's tenant, if its key is known; an unknown key is refused when every
/// caller must be a tenant.
fn tenant(gw: &Gateway, headers: &hyper::HeaderMap) -> Result<Option<usize>, Rejected> {
    let presented = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    // Constant-time: how much of a key matched must not show in the answer's timing.
    let tenant = presented.and_then(|key| {
        gw.tenants
            .iter()
            .position(|t| bool::from(t.key.expose_secret().as_bytes().ct_eq(key.as_bytes())))
    });
    if gw.config.require_tenant && tenant.is_none() {
        return Err(Rejected::new(
            StatusCode::UNAUTHORIZED,
            "invalid_api_key",
            "unknown API key",
        ));
    }
    Ok(tenant)
}

/// Adds `X-Stanch-Route-Version` for the table applied now.
pub(crate) fn with_route_version(gw: &Gateway, response: &mut Response) {
    let version = gw.table().map_or(0, |t| t.version);
    response
        .headers_mut()
        .insert(&ROUTE_VERSION_HEADER, version_value(version));
}

/// Routes a POST. The caller's key was looked up (`tenant`) while the head was at
/// hand, but a refused key is answered only once the body has been read: a caller
/// answered before its body is read can find the connection reset under the answer,
/// as the unread bytes make the socket's close a reset (hyper does not linger to
/// drain them).
async fn route(
    gw: &Arc<Gateway>,
    api: Api,
    body: Incoming,
    tenant: Result<Option<usize>, Rejected>,
    forward: Forward,
) -> Result<Response, Rejected> {
    let raw = match read_whole(body, &gw.body_limits, Some(&gw.body_budget)).await {
        Ok(raw) => raw,
        Err(BodyError::TooLarge(limit)) => {
            return Err(Rejected::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body_too_large",
                format!("request bodies are limited to {limit} bytes"),
            ));
        }
        Err(BodyError::TimedOut(_)) => {
            return Err(Rejected::new(
                StatusCode::REQUEST_TIMEOUT,
                "body_timeout",
                "the request body did not arrive in time",
            )
            .closing());
        }
        Err(BodyError::Busy) => {
            return Err(Rejected::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "busy",
                "too many request bodies are arriving at once; retry",
            )
            .retry_after(1)
            .closing());
        }
        Err(BodyError::Broken(_)) => {
            return Err(Rejected::new(
                StatusCode::BAD_REQUEST,
                "body_unreadable",
                "the request body ended before its declared length",
            ));
        }
    };
    // Only the fields routing needs are read; the body is forwarded as it came.
    let Ok(peek) = crate::json::peek(&raw) else {
        return Err(Rejected::new(
            StatusCode::BAD_REQUEST,
            "invalid_json",
            "the body must be a JSON object in UTF-8, with at most one `model` (a string) \
             and one `stream` (a boolean)",
        ));
    };
    let Some(requested) = peek.model.map(std::borrow::Cow::into_owned) else {
        return Err(Rejected::new(
            StatusCode::BAD_REQUEST,
            "model_required",
            "model: required",
        ));
    };
    let Some(model) = gw.resolve(&requested) else {
        return Err(Rejected::new(
            StatusCode::NOT_FOUND,
            "model_not_found",
            format!("model {requested:?} is not served here"),
        ));
    };
    let tenant = tenant?;
    let vip = tenant.is_some_and(|i| gw.tenants[i].vip);
    let wall = gw.clock.now();
    let table = gw.table();
    let version = table.as_ref().map_or(0, |t| t.version);
    let started = Instant::now();
    gw.budget.request(started);
    let stream = api != Api::Embeddings && peek.stream.unwrap_or(false);
    let mut ctx = Ctx {
        gw,
        api,
        requested,
        model: model.to_owned(),
        raw,
        stream,
        version,
        started,
        degraded: false,
        attempts: 0,
        tenant,
        forward,
    };

    let entry = |m: &str| honoured(table.as_deref(), m, wall);
    let mut serve = model;
    if let Some(e) = entry(model) {
        match e.rung {
            Rung::Static if api.answers_from_faq() => {
                return Ok(faq_answer(&ctx, e.faq.as_deref(), "static"));
            }
            Rung::Degraded => {
                let exempt = vip && e.alias_exempt.iter().any(|c| c == "vip");
                if let Some(alias) = e
                    .alias
                    .as_ref()
                    .filter(|a| !exempt && gw.models.contains_key(*a))
                {
                    serve = alias;
                    ctx.degraded = true;
                    gw.metrics
                        .degraded
                        .get_or_create(&ModelLabel {
                            model: model.to_owned(),
                        })
                        .inc();
                }
            }
            _ => {}
        }
    }
    if ctx.degraded {
        if let Some(e) = entry(serve).filter(|e| e.rung == Rung::Static && api.answers_from_faq()) {
            return Ok(faq_answer(&ctx, e.faq.as_deref(), "static"));
        }
    }
    let mut targets = plan(gw, serve, table.as_deref(), wall);
    let kind = if stream { Kind::Stream } else { Kind::Whole };
    let mut redirected = false;
    let mut tried: Vec<&Endpoint> = Vec::new();
    let policy = &gw.config.retry;
    let deadline = ctx.started + gw.config.timeouts.total.0;
    let mut t = 0;
    'targets: while t < targets.len() {
        let (m, p) = targets[t];
        let endpoints = &gw.models[m].pools[p].1;
        let mut in_pool = 0;
        while in_pool < policy.attempts_per_pool {
            let now = if ctx.attempts == 0 {
                started
            } else {
                Instant::now()
            };
            if ctx.attempts >= policy.max_attempts || now >= deadline {
                break 'targets;
            }
            let candidates: Vec<&Endpoint> = endpoints
                .iter()
                .map(Arc::as_ref)
                .filter(|e| !tried.iter().any(|t| std::ptr::eq(*t, *e)))
                .collect();
            if candidates.is_empty() {
                break;
            }
            if ctx.attempts > 0 {
                if !gw.budget.try_retry(now) {
                    gw.metrics.budget_exhausted.inc();
                    break 'targets;
                }
                gw.metrics
                    .retries
                    .get_or_create(&ModelLabel {
                        model: model.to_owned(),
                    })
                    .inc();
                tokio::time::sleep(backoff(gw, ctx.attempts)).await;
            }
            // Time left on the route table's block of an endpoint, if any.
            let blocked = |e: &Endpoint| {
                table
                    .as_ref()
                    .and_then(|t| table_block(t, e, wall))
                    .map(|until| until.since(wall))
            };
            let Some((chosen, all_blocked)) = choose(
                &candidates,
                blocked,
                kind,
                now,
                gw.config.blocking.slow_start.0,
            ) else {
                break;
            };
            if all_blocked {
                // Blocked is the lowest priority across the model's pools: a later pool
                // with an open endpoint comes first. Another model does not: changing the
                // model on blocks alone would degrade callers that the ladder has not.
                let open_later =
                    targets[t + 1..]
                        .iter()
                        .filter(|(m2, _)| *m2 == m)
                        .any(|(m2, p2)| {
                            gw.models[*m2].pools[*p2].1.iter().any(|e| {
                                !tried.iter().any(|x| std::ptr::eq(*x, e.as_ref()))
                                    && e.blocked(now).is_none()
                                    && blocked(e).is_none()
                            })
                        });
                if open_later {
                    break;
                }
                gw.metrics.all_blocked.inc();
            }
            let endpoint = endpoints
                .iter()
                .find(|e| std::ptr::eq(e.as_ref(), chosen))
                .expect("chosen from this pool");
            tried.push(endpoint);
            ctx.attempts += 1;
            in_pool += 1;
            match attempt(&ctx, endpoint, deadline).await {
                Attempt::Answer(response) => {
                    return Ok(finish(&ctx, response, Some(endpoint), "success"));
                }
                Attempt::Caller(Outcome::ContextTooLong, response) => {
                    let larger = gw
                        .config
                        .models
                        .get(m)
                        .and_then(|c| c.larger_context.as_deref());
                    match larger {
                        Some(l) if !redirected => {
                            redirected = true;
                            gw.metrics
                                .fallbacks
                                .get_or_create(&KindLabel {
                                    kind: "larger_context",
                                })
                                .inc();
                            targets = plan(gw, l, table.as_deref(), wall);
                            t = 0;
                            continue 'targets;
                        }
                        _ => {
                            return Ok(finish(&ctx, response, Some(endpoint), "context_too_long"));
                        }
                    }
                }
                Attempt::Caller(outcome, response) => {
                    return Ok(finish(&ctx, response, Some(endpoint), outcome.label()));
                }
                Attempt::Failed(outcome) => {
                    if outcome.excludes_endpoint() {
                        warn!(endpoint = %endpoint.url, outcome = outcome.label(), "too slow; not retried for this request");
                    }
                }
            }
        }
        t += 1;
        if let Some((next, _)) = targets.get(t) {
            let kind = if *next == m { "pool" } else { "model" };
            gw.metrics
                .fallbacks
                .get_or_create(&KindLabel { kind })
                .inc();
        }
    }
    if api.answers_from_faq() {
        gw.metrics
            .fallbacks
            .get_or_create(&KindLabel { kind: "faq" })
            .inc();
        let faq = gw.config.models.get(serve).and_then(|m| m.faq.as_deref());
        return Ok(faq_answer(&ctx, faq, "faq_fallback"));
    }
    let mut response = openai_error(
        StatusCode::SERVICE_UNAVAILABLE,
        "server_error",
        "upstreams_unavailable",
        "every upstream failed; retry later",
    );
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    Ok(finish(&ctx, response, None, "exhausted"))
}

/// The table's entry for `model`, unless its lease has passed: an expired entry is not
/// honoured, and routing falls back to normal (fail-open).
fn honoured<'t>(
    table: Option<&'t RouteTable>,
    model: &str,
    wall: Timestamp,
) -> Option<&'t stanch_api::ModelRoute> {
    table?.models.get(model).filter(|e| e.lease_until > wall)
}

/// The (model, pool) pairs to try in order: the model's active pool, its other pools,
/// then each fallback model's active and other pools.
fn plan<'g>(
    gw: &'g Gateway,
    model: &str,
    table: Option<&RouteTable>,
    wall: Timestamp,
) -> Vec<(&'g str, usize)> {
    let mut out = Vec::new();
    let Some((model, config)) = gw.config.models.get_key_value(model) else {
        return out;
    };
    for m in std::iter::once(model).chain(&config.fallbacks) {
        let Some(plan) = gw.models.get(m) else {
            continue;
        };
        let active = honoured(table, m, wall)
            .and_then(|e| plan.pools.iter().position(|(name, _)| *name == e.pool))
            .unwrap_or(0);
        out.push((m.as_str(), active));
        out.extend(
            (0..plan.pools.len())
                .filter(|i| *i != active)
                .map(|i| (m.as_str(), i)),
        );
    }
    out
}

/// `X-Stanch-Route-Version: <version>`, written once per version on each thread:
/// every answer carries it, and the version changes rarely.
fn version_value(version: u64) -> HeaderValue {
    std::thread_local! {
        static LAST: std::cell::RefCell<Option<(u64, HeaderValue)>> =
            const { std::cell::RefCell::new(None) };
    }
    LAST.with_borrow_mut(|last| match last {
        Some((v, value)) if *v == version => value.clone(),
        _ => last.insert((version, HeaderValue::from(version))).1.clone(),
    })
}

/// `X-Stanch-Attempts`'s value; the common counts without formatting or allocating.
fn attempts_value(attempts: u32) -> HeaderValue {
    const SMALL: [HeaderValue; 5] = [
        HeaderValue::from_static("0"),
        HeaderValue::from_static("1"),
        HeaderValue::from_static("2"),
        HeaderValue::from_static("3"),
        HeaderValue::from_static("4"),
    ];
    match SMALL.get(attempts as usize) {
        Some(v) => v.clone(),
        None => HeaderValue::from(attempts),
    }
}

fn backoff(gw: &Gateway, attempts: u32) -> Duration {
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

/// Counts the outcome of an attempt sent at `sent`, ending now, and feeds it to the
/// endpoint's passive blocking; its latency is the time since `sent`, for one unit of
/// work (failures, and answers that do not say their size).
fn record(gw: &Gateway, endpoint: &Endpoint, outcome: &Outcome, sent: Instant) {
    let now = Instant::now();
    let latency = now.duration_since(sent);
    record_with_latency(gw, endpoint, outcome, sent, latency, Work::Whole(1), now);
}

/// As [`record`], with the latency the endpoint is judged by and what it measured (a
/// stream's is its time to first token, however long the answer then took; a whole
/// answer's is per unit of its work).
fn record_with_latency(
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
                    model: endpoint.model.clone(),
                    pool: endpoint.pool.clone(),
                    endpoint: endpoint.url.clone(),
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

async fn attempt(ctx: &Ctx<'_>, endpoint: &Arc<Endpoint>, deadline: Instant) -> Attempt {
    let gw = &ctx.gw;
    // The caller's bytes go upstream untouched unless the upstream names the model
    // differently.
    let payload = match &endpoint.upstream_model {
        Some(name) if *name != ctx.requested => {
            let mut body: Value = serde_json::from_slice(&ctx.raw).unwrap_or_default();
            body["model"] = Value::String(name.clone());
            Bytes::from(serde_json::to_vec(&body).expect("JSON serializes"))
        }
        _ => ctx.raw.clone(),
    };
    let mut request = endpoint.post(ctx.api as usize, payload);
    ctx.forward.onto(request.headers_mut());
    let in_flight = endpoint.start();
    let sent = Instant::now();
    let first_byte = (sent + gw.config.timeouts.first_byte.0).min(deadline);
    let response = match timeout_at(first_byte, endpoint.conns.send(request)).await {
        Err(_) => {
            record(ctx.gw, endpoint, &Outcome::NoHeaders, sent);
            return Attempt::Failed(Outcome::NoHeaders);
        }
        Ok(Err(e)) => {
            // A TLS failure is a configuration problem (trust, name) more than an outage:
            // worth a warning, but not one per request.
            if matches!(e, SendError::Tls(..)) && endpoint.conns.tls_warning_due() {
                warn!(endpoint = %endpoint.url, error = %e, "upstream attempt failed");
            } else {
                debug!(endpoint = %endpoint.url, error = %e, "upstream attempt failed");
            }
            record(ctx.gw, endpoint, &Outcome::Connect, sent);
            return Attempt::Failed(Outcome::Connect);
        }
        Ok(Ok(r)) => r,
    };
    let status = response.status();
    let content_type = response.headers().get(header::CONTENT_TYPE).cloned();
    if !status.is_success() {
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
        record(ctx.gw, endpoint, &outcome, sent);
        if matches!(outcome, Outcome::CallerFault(_) | Outcome::ContextTooLong) {
            let mut r = Response::new(Body::from(bytes));
            *r.status_mut() = status;
            *r.headers_mut() = headers::from_upstream(head.headers);
            return Attempt::Caller(outcome, r);
        }
        return Attempt::Failed(outcome);
    }
    let is_stream = content_type
        .as_ref()
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    if !ctx.stream || !is_stream {
        let limit = gw.config.max_response_bytes;
        let within = BodyLimits {
            max_bytes: limit,
            timeout: deadline.saturating_duration_since(Instant::now()),
            min_rate: 0,
        };
        let (head, body) = response.into_parts();
        return match read_whole(body, &within, None).await {
            Ok(answer) => {
                let now = Instant::now();
                let work = Work::Whole(crate::json::work_units(&answer));
                let latency = now.duration_since(sent);
                record_with_latency(
                    ctx.gw,
                    endpoint,
                    &Outcome::Success,
                    sent,
                    latency,
                    work,
                    now,
                );
                drop(in_flight);
                let mut r = Response::new(Body::from(answer));
                *r.headers_mut() = headers::from_upstream(head.headers);
                r.headers_mut().insert(
                    header::CONTENT_TYPE,
                    content_type.unwrap_or(HeaderValue::from_static("application/json")),
                );
                Attempt::Answer(r)
            }
            Err(e) => {
                let outcome = match e {
                    BodyError::TooLarge(_) => {
                        warn!(endpoint = %endpoint.url, limit, "an answer larger than max_response_bytes");
                        Outcome::TooLarge
                    }
                    BodyError::Broken(e) => {
                        debug!(endpoint = %endpoint.url, error = %e, "the answer broke off");
                        Outcome::Truncated
                    }
                    BodyError::TimedOut(_) | BodyError::Busy => Outcome::Stalled,
                };
                record(ctx.gw, endpoint, &outcome, sent);
                Attempt::Failed(outcome)
            }
        };
    }
    let (head, body) = response.into_parts();
    stream(ctx, endpoint, head.headers, body, sent, in_flight).await
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

fn error_event(outcome: &Outcome) -> Bytes {
    let body = json!({"error": {"message": format!("the upstream stream was interrupted ({}); this answer is incomplete", outcome.label()),
                                "type": "upstream_error", "code": "stream_interrupted"}});
    Bytes::from(format!("data: {body}\n\n"))
}

/// Waits for the first token, then commits the stream to the caller.
async fn stream(
    ctx: &Ctx<'_>,
    endpoint: &Arc<Endpoint>,
    upstream_headers: hyper::HeaderMap,
    mut body: upstream::Body,
    sent: Instant,
    in_flight: crate::endpoints::InFlight,
) -> Attempt {
    let gw = ctx.gw.clone();
    let model_cfg = gw.config.models.get(&endpoint.model);
    let first_token = model_cfg
        .and_then(|m| m.first_token_timeout)
        .map_or(gw.config.timeouts.first_token.0, |d| d.0);
    let until = sent + first_token;
    // Read until the first token: until then the attempt can still fail over unseen.
    // (A heartbeat comment is held, not taken for a token.)
    let mut relay = Relay::default();
    let malformed = gw.metrics.malformed_chunks.clone();
    let end = loop {
        let frame = match timeout_at(until, body.frame()).await {
            Err(_) => {
                record(ctx.gw, endpoint, &Outcome::FirstTokenTimeout, sent);
                return Attempt::Failed(Outcome::FirstTokenTimeout);
            }
            Ok(None) => {
                record(ctx.gw, endpoint, &Outcome::Truncated, sent);
                return Attempt::Failed(Outcome::Truncated);
            }
            Ok(Some(Err(_))) => {
                record(ctx.gw, endpoint, &Outcome::Connect, sent);
                return Attempt::Failed(Outcome::Connect);
            }
            Ok(Some(Ok(frame))) => frame,
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        match relay.take(data, &malformed) {
            Some(End::Error) => {
                record(ctx.gw, endpoint, &Outcome::ServerError(200), sent);
                return Attempt::Failed(Outcome::ServerError(200));
            }
            Some(End::Done) => break Some(Outcome::Success),
            None if relay.started => break None,
            None => {}
        }
    };
    let ttft = sent.elapsed();
    let histograms = gw.model_histograms.get(&ctx.model).cloned();
    if let Some((_, ttft_seconds)) = &histograms {
        ttft_seconds.observe(ttft.as_secs_f64());
    }
    // Committed: from here on the caller has bytes, so failures end the stream explicitly.
    let mut relayed = Relayed {
        relay,
        idle: gw.config.timeouts.stream_idle.0,
        waiting: None,
        malformed,
        open: Some(Open {
            upstream: body,
            endpoint: endpoint.clone(),
            sent,
            ttft,
            histograms,
            model: ctx.model.clone(),
            version: ctx.version,
            attempts: ctx.attempts,
            started: ctx.started,
            request_id: ctx.forward.request_id.clone(),
            _in_flight: in_flight,
            gw,
        }),
    };
    if let Some(outcome) = end {
        relayed.end(outcome);
    }
    let mut response = Response::new(Body::new(relayed));
    let h = response.headers_mut();
    *h = headers::from_upstream(upstream_headers);
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    Attempt::Answer(response)
}

/// A stream on its way from the upstream to the caller.
#[derive(Default)]
struct Relay {
    parser: Parser,
    /// Bytes for the caller, not yet written.
    out: BytesMut,
    /// A chunk has passed: the first token.
    started: bool,
    /// A chunk with a `finish_reason` has passed: the answer is complete.
    last: bool,
    /// The events of the frame being taken (kept to reuse its allocation).
    events: Vec<Event>,
}

/// How the events of a stream said it ended.
enum End {
    /// `data: [DONE]`.
    Done,
    /// An error object in the stream.
    Error,
}

impl Relay {
    /// Takes the bytes of one upstream frame: what is for the caller goes to `out`.
    /// Returns how the answer ended, if it did; nothing after its end is taken.
    fn take(&mut self, data: Bytes, malformed: &Counter) -> Option<End> {
        // The events' vector is the relay's, reused from frame to frame.
        let mut events = std::mem::take(&mut self.events);
        self.parser.push(data, &mut events);
        let mut end = None;
        for event in events.drain(..) {
            match event {
                Event::Chunk { raw, last } => {
                    self.started = true;
                    self.last |= last;
                    self.out.extend_from_slice(&raw);
                }
                Event::Other(raw) => self.out.extend_from_slice(&raw),
                Event::Done => {
                    self.out.extend_from_slice(DONE);
                    end = Some(End::Done);
                    break;
                }
                Event::Error(_) => {
                    end = Some(End::Error);
                    break;
                }
                Event::Malformed => {
                    malformed.inc();
                }
            }
        }
        self.events = events;
        end
    }
}

/// A committed stream, as the caller's response body: hyper asks it for more whenever
/// it can write, and it reads the upstream's body then and there. Upstream connection,
/// relay and caller's connection are therefore driven by one task, with nothing handed
/// over between tasks. What has arrived goes to the caller in one write, however many
/// events it holds (upstreams send each event as its own HTTP chunk, and a write per
/// event would cost a system call per token): it takes every chunk already read or
/// ready to read, and gives them as one frame when there is nothing more; hyper writes
/// when the body has nothing ready.
struct Relayed {
    relay: Relay,
    /// The longest the upstream may go quiet.
    idle: Duration,
    /// While the upstream has nothing: the deadline that ends the wait.
    waiting: Option<stanch_net::timer::Sleep>,
    malformed: Counter,
    /// The stream while it lasts; `None` once it ended.
    open: Option<Open>,
}

/// A committed stream while it lasts: the upstream's body, and what ending it records.
struct Open {
    upstream: upstream::Body,
    gw: Arc<Gateway>,
    endpoint: Arc<Endpoint>,
    sent: Instant,
    ttft: Duration,
    histograms: Option<(
        crate::metrics::WorkerHistogram,
        crate::metrics::WorkerHistogram,
    )>,
    model: String,
    version: u64,
    attempts: u32,
    started: Instant,
    /// The request's id, for the access log.
    request_id: HeaderValue,
    /// Counts the request in flight on its endpoint until the stream ends or the
    /// caller goes.
    _in_flight: crate::endpoints::InFlight,
}

impl Relayed {
    /// Ends the stream with `outcome`: an explicit error event unless it succeeded,
    /// then the outcome recorded and logged. The upstream's body is then read to its
    /// end (the chunked terminator follows `[DONE]`) on a task of its own, so that its
    /// connection can be reused without holding up the end of the caller's stream.
    fn end(&mut self, outcome: Outcome) {
        let Some(e) = self.open.take() else {
            return;
        };
        if outcome != Outcome::Success {
            self.relay.out.extend_from_slice(&error_event(&outcome));
        }
        let now = Instant::now();
        record_with_latency(
            &e.gw,
            &e.endpoint,
            &outcome,
            e.sent,
            e.ttft,
            Work::FirstToken,
            now,
        );
        if let Some((latency, _)) = &e.histograms {
            latency.observe(now.duration_since(e.started).as_secs_f64());
        }
        info!(target: "access", model = e.model.as_str(), endpoint = e.endpoint.url.as_str(), attempts = e.attempts, outcome = outcome.label(), version = e.version, stream = true, ms = now.duration_since(e.started).as_millis() as u64, request_id = access_id(&e.request_id), "stream finished");
        self.waiting = None;
        let mut body = e.upstream;
        if outcome == Outcome::Success && !body.is_end_stream() {
            tokio::spawn(async move {
                let drain = async { while let Some(Ok(_)) = body.frame().await {} };
                let _ = tokio::time::timeout(DONE_GRACE, drain).await;
            });
        }
    }

    /// The upstream ended, broke or went quiet, which is `outcome`; after the final
    /// chunk, the answer is complete all the same, and ends properly with `[DONE]`.
    fn stopped(&mut self, outcome: Outcome) {
        if self.relay.last {
            self.relay.out.extend_from_slice(DONE);
            self.end(Outcome::Success);
        } else {
            self.end(outcome);
        }
    }

    /// Takes what the upstream has ready: `Pending` once it has nothing more, or when
    /// the stream has ended.
    fn poll_upstream(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let Some(open) = &mut self.open else {
            return Poll::Pending;
        };
        let outcome = match ready!(Pin::new(&mut open.upstream).poll_frame(cx)) {
            Some(Ok(frame)) => {
                self.waiting = None;
                let Ok(data) = frame.into_data() else {
                    return Poll::Ready(());
                };
                match self.relay.take(data, &self.malformed) {
                    Some(End::Done) => self.end(Outcome::Success),
                    Some(End::Error) => self.end(Outcome::ServerError(200)),
                    None => {}
                }
                return Poll::Ready(());
            }
            None => Outcome::Truncated,
            Some(Err(_)) => Outcome::Connect,
        };
        self.stopped(outcome);
        Poll::Ready(())
    }
}

impl hyper::body::Body for Relayed {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        loop {
            // Bounded, so that an upstream faster than the caller cannot grow it.
            if this.relay.out.len() < BATCH_LIMIT && this.poll_upstream(cx).is_ready() {
                continue;
            }
            if !this.relay.out.is_empty() {
                return Poll::Ready(Some(Ok(Frame::data(this.relay.out.split().freeze()))));
            }
            if this.open.is_none() {
                return Poll::Ready(None);
            }
            // Nothing to pass on: wait for the upstream, no longer than the idle limit
            // (after the final chunk, only briefly for `[DONE]`).
            let wait = if this.relay.last {
                DONE_GRACE
            } else {
                this.idle
            };
            let deadline = this
                .waiting
                .get_or_insert_with(|| stanch_net::timer::sleep_until(Instant::now() + wait));
            ready!(Pin::new(deadline).poll(cx));
            this.stopped(Outcome::Stalled);
        }
    }
}

/// Adds the gateway's headers, counts, and logs.
fn finish(
    ctx: &Ctx<'_>,
    mut response: Response,
    endpoint: Option<&Endpoint>,
    outcome: &'static str,
) -> Response {
    let h = response.headers_mut();
    h.insert(&ROUTE_VERSION_HEADER, version_value(ctx.version));
    h.insert(&ATTEMPTS_HEADER, attempts_value(ctx.attempts));
    if !h.contains_key(&REQUEST_ID) {
        h.insert(REQUEST_ID.clone(), ctx.forward.request_id.clone());
    }
    if ctx.degraded {
        h.insert(&DEGRADED_HEADER, HeaderValue::from_static("true"));
    }
    let status = response.status();
    let status_class = match status.as_u16() {
        200..=299 => "2xx",
        400..=499 => "4xx",
        _ => "5xx",
    };
    let hot = endpoint
        .filter(|e| outcome == "success" && status_class == "2xx" && e.model == ctx.model)
        .and_then(|e| e.hot.get());
    match hot {
        Some(hot) => hot.requests_ok.inc(),
        None => {
            let labels = RequestLabels {
                model: ctx.model.clone(),
                served_model: endpoint.map_or_else(|| "none".to_owned(), |e| e.model.clone()),
                pool: endpoint.map_or_else(String::new, |e| e.pool.clone()),
                endpoint: endpoint.map_or_else(String::new, |e| e.url.clone()),
                status_class,
                outcome,
            };
            ctx.gw.metrics.requests.get_or_create(&labels).inc()
        }
    };
    if !ctx.stream {
        if let Some((latency, _)) = ctx.gw.model_histograms.get(&ctx.model) {
            latency.observe(ctx.started.elapsed().as_secs_f64());
        }
    }
    info!(
        target: "access",
        model = ctx.requested.as_str(),
        tenant = ctx.tenant_name(),
        served = endpoint.map_or("none", |e| e.model.as_str()),
        endpoint = endpoint.map_or("", |e| e.url.as_str()),
        attempts = ctx.attempts,
        outcome,
        status = status.as_u16(),
        version = ctx.version,
        degraded = ctx.degraded,
        ms = ctx.started.elapsed().as_millis() as u64,
        request_id = access_id(&ctx.forward.request_id),
        "request"
    );
    response
}

/// A request id as the access log writes it: as text (ids are visible ASCII: the
/// caller's is checked, a new one is hex).
fn access_id(id: &HeaderValue) -> &str {
    id.to_str().unwrap_or("-")
}

/// The caller's question: the last user message, or the prompt.
fn question(body: &Value) -> String {
    if let Some(messages) = body["messages"].as_array() {
        let text = |c: &Value| match c {
            Value::String(s) => s.clone(),
            Value::Array(parts) => parts
                .iter()
                .filter_map(|p| p["text"].as_str())
                .collect::<Vec<_>>()
                .join(" "),
            _ => String::new(),
        };
        return messages
            .iter()
            .rev()
            .find(|m| m["role"] == "user")
            .map(|m| text(&m["content"]))
            .unwrap_or_default();
    }
    match &body["prompt"] {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(Value::as_str)
            .collect::<Vec<_>>()
            .join(" "),
        _ => String::new(),
    }
}

/// A static answer, OpenAI-shaped, always 200.
fn faq_answer(ctx: &Ctx<'_>, set: Option<&str>, outcome: &'static str) -> Response {
    let gw = &ctx.gw;
    gw.metrics
        .static_answers
        .get_or_create(&ModelLabel {
            model: ctx.model.clone(),
        })
        .inc();
    let set = set
        .filter(|s| gw.faqs.contains_key(*s))
        .or_else(|| {
            gw.config
                .models
                .get(&ctx.model)
                .and_then(|m| m.faq.as_deref())
        })
        .or_else(|| gw.faqs.keys().next().map(String::as_str));
    let request: Value = serde_json::from_slice(&ctx.raw).unwrap_or_default();
    let q = question(&request);
    // Answered here, so no tokens were spent; the shape is the one asked for.
    let no_usage = json!({"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0});
    let with_usage = request["stream_options"]["include_usage"] == Value::Bool(true);
    let answer = set.and_then(|s| gw.faqs.get(s)).map_or(
        "The service is busy right now. Please try again in a few minutes.".to_owned(),
        |f| f.answer(&q).answer.to_owned(),
    );
    let model = format!("stanch-faq/{}", set.unwrap_or("none"));
    let mut response = if ctx.stream {
        let object = match ctx.api {
            Api::Chat => "chat.completion.chunk",
            _ => "text_completion",
        };
        let chunk = |delta: Value, finish: Value| {
            let mut c = match ctx.api {
                Api::Chat => {
                    json!({"id": "stanch-faq", "object": object, "created": 0, "model": model,
                                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
                }
                _ => {
                    json!({"id": "stanch-faq", "object": object, "created": 0, "model": model,
                            "choices": [{"index": 0, "text": delta["content"].as_str().unwrap_or(""), "finish_reason": finish}]})
                }
            };
            if with_usage {
                c["usage"] = Value::Null;
            }
            c
        };
        let mut text = format!(
            "data: {}\n\ndata: {}\n\n",
            chunk(json!({"role": "assistant", "content": answer}), Value::Null),
            chunk(json!({}), json!("stop"))
        );
        if with_usage {
            let last = json!({"id": "stanch-faq", "object": object, "created": 0, "model": model,
                              "choices": [], "usage": no_usage});
            text.push_str(&format!("data: {last}\n\n"));
        }
        text.push_str("data: [DONE]\n\n");
        let mut r = Response::new(Body::from(text));
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        r
    } else {
        let usage = no_usage;
        let body = match ctx.api {
            Api::Chat => {
                json!({"id": "stanch-faq", "object": "chat.completion", "created": 0, "model": model,
                                "choices": [{"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}],
                                "usage": usage})
            }
            _ => {
                json!({"id": "stanch-faq", "object": "text_completion", "created": 0, "model": model,
                        "choices": [{"index": 0, "text": answer, "finish_reason": "stop"}], "usage": usage})
            }
        };
        axum::Json(body).into_response()
    };
    response
        .headers_mut()
        .insert(&DEGRADED_HEADER, HeaderValue::from_static("static"));
    finish(ctx, response, None, outcome)
}

#[cfg(test)]
mod tests {
    use stanch_api::{BlockedEndpoint, RouteTable, Timestamp};

    use bytes::Bytes;

    use super::{End, Relay, table_block, version_value};
    use crate::endpoints::Endpoint;

    #[test]
    fn the_route_version_header_follows_the_version() {
        assert_eq!(version_value(7), "7");
        assert_eq!(version_value(7), "7", "the kept one");
        assert_eq!(version_value(8), "8", "a new version");
        assert_eq!(version_value(7), "7", "and back");
        assert_eq!(version_value(u64::MAX), u64::MAX.to_string().as_str());
    }

    #[test]
    fn a_relay_holds_heartbeats_until_the_first_token_and_stops_at_the_end() {
        let malformed = prometheus_client::metrics::counter::Counter::default();
        let mut relay = Relay::default();
        assert!(
            relay
                .take(Bytes::from_static(b": keep-alive\n\n"), &malformed)
                .is_none()
        );
        assert!(!relay.started, "a heartbeat is not the first token");
        assert!(
            relay
                .take(Bytes::from_static(b"data: {oops\n\n"), &malformed)
                .is_none()
        );
        assert_eq!(
            malformed.get(),
            1,
            "a malformed chunk is counted and dropped"
        );
        let end = relay.take(
            Bytes::from_static(b"data: {\"choices\":[{\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\ndata: {\"late\":1}\n\n"),
            &malformed,
        );
        assert!(matches!(end, Some(End::Done)));
        assert!(relay.started && relay.last);
        assert_eq!(
            &relay.out[..],
            &b": keep-alive\n\ndata: {\"choices\":[{\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n"[..],
            "the heartbeat goes on with the answer; nothing after [DONE] does"
        );
        let mut failing = Relay::default();
        let end = failing.take(
            Bytes::from_static(b"data: {\"error\":{\"message\":\"overloaded\"}}\n\n"),
            &malformed,
        );
        assert!(matches!(end, Some(End::Error)));
    }

    #[test]
    fn a_table_block_names_an_endpoint_by_url_or_host_and_port() {
        let e = Endpoint::new(
            "http://10.0.0.7:8000",
            "qwen-72b",
            "dc-a",
            1,
            10,
            None,
            None,
            false,
            &crate::upstream::Connector::testing(),
        )
        .unwrap();
        let block = |endpoint: &str, model: Option<&str>, until: i64| BlockedEndpoint {
            endpoint: endpoint.to_owned(),
            model: model.map(str::to_owned),
            until: Timestamp::from_millis(until),
            reason: "test".into(),
        };
        let table = |blocked: Vec<BlockedEndpoint>| RouteTable {
            version: 1,
            epoch: "e".into(),
            hash: String::new(),
            generated_at: Timestamp::from_millis(0),
            models: Default::default(),
            blocked,
        };
        let now = Timestamp::from_millis(1_000);
        let blocked = |b: BlockedEndpoint| table_block(&table(vec![b]), &e, now);
        assert_eq!(
            blocked(block("http://10.0.0.7:8000", None, 2_000)),
            Some(Timestamp::from_millis(2_000))
        );
        assert_eq!(
            blocked(block("10.0.0.7:8000", Some("qwen-72b"), 3_000)),
            Some(Timestamp::from_millis(3_000))
        );
        assert_eq!(
            blocked(block("0.0.7:8000", None, 2_000)),
            None,
            "a suffix is not a host"
        );
        assert_eq!(
            blocked(block("10.0.0.7:8000", Some("qwen-14b"), 2_000)),
            None,
            "another model"
        );
        assert_eq!(blocked(block("10.0.0.7:8000", None, 500)), None, "expired");
    }
}
