//! stanch-gateway: the reference data plane. An OpenAI-compatible proxy that applies
//! stanch's route table per request and heals per request on its own.
//!
//! Owns: serving `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`,
//! `/v1/models`; applying the table (rungs, VIP exemption, blocks, leases); choosing
//! endpoints; classifying outcomes; passive blocking; retries within a budget; pool,
//! model and FAQ fallbacks; streaming pass-through. Does not own: decisions across the
//! fleet (the controller's) or capacity limits.

pub mod budget;
pub mod config;
pub mod endpoints;
pub mod faq;
mod h1;
mod headers;
mod json;
pub mod metrics;
pub mod outcome;
mod per_worker;
mod proxy;
mod sse;
mod upstream;
mod window;

use std::collections::BTreeMap;
use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use bytes::Bytes;
use http_body_util::BodyExt;
use secrecy::SecretString;
use stanch_api::{RouteTable, Rung};
use stanch_net::clock::Clock;
use tokio::net::TcpListener;
use tokio::time::Instant;

use crate::budget::RetryBudget;
use crate::config::{GatewayConfig, is_glob, secret};
use crate::endpoints::{Endpoint, glob};
use crate::faq::Faq;
use crate::metrics::{
    AttemptLabels, EndpointLabels, Metrics, ModelLabel, ProbeLabels, RequestLabels,
    WorkerHistogram, WorkerLabel,
};

/// A configured model, ready to serve.
pub(crate) struct ModelPlan {
    pub pools: Vec<(String, Vec<Arc<Endpoint>>)>,
}

/// A caller.
pub(crate) struct Tenant {
    pub key: SecretString,
    pub name: String,
    pub vip: bool,
}

/// The gateway, shared by every request.
pub struct Gateway {
    pub(crate) config: GatewayConfig,
    pub(crate) models: BTreeMap<String, ModelPlan>,
    pub(crate) globs: Vec<String>,
    pub(crate) tenants: Vec<Tenant>,
    pub(crate) faqs: BTreeMap<String, Faq>,
    pub(crate) budget: RetryBudget,
    pub(crate) routes: Option<stanch_client::Routes>,
    pub(crate) metrics: Metrics,
    /// How connections are made: the endpoints' pools and the controller's.
    pub(crate) connector: upstream::Connector,
    /// Per-model latency and time-to-first-token histograms, resolved once.
    pub(crate) model_histograms:
        std::collections::HashMap<String, (WorkerHistogram, WorkerHistogram)>,
    pub(crate) clock: Arc<dyn Clock>,
    /// How a caller's request body must arrive.
    pub(crate) body_limits: stanch_net::body::BodyLimits,
    /// The bytes of request bodies still arriving, held together.
    pub(crate) body_budget: stanch_net::body::BodyBudget,
    /// The worker threads' connection counts, when it serves on workers.
    workers: std::sync::OnceLock<stanch_net::Load>,
    /// How many log lines the process's log writer dropped, when it has one.
    log_drops: std::sync::OnceLock<stanch_log::Dropped>,
}

/// Every configured endpoint, model by model and pool by pool.
fn endpoints_of(models: &BTreeMap<String, ModelPlan>) -> impl Iterator<Item = &Arc<Endpoint>> {
    models
        .values()
        .flat_map(|m| m.pools.iter().flat_map(|(_, eps)| eps.iter()))
}

/// Why the gateway could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A secret named in the configuration could not be read.
    #[error("{what}: {why}")]
    Secret {
        /// Which setting.
        what: String,
        /// Why.
        why: String,
    },
    /// An endpoint's URL or the upstream TLS settings cannot be used.
    #[error("{what}: {why}")]
    Upstream {
        /// Which setting.
        what: String,
        /// Why.
        why: String,
    },
}

