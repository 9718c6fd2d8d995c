//! The gRPC watch (`stanch.v1.RouteWatch`), gRPC health checking and server
//! reflection, served on the API port beside HTTP/1.1 (HTTP/2, chosen per
//! connection: see `stanch_net::ConnLimits::http2`).
//!
//! One stream is one session: the gateway's Hello says what it holds, the session
//! sends what it lacks, latest only, and reads the gateway's Acks and Nacks. A table
//! is sent once the gateway has answered the one before it, so one table at most is
//! ever on its way to a gateway, and one that applies slowly is sent the newest
//! version when it is ready, not every version published meanwhile (HTTP/2 flow
//! control alone would let a window's worth of old tables queue for it). The
//! session is the response body itself, run whenever HTTP/2 can take another message
//! from it (no task of its own, nothing handed between tasks). A gateway that takes
//! nothing it is owed (a newer table, a heartbeat), or answers no table, for
//! `watch.slow_client_timeout` is cut off by the [`sweep`], its connection closed: a
//! body behind HTTP/2 flow control is not run, so it cannot time itself out. The
//! publisher never waits for any.
//!
//! The watch is served by hand rather than by the generated `RouteWatchServer`, for
//! its codec ([`WatchCodec`]): a table goes out as the bytes its snapshot encoded once
//! (`Snapshot::grpc`), so a version costs one encoding however many gateways watch,
//! and a stream's buffers start small.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{BufMut, Bytes};
use stanch_proto::v1::{self, watch_request, watch_response};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, Weak};

use stanch_api::status::WatchTransport;
use tokio::time::Instant;
use tonic::codegen::tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};
use tracing::debug;

use super::{AppState, WatcherGuard};

mod deadline;
use crate::auth::Role;
use crate::gateways::{MAX_ID_LEN, Report, clean_reason, valid_id};
use crate::net::CloseConnection;
use crate::net::body::BodyBudget;

/// The largest message a gateway may send (Hello, Ack and Nack are a few hundred
/// bytes at most).
const MAX_REQUEST_BYTES: usize = 64 << 10;
/// The largest message the controller sends: one route table, as SSE bounds it.
const MAX_RESPONSE_BYTES: usize = 32 << 20;
/// The versions a session remembers sending, for checking Acks: a gateway
/// acknowledges each soon after it arrives, so the last few are enough.
const SENT_KEPT: usize = 16;
/// What a stream's encode and decode buffers start with (tonic's default: 8 KiB
/// each). They grow for a larger message; a watch's messages are a few a minute.
const BUFFER_BYTES: usize = 1 << 10;
/// The method.
const WATCH_ROUTES: &str = "/stanch.v1.RouteWatch/WatchRoutes";

/// The gRPC services as one router, for the API router to merge.
pub(super) fn router(state: AppState) -> axum::Router {
    let health = tonic_health::pb::health_server::HealthServer::new(
        tonic_health::server::HealthService::from_health_reporter(state.health.clone()),
    );
    let descriptors = [
        stanch_proto::FILE_DESCRIPTOR_SET,
        tonic_health::pb::FILE_DESCRIPTOR_SET,
    ];
    let mut v1 = tonic_reflection::server::Builder::configure();
    let mut v1alpha = tonic_reflection::server::Builder::configure();
    for set in descriptors {
        v1 = v1.register_encoded_file_descriptor_set(set);
        v1alpha = v1alpha.register_encoded_file_descriptor_set(set);
    }
    // A message a client has begun must be whole within the slow-client timeout,
    // holding its bytes from the budget of bodies still arriving.
    let limits = (
        state.server.watch.slow_client_timeout.0,
        state.bodies.clone(),
    );
    let watch = WatchService(Arc::new(Watch { state }));
    let built = "the descriptors compiled at build time";
    let router = mount(axum::Router::new(), watch, &limits);
    let router = mount(router, health, &limits);
    let router = mount(router, v1.build_v1().expect(built), &limits);
    mount(router, v1alpha.build_v1alpha().expect(built), &limits)
}

/// Routes `/<package.Service>/<method>` to `service`, each message of a request to
/// arrive within the duration of `limits` of its first byte, holding its bytes from
/// the budget of `limits` meanwhile ([`deadline`]). (tonic's own router would bring a
/// fallback of its own, answering every other path as a gRPC call.)
fn mount<S>(router: axum::Router, service: S, limits: &(Duration, BodyBudget)) -> axum::Router
where
    S: tower::Service<
            axum::http::Request<axum::body::Body>,
            Response = axum::http::Response<tonic::body::Body>,
            Error = std::convert::Infallible,
        > + tonic::server::NamedService
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    let (within, budget) = limits.clone();
    let service = tower::ServiceBuilder::new()
        .map_request(move |request: axum::http::Request<axum::body::Body>| {
            request
                .map(|body| axum::body::Body::new(deadline::Deadline::new(body, within, &budget)))
        })
        .service(service);
    router.route_service(&format!("/{}/{{*method}}", S::NAME), service)
}

