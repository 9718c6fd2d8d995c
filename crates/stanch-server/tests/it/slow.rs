//! Slow and stalled senders: a body that does not arrive in time gets 408 and its
//! connection closed; bodies still arriving share a memory budget; nothing waits.

use std::time::Duration;

use stanch_testkit::net::{self, answer};
use tokio::net::TcpStream;
use tokio::time::Instant;

use stanch_server::config::ServerConfig;

use crate::support::*;

fn server() -> ServerConfig {
    let mut c = ServerConfig::default();
    c.intake.body_timeout = stanch_api::HumanDuration(Duration::from_millis(500));
    c.intake.body_min_rate = 1024 * 1024;
    c.intake.max_partial_body_bytes = 200 * 1024;
    c
}

/// Sends a request head promising `length` bytes and the first `sent` of them.
async fn partial(addr: &str, length: usize, sent: usize) -> TcpStream {
    let head = format!(
        "POST /v1/alerts/alertmanager HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {INGEST}\r\n\
         content-type: application/json\r\ncontent-length: {length}\r\n\r\n"
    );
    net::partial(addr, &head, sent).await
}

#[tokio::test]
async fn a_stalled_body_gets_408_and_its_connection_closed() {
    let h = Harness::with(Options {
        server: server(),
        ..Options::default()
    })
    .await;
    let addr = h.base.trim_start_matches("http://").to_owned();
    let started = Instant::now();
    let s = partial(&addr, 10_000, 100).await;
    let text = answer(s, Duration::from_secs(5)).await;
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(
        text.to_ascii_lowercase().contains("connection: close"),
        "{text}"
    );
    assert!(text.contains("body_timeout"), "{text}");
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(450) && took < Duration::from_secs(3),
        "{took:?}"
    );
}

#[tokio::test]
async fn partial_bodies_share_a_budget_and_the_controller_keeps_answering() {
    let h = Harness::with(Options {
        server: server(),
        ..Options::default()
    })
    .await;
    let addr = h.base.trim_start_matches("http://").to_owned();
    // Ten senders each stall with 60 KB of a 100 KB body: 200 KB hold three.
    let mut stalled = Vec::new();
    for _ in 0..10 {
        stalled.push(partial(&addr, 100_000, 60_000).await);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    // A whole alert is still taken at once: it arrives in one piece, so it does not
    // need the budget the stalled ones fill.
    let r = h
        .webhook(fixture("alertmanager-v4-firing-failover.json"))
        .await;
    assert_eq!(r.status(), 200);
    let mut statuses = Vec::new();
    for s in stalled {
        let text = answer(s, Duration::from_secs(5)).await;
        statuses.push(text.get(9..12).unwrap_or("").to_owned());
    }
    let busy = statuses.iter().filter(|s| *s == "503").count();
    let timed_out = statuses.iter().filter(|s| *s == "408").count();
    assert_eq!(busy + timed_out, 10, "{statuses:?}");
    assert!(
        busy >= 6,
        "past the budget they are turned away: {statuses:?}"
    );
    assert!(timed_out >= 1, "the ones held time out: {statuses:?}");
}
