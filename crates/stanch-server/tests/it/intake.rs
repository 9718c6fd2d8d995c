//! Alert intake: the real captured payloads, and everything a sender can get wrong.

use std::time::Duration;

use serde_json::Value;
use stanch_testkit::wait::until;

use crate::support::*;

#[tokio::test]
async fn alertmanager_fixtures_drive_the_ladder() {
    let h = Harness::start().await;
    let v0 = h.routes().await["version"].as_u64().unwrap();

    let r = h
        .webhook(fixture("alertmanager-v4-firing-failover.json"))
        .await;
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["accepted"], 1);
    let v1 = body["version"].as_u64().unwrap();
    assert!(v1 > v0);
    // The answer came after the version was published: it is visible at once.
    let routes = h.routes().await;
    assert_eq!(routes["version"], v1);
    assert_eq!(routes["models"]["qwen-72b"]["rung"], "failover");
    assert_eq!(routes["models"]["qwen-72b"]["pool"], "dc-b");
    assert_eq!(
        routes["models"]["qwen-72b"]["alerts"][0],
        "7e517a555438361b"
    );

    h.webhook(fixture("alertmanager-v4-firing-degradation.json"))
        .await;
    let routes = h.routes().await;
    assert_eq!(routes["models"]["qwen-72b"]["rung"], "degraded");
    assert_eq!(routes["models"]["qwen-72b"]["alias"], "qwen-14b");
    assert_eq!(routes["models"]["qwen-72b"]["alias_exempt"][0], "vip");

    let r = h
        .webhook(fixture("alertmanager-v4-resolved-failover.json"))
        .await;
    assert_eq!(r.status(), 200);
    let status = h.json("/v1/status").await;
    assert_eq!(
        status["alerts"]["active"], 1,
        "only the degradation alert is left"
    );
    // De-escalation waits for the stabilization window; the rung holds.
    assert_eq!(h.routes().await["models"]["qwen-72b"]["rung"], "degraded");
}

