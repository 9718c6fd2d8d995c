//! Every field that reaches the engine has a bound, and a value past it gets a 400
//! that names the field, with nothing recorded. The table here and the one in
//! docs/api.md ("Bounds on input") list the same fields; a test holds them together.

use serde_json::{Value, json};

use crate::support::*;

/// (route, field as docs/api.md names it, a body with a value past its bound).
fn rows() -> Vec<(&'static str, &'static str, Value)> {
    let long = |n: usize| "x".repeat(n);
    let alert = |labels: Value, annotations: Value, starts: &str, ends: &str| {
        json!({"version": "4", "status": "firing", "receiver": "stanch", "alerts": [{
            "status": "firing", "labels": labels, "annotations": annotations,
            "startsAt": starts, "endsAt": ends}]})
    };
    let ok_labels =
        json!({"alertname": "A", "action": "trigger-failover", "target_model": "qwen-72b"});
    let many: serde_json::Map<String, Value> = (0..65)
        .map(|i| (format!("l{i}"), Value::String("v".into())))
        .collect();
    let report = |endpoint: Value| json!({"gateway": "gw-1", "endpoints": [endpoint]});
    let ep = |successes: u64, failures: u64, streak: u64| {
        json!({"endpoint": "http://a1:8000", "model": "qwen-72b",
               "successes": successes, "failures": failures, "consecutive_failures": streak})
    };
    vec![
        (
            "/v1/admin/force",
            "ttl",
            json!({"model": "qwen-72b", "rung": "static", "ttl": "31d", "reason": "r"}),
        ),
        (
            "/v1/admin/freeze",
            "ttl",
            json!({"ttl": "100000000h", "reason": "r"}),
        ),
        (
            "/v1/admin/block",
            "ttl",
            json!({"endpoint": "e", "ttl": "500000000y", "reason": "r"}),
        ),
        (
            "/v1/admin/block",
            "endpoint",
            json!({"endpoint": long(513), "reason": "r"}),
        ),
        (
            "/v1/admin/unblock",
            "endpoint",
            json!({"endpoint": long(513), "reason": "r"}),
        ),
        (
            "/v1/admin/block",
            "endpoint",
            json!({"endpoint": "a\nb", "reason": "r"}),
        ),
        (
            "/v1/admin/unblock",
            "endpoint",
            json!({"endpoint": "a\u{1b}b", "reason": "r"}),
        ),
        (
            "/v1/reports",
            "endpoints[0].endpoint",
            report(json!({"endpoint": "a\rb", "model": "qwen-72b",
                "successes": 0, "failures": 0, "consecutive_failures": 0})),
        ),
        (
            "/v1/admin/force",
            "model",
            json!({"model": "gpt-9", "rung": "static", "reason": "r"}),
        ),
        (
            "/v1/admin/force",
            "rung",
            json!({"model": "qwen-72b", "rung": "panic", "reason": "r"}),
        ),
        (
            "/v1/admin/failback",
            "action",
            json!({"model": "qwen-72b", "action": "pause", "reason": "r"}),
        ),
        (
            "/v1/admin/thaw",
            "reason",
            json!({"reason": "集".repeat(1025)}),
        ),
        ("/v1/admin/unblock-all", "reason", json!({"reason": " "})),
        (
            "/v1/alerts/alertmanager",
            "alerts[0].startsAt",
            alert(
                ok_labels.clone(),
                json!({}),
                "+13434-11-12T00:00:00Z",
                "0001-01-01T00:00:00Z",
            ),
        ),
        (
            "/v1/alerts/alertmanager",
            "alerts[0].endsAt",
            alert(
                ok_labels.clone(),
                json!({}),
                "2026-11-30T00:00:00Z",
                "10000-01-01T00:00:00Z",
            ),
        ),
        (
            "/v1/alerts/alertmanager",
            "alerts[0].labels",
            alert(
                Value::Object(many.clone()),
                json!({}),
                "2026-11-30T00:00:00Z",
                "0001-01-01T00:00:00Z",
            ),
        ),
        (
            "/v1/alerts/alertmanager",
            "alerts[0].labels.alertname",
            alert(
                json!({"alertname": long(4097)}),
                json!({}),
                "2026-11-30T00:00:00Z",
                "0001-01-01T00:00:00Z",
            ),
        ),
        (
            "/v1/alerts/alertmanager",
            "alerts[0].labels",
            alert(
                json!({"alertname": long(4000), "a": long(4000), "b": long(300)}),
                json!({}),
                "2026-11-30T00:00:00Z",
                "0001-01-01T00:00:00Z",
            ),
        ),
        (
            "/v1/alerts/alertmanager",
            "alerts[0].annotations",
            alert(
                ok_labels,
                Value::Object(many.clone()),
                "2026-11-30T00:00:00Z",
                "0001-01-01T00:00:00Z",
            ),
        ),
        (
            "/v1/reports",
            "gateway",
            json!({"gateway": long(129), "endpoints": []}),
        ),
        (
            "/v1/reports",
            "endpoints[0].endpoint",
            report(
                json!({"endpoint": long(513), "model": "qwen-72b", "successes": 0, "failures": 0, "consecutive_failures": 0}),
            ),
        ),
        (
            "/v1/reports",
            "endpoints[0].model",
            report(
                json!({"endpoint": "e", "model": long(257), "successes": 0, "failures": 0, "consecutive_failures": 0}),
            ),
        ),
        (
            "/v1/reports",
            "endpoints[0].successes",
            report(ep(1_000_000_001, 0, 0)),
        ),
        (
            "/v1/reports",
            "endpoints[0].failures",
            report(ep(0, 1_000_000_001, 0)),
        ),
        (
            "/v1/reports",
            "endpoints[0].consecutive_failures",
            report(ep(0, 0, 1 << 33)),
        ),
    ]
}

