//! stanch-client: follows a stanch controller's route table for a gateway.
//!
//! Owns: the watch (SSE, falling back to long-poll, or gRPC), reconnecting with jittered
//! backoff, acknowledging applied versions and refusing ones the gateway cannot apply,
//! and the last-known-good table on disk, so a restarted gateway routes correctly while
//! the controller is down. Does not own: applying the table to requests, or lease
//! expiry, which the gateway checks per request against its own clock.
//!
//! A gateway never waits on this client: [`Routes::current`] is a lock-free load.
//!
//! With feature `kubernetes`, `start_from_resource` follows the route-table resource
//! through the Kubernetes API instead, by the same rules; without it, nothing of kube
//! is linked.

mod grpc;
#[cfg(feature = "kubernetes")]
mod resource;

#[cfg(feature = "kubernetes")]
pub use resource::{ResourceConfig, start_from_resource};

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwapOption;
use futures_util::StreamExt;
use secrecy::{ExposeSecret, SecretString};
use stanch_api::RouteTable;
use stanch_api::headers::{APPLIED_VERSION, GATEWAY_ID, REJECTED_REASON, REJECTED_VERSION};
use stanch_log::Sources;
use tokio::sync::watch;
use tracing::{Instrument, debug, info, info_span, warn};

/// How to reach the controller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// SSE, falling back to long-poll when the stream is refused.
    Auto,
    /// Only SSE.
    Sse,
    /// Only long-poll.
    LongPoll,
    /// The gRPC `WatchRoutes` stream, with an Ack or Nack for every table.
    Grpc,
}

/// Watch settings.
#[derive(Debug, Clone)]
pub struct WatchConfig {
    /// The controller's base URL, e.g. `http://stanch:9797`.
    pub url: String,
    /// A read (or admin) token, if the controller wants one.
    pub token: Option<SecretString>,
    /// This gateway's identity, sent as `X-Stanch-Gateway`.
    pub gateway_id: String,
    /// Where the last-known-good table is kept; `None` keeps nothing.
    pub state_file: Option<PathBuf>,
    /// SSE, long-poll or gRPC.
    pub transport: Transport,
    /// The long-poll wait to ask for. A long-poll unanswered past it plus as much
    /// again (at most [`LONG_POLL_GRACE`]) is dropped and asked again.
    pub long_poll_wait: Duration,
    /// The heartbeat interval to expect until the controller says its own (the SSE
    /// header [`stanch_api::headers::HEARTBEAT`], the gRPC `Heartbeat`): a stream
    /// silent for two intervals is dropped and opened again.
    pub heartbeat: Duration,
    /// Reconnect backoff: first delay.
    pub backoff_min: Duration,
    /// Reconnect backoff: cap.
    pub backoff_max: Duration,
    /// PEM CA certificates trusted for an `https` controller, besides the Mozilla roots.
    pub ca_pem: Option<Vec<u8>>,
}

impl WatchConfig {
    /// Defaults for `url` as gateway `gateway_id`.
    pub fn new(url: &str, gateway_id: &str) -> WatchConfig {
        WatchConfig {
            url: url.trim_end_matches('/').to_owned(),
            token: None,
            gateway_id: gateway_id.to_owned(),
            state_file: None,
            transport: Transport::Auto,
            long_poll_wait: Duration::from_secs(30),
            heartbeat: Duration::from_secs(15),
            backoff_min: Duration::from_millis(200),
            backoff_max: Duration::from_secs(10),
            ca_pem: None,
        }
    }
}

/// Decides whether the gateway can apply a table; `Err` names the field it cannot
/// apply and why (sent to the controller as a NACK).
pub type Validator = Arc<dyn Fn(&RouteTable) -> Result<(), stanch_api::Invalid> + Send + Sync>;

/// The route table as the gateway sees it: always available, never blocking.
#[derive(Clone)]
pub struct Routes {
    current: Arc<ArcSwapOption<RouteTable>>,
    changed: watch::Receiver<u64>,
}

impl Routes {
    /// The applied table, if there is one.
    pub fn current(&self) -> Option<Arc<RouteTable>> {
        self.current.load_full()
    }

