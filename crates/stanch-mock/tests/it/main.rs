//! The mock over real HTTP: every fault the gateway must survive, as a client sees it.

use std::time::Duration;

use serde_json::{Value, json};
use stanch_mock::{Mock, MockConfig};
use stanch_testkit::http::Fetch;
use tokio::time::Instant;

struct Instance {
    base: String,
    http: reqwest::Client,
}

async fn instance(configure: impl FnOnce(&mut MockConfig)) -> Instance {
    let mut config = MockConfig::new("qwen-72b", "m1");
    configure(&mut config);
    let base = stanch_mock::spawn(Mock::new(config)).await;
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    Instance { base, http }
}

impl Instance {
    async fn fault(&self, spec: Value) {
        let r = self
            .http
            .put(format!("{}/admin/fault", self.base))
            .body(spec.to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 204, "fault accepted");
    }

    async fn chat(&self, stream: bool) -> reqwest::Result<reqwest::Response> {
        let body = json!({"model": "qwen-72b", "stream": stream, "max_tokens": 5,
                          "messages": [{"role": "user", "content": "hello there"}]});
        self.http
            .post(format!("{}/v1/chat/completions", self.base))
            .json(&body)
            .send()
            .await
    }

    async fn stats(&self) -> Value {
        self.http
            .get(format!("{}/admin/stats", self.base))
            .fetch_json()
            .await
    }
}

/// The `data:` payloads of an SSE body.
fn events(text: &str) -> Vec<String> {
    text.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .map(str::to_owned)
        .collect()
}

#[tokio::test]
async fn answers_openai_shaped_and_deterministic() {
    let m = instance(|_| {}).await;
    let r = m.chat(false).await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-mock-instance"], "m1");
    let a: Value = r.json().await.unwrap();
    assert_eq!(a["object"], "chat.completion");
    assert_eq!(a["model"], "qwen-72b");
    assert_eq!(a["choices"][0]["finish_reason"], "stop");
    assert_eq!(a["usage"]["completion_tokens"], 5);
    let b: Value = m.chat(false).await.unwrap().json().await.unwrap();
    assert_eq!(
        a["choices"][0]["message"]["content"],
        b["choices"][0]["message"]["content"]
    );

    let text = m.chat(true).await.unwrap().text().await.unwrap();
    let ev = events(&text);
    assert_eq!(ev.len(), 5 + 2, "5 tokens, the final chunk, [DONE]: {text}");
    let last: Value = serde_json::from_str(&ev[5]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "stop");
    assert_eq!(ev[6], "[DONE]");

    let c: Value = m
        .http
        .post(format!("{}/v1/completions", m.base))
        .json(&json!({"prompt": "hi", "max_tokens": 3}))
        .fetch_json()
        .await;
    assert_eq!(c["object"], "text_completion");
    let e: Value = m
        .http
        .post(format!("{}/v1/embeddings", m.base))
        .json(&json!({"input": ["a", "b"]}))
        .fetch_json()
        .await;
    assert_eq!(e["data"].as_array().unwrap().len(), 2);
    assert_eq!(e["data"][0]["embedding"].as_array().unwrap().len(), 8);
    let models: Value = m
        .http
        .get(format!("{}/v1/models", m.base))
        .fetch_json()
        .await;
    assert_eq!(models["data"][0]["id"], "qwen-72b");
}

#[tokio::test]
async fn status_faults() {
    let m = instance(|_| {}).await;
    m.fault(json!({"kind": "status", "status": 429, "retry_after": 3}))
        .await;
    let r = m.chat(false).await.unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "3");
    m.fault(json!({"kind": "status", "status": 429})).await;
    assert!(
        m.chat(false)
            .await
            .unwrap()
            .headers()
            .get("retry-after")
            .is_none()
    );
    m.fault(json!({"kind": "status", "status": 402, "code": "insufficient_quota"}))
        .await;
    let r = m.chat(true).await.unwrap();
    assert_eq!(r.status(), 402);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "insufficient_quota");
    for status in [500, 503] {
        m.fault(json!({"kind": "status", "status": status})).await;
        assert_eq!(m.chat(false).await.unwrap().status(), status);
    }
}

