//! Overrides over HTTP: what they do, what they refuse, and the audit trail.

use serde_json::{Value, json};

use crate::support::*;

#[tokio::test]
async fn force_and_release() {
    let h = Harness::start().await;
    let r = h
        .admin(
            "force",
            json!({"model": "qwen-72b", "rung": "static", "ttl": "10m", "reason": "drill"}),
        )
        .await;
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["changed"], true);
    assert!(
        body["effects"][0]
            .as_str()
            .unwrap()
            .contains("pinned at static for 10m"),
        "{body}"
    );
    let m = &h.routes().await["models"]["qwen-72b"];
    assert_eq!(m["rung"], "static");
    assert_eq!(m["faq"], "default");
    assert_eq!(m["overridden"], true);
    let status = h.json("/v1/status").await;
    assert_eq!(status["models"]["qwen-72b"]["force"]["reason"], "drill");

    // Alerts do not move a forced model.
    h.webhook(fixture("alertmanager-v4-firing-failover.json"))
        .await;
    assert_eq!(h.routes().await["models"]["qwen-72b"]["rung"], "static");

    let r = h
        .admin(
            "release",
            json!({"model": "qwen-72b", "reason": "drill over"}),
        )
        .await;
    assert_eq!(r.status(), 200);
    // Automation holds the rung a full dwell, then steps down; released is not forced.
    assert_eq!(h.routes().await["models"]["qwen-72b"]["overridden"], false);
    let again: Value = h
        .admin("release", json!({"model": "qwen-72b", "reason": "twice"}))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(again["changed"], false);

    let history: Vec<Value> = h
        .get("/v1/history?model=qwen-72b", Some(READ))
        .await
        .json()
        .await
        .unwrap();
    let overrides: Vec<&str> = history
        .iter()
        .filter(|e| e["kind"] == "override")
        .map(|e| e["detail"]["reason"].as_str().unwrap())
        .collect();
    assert_eq!(overrides, ["drill", "drill over"]);
}

#[tokio::test]
async fn freeze_stops_automation_until_thawed() {
    let h = Harness::start().await;
    assert_eq!(
        h.admin("freeze", json!({"reason": "change window"}))
            .await
            .status(),
        200
    );
    h.webhook(fixture("alertmanager-v4-firing-failover.json"))
        .await;
    assert_eq!(h.routes().await["models"]["qwen-72b"]["rung"], "normal");
    assert_eq!(
        h.json("/v1/status").await["global_freeze"]["reason"],
        "change window"
    );
    assert_eq!(
        h.admin("thaw", json!({"reason": "done"})).await.status(),
        200
    );
    assert_eq!(
        h.routes().await["models"]["qwen-72b"]["rung"],
        "failover",
        "escalates at once on thaw"
    );
}

#[tokio::test]
async fn dry_run_decides_but_publishes_nothing_new() {
    let h = Harness::start().await;
    assert_eq!(
        h.admin("dry-run", json!({"enabled": true, "reason": "trial"}))
            .await
            .status(),
        200
    );
    let before = h.routes().await;
    h.webhook(fixture("alertmanager-v4-firing-failover.json"))
        .await;
    let after = h.routes().await;
    assert_eq!(after["models"], before["models"], "nothing new published");
    let status = h.json("/v1/status").await;
    assert_eq!(status["models"]["qwen-72b"]["rung"], "normal");
    assert_eq!(status["models"]["qwen-72b"]["decided_rung"], "failover");
    let history: Vec<Value> = h.get("/v1/history", Some(READ)).await.json().await.unwrap();
    let transition = history.iter().find(|e| e["kind"] == "transition").unwrap();
    assert_eq!(transition["dry_run"], true);
    assert_eq!(
        h.admin("dry-run", json!({"enabled": false, "reason": "trusted"}))
            .await
            .status(),
        200
    );
    assert_eq!(h.routes().await["models"]["qwen-72b"]["rung"], "failover");
}

#[tokio::test]
async fn blocks_and_unblocks() {
    let h = Harness::start().await;
    let r = h
        .admin(
            "block",
            json!({"endpoint": "10.0.0.7:8000", "ttl": "2m", "reason": "bad GPU"}),
        )
        .await;
    assert_eq!(r.status(), 200);
    let blocked = &h.routes().await["blocked"];
    assert_eq!(blocked[0]["endpoint"], "10.0.0.7:8000");
    assert_eq!(blocked[0]["model"], Value::Null);
    let r = h
        .admin(
            "unblock",
            json!({"endpoint": "10.0.0.9:8000", "reason": "typo"}),
        )
        .await;
    assert_eq!(r.status(), 404);
    let e: Value = r.json().await.unwrap();
    assert!(
        e["detail"]
            .as_str()
            .unwrap()
            .contains("blocked now: 10.0.0.7:8000"),
        "{e}"
    );
    assert_eq!(
        h.admin("unblock-all", json!({"reason": "fixed"}))
            .await
            .status(),
        200
    );
    assert_eq!(h.routes().await["blocked"].as_array().unwrap().len(), 0);
}