    /// Waits until a table with a version other than `version` is applied.
    pub async fn changed_from(&mut self, version: u64) -> Option<Arc<RouteTable>> {
        loop {
            if let Some(t) = self.current()
                && t.version != version
            {
                return Some(t);
            }
            self.changed.changed().await.ok()?;
        }
    }
}

/// Sets the table of [`Routes::manual`] by hand.
pub struct ManualRoutes {
    current: Arc<ArcSwapOption<RouteTable>>,
    notify: watch::Sender<u64>,
}

impl ManualRoutes {
    /// Applies `table`.
    pub fn set(&self, table: RouteTable) {
        let version = table.version;
        self.current.store(Some(Arc::new(table)));
        self.notify.send_replace(version);
    }
}

impl Routes {
    /// Routes set by hand rather than by a controller: for tests, and for gateways
    /// that get their table some other way.
    pub fn manual() -> (Routes, ManualRoutes) {
        let current = Arc::new(ArcSwapOption::empty());
        let (notify, changed) = watch::channel(0);
        (
            Routes {
                current: current.clone(),
                changed,
            },
            ManualRoutes { current, notify },
        )
    }
}

/// Why a watch attempt ended.
#[derive(Debug, thiserror::Error)]
enum WatchError {
    #[error("cannot reach the controller")]
    Request(#[from] reqwest::Error),
    #[error("the controller answered {0}")]
    Status(reqwest::StatusCode),
    #[error("the controller sent an unreadable table")]
    Table(#[source] serde_json::Error),
    #[error("the controller sent an event longer than {MAX_EVENT_BYTES} bytes")]
    TooLong,
    #[error("the stream ended")]
    Ended,
    #[error("the controller was silent for {0:?}: the connection is taken for dead")]
    Silent(Duration),
    #[error("the gRPC stream ended with {:?}: {}", .0.code(), .0.message())]
    Grpc(Box<tonic::Status>),
    #[error("the controller's URL or TLS settings cannot be used for gRPC")]
    GrpcSetup(#[source] tonic::transport::Error),
    #[error("the token is not a valid header value")]
    Token,
}

/// The most a long-poll may go unanswered past its wait before it is dropped.
pub const LONG_POLL_GRACE: Duration = Duration::from_secs(10);

/// The longest SSE event or gRPC message (one route table) read; a longer one is
/// refused.
const MAX_EVENT_BYTES: usize = stanch_api::routes::MAX_TABLE_BYTES;

/// The shortest and longest heartbeat interval a controller's header is believed
/// for: a watcher neither drops a healthy stream every few milliseconds nor waits
/// hours on a dead one.
const HEARTBEAT_BOUNDS: (Duration, Duration) =
    (Duration::from_millis(100), Duration::from_secs(600));

struct Watcher {
    config: WatchConfig,
    http: reqwest::Client,
    /// The gRPC channel, made on first use.
    grpc: Option<tonic::transport::Channel>,
    applier: Applier,
}

/// What every source of tables shares: the rules a table is applied by (newer than
/// the one applied, accepted by the validator), the refusal to report, and the
/// last-known-good copy on disk.
struct Applier {
    current: Arc<ArcSwapOption<RouteTable>>,
    notify: watch::Sender<u64>,
    validator: Option<Validator>,
    state_file: Option<PathBuf>,
    /// A table the gateway refused, to report on every request until one applies.
    rejected: Option<Rejected>,
}

/// A table the gateway could not read or would not apply.
#[derive(Debug, Clone)]
struct Rejected {
    version: u64,
    epoch: String,
    reason: String,
}

/// The two fields a table is named by, read from a table that is otherwise unreadable
/// (a field this gateway does not understand, a time it cannot parse), so that its
/// refusal can be reported against its version.
#[derive(Debug, serde::Deserialize)]
struct TableId {
    version: u64,
    epoch: String,
}

/// Starts following the controller. Loads the last-known-good table first, so the
/// gateway has routes before the controller answers (or while it is down).
pub fn start(
    config: WatchConfig,
    validator: Option<Validator>,
) -> (Routes, tokio::task::JoinHandle<()>) {
    let (routes, applier) = Applier::restore(config.state_file.clone(), validator);
    let mut http = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(3))
        .tcp_nodelay(true);
    if let Some(pem) = &config.ca_pem {
        match reqwest::Certificate::from_pem_bundle(pem) {
            Ok(certs) => {
                for cert in certs {
                    http = http.add_root_certificate(cert);
                }
            }
            Err(e) => {
                warn!(error = %e, "the controller's CA certificates are unreadable; trusting the Mozilla roots only")
            }
        }
    }
    let http = http.build().expect("an HTTP client builds");
    let watcher = Watcher {
        config,
        http,
        grpc: None,
        applier,
    };
    let span = info_span!("route_watch", controller = %watcher.config.url);
    let task = tokio::spawn(watcher.run().instrument(span));
    (routes, task)
}

impl Applier {
    /// An applier holding the last-known-good table from `state_file`, if there is a
    /// readable one, so that the gateway has routes before any source answers; and the
    /// routes it applies to.
    fn restore(state_file: Option<PathBuf>, validator: Option<Validator>) -> (Routes, Applier) {
        let current = Arc::new(ArcSwapOption::empty());
        if let Some(path) = &state_file {
            match load(path) {
                Ok(Some(table)) => {
                    info!(version = table.version, epoch = %table.epoch, path = %path.display(), "serving the last-known-good route table until the controller answers");
                    current.store(Some(Arc::new(table)));
                }
                Ok(None) => {}
                Err(e) => {
                    warn!(path = %path.display(), error = %e, source = %Sources(&e), "last-known-good route table unreadable; ignoring it")
                }
            }
        }
        let (notify, changed) = watch::channel(current.load().as_ref().map_or(0, |t| t.version));
        let routes = Routes {
            current: current.clone(),
            changed,
        };
        let applier = Applier {
            current,
            notify,
            validator,
            state_file,
            rejected: None,
        };
        (routes, applier)
    }

    /// Applies a table unless it is not newer than the one applied (same epoch) or the
    /// validator refuses it; returns whether it applied.
    fn apply(&mut self, table: RouteTable) -> bool {
        let have = self.current.load();
        if let Some(h) = have.as_ref()
            && h.epoch == table.epoch
            && h.version >= table.version
        {
            return false;
        }
        if let Some(validate) = &self.validator
            && let Err(why) = validate(&table)
        {
            warn!(version = table.version, reason = %why, "route table refused");
            self.refuse(table.version, table.epoch, why.to_string());
            return false;
        }
        self.rejected = None;
        if let Some(path) = &self.state_file
            && let Err(e) = save(path, &table)
        {
            warn!(path = %path.display(), error = %e, "cannot save the last-known-good route table");
        }
        debug!(version = table.version, "route table applied");
        let version = table.version;
        self.current.store(Some(Arc::new(table)));
        self.notify.send_replace(version);
        true
    }

    /// Applies a table as JSON, or records why it cannot be read. `Err` only when not
    /// even its version can be read.
    fn receive(&mut self, bytes: &[u8]) -> Result<bool, serde_json::Error> {
        match serde_json::from_slice::<RouteTable>(bytes) {
            Ok(table) => Ok(self.apply(table)),
            Err(e) => {
                let Ok(id) = serde_json::from_slice::<TableId>(bytes) else {
                    return Err(e);
                };
                warn!(version = id.version, epoch = %id.epoch, error = %e, "route table unreadable; refused, the gateway keeps its current table");
                self.refuse(id.version, id.epoch, format!("unreadable: {e}"));
                Ok(false)
            }
        }
    }

    /// Records a refused table, to report until one applies.
    fn refuse(&mut self, version: u64, epoch: String, reason: String) {
        self.rejected = Some(Rejected {
            version,
            epoch,
            reason,
        });
    }
}

/// The table saved at `path`, `None` if there is none; a file that is not a table is
/// `InvalidData`, with the parse error as its cause.
fn load(path: &Path) -> std::io::Result<Option<RouteTable>> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Writes atomically: a torn file must never replace a good one.
fn save(path: &Path, table: &RouteTable) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, serde_json::to_vec(table).expect("tables serialize"))?;
    std::fs::rename(&tmp, path)
}

