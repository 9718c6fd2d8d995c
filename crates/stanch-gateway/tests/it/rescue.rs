//! Rescues where a careful client would make them: the same endpoint again after a
//! one-off fault or a short `Retry-After`, when the model has nowhere else to go; and
//! blocked targets passed over for the rest of the plan.

use std::time::Duration;

use serde_json::{Value, json};
use tokio::time::Instant;

use crate::support::*;

/// qwen-72b with one pool of one endpoint (`a`), falling back to qwen-14b (`s`);
/// `retry` is added to the policy's retry settings.
async fn lone(retry: &str) -> (Setup, Upstream, Upstream) {
    let a = Upstream::start("qwen-72b", "a").await;
    let s = Upstream::start("qwen-14b", "s").await;
    let policy = POLICY.replace(
        "budget_min_retries: 1000}",
        &format!("budget_min_retries: 1000{retry}}}"),
    );
    let yaml = format!(
        "models:
  qwen-72b:
    faq: default
    fallbacks: [qwen-14b]
    pools:
      - {{name: dc-a, endpoints: [{{url: '{{a}}'}}]}}
  qwen-14b:
    pools:
      - {{name: dc-a, endpoints: [{{url: '{{s}}'}}]}}
{policy}"
    );
    let gw = gateway(&yaml, &[("a", &a), ("s", &s)]).await;
    (gw, a, s)
}

