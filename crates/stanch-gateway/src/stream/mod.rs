//! Stream: a streamed answer, from its first token to its end.
//!
//! A stream is committed to an upstream only when its first token arrives
//! ([`commit`]), so a slow or failed start is retried elsewhere without the caller
//! noticing. From then on the caller has bytes, and the [`relay`] passes the
//! upstream's events on as they come, batched into as few writes as the caller's
//! connection takes; a failure ends the stream with an explicit SSE error event, never
//! a silently truncated answer presented as complete. A final chunk without
//! `data: [DONE]` is complete: the gateway adds `[DONE]` promptly. Events are read by
//! [`sse`], which sees only what it must (a chunk's end, `[DONE]`, errors).

pub(crate) mod continuation;
mod relay;
pub(crate) mod resume;
pub(crate) mod sse;

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderValue, header};
use axum::response::Response;
use http_body_util::BodyExt;
use prometheus_client::metrics::counter::Counter;
use stanch_net::timer::timeout_at;
use tokio::time::Instant;

use crate::Gateway;
use crate::attempt::record;
use crate::endpoints::{Endpoint, InFlight};
use crate::error::Failure;
use crate::headers;
use crate::outcome::Outcome;
use crate::request::{Api, Ctx};
use crate::upstream;
use continuation::{Attempted, Resume};
use relay::{End, Open, Relay, Relayed, Request};
use resume::Transcript;

/// The event that ends an OpenAI stream.
const DONE: &[u8] = b"data: [DONE]\n\n";
/// How long to wait for `[DONE]` after the final chunk before adding it ourselves.
const DONE_GRACE: Duration = Duration::from_millis(200);

/// Reads `body` until its first token: until then the attempt can still fail over
/// unseen (a heartbeat comment is held, not taken for a token). Gives how the stream
/// ended, if it ended with its first token.
async fn first_token(
    gw: &Gateway,
    endpoint: &Endpoint,
    body: &mut upstream::Body,
    relay: &mut Relay,
    malformed: &Counter,
    sent: Instant,
) -> Result<Option<Outcome>, Failure> {
    let timeout = gw
        .config
        .models
        .get(&endpoint.model)
        .and_then(|m| m.first_token_timeout)
        .map_or(gw.config.timeouts.first_token.0, |d| d.0);
    let failed = |outcome| record(gw, endpoint, Failure::new(outcome), sent);
    loop {
        let frame = match timeout_at(sent + timeout, body.frame()).await {
            Err(_) => return Err(failed(Outcome::FirstTokenTimeout)),
            Ok(None) => return Err(failed(Outcome::Truncated)),
            Ok(Some(Err(e))) => {
                // A reset before any token: the caller has nothing yet, as if the
                // connection had broken before the head.
                let failure = Failure::new(Outcome::Connect).transient().because(e);
                return Err(record(gw, endpoint, failure, sent));
            }
            Ok(Some(Ok(frame))) => frame,
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        match relay.take(data, malformed) {
            Some(End::Error | End::Diverged) => return Err(failed(Outcome::ServerError(200))),
            Some(End::Done) => return Ok(Some(Outcome::Success)),
            None if relay.started => return Ok(None),
            None => {}
        }
    }
}

/// Waits for the first token, then commits the stream to the caller: the answer whose
/// body relays the rest. Unless `retry.stream_resumes` is 0, the stream keeps what it
/// needs to be continued elsewhere should it break.
pub(crate) async fn commit(
    ctx: &Ctx<'_>,
    endpoint: &Arc<Endpoint>,
    upstream_headers: hyper::HeaderMap,
    mut body: upstream::Body,
    sent: Instant,
    in_flight: InFlight,
    so_far: &Attempted<'_>,
) -> Result<Response, Failure> {
    let gw = ctx.gw.clone();
    let resumes = gw.config.retry.stream_resumes;
    let mut relay = Relay::default();
    if resumes > 0 && ctx.api != Api::Embeddings {
        relay.transcript = Some(Transcript::new(gw.config.max_response_bytes));
    }
    let malformed = gw.metrics.malformed_chunks.clone();
    let end = first_token(&gw, endpoint, &mut body, &mut relay, &malformed, sent).await?;
    let ttft = sent.elapsed();
    let histograms = gw.model_histograms.get(ctx.model).cloned();
    if let Some((_, ttft_seconds)) = &histograms {
        ttft_seconds.observe(ttft.as_secs_f64());
    }
    let resume = relay
        .transcript
        .is_some()
        .then(|| Box::new(Resume::of(ctx, so_far)));
    // Committed: from here on the caller has bytes, so failures end the stream explicitly.
    let timeouts = gw.config.timeouts.clone();
    let mut relayed = Relayed::new(
        relay,
        &timeouts,
        malformed,
        Open {
            upstream: body,
            endpoint: endpoint.clone(),
            sent,
            ttft: Some(ttft),
            _in_flight: in_flight,
        },
        Request {
            histograms,
            model: ctx.model.to_owned(),
            version: ctx.version,
            attempts: so_far.attempts,
            started: ctx.started,
            request_id: ctx.forward.request_id.clone(),
            gw,
        },
        resume.map(|r| (r, resumes)),
    );
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
    Ok(response)
}
