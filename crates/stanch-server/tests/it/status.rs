//! The status report behind `stanch ctl status` and the status page: why each model is
//! where it is, what it will do next, and where each block came from; and the page's
//! own files, served without a token under a strict policy.

use std::time::Duration;

use serde_json::{Value, json};
use stanch_api::{HumanDuration, Timestamp};
use stanch_ports::clock::Clock;

use crate::support::*;

fn at(v: &Value) -> Timestamp {
    Timestamp::parse_rfc3339(v.as_str().unwrap_or_else(|| panic!("a time: {v}"))).unwrap()
}

/// While the alert fires, the model shows it as the condition behind its rung (with
/// its labels and start) and no step down; once resolved, when it will step down; a
/// forced model shows none, since automation does not move it.
#[tokio::test]
async fn conditions_and_the_next_step_down() {
    let h = Harness::start().await;
    fail_dc_a(&h).await;
    let m = &h.json("/v1/status").await["models"]["qwen-72b"];
    assert_eq!(m["rung"], "failover");
    let conditions = m["conditions"].as_array().unwrap();
    assert_eq!(conditions.len(), 1, "{m}");
    let c = &conditions[0];
    assert_eq!(c["alertname"], "LLMModelHighFailureRate");
    assert_eq!(c["fingerprint"], m["alerts"][0]);
    assert_eq!(c["labels"]["pool"], "dc-a");
    assert_eq!(c["labels"]["severity"], "critical");
    assert_eq!(
        at(&c["starts_at"]),
        Timestamp::parse_rfc3339("2026-11-30T00:06:54.148Z").unwrap()
    );
    assert!(
        c["effect"].as_str().unwrap().contains("dc-a"),
        "the effect names the pool: {c}"
    );
    assert_eq!(
        m["step_down"],
        Value::Null,
        "the alert still needs failover"
    );

    h.clock.advance(Duration::from_secs(5));
    let resolved_at = h.clock.now();
    h.webhook(fixture("alertmanager-v4-resolved-failover.json"))
        .await;
    let m = &h.json("/v1/status").await["models"]["qwen-72b"];
    assert_eq!(m["rung"], "failover", "held for recover_after");
    assert_eq!(m["conditions"], json!([]));
    let recover_after = m["recover_after"]
        .as_str()
        .unwrap()
        .parse::<HumanDuration>()
        .unwrap()
        .0;
    assert_eq!(m["step_down"]["to"], "normal");
    assert_eq!(at(&m["step_down"]["at"]), resolved_at + recover_after);

    // Reached on its own once that time passes; then there is nothing to step down to.
    h.clock.advance(recover_after);
    stanch_testkit::wait::until(
        "qwen-72b back to normal",
        Duration::from_secs(5),
        || async { h.json("/v1/status").await["models"]["qwen-72b"]["rung"] == "normal" },
    )
    .await;
    assert_eq!(
        h.json("/v1/status").await["models"]["qwen-72b"]["step_down"],
        Value::Null
    );

    // A new incident, resolved: it would step down again, until an operator forces it.
    let labels = [
        ("alertname", "LLMModelHighFailureRate"),
        ("action", "trigger-failover"),
        ("target_model", "qwen-72b"),
        ("pool", "dc-a"),
    ];
    for state in ["firing", "resolved"] {
        let r = h
            .webhook(webhook_body(state, &labels, "2026-11-30T00:08:00Z"))
            .await;
        assert_eq!(r.status(), 200);
    }
    assert_ne!(
        h.json("/v1/status").await["models"]["qwen-72b"]["step_down"],
        Value::Null
    );
    let r = h
        .admin(
            "force",
            json!({"model": "qwen-72b", "rung": "failover", "ttl": "10m", "reason": "hold"}),
        )
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        h.json("/v1/status").await["models"]["qwen-72b"]["step_down"],
        Value::Null,
        "a forced model does not step down on its own"
    );
}

