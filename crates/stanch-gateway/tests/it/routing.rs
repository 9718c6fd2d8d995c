//! Applying the route table: pools, degradation with VIP exemption, static, blocks,
//! leases, fallback models, globs and tenants.

use std::time::Duration;

use serde_json::Value;
use stanch_api::{BlockedEndpoint, Rung};

use crate::support::*;

struct Fleet {
    gw: Setup,
    a: Upstream,
    b: Upstream,
    small: Upstream,
}

async fn fleet() -> Fleet {
    let a = Upstream::start("qwen-72b", "dc-a").await;
    let b = Upstream::start("qwen-72b", "dc-b").await;
    let small = Upstream::start("qwen-14b", "small").await;
    let yaml = format!(
        "models:
  qwen-72b:
    faq: default
    fallbacks: [qwen-14b]
    pools:
      - {{name: dc-a, endpoints: [{{url: '{{a}}'}}]}}
      - {{name: dc-b, endpoints: [{{url: '{{b}}'}}]}}
  qwen-14b:
    pools:
      - {{name: dc-a, endpoints: [{{url: '{{s}}'}}]}}
  'fb-*':
    pools:
      - {{name: p, endpoints: [{{url: '{{s}}', upstream_model: 'qwen-14b'}}]}}
{POLICY}"
    );
    let gw = gateway(&yaml, &[("a", &a), ("b", &b), ("s", &small)]).await;
    Fleet { gw, a, b, small }
}

async fn served_by(gw: &Setup, key: &str) -> (Value, reqwest::header::HeaderMap) {
    let r = gw.chat_as("qwen-72b", false, key, "hi").await;
    assert_eq!(r.status(), 200);
    let headers = r.headers().clone();
    (r.json().await.unwrap(), headers)
}

#[tokio::test]
async fn failover_routes_to_the_active_pool() {
    let mut f = fleet().await;
    f.gw.table(&[("qwen-72b", Rung::Failover, "dc-b", None)], vec![]);
    for _ in 0..5 {
        let (_, h) = served_by(&f.gw, "acme-key").await;
        assert_eq!(h["x-stanch-route-version"], "1");
    }
    assert_eq!((f.a.requests(), f.b.requests()), (0, 5));
}

#[tokio::test]
async fn a_split_spreads_requests_by_share() {
    let mut f = fleet().await;
    f.gw.split("qwen-72b", &[("dc-a", 25), ("dc-b", 75)], None);
    for _ in 0..100 {
        served_by(&f.gw, "acme-key").await;
    }
    // Exactly: every 100 requests give each pool its share.
    assert_eq!((f.a.requests(), f.b.requests()), (25, 75));
    assert_eq!(f.small.requests(), 0);
}

#[tokio::test]
async fn a_split_of_the_alias_degrades_only_its_percentage_and_never_vip() {
    let mut f = fleet().await;
    f.gw.split("qwen-72b", &[], Some(("qwen-14b", 40)));
    let mut degraded = 0;
    for _ in 0..100 {
        let (body, h) = served_by(&f.gw, "acme-key").await;
        if h.get("x-llm-degraded").is_some() {
            assert_eq!(body["model"], "qwen-14b");
            degraded += 1;
        } else {
            assert_eq!(body["model"], "qwen-72b");
        }
    }
    assert_eq!(degraded, 40);
    assert_eq!((f.small.requests(), f.a.requests()), (40, 60));
    for _ in 0..10 {
        let (body, _) = served_by(&f.gw, "vip-key").await;
        assert_eq!(body["model"], "qwen-72b", "VIP traffic keeps the model");
    }
    assert_eq!(f.small.requests(), 40);
}

#[tokio::test]
async fn degraded_serves_non_vip_from_the_alias_and_vip_keeps_the_model() {
    let mut f = fleet().await;
    f.gw.table(
        &[("qwen-72b", Rung::Degraded, "dc-a", Some("qwen-14b"))],
        vec![],
    );
    let (body, h) = served_by(&f.gw, "acme-key").await;
    assert_eq!(body["model"], "qwen-14b");
    assert_eq!(h["x-llm-degraded"], "true");
    let (body, h) = served_by(&f.gw, "vip-key").await;
    assert_eq!(body["model"], "qwen-72b");
    assert!(h.get("x-llm-degraded").is_none());
    assert_eq!(f.small.requests(), 1);
}