/// Keeps `grpc.health.v1` truthful until `stop`: the watch service is SERVING while
/// this replica has a route table to serve, NOT_SERVING before (a follower that has
/// not read the leader's state). The server as a whole (service `""`) is SERVING
/// while it runs; both are NOT_SERVING once it stops, while connections drain.
pub(crate) async fn report_health(state: AppState, stop: impl std::future::Future<Output = ()>) {
    use tonic_health::ServingStatus;
    let health = &state.health;
    let watch = stanch_proto::ROUTE_WATCH_SERVICE;
    let mut published = state.publisher.subscribe();
    tokio::pin!(stop);
    loop {
        let status = if state.publisher.table().is_some() {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        health.set_service_status(watch, status).await;
        tokio::select! {
            changed = published.changed() => if changed.is_err() { break },
            () = &mut stop => break,
        }
    }
    for service in ["", watch] {
        health
            .set_service_status(service, ServingStatus::NotServing)
            .await;
    }
}

/// `stanch.v1.RouteWatch`, with [`WatchCodec`]; any other method of it is
/// `UNIMPLEMENTED`.
#[derive(Clone)]
struct WatchService(Arc<Watch>);

impl tonic::server::NamedService for WatchService {
    const NAME: &'static str = stanch_proto::ROUTE_WATCH_SERVICE;
}

type Answer = axum::http::Response<tonic::body::Body>;

impl tower::Service<axum::http::Request<axum::body::Body>> for WatchService {
    type Response = Answer;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Answer, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: axum::http::Request<axum::body::Body>) -> Self::Future {
        let watch = self.0.clone();
        Box::pin(async move {
            if request.uri().path() != WATCH_ROUTES {
                return Ok(
                    Status::unimplemented("stanch.v1.RouteWatch has WatchRoutes only").into_http(),
                );
            }
            let mut grpc = tonic::server::Grpc::new(WatchCodec)
                .apply_max_message_size_config(Some(MAX_REQUEST_BYTES), Some(MAX_RESPONSE_BYTES));
            Ok(grpc.streaming(WatchRoutes(watch), request).await)
        })
    }
}

/// The watch's codec: a gateway's messages are decoded by prost; the controller's are
/// written as they were encoded, a table once per version for every stream
/// (`Snapshot::grpc`), a heartbeat once per beat.
struct WatchCodec;

impl tonic::codec::Codec for WatchCodec {
    type Encode = Bytes;
    type Decode = v1::WatchRequest;
    type Encoder = Encoded;
    type Decoder = tonic_prost::ProstDecoder<v1::WatchRequest>;

    fn encoder(&mut self) -> Encoded {
        Encoded
    }

    fn decoder(&mut self) -> Self::Decoder {
        tonic_prost::ProstDecoder::new(buffers())
    }
}

fn buffers() -> tonic::codec::BufferSettings {
    tonic::codec::BufferSettings::new(BUFFER_BYTES, 32 << 10)
}

/// Writes a message already encoded.
struct Encoded;

impl tonic::codec::Encoder for Encoded {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, item: Bytes, dst: &mut tonic::codec::EncodeBuf<'_>) -> Result<(), Status> {
        dst.put_slice(&item);
        Ok(())
    }

    fn buffer_settings(&self) -> tonic::codec::BufferSettings {
        buffers()
    }
}

/// `WatchRoutes`, as tonic's server calls it.
struct WatchRoutes(Arc<Watch>);

impl tonic::server::StreamingService<v1::WatchRequest> for WatchRoutes {
    type Response = Bytes;
    type ResponseStream = Messages;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Messages>, Status>> + Send>>;

    fn call(&mut self, request: Request<Streaming<v1::WatchRequest>>) -> Self::Future {
        let watch = self.0.clone();
        Box::pin(async move { watch.watch_routes(request).await })
    }
}

struct Watch {
    state: AppState,
}

/// A stream's messages, each encoded.
type Messages = Pin<Box<dyn Stream<Item = Result<Bytes, Status>> + Send>>;

