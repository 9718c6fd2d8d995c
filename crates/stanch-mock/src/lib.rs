//! stanch-mock: an OpenAI-compatible upstream that answers deterministic text, with
//! faults switchable at runtime, so gateway tests, the demo and drills can make a
//! model server fail in every way a real one does.
//!
//! Owns: `POST /v1/chat/completions`, `/v1/completions`, `/v1/embeddings` (streaming
//! and not), `GET /v1/models`, `GET /metrics` (including a settable
//! `vllm:gpu_cache_usage_perc`), and the admin API (`/admin/fault`, `/admin/kv-cache`,
//! `/admin/stats`, `/admin/reset`). Does not own: any realism beyond the wire format.

pub mod fault;
mod openai;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tower::Service;

pub use fault::{Fault, FaultSpec};

/// How one mock instance behaves.
#[derive(Debug, Clone)]
pub struct MockConfig {
    /// The model name it answers as (the upstream model name).
    pub model: String,
    /// A name for this instance, sent as `X-Mock-Instance` and in metrics.
    pub instance: String,
    /// Requests must carry `Authorization: Bearer <key>` when set.
    pub api_key: Option<String>,
    /// Prompts longer than this many words get 400 `context_length_exceeded`.
    pub max_context_words: usize,
    /// Pause between streamed tokens.
    pub token_interval: Duration,
    /// The admin API needs `Authorization: Bearer <token>` when set.
    pub admin_token: Option<String>,
    /// Close a keep-alive connection idle this long, as uvicorn (hence vLLM) does after
    /// 5 s; `None` keeps it open.
    pub keep_alive: Option<Duration>,
    /// What it makes of a chat request whose last message is the assistant's.
    pub prefill: Prefill,
}

/// What a mock makes of a request that carries a partial answer to continue: a chat
/// that ends with an assistant message, or (continuing only) a completions prompt that
/// ends with the start of its own answer, as the servers it stands in for do.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Prefill {
    /// Takes it for history and answers afresh, as OpenAI's API does.
    #[default]
    Ignore,
    /// Continues it: the answer is the rest of what the request without it would have
    /// been given (`max_tokens` counting the partial answer's words), as vLLM with
    /// `continue_final_message` does.
    Continue,
    /// Refuses it with a 400, as some providers do for models without prefill.
    Reject,
}

impl MockConfig {
    /// A mock of `model` named `instance`, with no keys and instant tokens.
    pub fn new(model: &str, instance: &str) -> MockConfig {
        MockConfig {
            model: model.to_owned(),
            instance: instance.to_owned(),
            api_key: None,
            max_context_words: 4096,
            token_interval: Duration::ZERO,
            admin_token: None,
            keep_alive: None,
            prefill: Prefill::Ignore,
        }
    }
}

/// Counts of what the instance saw, for tests (`GET /admin/stats`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    /// Every request to the OpenAI routes, probes included.
    pub requests: u64,
    /// Requests marked as health probes (`X-Stanch-Probe`).
    pub probes: u64,
    /// By route (`chat`, `completions`, `embeddings`, `models`).
    pub by_route: BTreeMap<String, u64>,
    /// By outcome (`ok`, `fault:status`, `unauthorized`, ...).
    pub by_outcome: BTreeMap<String, u64>,
    /// Connections accepted (with TLS: handshakes completed).
    #[serde(default)]
    pub connections: u64,
}

#[derive(Debug)]
struct Inner {
    fault: FaultSpec,
    kv_cache: f64,
    stats: Stats,
    running: i64,
    /// The headers of the last request answered, and how many were.
    last_headers: Option<HeaderMap>,
    answered: u64,
}

/// One mock instance's shared state.
#[derive(Debug, Clone)]
pub struct Mock {
    config: Arc<MockConfig>,
    inner: Arc<Mutex<Inner>>,
}

