//! Continuation: a broken stream continued elsewhere. A stream committed to an
//! upstream keeps what its request needs to be attempted again ([`Resume`]); when the
//! upstream breaks off, [`continuation`] looks for another upstream's stream through
//! the same attempts as any retry, and the relay splices it on
//! ([`super::resume`]).

use std::sync::Arc;

use bytes::Bytes;
use tokio::time::Instant;
use tracing::warn;

use super::resume::{How, prefilled};
use crate::Gateway;
use crate::attempt::{Next, Tried, is_stream, next, payload, record, send};
use crate::endpoints::{Endpoint, InFlight};
use crate::error::Failure;
use crate::headers::Forward;
use crate::outcome::Outcome;
use crate::request::{Api, Ctx};
use crate::route::plan;
use crate::upstream;

/// What a request has attempted when it attempts an endpoint: what a stream committed
/// to that endpoint keeps, to be continued elsewhere if it breaks.
pub(crate) struct Attempted<'a> {
    /// Every endpoint attempted, this one included.
    pub(crate) tried: &'a [&'a Arc<Endpoint>],
    /// Attempts, this one included.
    pub(crate) attempts: u32,
}

impl<'a> Attempted<'a> {
    /// What `ctx` has attempted, as `tried` has it.
    pub(crate) fn of(ctx: &Ctx<'_>, tried: &'a Tried<'a>) -> Attempted<'a> {
        Attempted {
            tried: &tried.all,
            attempts: ctx.attempts,
        }
    }
}

/// A request whose stream the caller is reading, kept to continue that stream
/// elsewhere if it breaks: what its [`Ctx`] holds, owned, with what it has attempted.
pub(crate) struct Resume {
    gw: Arc<Gateway>,
    api: Api,
    requested: String,
    serving: String,
    raw: Bytes,
    started: Instant,
    degraded: bool,
    tenant: Option<usize>,
    forward: Forward,
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
    let targets = plan(&gw, serving, ctx.route_table(), ctx.wall);
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
