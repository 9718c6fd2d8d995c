//! `stanch-bench fleet`: a fleet of watchers on one `stanch serve` process, on loopback.
//!
//! 5,000 gRPC watchers (each acknowledging every table), 3,000 SSE and 2,000 long-poll
//! watchers by default. Then: how fast a new version reaches them (per transport, the
//! tail, and the last), how soon every gRPC watcher's Ack shows in `/v1/status`, the
//! controller's CPU per version (and the watchers', on the same cores) and its memory;
//! 1,000 watchers that stop reading (a full receive window) joining, and being cut
//! off, while the others are timed; and a controller killed and restarted under all
//! of them (the reconnect storm).
//!
//! The benchmark raises its own file-descriptor limit (soft to hard) before it opens
//! anything; the controller, its child, inherits it.
//!
//! Size: the fleet benchmark with its lean watchers and its report, kept together so that a change to what is measured is seen with how.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, bail};
use serde_json::Value;
use stanch_proto::v1::route_watch_client::RouteWatchClient;
use stanch_proto::v1::{self, watch_request, watch_response};
use tokio::time::Instant;

use crate::{RawConn, percentile, show, toggling_webhook};

#[derive(Debug, clap::Args)]
pub struct FleetArgs {
    /// The stanch binary to measure (build it with --release).
    #[arg(long, default_value = "target/release/stanch")]
    stanch: PathBuf,
    /// gRPC watchers.
    #[arg(long, default_value_t = 5000)]
    grpc: usize,
    /// SSE watchers.
    #[arg(long, default_value_t = 3000)]
    sse: usize,
    /// Long-poll watchers.
    #[arg(long, default_value_t = 2000)]
    long_poll: usize,
    /// Versions timed across the fleet.
    #[arg(long, default_value_t = 30)]
    rounds: usize,
    /// Watchers that stop reading.
    #[arg(long, default_value_t = 1000)]
    slow: usize,
    /// The gRPC watchers' client: `h2`, lean (HTTP/2 and gRPC framing by hand, only a
    /// table's version and epoch decoded, as the SSE and long-poll watchers read only
    /// the event id and version); or `tonic`, as stanch-client watches (a tonic
    /// channel, every table decoded whole), which costs the shared cores more.
    #[arg(long, value_enum, default_value_t = GrpcClient::H2)]
    grpc_client: GrpcClient,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum GrpcClient {
    H2,
    Tonic,
}

/// The transports, in the order results are printed.
const KINDS: [&str; 3] = ["grpc", "sse", "long_poll"];

/// What the watchers saw: for each table arrival, (transport, version, when).
type Arrivals = Arc<Mutex<Vec<(usize, u64, Instant)>>>;

/// The controller process on a fixed port and data directory, so that it can be
/// killed and started again where the fleet expects it.
struct Controller {
    bin: PathBuf,
    port: u16,
    data: tempfile::TempDir,
    child: Option<Child>,
}

impl Controller {
    async fn start(bin: PathBuf, max_watchers: usize) -> anyhow::Result<Controller> {
        let data = tempfile::tempdir()?;
        // Room for the stuck watchers beside the fleet, and their connections.
        let config = crate::loopback_config(&format!(
            "  max: {}\nwatch:\n  max_watchers: {max_watchers}\n",
            max_watchers + 1_000
        ));
        std::fs::write(data.path().join("stanch.yaml"), config)?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let mut c = Controller {
            bin,
            port,
            data,
            child: None,
        };
        c.spawn().await?;
        Ok(c)
    }