impl Gateway {
    /// Builds the gateway; `routes` follows a controller when there is one.
    pub fn new(
        config: GatewayConfig,
        routes: Option<stanch_client::Routes>,
        clock: Arc<dyn Clock>,
    ) -> Result<Gateway, StartError> {
        let connector = upstream::Connector {
            tls: upstream::tls_connector(config.tls.ca_file.as_deref().map(Path::new)).map_err(
                |why| StartError::Upstream {
                    what: "tls.ca_file".into(),
                    why,
                },
            )?,
            connect_timeout: config.timeouts.connect.0,
            idle_timeout: config.timeouts.idle_connection.0,
        };
        let mut models = BTreeMap::new();
        for (name, m) in &config.models {
            let mut pools = Vec::new();
            for pool in &m.pools {
                let alone = pool.endpoints.len() == 1;
                let mut eps = Vec::new();
                for (j, e) in pool.endpoints.iter().enumerate() {
                    let what = || format!("models.{name}.pools.{}.endpoints[{j}]", pool.name);
                    let key = secret(e.api_key_env.as_ref(), e.api_key_file.as_ref(), None)
                        .map_err(|why| StartError::Secret { what: what(), why })?;
                    let upstream = e
                        .upstream_model
                        .clone()
                        .or_else(|| (!is_glob(name)).then(|| name.clone()));
                    let endpoint = Endpoint::new(
                        &e.url, name, &pool.name, e.weight, e.capacity, upstream, key, alone,
                        &connector,
                    )
                    .map_err(|why| StartError::Upstream { what: what(), why })?;
                    eps.push(Arc::new(endpoint));
                }
                pools.push((pool.name.clone(), eps));
            }
            models.insert(name.clone(), ModelPlan { pools });
        }
        let mut tenants = Vec::new();
        for (i, t) in config.tenants.iter().enumerate() {
            let key = secret(t.key_env.as_ref(), t.key_file.as_ref(), t.key.as_ref())
                .map_err(|why| StartError::Secret {
                    what: format!("tenants[{i}]"),
                    why,
                })?
                .ok_or_else(|| StartError::Secret {
                    what: format!("tenants[{i}]"),
                    why: "no key".into(),
                })?;
            tenants.push(Tenant {
                key,
                name: t.name.clone(),
                vip: t.vip,
            });
        }
        let faqs = config
            .faq_sets
            .iter()
            .map(|(name, set)| (name.clone(), Faq::new(set)))
            .collect();
        let r = &config.retry;
        let budget = RetryBudget::new(r.budget_ratio, r.budget_min_retries, r.budget_window.0);
        let globs = config
            .models
            .keys()
            .filter(|k| is_glob(k))
            .cloned()
            .collect();
        let metrics = Metrics::new();
        for e in endpoints_of(&models) {
            let requests_ok = metrics
                .requests
                .get_or_create(&RequestLabels {
                    model: e.model.clone(),
                    served_model: e.model.clone(),
                    pool: e.pool.clone(),
                    endpoint: e.url.clone(),
                    status_class: "2xx",
                    outcome: "success",
                })
                .clone();
            let attempts_ok = metrics
                .attempts
                .get_or_create(&AttemptLabels {
                    model: e.model.clone(),
                    pool: e.pool.clone(),
                    endpoint: e.url.clone(),
                    outcome: "success",
                })
                .clone();
            // Every outcome's series exists from the start, at zero.
            for outcome in outcome::LABELS {
                let _ = metrics.attempts.get_or_create(&AttemptLabels {
                    model: e.model.clone(),
                    pool: e.pool.clone(),
                    endpoint: e.url.clone(),
                    outcome,
                });
            }
            for outcome in ["success", "failure"] {
                let _ = metrics.probes.get_or_create(&ProbeLabels {
                    model: e.model.clone(),
                    pool: e.pool.clone(),
                    endpoint: e.url.clone(),
                    outcome,
                });
            }
            e.conns.count_opened_in(
                metrics
                    .connections_opened
                    .get_or_create(&EndpointLabels {
                        endpoint: e.url.clone(),
                        model: e.model.clone(),
                        pool: e.pool.clone(),
                    })
                    .clone(),
            );
            let _ = e.hot.set(endpoints::HotCounters {
                requests_ok,
                attempts_ok,
            });
        }
        let model_histograms = config
            .models
            .keys()
            .map(|m| {
                let label = ModelLabel { model: m.clone() };
                let latency = metrics.latency.get_or_create(&label).clone();
                let ttft = metrics.ttft.get_or_create(&label).clone();
                (m.clone(), (latency, ttft))
            })
            .collect();
        Ok(Gateway {
            models,
            globs,
            tenants,
            faqs,
            budget,
            routes,
            metrics,
            connector,
            model_histograms,
            clock,
            body_limits: stanch_net::body::BodyLimits {
                max_bytes: config.max_body_bytes,
                timeout: config.timeouts.body.0,
                min_rate: config.body_min_rate,
            },
            body_budget: stanch_net::body::BodyBudget::new(config.max_partial_body_bytes),
            config,
            workers: std::sync::OnceLock::new(),
            log_drops: std::sync::OnceLock::new(),
        })
    }

