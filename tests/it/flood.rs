//! Floods at the API's maximum against the real process: whatever one holder of a
//! token sends, the controller's memory, its data directory and the table it serves
//! stay within the bounds docs/operations.md lists, and so does a restart after it.

use std::path::Path;

use serde_json::{Value, json};
use stanch_testkit::wait::blocking::until;

use crate::process::{Server, client};

/// The most endpoints one report may carry (`stanch_api::reports::MAX_REPORT_ENDPOINTS`).
const MAX_REPORT_ENDPOINTS: usize = 10_000;

/// The controller's peak resident memory, from the kernel.
fn peak_rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM");
    kib / 1024.0
}

/// The controller as shipped: the default log level, `info`, written out to `log`
/// (appended to, so that a restart adds its lines), with `extra` arguments and its
/// data under `dir`.
fn as_shipped(dir: &Path, extra: &[&str], log: &Path) -> Server {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .unwrap();
    Server::start_with(dir, extra, "http", "info", log, ["adm", "ing", "rd"])
}

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .expect("data dir")
        .filter_map(Result::ok)
        .map(|e| e.metadata().map_or(0, |m| m.len()))
        .sum()
}

/// One report at the API's maximum: 10,000 endpoints never seen before, each failing
/// five times in a row, from a gateway with a 128-byte name.
fn report(round: usize) -> Value {
    let gateway = format!("{round:0>128}");
    let endpoints: Vec<Value> = (0..MAX_REPORT_ENDPOINTS)
        .map(|i| {
            json!({
                "endpoint": format!("h{round}-{i}:1"),
                "model": "qwen-14b",
                "successes": 0,
                "failures": 5,
                "consecutive_failures": 5,
            })
        })
        .collect();
    json!({ "gateway": gateway, "endpoints": endpoints })
}

/// The bound on the table's size with the default limits: 1,000 blocks of at most
/// 512 bytes of endpoint, a model name and a reason of a fleet block, and the models.
const TABLE_BOUND: usize = 1_000 * 1_024 + 64 * 1_024;

#[test]
fn a_report_flood_at_the_api_maximum_stays_within_bounds() {
    let data = tempfile::tempdir().unwrap();
    // As shipped: the default log level, written out.
    let log_path = data.path().join("stanch.log");
    let mut server = as_shipped(data.path(), &[], &log_path);
    let http = client();
    let rounds = 30;
    let mut refused = 0u64;
    for round in 0..rounds {
        let r = http
            .post(format!("{}/v1/reports", server.base))
            .bearer_auth("ing")
            .json(&report(round))
            .send()
            .unwrap();
        assert_eq!(r.status(), 200, "round {round}");
        let body: Value = r.json().unwrap();
        refused += body["refused"].as_u64().expect("refused is counted");
    }
    // 1,000 pairs are tracked at a time, each counted once into a block.
    assert!(
        refused >= (rounds as u64 - 1) * 9_000,
        "most entries are refused: {refused}"
    );
    let table = http
        .get(format!("{}/v1/routes", server.base))
        .bearer_auth("rd")
        .send()
        .unwrap()
        .bytes()
        .unwrap();
    let parsed: Value = serde_json::from_slice(&table).unwrap();
    let blocks = parsed["blocked"].as_array().unwrap().len();
    assert_eq!(blocks, 1_000, "blocking.max_blocks holds");
    assert!(table.len() < TABLE_BOUND, "table {} bytes", table.len());
    let metrics = server.metrics();
    assert!(
        metrics.contains("stanch_blocks_refused_total{kind=\"limit\"}"),
        "refused blocks are counted"
    );
    assert!(metrics.contains("stanch_reports_refused_total{kind=\"limit\"}"));

    // A flood is a warning a minute, not a line per report.
    let logged = std::fs::read_to_string(&log_path).unwrap();
    for warning in ["report entries not counted", "block limit reached"] {
        assert_eq!(
            logged.matches(warning).count(),
            1,
            "{warning:?} once in:\n{logged}"
        );
    }

    let rss = peak_rss_mib(server.child.id());
    let disk = dir_bytes(data.path()) - std::fs::metadata(&log_path).unwrap().len();
    eprintln!(
        "after {rounds} reports of {MAX_REPORT_ENDPOINTS}: peak RSS {rss:.0} MiB, data dir {} KiB, table {} KiB",
        disk / 1024,
        table.len() / 1024
    );
    assert!(rss < 64.0, "peak RSS {rss:.0} MiB");
    assert!(disk < 16 << 20, "data dir {disk} bytes");

    // A restart after the flood, from a kill: it replays within the same bounds.
    server.child.kill().unwrap();
    server.child.wait().unwrap();
    let server = as_shipped(data.path(), &[], &log_path);
    let replayed: Value = server.routes();
    assert_eq!(replayed["blocked"].as_array().unwrap().len(), 1_000);
    let rss = peak_rss_mib(server.child.id());
    eprintln!("restarted: peak RSS {rss:.0} MiB");
    assert!(rss < 64.0, "peak RSS after restart {rss:.0} MiB");
}