impl Mock {
    /// A healthy instance.
    pub fn new(config: MockConfig) -> Mock {
        Mock {
            config: Arc::new(config),
            inner: Arc::new(Mutex::new(Inner {
                fault: FaultSpec::default(),
                kv_cache: 0.0,
                stats: Stats::default(),
                running: 0,
                last_headers: None,
                answered: 0,
            })),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &MockConfig {
        &self.config
    }

    /// Switches the fault in force.
    pub fn set_fault(&self, spec: FaultSpec) {
        self.inner.lock().expect("mock lock").fault = spec;
    }

    /// What the instance saw so far.
    pub fn stats(&self) -> Stats {
        self.inner.lock().expect("mock lock").stats.clone()
    }

    /// The headers of the last request answered on an OpenAI route, as received.
    pub fn last_request_headers(&self) -> Option<HeaderMap> {
        self.inner.lock().expect("mock lock").last_headers.clone()
    }

    /// Keeps `headers` as the last request's; returns how many were answered before.
    fn remember_headers(&self, headers: &HeaderMap) -> u64 {
        let mut inner = self.inner.lock().expect("mock lock");
        inner.last_headers = Some(headers.clone());
        inner.answered += 1;
        inner.answered - 1
    }

    /// Takes the fault for one request (counting down a limited fault) and records it.
    fn take_fault(&self, route: &str, probe: bool) -> Fault {
        let mut inner = self.inner.lock().expect("mock lock");
        inner.stats.requests += 1;
        if probe {
            inner.stats.probes += 1;
        }
        *inner.stats.by_route.entry(route.to_owned()).or_default() += 1;
        let fault = inner.fault.fault.clone();
        if let Some(n) = inner.fault.count.as_mut() {
            *n = n.saturating_sub(1);
            if *n == 0 {
                inner.fault = FaultSpec::default();
            }
        }
        fault
    }

    fn outcome(&self, outcome: &str) {
        let mut inner = self.inner.lock().expect("mock lock");
        *inner
            .stats
            .by_outcome
            .entry(outcome.to_owned())
            .or_default() += 1;
    }

    fn running(&self, delta: i64) {
        self.inner.lock().expect("mock lock").running += delta;
    }
}

/// The router of one instance.
pub fn router(mock: Mock) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(openai::chat))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/embeddings", post(openai::embeddings))
        .route("/v1/models", get(openai::models))
        .route("/metrics", get(metrics))
        .route(
            "/admin/fault",
            put(set_fault).delete(clear_fault).get(get_fault),
        )
        .route("/admin/kv-cache", put(set_kv_cache))
        .route("/admin/stats", get(stats))
        .route("/admin/reset", axum::routing::post(reset))
        .with_state(mock)
}

/// Whether the request may use the admin API.
fn admin_allowed(mock: &Mock, headers: &HeaderMap) -> bool {
    let Some(token) = &mock.config.admin_token else {
        return true;
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    given == Some(format!("Bearer {token}").as_str())
}

fn admin_refused() -> Response {
    (StatusCode::UNAUTHORIZED, "admin token required\n").into_response()
}

async fn set_fault(
    State(mock): State<Mock>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    if !admin_allowed(&mock, &headers) {
        return admin_refused();
    }
    match serde_json::from_slice::<FaultSpec>(&body) {
        Ok(spec) => {
            tracing::info!(instance = %mock.config.instance, fault = ?spec, "fault set");
            mock.set_fault(spec);
            StatusCode::NO_CONTENT.into_response()
        }
        Err(e) => (StatusCode::BAD_REQUEST, format!("bad fault: {e}\n")).into_response(),
    }
}

async fn clear_fault(State(mock): State<Mock>, headers: HeaderMap) -> Response {
    if !admin_allowed(&mock, &headers) {
        return admin_refused();
    }
    mock.set_fault(FaultSpec::default());
    StatusCode::NO_CONTENT.into_response()
}

async fn get_fault(State(mock): State<Mock>) -> Response {
    axum::Json(mock.inner.lock().expect("mock lock").fault.clone()).into_response()
}

#[derive(Deserialize)]
struct KvCache {
    value: f64,
}

async fn set_kv_cache(
    State(mock): State<Mock>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    if !admin_allowed(&mock, &headers) {
        return admin_refused();
    }
    match serde_json::from_slice::<KvCache>(&body) {
        Ok(KvCache { value }) if (0.0..=1.0).contains(&value) => {
            mock.inner.lock().expect("mock lock").kv_cache = value;
            StatusCode::NO_CONTENT.into_response()
        }
        _ => (StatusCode::BAD_REQUEST, "expected {\"value\": <0..1>}\n").into_response(),
    }
}

async fn stats(State(mock): State<Mock>) -> axum::Json<Stats> {
    axum::Json(mock.stats())
}

async fn reset(State(mock): State<Mock>, headers: HeaderMap) -> Response {
    if !admin_allowed(&mock, &headers) {
        return admin_refused();
    }
    let mut inner = mock.inner.lock().expect("mock lock");
    inner.fault = FaultSpec::default();
    inner.stats = Stats::default();
    inner.kv_cache = 0.0;
    StatusCode::NO_CONTENT.into_response()
}

/// Prometheus text, shaped like a vLLM server's so that rules written for vLLM apply.
async fn metrics(State(mock): State<Mock>) -> Response {
    let inner = mock.inner.lock().expect("mock lock");
    let (model, instance) = (&mock.config.model, &mock.config.instance);
    let mut out = String::new();
    out.push_str(
        "# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.\n",
    );
    out.push_str("# TYPE vllm:gpu_cache_usage_perc gauge\n");
    out.push_str(&format!(
        "vllm:gpu_cache_usage_perc{{model_name=\"{model}\"}} {}\n",
        inner.kv_cache
    ));
    out.push_str("# HELP vllm:num_requests_running Number of requests currently running.\n");
    out.push_str("# TYPE vllm:num_requests_running gauge\n");
    out.push_str(&format!(
        "vllm:num_requests_running{{model_name=\"{model}\"}} {}\n",
        inner.running
    ));
    out.push_str("# HELP stanch_mock_requests_total Requests by outcome.\n");
    out.push_str("# TYPE stanch_mock_requests_total counter\n");
    for (outcome, n) in &inner.stats.by_outcome {
        out.push_str(&format!(
            "stanch_mock_requests_total{{instance=\"{instance}\",model_name=\"{model}\",outcome=\"{outcome}\"}} {n}\n"
        ));
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response()
}

/// Wraps the router so that the `reset` fault closes the connection without answering.
#[derive(Clone)]
struct Resetting {
    mock: Mock,
    router: Router,
}

/// The error that makes hyper drop a connection.
#[derive(Debug, thiserror::Error)]
#[error("connection reset by fault injection")]
pub struct InjectedReset;

impl Service<Request<hyper::body::Incoming>> for Resetting {
    type Response = Response;
    type Error = InjectedReset;
    type Future = std::pin::Pin<Box<dyn Future<Output = Result<Response, InjectedReset>> + Send>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), InjectedReset>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<hyper::body::Incoming>) -> Self::Future {
        let is_api =
            req.uri().path().starts_with("/v1/") && req.method() == axum::http::Method::POST;
        let reset = is_api
            && matches!(
                self.mock.inner.lock().expect("mock lock").fault.fault,
                Fault::Reset
            );
        if reset {
            let route = openai::route_name(req.uri().path());
            let probe = req.headers().contains_key(stanch_api::headers::PROBE);
            self.mock.take_fault(route, probe);
            self.mock.outcome("fault:reset");
            return Box::pin(async { Err(InjectedReset) });
        }
        let mut router = self.router.clone();
        Box::pin(async move {
            let response: Result<Response, Infallible> =
                router.call(req.map(axum::body::Body::new)).await;
            Ok(response.unwrap_or_else(|never| match never {}))
        })
    }
}