#[tokio::test]
async fn bad_overrides_are_refused_with_the_field_named() {
    let h = Harness::start().await;
    let detail = |r: Value| r["detail"].as_str().unwrap().to_owned();
    let cases = [
        (
            "force",
            json!({"model": "qwen-72b", "rung": "static"}),
            "missing field `reason`",
        ),
        (
            "force",
            json!({"model": "qwen-72b", "rung": "static", "reason": "  "}),
            "reason: must say why",
        ),
        (
            "force",
            json!({"model": "ghost", "rung": "static", "reason": "x"}),
            "model: \"ghost\" is not configured",
        ),
        (
            "force",
            json!({"model": "qwen-14b", "rung": "degraded", "reason": "x"}),
            "no fallback model",
        ),
        (
            "force",
            json!({"model": "qwen-72b", "rung": "burning", "reason": "x"}),
            "unknown variant `burning`",
        ),
        (
            "force",
            json!({"model": "qwen-72b", "rung": "static", "reason": "x", "ttl": "soon"}),
            "not a duration",
        ),
        (
            "freeze",
            json!({"reason": "x", "modle": "qwen-72b"}),
            "unknown field `modle`",
        ),
        (
            "block",
            json!({"endpoint": "", "reason": "x"}),
            "endpoint: must not be empty",
        ),
    ];
    for (action, body, expected) in cases {
        let r = h.admin(action, body.clone()).await;
        assert_eq!(r.status(), 400, "{action} {body}");
        let d = detail(r.json().await.unwrap());
        assert!(d.contains(expected), "{action} {body}: {d}");
    }
}

#[tokio::test]
async fn overrides_need_the_admin_token() {
    let h = Harness::start().await;
    let body = json!({"reason": "x"}).to_string();
    assert_eq!(
        h.post("/v1/admin/unblock-all", None, body.clone())
            .await
            .status(),
        401
    );
    assert_eq!(
        h.post("/v1/admin/unblock-all", Some(INGEST), body.clone())
            .await
            .status(),
        401
    );
    assert_eq!(
        h.post("/v1/admin/unblock-all", Some(READ), body.clone())
            .await
            .status(),
        401
    );
    assert_eq!(
        h.post("/v1/admin/unblock-all", Some(ADMIN), body)
            .await
            .status(),
        200
    );
}

/// A follower takes no writes: alerts, reports and overrides get 503 with
/// `Retry-After`, naming the leader, and change nothing; reads are served. Once it
/// leads, the same requests are taken.
#[tokio::test]
async fn a_follower_refuses_writes_and_names_the_leader() {
    use stanch_ports::leadership::Role;
    let h = Harness::start().await;
    let before = h.routes().await;
    let leadership = h.controller.as_ref().unwrap().leadership().clone();
    leadership.set(Role::Follower {
        leader: Some("stanch-0".into()),
    });
    for r in [
        h.webhook(fixture("alertmanager-v4-firing-failover.json"))
            .await,
        h.admin(
            "force",
            json!({"model": "qwen-14b", "rung": "static", "ttl": "1h", "reason": "drill"}),
        )
        .await,
    ] {
        assert_eq!(r.status(), 503);
        assert_eq!(r.headers()["retry-after"], "1");
        assert_eq!(r.headers()["x-stanch-leader"], "stanch-0");
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["error"], "not_leader");
    }
    assert_eq!(
        h.routes().await["version"],
        before["version"],
        "nothing changed"
    );
    // An unauthenticated caller learns nothing of the leader.
    let anonymous = h
        .post(
            "/v1/alerts/alertmanager",
            None,
            fixture("alertmanager-v4-firing-failover.json"),
        )
        .await;
    assert_eq!(anonymous.status(), 401);
    assert!(anonymous.headers().get("x-stanch-leader").is_none());

    leadership.set(Role::Leader);
    let taken = h
        .webhook(fixture("alertmanager-v4-firing-failover.json"))
        .await;
    assert_eq!(taken.status(), 200);
    assert_eq!(h.routes().await["models"]["qwen-72b"]["rung"], "failover");
}
