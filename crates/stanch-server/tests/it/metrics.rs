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
        r#"stanch_model_pool_share{model="qwen-72b",pool="dc-a"} 0"#,
        r#"stanch_model_pool_share{model="qwen-72b",pool="dc-b"} 100"#,
        r#"stanch_model_pool_share{model="qwen-14b",pool="dc-a"} 100"#,
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

/// A slow pool's alert asks for a share: the route, the history and the metrics say
/// where the model's traffic goes, pool by pool.
#[tokio::test]
async fn a_partial_failover_is_published_with_its_shares() {
    let h = Harness::start().await;
    let labels = [
        ("alertname", "PoolLatencyHigh"),
        ("action", "trigger-failover"),
        ("target_model", "qwen-72b"),
        ("pool", "dc-a"),
        ("shift", "75%"),
    ];
    let r = h
        .webhook(webhook_body("firing", &labels, "2026-11-30T00:06:00Z"))
        .await;
    assert_eq!(r.status(), 200);
    let route = &h.routes().await["models"]["qwen-72b"];
    assert_eq!(route["rung"], "failover");
    assert_eq!(route["pool"], "dc-b", "the largest share");
    assert_eq!(
        route["shares"],
        serde_json::json!([{"pool": "dc-a", "percent": 25}, {"pool": "dc-b", "percent": 75}])
    );
    assert_eq!(route["reason"], "pool dc-a slow: 75% of its traffic moves");
    let status = &h.json("/v1/status").await["models"]["qwen-72b"];
    assert_eq!(status["shares"], route["shares"], "status says it too");
    assert!(
        h.routes().await["models"]["qwen-14b"]
            .get("shares")
            .is_none(),
        "no split, no field"
    );
    let text = h.get("/metrics", None).await.text().await.unwrap();
    for expected in [
        r#"stanch_model_pool_share{model="qwen-72b",pool="dc-a"} 25"#,
        r#"stanch_model_pool_share{model="qwen-72b",pool="dc-b"} 75"#,
    ] {
        assert!(text.contains(expected), "missing {expected:?} in\n{text}");
    }

    // Now dc-a fails outright: its quarter leaves at once.
    let labels = [
        ("alertname", "PoolErrors"),
        ("action", "trigger-failover"),
        ("target_model", "qwen-72b"),
        ("pool", "dc-a"),
    ];
    h.webhook(webhook_body("firing", &labels, "2026-11-30T00:06:30Z"))
        .await;
    let route = &h.routes().await["models"]["qwen-72b"];
    assert_eq!(route["pool"], "dc-b");
    assert!(route.get("shares").is_none(), "{route}");
    let history: Vec<serde_json::Value> =
        h.get("/v1/history", Some(READ)).await.json().await.unwrap();
    let moved = history
        .iter()
        .find(|e| e["kind"] == "shares_changed")
        .expect("the share move is in the history");
    assert_eq!(
        moved["summary"],
        "qwen-72b: shares dc-a 25% dc-b 75% -> dc-b 100%: pool dc-a failing"
    );
}

#[tokio::test]
async fn unknown_routes_are_404_json() {
    let h = Harness::start().await;
    let r = h.get("/v1/nope", None).await;
    assert_eq!(r.status(), 404);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"], "not_found");
}