/// A configuration file: the embedded default policy and `server`, the controller's
/// own settings, written under `dir`.
fn config_file(dir: &Path, server: &str) -> String {
    let path = dir.join("config.yaml");
    let text = format!("{}\n{server}", stanch_core::config::DEFAULT_CONFIG_YAML);
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_owned()
}

/// A metric's value in an exposition, 0 when absent.
fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

/// The controller's metrics, asked from 127.0.0.2: not from the address a flood comes
/// from, whose connections are at their limit.
fn metrics_from_elsewhere(server: &Server) -> String {
    reqwest::blocking::Client::builder()
        .local_address(std::net::IpAddr::from([127, 0, 0, 2]))
        .build()
        .unwrap()
        .get(format!("{}/metrics", server.base))
        .bearer_auth("rd")
        .send()
        .unwrap()
        .text()
        .unwrap()
}

/// One client opens connections without end: half of them HTTP/2 that answer every
/// ping and open no stream (the review's), half of them SSE watchers. It holds at
/// most `connections.max_per_source` (1,000) at a bounded cost; the rest are closed as
/// soon as accepted, counted, and logged once; the idle HTTP/2 ones are closed at
/// `connections.http2_idle_timeout` while the watchers, which are in use, stay.
#[test]
fn a_connection_and_watch_flood_holds_a_bounded_share() {
    use std::time::Duration;
    stanch_server::net::raise_open_file_limit();
    let data = tempfile::tempdir().unwrap();
    let config = config_file(data.path(), "connections:\n  http2_idle_timeout: 3s\n");
    let log_path = data.path().join("stanch.log");
    let server = as_shipped(&data.path().join("data"), &["--config", &config], &log_path);
    let addr: std::net::SocketAddr = server.base.trim_start_matches("http://").parse().unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (idle, watchers, refused) = runtime.block_on(async {
        let mut idle = Vec::new();
        let mut watchers = Vec::new();
        let mut refused = 0;
        for i in 0..1_100 {
            let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
            if i % 2 == 0 {
                // The handshake does not wait for the server: a refused one is told
                // apart below, by its connection having ended.
                match h2::client::handshake(tcp).await {
                    Ok((client, connection)) => idle.push((client, tokio::spawn(connection))),
                    Err(_) => refused += 1,
                }
            } else {
                let mut tcp = tcp;
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let ask = "GET /v1/routes/stream HTTP/1.1\r\nHost: 127.0.0.1\r\n\
                           Authorization: Bearer rd\r\nAccept: text/event-stream\r\n\r\n";
                let mut first = [0u8; 64];
                let answered = async {
                    tcp.write_all(ask.as_bytes()).await?;
                    tcp.read(&mut first).await
                };
                match tokio::time::timeout(Duration::from_secs(5), answered).await {
                    Ok(Ok(n)) if first[..n].starts_with(b"HTTP/1.1 200") => watchers.push(tcp),
                    _ => refused += 1,
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let (ended, idle): (Vec<_>, Vec<_>) = idle
            .into_iter()
            .partition(|(_, connection)| connection.is_finished());
        (idle, watchers, refused + ended.len())
    });
    let metrics = metrics_from_elsewhere(&server);
    let held = idle.len() + watchers.len();
    eprintln!(
        "held {held} ({} idle HTTP/2, {} SSE watchers), refused {refused}",
        idle.len(),
        watchers.len()
    );
    assert_eq!(held, 1_000, "max_per_source holds");
    assert_eq!(refused, 100);
    assert!(
        metric(
            &metrics,
            "stanch_connections_refused_total{reason=\"per_source\"}"
        ) >= 100.0,
        "counted:\n{metrics}"
    );
    let rss = peak_rss_mib(server.child.id());
    eprintln!("peak RSS with 1,000 connections held: {rss:.0} MiB");
    assert!(rss < 96.0, "peak RSS {rss:.0} MiB");

    // The idle HTTP/2 connections are closed; the watchers stay.
    runtime.block_on(async {
        for (_client, connection) in idle {
            let ended = tokio::time::timeout(Duration::from_secs(10), connection).await;
            assert!(ended.is_ok(), "an idle HTTP/2 connection is closed");
        }
    });
    let metrics = metrics_from_elsewhere(&server);
    let open = metric(&metrics, "stanch_connections_open");
    assert!((500.0..=502.0).contains(&open), "the watchers stay: {open}");
    assert_eq!(metric(&metrics, "stanch_watchers{kind=\"sse\"}"), 500.0);
    drop(watchers);
    until("all closed", Duration::from_secs(10), || {
        metric(&metrics_from_elsewhere(&server), "stanch_connections_open") <= 1.0
    });
    let logged = std::fs::read_to_string(&log_path).unwrap();
    assert_eq!(
        logged.matches("connections refused").count(),
        1,
        "once a minute at most:\n{logged}"
    );
}

/// A gRPC watch on its way: the answer to come, and the request's body, kept open.
type Watch = (h2::client::ResponseFuture, h2::SendStream<bytes::Bytes>);

/// Opens `connections` HTTP/2 connections to `server` of `streams` gRPC watches each,
/// every one sending `first(n)` at once (its Hello, and whatever follows), as a client
/// on HTTP/2 itself would; returns the watches and the connections' tasks.
async fn grpc_watches(
    server: &Server,
    connections: usize,
    streams: usize,
    first: impl Fn(usize) -> Vec<u8>,
) -> (
    Vec<Watch>,
    Vec<tokio::task::JoinHandle<Result<(), h2::Error>>>,
) {
    let addr: std::net::SocketAddr = server.base.trim_start_matches("http://").parse().unwrap();
    let mut watches = Vec::new();
    let mut held = Vec::new();
    for _ in 0..connections {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (client, connection) = h2::client::handshake(tcp).await.unwrap();
        held.push(tokio::spawn(connection));
        let mut client = client.ready().await.unwrap();
        for _ in 0..streams {
            let request =
                http::Request::post(format!("{}/stanch.v1.RouteWatch/WatchRoutes", server.base))
                    .header("content-type", "application/grpc")
                    .header("te", "trailers")
                    .header("authorization", "Bearer rd")
                    .body(())
                    .unwrap();
            client = client.ready().await.unwrap();
            let (response, mut body) = client.send_request(request, false).unwrap();
            let bytes = first(watches.len());
            body.reserve_capacity(bytes.len());
            body.send_data(bytes.into(), false).unwrap();
            watches.push((response, body));
        }
    }
    (watches, held)
}

/// A gateway's Hello, as gRPC frames it.
fn hello(n: usize) -> Vec<u8> {
    use stanch_proto::v1;
    stanch_proto::grpc_frame(&v1::WatchRequest {
        kind: Some(v1::watch_request::Kind::Hello(v1::Hello {
            gateway_id: format!("gw-{n:05}"),
            ..Default::default()
        })),
    })
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// gRPC streams by the thousand, each sending its Hello and then 65,530 bytes of a
/// message declared as 65,535 (the review's): what they hold is bounded by the
/// budget of bodies arriving, and every one ends by `watch.slow_client_timeout`.
#[test]
fn a_partial_message_flood_holds_a_bounded_share() {
    use std::time::Duration;
    stanch_server::net::raise_open_file_limit();
    let data = tempfile::tempdir().unwrap();
    let config = config_file(data.path(), "watch:\n  slow_client_timeout: 3s\n");
    let log_path = data.path().join("stanch.log");
    let server = as_shipped(&data.path().join("data"), &["--config", &config], &log_path);
    let (connections, streams) = (40, 100);
    let started = tokio::time::Instant::now();
    let ended = runtime().block_on(async {
        let (watches, _held) = grpc_watches(&server, connections, streams, |n| {
            // Then 65,530 bytes of a message declared as 65,535.
            let mut frame = hello(n);
            frame.extend_from_slice(&[0, 0, 0, 0xff, 0xff]);
            frame.extend(std::iter::repeat_n(0x0a, 65_530));
            frame
        })
        .await;
        let answers: Vec<_> = watches
            .into_iter()
            .map(|(response, body)| {
                tokio::spawn(async move {
                    let _body = body;
                    let mut answer = response.await.ok()?.into_body();
                    while let Some(chunk) = answer.data().await {
                        let chunk = chunk.ok()?;
                        let _ = answer.flow_control().release_capacity(chunk.len());
                    }
                    answer.trailers().await.ok().flatten()
                })
            })
            .collect();
        let mut ended = 0;
        for answer in answers {
            let trailers = tokio::time::timeout(Duration::from_secs(20), answer)
                .await
                .expect("every stream ends")
                .unwrap();
            if trailers.is_some_and(|t| t.get("grpc-status").is_some_and(|s| s != "0")) {
                ended += 1;
            }
        }
        ended
    });
    let took = started.elapsed();
    let rss = peak_rss_mib(server.child.id());
    eprintln!(
        "{} streams with a message under way: {ended} ended with a status within {took:?}; peak RSS {rss:.0} MiB",
        connections * streams
    );
    assert_eq!(
        ended,
        connections * streams,
        "every stream ends with a status"
    );
    assert!(rss < 128.0, "peak RSS {rss:.0} MiB");
}

/// One holder of the read token opening gRPC watches without end, a hundred to a
/// connection: it gets `watch.max_watchers` of them and no more (UNAVAILABLE past it),
/// each at a bounded cost.
#[test]
fn a_watch_flood_stops_at_max_watchers() {
    use std::time::Duration;
    stanch_server::net::raise_open_file_limit();
    let data = tempfile::tempdir().unwrap();
    let config = config_file(data.path(), "watch:\n  max_watchers: 2000\n");
    let log_path = data.path().join("stanch.log");
    let server = as_shipped(&data.path().join("data"), &["--config", &config], &log_path);
    let idle = peak_rss_mib(server.child.id());
    // Kept until the end: the watches' connections run on it.
    let clients = runtime();
    let (held, refused, _keep) = clients.block_on(async {
        let (watches, connections) = grpc_watches(&server, 21, 100, hello).await;
        let (mut held, mut refused, mut keep) = (0, 0, Vec::new());
        for (response, body) in watches {
            let response = tokio::time::timeout(Duration::from_secs(20), response)
                .await
                .expect("an answer")
                .unwrap();
            // Past the limit, a trailers-only answer: the status in the headers.
            if let Some(status) = response.headers().get("grpc-status") {
                assert_eq!(status, "14", "UNAVAILABLE");
                refused += 1;
                continue;
            }
            let mut answer = response.into_body();
            let table = tokio::time::timeout(Duration::from_secs(20), answer.data())
                .await
                .expect("the table")
                .expect("a message")
                .unwrap();
            let _ = answer.flow_control().release_capacity(table.len());
            held += 1;
            keep.push((answer, body));
        }
        (held, refused, (keep, connections))
    });
    let rss = peak_rss_mib(server.child.id());
    let each = (rss - idle) * 1024.0 / f64::from(held);
    eprintln!(
        "gRPC watches: {held} held, {refused} refused; peak RSS {rss:.0} MiB ({each:.0} KiB a watch)"
    );
    assert_eq!((held, refused), (2_000, 100));
    let metrics = metrics_from_elsewhere(&server);
    assert_eq!(metric(&metrics, "stanch_watchers{kind=\"grpc\"}"), 2_000.0);
    assert!(rss < 128.0, "peak RSS {rss:.0} MiB");
}

/// Alerts at the API's maximum: notifications of 1 MiB, every alert with 64 labels
/// filling their 8 KiB and 64 annotations of 1 KiB (cut to 4 KiB), none of them
/// mapping to anything (the review's flood was 320 such alerts with 62 annotations of
/// 16 KB: 329 MB). The controller holds at most `alerts.max_bytes` of them, refuses
/// the rest with 503, and its memory, data directory and a restart stay bounded.
#[test]
fn an_alert_flood_at_the_api_maximum_stays_within_bounds() {
    let data = tempfile::tempdir().unwrap();
    let log_path = data.path().join("stanch.log");
    let dir = data.path().join("data");
    let mut server = as_shipped(&dir, &[], &log_path);
    let http = client();
    let alert = |n: usize| {
        let mut labels = serde_json::Map::new();
        labels.insert("alertname".into(), json!(format!("Flood{n:06}")));
        for l in 1..64 {
            labels.insert(
                format!("l{l:02}"),
                json!(format!("{n:06}{}", "v".repeat(120))),
            );
        }
        let annotations: serde_json::Map<String, Value> = (0..64)
            .map(|a| (format!("a{a:02}"), json!("d".repeat(1_000))))
            .collect();
        json!({"status": "firing", "labels": labels, "annotations": annotations,
               "startsAt": "2026-12-07T00:00:00Z", "endsAt": "0001-01-01T00:00:00Z"})
    };
    let per_request = 13;
    let (mut taken, mut refused_503) = (0, 0);
    for request in 0..120 {
        let alerts: Vec<Value> = (0..per_request)
            .map(|i| alert(request * per_request + i))
            .collect();
        let body = json!({"version": "4", "status": "firing", "receiver": "stanch",
                          "alerts": alerts})
        .to_string();
        assert!(
            body.len() <= 1 << 20,
            "within intake.max_body_bytes: {}",
            body.len()
        );
        let r = http
            .post(format!("{}/v1/alerts/alertmanager", server.base))
            .bearer_auth("ing")
            .header("content-type", "application/json")
            .body(body)
            .send()
            .unwrap();
        match r.status().as_u16() {
            200 => taken += 1,
            503 => refused_503 += 1,
            other => panic!("request {request}: {other} {}", r.text().unwrap()),
        }
    }
    let metrics = server.metrics();
    let active = metric(&metrics, "stanch_alerts_active");
    let rss = peak_rss_mib(server.child.id());
    let disk = dir_bytes(&dir);
    eprintln!(
        "120 notifications of {per_request} alerts: {taken} taken whole, {refused_503} answered 503; \
         {active} alerts active; peak RSS {rss:.0} MiB, data dir {} KiB",
        disk / 1024
    );
    assert!(refused_503 > 0, "alerts.max_bytes was reached");
    assert!(
        (700.0..1_100.0).contains(&active),
        "16 MiB holds about a thousand such alerts: {active}"
    );
    // 91 MiB as shipped (the release build), more as the test profile builds it.
    assert!(rss < 128.0, "peak RSS {rss:.0} MiB");
    assert!(disk < 64 << 20, "data dir {disk} bytes");

    server.child.kill().unwrap();
    server.child.wait().unwrap();
    let server = as_shipped(&dir, &[], &log_path);
    let again = metric(&server.metrics(), "stanch_alerts_active");
    let rss = peak_rss_mib(server.child.id());
    eprintln!("restarted: {again} alerts active, peak RSS {rss:.0} MiB");
    assert_eq!(again, active, "a restart holds the same alerts");
    assert!(rss < 128.0, "peak RSS after restart {rss:.0} MiB");
}