/// A block says where it came from: the alert (with its fingerprint) or an operator.
#[tokio::test]
async fn blocks_name_their_source() {
    let h = Harness::start().await;
    let r = h
        .webhook(webhook_body(
            "firing",
            &[
                ("alertname", "EndpointDown"),
                ("action", "block-endpoint"),
                ("endpoint", "10.0.0.1:8000"),
            ],
            "2026-11-30T00:06:00Z",
        ))
        .await;
    assert_eq!(r.status(), 200);
    let r = h
        .admin(
            "block",
            json!({"endpoint": "10.0.0.7:8000", "ttl": "2m", "reason": "bad GPU"}),
        )
        .await;
    assert_eq!(r.status(), 200);
    let status = h.json("/v1/status").await;
    let blocks = status["blocked"].as_array().unwrap();
    let by = |endpoint: &str| {
        blocks
            .iter()
            .find(|b| b["endpoint"] == endpoint)
            .unwrap_or_else(|| panic!("{endpoint} blocked: {status}"))
    };
    let alert = by("10.0.0.1:8000");
    assert_eq!(alert["source"], "alert");
    assert!(alert["alert"].is_string(), "{alert}");
    assert_eq!(at(&alert["since"]), fixture_time());
    let operator = by("10.0.0.7:8000");
    assert_eq!(operator["source"], "operator");
    assert_eq!(operator["alert"], Value::Null);
    assert_eq!(operator["reason"], "bad GPU");
}