impl Watcher {
    async fn run(mut self) {
        let mut backoff = self.config.backoff_min;
        let mut use_sse = self.config.transport != Transport::LongPoll;
        loop {
            let result = if self.config.transport == Transport::Grpc {
                self.grpc_session().await
            } else if use_sse {
                self.follow_sse().await
            } else {
                self.long_poll().await
            };
            match result {
                Ok(()) => backoff = self.config.backoff_min,
                Err(WatchError::Status(s))
                    if use_sse
                        && self.config.transport == Transport::Auto
                        && s.is_client_error()
                        && s != reqwest::StatusCode::UNAUTHORIZED =>
                {
                    info!(status = %s, "SSE refused; falling back to long-poll");
                    use_sse = false;
                    continue;
                }
                // A connection that went quiet was a working one: open the next at
                // once (it may reach another replica); if that fails, back off.
                Err(e @ WatchError::Silent(_)) => {
                    warn!(error = %e, "route watch silent; reconnecting, the gateway keeps its current table");
                    backoff = self.config.backoff_min;
                }
                Err(e) => {
                    let wait = jitter(backoff);
                    warn!(error = %e, source = %Sources(&e), retry_in = ?wait, "route watch interrupted; the gateway keeps its current table");
                    tokio::time::sleep(wait).await;
                    backoff = (backoff * 2).min(self.config.backoff_max);
                }
            }
        }
    }

