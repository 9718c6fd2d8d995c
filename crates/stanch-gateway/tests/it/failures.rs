//! Every upstream failure class, non-streaming and streaming.

use std::time::Duration;

use serde_json::{Value, json};
use stanch_api::Rung;
use stanch_mock::MockConfig;
use stanch_testkit::http::Fetch;
use tokio::time::Instant;

use crate::support::*;

/// Three endpoints of qwen-72b in one pool.
async fn three() -> (Setup, Vec<Upstream>) {
    let ups = vec![
        Upstream::start("qwen-72b", "a").await,
        Upstream::start("qwen-72b", "b").await,
        Upstream::start("qwen-72b", "c").await,
    ];
    let yaml = format!(
        "models:\n  qwen-72b:\n    faq: default\n    pools:\n      - name: dc-a\n        endpoints: [{{url: '{{a}}'}}, {{url: '{{b}}'}}, {{url: '{{c}}'}}]\n{POLICY}"
    );
    let gw = gateway(&yaml, &[("a", &ups[0]), ("b", &ups[1]), ("c", &ups[2])]).await;
    (gw, ups)
}

fn total(ups: &[Upstream]) -> u64 {
    ups.iter().map(Upstream::requests).sum()
}

#[tokio::test]
async fn serves_spreads_load_and_labels_responses() {
    let (gw, ups) = three().await;
    for _ in 0..30 {
        let r = gw.chat("qwen-72b", false).await;
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["x-stanch-route-version"], "0");
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["model"], "qwen-72b", "the model that answered");
    }
    for u in &ups {
        assert!(u.requests() > 0, "every endpoint gets a share");
    }
    let models: Value = gw
        .http
        .get(format!("{}/v1/models", gw.base))
        .fetch_json()
        .await;
    assert_eq!(models["data"][0]["id"], "qwen-72b");
    let e = gw
        .http
        .post(format!("{}/v1/embeddings", gw.base))
        .json(&json!({"model": "qwen-72b", "input": "hi"}))
        .send()
        .await
        .unwrap();
    assert_eq!(e.status(), 200);
}

async fn retried_elsewhere(fault: Value, stream: bool) {
    let (gw, ups) = three().await;
    ups[0].fault(fault.clone());
    for _ in 0..12 {
        let r = gw.chat("qwen-72b", stream).await;
        assert_eq!(r.status(), 200, "{fault}");
        let text = r.text().await.unwrap();
        if stream {
            let ev = events(&text);
            assert_eq!(
                ev.last().map(String::as_str),
                Some("[DONE]"),
                "{fault}: {text}"
            );
            assert_eq!(content(&ev).split(' ').count(), 4, "a whole answer: {text}");
        }
    }
    assert!(
        ups[0].requests() <= 3,
        "{fault}: the failing endpoint saw {} attempts, at most the threshold",
        ups[0].requests()
    );
}

#[tokio::test]
async fn server_errors_are_retried_elsewhere_and_block() {
    retried_elsewhere(json!({"kind": "status", "status": 503}), false).await;
    retried_elsewhere(json!({"kind": "status", "status": 500}), true).await;
}

#[tokio::test]
async fn quota_and_rate_limits_move_elsewhere() {
    retried_elsewhere(
        json!({"kind": "status", "status": 402, "code": "insufficient_quota"}),
        false,
    )
    .await;
    retried_elsewhere(json!({"kind": "status", "status": 429}), true).await;
}

