//! Connections to upstreams: kept alive and reused, never reused after an upstream
//! closed them or after the idle limit, and TLS to `https` endpoints.

use std::time::Duration;

use serde_json::Value;
use stanch_mock::{Mock, MockConfig};

use crate::support::*;

/// One model on one endpoint `{a}`, with `policy` after it.
fn one(policy: &str) -> String {
    format!(
        "models:\n  qwen-72b:\n    faq: default\n    pools:\n      - name: dc-a\n        endpoints: [{{url: '{{a}}'}}]\n{policy}"
    )
}

/// The gateway's count of failed attempts, from its status.
async fn failures(gw: &Setup) -> u64 {
    let status = gw.status().await;
    status["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["failures"].as_u64().unwrap())
        .sum()
}

async fn answered(gw: &Setup, stream: bool) -> String {
    let r = gw.chat("qwen-72b", stream).await;
    assert_eq!(r.status(), 200);
    assert!(
        r.headers().get("x-llm-degraded").is_none(),
        "the upstream answered"
    );
    r.text().await.unwrap()
}

/// Waits until the gateway holds `n` idle upstream connections; panics after 2 s.
async fn idle_soon(gw: &Setup, n: f64) {
    stanch_testkit::wait::until(
        &format!("{n} idle upstream connections"),
        Duration::from_secs(2),
        || async {
            let metrics = gw.metrics().await;
            sample(&metrics, "stanch_gateway_upstream_connections_idle", &[]) == n
        },
    )
    .await;
}

#[tokio::test]
async fn connections_are_kept_alive_and_reused() {
    let a = Upstream::start("qwen-72b", "a").await;
    let gw = gateway(&one(POLICY), &[("a", &a)]).await;
    for _ in 0..10 {
        answered(&gw, false).await;
        let text = answered(&gw, true).await;
        assert!(text.contains("[DONE]"), "{text}");
        // A stream's connection goes back once the upstream's end is read, just after
        // the caller's stream ended.
        idle_soon(&gw, 1.0).await;
    }
    assert_eq!(a.requests(), 20);
    assert_eq!(
        a.mock.stats().connections,
        1,
        "one connection carried every request, streams included"
    );

    // A burst opens what it needs; the next burst reuses them.
    for _ in 0..2 {
        let burst = (0..16).map(|_| answered(&gw, false));
        futures_util::future::join_all(burst).await;
    }
    let connections = a.mock.stats().connections;
    assert!(
        (2..=17).contains(&connections),
        "16 concurrent requests at most open 16 more, and the second burst reuses them: {connections}"
    );
    // What the gateway says of it.
    let metrics = gw.metrics().await;
    let opened = sample(
        &metrics,
        "stanch_gateway_upstream_connections_opened_total",
        &[],
    );
    assert_eq!(opened, connections as f64, "{metrics}");
    let idle = sample(&metrics, "stanch_gateway_upstream_connections_idle", &[]);
    assert_eq!(
        idle, connections as f64,
        "every connection is idle between bursts"
    );
}

/// An upstream that closes connections idle for `after`, behind a gateway that would
/// keep them for 10 s.
async fn closing_after(after: Duration) -> (Upstream, Setup) {
    let mut config = MockConfig::new("qwen-72b", "a");
    config.keep_alive = Some(after);
    let a = Upstream::with(config).await;
    let policy = POLICY.replace("total: 10s}", "total: 10s, idle_connection: 10s}");
    let gw = gateway(&one(&policy), &[("a", &a)]).await;
    (a, gw)
}

#[tokio::test]
async fn a_connection_the_upstream_closed_is_not_reused() {
    let (a, gw) = closing_after(Duration::from_millis(150)).await;
    answered(&gw, false).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    answered(&gw, false).await;
    answered(&gw, true).await;
    assert_eq!(a.mock.stats().connections, 2, "a new one after the close");
    assert_eq!(a.requests(), 3, "no request was lost or sent twice");
    assert_eq!(
        failures(&gw).await,
        0,
        "an upstream's close is not its failure"
    );
}

/// The race every keep-alive client meets, under load: an upstream that closes
/// connections idle for 40 ms on its own timer (as uvicorn does after 5 s), and waves
/// of concurrent requests paced around that interval, so that closes land between a
/// checkout and its request. Every request is answered by the upstream and not one
/// failure is counted against it; the upstream did close connections under it.
#[tokio::test]
async fn an_upstream_closing_idle_connections_on_a_timer_costs_no_failures_under_load() {
    let (a, gw) = closing_after(Duration::from_millis(40)).await;
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    let (waves, wide) = (60, 8);
    for wave in 0..waves {
        let answers =
            futures_util::future::join_all((0..wide).map(|i| answered(&gw, (wave + i) % 3 == 0)))
                .await;
        assert_eq!(answers.len(), wide);
        seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        let pause = 30 + (seed >> 33) % 20;
        tokio::time::sleep(Duration::from_millis(pause)).await;
    }
    assert_eq!(
        failures(&gw).await,
        0,
        "an upstream's close is not its failure"
    );
    assert_eq!(
        a.requests(),
        (waves * wide) as u64,
        "each request answered once"
    );
    assert!(
        a.mock.stats().connections > wide as u64 * 5,
        "the upstream closed idle connections under the load: {} opened",
        a.mock.stats().connections
    );
}

#[tokio::test]
async fn an_idle_connection_the_upstream_closed_is_closed_within_seconds() {
    let (_a, gw) = closing_after(Duration::from_millis(100)).await;
    answered(&gw, false).await;
    idle_soon(&gw, 1.0).await;
    // Nothing reads an idle connection; the gateway's sweep (every second) sees the
    // upstream's close and closes its end too, instead of holding it half-open until
    // the endpoint's next request.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    idle_soon(&gw, 0.0).await;
}

#[tokio::test]
async fn idle_connections_are_not_reused_past_the_idle_limit() {
    let a = Upstream::start("qwen-72b", "a").await;
    let policy = POLICY.replace("total: 10s}", "total: 10s, idle_connection: 100ms}");
    let gw = gateway(&one(&policy), &[("a", &a)]).await;
    answered(&gw, false).await;
    answered(&gw, false).await;
    assert_eq!(a.mock.stats().connections, 1);
    tokio::time::sleep(Duration::from_millis(300)).await;
    answered(&gw, false).await;
    assert_eq!(
        a.mock.stats().connections,
        2,
        "idle past the limit: a new one"
    );
    assert_eq!(failures(&gw).await, 0);
}

#[tokio::test]
async fn https_endpoints_are_trusted_through_the_configured_ca() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) = certificates(dir.path());
    let acceptor = stanch_net::tls_acceptor(&cert, &key, false).unwrap();
    let mock = Mock::new(MockConfig::new("qwen-72b", "a"));
    let a = Upstream {
        base: stanch_mock::spawn_tls(mock.clone(), acceptor).await,
        mock,
    };
    assert!(a.base.starts_with("https://localhost:"));

    let trusted = format!("{POLICY}tls: {{ca_file: '{}'}}\n", ca.display());
    let gw = gateway(&one(&trusted), &[("a", &a)]).await;
    for _ in 0..3 {
        let body: Value = serde_json::from_str(&answered(&gw, false).await).unwrap();
        assert_eq!(body["model"], "qwen-72b");
    }
    let text = answered(&gw, true).await;
    assert!(text.contains("[DONE]"), "{text}");
    assert_eq!(
        a.mock.stats().connections,
        1,
        "TLS connections are reused too"
    );

    // Without the CA the certificate is not trusted: no request reaches the upstream,
    // and the caller gets the FAQ's answer, not an error.
    let before = a.requests();
    let untrusted = gateway(&one(POLICY), &[("a", &a)]).await;
    let r = untrusted.chat("qwen-72b", false).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-llm-degraded"], "static");
    assert_eq!(a.requests(), before);
    assert!(
        failures(&untrusted).await > 0,
        "counted against the endpoint"
    );
}