    /// Reports the log writer's dropped lines as `stanch_gateway_log_lines_dropped_total`.
    pub fn count_log_drops(&self, dropped: stanch_log::Dropped) {
        let _ = self.log_drops.set(dropped);
    }

    /// Every configured endpoint.
    pub(crate) fn endpoints(&self) -> impl Iterator<Item = &Arc<Endpoint>> {
        endpoints_of(&self.models)
    }

    /// Whether active probing of blocked endpoints is on.
    pub fn config_probing(&self) -> bool {
        self.config.blocking.probe.enabled
    }

    /// The configured model serving a requested name: exact, else the first glob.
    pub(crate) fn resolve(&self, requested: &str) -> Option<&str> {
        if let Some((k, _)) = self.models.get_key_value(requested) {
            if !is_glob(k) {
                return Some(k);
            }
        }
        self.globs
            .iter()
            .find(|g| glob(g, requested))
            .map(String::as_str)
    }

    /// The applied route table, if any.
    pub(crate) fn table(&self) -> Option<Arc<RouteTable>> {
        self.routes
            .as_ref()
            .and_then(stanch_client::Routes::current)
    }

    /// Checks that a route table can be applied here (the controller hears why not).
    pub fn validator(config: &GatewayConfig) -> stanch_client::Validator {
        let faqs: Vec<String> = config.faq_sets.keys().cloned().collect();
        Arc::new(move |t: &RouteTable| {
            for (name, m) in &t.models {
                if let Some(faq) = &m.faq {
                    if !faqs.contains(faq) {
                        return Err(format!("models.{name}.faq: unknown FAQ set {faq:?}"));
                    }
                }
            }
            Ok(())
        })
    }
}

/// The route table a gateway has applied, if any (for status pages and tests).
pub fn applied_table(gateway: &Gateway) -> Option<Arc<RouteTable>> {
    gateway.table()
}

/// The gateway's routes besides the proxied ones (which `Front` serves).
fn router(gateway: Arc<Gateway>) -> Router {
    Router::new()
        .route("/v1/models", get(models))
        .route("/v1/status", get(status))
        .route("/status", get(status_text))
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .with_state(gateway)
}

async fn models(State(gw): State<Arc<Gateway>>) -> Response {
    let data: Vec<_> = gw
        .models
        .keys()
        .filter(|k| !is_glob(k))
        .map(|k| serde_json::json!({"id": k, "object": "model", "created": 0, "owned_by": "stanch-gateway"}))
        .collect();
    let mut response =
        axum::Json(serde_json::json!({"object": "list", "data": data})).into_response();
    proxy::with_route_version(&gw, &mut response);
    response
}

fn status_value(gw: &Gateway) -> serde_json::Value {
    let now = Instant::now();
    let wall = gw.clock.now();
    let table = gw.table();
    let slow_start = gw.config.blocking.slow_start.0;
    let endpoints: Vec<_> = gw
        .endpoints()
        .map(|e| {
            let mut s = serde_json::to_value(e.status(now, slow_start)).unwrap_or_default();
            if let Some(until) = table.as_ref().and_then(|t| proxy::table_block(t, e, wall)) {
                s["table_blocked_until"] = serde_json::json!(until);
            }
            s
        })
        .collect();
    serde_json::json!({
        "route_version": table.as_ref().map(|t| t.version),
        "route_epoch": table.as_ref().map(|t| t.epoch.clone()),
        "route_age_seconds": table.as_ref().map(|t| wall.since(t.generated_at).as_secs()),
        "models": table.as_ref().map(|t| t.models.iter().map(|(k, m)| (k.clone(), serde_json::json!({
            "rung": m.rung, "pool": m.pool, "alias": m.alias, "lease_expired": m.lease_until <= wall,
        }))).collect::<serde_json::Map<_, _>>()),
        "endpoints": endpoints,
    })
}

async fn status(State(gw): State<Arc<Gateway>>) -> axum::Json<serde_json::Value> {
    axum::Json(status_value(&gw))
}

