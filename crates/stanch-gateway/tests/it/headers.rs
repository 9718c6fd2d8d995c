//! Headers through the gateway: the caller's go up (never its credentials), every
//! request has an `X-Request-Id`, the upstream's come back, and the gateway's own 503
//! says when to retry.

use serde_json::json;
use stanch_mock::MockConfig;

use crate::support::*;

/// One endpoint `{a}`, with the API key in `key_file` if given.
fn config(key_file: Option<&std::path::Path>) -> String {
    let key = key_file.map_or(String::new(), |f| {
        format!(", api_key_file: '{}'", f.display())
    });
    format!(
        "models:\n  qwen-72b:\n    pools:\n      - name: dc-a\n        endpoints: [{{url: '{{a}}'{key}}}]\n{POLICY}"
    )
}

async fn send(gw: &Setup, stream: bool, extra: &[(&str, &str)]) -> reqwest::Response {
    let body = json!({"model": "qwen-72b", "stream": stream, "max_tokens": 3,
                      "messages": [{"role": "user", "content": "hi"}]});
    let mut request = gw
        .http
        .post(format!("{}/v1/chat/completions", gw.base))
        .bearer_auth("acme-key")
        .json(&body);
    for (k, v) in extra {
        request = request.header(*k, *v);
    }
    request.send().await.unwrap()
}

#[tokio::test]
async fn callers_headers_go_up_and_the_upstreams_come_back() {
    let mut mock = MockConfig::new("qwen-72b", "a");
    mock.api_key = Some("endpoint-key".into());
    let a = Upstream::with(mock).await;
    let dir = tempfile::tempdir().unwrap();
    let key_file = dir.path().join("key");
    std::fs::write(&key_file, "endpoint-key\n").unwrap();
    let gw = gateway(&config(Some(&key_file)), &[("a", &a)]).await;
    let traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    for stream in [false, true] {
        let r = send(
            &gw,
            stream,
            &[
                ("traceparent", traceparent),
                ("tracestate", "congo=t61rcWkgMzE"),
                ("x-request-id", "caller-req-1"),
                ("openai-organization", "org-1"),
                ("cookie", "session=secret"),
                ("x-api-key", "caller-secret"),
            ],
        )
        .await;
        assert_eq!(
            r.status(),
            200,
            "the endpoint's key went up, or the mock would refuse"
        );
        let up = a.mock.last_request_headers().unwrap();
        assert_eq!(up["authorization"], "Bearer endpoint-key");
        assert_eq!(up["traceparent"], traceparent);
        assert_eq!(up["tracestate"], "congo=t61rcWkgMzE");
        assert_eq!(up["x-request-id"], "caller-req-1");
        assert_eq!(up["openai-organization"], "org-1");
        assert!(
            !up.contains_key("cookie") && !up.contains_key("x-api-key"),
            "{up:?}"
        );
        let h = r.headers();
        assert_eq!(h["x-request-id"], "caller-req-1", "stream: {stream}");
        assert_eq!(h["openai-processing-ms"], "7");
        assert_eq!(h["x-ratelimit-remaining-requests"], "9999");
        assert!(h.contains_key("x-stanch-route-version"));
        assert_eq!(h.get_all("content-type").iter().count(), 1);
        let _ = r.text().await.unwrap();
    }
}

#[tokio::test]
async fn every_request_has_an_id_and_a_gateway_503_says_when_to_retry() {
    let a = Upstream::start("qwen-72b", "a").await;
    let gw = gateway(&config(None), &[("a", &a)]).await;
    let r = send(&gw, false, &[]).await;
    let sent = a.mock.last_request_headers().unwrap()["x-request-id"].clone();
    assert_eq!(sent.len(), 32, "a new id went up: {sent:?}");
    assert_eq!(r.headers()["x-request-id"], sent, "and came back");

    // Every attempt fails, and the model has no FAQ: the gateway's own 503.
    a.fault(json!({"kind": "status", "status": 500}));
    let embeddings = gw
        .http
        .post(format!("{}/v1/embeddings", gw.base))
        .header("x-request-id", "caller-req-2")
        .json(&json!({"model": "qwen-72b", "input": "hi"}))
        .send()
        .await
        .unwrap();
    assert_eq!(embeddings.status(), 503);
    assert_eq!(embeddings.headers()["retry-after"], "1");
    assert_eq!(embeddings.headers()["x-request-id"], "caller-req-2");
}