impl Watch {
    async fn watch_routes(
        &self,
        request: Request<Streaming<v1::WatchRequest>>,
    ) -> Result<Response<Messages>, Status> {
        let state = &self.state;
        state
            .tokens
            .check(Role::Read, request.metadata().as_ref())
            .map_err(|_| {
                Status::unauthenticated(
                    "a valid read or admin token is required as `authorization: Bearer <token>` metadata",
                )
            })?;
        if state.publisher.table().is_none() {
            return Err(Status::unavailable(
                "no route table yet: this replica has not read the leader's state",
            ));
        }
        let guard = WatcherGuard::admit(state, WatchTransport::Grpc, None)
            .map_err(|e| Status::unavailable(e.to_string()))?;
        let close = request.extensions().get::<CloseConnection>().cloned();
        let liveness = state.grpc_sessions.add(close);
        let heartbeat = state.server.watch.heartbeat.0;
        let mut beat = tokio::time::interval_at(Instant::now() + heartbeat, heartbeat);
        beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let session = Session {
            state: state.clone(),
            inbound: request.into_inner(),
            published: state.publisher.subscribe(),
            beat,
            guard,
            liveness,
            greeted: false,
            holds: None,
            sent: VecDeque::with_capacity(SENT_KEPT),
            unanswered: None,
        };
        let messages = futures_util::stream::unfold(Some(session), |session| async move {
            let mut session = session?;
            match session.next().await {
                Ok(message) => Some((Ok(message), Some(session))),
                Err(end) => {
                    let status = end?;
                    debug!(code = ?status.code(), message = status.message(), "gRPC watch ended");
                    Some((Err(status), None))
                }
            }
        });
        Ok(Response::new(Box::pin(messages)))
    }
}

/// One gateway's stream.
struct Session {
    state: AppState,
    inbound: Streaming<v1::WatchRequest>,
    published: tokio::sync::watch::Receiver<u64>,
    beat: tokio::time::Interval,
    guard: WatcherGuard,
    /// What the sweep sees of it.
    liveness: Arc<Liveness>,
    greeted: bool,
    /// The table the gateway holds as far as this session knows: what its Hello
    /// said, then what was last sent. `None` for the gateway that holds none.
    holds: Option<(Arc<str>, u64)>,
    /// The (epoch, version) of the last tables sent, newest last. An epoch is the
    /// snapshot's own (`Snapshot::epoch`), so remembering it costs no copy.
    sent: VecDeque<(Arc<str>, u64)>,
    /// The last table sent, until the gateway answers it (Ack or Nack): no other is
    /// sent meanwhile.
    unanswered: Option<(Arc<str>, u64)>,
}

/// Why a session ends: a status for the gateway (`None` when it just closed).
type End = Option<Status>;

impl Session {
    /// The next message for the gateway, once there is one (the Acks and Nacks that
    /// come meanwhile are taken in): a newer table once the last one is answered, or a
    /// heartbeat; `Err` when the stream ends, and why.
    async fn next(&mut self) -> Result<Bytes, End> {
        let watch = &self.state.server.watch;
        let (heartbeat, slow) = (watch.heartbeat.0, watch.slow_client_timeout.0);
        if !self.greeted {
            self.hello(slow).await.map_err(Some)?;
            self.greeted = true;
        }
        loop {
            let snap = self.state.publisher.load();
            let (epoch, version) = (&snap.epoch, snap.table.version);
            let news = self
                .holds
                .as_ref()
                .is_none_or(|(e, v)| *v < version || e != epoch);
            if news && self.unanswered.is_none() {
                let table = snap.grpc.clone();
                let epoch = epoch.clone();
                drop(snap);
                self.holds = Some((epoch.clone(), version));
                if self.sent.len() == SENT_KEPT {
                    self.sent.pop_front();
                }
                self.sent.push_back((epoch.clone(), version));
                self.unanswered = Some((epoch, version));
                self.beat.reset();
                self.liveness.gave(Some(version));
                return Ok(table);
            }
            drop(snap);
            if !news {
                // Else the sweep sees it owed the newer table until it is sent.
                self.liveness.holds(version);
            }
            tokio::select! {
                changed = self.published.changed() => {
                    if changed.is_err() {
                        return Err(Some(Status::unavailable("the controller is shutting down")));
                    }
                }
                _ = self.beat.tick() => {
                    let heartbeat = v1::WatchResponse {
                        kind: Some(watch_response::Kind::Heartbeat(v1::Heartbeat {
                            interval_ms: u64::try_from(heartbeat.as_millis()).unwrap_or(u64::MAX),
                            latest_version: self.state.publisher.load().table.version,
                        })),
                    };
                    self.liveness.gave(None);
                    return Ok(Bytes::from(prost::Message::encode_to_vec(&heartbeat)));
                }
                message = self.inbound.message() => self.receive(message)?,
            }
        }
    }

