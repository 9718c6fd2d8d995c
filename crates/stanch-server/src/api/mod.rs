//! The HTTP API: one router, built by [`router`], so tests can drive it in-process.
//!
//! Handlers parse, authenticate (by route group), hand an input to the engine task,
//! and answer. No decision logic lives here.

mod admin;
mod grpc;
pub(crate) use grpc::{report_health, sweep as sweep_grpc};
mod intake;
mod read;
mod ui;
mod watch;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use arc_swap::ArcSwap;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{FromRequestParts, Query, Request, State};
use axum::http::request::Parts;
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{get, post};
use serde::de::DeserializeOwned;
use stanch_api::admin::{
    DryRunRequest, FailbackRequest, ForceRequest, FreezeRequest, ReleaseRequest, ThawRequest,
    UnblockAllRequest,
};
use stanch_api::status::WatchTransport;
use stanch_core::Config;
use tokio::sync::Notify;

use crate::auth::{Role, Tokens};
use crate::config::ServerConfig;
use crate::engine_task::{EngineHandle, EngineUnavailable, StoreHealth};
use crate::error::ApiError;
use crate::gateways::Gateways;
use crate::history::History;
use crate::metrics::{KindLabel, Metrics};
use crate::net::body::{BodyBudget, BodyError, BodyLimits, read_whole};
use crate::publish::Publisher;
use stanch_ports::clock::Clock;
use stanch_ports::leadership::Leadership;

/// What every handler shares.
pub struct Shared {
    /// Sends inputs to the engine task.
    pub engine: EngineHandle,
    /// The published snapshot.
    pub publisher: Arc<Publisher>,
    /// The audit history.
    pub history: Arc<History>,
    /// Gateways seen on the watch API.
    pub gateways: Gateways,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Role tokens.
    pub tokens: Tokens,
    /// Wall-clock time.
    pub clock: Arc<dyn Clock>,
    /// The policy in force (replaced when it changes).
    pub config: ArcSwap<Config>,
    /// The controller's own settings (intake and watch limits).
    pub server: Arc<ServerConfig>,
    /// The state store's health.
    pub store: Arc<StoreHealth>,
    /// Wakes the Alertmanager reconciler, when one runs.
    pub reconcile: Option<Arc<Notify>>,
    /// Whether this replica decides: followers refuse writes.
    pub leadership: Arc<Leadership>,
    /// What `grpc.health.v1` answers (`grpc::report_health` keeps it).
    pub(crate) health: tonic_health::server::HealthReporter,
    /// The gRPC watch's sessions, for `grpc::sweep`.
    pub(crate) grpc_sessions: grpc::Sessions,
    /// Connected watchers (long-poll, SSE and gRPC).
    watchers: AtomicUsize,
    /// The bytes of request bodies still arriving.
    bodies: BodyBudget,
}

impl Shared {
    /// Everything handlers need.
    #[expect(
        clippy::too_many_arguments,
        reason = "one constructor wiring every shared part"
    )]
    pub fn new(
        engine: EngineHandle,
        publisher: Arc<Publisher>,
        history: Arc<History>,
        metrics: Arc<Metrics>,
        tokens: Tokens,
        clock: Arc<dyn Clock>,
        config: Arc<Config>,
        server: Arc<ServerConfig>,
        store: Arc<StoreHealth>,
        reconcile: Option<Arc<Notify>>,
        leadership: Arc<Leadership>,
    ) -> Shared {
        Shared {
            engine,
            publisher,
            history,
            gateways: Gateways::new(metrics.clone(), server.watch.max_watchers),
            metrics,
            tokens,
            clock,
            store,
            watchers: AtomicUsize::new(0),
            health: tonic_health::server::HealthReporter::new(),
            grpc_sessions: grpc::Sessions::default(),
            bodies: BodyBudget::new(server.intake.max_partial_body_bytes),
            config: ArcSwap::new(config),
            server,
            reconcile,
            leadership,
        }
    }
}

/// Handler state.
pub type AppState = Arc<Shared>;