/// The status as a plain table, for a human with curl.
async fn status_text(State(gw): State<Arc<Gateway>>) -> String {
    let s = status_value(&gw);
    let mut out = format!(
        "route version {} (age {}s)\n\n{:<32} {:<10} {:<6} {:<10} {:>6} {:>6} {:>9}\n",
        s["route_version"],
        s["route_age_seconds"],
        "ENDPOINT",
        "MODEL",
        "POOL",
        "STATE",
        "OK",
        "FAIL",
        "ms/token"
    );
    for e in s["endpoints"].as_array().into_iter().flatten() {
        out.push_str(&format!(
            "{:<32} {:<10} {:<6} {:<10} {:>6} {:>6} {:>9.1}\n",
            e["url"].as_str().unwrap_or(""),
            e["model"].as_str().unwrap_or(""),
            e["pool"].as_str().unwrap_or(""),
            if e["table_blocked_until"].is_null() {
                e["state"].as_str().unwrap_or("")
            } else {
                "blocked*"
            },
            e["successes"],
            e["failures"],
            e["ms_per_token"].as_f64().unwrap_or(0.0),
        ));
    }
    out
}

async fn metrics(State(gw): State<Arc<Gateway>>) -> Response {
    if let Some(dropped) = gw.log_drops.get() {
        // Catch the counter up with the writer's; a concurrent scrape may have.
        let counter = &gw.metrics.log_lines_dropped;
        let behind = dropped.get().saturating_sub(counter.get());
        if behind > 0 {
            counter.inc_by(behind);
        }
    }
    let now = Instant::now();
    let wall = gw.clock.now();
    let table = gw.table();
    if let Some(t) = &table {
        gw.metrics
            .route_version
            .set(i64::try_from(t.version).unwrap_or(i64::MAX));
        gw.metrics
            .route_age_seconds
            .set(i64::try_from(wall.since(t.generated_at).as_secs()).unwrap_or(i64::MAX));
    }
    for e in gw.endpoints() {
        let labels = EndpointLabels {
            endpoint: e.url.clone(),
            model: e.model.clone(),
            pool: e.pool.clone(),
        };
        let locally = e.blocked(now).is_some();
        let by_table = table
            .as_ref()
            .is_some_and(|t| proxy::table_block(t, e, wall).is_some());
        gw.metrics
            .endpoint_blocked
            .get_or_create(&labels)
            .set(i64::from(locally || by_table));
        gw.metrics
            .endpoint_blocked_locally
            .get_or_create(&labels)
            .set(i64::from(locally));
        gw.metrics
            .connections_idle
            .get_or_create(&labels)
            .set(i64::try_from(e.conns.idle_count()).unwrap_or(i64::MAX));
    }
    if let Some(load) = gw.workers.get() {
        for (worker, connections) in (0u32..).zip(load.connections()) {
            gw.metrics
                .worker_connections
                .get_or_create(&WorkerLabel { worker })
                .set(i64::try_from(connections).unwrap_or(i64::MAX));
        }
    }
    let mut r = gw.metrics.encode().into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        "application/openmetrics-text; version=1.0.0; charset=utf-8"
            .parse()
            .expect("static header"),
    );
    r
}

/// How the gateway's listener treats connections: a caller brings each request's
/// headers within `timeouts.caller_idle` (which also closes kept-alive connections
/// idle that long), a caller that takes no bytes for 30 s is cut off, and at shutdown
/// streams in flight get 30 s to finish (Kubernetes' default grace period) before
/// they are closed.
fn limits(gateway: &Gateway) -> stanch_net::ConnLimits {
    stanch_net::ConnLimits {
        write_timeout: Duration::from_secs(30),
        header_timeout: gateway.config.timeouts.caller_idle.0,
        drain: Duration::from_secs(30),
    }
}

/// Serves the gateway on `listener` until `shutdown`, then drains in-flight requests.
/// Connections are served on the runtime this runs on.
pub async fn serve(
    listener: TcpListener,
    gateway: Arc<Gateway>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let limits = limits(&gateway);
    let _sweeping = Sweeper::start(&gateway);
    stanch_net::serve(listener, Front::new(gateway), None, limits, shutdown).await;
    Ok(())
}

/// As [`serve`], with every connection served whole by one of `workers`' threads:
/// how the gateway uses several cores.
pub async fn serve_on(
    workers: &stanch_net::Workers,
    listener: TcpListener,
    gateway: Arc<Gateway>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    // Their connection counts show in the metrics.
    let _ = gateway.workers.set(workers.load());
    let limits = limits(&gateway);
    let _sweeping = Sweeper::start(&gateway);
    stanch_net::serve_on(
        workers,
        listener,
        Front::new(gateway),
        None,
        limits,
        shutdown,
    )
    .await;
    Ok(())
}