/// Serves one instance on `listener` until `shutdown` resolves; over TLS when given
/// an acceptor.
pub async fn serve(
    listener: TcpListener,
    mock: Mock,
    tls: Option<TlsAcceptor>,
    shutdown: impl Future<Output = ()>,
) {
    let service = Resetting {
        router: router(mock.clone()),
        mock: mock.clone(),
    };
    tokio::pin!(shutdown);
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
            () = &mut shutdown => return,
        };
        let _ = stream.set_nodelay(true);
        let service = service.clone();
        let mock = mock.clone();
        let tls = tls.clone();
        tokio::spawn(async move {
            match tls {
                None => connection(stream, service, &mock).await,
                Some(tls) => {
                    let handshake = tls.accept(stream);
                    if let Ok(Ok(stream)) =
                        tokio::time::timeout(Duration::from_secs(5), handshake).await
                    {
                        connection(stream, service, &mock).await;
                    }
                }
            }
        });
    }
}

/// Serves one connection, closing it once idle for the configured keep-alive.
async fn connection<S>(stream: S, service: Resetting, mock: &Mock)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    mock.inner.lock().expect("mock lock").stats.connections += 1;
    let service = TowerToHyperService::new(service);
    let Some(keep_alive) = mock.config.keep_alive else {
        let _ = hyper::server::conn::http1::Builder::new()
            .serve_connection(TokioIo::new(stream), service)
            .await;
        return;
    };
    // Only a mock that closes idle connections notes when each last moved bytes.
    let last_io = Arc::new(Mutex::new(tokio::time::Instant::now()));
    let io = TokioIo::new(Tracked {
        inner: stream,
        last_io: last_io.clone(),
    });
    let conn = hyper::server::conn::http1::Builder::new().serve_connection(io, service);
    tokio::pin!(conn);
    let mut tick = tokio::time::interval(keep_alive / 4);
    loop {
        tokio::select! {
            _ = conn.as_mut() => return,
            _ = tick.tick() => {
                // A request in flight finishes first: this only closes between requests.
                if last_io.lock().expect("io clock").elapsed() >= keep_alive {
                    conn.as_mut().graceful_shutdown();
                }
            }
        }
    }
}

/// A stream that notes when it last moved bytes.
struct Tracked<S> {
    inner: S,
    last_io: Arc<Mutex<tokio::time::Instant>>,
}

impl<S> Tracked<S> {
    fn touch(&self) {
        *self.last_io.lock().expect("io clock") = tokio::time::Instant::now();
    }
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Tracked<S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let polled = std::pin::Pin::new(&mut self.inner).poll_read(cx, buf);
        if polled.is_ready() {
            self.touch();
        }
        polled
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Tracked<S> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let polled = std::pin::Pin::new(&mut self.inner).poll_write(cx, buf);
        if polled.is_ready() {
            self.touch();
        }
        polled
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Starts an instance on an ephemeral loopback port, for tests. Returns its base URL.
pub async fn spawn(mock: Mock) -> String {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    let addr = listener.local_addr().expect("local addr");
    tokio::spawn(serve(listener, mock, None, std::future::pending()));
    format!("http://{addr}")
}

/// Starts an instance serving TLS on an ephemeral loopback port, for tests. Returns
/// its base URL, `https://localhost:PORT` (the name its certificate should carry).
pub async fn spawn_tls(mock: Mock, tls: TlsAcceptor) -> String {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    let addr = listener.local_addr().expect("local addr");
    tokio::spawn(serve(listener, mock, Some(tls), std::future::pending()));
    format!("https://localhost:{}", addr.port())
}