    /// Waits for the Hello (within `within`) and records the gateway.
    async fn hello(&mut self, within: Duration) -> Result<(), Status> {
        let message = tokio::time::timeout(within, self.inbound.message())
            .await
            .map_err(|_| {
                Status::deadline_exceeded(format!(
                    "no Hello within {within:?}: a watch starts with the gateway's Hello"
                ))
            })?;
        let hello = match unread(message)? {
            Some(watch_request::Kind::Hello(hello)) => hello,
            Some(other) => {
                return Err(Status::invalid_argument(format!(
                    "the first message must be a Hello, not {}",
                    name(&other)
                )));
            }
            None => return Err(Status::cancelled("the gateway closed its stream")),
        };
        if !valid_id(&hello.gateway_id) {
            return Err(Status::invalid_argument(format!(
                "Hello.gateway_id: must be 1 to {MAX_ID_LEN} bytes without control characters"
            )));
        }
        let holds = (!hello.epoch.is_empty()).then(|| (Arc::from(hello.epoch), hello.version));
        let report = Report {
            applied: holds.as_ref().map(|(_, v)| *v),
            rejected: None,
        };
        let now = self.state.clock.now();
        self.state
            .gateways
            .record(&hello.gateway_id, WatchTransport::Grpc, report, now);
        self.guard.attach(&hello.gateway_id);
        self.holds = holds;
        Ok(())
    }

    /// Takes in one message after the Hello: an Ack or a Nack of a table this
    /// session sent.
    fn receive(&mut self, message: Result<Option<v1::WatchRequest>, Status>) -> Result<(), End> {
        let now = self.state.clock.now();
        let report = match unread(message).map_err(Some)? {
            None => return Err(None),
            Some(watch_request::Kind::Hello(_)) => {
                return Err(Some(Status::invalid_argument(
                    "a second Hello: a stream has one, first",
                )));
            }
            Some(watch_request::Kind::Ack(ack)) => {
                self.was_sent("Ack", &ack.epoch, ack.version)?;
                self.answered(&ack.epoch, ack.version);
                Report {
                    applied: Some(ack.version),
                    rejected: None,
                }
            }
            Some(watch_request::Kind::Nack(nack)) => {
                self.was_sent("Nack", &nack.epoch, nack.version)?;
                self.answered(&nack.epoch, nack.version);
                Report {
                    applied: None,
                    rejected: Some((nack.version, clean_reason(&nack.reason))),
                }
            }
        };
        let id = self.guard.gateway().unwrap_or_default();
        self.state
            .gateways
            .record(id, WatchTransport::Grpc, report, now);
        Ok(())
    }

    /// The gateway answered the table of (`epoch`, `version`): if it is the last one
    /// sent, the next may go.
    fn answered(&mut self, epoch: &str, version: u64) {
        if self
            .unanswered
            .as_ref()
            .is_some_and(|(e, v)| *v == version && **e == *epoch)
        {
            self.unanswered = None;
        }
    }

    /// An Ack or Nack must name a table this session sent (most often the newest,
    /// looked at first).
    fn was_sent(&self, what: &str, epoch: &str, version: u64) -> Result<(), End> {
        if self
            .sent
            .iter()
            .rev()
            .any(|(e, v)| *v == version && **e == *epoch)
        {
            return Ok(());
        }
        let problem = if self.sent.iter().any(|(e, _)| **e == *epoch) {
            format!("{what} for version {version}, which this stream never sent")
        } else {
            let truncated: String = epoch.chars().take(64).collect();
            format!("{what} for epoch {truncated:?}, which this stream never sent")
        };
        Err(Some(Status::invalid_argument(problem)))
    }
}

/// The gRPC sessions in progress, for the [`sweep`].
#[derive(Default)]
pub(crate) struct Sessions {
    live: Mutex<Vec<Weak<Liveness>>>,
}

/// Milliseconds since the first time this was asked (at least 1: 0 means never).
fn now_ms() -> u64 {
    static BASE: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    let base = *BASE.get_or_init(Instant::now);
    u64::try_from(base.elapsed().as_millis())
        .unwrap_or(u64::MAX)
        .saturating_add(1)
}

