//! What survives a crash, and what happens when the disk cannot be written.

use serde_json::{Value, json};

use crate::support::*;

#[tokio::test]
async fn a_crash_loses_nothing_acknowledged() {
    let mut h = Harness::start().await;
    h.webhook(fixture("alertmanager-v4-firing-failover.json"))
        .await;
    h.webhook(fixture("alertmanager-v4-firing-degradation.json"))
        .await;
    h.admin(
        "force",
        json!({"model": "qwen-14b", "rung": "static", "ttl": "1h", "reason": "drill"}),
    )
    .await;
    h.admin(
        "block",
        json!({"endpoint": "a1:8000", "model": "qwen-72b", "ttl": "10m", "reason": "bad"}),
    )
    .await;
    h.admin("freeze", json!({"model": "qwen-72b", "reason": "looking"}))
        .await;
    let before_routes = h.routes().await;
    let before_status = h.json("/v1/status").await;

    h.crash().await;
    h.restart().await;

    let after_routes = h.routes().await;
    let after_status = h.json("/v1/status").await;
    assert_eq!(after_routes["epoch"], before_routes["epoch"], "same epoch");
    assert_eq!(
        after_routes["version"], before_routes["version"],
        "same version"
    );
    assert_eq!(
        after_routes["models"], before_routes["models"],
        "same rungs, pools, since and leases"
    );
    assert_eq!(after_routes["blocked"], before_routes["blocked"]);
    assert_eq!(
        after_status["models"], before_status["models"],
        "same timers and overrides"
    );
    assert_eq!(after_status["alerts"], before_status["alerts"]);
    assert!(after_status["store"]["recovered_from_corruption"].is_null());

    // The version continues upward.
    let r: Value = h
        .admin("thaw", json!({"model": "qwen-72b", "reason": "done"}))
        .await
        .json()
        .await
        .unwrap();
    assert!(r["version"].as_u64().unwrap() > before_routes["version"].as_u64().unwrap());
    // The history survived too.
    let history: Vec<Value> = h
        .get("/v1/history?limit=1000", Some(READ))
        .await
        .json()
        .await
        .unwrap();
    assert!(
        history
            .iter()
            .any(|e| e["kind"] == "override" && e["detail"]["reason"] == "drill")
    );
}

#[tokio::test]
async fn corrupt_state_starts_a_new_epoch_loudly() {
    let mut h = Harness::start().await;
    h.webhook(fixture("alertmanager-v4-firing-failover.json"))
        .await;
    let old_epoch = h.routes().await["epoch"].clone();
    h.crash().await;
    std::fs::write(h.dir.join("state.json"), b"\x00\x01 definitely not json").unwrap();
    h.clock.advance(std::time::Duration::from_secs(1)); // A different epoch name.
    h.restart().await;

    let routes = h.routes().await;
    assert_ne!(
        routes["epoch"], old_epoch,
        "versions are not comparable any more"
    );
    let status = h.json("/v1/status").await;
    let why = status["store"]["recovered_from_corruption"]
        .as_str()
        .expect("said in status");
    assert!(why.contains("snapshot unreadable"), "{why}");
    let metrics = h.get("/metrics", None).await.text().await.unwrap();
    assert!(
        metrics.contains("stanch_state_corrupt_recovered 1"),
        "{metrics}"
    );
    let aside = std::fs::read_dir(&h.dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .any(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("state.json.corrupt-")
        });
    assert!(aside, "the unreadable file is kept for a post-mortem");
    // And it keeps working.
    assert_eq!(
        h.webhook(fixture("alertmanager-v4-firing-failover.json"))
            .await
            .status(),
        200
    );
}

#[cfg(target_os = "linux")]
#[tokio::test]
async fn a_full_disk_is_a_retryable_error_and_nothing_is_lost() {
    let mut h = Harness::start().await;
    let journal = h.dir.join("journal.jsonl");
    std::fs::remove_file(&journal).ok();
    // Every write to /dev/full fails with ENOSPC, as on a full disk.
    std::os::unix::fs::symlink("/dev/full", &journal).unwrap();

    let r = h
        .webhook(fixture("alertmanager-v4-firing-failover.json"))
        .await;
    assert_eq!(r.status(), 503, "Alertmanager retries 5xx");
    let e: Value = r.json().await.unwrap();
    let detail = e["detail"].as_str().unwrap();
    assert!(detail.contains("state store cannot write"), "{e}");
    assert!(
        !detail.contains(h.dir.to_str().unwrap()) && !detail.contains("space"),
        "the cause is logged, not sent to callers: {e}"
    );
    assert_eq!(h.get("/readyz", None).await.status(), 503);
    assert_eq!(h.json("/v1/status").await["store"]["healthy"], false);
    assert_eq!(
        h.routes().await["models"]["qwen-72b"]["rung"],
        "normal",
        "nothing unpersisted is published"
    );

    // Space comes back: the held records are written first, then the new one.
    std::fs::remove_file(&journal).unwrap();
    let r = h
        .webhook(fixture("alertmanager-v4-firing-degradation.json"))
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(h.get("/readyz", None).await.status(), 200);
    assert_eq!(h.routes().await["models"]["qwen-72b"]["rung"], "degraded");
    let metrics = h.get("/metrics", None).await.text().await.unwrap();
    assert!(
        metrics.contains(r#"stanch_store_errors_total{kind="append"}"#),
        "{metrics}"
    );

    h.crash().await;
    h.restart().await;
    let status = h.json("/v1/status").await;
    assert_eq!(
        status["alerts"]["active"], 2,
        "the alert first refused is kept too"
    );
}