    fn base(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    async fn spawn(&mut self) -> anyhow::Result<()> {
        let child = Command::new(&self.bin)
            .args(["serve", "--listen", &format!("127.0.0.1:{}", self.port)])
            .arg("--config")
            .arg(self.data.path().join("stanch.yaml"))
            .arg("--data-dir")
            .arg(self.data.path().join("state"))
            // As shipped: logging on at the default level.
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("cannot run {}", self.bin.display()))?;
        self.child = Some(child);
        let http = reqwest::Client::new();
        for _ in 0..400 {
            if http
                .get(format!("{}/readyz", self.base()))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success())
            {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        bail!("stanch did not become ready")
    }

    /// `kill -9`.
    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    fn rss_kib(&self) -> u64 {
        crate::rss_kib(self.pid())
    }

    fn cpu_ticks(&self) -> u64 {
        cpu_ticks(self.pid())
    }
}

/// The CPU time process `pid` has used so far (user + system), in clock ticks of
/// 10 ms; 0 when it cannot be read.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The fields after the command name, which is in parentheses.
    let ticks = |fields: &[&str]| -> Option<u64> {
        Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
    };
    stat.rsplit_once(')')
        .and_then(|(_, rest)| ticks(&rest.split_whitespace().collect::<Vec<_>>()))
        .unwrap_or(0)
}

impl Drop for Controller {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A spread of up to a second, the same for a watcher and attempt each run.
fn jitter(watcher: usize, attempt: u64) -> Duration {
    let mut h = stanch_api::hash::Fnv64::default();
    h.write(&(watcher as u64).to_le_bytes());
    h.write(&attempt.to_le_bytes());
    Duration::from_millis(h.finish() % 1000)
}

/// One gRPC watcher as stanch-client watches, on a tonic channel: Hello with what it
/// holds, an Ack for every table; on any end, again after up to a second.
async fn grpc_watcher(base: String, i: usize, arrivals: Arrivals) {
    let endpoint = tonic::transport::Endpoint::from_shared(base)
        .expect("a URL")
        .tcp_nodelay(true);
    let mut held = (0u64, String::new());
    for attempt in 0u64.. {
        if attempt > 0 {
            tokio::time::sleep(jitter(i, attempt)).await;
        }
        let Ok(channel) = endpoint.connect().await else {
            continue;
        };
        let mut client = RouteWatchClient::new(channel).max_decoding_message_size(32 << 20);
        let (out, outbound) = tokio::sync::mpsc::channel(4);
        let hello = watch_request::Kind::Hello(v1::Hello {
            gateway_id: format!("grpc-{i}"),
            version: held.0,
            epoch: held.1.clone(),
        });
        let _ = out.try_send(v1::WatchRequest { kind: Some(hello) });
        let request = tonic::codegen::tokio_stream::wrappers::ReceiverStream::new(outbound);
        let Ok(response) = client.watch_routes(request).await else {
            continue;
        };
        let mut inbound = response.into_inner();
        while let Ok(Some(message)) = inbound.message().await {
            if let Some(watch_response::Kind::Table(t)) = message.kind {
                arrivals
                    .lock()
                    .unwrap()
                    .push((0, t.version, Instant::now()));
                held = (t.version, t.epoch.clone());
                let ack = watch_request::Kind::Ack(v1::Ack {
                    version: t.version,
                    epoch: t.epoch,
                });
                if out
                    .send(v1::WatchRequest { kind: Some(ack) })
                    .await
                    .is_err()
                {
                    break;
                }
            }
        }
    }
}

/// What a lean gRPC watcher reads of a `WatchResponse`: the table's version and epoch
/// (the same field numbers; prost skips the rest unread, as any reader skips fields it
/// does not know).
#[derive(Clone, PartialEq, prost::Message)]
struct ResponseHead {
    #[prost(message, optional, tag = "1")]
    table: Option<TableHead>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct TableHead {
    #[prost(uint64, tag = "1")]
    version: u64,
    #[prost(string, tag = "2")]
    epoch: String,
}

/// `message` as a gRPC message on the wire.
fn grpc_frame(message: &impl prost::Message) -> bytes::Bytes {
    stanch_proto::grpc_frame(message).into()
}

/// One lean gRPC watcher, on h2 itself: Hello with what it holds, an Ack for every
/// table; on any end, again after up to a second.
async fn h2_grpc_watcher(addr: String, base: String, i: usize, arrivals: Arrivals) {
    use bytes::Buf;
    let mut held = (0u64, String::new());
    for attempt in 0u64.. {
        if attempt > 0 {
            tokio::time::sleep(jitter(i, attempt)).await;
        }
        let Ok(tcp) = tokio::net::TcpStream::connect(&addr).await else {
            continue;
        };
        let _ = tcp.set_nodelay(true);
        let Ok((client, connection)) = h2::client::handshake(tcp).await else {
            continue;
        };
        // It ends once the connection fails or the handles below are dropped.
        tokio::spawn(connection);
        let request = http::Request::post(format!("{base}/stanch.v1.RouteWatch/WatchRoutes"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(())
            .expect("a valid request");
        let Ok(mut client) = client.ready().await else {
            continue;
        };
        let Ok((response, mut send)) = client.send_request(request, false) else {
            continue;
        };
        let hello = v1::WatchRequest {
            kind: Some(watch_request::Kind::Hello(v1::Hello {
                gateway_id: format!("grpc-{i}"),
                version: held.0,
                epoch: held.1.clone(),
            })),
        };
        if send.send_data(grpc_frame(&hello), false).is_err() {
            continue;
        }
        let Ok(response) = response.await else {
            continue;
        };
        let mut body = response.into_body();
        let mut pending = bytes::BytesMut::new();
        'stream: while let Some(Ok(chunk)) = body.data().await {
            let _ = body.flow_control().release_capacity(chunk.len());
            pending.extend_from_slice(&chunk);
            while pending.len() >= 5 {
                let len = u32::from_be_bytes([pending[1], pending[2], pending[3], pending[4]]);
                let len = usize::try_from(len).unwrap_or(usize::MAX);
                if pending.len() - 5 < len {
                    break;
                }
                pending.advance(5);
                let message = pending.split_to(len);
                let Ok(head) = <ResponseHead as prost::Message>::decode(message) else {
                    break 'stream;
                };
                let Some(t) = head.table else {
                    continue; // a heartbeat
                };
                arrivals
                    .lock()
                    .unwrap()
                    .push((0, t.version, Instant::now()));
                let ack = v1::WatchRequest {
                    kind: Some(watch_request::Kind::Ack(v1::Ack {
                        version: t.version,
                        epoch: t.epoch.clone(),
                    })),
                };
                held = (t.version, t.epoch);
                if send.send_data(grpc_frame(&ack), false).is_err() {
                    break 'stream;
                }
            }
        }
    }
}

/// One SSE watcher, resuming with `Last-Event-ID`.
async fn sse_watcher(addr: String, i: usize, arrivals: Arrivals) {
    let mut held = None;
    for attempt in 0u64.. {
        if attempt > 0 {
            tokio::time::sleep(jitter(i, attempt)).await;
        }
        let resume = held
            .map(|v| format!("Last-Event-ID: {v}\r\n"))
            .unwrap_or_default();
        let request = format!(
            "GET /v1/routes/stream HTTP/1.1\r\nHost: {addr}\r\nX-Stanch-Gateway: sse-{i}\r\n{resume}\r\n"
        );
        let Ok(mut conn) = RawConn::open(&addr, &request).await else {
            continue;
        };
        while let Some(id) = conn.next_sse_id().await {
            arrivals.lock().unwrap().push((1, id, Instant::now()));
            held = Some(id);
        }
    }
}

/// One long-poll watcher.
async fn long_poll_watcher(addr: String, i: usize, arrivals: Arrivals, start: u64) {
    let mut have = start;
    for attempt in 0u64.. {
        if attempt > 0 {
            tokio::time::sleep(jitter(i, attempt)).await;
        }
        let Ok(mut conn) = RawConn::open(&addr, "").await else {
            continue;
        };
        loop {
            let request = format!(
                "GET /v1/routes?after={have}&wait=30s HTTP/1.1\r\nHost: {addr}\r\nX-Stanch-Gateway: lp-{i}\r\nX-Stanch-Applied-Version: {have}\r\n\r\n"
            );
            let Some((status, version)) = conn.exchange(&request).await else {
                break;
            };
            if status == 200
                && let Some(v) = version
            {
                have = v;
                arrivals.lock().unwrap().push((2, v, Instant::now()));
            }
        }
    }
}

/// A gRPC watcher that says Hello and never reads: a receive window of 64 bytes,
/// never released. Returns when the controller closes its connection.
async fn stuck_watcher(addr: String, base: String, i: usize) -> Option<Instant> {
    let tcp = tokio::net::TcpStream::connect(addr).await.ok()?;
    let (client, connection) = h2::client::Builder::new()
        .initial_window_size(64)
        .handshake::<_, bytes::Bytes>(tcp)
        .await
        .ok()?;
    let connection = tokio::spawn(connection);
    let mut client = client.ready().await.ok()?;
    let request = http::Request::post(format!("{base}/stanch.v1.RouteWatch/WatchRoutes"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .ok()?;
    let (response, mut body) = client.send_request(request, false).ok()?;
    let hello = v1::WatchRequest {
        kind: Some(watch_request::Kind::Hello(v1::Hello {
            gateway_id: format!("stuck-{i}"),
            ..Default::default()
        })),
    };
    body.send_data(grpc_frame(&hello), false).ok()?;
    let _response = response.await.ok()?;
    // The controller closes the connection once it gives up on us.
    let _ = connection.await;
    let ended = Instant::now();
    drop(body);
    Some(ended)
}

/// The arrivals of `version` or newer: the first per watcher is what counts, and every
/// watcher records each version once.
fn latencies(arrivals: &Arrivals, version: u64, since: Instant) -> [Vec<Duration>; 3] {
    let mut by_kind: [Vec<Duration>; 3] = Default::default();
    for (kind, v, at) in arrivals.lock().unwrap().iter() {
        if *v == version {
            by_kind[*kind].push(at.saturating_duration_since(since));
        }
    }
    for k in &mut by_kind {
        k.sort();
    }
    by_kind
}

/// Publishes a new version; waits until `expected` watchers hold it (at most
/// `within`). Returns the version and the latencies by transport.
async fn round(
    http: &reqwest::Client,
    base: &str,
    n: usize,
    arrivals: &Arrivals,
    expected: usize,
    within: Duration,
) -> anyhow::Result<(u64, Instant, [Vec<Duration>; 3])> {
    arrivals.lock().unwrap().clear();
    let started = Instant::now();
    let hook = format!("{base}/v1/alerts/alertmanager");
    let answer: Value = crate::webhook(http, &hook, toggling_webhook(20_000 + n))
        .send()
        .await?
        .json()
        .await?;
    let version = answer["version"].as_u64().context("version")?;
    let give_up = started + within;
    loop {
        let got = arrivals
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, v, _)| *v == version)
            .count();
        if got >= expected || Instant::now() > give_up {
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    Ok((version, started, latencies(arrivals, version, started)))
}

/// Connected watchers by transport, from `/metrics`.
async fn connected(http: &reqwest::Client, base: &str) -> anyhow::Result<u64> {
    let text = http
        .get(format!("{base}/metrics"))
        .send()
        .await?
        .text()
        .await?;
    Ok(text
        .lines()
        .filter(|l| l.starts_with("stanch_watchers{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum())
}

/// Gateways over gRPC whose applied version is `version`, from `/v1/status`.
async fn acked(http: &reqwest::Client, base: &str, version: u64) -> anyhow::Result<usize> {
    let status: Value = http
        .get(format!("{base}/v1/status"))
        .send()
        .await?
        .json()
        .await?;
    Ok(status["gateways"]
        .as_array()
        .map(|gs| {
            gs.iter()
                .filter(|g| g["transport"] == "grpc" && g["applied_version"] == version)
                .count()
        })
        .unwrap_or(0))
}

fn summary(label: &str, sorted: &[Duration]) {
    if sorted.is_empty() {
        return;
    }
    println!(
        "  {label:<10} {:>6} arrivals: p50 {}  p99 {}  max {}",
        sorted.len(),
        show(percentile(sorted, 0.50)),
        show(percentile(sorted, 0.99)),
        show(*sorted.last().unwrap_or(&Duration::ZERO)),
    );
}

// Size: a benchmark's script, start to finish, read top to bottom.
pub async fn run(args: FleetArgs) -> anyhow::Result<()> {
    let (before, after) =
        stanch_net::raise_open_file_limit().context("cannot raise the open-file limit")?;
    println!("open-file limit: {before} -> {after}");
    let total = args.grpc + args.sse + args.long_poll;
    let mut controller = Controller::start(args.stanch.clone(), total + args.slow + 100).await?;
    let base = controller.base();
    let addr = base.trim_start_matches("http://").to_owned();
    let http = reqwest::Client::new();
    println!("idle RSS: {} KiB", controller.rss_kib());
    let start: u64 = http
        .get(format!("{base}/v1/routes"))
        .send()
        .await?
        .json::<Value>()
        .await?["version"]
        .as_u64()
        .unwrap_or(0);

    // The fleet, in batches, so the listener's backlog is not the thing measured.
    let arrivals: Arrivals = Arc::default();
    let mut tasks = Vec::new();
    let connecting = Instant::now();
    for i in 0..total {
        let arrivals = arrivals.clone();
        tasks.push(if i < args.grpc {
            match args.grpc_client {
                GrpcClient::H2 => {
                    tokio::spawn(h2_grpc_watcher(addr.clone(), base.clone(), i, arrivals))
                }
                GrpcClient::Tonic => tokio::spawn(grpc_watcher(base.clone(), i, arrivals)),
            }
        } else if i < args.grpc + args.sse {
            tokio::spawn(sse_watcher(addr.clone(), i, arrivals))
        } else {
            tokio::spawn(long_poll_watcher(addr.clone(), i, arrivals, start))
        });
        if i % 250 == 249 {
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while connected(&http, &base).await? < total as u64 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!(
        "watchers connected: {} of {total} ({} gRPC, {} SSE, {} long-poll) in {:.1} s",
        connected(&http, &base).await?,
        args.grpc,
        args.sse,
        args.long_poll,
        connecting.elapsed().as_secs_f64()
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rss_connected = controller.rss_kib();
    println!(
        "RSS with the fleet connected: {rss_connected} KiB ({:.1} MiB)",
        rss_connected as f64 / 1024.0
    );

    // 1. New versions across the fleet, and the controller's CPU for them.
    let mut all: [Vec<Duration>; 3] = Default::default();
    let mut p99s = Vec::new();
    let mut lasts = Vec::new();
    let mut short = 0;
    let ticks = controller.cpu_ticks();
    let own_ticks = cpu_ticks(std::process::id());
    for n in 0..args.rounds {
        let (version, _, by_kind) =
            round(&http, &base, n, &arrivals, total, Duration::from_secs(5)).await?;
        let mut every: Vec<Duration> = by_kind.iter().flatten().copied().collect();
        every.sort();
        if every.len() < total {
            short += 1;
            println!(
                "round {n}: {} of {total} watchers got version {version} within 5 s",
                every.len()
            );
        }
        p99s.push(percentile(&every, 0.99));
        lasts.push(*every.last().unwrap_or(&Duration::ZERO));
        for (k, v) in by_kind.into_iter().enumerate() {
            all[k].extend(v);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let cpu = (controller.cpu_ticks() - ticks) as f64 * 10.0; // ms
    let own_cpu = (cpu_ticks(std::process::id()) - own_ticks) as f64 * 10.0;
    p99s.sort();
    lasts.sort();
    println!(
        "webhook -> watchers holding the version ({} rounds of {total}; {short} short):",
        args.rounds
    );
    for (k, label) in KINDS.iter().enumerate() {
        all[k].sort();
        summary(label, &all[k]);
    }
    let mut every: Vec<Duration> = all.iter().flatten().copied().collect();
    every.sort();
    summary("all", &every);
    println!(
        "  per round: p99 of the fleet worst {}, median {}; the last watcher worst {}, median {}",
        show(*p99s.last().unwrap_or(&Duration::ZERO)),
        show(percentile(&p99s, 0.5)),
        show(*lasts.last().unwrap_or(&Duration::ZERO)),
        show(percentile(&lasts, 0.5)),
    );
    println!(
        "controller CPU: {:.1} ms per version, {:.2} ms per version per 1000 watchers (includes the webhook and the watchers' requests)",
        cpu / args.rounds as f64,
        cpu / args.rounds as f64 / (total as f64 / 1000.0)
    );
    // On the same cores: what of the machine the controller could not have.
    println!(
        "the watchers' CPU (this process): {:.1} ms per version",
        own_cpu / args.rounds as f64
    );
    println!("RSS after the rounds: {} KiB", controller.rss_kib());

    // 2. Acks: every gRPC watcher's visible in the status report.
    let mut ack_times = Vec::new();
    for n in 0..5 {
        let (version, started, _) = round(
            &http,
            &base,
            args.rounds + n,
            &arrivals,
            total,
            Duration::from_secs(5),
        )
        .await?;
        let give_up = started + Duration::from_secs(10);
        loop {
            if acked(&http, &base, version).await? >= args.grpc {
                ack_times.push(started.elapsed());
                break;
            }
            if Instant::now() > give_up {
                println!("acks: not all {} within 10 s", args.grpc);
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    ack_times.sort();
    println!(
        "webhook -> all {} gRPC acks visible in /v1/status ({} rounds): median {}  max {}",
        args.grpc,
        ack_times.len(),
        show(percentile(&ack_times, 0.5)),
        show(*ack_times.last().unwrap_or(&Duration::ZERO)),
    );

    // 3. Watchers that stop reading join; the others are timed meanwhile.
    let stuck_at = Instant::now();
    let stuck: Vec<_> = (0..args.slow)
        .map(|i| tokio::spawn(stuck_watcher(addr.clone(), base.clone(), i)))
        .collect();
    tokio::time::sleep(Duration::from_secs(1)).await;
    println!(
        "with {} stuck watchers: {} connected, RSS {} KiB",
        args.slow,
        connected(&http, &base).await?,
        controller.rss_kib()
    );
    let mut during = Vec::new();
    for n in 0..10 {
        let (_, _, by_kind) = round(
            &http,
            &base,
            args.rounds + 10 + n,
            &arrivals,
            total,
            Duration::from_secs(5),
        )
        .await?;
        during.extend(by_kind.into_iter().flatten());
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    during.sort();
    summary("others", &during);
    let mut cut = Vec::new();
    for s in stuck {
        if let Ok(Some(at)) = tokio::time::timeout(Duration::from_secs(30), s)
            .await
            .unwrap_or(Ok(None))
        {
            cut.push(at.saturating_duration_since(stuck_at));
        }
    }
    cut.sort();
    println!(
        "stuck watchers cut off: {} of {}, after median {}, last {} (watch.slow_client_timeout 10 s); then {} connected, RSS {} KiB",
        cut.len(),
        args.slow,
        show(percentile(&cut, 0.5)),
        show(*cut.last().unwrap_or(&Duration::ZERO)),
        connected(&http, &base).await?,
        controller.rss_kib()
    );

    // 4. The reconnect storm: the controller killed and started again under the fleet.
    controller.kill();
    let restarted = Instant::now();
    controller.spawn().await?;
    let ready = restarted.elapsed();
    let (version, started, by_kind) = round(
        &http,
        &base,
        args.rounds + 100,
        &arrivals,
        total,
        Duration::from_secs(15),
    )
    .await?;
    let mut every: Vec<Duration> = by_kind.iter().flatten().copied().collect();
    every.sort();
    println!(
        "reconnect storm: controller ready {} after kill -9; then version {version}: {} of {total} watchers within {} of it (p99 {}), {} after the restart; {} connected, RSS {} KiB",
        show(ready),
        every.len(),
        show(*every.last().unwrap_or(&Duration::ZERO)),
        show(percentile(&every, 0.99)),
        show(started.duration_since(restarted) + *every.last().unwrap_or(&Duration::ZERO)),
        connected(&http, &base).await?,
        controller.rss_kib()
    );
    for t in tasks {
        t.abort();
    }
    Ok(())
}
