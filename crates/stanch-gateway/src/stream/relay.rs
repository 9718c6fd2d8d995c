//! The relay of a committed stream: the upstream's events to the caller, as the
//! caller's connection takes them, until the answer ends, breaks or stalls. A stream
//! that breaks or stalls before its end is continued elsewhere where it can be (see
//! [`super::resume`]), and ends with an explicit error event where it cannot.

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
use tracing::{info, warn};

use super::continuation::{Continued, Resume, continuation};
use super::resume::{How, Splice, Spliced, Transcript};
use super::sse::{Event, Parser};
use super::{DONE, DONE_GRACE};
use crate::Gateway;
use crate::attempt::record_latency;
use crate::config::Timeouts;
use crate::endpoints::{Endpoint, InFlight, Work};
use crate::metrics::ResumeLabels;
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
    /// A chunk has passed: the first token (of the stream, or of its continuation).
    pub(super) started: bool,
    /// A chunk with a `finish_reason` has passed: the answer is complete.
    pub(super) last: bool,
    /// What the caller has, while the stream may be continued elsewhere.
    pub(super) transcript: Option<Transcript>,
    /// While a continuation is relayed: how its chunks become the caller's.
    splice: Option<Splice>,
    /// The events of the frame being taken (kept to reuse its allocation).
    events: Vec<Event>,
}

/// How the events of a stream said it ended.
pub(super) enum End {
    /// `data: [DONE]`.
    Done,
    /// An error object in the stream.
    Error,
    /// A regenerated continuation that is not the caller's answer.
    Diverged,
}