/// Sends one chat request; returns the model that answered and the attempts it took.
async fn answered(gw: &Setup, stream: bool) -> (String, u64) {
    let r = gw.chat("qwen-72b", stream).await;
    assert_eq!(r.status(), 200);
    let attempts = r.headers()["x-stanch-attempts"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let text = r.text().await.unwrap();
    let model = if stream {
        let ev = events(&text);
        assert_eq!(ev.last().map(String::as_str), Some("[DONE]"), "{text}");
        assert_eq!(content(&ev).split(' ').count(), 4, "a whole answer: {text}");
        let first: Value = serde_json::from_str(&ev[0]).unwrap();
        first["model"].as_str().unwrap().to_owned()
    } else {
        let body: Value = serde_json::from_str(&text).unwrap();
        body["model"].as_str().unwrap().to_owned()
    };
    (model, attempts)
}

/// A one-off 5xx or reset at a pool's only endpoint is tried there again, not sent to
/// the smaller model; streamed or not.
#[tokio::test]
async fn a_one_off_fault_at_the_models_only_endpoint_is_retried_there() {
    for (fault, stream) in [
        (json!({"kind": "status", "status": 500, "count": 1}), false),
        (json!({"kind": "status", "status": 503, "count": 1}), true),
        (json!({"kind": "reset", "count": 1}), false),
        (json!({"kind": "reset", "count": 1}), true),
        // Headers came, then the connection broke before the first token: the caller
        // has nothing yet, so it is as if it broke before the head.
        (
            json!({"kind": "break", "after_tokens": 0, "count": 1}),
            true,
        ),
    ] {
        let (gw, a, s) = lone("").await;
        a.fault(fault.clone());
        assert_eq!(
            answered(&gw, stream).await,
            ("qwen-72b".to_owned(), 2),
            "{fault}"
        );
        assert_eq!((a.requests(), s.requests()), (2, 0), "{fault}");
        let metrics = gw.metrics().await;
        assert_eq!(
            sample(
                &metrics,
                "stanch_gateway_same_endpoint_retries_total",
                &[("kind", "transient")]
            ),
            1.0,
            "{metrics}"
        );
    }
}

/// Once only: a fault that persists goes to the fallback after the second attempt; and
/// `same_endpoint: 0` never sends a request to an endpoint twice.
#[tokio::test]
async fn the_same_endpoint_is_tried_again_at_most_as_configured() {
    let (gw, a, s) = lone("").await;
    a.fault(json!({"kind": "status", "status": 500, "count": 2}));
    assert_eq!(answered(&gw, false).await, ("qwen-14b".to_owned(), 3));
    assert_eq!((a.requests(), s.requests()), (2, 1));

    let (gw, a, s) = lone(", same_endpoint: 0").await;
    a.fault(json!({"kind": "status", "status": 500, "count": 1}));
    assert_eq!(answered(&gw, false).await, ("qwen-14b".to_owned(), 2));
    assert_eq!((a.requests(), s.requests()), (1, 1));
}

/// Faults that another try at the same endpoint will not change go elsewhere at once:
/// a refused connection, a 501, a quota.
#[tokio::test]
async fn lasting_faults_are_not_tried_again_at_the_same_endpoint() {
    for fault in [
        json!({"kind": "status", "status": 501, "count": 1}),
        json!({"kind": "status", "status": 402, "code": "insufficient_quota", "count": 1}),
        json!({"kind": "status", "status": 429, "count": 1}),
    ] {
        let (gw, a, s) = lone("").await;
        a.fault(fault.clone());
        assert_eq!(answered(&gw, false).await.0, "qwen-14b", "{fault}");
        assert_eq!((a.requests(), s.requests()), (1, 1), "{fault}");
    }
    // Nothing listens at port 9: refused.
    let s = Upstream::start("qwen-14b", "s").await;
    let yaml = format!(
        "models:
  qwen-72b:
    fallbacks: [qwen-14b]
    pools: [{{name: p, endpoints: [{{url: 'http://127.0.0.1:9'}}]}}]
  qwen-14b:
    pools: [{{name: p, endpoints: [{{url: '{{s}}'}}]}}]
{POLICY}"
    );
    let gw = gateway(&yaml, &[("s", &s)]).await;
    assert_eq!(answered(&gw, false).await, ("qwen-14b".to_owned(), 2));
    let metrics = gw.metrics().await;
    assert_eq!(
        sample(&metrics, "stanch_gateway_same_endpoint_retries_total", &[]),
        0.0
    );
}

/// Another endpoint of the model (here in its other pool) answers sooner than a second
/// try: a one-off fault moves there.
#[tokio::test]
async fn another_endpoint_of_the_model_comes_before_the_same_one_again() {
    let a = Upstream::start("qwen-72b", "a").await;
    let b = Upstream::start("qwen-72b", "b").await;
    let yaml = format!(
        "models:
  qwen-72b:
    pools:
      - {{name: dc-a, endpoints: [{{url: '{{a}}'}}]}}
      - {{name: dc-b, endpoints: [{{url: '{{b}}'}}]}}
{POLICY}"
    );
    let gw = gateway(&yaml, &[("a", &a), ("b", &b)]).await;
    a.fault(json!({"kind": "status", "status": 500, "count": 1}));
    assert_eq!(answered(&gw, false).await, ("qwen-72b".to_owned(), 2));
    assert_eq!((a.requests(), b.requests()), (1, 1));
}

/// A 429 with `Retry-After: 1` is waited out, never less than it says, when the model
/// has nowhere else to go; one longer than `retry_after_max` moves on at once.
#[tokio::test]
async fn a_short_retry_after_is_waited_out_and_a_long_one_is_not() {
    for stream in [false, true] {
        let (gw, a, s) = lone("").await;
        a.fault(json!({"kind": "status", "status": 429, "retry_after": 1, "count": 1}));
        let started = Instant::now();
        assert_eq!(answered(&gw, stream).await, ("qwen-72b".to_owned(), 2));
        let took = started.elapsed();
        assert!(
            took >= Duration::from_secs(1) && took < Duration::from_secs(3),
            "waited {took:?}"
        );
        assert_eq!((a.requests(), s.requests()), (2, 0));
        let metrics = gw.metrics().await;
        assert_eq!(
            sample(
                &metrics,
                "stanch_gateway_same_endpoint_retries_total",
                &[("kind", "retry_after")]
            ),
            1.0
        );
    }

    // Waited out once: a second 429 after the wait is a limit that holds, and the
    // request moves on.
    let (gw, a, s) = lone("").await;
    a.fault(json!({"kind": "status", "status": 429, "retry_after": 1, "count": 2}));
    assert_eq!(answered(&gw, false).await, ("qwen-14b".to_owned(), 3));
    assert_eq!((a.requests(), s.requests()), (2, 1));

    let (gw, a, s) = lone(", retry_after_max: 1s").await;
    a.fault(json!({"kind": "status", "status": 429, "retry_after": 2, "count": 1}));
    let started = Instant::now();
    assert_eq!(answered(&gw, false).await.0, "qwen-14b");
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "moved on at once"
    );
    assert_eq!((a.requests(), s.requests()), (1, 1));
}

