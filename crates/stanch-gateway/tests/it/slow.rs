//! Slow and stalled callers: a body that does not arrive in time gets 408 and its
//! connection closed, bodies still arriving share a memory budget past which callers
//! get 503 with `Retry-After`, and whole requests are served meanwhile.

use std::time::Duration;

use stanch_testkit::net::{self, answer};
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::support::*;

const CONFIG: &str = "models:\n  qwen-72b:\n    pools:\n      - name: dc-a\n        endpoints: [{url: '{a}'}]\n\
timeouts: {body: 500ms}\nbody_min_rate: 1048576\nmax_partial_body_bytes: 204800\n";

/// Sends a request head promising `length` bytes and the first `sent` of them.
async fn partial(base: &str, length: usize, sent: usize) -> TcpStream {
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         content-length: {length}\r\n\r\n"
    );
    net::partial(base, &head, sent).await
}

#[tokio::test]
async fn a_stalled_body_gets_408_and_never_reaches_an_upstream() {
    let a = Upstream::start("qwen-72b", "a").await;
    let gw = gateway(CONFIG, &[("a", &a)]).await;
    let started = Instant::now();
    let text = answer(partial(&gw.base, 10_000, 100).await, Duration::from_secs(5)).await;
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(
        text.to_ascii_lowercase().contains("connection: close"),
        "{text}"
    );
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(450) && took < Duration::from_secs(3),
        "{took:?}"
    );
    assert_eq!(a.requests(), 0);
}

#[tokio::test]
async fn partial_bodies_share_a_budget_and_whole_requests_are_served() {
    let a = Upstream::start("qwen-72b", "a").await;
    let gw = gateway(CONFIG, &[("a", &a)]).await;
    // Ten callers stall with 60 KB of a 100 KB body each: 200 KB hold three.
    let mut stalled = Vec::new();
    for _ in 0..10 {
        stalled.push(partial(&gw.base, 100_000, 60_000).await);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let r = gw.chat("qwen-72b", false).await;
    assert_eq!(r.status(), 200, "a whole request needs none of the budget");
    let mut answers = Vec::new();
    for s in stalled {
        answers.push(answer(s, Duration::from_secs(5)).await);
    }
    let busy: Vec<&String> = answers
        .iter()
        .filter(|t| t.starts_with("HTTP/1.1 503"))
        .collect();
    let timed_out = answers
        .iter()
        .filter(|t| t.starts_with("HTTP/1.1 408"))
        .count();
    assert_eq!(busy.len() + timed_out, 10, "{answers:?}");
    assert!(
        busy.len() >= 6,
        "past the budget, callers are turned away: {answers:?}"
    );
    assert!(timed_out >= 1, "the ones held time out");
    assert!(
        busy.iter()
            .all(|t| t.to_ascii_lowercase().contains("retry-after: 1")),
        "{busy:?}"
    );
    assert_eq!(gw.chat("qwen-72b", false).await.status(), 200);
}
