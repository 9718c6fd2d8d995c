//! Attempt: the plan's targets in order, an endpoint at a time, until one answers.
//!
//! Within a pool, the balancer chooses among the endpoints not yet tried; every attempt
//! after the first waits a jittered backoff and spends from the retry budget, and none
//! starts past the request's deadline or its `max_attempts`. An attempt's [`Failure`]
//! says what trying again can do: another endpoint, a model with a larger context, or
//! nothing (the caller's fault, whose answer is passed on); and whether the same
//! endpoint is worth a second attempt (a one-off fault, a 429's short wait), which it
//! gets only when its model has no other endpoint open to try.
//!
//! Blocked is the lowest priority across the whole plan: a target whose endpoints are
//! all blocked is passed over while any later target (another pool, a fallback model)
//! has an open endpoint, and is tried only after every other target has failed. When
//! every target has failed, the FAQ answers (or, for embeddings, a `503`).

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderValue, header};
use axum::response::Response;
use bytes::Bytes;
use http_body_util::BodyExt;
use serde_json::Value;
use stanch_api::headers::RATE_LIMITED;
use stanch_net::body::{BodyError, BodyLimits, read_whole};
use stanch_net::timer::timeout_at;
use tokio::time::Instant;
use tracing::{debug, warn};

use crate::Gateway;
use crate::admit::Ctx;
use crate::endpoints::{Endpoint, InFlight, Kind, Work, choose};
use crate::error::{Again, Failure, Retry};
use crate::headers;
use crate::metrics::{AttemptLabels, KindLabel, ModelLabel, WinnerLabel};
use crate::outcome::{Outcome, classify_status, retry_after};
use crate::route::plan;
use crate::stream::resume::{How, prefilled};
use crate::upstream::{self, SendError};

/// The most of an upstream error body read, to classify it.
const ERROR_BODY_LIMIT: usize = 64 * 1024;

/// A (model, pool index) of the plan.
type Target<'g> = (&'g str, usize);

/// Serves the request from its model's plan, and answers it.
pub(crate) async fn serve(ctx: &mut Ctx<'_>) -> Response {
    let gw = ctx.gw;
    let model = ctx.serving;
    let per_pool = gw.config.retry.attempts_per_pool;
    let mut targets = plan(gw, model, ctx.table.as_deref(), ctx.wall);
    let mut redirected = false;
    let mut tried = Tried::default();
    // Targets passed over with every endpoint blocked, for after all the others.
    let mut passed_over: Vec<Target<'_>> = Vec::new();
    let mut last_resort = false;
    let deadline = ctx.started + gw.config.timeouts.total.0;
    let mut t = 0;
    'targets: loop {
        if t == targets.len() {
            if passed_over.is_empty() {
                break;
            }
            targets = std::mem::take(&mut passed_over);
            last_resort = true;
            t = 0;
        }
        let (m, _) = targets[t];
        let mut again: Option<&Arc<Endpoint>> = None;
        for n in 1..=per_pool {
            let endpoint = match again.take() {
                Some(endpoint) => endpoint,
                None => match next(ctx, &targets, t, &tried, deadline, last_resort).await {
                    Next::Try(endpoint) => endpoint,
                    Next::PoolDone => break,
                    Next::PassOver => {
                        passed_over.push(targets[t]);
                        break;
                    }
                    Next::Stop => break 'targets,
                },
            };
            tried.all.push(endpoint);
            ctx.attempts += 1;
            let hedge_after = gw.config.models.get(m).and_then(|c| c.hedge_after);
            let (result, endpoint) = match hedge_after {
                Some(after) if ctx.stream => {
                    let hedged =
                        hedged(ctx, endpoint, after.0, deadline, &targets[t..], &tried).await;
                    if let Some(second) = hedged.second {
                        tried.all.push(second);
                        ctx.attempts += 1;
                    }
                    (hedged.result, hedged.endpoint)
                }
                _ => {
                    let so_far = Attempted::of(ctx, &tried);
                    (attempt(ctx, endpoint, deadline, &so_far).await, endpoint)
                }
            };
            let failure = match result {
                Ok(answer) => {
                    return crate::respond::finish(ctx, answer, Some(endpoint), "success");
                }
                Err(failure) => failure,
            };
            match failure.retry() {
                Retry::Elsewhere => {
                    if failure.outcome.excludes_endpoint() {
                        warn!(endpoint = %endpoint.url, outcome = failure.outcome.label(), "too slow; not retried for this request");
                    } else if let Some(why) = failure.again_here()
                        && n < per_pool
                        && retry_here(ctx, &targets[t..], &tried, endpoint, why, deadline).await
                    {
                        tried.again.push(endpoint);
                        again = Some(endpoint);
                    }
                }
                Retry::LargerContext if !redirected => {
                    let larger = gw
                        .config
                        .models
                        .get(m)
                        .and_then(|c| c.larger_context.as_deref());
                    if let Some(larger) = larger {
                        redirected = true;
                        count_fallback(gw, "larger_context");
                        targets = plan(gw, larger, ctx.table.as_deref(), ctx.wall);
                        passed_over.clear();
                        t = 0;
                        continue 'targets;
                    }
                    return pass_on(ctx, failure, endpoint);
                }
                Retry::LargerContext | Retry::Never => return pass_on(ctx, failure, endpoint),
            }
        }
        t += 1;
        if let Some((next, _)) = targets.get(t) {
            count_fallback(gw, if *next == m { "pool" } else { "model" });
        }
    }
    if ctx.api.answers_from_faq() {
        count_fallback(gw, "faq");
        let faq = gw.config.models.get(model).and_then(|m| m.faq.as_deref());
        return crate::respond::faq(ctx, faq, "faq_fallback");
    }
    crate::respond::exhausted(ctx)
}