/// A dead endpoint alone in its pool, with a fallback model: once blocked it gets no
/// live request until its block ends, then at most the threshold again before it is
/// blocked anew (for longer), so it sees at most the threshold per block period; and
/// no caller sees an error.
#[tokio::test]
async fn a_dead_pool_gets_at_most_the_threshold_per_block_period() {
    let a = Upstream::start("qwen-72b", "a").await;
    let s = Upstream::start("qwen-14b", "s").await;
    let policy = POLICY.replace("ttl: 60s", "ttl: 500ms");
    let yaml = format!(
        "models:
  qwen-72b:
    fallbacks: [qwen-14b]
    pools: [{{name: dc-a, endpoints: [{{url: '{{a}}'}}]}}]
  qwen-14b:
    pools: [{{name: dc-a, endpoints: [{{url: '{{s}}'}}]}}]
{policy}"
    );
    let gw = gateway(&yaml, &[("a", &a), ("s", &s)]).await;
    a.fault(json!({"kind": "status", "status": 500}));
    let started = Instant::now();
    let mut sent = 0;
    while started.elapsed() < Duration::from_millis(2500) && sent < 2000 {
        for stream in [false, true] {
            assert_eq!(answered(&gw, stream).await.0, "qwen-14b");
            sent += 1;
        }
    }
    let metrics = gw.metrics().await;
    let blocks = sample(&metrics, "stanch_gateway_blocks_total", &[]) as u64;
    // 500 ms, then 1 s, then 2 s: two or three blocks in 2.5 s.
    assert!(
        (2..=3).contains(&blocks),
        "blocks made: {blocks}\n{metrics}"
    );
    assert!(
        a.requests() <= 3 * (blocks + 1),
        "{} attempts at the dead endpoint in {sent} requests over {blocks} blocks",
        a.requests()
    );
    assert!(
        sent > 20 * a.requests(),
        "{sent} requests, {}",
        a.requests()
    );
}

/// qwen-72b hedged after 100 ms, in two pools of one endpoint each (`a`, `b`); its
/// first-token timeout is 2 s, so only a hedge answers a slow start sooner.
async fn hedging(a: &Upstream, b: &Upstream) -> Setup {
    hedging_within(a, b, "max_attempts: 4, budget_min_retries: 1000").await
}

/// [`hedging`] with the retry policy's limits given by `limits`.
async fn hedging_within(a: &Upstream, b: &Upstream, limits: &str) -> Setup {
    let policy = POLICY
        .replace("first_token: 400ms", "first_token: 2s")
        .replace("max_attempts: 4, ", "")
        .replace("budget_min_retries: 1000", limits);
    let yaml = format!(
        "models:
  qwen-72b:
    hedge_after: 100ms
    pools:
      - {{name: dc-a, endpoints: [{{url: '{{a}}'}}]}}
      - {{name: dc-b, endpoints: [{{url: '{{b}}'}}]}}
{policy}"
    );
    gateway(&yaml, &[("a", a), ("b", b)]).await
}

fn hedges(metrics: &str, winner: &str) -> f64 {
    sample(
        metrics,
        "stanch_gateway_hedged_streams_total",
        &[("winner", winner)],
    )
}

/// A stream with no first token after `hedge_after` is sent to the next target too,
/// and the first to stream serves the caller: the hedge when the original is slower,
/// the original when it is faster or the hedge fails.
#[tokio::test]
async fn a_slow_first_token_is_hedged_and_the_first_to_stream_serves() {
    // The original takes 1.5 s to its first token; the hedge answers at once.
    let (a, b) = (
        Upstream::start("qwen-72b", "a").await,
        Upstream::start("qwen-72b", "b").await,
    );
    a.fault(json!({"kind": "slow_first_token", "ms": 1500}));
    let gw = hedging(&a, &b).await;
    let started = Instant::now();
    let r = gw.chat("qwen-72b", true).await;
    assert_eq!(r.headers()["x-stanch-attempts"], "2");
    let ev = events(&r.text().await.unwrap());
    let took = started.elapsed();
    assert_eq!(content(&ev).split(' ').count(), 4, "{ev:?}");
    let first: Value = serde_json::from_str(&ev[0]).unwrap();
    assert_eq!(first["id"], "chatcmpl-b", "the hedge served it");
    assert!(
        took >= Duration::from_millis(100) && took < Duration::from_millis(1000),
        "hedged after 100 ms, not after the slow start: {took:?}"
    );
    assert_eq!(hedges(&gw.metrics().await, "hedge"), 1.0);

    // The original streams at 300 ms, the hedge not before 1.5 s.
    let (a, b) = (
        Upstream::start("qwen-72b", "a").await,
        Upstream::start("qwen-72b", "b").await,
    );
    a.fault(json!({"kind": "slow_first_token", "ms": 300}));
    b.fault(json!({"kind": "slow_first_token", "ms": 1500}));
    let gw = hedging(&a, &b).await;
    let started = Instant::now();
    let ev = events(&gw.chat("qwen-72b", true).await.text().await.unwrap());
    let first: Value = serde_json::from_str(&ev[0]).unwrap();
    assert_eq!(first["id"], "chatcmpl-a");
    assert!(started.elapsed() < Duration::from_millis(1000));
    assert_eq!(hedges(&gw.metrics().await, "original"), 1.0);
    assert_eq!(b.requests(), 1, "the hedge was sent");

    // The hedge fails at once: the original still answers.
    let (a, b) = (
        Upstream::start("qwen-72b", "a").await,
        Upstream::start("qwen-72b", "b").await,
    );
    a.fault(json!({"kind": "slow_first_token", "ms": 300}));
    b.fault(json!({"kind": "status", "status": 500}));
    let gw = hedging(&a, &b).await;
    let ev = events(&gw.chat("qwen-72b", true).await.text().await.unwrap());
    assert_eq!(content(&ev).split(' ').count(), 4, "{ev:?}");
    assert_eq!(hedges(&gw.metrics().await, "original"), 1.0);
}