#[tokio::test]
async fn a_limited_fault_ends_by_itself_and_stats_count_attempts() {
    let m = instance(|_| {}).await;
    m.fault(json!({"kind": "status", "status": 503, "count": 2}))
        .await;
    assert_eq!(m.chat(false).await.unwrap().status(), 503);
    assert_eq!(m.chat(false).await.unwrap().status(), 503);
    assert_eq!(m.chat(false).await.unwrap().status(), 200);
    m.http
        .post(format!("{}/v1/chat/completions", m.base))
        .header("x-stanch-probe", "1")
        .json(&json!({"messages": []}))
        .send()
        .await
        .unwrap();
    let stats = m.stats().await;
    assert_eq!(stats["requests"], 4);
    assert_eq!(stats["probes"], 1);
    assert_eq!(stats["by_outcome"]["fault:status"], 2);
    assert_eq!(stats["by_outcome"]["ok"], 2);
}

#[tokio::test]
async fn latency_and_slow_first_token() {
    let m = instance(|_| {}).await;
    m.fault(json!({"kind": "latency", "ms": 300})).await;
    let started = Instant::now();
    m.chat(false).await.unwrap();
    assert!(started.elapsed() >= Duration::from_millis(300));

    m.fault(json!({"kind": "slow_first_token", "ms": 300}))
        .await;
    let started = Instant::now();
    let r = m.chat(true).await.unwrap();
    let headers_after = started.elapsed();
    assert!(
        headers_after < Duration::from_millis(250),
        "headers come at once: {headers_after:?}"
    );
    r.text().await.unwrap();
    assert!(started.elapsed() >= Duration::from_millis(300));
}

#[tokio::test]
async fn stream_faults() {
    let m = instance(|_| {}).await;
    m.fault(json!({"kind": "cut", "after_tokens": 2})).await;
    let ev = events(&m.chat(true).await.unwrap().text().await.unwrap());
    assert_eq!(ev.len(), 2, "two tokens, no final chunk, no [DONE]");

    m.fault(json!({"kind": "missing_done"})).await;
    let ev = events(&m.chat(true).await.unwrap().text().await.unwrap());
    assert_eq!(ev.len(), 6);
    assert!(ev[5].contains("\"finish_reason\":\"stop\""));

    m.fault(json!({"kind": "malformed_chunk", "at_token": 1}))
        .await;
    let ev = events(&m.chat(true).await.unwrap().text().await.unwrap());
    assert_eq!(ev.len(), 8, "one extra, malformed");
    assert!(serde_json::from_str::<Value>(&ev[1]).is_err());
    assert_eq!(ev[7], "[DONE]");

    m.fault(json!({"kind": "stall", "after_tokens": 1})).await;
    let mut r = m.chat(true).await.unwrap();
    let first = r.chunk().await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&first).contains("data: "));
    let next = tokio::time::timeout(Duration::from_millis(300), r.chunk()).await;
    assert!(next.is_err(), "nothing more arrives");
}

#[tokio::test]
async fn reset_and_no_response() {
    let m = instance(|_| {}).await;
    m.fault(json!({"kind": "reset"})).await;
    let err = m.chat(false).await.unwrap_err();
    assert!(!err.is_timeout(), "closed, not slow: {err}");
    m.fault(json!({"kind": "no_response"})).await;
    let started = Instant::now();
    let r = tokio::time::timeout(Duration::from_millis(400), m.chat(false)).await;
    assert!(r.is_err(), "no answer");
    assert!(started.elapsed() >= Duration::from_millis(400));
    m.http
        .delete(format!("{}/admin/fault", m.base))
        .send()
        .await
        .unwrap();
    assert_eq!(m.chat(false).await.unwrap().status(), 200);
}

#[tokio::test]
async fn caller_faults_and_keys() {
    let m = instance(|c| {
        c.max_context_words = 3;
        c.api_key = Some("k1".into());
    })
    .await;
    assert_eq!(m.chat(false).await.unwrap().status(), 401, "no key");
    let long = json!({"messages": [{"role": "user", "content": "one two three four"}]});
    let r = m
        .http
        .post(format!("{}/v1/chat/completions", m.base))
        .bearer_auth("k1")
        .json(&long)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "context_length_exceeded");
}

#[tokio::test]
async fn metrics_stand_in_for_vllm() {
    let m = instance(|_| {}).await;
    let r = m
        .http
        .put(format!("{}/admin/kv-cache", m.base))
        .body(r#"{"value": 0.97}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    let text = m.http.get(format!("{}/metrics", m.base)).fetch_text().await;
    assert!(
        text.contains("vllm:gpu_cache_usage_perc{model_name=\"qwen-72b\"} 0.97"),
        "{text}"
    );
    let r = m
        .http
        .put(format!("{}/admin/kv-cache", m.base))
        .body(r#"{"value": 7}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let r = m
        .http
        .put(format!("{}/admin/fault", m.base))
        .body(r#"{"kind": "explode"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
}
