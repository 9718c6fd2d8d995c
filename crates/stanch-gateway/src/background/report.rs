//! Reporting per-endpoint outcomes to the controller, which blocks for the whole
//! fleet what each gateway sees.

use std::sync::Arc;
use std::time::Duration;

use axum::http::header;
use bytes::Bytes;
use http_body_util::BodyExt;
use secrecy::SecretString;

use crate::Gateway;
use crate::endpoints::Endpoint;
use crate::upstream;

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
            tracing::error!(%url, error = %why, source = %stanch_log::Sources(&why), "cannot report outcomes to this controller");
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
