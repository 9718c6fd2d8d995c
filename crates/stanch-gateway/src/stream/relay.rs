//! The relay of a committed stream: the upstream's events to the caller, as the
//! caller's connection takes them, until the answer ends, breaks or stalls.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use axum::http::HeaderValue;
use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;
use hyper::body::{Body as _, Frame};
use prometheus_client::metrics::counter::Counter;
use serde_json::json;
use tokio::time::Instant;
use tracing::info;

use super::sse::{Event, Parser};
use super::{DONE, DONE_GRACE};
use crate::Gateway;
use crate::attempt::record_latency;
use crate::endpoints::{Endpoint, InFlight, Work};
use crate::outcome::Outcome;
use crate::upstream;

/// The most of a stream passed to the caller in one write.
const BATCH_LIMIT: usize = 64 * 1024;

/// A stream on its way from the upstream to the caller.
#[derive(Default)]
pub(super) struct Relay {
    parser: Parser,
    /// Bytes for the caller, not yet written.
    pub(super) out: BytesMut,
    /// A chunk has passed: the first token.
    pub(super) started: bool,
    /// A chunk with a `finish_reason` has passed: the answer is complete.
    pub(super) last: bool,
    /// The events of the frame being taken (kept to reuse its allocation).
    events: Vec<Event>,
}

/// How the events of a stream said it ended.
pub(super) enum End {
    /// `data: [DONE]`.
    Done,
    /// An error object in the stream.
    Error,
}

impl Relay {
    /// Takes the bytes of one upstream frame: what is for the caller goes to `out`.
    /// Returns how the answer ended, if it did; nothing after its end is taken.
    pub(super) fn take(&mut self, data: Bytes, malformed: &Counter) -> Option<End> {
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
pub(super) struct Relayed {
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
pub(super) struct Open {
    pub(super) upstream: upstream::Body,
    pub(super) gw: Arc<Gateway>,
    pub(super) endpoint: Arc<Endpoint>,
    pub(super) sent: Instant,
    pub(super) ttft: Duration,
    pub(super) histograms: Option<(
        crate::metrics::WorkerHistogram,
        crate::metrics::WorkerHistogram,
    )>,
    pub(super) model: String,
    pub(super) version: u64,
    pub(super) attempts: u32,
    pub(super) started: Instant,
    /// The request's id, for the access log.
    pub(super) request_id: HeaderValue,
    /// Counts the request in flight on its endpoint until the stream ends or the
    /// caller goes.
    pub(super) _in_flight: InFlight,
}

impl Relayed {
    /// The relay of a stream committed with what `relay` has taken so far.
    pub(super) fn new(relay: Relay, idle: Duration, malformed: Counter, open: Open) -> Relayed {
        Relayed {
            relay,
            idle,
            waiting: None,
            malformed,
            open: Some(open),
        }
    }

    /// Ends the stream with `outcome`: an explicit error event unless it succeeded,
    /// then the outcome recorded and logged. The upstream's body is then read to its
    /// end (the chunked terminator follows `[DONE]`) on a task of its own, so that its
    /// connection can be reused without holding up the end of the caller's stream.
    pub(super) fn end(&mut self, outcome: Outcome) {
        let Some(e) = self.open.take() else {
            return;
        };
        if outcome != Outcome::Success {
            self.relay.out.extend_from_slice(&error_event(&outcome));
        }
        let now = Instant::now();
        record_latency(
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
        info!(target: "access", model = e.model.as_str(), endpoint = e.endpoint.url.as_str(), attempts = e.attempts, outcome = outcome.label(), version = e.version, stream = true, ms = now.duration_since(e.started).as_millis() as u64, request_id = crate::respond::access_id(&e.request_id), "stream finished");
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

fn error_event(outcome: &Outcome) -> Bytes {
    let body = json!({"error": {"message": format!("the upstream stream was interrupted ({}); this answer is incomplete", outcome.label()),
                                "type": "upstream_error", "code": "stream_interrupted"}});
    Bytes::from(format!("data: {body}\n\n"))
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::{End, Relay};

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
}