#[tokio::test]
async fn static_answers_from_the_faq_in_chinese_and_english() {
    let mut f = fleet().await;
    f.gw.table(&[("qwen-72b", Rung::Static, "dc-a", None)], vec![]);
    for (q, expect) in [
        ("如何重置密码？", "reset link"),
        ("how do I reset my password", "reset link"),
        ("sing a song", "busy"),
    ] {
        let r = f.gw.chat_as("qwen-72b", false, "vip-key", q).await;
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["x-llm-degraded"], "static");
        let body: Value = r.json().await.unwrap();
        assert!(
            body["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .contains(expect),
            "{q}: {body}"
        );
        assert_eq!(body["usage"]["total_tokens"], 0);
    }
    let r = f.gw.chat("qwen-72b", true).await;
    let ev = events(&r.text().await.unwrap());
    assert_eq!(ev.last().map(String::as_str), Some("[DONE]"));
    assert_eq!(f.a.requests() + f.b.requests(), 0, "no upstream touched");
}

#[tokio::test]
async fn an_expired_lease_reverts_to_normal_routing() {
    let mut f = fleet().await;
    f.gw.table_with_lease(
        &[("qwen-72b", Rung::Static, "dc-b", None)],
        vec![],
        Duration::from_millis(200),
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (body, h) = served_by(&f.gw, "acme-key").await;
    assert_eq!(body["model"], "qwen-72b");
    assert!(h.get("x-llm-degraded").is_none());
    assert_eq!(f.a.requests(), 1, "back on the primary");
}

#[tokio::test]
async fn blocks_from_the_table_are_honoured() {
    let mut f = fleet().await;
    let until = stanch_ports::clock::Clock::now(&stanch_ports::clock::SystemClock)
        + Duration::from_secs(60);
    let block = |e: &Upstream| BlockedEndpoint {
        endpoint: e.base.clone(),
        model: Some("qwen-72b".into()),
        until,
        reason: "fleet".into(),
    };
    f.gw.table(
        &[("qwen-72b", Rung::Normal, "dc-a", None)],
        vec![block(&f.a)],
    );
    for _ in 0..5 {
        served_by(&f.gw, "acme-key").await;
    }
    assert_eq!(
        (f.a.requests(), f.b.requests()),
        (0, 5),
        "an open endpoint in the next pool comes first"
    );
    let status: Value = f.gw.status().await;
    assert!(
        status["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| !e["table_blocked_until"].is_null())
    );

    // Every endpoint of the model blocked: blocked is the lowest priority across the
    // plan, so the fallback model comes first...
    f.gw.table(
        &[("qwen-72b", Rung::Normal, "dc-a", None)],
        vec![block(&f.a), block(&f.b)],
    );
    for _ in 0..3 {
        let (body, _) = served_by(&f.gw, "acme-key").await;
        assert_eq!(body["model"], "qwen-14b", "the open fallback first");
    }
    assert_eq!((f.a.requests(), f.b.requests()), (0, 5));
    // ...and with every target blocked, blocked is lowest priority, not gone.
    let small = BlockedEndpoint {
        model: Some("qwen-14b".into()),
        ..block(&f.small)
    };
    f.gw.table(
        &[("qwen-72b", Rung::Normal, "dc-a", None)],
        vec![block(&f.a), block(&f.b), small],
    );
    for _ in 0..3 {
        let (body, _) = served_by(&f.gw, "acme-key").await;
        assert_eq!(
            body["model"], "qwen-72b",
            "the model itself, blocked or not"
        );
    }
    let metrics = f.gw.metrics().await;
    assert!(
        metrics.contains("stanch_gateway_all_candidates_blocked_total"),
        "{metrics}"
    );
    let gauge = |name: &str, value: u8| {
        format!(
            "stanch_gateway_{name}{{endpoint=\"{}\",model=\"qwen-72b\",pool=\"dc-a\"}} {value}",
            f.a.base
        )
    };
    assert!(metrics.contains(&gauge("endpoint_blocked", 1)), "{metrics}");
    assert!(
        metrics.contains(&gauge("endpoint_blocked_locally", 0)),
        "the table's blocks are the controller's, not evidence for its rules:\n{metrics}"
    );
}

#[tokio::test]
async fn pools_then_the_fallback_model() {
    let f = fleet().await;
    f.a.fault(serde_json::json!({"kind": "status", "status": 503}));
    let (body, _) = served_by(&f.gw, "acme-key").await;
    assert_eq!(body["model"], "qwen-72b", "the next pool");
    f.b.fault(serde_json::json!({"kind": "status", "status": 503}));
    let (body, _) = served_by(&f.gw, "acme-key").await;
    assert_eq!(body["model"], "qwen-14b", "then the fallback model");
}

#[tokio::test]
async fn globs_forward_the_requested_name_and_unknown_models_are_404() {
    let f = fleet().await;
    let r = f.gw.chat("fb-anything", false).await;
    assert_eq!(r.status(), 200);
    let r = f.gw.chat("gpt-9", false).await;
    assert_eq!(r.status(), 404);
    assert_eq!(
        r.headers()["x-stanch-route-version"],
        "0",
        "answers made before routing carry the version too"
    );
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "model_not_found");
}

#[tokio::test]
async fn every_answer_carries_the_route_version_and_rejections_are_counted() {
    let mut f = fleet().await;
    f.gw.table(&[("qwen-72b", Rung::Failover, "dc-b", None)], vec![]);
    let bad =
        f.gw.http
            .post(format!("{}/v1/chat/completions", f.gw.base))
            .body("{not json")
            .send()
            .await
            .unwrap();
    assert_eq!(bad.status(), 400);
    assert_eq!(bad.headers()["x-stanch-route-version"], "1");
    // Counted by kind, never by the name a caller made up.
    f.gw.chat("gpt-9", false).await;
    let metrics = f.gw.metrics().await;
    for kind in ["invalid_json", "model_not_found"] {
        assert_eq!(
            sample(
                &metrics,
                "stanch_gateway_rejected_requests_total",
                &[("kind", kind)]
            ),
            1.0,
            "{kind}"
        );
    }
    assert!(!metrics.contains("gpt-9"));
    let models =
        f.gw.http
            .get(format!("{}/v1/models", f.gw.base))
            .send()
            .await
            .unwrap();
    assert_eq!(models.status(), 200);
    assert_eq!(models.headers()["x-stanch-route-version"], "1");
    let (_, served) = served_by(&f.gw, "acme-key").await;
    assert_eq!(served["x-stanch-route-version"], "1");
}

/// The gateway routes by the same reading of a body as the upstream will make: a
/// body with two `model`s (which the upstream might read as either) is refused, not
/// routed by one and served by the other; a key written with escapes means what it
/// decodes to.
#[tokio::test]
async fn bodies_are_read_as_the_upstream_reads_them() {
    let f = fleet().await;
    let post = |body: &'static str| {
        f.gw.http
            .post(format!("{}/v1/chat/completions", f.gw.base))
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    for bad in [
        r#"{"model":"qwen-14b","model":"qwen-72b","messages":[]}"#,
        r#"{"model":"qwen-14b","mod\u0065l":"qwen-72b","messages":[]}"#,
        r#"{"model":"qwen-72b","stream":true,"stream":false,"messages":[]}"#,
        r#"["qwen-72b"]"#,
        r#"{"model":"qwen-72b","stream":"yes","messages":[]}"#,
    ] {
        let r = post(bad).await.unwrap();
        assert_eq!(r.status(), 400, "{bad}");
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["error"]["code"], "invalid_json", "{bad}");
    }
    let upstream = |u: &Upstream| u.mock.stats().requests;
    assert_eq!(
        upstream(&f.a) + upstream(&f.small),
        0,
        "nothing went upstream"
    );

    let r =
        post(r#"{"mod\u0065l":"qwen-\u0031\u0034b","messages":[{"role":"user","content":"hi"}]}"#)
            .await
            .unwrap();
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["model"], "qwen-14b");
    assert_eq!(upstream(&f.small), 1);
}