/// Hedging is for streams, after `hedge_after` only, and needs somewhere to go: a fast
/// stream, a whole answer and a model with one endpoint are never hedged.
#[tokio::test]
async fn only_a_slow_stream_with_somewhere_else_to_go_is_hedged() {
    let (a, b) = (
        Upstream::start("qwen-72b", "a").await,
        Upstream::start("qwen-72b", "b").await,
    );
    let gw = hedging(&a, &b).await;
    for stream in [true, false] {
        assert_eq!(gw.chat("qwen-72b", stream).await.status(), 200);
    }
    a.fault(json!({"kind": "slow_first_token", "ms": 300}));
    assert_eq!(gw.chat("qwen-72b", false).await.status(), 200);
    assert_eq!(
        b.requests(),
        0,
        "neither a fast stream nor a whole answer is hedged"
    );

    let a = Upstream::start("qwen-72b", "a").await;
    a.fault(json!({"kind": "slow_first_token", "ms": 300}));
    let policy = POLICY.replace("first_token: 400ms", "first_token: 2s");
    let yaml = format!(
        "models:\n  qwen-72b:\n    hedge_after: 100ms\n    pools: [{{name: dc-a, endpoints: [{{url: '{{a}}'}}]}}]\n{policy}"
    );
    let gw = gateway(&yaml, &[("a", &a)]).await;
    let r = gw.chat("qwen-72b", true).await;
    assert_eq!(r.headers()["x-stanch-attempts"], "1");
    assert_eq!(
        content(&events(&r.text().await.unwrap()))
            .split(' ')
            .count(),
        4
    );
    let metrics = gw.metrics().await;
    assert_eq!(
        hedges(&metrics, "hedge") + hedges(&metrics, "original"),
        0.0
    );
}

/// A hedge is a retry: with the retry budget spent, or `max_attempts` at one, a slow
/// first token is waited for on the original alone, which answers.
#[tokio::test]
async fn a_hedge_is_bounded_by_the_retry_budget_and_max_attempts() {
    for (limits, budget_exhausted) in [
        (
            "max_attempts: 4, budget_ratio: 0, budget_min_retries: 0",
            1.0,
        ),
        ("max_attempts: 1, budget_min_retries: 1000", 0.0),
    ] {
        let (a, b) = (
            Upstream::start("qwen-72b", "a").await,
            Upstream::start("qwen-72b", "b").await,
        );
        a.fault(json!({"kind": "slow_first_token", "ms": 400}));
        let gw = hedging_within(&a, &b, limits).await;
        let started = Instant::now();
        let r = gw.chat("qwen-72b", true).await;
        assert_eq!(r.headers()["x-stanch-attempts"], "1", "{limits}");
        let ev = events(&r.text().await.unwrap());
        let first: Value = serde_json::from_str(&ev[0]).unwrap();
        assert_eq!(
            first["id"], "chatcmpl-a",
            "{limits}: the original served it"
        );
        assert_eq!(content(&ev).split(' ').count(), 4, "{limits}: {ev:?}");
        assert!(
            started.elapsed() >= Duration::from_millis(400),
            "{limits}: waited for the slow start"
        );
        assert_eq!(b.requests(), 0, "{limits}: no hedge was sent");
        let metrics = gw.metrics().await;
        assert_eq!(
            hedges(&metrics, "hedge") + hedges(&metrics, "original"),
            0.0,
            "{limits}"
        );
        assert_eq!(
            sample(&metrics, "stanch_gateway_retry_budget_exhausted_total", &[]),
            budget_exhausted,
            "{limits}"
        );
    }
}