/// Every second, closes the idle upstream connections that their upstream has closed
/// or that have aged out: nothing else reads an idle connection, so without this one
/// the upstream closed would stay half-open until its endpoint's next request. It runs
/// while the gateway serves, and stops when serving ends, however it ends.
struct Sweeper(tokio::task::JoinHandle<()>);

impl Sweeper {
    fn start(gateway: &Arc<Gateway>) -> Sweeper {
        let gateway = gateway.clone();
        Sweeper(tokio::spawn(async move {
            let mut ticker = tokio::time::interval(Duration::from_secs(1));
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticker.tick().await;
                for endpoint in gateway.endpoints() {
                    endpoint.conns.sweep();
                }
            }
        }))
    }
}

impl Drop for Sweeper {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The gateway's service. The three proxied routes are nearly every request, and are
/// served here directly (other methods on them get 405); the rest go through the
/// router. This saves the router's matching, extraction, body boxing and layers on
/// every proxied request.
#[derive(Clone)]
struct Front {
    gateway: Arc<Gateway>,
    rest: Router,
}

impl Front {
    fn new(gateway: Arc<Gateway>) -> Front {
        Front {
            rest: router(gateway.clone()),
            gateway,
        }
    }
}

impl hyper::service::Service<hyper::Request<hyper::body::Incoming>> for Front {
    type Response = Response;
    type Error = std::convert::Infallible;
    type Future = futures_util::future::Either<
        std::pin::Pin<Box<dyn Future<Output = Result<Response, Self::Error>> + Send>>,
        <Router as tower::Service<hyper::Request<hyper::body::Incoming>>>::Future,
    >;

    fn call(&self, request: hyper::Request<hyper::body::Incoming>) -> Self::Future {
        use futures_util::FutureExt;
        use futures_util::future::Either;
        match proxy::Api::of_path(request.uri().path()) {
            Some(api) => {
                let handled = proxy::handle(self.gateway.clone(), api, request);
                Either::Left(Box::pin(handled.map(Ok)))
            }
            // The router is always ready (it says so of itself), so it is called
            // without asking.
            None => Either::Right(tower::Service::call(&mut self.rest.clone(), request)),
        }
    }
}

/// Reports per-endpoint outcome counts to the controller every `interval`, so that the
/// controller can block what this replica discovers for the whole fleet.
pub async fn report_loop(
    gateway: Arc<Gateway>,
    url: String,
    token: Option<SecretString>,
    gateway_id: String,
    interval: Duration,
) {
    use stanch_api::reports::{EndpointReport, ReportBatch};
    let controller = upstream::Pool::new(&url, gateway.connector.clone()).and_then(|pool| {
        let path = pool.path("/v1/reports")?;
        let authorization = token.as_ref().map(upstream::bearer).transpose()?;
        Ok((pool, path, authorization))
    });
    let (http, path, authorization) = match controller {
        Ok(c) => c,
        Err(why) => {
            tracing::error!(%url, %why, "cannot report outcomes to this controller");
            return;
        }
    };
    let endpoints: Vec<Arc<Endpoint>> = gateway.endpoints().cloned().collect();
    let mut last: Vec<(u64, u64)> = endpoints
        .iter()
        .map(|e| (e.counts().0, e.counts().1))
        .collect();
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let mut reports = Vec::new();
        for (i, e) in endpoints.iter().enumerate() {
            let (ok, failed, streak) = e.report_counts();
            let (ok0, failed0) = last[i];
            last[i] = (ok, failed);
            if ok > ok0 || failed > failed0 || streak > 0 {
                reports.push(EndpointReport {
                    endpoint: e.url.clone(),
                    model: e.model.clone(),
                    successes: ok - ok0,
                    failures: failed - failed0,
                    consecutive_failures: streak,
                });
            }
        }
        if reports.is_empty() {
            continue;
        }
        let batch = ReportBatch {
            gateway: gateway_id.clone(),
            endpoints: reports,
        };
        let body = serde_json::to_vec(&batch).expect("reports serialize");
        let mut request = hyper::Request::post(path.clone())
            .header(header::HOST, http.host().clone())
            .header(header::CONTENT_TYPE, "application/json");
        if let Some(a) = &authorization {
            request = request.header(header::AUTHORIZATION, a.clone());
        }
        let Ok(request) = request.body(Bytes::from(body)) else {
            continue;
        };
        let sent = async {
            let response = http.send(request).await?;
            let status = response.status();
            // Read to the end, so the connection is kept for the next report.
            let _ = response.into_body().collect().await;
            Ok::<_, upstream::SendError>(status)
        };
        match tokio::time::timeout(Duration::from_secs(5), sent).await {
            Ok(Ok(status)) if status.is_success() => {}
            Ok(Ok(status)) => {
                tracing::warn!(%status, "the controller refused an outcome report")
            }
            Ok(Err(e)) => tracing::warn!(error = %e, "cannot send an outcome report"),
            Err(_) => tracing::warn!("outcome report timed out"),
        }
    }
}