/// The endpoints a request has attempted.
#[derive(Default)]
struct Tried<'g> {
    /// Each attempted endpoint, once per attempt.
    all: Vec<&'g Arc<Endpoint>>,
    /// Those attempted again, once for each time.
    again: Vec<&'g Endpoint>,
}

impl Tried<'_> {
    fn has(&self, e: &Endpoint) -> bool {
        self.all.iter().any(|t| std::ptr::eq(t.as_ref(), e))
    }

    fn times_again(&self, e: &Endpoint) -> u32 {
        self.again.iter().filter(|t| std::ptr::eq(**t, e)).count() as u32
    }
}

/// Whether `endpoint`, which just failed for `why`, gets the request again, and if so
/// after waiting: at least the wait it asked for and the backoff, from the retry
/// budget, within the deadline and `max_attempts`. A fault counts as one-off only while
/// the endpoint's run of failures is this request's alone, with nothing else in flight
/// there, so a dead endpoint gets no more attempts than its blocking threshold allows. Only when its model has no other
/// endpoint open and untried in `rest` (this target and those after it): another
/// endpoint answers sooner than a wait, and a fallback model is a degradation a short
/// wait spares the caller.
async fn retry_here(
    ctx: &Ctx<'_>,
    rest: &[Target<'_>],
    tried: &Tried<'_>,
    endpoint: &Endpoint,
    why: Again,
    deadline: Instant,
) -> bool {
    let gw = ctx.gw;
    let r = &gw.config.retry;
    let now = Instant::now();
    let floor = why.floor();
    let resume = now + floor.max(backoff(gw, ctx.attempts));
    let allowed = match why {
        Again::Transient => {
            let again = tried.times_again(endpoint);
            again < r.same_endpoint && endpoint.one_off_failure(again + 1)
        }
        // Waited out once per request: a wait that is followed by another 429 is a
        // limit that holds, and the request moves on.
        Again::After(wait) => {
            tried.times_again(endpoint) == 0
                && !r.retry_after_max.0.is_zero()
                && wait <= r.retry_after_max.0
        }
    };
    // A block of its own beyond the wait (passive blocking, not the 429's own wait) or
    // the table's says it is not coming back within this request.
    let coming_back = endpoint.blocked(now).is_none_or(|until| until <= resume)
        && ctx.table_block(endpoint).is_none();
    if !allowed || !coming_back || ctx.attempts >= r.max_attempts || resume >= deadline {
        return false;
    }
    let alternative = rest
        .iter()
        .filter(|(m, _)| *m == endpoint.model)
        .flat_map(|(m, p)| &gw.models[*m].pools[*p].1)
        .any(|e| ctx.open(e, |e| std::ptr::eq(e, endpoint) || tried.has(e), now));
    if alternative {
        return false;
    }
    if !gw.budget.try_retry(now) {
        gw.metrics.budget_exhausted.inc();
        return false;
    }
    count_retry(ctx);
    gw.metrics
        .same_endpoint_retries
        .get_or_create(&KindLabel { kind: why.label() })
        .inc();
    debug!(endpoint = %endpoint.url, why = why.label(), wait = ?resume.duration_since(now), "attempting the same endpoint again");
    tokio::time::sleep_until(resume).await;
    true
}

/// The upstream's own answer to a request it refused, as it came.
fn pass_on(ctx: &Ctx<'_>, failure: Failure, endpoint: &Endpoint) -> Response {
    let label = failure.outcome.label();
    let answer = failure
        .answer
        .expect("a failure passed on carries the upstream's answer");
    crate::respond::finish(ctx, answer, Some(endpoint), label)
}

fn count_fallback(gw: &Gateway, kind: &'static str) {
    gw.metrics
        .fallbacks
        .get_or_create(&KindLabel { kind })
        .inc();
}

fn count_retry(ctx: &Ctx<'_>) {
    ctx.gw
        .metrics
        .retries
        .get_or_create(&ModelLabel {
            model: ctx.model.to_owned(),
        })
        .inc();
}

/// What to do next within the target `targets[t]`.
enum Next<'g> {
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
async fn next<'g>(
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

/// What a request has attempted when it attempts an endpoint: what a stream committed
/// to that endpoint keeps, to be continued elsewhere if it breaks.
pub(crate) struct Attempted<'a> {
    /// Every endpoint attempted, this one included.
    pub(crate) tried: &'a [&'a Arc<Endpoint>],
    /// Attempts, this one included.
    pub(crate) attempts: u32,
}