#[tokio::test]
async fn a_local_rate_limiters_429s_never_count_against_the_endpoint() {
    let (gw, ups) = three().await;
    ups[0].fault(json!({"kind": "status", "status": 429, "local": true}));
    for _ in 0..30 {
        assert_eq!(gw.chat("qwen-72b", false).await.status(), 200);
    }
    // Passive blocking would have stopped after 3 in a row: the endpoint keeps its
    // share, and every one of its answers was the limiter's.
    let limited = ups[0].requests();
    assert!(limited > 3, "still tried after the threshold: {limited}");
    let status = gw.status().await;
    let seen = status["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["url"] == ups[0].base.as_str())
        .unwrap()
        .clone();
    assert_eq!(seen["state"], "ok", "{seen}");
    assert_eq!(seen["failures"], 0, "{seen}");
    let metrics = gw.metrics().await;
    let count = |outcome: &str| {
        sample(
            &metrics,
            "stanch_gateway_upstream_attempts_total",
            &[("endpoint", ups[0].base.as_str()), ("outcome", outcome)],
        )
    };
    assert_eq!(count("local_rate_limited"), limited as f64);
    assert_eq!(count("rate_limited"), 0.0);
}

#[tokio::test]
async fn retry_after_keeps_the_endpoint_away_at_once() {
    let (gw, ups) = three().await;
    ups[0].fault(json!({"kind": "status", "status": 429, "retry_after": 30}));
    for _ in 0..20 {
        assert_eq!(gw.chat("qwen-72b", false).await.status(), 200);
    }
    assert_eq!(
        ups[0].requests(),
        1,
        "after its Retry-After it gets nothing"
    );
    let metrics = gw.metrics().await;
    let blocked = |gauge: &str, up: &Upstream, value: u8| {
        format!(
            "stanch_gateway_{gauge}{{endpoint=\"{}\",model=\"qwen-72b\",pool=\"dc-a\"}} {value}",
            up.base
        )
    };
    for gauge in ["endpoint_blocked", "endpoint_blocked_locally"] {
        assert!(
            metrics.contains(&blocked(gauge, &ups[0], 1)),
            "the blocked endpoint, with its pool, for the pool rule:\n{metrics}"
        );
        assert!(metrics.contains(&blocked(gauge, &ups[1], 0)), "{metrics}");
    }
}

#[tokio::test]
async fn resets_and_refused_connections_are_retried() {
    retried_elsewhere(json!({"kind": "reset"}), false).await;
    retried_elsewhere(json!({"kind": "reset"}), true).await;
    let up = Upstream::start("qwen-72b", "ok").await;
    let yaml = format!(
        "models:\n  qwen-72b:\n    pools:\n      - name: p\n        endpoints: [{{url: 'http://127.0.0.1:9'}}, {{url: '{{ok}}'}}]\n{POLICY}"
    );
    let gw = gateway(&yaml, &[("ok", &up)]).await;
    for _ in 0..5 {
        assert_eq!(gw.chat("qwen-72b", false).await.status(), 200);
    }
}

#[tokio::test]
async fn no_headers_in_time_is_retried_once_elsewhere() {
    for (fault, stream) in [
        (json!({"kind": "latency", "ms": 3000}), false),
        (json!({"kind": "latency", "ms": 3000}), true),
        (json!({"kind": "no_response"}), false),
        (json!({"kind": "no_response"}), true),
    ] {
        let (gw, ups) = three().await;
        ups[0].fault(fault.clone());
        let started = Instant::now();
        for _ in 0..6 {
            let r = gw.chat("qwen-72b", stream).await;
            assert_eq!(r.status(), 200);
            let text = r.text().await.unwrap();
            if stream {
                assert_eq!(
                    events(&text).last().map(String::as_str),
                    Some("[DONE]"),
                    "{fault}"
                );
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "{fault} (stream: {stream}): never waited out the slow endpoint"
        );
        assert!(
            ups[0].requests() <= 3,
            "{fault}: not retried on the slow endpoint within a request"
        );
    }
}

#[tokio::test]
async fn a_slow_first_token_is_retried_before_anything_reaches_the_caller() {
    let (gw, ups) = three().await;
    ups[0].fault(json!({"kind": "slow_first_token", "ms": 3000}));
    for _ in 0..6 {
        let r = gw.chat("qwen-72b", true).await;
        assert_eq!(r.status(), 200);
        let ev = events(&r.text().await.unwrap());
        assert_eq!(ev.last().map(String::as_str), Some("[DONE]"));
        assert_eq!(content(&ev).split(' ').count(), 4);
    }
}

async fn only(fault: Value) -> (Setup, Upstream) {
    let up = Upstream::start("qwen-72b", "only").await;
    up.fault(fault);
    let yaml = format!(
        "models:\n  qwen-72b:\n    pools:\n      - name: p\n        endpoints: [{{url: '{{u}}'}}]\n{POLICY}"
    );
    let gw = gateway(&yaml, &[("u", &up)]).await;
    (gw, up)
}

#[tokio::test]
async fn a_stream_cut_or_broken_after_commit_ends_with_an_explicit_error() {
    // A clean end without the final chunk, and a connection aborted mid-body.
    for kind in ["cut", "break"] {
        let (gw, _up) = only(json!({"kind": kind, "after_tokens": 2})).await;
        let ev = events(&gw.chat("qwen-72b", true).await.text().await.unwrap());
        assert_eq!(
            content(&ev).split(' ').filter(|w| !w.is_empty()).count(),
            2,
            "{kind}: {ev:#?}"
        );
        let last: Value = serde_json::from_str(ev.last().unwrap()).unwrap();
        assert_eq!(
            last["error"]["code"], "stream_interrupted",
            "{kind}: never presented as complete"
        );
        assert!(!ev.iter().any(|e| e == "[DONE]"), "{kind}");
    }
}

#[tokio::test]
async fn a_stalled_stream_ends_with_an_explicit_error() {
    let (gw, _up) = only(json!({"kind": "stall", "after_tokens": 1})).await;
    let started = Instant::now();
    let ev = events(&gw.chat("qwen-72b", true).await.text().await.unwrap());
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "the idle timeout ends it"
    );
    let last: Value = serde_json::from_str(ev.last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "stream_interrupted");
}

#[tokio::test]
async fn a_malformed_chunk_is_dropped_and_the_stream_continues() {
    let (gw, _up) = only(json!({"kind": "malformed_chunk", "at_token": 1})).await;
    let ev = events(&gw.chat("qwen-72b", true).await.text().await.unwrap());
    assert!(
        ev.iter()
            .all(|e| e == "[DONE]" || serde_json::from_str::<Value>(e).is_ok()),
        "{ev:?}"
    );
    assert_eq!(content(&ev).split(' ').count(), 4);
    assert_eq!(ev.last().map(String::as_str), Some("[DONE]"));
    let metrics = gw.metrics().await;
    assert!(
        metrics.contains("stanch_gateway_malformed_chunks_total 1"),
        "{metrics}"
    );
}

#[tokio::test]
async fn a_final_chunk_without_done_is_completed_promptly() {
    let (gw, _up) = only(json!({"kind": "missing_done"})).await;
    let started = Instant::now();
    let ev = events(&gw.chat("qwen-72b", true).await.text().await.unwrap());
    assert_eq!(ev.last().map(String::as_str), Some("[DONE]"));
    assert_eq!(content(&ev).split(' ').count(), 4);
    assert!(started.elapsed() < Duration::from_secs(1));
}

#[tokio::test]
async fn caller_faults_are_not_retried_and_pass_through() {
    let ups = [
        Upstream::with({
            let mut c = MockConfig::new("qwen-72b", "small");
            c.max_context_words = 2;
            c
        })
        .await,
        Upstream::start("qwen-72b", "other").await,
    ];
    let yaml = format!(
        "models:\n  qwen-72b:\n    pools:\n      - name: p\n        endpoints: [{{url: '{{a}}'}}]\n      - name: q\n        endpoints: [{{url: '{{b}}'}}]\n{POLICY}"
    );
    let gw = gateway(&yaml, &[("a", &ups[0]), ("b", &ups[1])]).await;
    let r = gw
        .chat_as("qwen-72b", false, "acme-key", "a prompt that is too long")
        .await;
    assert_eq!(r.status(), 400);
    let body: Value = r.json().await.unwrap();
    assert_eq!(
        body["error"]["code"], "context_length_exceeded",
        "the upstream's error, unchanged"
    );
    assert_eq!(ups[1].requests(), 0, "not retried");
}

#[tokio::test]
async fn too_long_prompts_go_to_the_larger_context_model() {
    let small = Upstream::with({
        let mut c = MockConfig::new("qwen-72b", "small");
        c.max_context_words = 2;
        c
    })
    .await;
    let large = Upstream::start("qwen-72b-128k", "large").await;
    let yaml = format!(
        "models:\n  qwen-72b:\n    larger_context: qwen-72b-128k\n    pools:\n      - name: p\n        endpoints: [{{url: '{{s}}'}}]\n  qwen-72b-128k:\n    pools:\n      - name: p\n        endpoints: [{{url: '{{l}}'}}]\n{POLICY}"
    );
    let gw = gateway(&yaml, &[("s", &small), ("l", &large)]).await;
    let r = gw
        .chat_as("qwen-72b", false, "acme-key", "a prompt that is too long")
        .await;
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["model"], "qwen-72b-128k");
}