#[tokio::test]
async fn duplicate_deliveries_change_nothing() {
    let h = Harness::start().await;
    let first: Value = h
        .webhook(fixture("alertmanager-v4-firing-failover.json"))
        .await
        .json()
        .await
        .unwrap();
    let again: Value = h
        .webhook(fixture("alertmanager-v4-firing-failover.json"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(first["version"], again["version"]);
    // A late firing after the resolution is recognised and ignored.
    h.webhook(fixture("alertmanager-v4-resolved-failover.json"))
        .await;
    h.webhook(fixture("alertmanager-v4-firing-failover.json"))
        .await;
    assert_eq!(h.json("/v1/status").await["alerts"]["active"], 0);
}

#[tokio::test]
async fn prometheus_push_fixtures_and_expiry() {
    let h = Harness::start().await;
    let r = h
        .post(
            "/api/v2/alerts",
            Some(INGEST),
            fixture("prometheus-v2-firing-failover.json"),
        )
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(h.routes().await["models"]["qwen-72b"]["rung"], "failover");
    assert_eq!(h.json("/v1/status").await["alerts"]["active"], 1);
    // Its endsAt (00:07:02) passes without a refresh: the alert expires on its own.
    h.clock.advance(Duration::from_secs(3));
    until("no alert active", Duration::from_secs(5), || async {
        h.json("/v1/status").await["alerts"]["active"] == 0
    })
    .await;
    // A resolved push for an alert no longer active changes nothing.
    let r = h
        .post(
            "/api/v2/alerts",
            Some(INGEST),
            fixture("prometheus-v2-resolved-failover.json"),
        )
        .await;
    assert_eq!(r.status(), 200);
}

#[tokio::test]
async fn malformed_payloads_get_400_naming_the_field() {
    let h = Harness::start().await;
    let r = h.webhook("{not json").await;
    assert_eq!(r.status(), 400);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"], "invalid_payload");
    assert!(
        e["detail"]
            .as_str()
            .unwrap()
            .starts_with("body is not valid JSON"),
        "{e}"
    );

    let r = h.webhook(r#"{"version":"4","alerts":{}}"#).await;
    assert_eq!(r.status(), 400);
    let e: Value = r.json().await.unwrap();
    assert!(e["detail"].as_str().unwrap().starts_with("alerts:"), "{e}");

    let r = h
        .post("/api/v2/alerts", Some(INGEST), r#"{"labels":{}}"#)
        .await;
    assert_eq!(r.status(), 400);
    let e: Value = r.json().await.unwrap();
    assert!(e["detail"].as_str().unwrap().contains("array"), "{e}");
}

#[tokio::test]
async fn one_bad_alert_does_not_drop_the_batch() {
    let h = Harness::start().await;
    let body = r#"{"version":"4","alerts":[
        {"status":"firing","labels":{"action":"trigger-failover","target_model":"qwen-72b","pool":"dc-a"},"startsAt":"2026-11-30T00:06:00Z"},
        {"status":"firing","labels":{"alertname":"Broken"},"startsAt":"yesterday"}]}"#;
    let r = h.webhook(body).await;
    assert_eq!(r.status(), 200);
    let b: Value = r.json().await.unwrap();
    assert_eq!(b["accepted"], 1);
    assert_eq!(b["rejected"][0]["index"], 1);
    assert!(
        b["rejected"][0]["detail"]
            .as_str()
            .unwrap()
            .starts_with("alerts[1].startsAt"),
        "{b}"
    );
    assert_eq!(h.routes().await["models"]["qwen-72b"]["rung"], "failover");
    let metrics = h.get("/metrics", None).await.text().await.unwrap();
    assert!(
        metrics.contains(
            r#"stanch_alerts_rejected_total{source="alertmanager",reason="bad_alert"} 1"#
        ),
        "{metrics}"
    );
}

#[tokio::test]
async fn oversized_bodies_get_413() {
    let h = Harness::start().await;
    let big = vec![b' '; 1024 * 1024 + 1];
    let r = h.webhook(big).await;
    assert_eq!(r.status(), 413);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"], "too_large");
}

#[tokio::test]
async fn intake_needs_the_ingest_token() {
    let h = Harness::start().await;
    let body = fixture("alertmanager-v4-firing-failover.json");
    let r = h.post("/v1/alerts/alertmanager", None, body.clone()).await;
    assert_eq!(r.status(), 401);
    assert_eq!(r.headers()["www-authenticate"], "Bearer");
    assert_eq!(
        h.post("/v1/alerts/alertmanager", Some("wrong"), body.clone())
            .await
            .status(),
        401
    );
    assert_eq!(
        h.post("/v1/alerts/alertmanager", Some(READ), body.clone())
            .await
            .status(),
        401
    );
    assert_eq!(
        h.post("/v1/alerts/alertmanager", Some(ADMIN), body)
            .await
            .status(),
        200
    );
}

#[tokio::test]
async fn unmapped_alerts_are_counted_not_refused() {
    let h = Harness::start().await;
    let body = webhook_body(
        "firing",
        &[("alertname", "DiskFull")],
        "2026-11-30T00:06:00Z",
    );
    assert_eq!(h.webhook(body).await.status(), 200);
    let status = h.json("/v1/status").await;
    assert_eq!(status["alerts"]["unmapped"], 1);
    let metrics = h.get("/metrics", None).await.text().await.unwrap();
    assert!(
        metrics.contains("stanch_alerts_unmapped_total 1"),
        "{metrics}"
    );
}

/// The report token, which gateways hold, posts reports and nothing else; reports
/// also take the ingest and admin tokens.
#[tokio::test]
async fn the_report_token_reports_and_does_nothing_else() {
    let h = Harness::start().await;
    let report = r#"{"gateway": "gw-1", "endpoints": []}"#;
    for token in [REPORT, INGEST, ADMIN] {
        let r = h.post("/v1/reports", Some(token), report).await;
        assert_eq!(r.status(), 200, "{token}");
    }
    for token in [READ, "nope"] {
        let r = h.post("/v1/reports", Some(token), report).await;
        assert_eq!(r.status(), 401, "{token}");
    }
    let alert = webhook_body(
        "firing",
        &[
            ("alertname", "A"),
            ("action", "trigger-failover"),
            ("target_model", "qwen-72b"),
        ],
        "2026-11-30T00:06:00Z",
    );
    for path in ["/v1/alerts/alertmanager", "/v1/admin/unblock-all"] {
        let body = if path.contains("admin") {
            r#"{"reason": "r"}"#.to_owned()
        } else {
            alert.clone()
        };
        let r = h.post(path, Some(REPORT), body).await;
        assert_eq!(r.status(), 401, "{path}");
    }
    assert_eq!(h.get("/v1/status", Some(REPORT)).await.status(), 401);
    assert_eq!(h.routes().await["version"], 1, "nothing changed");
}

#[tokio::test]
async fn gateway_reports_block_an_endpoint_for_every_gateway() {
    let h = Harness::start().await;
    let report = |gateway: &str, failures: u64, streak: u32| {
        serde_json::json!({"gateway": gateway, "endpoints": [{"endpoint": "http://10.0.0.7:8000", "model": "qwen-72b",
            "successes": 0, "failures": failures, "consecutive_failures": streak}]})
        .to_string()
    };
    let r = h
        .post("/v1/reports", Some(REPORT), report("gw-1", 2, 2))
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        h.routes().await["blocked"].as_array().unwrap().len(),
        0,
        "not enough yet"
    );
    let r: Value = h
        .post("/v1/reports", Some(INGEST), report("gw-1", 5, 7))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(r["accepted"], 1);
    let blocked = &h.routes().await["blocked"];
    assert_eq!(blocked[0]["endpoint"], "http://10.0.0.7:8000");
    assert_eq!(blocked[0]["model"], "qwen-72b");
    assert!(
        blocked[0]["reason"]
            .as_str()
            .unwrap()
            .contains("fleet reports")
    );

    assert_eq!(
        h.post("/v1/reports", Some(READ), report("gw-1", 1, 1))
            .await
            .status(),
        401
    );
    let r = h
        .post(
            "/v1/reports",
            Some(INGEST),
            r#"{"gateway": "", "endpoints": []}"#,
        )
        .await;
    assert_eq!(r.status(), 400);
    let e: Value = r.json().await.unwrap();
    assert!(e["detail"].as_str().unwrap().starts_with("gateway:"), "{e}");
}

#[tokio::test]
async fn new_alerts_beyond_the_limit_get_503_and_what_was_taken_is_kept() {
    let mut config = test_config();
    config.alerts.max_active = 3;
    let h = Harness::with(Options {
        config,
        ..Options::default()
    })
    .await;
    let alerts: Vec<Value> = (0..5)
        .map(|i| {
            serde_json::json!({"status": "firing",
                "labels": {"alertname": "PodCrash", "pod": format!("pod-{i}")},
                "annotations": {}, "startsAt": "2026-11-30T00:06:00Z",
                "endsAt": "0001-01-01T00:00:00Z"})
        })
        .collect();
    let body = serde_json::json!({"version": "4", "status": "firing", "alerts": alerts});
    let r = h.webhook(body.to_string()).await;
    assert_eq!(r.status(), 503);
    assert_eq!(r.headers()["retry-after"], "30");
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"], "alert_limit");
    assert!(
        e["detail"].as_str().unwrap().starts_with(
            "2 new alert(s) refused: the active alerts are at a limit (alerts.max_active, 3 alerts,"
        ),
        "{e}"
    );
    assert_eq!(h.json("/v1/status").await["alerts"]["active"], 3);

    // An alert that acts is never kept out by noise: it takes an unmapped one's place.
    let r = h
        .webhook(fixture("alertmanager-v4-firing-failover.json"))
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(h.routes().await["models"]["qwen-72b"]["rung"], "failover");
    assert_eq!(h.json("/v1/status").await["alerts"]["active"], 3);

    let metrics = h.get("/metrics", None).await.text().await.unwrap();
    assert!(
        metrics.contains(r#"stanch_alerts_rejected_total{source="alertmanager",reason="limit"} 2"#),
        "{metrics}"
    );
    let history: Vec<Value> = h
        .get("/v1/history?limit=100", Some(READ))
        .await
        .json()
        .await
        .unwrap();
    let limits: Vec<&str> = history
        .iter()
        .filter(|e| e["kind"] == "alert_limit")
        .map(|e| e["summary"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(limits.len(), 2, "{history:?}");
    assert!(
        limits
            .iter()
            .any(|s| s.ends_with("refused 2 new from Alertmanager (PodCrash)")),
        "{limits:?}"
    );
    assert!(
        limits
            .iter()
            .any(|s| s.ends_with("dropped 1 unmapped for mapped ones from Alertmanager (PodCrash)")),
        "{limits:?}"
    );
}

#[tokio::test]
async fn reports_count_only_the_configured_endpoints_and_blocks_stop_at_the_limit() {
    let mut config = test_config();
    config.models.get_mut("qwen-72b").unwrap().pools = vec![
        stanch_core::config::PoolConfig::Full {
            name: "dc-a".into(),
            endpoints: vec!["10.0.0.7:8000".into()],
        },
        stanch_core::config::PoolConfig::Name("dc-b".into()),
    ];
    config.blocking.max_blocks = 2;
    let h = Harness::with(Options {
        config,
        ..Options::default()
    })
    .await;
    let failing = |endpoint: &str, model: &str| {
        serde_json::json!({"endpoint": endpoint, "model": model,
            "successes": 0, "failures": 5, "consecutive_failures": 5})
    };
    let body = serde_json::json!({"gateway": "gw-1", "endpoints": [
        failing("http://10.0.0.7:8000", "qwen-72b"),
        failing("http://10.0.0.7:8000", "qwen-72b"),
        failing("http://made-up:1", "qwen-72b"),
        failing("http://made-up:1", "no-such-model"),
    ]});
    let r: Value = h
        .post("/v1/reports", Some(INGEST), body.to_string())
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(
        (r["accepted"].as_u64(), r["refused"].as_u64()),
        (Some(2), Some(2))
    );
    let blocked = h.routes().await["blocked"].as_array().unwrap().clone();
    assert_eq!(blocked.len(), 1);
    assert_eq!(blocked[0]["endpoint"], "http://10.0.0.7:8000");
    let metrics = h.get("/metrics", Some(READ)).await.text().await.unwrap();
    for kind in ["unknown_endpoint", "unknown_model"] {
        assert!(
            metrics.contains(&format!(
                "stanch_reports_refused_total{{kind=\"{kind}\"}} 1"
            )),
            "{kind}: {metrics}"
        );
    }

    // The operator's blocks fill the limit; one more is refused, saying why.
    let block = |endpoint: &str| serde_json::json!({"endpoint": endpoint, "ttl": "1h", "reason": "by hand"});
    for endpoint in ["http://o1:1", "http://o2:1"] {
        assert_eq!(h.admin("block", block(endpoint)).await.status(), 200);
    }
    let r = h.admin("block", block("http://o3:1")).await;
    assert_eq!(r.status(), 409);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"], "block_limit");
    assert!(
        e["detail"]
            .as_str()
            .unwrap()
            .contains("blocking.max_blocks"),
        "{e}"
    );
    let blocked = h.routes().await["blocked"].as_array().unwrap().clone();
    assert_eq!(
        blocked.len(),
        2,
        "the fleet block gave way; the third was not made"
    );
    let metrics = h.get("/metrics", Some(READ)).await.text().await.unwrap();
    assert!(
        metrics.contains("stanch_blocks_refused_total{kind=\"limit\"} 1"),
        "{metrics}"
    );
}