impl<'a> Attempted<'a> {
    fn of(ctx: &Ctx<'_>, tried: &'a Tried<'a>) -> Attempted<'a> {
        Attempted {
            tried: &tried.all,
            attempts: ctx.attempts,
        }
    }
}

/// One attempt at `endpoint`: the answer, or why there is none.
async fn attempt(
    ctx: &Ctx<'_>,
    endpoint: &Arc<Endpoint>,
    deadline: Instant,
    so_far: &Attempted<'_>,
) -> Result<Response, Failure> {
    let gw = ctx.gw;
    let (response, sent, in_flight) = send(ctx, endpoint, payload(ctx, endpoint), deadline).await?;
    if ctx.stream && is_stream(&response) {
        let (head, body) = response.into_parts();
        return crate::stream::commit(ctx, endpoint, head.headers, body, sent, in_flight, so_far)
            .await;
    }
    let answer = whole(gw, endpoint, response, sent, deadline).await;
    drop(in_flight);
    answer
}

/// Sends `body` to `endpoint` and waits for the head of a successful answer, within
/// `timeouts.first_byte` and the deadline; an error status is a [`Failure`], read and
/// classified. Gives the answer with when it was sent, counted in flight.
async fn send(
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
                warn!(endpoint = %endpoint.url, error = %e, "upstream attempt failed");
            } else {
                debug!(endpoint = %endpoint.url, error = %e, "upstream attempt failed");
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

fn is_stream<B>(response: &hyper::Response<B>) -> bool {
    response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"))
}

/// A hedged attempt: what answered, and the second target attempted, if one was.
struct Hedged<'g> {
    result: Result<Response, Failure>,
    /// The endpoint `result` is from.
    endpoint: &'g Arc<Endpoint>,
    second: Option<&'g Arc<Endpoint>>,
}

/// An attempt at a stream that, after `after` without a first token, is sent to the
/// next open target in `rest` as well (from the retry budget, within `max_attempts`):
/// the first of the two to stream serves the caller, and the other is cancelled
/// (dropped, which closes its connection). One that fails leaves the other to answer.
async fn hedged<'g>(
    ctx: &Ctx<'g>,
    endpoint: &'g Arc<Endpoint>,
    after: Duration,
    deadline: Instant,
    rest: &[Target<'g>],
    tried: &Tried<'g>,
) -> Hedged<'g> {
    let gw = ctx.gw;
    let so_far = Attempted::of(ctx, tried);
    let original = attempt(ctx, endpoint, deadline, &so_far);
    tokio::pin!(original);
    let single = |result| Hedged {
        result,
        endpoint,
        second: None,
    };
    tokio::select! {
        biased;
        result = &mut original => return single(result),
        () = tokio::time::sleep_until((Instant::now() + after).min(deadline)) => {}
    }
    let Some(second) = hedge_target(ctx, rest, tried) else {
        return single(original.await);
    };
    debug!(endpoint = %endpoint.url, hedge = %second.url, "no first token yet: hedged");
    let mut both = tried.all.clone();
    both.push(second);
    let so_far = Attempted {
        tried: &both,
        attempts: ctx.attempts + 1,
    };
    let hedge = attempt(ctx, second, deadline, &so_far);
    tokio::pin!(hedge);
    let (first, first_is_hedge) = tokio::select! {
        result = &mut original => (result, false),
        result = &mut hedge => (result, true),
    };
    let (winner, result, answered) = match first {
        Ok(answer) => (
            if first_is_hedge { "hedge" } else { "original" },
            Ok(answer),
            if first_is_hedge { second } else { endpoint },
        ),
        // The other may still answer.
        Err(_) if first_is_hedge => {
            let result = original.await;
            (
                if result.is_ok() {
                    "original"
                } else {
                    "neither"
                },
                result,
                endpoint,
            )
        }
        Err(_) => {
            let result = hedge.await;
            (
                if result.is_ok() { "hedge" } else { "neither" },
                result,
                second,
            )
        }
    };
    gw.metrics
        .hedges
        .get_or_create(&WinnerLabel { winner })
        .inc();
    Hedged {
        result,
        endpoint: answered,
        second: Some(second),
    }
}

