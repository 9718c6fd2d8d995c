//! The `stanch-gateway` binary as it is run: several worker threads, one gateway.

use std::process::{Command, Stdio};
use std::time::Duration;

use stanch_testkit::http::Fetch;
use stanch_testkit::net::free_port;
use stanch_testkit::process::Running;
use stanch_testkit::wait::{until, until_some};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::*;

/// A configuration of one model, `qwen-72b`, served by `up`, written under `dir`.
fn one_model(dir: &std::path::Path, up: &Upstream) -> std::path::PathBuf {
    let config = dir.join("gateway.yaml");
    std::fs::write(
        &config,
        format!(
            "models:\n  qwen-72b:\n    pools:\n      - {{name: p, endpoints: [{{url: '{}'}}]}}\n",
            up.base
        ),
    )
    .unwrap();
    config
}

#[tokio::test]
async fn the_binary_serves_from_several_threads_and_stops_on_sigterm_and_sigint() {
    let up = Upstream::start("qwen-72b", "a").await;
    let dir = std::env::temp_dir().join(format!("stanch-gw-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = one_model(&dir, &up);
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let mut gateway = started(&config, port, "3").await;

    // Each request on a connection of its own, served by whichever worker thread.
    let body = serde_json::json!({"model": "qwen-72b", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]});
    for i in 0..24 {
        let http = reqwest::Client::builder()
            .no_proxy()
            .pool_max_idle_per_host(0)
            .timeout(Duration::from_secs(5))
            .build()
            .unwrap();
        let r = http
            .post(format!("{base}/v1/chat/completions"))
            .json(&body)
            .send()
            .await
            .unwrap_or_else(|e| panic!("request {i}: {e}"));
        assert_eq!(r.status(), 200, "request {i}");
        assert_eq!(r.headers()["x-stanch-route-version"], "0");
    }
    // One gateway behind the threads: one set of metrics counts them all.
    let metrics = reqwest::get(format!("{base}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let served = sample(
        &metrics,
        "stanch_gateway_requests_total",
        &[("model", "qwen-72b"), ("status_class", "2xx")],
    );
    assert_eq!(served, 24.0);
    assert_eq!(up.requests(), 24);

    // Kept-alive connections spread over the workers, and the metrics say how. One
    // client asks for the metrics over one connection; first, until the gateway has
    // seen the closes of the requests above and counts that connection alone.
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let by_worker = || async {
        let metrics = http.get(format!("{base}/metrics")).fetch_text().await;
        (0..3)
            .map(|w| {
                sample(
                    &metrics,
                    "stanch_gateway_worker_connections",
                    &[("worker", &w.to_string())],
                )
            })
            .collect::<Vec<f64>>()
    };
    until(
        "closed connections no longer counted",
        Duration::from_secs(2),
        || async { by_worker().await.iter().sum::<f64>() == 1.0 },
    )
    .await;
    let mut open = Vec::new();
    for _ in 0..6 {
        let mut conn = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        conn.write_all(b"GET /healthz HTTP/1.1\r\nHost: gw\r\n\r\n")
            .await
            .unwrap();
        let mut answer = [0; 256];
        let n = conn.read(&mut answer).await.unwrap();
        assert!(answer[..n].starts_with(b"HTTP/1.1 200"));
        open.push(conn);
    }
    // The six and the metrics' own: the least busy worker takes each new one.
    let counts = by_worker().await;
    assert_eq!(counts.iter().sum::<f64>(), 7.0, "{counts:?}");
    assert!(
        counts.iter().all(|&c| (2.0..=3.0).contains(&c)),
        "{counts:?}"
    );
    drop(open);

    // SIGTERM (what Kubernetes sends) stops it cleanly, keep-alive connections and all.
    stops_cleanly_on(&mut gateway, "-TERM").await;

    // And so does SIGINT.
    let mut again = started(&config, port, "0").await;
    stops_cleanly_on(&mut again, "-INT").await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// The gateway binary for `config` on `port` with `threads` worker threads (0: one a
/// core), once it answers `/healthz`.
async fn started(config: &std::path::Path, port: u16, threads: &str) -> Running {
    started_logging(config, port, threads, &[], "warn", Stdio::null()).await
}

/// Starts the binary with `RUST_LOG=filter`, extra arguments, standard error to `log`.
async fn started_logging(
    config: &std::path::Path,
    port: u16,
    threads: &str,
    extra: &[&str],
    filter: &str,
    log: impl Into<Stdio>,
) -> Running {
    let gateway = Running::spawn(
        Command::new(env!("CARGO_BIN_EXE_stanch-gateway"))
            .arg("--config")
            .arg(config)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--worker-threads", threads])
            .args(extra)
            .env("RUST_LOG", filter)
            .stdout(Stdio::null())
            .stderr(log),
    );
    stanch_testkit::http::ready(
        &format!("http://127.0.0.1:{port}/healthz"),
        Duration::from_secs(5),
    )
    .await;
    gateway
}

async fn stops_cleanly_on(gateway: &mut Running, signal: &str) {
    gateway.signal(signal);
    let exited = until_some(
        &format!("the gateway exiting on {signal}"),
        Duration::from_secs(5),
        || std::future::ready(gateway.try_wait().unwrap()),
    )
    .await;
    assert!(exited.success(), "exits cleanly on {signal}: {exited:?}");
}

/// The access log as shipped (on, buffered): every request's line reaches the file
/// whole, the last ones at a normal stop too, in text and in JSON, and the metrics say
/// how many lines were dropped (none here).
#[tokio::test]
async fn every_access_line_is_written_whole_and_none_lost_at_a_stop() {
    let up = Upstream::start("qwen-72b", "a").await;
    let dir = tempfile::tempdir().unwrap();
    let config = one_model(dir.path(), &up);
    for format in ["text", "json"] {
        let log_path = dir.path().join(format!("gateway-{format}.log"));
        let log = std::fs::File::create(&log_path).unwrap();
        let port = free_port();
        let base = format!("http://127.0.0.1:{port}");
        let mut gateway =
            started_logging(&config, port, "2", &["--log-format", format], "info", log).await;
        let http = reqwest::Client::builder().no_proxy().build().unwrap();
        let body = serde_json::json!({"model": "qwen-72b", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]});
        let requests = futures_util::future::join_all((0..300).map(|_| {
            http.post(format!("{base}/v1/chat/completions"))
                .json(&body)
                .send()
        }))
        .await;
        assert!(
            requests
                .iter()
                .all(|r| r.as_ref().is_ok_and(|r| r.status() == 200))
        );
        let metrics = http.get(format!("{base}/metrics")).fetch_text().await;
        assert_eq!(
            sample(&metrics, "stanch_gateway_log_lines_dropped_total", &[]),
            0.0,
            "{format}"
        );
        stops_cleanly_on(&mut gateway, "-TERM").await;
        let text = std::fs::read_to_string(&log_path).unwrap();
        let access: Vec<&str> = text.lines().filter(|l| l.contains("access")).collect();
        assert_eq!(
            access.len(),
            300,
            "{format}: one line a request, none lost at the stop"
        );
        for line in &access {
            match format {
                "json" => {
                    let v: serde_json::Value =
                        serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
                    assert_eq!(v["target"], "access", "{line}");
                }
                _ => assert!(
                    line.starts_with("20") && !line.contains('\u{1b}'),
                    "whole, without colour: {line:?}"
                ),
            }
        }
    }
}

/// Built with feature `kubernetes`, the binary follows the route-table resource
/// through the API server (the fake one here) and never reaches the controller: a
/// failover the controller published is applied and routes the request.
#[tokio::test]
async fn the_binary_follows_the_route_table_resource_without_reaching_the_controller() {
    use std::sync::Arc;

    use stanch_fake_apiserver::FakeApiServer;
    use stanch_kube::publish::RouteTableWriter;

    let api = FakeApiServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig, "default").unwrap();
    // The controller, and the leader's writing of its table to the resource.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let controller = stanch_server::Controller::start(
        stanch_server::Settings::in_memory(stanch_core::Config::default_config()),
        listener,
        Arc::new(stanch_ports::clock::SystemClock),
    )
    .await
    .unwrap();
    let client = kube::Client::try_from(kube::Config::new(api.url().parse().unwrap())).unwrap();
    let mut writer = RouteTableWriter::new(kube::Api::namespaced(client, "monitoring"), "stanch");
    let alert = serde_json::json!({"version": "4", "status": "firing", "alerts": [{"status": "firing",
        "labels": {"alertname": "F", "action": "trigger-failover", "target_model": "qwen-72b", "pool": "dc-a"},
        "startsAt": "2026-11-30T00:00:00Z", "endsAt": "0001-01-01T00:00:00Z"}]});
    let r = reqwest::Client::new()
        .post(format!(
            "http://{}/v1/alerts/alertmanager",
            controller.addr()
        ))
        .json(&alert)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let table = controller.published().table.clone();
    assert_eq!(table.models["qwen-72b"].pool, "dc-b");
    writer.write(&table).await.unwrap();

    let dc_a = Upstream::start("qwen-72b", "a").await;
    let dc_b = Upstream::start("qwen-72b", "b").await;
    let config = dir.path().join("gateway.yaml");
    std::fs::write(
        &config,
        format!(
            "models:\n  qwen-72b:\n    pools:\n      - {{name: dc-a, endpoints: [{{url: '{}'}}]}}\n      \
             - {{name: dc-b, endpoints: [{{url: '{}'}}]}}\n\
             controller:\n  route_table: {{namespace: monitoring}}\n  state_file: '{}'\n",
            dc_a.base,
            dc_b.base,
            dir.path().join("routes.json").display()
        ),
    )
    .unwrap();
    let port = free_port();
    let _gateway = Running::spawn(
        Command::new(env!("CARGO_BIN_EXE_stanch-gateway"))
            .arg("--config")
            .arg(&config)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .env("KUBECONFIG", &kubeconfig)
            .env_remove("KUBERNETES_SERVICE_HOST")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    );
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    until(
        "the table in the resource applied",
        Duration::from_secs(10),
        || async {
            let Ok(r) = http.get(format!("{base}/v1/status")).send().await else {
                return false;
            };
            let status: serde_json::Value = r.json().await.unwrap_or_default();
            status["route_version"].as_u64() == Some(table.version)
        },
    )
    .await;
    let body = serde_json::json!({"model": "qwen-72b", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]});
    let r = http
        .post(format!("{base}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers()["x-stanch-route-version"],
        table.version.to_string().as_str()
    );
    assert_eq!(
        (dc_a.requests(), dc_b.requests()),
        (0, 1),
        "failed over to dc-b"
    );
}