    /// One gRPC stream on the watcher's channel (made on first use).
    async fn grpc_session(&mut self) -> Result<(), WatchError> {
        let channel = match &self.grpc {
            Some(channel) => channel.clone(),
            None => {
                let channel = grpc::channel(&self.config).map_err(WatchError::GrpcSetup)?;
                self.grpc = Some(channel.clone());
                channel
            }
        };
        let result = self.follow_grpc(channel).await;
        if let Err(WatchError::Silent(_)) = result {
            // The channel would wait on the same dead connection: the next stream
            // gets a new one.
            self.grpc = None;
        }
        result
    }

    fn request(&self, url: String) -> reqwest::RequestBuilder {
        let mut req = self
            .http
            .get(url)
            .header(GATEWAY_ID, &self.config.gateway_id);
        if let Some(t) = self.applier.current.load().as_ref() {
            req = req.header(APPLIED_VERSION, t.version);
        }
        if let Some(r) = &self.applier.rejected {
            let reason: String = r
                .reason
                .chars()
                .map(|c| if c.is_control() { ' ' } else { c })
                .take(256)
                .collect();
            req = req.header(REJECTED_VERSION, r.version);
            if let Ok(value) = reqwest::header::HeaderValue::from_str(&reason) {
                req = req.header(REJECTED_REASON, value);
            }
        }
        if let Some(token) = &self.config.token {
            req = req.bearer_auth(token.expose_secret());
        }
        req
    }

    /// Applies a table from the wire; `Err` when not even its version can be read.
    fn receive(&mut self, bytes: &[u8]) -> Result<bool, WatchError> {
        self.applier.receive(bytes).map_err(WatchError::Table)
    }

    /// The long-poll request: wait for a version after the one applied, or after the
    /// one refused if that is newer, so a refused table is not fetched again at once.
    /// The epoch is whatever the controller sent, so it goes in query-encoded.
    fn poll(&self, wait: Duration) -> reqwest::RequestBuilder {
        let have = self.applier.current.load();
        let after = match (have.as_ref(), &self.applier.rejected) {
            (Some(t), Some(r)) if r.epoch != t.epoch || r.version > t.version => {
                Some((r.version, r.epoch.as_str()))
            }
            (Some(t), _) => Some((t.version, t.epoch.as_str())),
            (None, Some(r)) => Some((r.version, r.epoch.as_str())),
            (None, None) => None,
        };
        let request = self.request(format!("{}/v1/routes", self.config.url));
        match after {
            Some((version, epoch)) => request.query(&[
                ("after", version.to_string().as_str()),
                ("epoch", epoch),
                ("wait", &format!("{}ms", wait.as_millis())),
            ]),
            None => request,
        }
    }

