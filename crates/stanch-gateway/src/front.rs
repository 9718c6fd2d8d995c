//! The gateway's HTTP front: the three proxied APIs go straight to [`crate::admit`]
//! (nearly every request is one of them), the rest through a router: `/v1/models`,
//! `/healthz`, and, unless they are served on a listener of their own
//! ([`status_router`]), `/v1/status` and `/status`, `/metrics`.

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use tokio::time::Instant;

use crate::Gateway;
use crate::config::is_glob;
use crate::metrics::{EndpointLabels, Label, WorkerLabel};
use crate::request::Api;

/// The gateway's service. The three proxied routes are nearly every request, and are
/// served here directly (other methods on them get 405); the rest go through the
/// router. This saves the router's matching, extraction, body boxing and layers on
/// every proxied request.
#[derive(Clone)]
pub(crate) struct Front {
    gateway: Arc<Gateway>,
    rest: Router,
}

impl Front {
    /// The front for callers; with `status`, it also answers `/v1/status`, `/status`
    /// and `/metrics`.
    pub(crate) fn new(gateway: Arc<Gateway>, status: bool) -> Front {
        let rest = Router::new()
            .route("/v1/models", get(models))
            .route("/healthz", get(|| async { "ok\n" }));
        let rest = if status {
            rest.merge(status_routes())
        } else {
            rest
        };
        Front {
            rest: rest.with_state(gateway.clone()),
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
        match Api::of_path(request.uri().path()) {
            Some(api) => {
                let handled = crate::admit::handle(self.gateway.clone(), api, request);
                Either::Left(Box::pin(handled.map(Ok)))
            }
            // The router is always ready (it says so of itself), so it is called
            // without asking.
            None => Either::Right(tower::Service::call(&mut self.rest.clone(), request)),
        }
    }
}

/// What the gateway shows of itself: its status (with its upstreams' URLs) and its
/// metrics.
fn status_routes() -> Router<Arc<Gateway>> {
    Router::new()
        .route("/v1/status", get(status))
        .route("/status", get(status_text))
        .route("/metrics", get(metrics))
}

/// The status listener's routes: the status, the metrics and `/healthz`.
pub(crate) fn status_router(gateway: Arc<Gateway>) -> Router {
    status_routes()
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
    crate::respond::with_route_version(&gw, &mut response);
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
            if let Some(until) = table.as_ref().and_then(|t| e.blocked_by(t, wall)) {
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
            endpoint: Label::from(&e.url),
            model: Label::from(&e.model),
            pool: Label::from(&e.pool),
        };
        let locally = e.blocked(now).is_some();
        let by_table = table
            .as_ref()
            .is_some_and(|t| e.blocked_by(t, wall).is_some());
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
