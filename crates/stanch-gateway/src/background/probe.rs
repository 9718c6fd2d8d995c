//! Probing the endpoints that get no traffic: locally blocked ones, whose block probes
//! may lift early, and those of pools the route table has failed away from, whose
//! probes are the rules' only evidence that the pool is back.

use std::sync::Arc;
use std::time::Duration;

use axum::http::header;
use bytes::Bytes;
use http_body_util::BodyExt;
use stanch_api::{RouteTable, Rung};
use tokio::time::Instant;

use crate::Gateway;
use crate::endpoints::Endpoint;
use crate::metrics::{Label, ProbeLabels};

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
            .filter_map(|e| idle(e, table.as_deref().map(|a| &**a), now, wall).map(|why| (e, why)));
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
                        model: Label::from(&e.model),
                        pool: Label::from(&e.pool),
                        endpoint: Label::from(&e.url),
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