    async fn long_poll(&mut self) -> Result<(), WatchError> {
        let wait = self.config.long_poll_wait;
        let response = self
            .poll(wait)
            .timeout(wait + wait.min(LONG_POLL_GRACE))
            .send()
            .await?;
        match response.status() {
            reqwest::StatusCode::OK => {
                let bytes = response.bytes().await?;
                if !self.receive(&bytes)? && self.applier.rejected.is_some() {
                    self.acknowledge(wait).await;
                }
                Ok(())
            }
            reqwest::StatusCode::NOT_MODIFIED => Ok(()),
            status => Err(WatchError::Status(status)),
        }
    }

    /// Tells the controller what is applied (a long-poll that does not wait), giving
    /// up after `within`: a controller gone silent must not hold the watch up.
    async fn acknowledge(&self, within: Duration) {
        let _ = self
            .poll(Duration::ZERO)
            .timeout(within.min(Duration::from_secs(5)))
            .send()
            .await;
    }

    async fn follow_sse(&mut self) -> Result<(), WatchError> {
        let mut req = self.request(format!("{}/v1/routes/stream", self.config.url));
        if let Some(t) = self.applier.current.load().as_ref() {
            // The version alone would not tell a table of another epoch (a controller
            // that lost its state and counted again) that happens to have that number.
            req = req
                .header("last-event-id", t.version)
                .query(&[("epoch", t.epoch.as_str())]);
        }
        // Until the controller says its interval, the configured one bounds the wait
        // for its answer.
        let expected = 2 * self.config.heartbeat;
        let response = tokio::time::timeout(expected, req.send())
            .await
            .map_err(|_| WatchError::Silent(expected))??;
        if !response.status().is_success() {
            return Err(WatchError::Status(response.status()));
        }
        let silence = 2 * response
            .headers()
            .get(stanch_api::headers::HEARTBEAT)
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
            .map(Duration::from_millis)
            .map_or(self.config.heartbeat, |d| {
                d.clamp(HEARTBEAT_BOUNDS.0, HEARTBEAT_BOUNDS.1)
            });
        let mut body = response.bytes_stream();
        let mut buf: Vec<u8> = Vec::new();
        // Silence counts from the last bytes heard, acknowledgements included.
        let mut heard = tokio::time::Instant::now();
        loop {
            while let Some(end) = find(&buf, b"\n\n") {
                let event: Vec<u8> = buf.drain(..end + 2).collect();
                let text = String::from_utf8_lossy(&event);
                let data: String = text
                    .lines()
                    .filter_map(|l| l.strip_prefix("data:"))
                    .map(str::trim_start)
                    .collect();
                if data.is_empty() {
                    continue; // A heartbeat or a comment.
                }
                self.receive(data.as_bytes())?;
                let left = (heard + silence).saturating_duration_since(tokio::time::Instant::now());
                self.acknowledge(left).await;
            }
            match tokio::time::timeout_at(heard + silence, body.next()).await {
                Ok(Some(Ok(chunk))) => {
                    heard = tokio::time::Instant::now();
                    buf.extend_from_slice(&chunk);
                    if buf.len() > MAX_EVENT_BYTES {
                        return Err(WatchError::TooLong);
                    }
                }
                Ok(Some(Err(e))) => return Err(e.into()),
                Ok(None) => return Err(WatchError::Ended),
                Err(_) => return Err(WatchError::Silent(silence)),
            }
        }
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// ±20 % spread on a reconnect delay, so a fleet does not reconnect in step.
fn jitter(d: Duration) -> Duration {
    let nanos = std::process::id() as u64 ^ d.as_nanos() as u64;
    stanch_api::jitter::spread(d, 0.2, stanch_api::hash::fnv64(&nanos.to_le_bytes()))
}