/// What the sweep knows of one session.
pub(crate) struct Liveness {
    /// When the session last gave its gateway a message, or began.
    gave_at: AtomicU64,
    /// The version of the last table it gave (`u64::MAX`: none yet).
    holds: AtomicU64,
    /// Since when (by the sweep) it has owed its gateway a newer table; 0: it does not.
    owed_since: AtomicU64,
    /// Closes its connection, when it is served by `stanch_net` (always, but in tests
    /// that serve the router some other way).
    close: Option<CloseConnection>,
}

impl Sessions {
    /// Registers a session served on the connection `close` closes.
    fn add(&self, close: Option<CloseConnection>) -> Arc<Liveness> {
        let liveness = Arc::new(Liveness {
            gave_at: AtomicU64::new(now_ms()),
            holds: AtomicU64::new(u64::MAX),
            owed_since: AtomicU64::new(0),
            close,
        });
        self.live
            .lock()
            .expect("sessions lock")
            .push(Arc::downgrade(&liveness));
        liveness
    }
}

impl Liveness {
    /// The session gave its gateway a message: a table of `version`, or a heartbeat.
    fn gave(&self, version: Option<u64>) {
        self.gave_at.store(now_ms(), Ordering::Relaxed);
        if let Some(v) = version {
            self.holds(v);
        }
    }

    /// The gateway holds the table of `version`.
    fn holds(&self, version: u64) {
        self.holds.store(version, Ordering::Relaxed);
    }
}

/// Until `stop`: cuts off, every quarter of `watch.slow_client_timeout` (at most every
/// second), each gRPC session that has owed its gateway a newer table for longer than
/// that timeout, or given it nothing (not even a heartbeat) for a heartbeat interval
/// and that timeout; and forgets the sessions that ended.
pub(crate) async fn sweep(state: AppState, stop: impl Future<Output = ()>) {
    let watch = &state.server.watch;
    let slow = u64::try_from(watch.slow_client_timeout.0.as_millis()).unwrap_or(u64::MAX);
    let silent =
        slow.saturating_add(u64::try_from(watch.heartbeat.0.as_millis()).unwrap_or(u64::MAX));
    let every =
        (watch.slow_client_timeout.0 / 4).clamp(Duration::from_millis(10), Duration::from_secs(1));
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(stop);
    let sessions = &state.grpc_sessions;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = &mut stop => return,
        }
        let latest = state.publisher.load().table.version;
        let now = now_ms();
        let mut cut = 0;
        sessions.live.lock().expect("sessions lock").retain(|weak| {
            let Some(s) = weak.upgrade() else {
                return false;
            };
            let owed = s.holds.load(Ordering::Relaxed) != latest;
            let since = s.owed_since.load(Ordering::Relaxed);
            match (owed, since) {
                (false, _) => s.owed_since.store(0, Ordering::Relaxed),
                (true, 0) => s.owed_since.store(now, Ordering::Relaxed),
                _ => {}
            }
            let gave_at = s.gave_at.load(Ordering::Relaxed);
            let stuck = (owed && since != 0 && now.saturating_sub(since) > slow)
                || now.saturating_sub(gave_at) > silent;
            if stuck {
                // Behind HTTP/2 flow control a status would wait, as the messages do,
                // for window the gateway does not grant: its connection is closed
                // instead, which frees what waits on it, as a stuck SSE watcher's is.
                if let Some(close) = &s.close {
                    close.close();
                }
                cut += 1;
            }
            !stuck
        });
        if cut > 0 {
            debug!(
                cut,
                "gRPC watchers that took nothing for watch.slow_client_timeout were cut off"
            );
        }
    }
}

/// A message's kind, or the status for one that could not be read or has none.
fn unread(
    message: Result<Option<v1::WatchRequest>, Status>,
) -> Result<Option<watch_request::Kind>, Status> {
    match message {
        Ok(Some(v1::WatchRequest { kind: Some(kind) })) => Ok(Some(kind)),
        Ok(Some(v1::WatchRequest { kind: None })) => Err(Status::invalid_argument(
            "a WatchRequest with no Hello, Ack or Nack in it",
        )),
        Ok(None) => Ok(None),
        Err(status) if status.code() == tonic::Code::Cancelled => Ok(None),
        Err(status) => Err(Status::invalid_argument(format!(
            "unreadable message: {}",
            status.message()
        ))),
    }
}

fn name(kind: &watch_request::Kind) -> &'static str {
    match kind {
        watch_request::Kind::Hello(_) => "a Hello",
        watch_request::Kind::Ack(_) => "an Ack",
        watch_request::Kind::Nack(_) => "a Nack",
    }
}
