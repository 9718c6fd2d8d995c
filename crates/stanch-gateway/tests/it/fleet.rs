//! With a real controller: one replica's discovery protects every replica.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use stanch_core::Config;
use stanch_gateway::Gateway;
use stanch_gateway::config::GatewayConfig;
use stanch_ports::clock::SystemClock;
use stanch_server::{Controller, Settings};
use stanch_testkit::http::Fetch;

use crate::support::*;

/// A controller, serving TLS with the certificate and key when given.
async fn controller(tls: Option<(PathBuf, PathBuf)>) -> (Controller, String) {
    let mut settings = Settings::in_memory(Config::default_config());
    let scheme = if tls.is_some() { "https" } else { "http" };
    settings.tls = tls;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let c = Controller::start(settings, listener, Arc::new(SystemClock))
        .await
        .unwrap();
    let url = format!("{scheme}://localhost:{}", c.addr().port());
    (c, url)
}

/// A gateway replica following `controller` and reporting to it every 100 ms.
async fn replica(yaml: &str, controller: &str, id: &str) -> (String, Arc<Gateway>) {
    let config = GatewayConfig::from_yaml(yaml).unwrap();
    let mut watch = stanch_client::WatchConfig::new(controller, id);
    watch.long_poll_wait = Duration::from_secs(2);
    watch.ca_pem = config
        .tls
        .ca_file
        .as_ref()
        .map(|f| std::fs::read(f).unwrap());
    let (routes, _task) = stanch_client::start(watch, Some(Gateway::validator(&config)));
    let gw = Arc::new(Gateway::new(config, Some(routes), Arc::new(SystemClock)).unwrap());
    tokio::spawn(stanch_gateway::report_loop(
        gw.clone(),
        controller.to_owned(),
        None,
        id.to_owned(),
        Duration::from_millis(100),
    ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(stanch_gateway::serve(
        listener,
        gw.clone(),
        std::future::pending(),
    ));
    (base, gw)
}

#[tokio::test]
async fn one_replicas_discovery_protects_every_replica() {
    discovery_protects_every_replica(false).await;
}

#[tokio::test]
async fn replicas_watch_and_report_to_a_controller_over_tls() {
    discovery_protects_every_replica(true).await;
}

/// Replica A's failures reach the controller as reports, and its block reaches replica
/// B through the watch; with `tls`, both over HTTPS trusted through `tls.ca_file`.
async fn discovery_protects_every_replica(tls: bool) {
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) = certificates(dir.path());
    let (_c, url) = controller(tls.then_some((cert, key))).await;
    let trust = if tls {
        format!("tls: {{ca_file: '{}'}}\n", ca.display())
    } else {
        String::new()
    };
    let bad = Upstream::start("qwen-72b", "bad").await;
    let good = Upstream::start("qwen-72b", "good").await;
    bad.fault(json!({"kind": "status", "status": 503}));
    // Local blocking off, so only the fleet decision can protect replica B.
    let yaml = format!(
        "models:\n  qwen-72b:\n    pools:\n      - name: dc-a\n        endpoints: [{{url: '{}'}}]\n      - name: dc-b\n        endpoints: [{{url: '{}'}}]\nblocking: {{consecutive_failures: 0}}\nretry: {{backoff_base: 1ms, backoff_max: 2ms, budget_min_retries: 1000}}\n{trust}",
        bad.base, good.base
    );
    let (a, _) = replica(&yaml, &url, "gw-a").await;
    let (b, gw_b) = replica(&yaml, &url, "gw-b").await;
    let ca = reqwest::Certificate::from_pem(&std::fs::read(&ca).unwrap()).unwrap();
    let http = reqwest::Client::builder()
        .no_proxy()
        .add_root_certificate(ca)
        .build()
        .unwrap();
    let chat = |base: String| {
        let http = http.clone();
        async move {
            let body = json!({"model": "qwen-72b", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]});
            http.post(format!("{base}/v1/chat/completions"))
                .json(&body)
                .send()
                .await
                .unwrap()
                .status()
        }
    };
    // Only replica A sees traffic, and with it the failures.
    for _ in 0..10 {
        assert_eq!(chat(a.clone()).await, 200);
    }
    stanch_testkit::wait::until(
        "the block reaching replica B through the controller",
        Duration::from_secs(5),
        || async {
            let status: Value = http.get(format!("{b}/v1/status")).fetch_json().await;
            status["endpoints"]
                .as_array()
                .unwrap()
                .iter()
                .find(|e| e["url"] == bad.base.as_str())
                .is_some_and(|e| !e["table_blocked_until"].is_null())
        },
    )
    .await;
    let before = bad.requests();

    for _ in 0..20 {
        assert_eq!(chat(b.clone()).await, 200);
    }
    assert_eq!(
        bad.requests(),
        before,
        "replica B never sent the bad endpoint a request"
    );
    drop(gw_b);
    let routes: Value = http.get(format!("{url}/v1/routes")).fetch_json().await;
    assert!(
        routes["blocked"][0]["reason"]
            .as_str()
            .unwrap()
            .contains("fleet reports")
    );
}