#[tokio::test]
async fn when_everything_fails_the_caller_gets_the_faq_not_a_5xx() {
    let (gw, ups) = three().await;
    for u in &ups {
        u.fault(json!({"kind": "status", "status": 503}));
    }
    for stream in [false, true] {
        let r = gw
            .chat_as(
                "qwen-72b",
                stream,
                "acme-key",
                "how do I reset my password?",
            )
            .await;
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["x-llm-degraded"], "static");
        let text = r.text().await.unwrap();
        assert!(text.contains("reset link"), "{text}");
    }
    let e = gw
        .http
        .post(format!("{}/v1/embeddings", gw.base))
        .json(&json!({"model": "qwen-72b", "input": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(e.status(), 503, "embeddings have no FAQ to fall back to");
}

#[tokio::test]
async fn a_failing_endpoint_gets_no_traffic_after_the_threshold() {
    let (gw, ups) = three().await;
    ups[1].fault(json!({"kind": "status", "status": 503}));
    for _ in 0..60 {
        assert_eq!(
            gw.chat("qwen-72b", false).await.status(),
            200,
            "no client-visible error"
        );
    }
    assert!(
        ups[1].requests() <= 3,
        "at most the threshold: it saw {}",
        ups[1].requests()
    );
    assert!(ups[1].requests() >= 1, "it was tried");
    let status: Value = gw.status().await;
    let failing = status["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["url"] == ups[1].base.as_str())
        .unwrap();
    assert_eq!(failing["successes"], 0);
    assert!(failing["failures"].as_u64().unwrap() >= 1);
    assert!(total(&ups) >= 60);
}

#[tokio::test]
async fn probes_lift_a_block_early_once_the_endpoint_answers() {
    let ups = [
        Upstream::start("qwen-72b", "a").await,
        Upstream::start("qwen-72b", "b").await,
    ];
    // Alone in the primary pool, the failing endpoint is tried first on every request.
    let yaml = "models:\n  qwen-72b:\n    pools:\n      - {name: p1, endpoints: [{url: '{a}'}]}\n      - {name: p2, endpoints: [{url: '{b}'}]}\n\
        retry: {backoff_base: 1ms, backoff_max: 2ms, budget_min_retries: 1000}\n\
        blocking: {consecutive_failures: 2, ttl: 60s, jitter: 0, slow_start: 0s, probe: {enabled: true, interval: 100ms, successes: 2, timeout: 1s}}\n";
    let gw = gateway(yaml, &[("a", &ups[0]), ("b", &ups[1])]).await;
    ups[0].fault(json!({"kind": "status", "status": 503}));
    for _ in 0..10 {
        assert_eq!(gw.chat("qwen-72b", false).await.status(), 200);
    }
    let state = |s: &Value| {
        s["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["url"] == ups[0].base.as_str())
            .unwrap()["state"]
            .clone()
    };
    let status: Value = gw.status().await;
    assert_eq!(state(&status), "blocked");
    // Failing probes keep it blocked.
    tokio::time::sleep(Duration::from_millis(350)).await;
    let status: Value = gw.status().await;
    assert_eq!(state(&status), "blocked");

    ups[0].fault(json!({"kind": "none"}));
    let mut lifted = false;
    for _ in 0..40 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let status: Value = gw.status().await;
        if state(&status) != "blocked" {
            lifted = true;
            break;
        }
    }
    assert!(lifted, "two successful probes lift the 60 s block early");
    let stats = ups[0].mock.stats();
    assert!(stats.probes >= 2, "probes are marked as such: {stats:?}");
    let failures_seen = ups[0]
        .mock
        .stats()
        .by_outcome
        .get("fault:status")
        .copied()
        .unwrap_or(0);
    assert!(failures_seen >= 2);
    let before = ups[0].requests();
    for _ in 0..20 {
        gw.chat("qwen-72b", false).await;
    }
    assert!(ups[0].requests() > before, "it takes traffic again");
}

#[tokio::test]
async fn a_spent_retry_budget_answers_from_the_faq_instead_of_adding_load() {
    let ups = [
        Upstream::start("qwen-72b", "a").await,
        Upstream::start("qwen-72b", "b").await,
    ];
    // No retries allowed at all: the budget is always spent.
    let yaml = format!(
        "models:\n  qwen-72b:\n    faq: default\n    pools:\n      - {{name: p1, endpoints: [{{url: '{{a}}'}}]}}\n      - {{name: p2, endpoints: [{{url: '{{b}}'}}]}}\n\
        retry: {{budget_ratio: 0, budget_min_retries: 0}}\nblocking: {{consecutive_failures: 0}}\n{}",
        POLICY.replace("retry: {max_attempts: 4, attempts_per_pool: 3, backoff_base: 1ms, backoff_max: 5ms, budget_min_retries: 1000}\n", "")
            .replace("blocking: {consecutive_failures: 3, jitter: 0, ttl: 60s, slow_start: 0s}\n", "")
    );
    let gw = gateway(&yaml, &[("a", &ups[0]), ("b", &ups[1])]).await;
    ups[0].fault(json!({"kind": "status", "status": 503}));
    for _ in 0..5 {
        let r = gw.chat("qwen-72b", false).await;
        assert_eq!(r.status(), 200, "never a bare 5xx");
        assert_eq!(r.headers()["x-llm-degraded"], "static");
    }
    assert_eq!(ups[1].requests(), 0, "no retry was sent to the other pool");
    assert!(
        gw.metrics()
            .await
            .contains("stanch_gateway_retry_budget_exhausted_total 5")
    );
}

#[tokio::test]
async fn pools_the_table_failed_away_from_are_probed_and_counted() {
    let a = Upstream::start("qwen-72b", "dc-a").await;
    let b = Upstream::start("qwen-72b", "dc-b").await;
    let yaml = "models:\n  qwen-72b:\n    pools:\n      - {name: dc-a, endpoints: [{url: '{a}'}]}\n      - {name: dc-b, endpoints: [{url: '{b}'}]}\n\
        blocking: {consecutive_failures: 3, probe: {enabled: true, interval: 100ms, successes: 2, timeout: 1s}}\n";
    let mut gw = gateway(yaml, &[("a", &a), ("b", &b)]).await;
    a.fault(json!({"kind": "status", "status": 503}));
    gw.table(&[("qwen-72b", Rung::Failover, "dc-b", None)], vec![]);
    for _ in 0..5 {
        assert_eq!(gw.chat("qwen-72b", false).await.status(), 200);
    }
    let probes = |pool: &'static str, outcome: &'static str| {
        let gw = &gw;
        async move {
            let text = gw.metrics().await;
            sample(
                &text,
                "stanch_gateway_probes_total",
                &[("pool", pool), ("outcome", outcome)],
            )
        }
    };
    tokio::time::sleep(Duration::from_millis(450)).await;
    // dc-a gets probes and only probes; dc-b, serving, gets none.
    let failed = probes("dc-a", "failure").await;
    assert!(failed >= 2.0, "failing probes of dc-a counted: {failed}");
    assert_eq!(probes("dc-a", "success").await, 0.0);
    assert_eq!(
        probes("dc-b", "failure").await + probes("dc-b", "success").await,
        0.0
    );
    let (sa, sb) = (a.mock.stats(), b.mock.stats());
    assert_eq!(sa.requests, sa.probes, "dc-a saw no caller traffic: {sa:?}");
    assert_eq!(sb.probes, 0);
    assert_eq!(sb.requests, 5);

    // dc-a recovers: its probes now say so, for the rules to see.
    a.fault(json!({"kind": "none"}));
    tokio::time::sleep(Duration::from_millis(350)).await;
    assert!(probes("dc-a", "success").await >= 2.0);

    // Back to normal routing: dc-a has traffic again and is not probed.
    gw.table(&[("qwen-72b", Rung::Normal, "dc-a", None)], vec![]);
    tokio::time::sleep(Duration::from_millis(150)).await;
    let before = a.mock.stats().probes;
    tokio::time::sleep(Duration::from_millis(350)).await;
    assert_eq!(a.mock.stats().probes, before, "no probes while dc-a serves");

    // Static: callers get the FAQ, so every pool of the model is probed.
    gw.table(&[("qwen-72b", Rung::Static, "dc-a", None)], vec![]);
    tokio::time::sleep(Duration::from_millis(350)).await;
    assert!(a.mock.stats().probes > before, "dc-a probed while static");
    assert!(b.mock.stats().probes >= 2, "dc-b probed while static");
}

#[tokio::test]
async fn streams_pass_through_as_tokens_arrive() {
    let mut config = MockConfig::new("qwen-72b", "a");
    config.token_interval = Duration::from_millis(100);
    let a = Upstream::with(config).await;
    let yaml = format!(
        "models:\n  qwen-72b:\n    pools:\n      - name: dc-a\n        endpoints: [{{url: '{{a}}'}}]\n{POLICY}"
    );
    let gw = gateway(&yaml, &[("a", &a)]).await;
    let started = Instant::now();
    let mut r = gw.chat("qwen-72b", true).await;
    assert_eq!(r.status(), 200);
    // When each piece of the answer reached the caller, and what it held.
    let mut pieces = Vec::new();
    while let Some(bytes) = r.chunk().await.unwrap() {
        pieces.push((
            started.elapsed(),
            String::from_utf8_lossy(&bytes).into_owned(),
        ));
    }
    let text: String = pieces.iter().map(|(_, p)| p.as_str()).collect();
    assert_eq!(content(&events(&text)).split_whitespace().count(), 4);
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    let with_content: Vec<Duration> = pieces
        .iter()
        .filter(|(_, p)| p.contains("\"content\""))
        .map(|(at, _)| *at)
        .collect();
    assert!(
        with_content.len() >= 4,
        "each token is its own write when tokens come apart: {pieces:?}"
    );
    let (first, last) = (with_content[0], *with_content.last().unwrap());
    assert!(
        last - first >= Duration::from_millis(250),
        "passed on as they came, not gathered: {pieces:?}"
    );
}

#[tokio::test]
async fn a_caller_that_leaves_mid_stream_frees_its_endpoint_and_costs_it_nothing() {
    let mut config = MockConfig::new("qwen-72b", "a");
    // Tokens 2 s apart: the answer would take 6 s, the check below waits at most 1 s.
    config.token_interval = Duration::from_secs(2);
    let a = Upstream::with(config).await;
    // An idle limit above the token interval, so the stream is not cut as stalled.
    let policy = POLICY.replace("stream_idle: 400ms", "stream_idle: 5s");
    let yaml = format!(
        "models:\n  qwen-72b:\n    pools:\n      - name: dc-a\n        endpoints: [{{url: '{{a}}'}}]\n{policy}"
    );
    let gw = gateway(&yaml, &[("a", &a)]).await;
    let in_flight = async || gw.status().await["endpoints"][0]["in_flight"].as_u64();
    let mut r = gw.chat("qwen-72b", true).await;
    assert!(r.chunk().await.unwrap().is_some(), "the first token");
    assert_eq!(in_flight().await, Some(1), "counted while it streams");
    drop(r);
    stanch_testkit::wait::until(
        "freed once the caller left, not when the answer would have ended",
        Duration::from_secs(1),
        || async { in_flight().await == Some(0) },
    )
    .await;
    let status = gw.status().await;
    assert_eq!(
        status["endpoints"][0]["failures"], 0,
        "not the endpoint's fault: {status}"
    );
}

#[tokio::test]
async fn a_whole_answer_over_the_size_limit_is_a_failed_attempt() {
    let a = Upstream::start("qwen-72b", "a").await;
    let yaml = format!(
        "models:\n  qwen-72b:\n    faq: default\n    pools:\n      - name: dc-a\n        endpoints: [{{url: '{{a}}'}}]\n{POLICY}max_response_bytes: 64\n"
    );
    let gw = gateway(&yaml, &[("a", &a)]).await;
    let r = gw.chat("qwen-72b", false).await;
    assert_eq!(r.status(), 200, "the caller still gets an answer");
    assert_eq!(r.headers()["x-llm-degraded"], "static", "from the FAQ");
    let metrics = gw.metrics().await;
    assert!(
        sample(
            &metrics,
            "stanch_gateway_upstream_attempts_total",
            &[("outcome", "too_large")]
        ) >= 1.0,
        "{metrics}"
    );
    // A stream is never held whole, so the limit is not for it.
    let r = gw.chat("qwen-72b", true).await;
    assert_eq!(r.status(), 200);
    assert!(r.headers().get("x-llm-degraded").is_none());
    assert!(r.text().await.unwrap().ends_with("data: [DONE]\n\n"));
}

/// Requests already out when an endpoint starts failing come back well (the upstream
/// took them before the fault); they must not reset its run of failures, or an
/// endpoint failing every new request is never blocked while old answers trickle in.
/// Non-streamed: slow answers. Streamed: answers whose first token came at once but
/// whose last comes much later, which is how LLM streams outlive the start of a fault.
#[tokio::test]
async fn answers_to_requests_sent_before_a_fault_do_not_reset_its_failure_run() {
    for stream in [false, true] {
        answers_before_a_fault(stream).await;
    }
}

async fn answers_before_a_fault(stream: bool) {
    let mut config = MockConfig::new("qwen-72b", "dc-a");
    if stream {
        // Four tokens and the end, 200 ms apart.
        config.token_interval = Duration::from_millis(200);
    }
    let a = Upstream::with(config).await;
    let b = Upstream::start("qwen-72b", "dc-b").await;
    let yaml = format!(
        "models:\n  qwen-72b:\n    faq: default\n    pools:\n      - {{name: dc-a, endpoints: [{{url: '{{a}}'}}]}}\n      - {{name: dc-b, endpoints: [{{url: '{{b}}'}}]}}\n{policy}",
        policy = POLICY.replace(
            "first_byte: 400ms, first_token: 400ms",
            "first_byte: 5s, first_token: 5s"
        )
    );
    let gw = std::sync::Arc::new(gateway(&yaml, &[("a", &a), ("b", &b)]).await);
    // Three slow answers on their way from dc-a...
    if !stream {
        a.fault(json!({"kind": "latency", "ms": 1000, "count": 3}));
    }
    let slow: Vec<_> = (0..3)
        .map(|_| {
            let gw = gw.clone();
            tokio::spawn(async move {
                let r = gw.chat("qwen-72b", stream).await;
                (r.status(), r.text().await.unwrap())
            })
        })
        .collect();
    let arrived = Instant::now();
    while a.requests() < 3 {
        assert!(
            arrived.elapsed() < Duration::from_millis(800),
            "sent to dc-a"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // ...when it starts failing every new request: one failure, retried on dc-b.
    a.fault(json!({"kind": "status", "status": 503}));
    assert_eq!(gw.chat("qwen-72b", false).await.status(), 200);
    assert_eq!(a.requests(), 4);
    for s in slow {
        let (status, text) = s.await.unwrap();
        assert_eq!(status, 200, "answered well by dc-a");
        if stream {
            assert!(text.ends_with("data: [DONE]\n\n"), "whole: {text}");
        }
    }
    // The run of failures goes on: two more reach the threshold (3), not three.
    for _ in 0..5 {
        assert_eq!(gw.chat("qwen-72b", false).await.status(), 200);
    }
    assert_eq!(
        a.requests(),
        6,
        "dc-a blocked after its third failure in a row (stream: {stream})"
    );
    let metrics = gw.metrics().await;
    assert_eq!(
        sample(
            &metrics,
            "stanch_gateway_endpoint_blocked_locally",
            &[("pool", "dc-a")]
        ),
        1.0
    );
}