/// Every route [`router`] serves, as (method, path). `docs/openapi.yaml` must list
/// exactly these; a test holds the three together.
pub const ROUTES: &[(&str, &str)] = &[
    ("POST", "/v1/alerts/alertmanager"),
    ("POST", "/api/v2/alerts"),
    ("POST", "/v1/reports"),
    ("POST", "/v1/admin/force"),
    ("POST", "/v1/admin/release"),
    ("POST", "/v1/admin/freeze"),
    ("POST", "/v1/admin/thaw"),
    ("POST", "/v1/admin/block"),
    ("POST", "/v1/admin/unblock"),
    ("POST", "/v1/admin/unblock-all"),
    ("POST", "/v1/admin/dry-run"),
    ("POST", "/v1/admin/failback"),
    ("GET", "/v1/routes"),
    ("GET", "/v1/routes/stream"),
    ("GET", "/v1/status"),
    ("GET", "/v1/history"),
    ("GET", "/metrics"),
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/"),
    ("GET", "/ui/{asset}"),
];

/// Builds the router.
pub fn router(state: AppState) -> Router {
    let ingest = Router::new()
        .route("/v1/alerts/alertmanager", post(intake::alertmanager))
        .route("/api/v2/alerts", post(intake::prometheus))
        .route_layer(middleware::from_fn_with_state(state.clone(), leader_only))
        .route_layer(middleware::from_fn_with_state(
            (state.clone(), Role::Ingest),
            require,
        ));
    let report = Router::new()
        .route("/v1/reports", post(intake::reports))
        .route_layer(middleware::from_fn_with_state(state.clone(), leader_only))
        .route_layer(middleware::from_fn_with_state(
            (state.clone(), Role::Report),
            require,
        ));
    let admin = Router::new()
        .route("/v1/admin/force", post(admin::apply::<ForceRequest>))
        .route("/v1/admin/release", post(admin::apply::<ReleaseRequest>))
        .route("/v1/admin/freeze", post(admin::apply::<FreezeRequest>))
        .route("/v1/admin/thaw", post(admin::apply::<ThawRequest>))
        .route("/v1/admin/failback", post(admin::apply::<FailbackRequest>))
        .route("/v1/admin/block", post(admin::block))
        .route("/v1/admin/unblock", post(admin::unblock))
        .route(
            "/v1/admin/unblock-all",
            post(admin::apply::<UnblockAllRequest>),
        )
        .route("/v1/admin/dry-run", post(admin::apply::<DryRunRequest>))
        .route_layer(middleware::from_fn_with_state(state.clone(), leader_only))
        .route_layer(middleware::from_fn_with_state(
            (state.clone(), Role::Admin),
            require,
        ));
    let read = Router::new()
        .route("/v1/routes", get(watch::routes))
        .route("/v1/routes/stream", get(watch::stream))
        .route("/v1/status", get(read::status))
        .route("/v1/history", get(read::history))
        .route_layer(middleware::from_fn_with_state(
            (state.clone(), Role::Read),
            require,
        ));
    let open = Router::new()
        .route("/metrics", get(read::metrics))
        .route("/healthz", get(read::healthz))
        .route("/readyz", get(read::readyz))
        .route("/", get(ui::index))
        .route("/ui/{asset}", get(ui::asset));
    let grpc = if state.server.watch.grpc {
        grpc::router(state.clone())
    } else {
        Router::new()
    };
    Router::new()
        .merge(ingest)
        .merge(report)
        .merge(admin)
        .merge(read)
        .merge(open)
        .fallback(|| async { ApiError::NotFound("no such route; see docs/api.md".into()) })
        .with_state(state)
        .merge(grpc)
}

async fn require(
    State((state, role)): State<(AppState, Role)>,
    request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    state.tokens.check(role, request.headers())?;
    if state.tokens.is_open(role) {
        let changes = matches!(role, Role::Ingest | Role::Report | Role::Admin);
        crate::auth::same_machine(
            request.headers(),
            request.uri().authority().map(|a| a.as_str()),
            changes,
        )?;
    }
    Ok(next.run(request).await)
}

/// What changes state is the leader's to take: a follower answers 503 with
/// `Retry-After`, naming the leader (after authentication, so only callers with a
/// token learn it).
async fn leader_only(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    match state.leadership.role() {
        stanch_ports::leadership::Role::Leader => Ok(next.run(request).await),
        stanch_ports::leadership::Role::Follower { leader } => Err(ApiError::NotLeader { leader }),
    }
}

/// A request body read whole within `intake.*`: its size, its deadline and the
/// budget of bodies still arriving (see `stanch_net::body`).
pub(crate) struct Body(pub Bytes);