/// `timeouts.caller_idle` reaches the listener: a caller's kept-alive connection is
/// closed once idle that long, and not before.
#[tokio::test]
async fn a_callers_idle_connection_closes_after_caller_idle() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let a = Upstream::start("qwen-72b", "a").await;
    let policy = POLICY.replace("total: 10s}", "total: 10s, caller_idle: 500ms}");
    let gw = gateway(&one(&policy), &[("a", &a)]).await;
    let mut conn = tokio::net::TcpStream::connect(gw.base.trim_start_matches("http://"))
        .await
        .unwrap();
    conn.write_all(b"GET /healthz HTTP/1.1\r\nHost: gw\r\n\r\n")
        .await
        .unwrap();
    let mut buf = vec![0; 4096];
    let n = conn.read(&mut buf).await.unwrap();
    assert!(
        buf[..n].starts_with(b"HTTP/1.1 200"),
        "{:?}",
        String::from_utf8_lossy(&buf[..n])
    );
    let answered = tokio::time::Instant::now();
    let closed = tokio::time::timeout(Duration::from_secs(5), conn.read(&mut buf)).await;
    assert!(
        matches!(closed, Ok(Ok(0))),
        "closed by the gateway: {closed:?}"
    );
    let idle = answered.elapsed();
    assert!(
        idle >= Duration::from_millis(400) && idle < Duration::from_secs(2),
        "{idle:?}"
    );
}