#[test]
fn an_upstream_key_that_cannot_be_a_header_stops_the_start() {
    use stanch_gateway::Gateway;
    use stanch_gateway::config::GatewayConfig;
    use stanch_ports::clock::SystemClock;
    use std::sync::Arc;

    let key = std::env::temp_dir().join(format!("stanch-bad-key-{}", std::process::id()));
    std::fs::write(&key, "sk-one\nsk-two\n").unwrap();
    let yaml = format!(
        "models:\n  m:\n    pools:\n      - {{name: p, endpoints: [{{url: 'http://127.0.0.1:9', api_key_file: '{}'}}]}}\n",
        key.display()
    );
    let config = GatewayConfig::from_yaml(&yaml).unwrap();
    let err = Gateway::new(config, None, Arc::new(SystemClock))
        .err()
        .expect("refused");
    // As the binary prints it: the error, then its causes.
    let err = format!("{err}: {}", stanch_log::Sources(&err));
    let _ = std::fs::remove_file(&key);
    assert!(err.contains("models.m.pools.p.endpoints[0]"), "{err}");
    assert!(err.contains("header"), "{err}");
    assert!(!err.contains("sk-one"), "the key is never shown: {err}");
}

#[tokio::test]
async fn the_proxied_routes_take_only_post_and_the_others_only_get() {
    let f = fleet().await;
    let http = &f.gw.http;
    let base = &f.gw.base;
    for path in ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"] {
        let r = http.get(format!("{base}{path}")).send().await.unwrap();
        assert_eq!(r.status(), 405, "GET {path}");
        assert_eq!(r.headers()["allow"], "POST");
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["error"]["code"], "method_not_allowed");
    }
    for path in [
        "/v1/models",
        "/v1/status",
        "/status",
        "/metrics",
        "/healthz",
    ] {
        let r = http.get(format!("{base}{path}")).send().await.unwrap();
        assert_eq!(r.status(), 200, "GET {path}");
        let r = http.post(format!("{base}{path}")).send().await.unwrap();
        assert_eq!(r.status(), 405, "POST {path}");
    }
    let r = http
        .post(format!("{base}/v1/chat/completions/"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404, "paths match exactly");
    let r = http
        .post(format!("{base}/v1/embeddings"))
        .bearer_auth("acme-key")
        .json(&serde_json::json!({"model": "qwen-72b", "input": "hello"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["object"], "list");
}

/// A table whose split the wire does not allow is refused before it is applied, naming
/// the model and the field: the controller shows it as a NACK.
#[test]
fn a_table_with_a_malformed_split_is_refused_naming_the_field() {
    let config = stanch_gateway::config::GatewayConfig::from_yaml(
        "models:\n  qwen-72b:\n    pools:\n      - {name: dc-a, endpoints: [{url: 'http://127.0.0.1:9'}]}\n",
    )
    .unwrap();
    let validate = stanch_gateway::Gateway::validator(&config);
    let mut table: stanch_api::RouteTable = serde_json::from_value(serde_json::json!({
        "version": 1, "epoch": "e", "hash": "", "generated_at": "2026-12-07T00:00:00Z",
        "models": {"qwen-72b": {"rung": "failover", "pool": "dc-b", "alias": null, "faq": null,
            "since": "2026-12-07T00:00:00Z", "lease_until": "2026-12-07T00:02:00Z",
            "reason": "", "overridden": false,
            "shares": [{"pool": "dc-a", "percent": 25}, {"pool": "dc-b", "percent": 75}]}},
        "blocked": []
    }))
    .unwrap();
    assert_eq!(validate(&table), Ok(()), "a split as the wire allows it");
    table.models.get_mut("qwen-72b").unwrap().shares[1].percent = 70;
    assert_eq!(
        validate(&table),
        Err(stanch_api::Invalid::new(
            "models.qwen-72b.shares",
            "they sum to 95, not 100"
        ))
    );
}