impl axum::extract::FromRequest<AppState> for Body {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &AppState) -> Result<Body, ApiError> {
        let intake = &state.server.intake;
        let limits = BodyLimits {
            max_bytes: intake.max_body_bytes,
            timeout: intake.body_timeout.0,
            min_rate: intake.body_min_rate,
        };
        match read_whole(request.into_body(), &limits, Some(&state.bodies)).await {
            Ok(bytes) => Ok(Body(bytes)),
            Err(BodyError::TooLarge(limit)) => Err(ApiError::TooLarge { limit }),
            Err(BodyError::TimedOut(_)) => Err(ApiError::BodyTimeout),
            Err(BodyError::Busy) => Err(ApiError::Busy),
            Err(BodyError::Broken(_)) => Err(ApiError::invalid(
                "body: the connection broke or the body ended before its declared length",
            )),
        }
    }
}

/// A query string parsed into `T`: one that does not parse (an unknown parameter, a
/// value of the wrong type) is a 400 that says which, in the same error shape as a
/// bad body, not axum's plain-text rejection.
pub(crate) struct Params<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for Params<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Params<T>, ApiError> {
        match Query::<T>::from_request_parts(parts, state).await {
            Ok(Query(query)) => Ok(Params(query)),
            Err(e) => Err(ApiError::invalid(format!("query: {}", e.body_text()))),
        }
    }
}

impl From<EngineUnavailable> for ApiError {
    fn from(e: EngineUnavailable) -> ApiError {
        ApiError::Unavailable(e.to_string())
    }
}

/// Counts a connected watcher for as long as it lives, and the watch its gateway
/// holds open.
pub(crate) struct WatcherGuard {
    state: AppState,
    transport: WatchTransport,
    gateway: Option<String>,
}

impl WatcherGuard {
    /// Admits a watcher, or refuses past the configured limit (`watch.max_watchers`).
    pub(crate) fn admit(
        state: &AppState,
        transport: WatchTransport,
        gateway: Option<String>,
    ) -> Result<WatcherGuard, TooManyWatchers> {
        let max = state.server.watch.max_watchers;
        let admitted = state
            .watchers
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .is_ok();
        if !admitted {
            return Err(TooManyWatchers(max));
        }
        state
            .metrics
            .watchers
            .get_or_create(&KindLabel {
                kind: transport.as_str(),
            })
            .inc();
        if let Some(id) = &gateway {
            state.gateways.opened(id, transport);
        }
        Ok(WatcherGuard {
            state: state.clone(),
            transport,
            gateway,
        })
    }
}

impl WatcherGuard {
    /// Names the gateway holding this watch, once it has said who it is (a gRPC
    /// stream's Hello); its watch is counted open from now on.
    pub(crate) fn attach(&mut self, id: &str) {
        if self.gateway.is_none() {
            self.state.gateways.opened(id, self.transport);
            self.gateway = Some(id.to_owned());
        }
    }

    /// The gateway holding this watch, once known.
    pub(crate) fn gateway(&self) -> Option<&str> {
        self.gateway.as_deref()
    }
}

/// `watch.max_watchers` are connected already.
#[derive(Debug, thiserror::Error)]
#[error("{0} watchers already connected; retry later")]
pub(crate) struct TooManyWatchers(usize);

impl From<TooManyWatchers> for ApiError {
    fn from(e: TooManyWatchers) -> ApiError {
        ApiError::Unavailable(e.to_string())
    }
}

impl Drop for WatcherGuard {
    fn drop(&mut self) {
        self.state.watchers.fetch_sub(1, Ordering::AcqRel);
        self.state
            .metrics
            .watchers
            .get_or_create(&KindLabel {
                kind: self.transport.as_str(),
            })
            .dec();
        if let Some(id) = &self.gateway {
            self.state.gateways.closed(id, self.state.clock.now());
        }
    }
}

/// The route table to serve, or `503` while this replica has none from the state (a
/// follower that has not read the leader's yet): better no answer, which a gateway
/// retries while it keeps its own table, than a table no leader made.
fn table(state: &AppState) -> Result<Arc<crate::publish::Snapshot>, ApiError> {
    state.publisher.table().ok_or_else(|| {
        ApiError::Unavailable(
            "no route table yet: this replica has not read the leader's state".into(),
        )
    })
}