fn token(path: &str) -> &'static str {
    if path.starts_with("/v1/admin") {
        ADMIN
    } else {
        INGEST
    }
}

#[tokio::test]
async fn a_value_past_its_bound_is_refused_naming_the_field_and_nothing_is_recorded() {
    let h = Harness::start().await;
    let before = h.routes().await;
    for (path, field, body) in rows() {
        let r = h.post(path, Some(token(path)), body.to_string()).await;
        let status = r.status();
        let e: Value = r.json().await.unwrap();
        assert_eq!(status, 400, "{path} {field}: {e}");
        let detail = e["detail"].as_str().unwrap();
        assert!(
            detail.contains(&format!("{field}:")) || detail.contains(&format!("{field} ")),
            "{path}: the error names {field}: {detail}"
        );
        assert!(
            detail.len() < 600,
            "the error does not echo the input: {detail}"
        );
    }
    let after = h.routes().await;
    assert_eq!(after["version"], before["version"], "nothing was recorded");
    assert_eq!(after["blocked"], before["blocked"]);
}

#[tokio::test]
async fn the_longest_allowed_values_are_accepted() {
    let h = Harness::start().await;
    for (path, body) in [
        (
            "/v1/admin/block",
            json!({"endpoint": "e".repeat(512), "ttl": "30d", "reason": "集".repeat(1024)}),
        ),
        ("/v1/admin/freeze", json!({"ttl": "30d", "reason": "r"})),
    ] {
        let r = h.post(path, Some(ADMIN), body.to_string()).await;
        assert_eq!(r.status(), 200, "{path}: {}", r.text().await.unwrap());
    }
    // The route table stays readable, with every time in RFC 3339.
    let table = h.routes().await;
    let until = table["blocked"][0]["until"].as_str().unwrap();
    assert!(
        stanch_api::Timestamp::parse_rfc3339(until).is_ok(),
        "{until}"
    );
}

#[test]
fn the_docs_list_the_same_fields() {
    let doc =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/api.md")).unwrap();
    let section = doc
        .split("## Bounds on input")
        .nth(1)
        .expect("docs/api.md has a \"Bounds on input\" section");
    let section = section.split("\n## ").next().unwrap();
    let mut documented: Vec<(String, String)> = section
        .lines()
        .filter(|l| l.starts_with("| `"))
        .map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            (
                cells[1].trim_matches('`').to_owned(),
                cells[2].trim_matches('`').to_owned(),
            )
        })
        .collect();
    let mut tested: Vec<(String, String)> = rows()
        .into_iter()
        .map(|(path, field, _)| (path.to_owned(), field.to_owned()))
        .collect();
    documented.sort();
    documented.dedup();
    tested.sort();
    tested.dedup();
    assert_eq!(
        documented, tested,
        "docs/api.md and this table list the same fields"
    );
}