/// With `--status-listen`, the status (which names the upstreams) and the metrics are
/// served on their own address and the callers' port does not answer them; callers
/// are served as before, and both stop on SIGTERM.
#[tokio::test]
async fn status_and_metrics_can_be_served_apart_from_callers() {
    let up = Upstream::start("qwen-72b", "a").await;
    let dir = tempfile::tempdir().unwrap();
    let config = one_model(dir.path(), &up);
    let (port, status_port) = (free_port(), free_port());
    let status_at = format!("127.0.0.1:{status_port}");
    let mut gateway = started_logging(
        &config,
        port,
        "2",
        &["--status-listen", &status_at],
        "warn",
        Stdio::null(),
    )
    .await;
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let callers = format!("http://127.0.0.1:{port}");
    let status = format!("http://{status_at}");
    for path in ["/v1/status", "/status", "/metrics"] {
        let r = http.get(format!("{callers}{path}")).send().await.unwrap();
        assert_eq!(r.status(), 404, "{path} is not the callers'");
        let r = http.get(format!("{status}{path}")).send().await.unwrap();
        assert_eq!(r.status(), 200, "{path} on the status listener");
    }
    let text = |url: String| {
        let http = http.clone();
        async move { http.get(url).fetch_text().await }
    };
    let shown = text(format!("{status}/v1/status")).await;
    assert!(shown.contains(&up.base), "the status names the upstream");
    for base in [&callers, &status] {
        let r = http.get(format!("{base}/healthz")).send().await.unwrap();
        assert_eq!(r.status(), 200, "{base}/healthz");
    }
    let body = serde_json::json!({"model": "qwen-72b", "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi"}]});
    let r = http
        .post(format!("{callers}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let metrics = text(format!("{status}/metrics")).await;
    assert!(
        metrics.contains("stanch_gateway_requests_total{"),
        "the callers' requests are counted"
    );
    assert!(metrics.contains("stanch_gateway_connections_open "));
    stops_cleanly_on(&mut gateway, "-TERM").await;
}
