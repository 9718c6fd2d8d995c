//! The Prometheus exposition.

use crate::support::*;

#[tokio::test]
async fn metrics_follow_decisions() {
    let h = Harness::start().await;
    h.webhook(fixture("alertmanager-v4-firing-failover.json"))
        .await;
    let r = h.get("/metrics", None).await;
    assert_eq!(r.status(), 200);
    assert!(
        r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("application/openmetrics-text")
    );
    let text = r.text().await.unwrap();
    for expected in [
        r#"stanch_model_rung{model="qwen-72b"} 1"#,
        r#"stanch_model_rung{model="qwen-14b"} 0"#,
        r#"stanch_transitions_total{model="qwen-72b",direction="up"} 1"#,
        r#"stanch_alerts_received_total{source="alertmanager"} 1"#,
        "stanch_alerts_active 1",
        "stanch_route_version ",
        "stanch_publish_latency_seconds_count",
        "stanch_dry_run 0",
        "# EOF",
    ] {
        assert!(text.contains(expected), "missing {expected:?} in\n{text}");
    }
    assert_eq!(h.get("/healthz", None).await.status(), 200);
    assert_eq!(h.get("/readyz", None).await.status(), 200);
}

#[tokio::test]
async fn unknown_routes_are_404_json() {
    let h = Harness::start().await;
    let r = h.get("/v1/nope", None).await;
    assert_eq!(r.status(), 404);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"], "not_found");
}