/// A chunk event's JSON: `data: <payload>\n\n`, as the parser gives it.
fn payload(raw: &[u8]) -> &str {
    let payload = &raw[b"data: ".len()..raw.len() - 2];
    std::str::from_utf8(payload).expect("a chunk is UTF-8")
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
                Event::Chunk { raw, last, text } => {
                    self.started = true;
                    match (&mut self.splice, &mut self.transcript) {
                        (Some(splice), Some(transcript)) => {
                            match splice.chunk(payload(&raw), last, transcript) {
                                Spliced::Pass(bytes) => {
                                    self.last |= last;
                                    self.out.extend_from_slice(&bytes);
                                }
                                Spliced::Skip => {}
                                Spliced::Diverged => {
                                    end = Some(End::Diverged);
                                    break;
                                }
                            }
                        }
                        (_, transcript) => {
                            if let Some(t) = transcript {
                                t.note(&raw, text);
                            }
                            self.last |= last;
                            self.out.extend_from_slice(&raw);
                        }
                    }
                }
                Event::Other(raw) => self.out.extend_from_slice(&raw),
                Event::Done if self.splice.as_ref().is_some_and(|s| !s.caught_up()) => {
                    end = Some(End::Diverged);
                    break;
                }
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

    /// Ready for a continuation asked for `how` (what the broken upstream had begun
    /// of an event is dropped).
    fn splice(&mut self, how: How) {
        self.parser = Parser::default();
        self.started = false;
        self.splice = self.transcript.as_ref().map(|t| {
            let text = t.text().unwrap_or_default();
            Splice::new(how, t.id(), &text, t.tokens())
        });
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
    /// The longest a continuation may take to its first chunk.
    first_token: Duration,
    /// While the upstream has nothing: the deadline that ends the wait.
    waiting: Option<stanch_net::timer::Sleep>,
    malformed: Counter,
    /// The upstream being relayed; `None` once the stream ended, or while a
    /// continuation is sought.
    open: Option<Open>,
    request: Request,
    /// To continue the stream elsewhere if it breaks; `None` when it may not be (or
    /// while a continuation is sought).
    resume: Option<Box<Resume>>,
    /// How many more times it may be.
    resumes_left: u32,
    /// A continuation being sought.
    seeking: Option<Seeking>,
    /// How the upstream last broke: the error event's, if no continuation comes.
    broke: Option<Outcome>,
    /// How the stream has been continued, for the access log.
    resumed: Option<How>,
    ended: bool,
}

type Seeking = Pin<Box<dyn Future<Output = (Resume, Option<Continued>)> + Send>>;

/// The upstream a committed stream is relaying, and what ending it records.
pub(super) struct Open {
    pub(super) upstream: upstream::Body,
    pub(super) endpoint: Arc<Endpoint>,
    pub(super) sent: Instant,
    /// Its time to first token, once it came.
    pub(super) ttft: Option<Duration>,
    /// Counts the request in flight on its endpoint until the stream ends or the
    /// caller goes.
    pub(super) _in_flight: InFlight,
}

/// The request a committed stream answers, for what its end records.
pub(super) struct Request {
    pub(super) gw: Arc<Gateway>,
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
}

impl Relayed {
    /// The relay of a stream committed with what `relay` has taken so far; `resume`
    /// continues it elsewhere up to the given number of times.
    pub(super) fn new(
        relay: Relay,
        timeouts: &Timeouts,
        malformed: Counter,
        open: Open,
        request: Request,
        resume: Option<(Box<Resume>, u32)>,
    ) -> Relayed {
        Relayed {
            relay,
            idle: timeouts.stream_idle.0,
            first_token: timeouts.first_token.0,
            waiting: None,
            malformed,
            open: Some(open),
            request,
            resumes_left: resume.as_ref().map_or(0, |(_, n)| *n),
            resume: resume.map(|(r, _)| r),
            seeking: None,
            broke: None,
            resumed: None,
            ended: false,
        }
    }

    /// Records how the upstream being relayed did, and lets it go. After a success
    /// its body is read to its end (the chunked terminator follows `[DONE]`) on a task
    /// of its own, so that its connection can be reused without holding up the end of
    /// the caller's stream.
    fn close(&mut self, outcome: &Outcome, now: Instant) -> Option<Arc<Endpoint>> {
        let open = self.open.take()?;
        let gw = &self.request.gw;
        let ttft = open.ttft.unwrap_or_else(|| now.duration_since(open.sent));
        record_latency(
            gw,
            &open.endpoint,
            outcome,
            open.sent,
            ttft,
            Work::FirstToken,
            now,
        );
        let mut body = open.upstream;
        if *outcome == Outcome::Success && !body.is_end_stream() {
            tokio::spawn(async move {
                let drain = async { while let Some(Ok(_)) = body.frame().await {} };
                let _ = tokio::time::timeout(DONE_GRACE, drain).await;
            });
        }
        Some(open.endpoint)
    }

    /// Ends the stream with `outcome`: an explicit error event unless it succeeded,
    /// then the outcome recorded and logged.
    pub(super) fn end(&mut self, outcome: Outcome) {
        if self.ended {
            return;
        }
        self.ended = true;
        if outcome != Outcome::Success {
            self.relay.out.extend_from_slice(&error_event(&outcome));
        }
        let now = Instant::now();
        let endpoint = self.close(&outcome, now);
        let r = &self.request;
        if let Some((latency, _)) = &r.histograms {
            latency.observe(now.duration_since(r.started).as_secs_f64());
        }
        let url = endpoint.as_ref().map_or("", |e| e.url.as_str());
        let resumed = self.resumed.map_or("no", How::label);
        info!(target: "access", model = r.model.as_str(), endpoint = url, attempts = r.attempts, outcome = outcome.label(), version = r.version, stream = true, resumed, ms = now.duration_since(r.started).as_millis() as u64, request_id = crate::respond::access_id(&r.request_id), "stream finished");
        self.waiting = None;
    }

    /// The upstream ended, broke or went quiet, which is `outcome`; after the final
    /// chunk, the answer is complete all the same, and ends properly with `[DONE]`.
    /// Before it, the stream is continued elsewhere if it may be.
    fn stopped(&mut self, outcome: Outcome) {
        if self.relay.last {
            self.relay.out.extend_from_slice(DONE);
            self.end(Outcome::Success);
        } else if !self.seek(&outcome) {
            self.end(outcome);
        }
    }

    /// Starts seeking a continuation after the upstream broke with `outcome`, if the
    /// answer so far can be continued and the stream may be again. A continuation that
    /// broke before its first chunk spends no resume: the next target is sought.
    fn seek(&mut self, outcome: &Outcome) -> bool {
        // The text so far, if it can be continued.
        let Some((text, tokens)) = self
            .relay
            .transcript
            .as_ref()
            .and_then(|t| Some((t.text()?, t.tokens())))
        else {
            return false;
        };
        let unstarted = self.open.as_ref().is_some_and(|o| o.ttft.is_none());
        if self.resumes_left == 0 && !unstarted {
            return false;
        }
        let Some(resume) = self.resume.take() else {
            return false;
        };
        if !unstarted {
            self.resumes_left -= 1;
        }
        if let Some(endpoint) = self.close(outcome, Instant::now()) {
            warn!(endpoint = %endpoint.url, outcome = outcome.label(), "a stream broke after its first token; continuing it elsewhere");
        }
        self.broke = Some(outcome.clone());
        self.waiting = None;
        self.seeking = Some(Box::pin(continuation(*resume, text, tokens)));
        true
    }

    /// The search for a continuation is over: relay what it found, or end the stream
    /// as it broke.
    fn found(&mut self, resume: Resume, found: Option<Continued>) {
        self.request.attempts = resume.attempts;
        self.resume = Some(Box::new(resume));
        let Some(c) = found else {
            self.count_resume("none", "unavailable");
            let outcome = self.broke.clone().unwrap_or(Outcome::Truncated);
            return self.end(outcome);
        };
        self.relay.splice(c.how);
        self.resumed = Some(c.how);
        let gw = &self.request.gw;
        self.first_token = gw
            .config
            .models
            .get(&c.endpoint.model)
            .and_then(|m| m.first_token_timeout)
            .map_or(gw.config.timeouts.first_token.0, |d| d.0);
        self.open = Some(Open {
            upstream: c.body,
            endpoint: c.endpoint,
            sent: c.sent,
            ttft: None,
            _in_flight: c.in_flight,
        });
    }

    fn count_resume(&self, how: &'static str, result: &'static str) {
        self.request
            .gw
            .metrics
            .stream_resumes
            .get_or_create(&ResumeLabels { how, result })
            .inc();
    }

    /// Takes what the upstream has ready: `Pending` once it has nothing more, or when
    /// there is no upstream.
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
                let end = self.relay.take(data, &self.malformed);
                if self.relay.started && open.ttft.is_none() {
                    open.ttft = Some(open.sent.elapsed());
                }
                if let Some(splice) = &mut self.relay.splice
                    && splice.spliced
                    && !std::mem::replace(&mut splice.counted, true)
                {
                    let how = splice.how().label();
                    self.count_resume(how, "spliced");
                }
                match end {
                    Some(End::Done) => self.end(Outcome::Success),
                    Some(End::Error) => self.stopped(Outcome::ServerError(200)),
                    Some(End::Diverged) => {
                        self.count_resume(How::Regenerate.label(), "diverged");
                        let outcome = self.broke.clone().unwrap_or(Outcome::Truncated);
                        self.end(outcome);
                    }
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
            if let Some(seeking) = &mut this.seeking {
                if let Poll::Ready((resume, found)) = seeking.as_mut().poll(cx) {
                    this.seeking = None;
                    this.found(resume, found);
                    continue;
                }
            } else if this.relay.out.len() < BATCH_LIMIT && this.poll_upstream(cx).is_ready() {
                // Bounded, so that an upstream faster than the caller cannot grow it.
                continue;
            }
            if !this.relay.out.is_empty() {
                return Poll::Ready(Some(Ok(Frame::data(this.relay.out.split().freeze()))));
            }
            if this.ended {
                return Poll::Ready(None);
            }
            let Some(open) = &this.open else {
                // A continuation is being sought, within deadlines of its own.
                return Poll::Pending;
            };
            // Nothing to pass on: wait for the upstream, no longer than the idle limit
            // (after the final chunk, only briefly for `[DONE]`; for a continuation's
            // first chunk, its first-token timeout from when it was sent).
            let (until, outcome) = match open.ttft {
                None => (open.sent + this.first_token, Outcome::FirstTokenTimeout),
                Some(_) if this.relay.last => (Instant::now() + DONE_GRACE, Outcome::Stalled),
                Some(_) => (Instant::now() + this.idle, Outcome::Stalled),
            };
            let deadline = this
                .waiting
                .get_or_insert_with(|| stanch_net::timer::sleep_until(until));
            ready!(Pin::new(deadline).poll(cx));
            this.stopped(outcome);
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
