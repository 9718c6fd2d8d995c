//! Serving: the plan's targets in order, an endpoint at a time, until one answers.
//!
//! Each attempt is [`crate::attempt`]'s: the balancer's choice among the endpoints
//! not yet tried, after a backoff and from the retry budget, within the request's
//! deadline and `max_attempts`. An attempt's [`Failure`] says what trying again can
//! do: another endpoint, a model with a larger context, or nothing (the caller's
//! fault, whose answer is passed on); and whether the same endpoint is worth a second
//! attempt (a one-off fault, a 429's short wait), which it gets only when its model
//! has no other endpoint open to try. A stream is committed to the first upstream
//! whose first token arrives ([`crate::stream`]); a stream may be hedged.
//!
//! Blocked is the lowest priority across the whole plan: a target whose endpoints are
//! all blocked is passed over while any later target (another pool, a fallback model)
//! has an open endpoint, and is tried only after every other target has failed. When
//! every target has failed, the FAQ answers (or, for embeddings, a `503`).

use std::sync::Arc;
use std::time::Duration;

use axum::response::Response;
use tokio::time::Instant;
use tracing::{debug, warn};

use crate::Gateway;
use crate::attempt::{Next, Tried, backoff, count_retry, is_stream, next, payload, send, whole};
use crate::endpoints::{Endpoint, Kind, choose};
use crate::error::{Again, Failure, Retry};
use crate::metrics::{KindLabel, WinnerLabel};
use crate::request::Ctx;
use crate::route::{Target, plan};
use crate::stream::continuation::Attempted;

/// Serves the request from `targets`, the plan of the model that serves it
/// ([`crate::route`]), and answers it.
// Size: one loop over the plan whose state (tried, budget, deadline, hedge) every branch shares.
pub(crate) async fn serve<'g>(ctx: &mut Ctx<'g>, mut targets: Vec<Target<'g>>) -> Response {
    let gw = ctx.gw;
    let model = ctx.serving;
    let per_pool = gw.config.retry.attempts_per_pool;
    let mut redirected = false;
    let mut tried = Tried::default();
    // Targets passed over with every endpoint blocked, for after all the others.
    let mut passed_over: Vec<Target<'g>> = Vec::new();
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
                    (
                        answer_from(ctx, endpoint, deadline, &so_far).await,
                        endpoint,
                    )
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
                        targets = plan(gw, larger, ctx.route_table(), ctx.wall);
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

/// One attempt at `endpoint`: the answer, or why there is none.
async fn answer_from(
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
    let original = answer_from(ctx, endpoint, deadline, &so_far);
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
    let hedge = answer_from(ctx, second, deadline, &so_far);
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