/// The endpoint a hedge goes to: the best open one not yet attempted, in this target
/// or the ones after it; none once `max_attempts` or the retry budget is spent.
fn hedge_target<'g>(
    ctx: &Ctx<'g>,
    rest: &[Target<'g>],
    tried: &Tried<'g>,
) -> Option<&'g Arc<Endpoint>> {
    let gw: &'g Gateway = ctx.gw;
    if ctx.attempts >= gw.config.retry.max_attempts {
        return None;
    }
    let now = Instant::now();
    let blocked = |e: &Endpoint| ctx.table_block(e);
    let slow_start = gw.config.blocking.slow_start.0;
    for (m, p) in rest {
        let endpoints = &gw.models[*m].pools[*p].1;
        let open: Vec<&Endpoint> = endpoints
            .iter()
            .map(Arc::as_ref)
            .filter(|e| ctx.open(e, |e| tried.has(e), now))
            .collect();
        let Some((chosen, _)) = choose(&open, blocked, Kind::Stream, now, slow_start) else {
            continue;
        };
        if !gw.budget.try_retry(now) {
            gw.metrics.budget_exhausted.inc();
            return None;
        }
        count_retry(ctx);
        return endpoints.iter().find(|e| std::ptr::eq(e.as_ref(), chosen));
    }
    None
}

/// A request whose stream the caller is reading, kept to continue that stream
/// elsewhere if it breaks: what its [`Ctx`] holds, owned, with what it has attempted.
pub(crate) struct Resume {
    gw: Arc<Gateway>,
    api: crate::admit::Api,
    requested: String,
    serving: String,
    raw: Bytes,
    started: Instant,
    degraded: bool,
    tenant: Option<usize>,
    forward: crate::headers::Forward,
    /// Attempts so far, continuations included.
    pub(crate) attempts: u32,
    tried: Vec<Arc<Endpoint>>,
}

/// A continuation of a broken stream: the head of another upstream's stream, its body
/// not yet read.
pub(crate) struct Continued {
    pub(crate) endpoint: Arc<Endpoint>,
    pub(crate) body: upstream::Body,
    pub(crate) sent: Instant,
    pub(crate) in_flight: InFlight,
    pub(crate) how: How,
}