/// Why an endpoint gets no traffic and is probed instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Idle {
    /// This gateway's passive blocking holds it: probes may lift the block early.
    Blocked,
    /// The route table serves its model from another pool (failover) or from the FAQ
    /// (static): probes are the rules' only evidence of whether the pool is back.
    FailedAway,
}

/// Whether `e` is idle, and why.
pub(crate) fn idle(
    e: &Endpoint,
    table: Option<&RouteTable>,
    now: Instant,
    wall: stanch_api::Timestamp,
) -> Option<Idle> {
    if e.blocked(now).is_some() {
        return Some(Idle::Blocked);
    }
    let entry = table?
        .models
        .get(&e.model)
        .filter(|entry| entry.lease_until > wall)?;
    match entry.rung {
        Rung::Failover if entry.pool != e.pool => Some(Idle::FailedAway),
        Rung::Static => Some(Idle::FailedAway),
        _ => None,
    }
}

/// Probes the endpoints that get no traffic — locally blocked ones, and those of pools
/// the route table has failed away from — with a one-token completion every
/// `blocking.probe.interval` (marked `X-Stanch-Probe`). Outcomes are counted in
/// `stanch_gateway_probes_total`, so the rules still see whether a failed-away pool
/// is healthy; `blocking.probe.successes` in a row lift a local block early.
pub async fn probe_loop(gateway: Arc<Gateway>) {
    let policy = gateway.config.blocking.probe.clone();
    let mut ticker = tokio::time::interval(policy.interval.0);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let table = gateway.table();
        let (now, wall) = (Instant::now(), gateway.clock.now());
        let due = gateway
            .endpoints()
            .filter_map(|e| idle(e, table.as_deref(), now, wall).map(|why| (e, why)));
        // Concurrently: one slow endpoint does not delay the others' evidence.
        let probes = due.map(|(e, why)| {
            let gateway = &gateway;
            let policy = &policy;
            async move {
                let ok = probe(e, policy.timeout.0).await;
                gateway
                    .metrics
                    .probes
                    .get_or_create(&ProbeLabels {
                        model: e.model.clone(),
                        pool: e.pool.clone(),
                        endpoint: e.url.clone(),
                        outcome: if ok { "success" } else { "failure" },
                    })
                    .inc();
                if why == Idle::Blocked && e.probe_result(ok, policy.successes, Instant::now())
                {
                    tracing::info!(endpoint = %e.url, model = %e.model, "block lifted early: probes succeeded");
                }
            }
        });
        futures_util::future::join_all(probes).await;
    }
}

/// One probe: a one-token chat completion; true when the endpoint answered 2xx in time.
async fn probe(e: &Endpoint, timeout: Duration) -> bool {
    let model = e.upstream_model.as_ref().unwrap_or(&e.model);
    let body = serde_json::json!({"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "ping"}]});
    let mut request = e.post(0, Bytes::from(body.to_string()));
    request.headers_mut().insert(
        stanch_api::headers::PROBE,
        header::HeaderValue::from_static("1"),
    );
    let answered = async {
        let response = e.conns.send(request).await.ok()?;
        let ok = response.status().is_success();
        // Read the answer so the connection goes back to the pool.
        response.into_body().collect().await.ok()?;
        Some(ok)
    };
    matches!(
        tokio::time::timeout(timeout, answered).await,
        Ok(Some(true))
    )
}

/// A gateway-made error in OpenAI's shape.
pub(crate) fn openai_error(status: StatusCode, kind: &str, code: &str, message: &str) -> Response {
    let body = serde_json::json!({"error": {"message": message, "type": kind, "param": null, "code": code}});
    (status, axum::Json(body)).into_response()
}