/// `GET /` and `/ui/…` need no token (they carry no data), come with a policy that
/// lets nothing but this origin's own script run, revalidate by ETag, and name the
/// files there are when asked for one that is not.
#[tokio::test]
async fn the_page_is_served_without_a_token_under_a_strict_policy() {
    let h = Harness::start().await;
    let page = h.get("/", None).await;
    assert_eq!(page.status(), 200);
    let headers = page.headers().clone();
    assert_eq!(headers["content-type"], "text/html; charset=utf-8");
    let csp = headers["content-security-policy"].to_str().unwrap();
    for directive in [
        "default-src 'none'",
        "script-src 'self'",
        "frame-ancestors 'none'",
    ] {
        assert!(csp.contains(directive), "{csp}");
    }
    assert!(!csp.contains("unsafe"), "{csp}");
    assert_eq!(headers["x-content-type-options"], "nosniff");
    assert_eq!(headers["cache-control"], "no-cache");
    let html = page.text().await.unwrap();
    assert!(
        html.contains(r#"src="ui/app.js""#),
        "relative, for a path prefix"
    );
    assert!(
        !html.contains("<script>") && !html.contains(" style="),
        "no inline code"
    );

    for (asset, kind) in [
        ("app.js", "text/javascript"),
        ("app.css", "text/css"),
        ("icon.svg", "image/svg+xml"),
    ] {
        let r = h.get(&format!("/ui/{asset}"), None).await;
        assert_eq!(r.status(), 200, "{asset}");
        assert!(
            r.headers()["content-type"]
                .to_str()
                .unwrap()
                .starts_with(kind),
            "{asset}"
        );
        let etag = r.headers()["etag"].clone();
        let again = h
            .http
            .get(h.url(&format!("/ui/{asset}")))
            .header("if-none-match", etag)
            .send()
            .await
            .unwrap();
        assert_eq!(again.status(), 304, "{asset} unchanged");
    }

    let r = h.get("/ui/secrets.json", None).await;
    assert_eq!(r.status(), 404);
    let e: Value = r.json().await.unwrap();
    assert!(
        e["detail"].as_str().unwrap().contains("app.js"),
        "names what there is: {e}"
    );
    // The data behind the page still needs the read token.
    assert_eq!(h.get("/v1/status", None).await.status(), 401);
}

/// A controller under `config` whose qwen-72b failed over from dc-a, recovered, and
/// has begun its fail-back: the first step taken.
async fn at_the_first_step(config: stanch_core::Config) -> Harness {
    let h = Harness::with(Options {
        config,
        ..Options::default()
    })
    .await;
    fail_dc_a(&h).await;
    h.clock.advance(Duration::from_secs(5));
    h.webhook(fixture("alertmanager-v4-resolved-failover.json"))
        .await;
    h.clock.advance(h.config.ladder.recover_after.0);
    let first = h.config.ladder.failback.steps[0];
    stanch_testkit::wait::until("the first step", Duration::from_secs(5), || async {
        h.json("/v1/status").await["models"]["qwen-72b"]["failback"]["percent"] == first
    })
    .await;
    h
}

/// With gradual fail-back, a recovered dc-a gets its traffic back in steps: the route
/// splits, status shows the step and what it will be judged by, and the gateways'
/// outcomes at dc-a move it on; a failing step sends everything back to dc-b.
#[tokio::test]
async fn a_gradual_failback_steps_by_the_outcomes_and_aborts_on_failures() {
    let mut config = test_config();
    config.ladder.failback.steps = vec![10, 50, 100];
    config.ladder.failback.hold = HumanDuration::secs(30);
    config.ladder.failback.min_samples = 10;
    config.models.get_mut("qwen-72b").unwrap().pools[0] = stanch_core::config::PoolConfig::Full {
        name: "dc-a".into(),
        endpoints: vec!["10.0.0.1:8000".into()],
    };
    let h = at_the_first_step(config).await;
    let shares = h.routes().await["models"]["qwen-72b"]["shares"].clone();
    assert_eq!(
        shares,
        json!([{"pool": "dc-a", "percent": 10}, {"pool": "dc-b", "percent": 90}])
    );
    let m = &h.json("/v1/status").await["models"]["qwen-72b"];
    assert_eq!(m["rung"], "failover", "on its rung until the last step");
    assert_eq!(m["failback"]["to"], "normal");
    assert_eq!(m["failback"]["percent"], 10);
    assert_eq!(m["failback"]["outcomes"], json!([0, 0]));
    assert_eq!(
        at(&m["failback"]["judged_at"]),
        at(&m["failback"]["since"]) + Duration::from_secs(30)
    );

    // Good outcomes at dc-a: the next step.
    let report = |ok: u64, failed: u64| {
        json!({"gateway": "gw-1", "endpoints": [{"endpoint": "http://10.0.0.1:8000",
            "model": "qwen-72b", "successes": ok, "failures": failed, "consecutive_failures": 0}]})
        .to_string()
    };
    h.clock.advance(Duration::from_secs(1));
    let r = h.post("/v1/reports", Some(REPORT), report(40, 1)).await;
    assert_eq!(r.status(), 200);
    h.clock.advance(Duration::from_secs(30));
    stanch_testkit::wait::until("the second step", Duration::from_secs(5), || async {
        h.routes().await["models"]["qwen-72b"]["shares"]
            == json!([{"pool": "dc-a", "percent": 50}, {"pool": "dc-b", "percent": 50}])
    })
    .await;

    // Failures at dc-a: everything back on dc-b at once.
    h.clock.advance(Duration::from_secs(1));
    h.post("/v1/reports", Some(REPORT), report(5, 20)).await;
    h.clock.advance(Duration::from_secs(30));
    stanch_testkit::wait::until("the abort", Duration::from_secs(5), || async {
        let route = &h.routes().await["models"]["qwen-72b"];
        route["pool"] == "dc-b" && route.get("shares").is_none()
    })
    .await;
    let history: Vec<Value> = h.get("/v1/history", Some(READ)).await.json().await.unwrap();
    let kinds: Vec<&str> = history.iter().filter_map(|e| e["kind"].as_str()).collect();
    assert!(kinds.contains(&"failback_step"), "{kinds:?}");
    let aborted = history
        .iter()
        .find(|e| e["kind"] == "failback_aborted")
        .expect("the abort is in the history");
    assert!(
        aborted["summary"]
            .as_str()
            .unwrap()
            .contains("20 of 25 outcomes failed"),
        "{aborted}"
    );
    assert!(h.json("/v1/status").await["models"]["qwen-72b"]["failback"].is_null());
}

/// An operator skips a fail-back to its end over the admin API; a fail-back that is
/// not under way changes nothing; a bad action is refused naming the field.
#[tokio::test]
async fn a_failback_is_skipped_by_an_operator() {
    let mut config = test_config();
    config.ladder.failback.steps = vec![10, 50, 100];
    let h = at_the_first_step(config).await;
    let r = h
        .admin(
            "failback",
            json!({"model": "qwen-14b", "action": "skip", "reason": "r"}),
        )
        .await;
    assert_eq!(r.status(), 200);
    let changed = &r.json::<Value>().await.unwrap()["changed"];
    assert_eq!(*changed, false, "none under way for qwen-14b");

    let skip = json!({"model": "qwen-72b", "action": "skip", "reason": "dc-a is fine"});
    let r = h.admin("failback", skip).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap()["changed"], true);
    let route = &h.routes().await["models"]["qwen-72b"];
    assert_eq!(route["rung"], "normal", "{route}");
    assert_eq!(route["pool"], "dc-a");

    let r = h
        .admin(
            "failback",
            json!({"model": "qwen-72b", "action": "pause", "reason": "r"}),
        )
        .await;
    assert_eq!(r.status(), 400);
    let body: Value = r.json().await.unwrap();
    assert!(body.to_string().contains("action"), "{body}");
    let r = h
        .post(
            "/v1/admin/failback",
            None,
            json!({"model": "qwen-72b", "action": "skip", "reason": "r"}).to_string(),
        )
        .await;
    assert_eq!(r.status(), 401, "the admin token is needed");
}