impl Resume {
    /// What continuing `ctx`'s stream needs, after `so_far`.
    pub(crate) fn of(ctx: &Ctx<'_>, so_far: &Attempted<'_>) -> Resume {
        Resume {
            gw: ctx.gw.clone(),
            api: ctx.api,
            requested: ctx.requested.clone(),
            serving: ctx.serving.to_owned(),
            raw: ctx.raw.clone(),
            started: ctx.started,
            degraded: ctx.degraded,
            tenant: ctx.tenant,
            forward: ctx.forward.clone(),
            attempts: so_far.attempts,
            tried: so_far.tried.iter().map(|e| Arc::clone(e)).collect(),
        }
    }
}

/// Finds a continuation of a stream that broke with `text` (`tokens` of it) at the
/// caller: the plan again, from the route table in force now, over the endpoints not
/// yet attempted, as retries (budget, backoff, `max_attempts`, within
/// `timeouts.total` of the request's start). A pool that takes a prefill gets the
/// partial answer to continue; any other, the request to regenerate. A refusal (a
/// pool that does not take the prefill it was said to) moves on, and is never the
/// caller's answer. Gives the resume back, with what it attempted.
pub(crate) async fn continuation(
    mut r: Resume,
    text: String,
    tokens: u32,
) -> (Resume, Option<Continued>) {
    let gw = r.gw.clone();
    let Some((serving, _)) = gw.models.get_key_value(r.serving.as_str()) else {
        return (r, None);
    };
    let table = gw.table();
    let mut tried = Tried::default();
    tried.all = gw
        .endpoints()
        .filter(|e| r.tried.iter().any(|t| Arc::ptr_eq(t, e)))
        .collect();
    let mut ctx = Ctx {
        gw: &gw,
        api: r.api,
        requested: r.requested.clone(),
        model: serving,
        serving,
        raw: r.raw.clone(),
        stream: true,
        version: table.as_ref().map_or(0, |t| t.version),
        wall: gw.clock.now(),
        table,
        started: r.started,
        degraded: r.degraded,
        attempts: r.attempts,
        tenant: r.tenant,
        forward: r.forward.clone(),
    };
    let targets = plan(&gw, serving, ctx.table.as_deref(), ctx.wall);
    let deadline = r.started + gw.config.timeouts.total.0;
    let mut found = None;
    'targets: for t in 0..targets.len() {
        let (m, p) = targets[t];
        for _ in 0..gw.config.retry.attempts_per_pool {
            let endpoint = match next(&ctx, &targets, t, &tried, deadline, false).await {
                Next::Try(endpoint) => endpoint,
                Next::PoolDone | Next::PassOver => break,
                Next::Stop => break 'targets,
            };
            tried.all.push(endpoint);
            ctx.attempts += 1;
            let prefill = gw.config.models[m].pools[p].prefill;
            let model = endpoint
                .upstream_model
                .as_deref()
                .filter(|n| **n != ctx.requested);
            let (how, body) = match prefilled(&ctx.raw, ctx.api, prefill, &text, tokens, model) {
                Some(body) => (How::Prefill, body),
                None => (How::Regenerate, payload(&ctx, endpoint)),
            };
            match send(&ctx, endpoint, body, deadline).await {
                Ok((response, sent, in_flight)) if is_stream(&response) => {
                    found = Some(Continued {
                        endpoint: endpoint.clone(),
                        body: response.into_body(),
                        sent,
                        in_flight,
                        how,
                    });
                    break 'targets;
                }
                Ok((_, sent, _)) => {
                    record(&gw, endpoint, Failure::new(Outcome::ServerError(200)), sent);
                }
                Err(failure) if failure.answer.is_some() => {
                    warn!(endpoint = %endpoint.url, how = how.label(), outcome = failure.outcome.label(), "a continuation of a broken stream was refused; moving on");
                }
                Err(_) => {}
            }
        }
    }
    r.attempts = ctx.attempts;
    r.tried = tried.all.iter().map(|e| Arc::clone(e)).collect();
    (r, found)
}

/// The caller's bytes, untouched unless the upstream names the model differently.
fn payload(ctx: &Ctx<'_>, endpoint: &Endpoint) -> Bytes {
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
async fn whole(
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
