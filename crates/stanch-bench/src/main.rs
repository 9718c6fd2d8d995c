//! `stanch-bench`: measures a real `stanch serve` process on loopback and prints numbers.
//!
//! ```text
//! cargo build --release -p stanch -p stanch-bench
//! target/release/stanch-bench controller --stanch target/release/stanch
//! ```
//!
//! Every loop here is bounded in count and in time, and talks only to 127.0.0.1.
#![expect(clippy::print_stdout, reason = "a benchmark prints its results")]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use serde_json::{Value, json};
use std::sync::Mutex;
use tokio::time::Instant;

#[derive(Debug, Parser)]
#[command(about = "Benchmarks of stanch that print numbers")]
struct Cli {
    #[command(subcommand)]
    command: Bench,
}

#[derive(Debug, Subcommand)]
enum Bench {
    /// The controller: webhook-to-visible latency, intake throughput, watch fan-out and RSS.
    Controller(ControllerArgs),
    /// The gateway: direct vs stanch-gateway vs a bare hyper proxy vs nginx, then an
    /// upstream failing mid-run.
    Gateway(gateway::GatewayArgs),
    /// A fleet of 10,000 watchers (gRPC, SSE, long-poll) on one controller: a new
    /// version's reach, acknowledgements, CPU and memory, stuck watchers, and a
    /// reconnect storm after `kill -9`.
    Fleet(fleet::FleetArgs),
    /// What callers see when the gateway's only endpoint of a model breaks: a one-off
    /// 500, a reset, a 429 with `Retry-After`, a dead pool; as shipped, and with
    /// same-endpoint retries off.
    Rescue(rescue::RescueArgs),
    /// The controller with its state in the cluster (a fake API server): webhook
    /// latency, and an alert storm's API writes and latency, beside the file store.
    Cluster(cluster::ClusterArgs),
    /// The bare hyper proxy the gateway benchmark measures as a floor (run by it).
    #[command(hide = true)]
    BareProxy {
        /// Address to listen on.
        #[arg(long)]
        listen: std::net::SocketAddr,
        /// An upstream host:port (repeat for round robin).
        #[arg(long, required = true)]
        upstream: Vec<String>,
        /// Threads, each with its own listener and upstream connections.
        #[arg(long, default_value_t = 1)]
        threads: usize,
    },
}

mod bare;
mod cluster;
mod fleet;
mod gateway;
mod rescue;

#[derive(Debug, clap::Args)]
struct ControllerArgs {
    /// The stanch binary to measure (build it with --release).
    #[arg(long, default_value = "target/release/stanch")]
    stanch: PathBuf,
    /// Webhooks for the latency measurement.
    #[arg(long, default_value_t = 2000)]
    latency_rounds: usize,
    /// Seconds of the throughput measurement (at most).
    #[arg(long, default_value_t = 5)]
    throughput_secs: u64,
    /// Concurrent senders for the throughput measurement.
    #[arg(long, default_value_t = 32)]
    senders: usize,
    /// SSE watchers.
    #[arg(long, default_value_t = 1000)]
    sse: usize,
    /// Long-poll watchers.
    #[arg(long, default_value_t = 1000)]
    long_poll: usize,
    /// Version changes to time across all watchers.
    #[arg(long, default_value_t = 50)]
    fanout_rounds: usize,
}

fn main() -> anyhow::Result<()> {
    let command = Cli::parse().command;
    if let Bench::BareProxy {
        listen,
        upstream,
        threads,
    } = command
    {
        return bare::run(listen, upstream, threads);
    }
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async move {
        match command {
            Bench::Controller(args) => controller(args).await,
            Bench::Gateway(args) => gateway::run(args).await,
            Bench::Cluster(args) => cluster::run(args).await,
            Bench::Fleet(args) => fleet::run(args).await,
            Bench::Rescue(args) => rescue::run(args).await,
            Bench::BareProxy { .. } => unreachable!("served above"),
        }
    })
}

/// The shipped configuration, but for the connections one address may hold: every
/// watcher of a benchmark comes from 127.0.0.1, where a fleet's come from an address
/// each. `more` follows (its indented lines continue the `connections` section).
pub(crate) fn loopback_config(more: &str) -> String {
    format!(
        "{}\nconnections:\n  max_per_source: 1000000\n{more}",
        include_str!("../../stanch-core/src/default-config.yaml")
    )
}

struct Server {
    child: Child,
    base: String,
    _data: tempfile::TempDir,
}

impl Server {
    async fn start(bin: &PathBuf) -> anyhow::Result<Server> {
        let data = tempfile::tempdir()?;
        let config = data.path().join("stanch.yaml");
        std::fs::write(&config, loopback_config(""))?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let child = Command::new(bin)
            .args([
                "serve",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--data-dir",
            ])
            .arg(data.path().join("data"))
            .arg("--config")
            .arg(&config)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("cannot run {}", bin.display()))?;
        let server = Server {
            child,
            base: format!("http://127.0.0.1:{port}"),
            _data: data,
        };
        let http = reqwest::Client::new();
        for _ in 0..200 {
            if http
                .get(format!("{}/readyz", server.base))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success())
            {
                return Ok(server);
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        bail!("stanch did not become ready")
    }

    fn rss_kib(&self) -> u64 {
        rss_kib(self.child.id())
    }
}

/// A process's resident memory (`VmRSS`), in KiB; 0 when it cannot be read.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A webhook post as Alertmanager sends it: JSON, saying so (a controller without
/// tokens refuses a state change that does not, so that a browser cannot send one).
pub(crate) fn webhook(
    http: &reqwest::Client,
    url: &str,
    body: impl Into<reqwest::Body>,
) -> reqwest::RequestBuilder {
    http.post(url)
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .body(body)
}

/// A webhook that always changes the route table: the failover alert for qwen-72b
/// dc-a, firing (with a fresh start) or resolved, in turn.
fn toggling_webhook(round: usize) -> String {
    let status = if round.is_multiple_of(2) {
        "firing"
    } else {
        "resolved"
    };
    let start = format!(
        "2026-11-30T00:{:02}:{:02}Z",
        (round / 2 / 60) % 60,
        (round / 2) % 60
    );
    let ends = if status == "firing" {
        "0001-01-01T00:00:00Z".to_owned()
    } else {
        start.replace('Z', ".5Z")
    };
    json!({"version": "4", "status": status, "alerts": [{
        "status": status,
        "labels": {"alertname": "Bench", "action": "trigger-failover", "target_model": "qwen-72b", "pool": "dc-a"},
        "startsAt": start, "endsAt": ends}]})
    .to_string()
}

/// A minimal HTTP/1.1 client for watchers: what an efficient gateway does, and light
/// enough that the benchmark measures the controller rather than itself.
struct RawConn {
    stream: tokio::io::BufReader<tokio::net::TcpStream>,
    pending: String,
}

impl RawConn {
    async fn open(addr: &str, first_request: &str) -> std::io::Result<RawConn> {
        use tokio::io::AsyncWriteExt;
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        if !first_request.is_empty() {
            stream.write_all(first_request.as_bytes()).await?;
        }
        Ok(RawConn {
            stream: tokio::io::BufReader::new(stream),
            pending: String::new(),
        })
    }

    /// Sends a request and reads the response: (status, X-Stanch-Route-Version).
    async fn exchange(&mut self, request: &str) -> Option<(u16, Option<u64>)> {
        use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
        self.stream
            .get_mut()
            .write_all(request.as_bytes())
            .await
            .ok()?;
        let mut line = String::new();
        self.stream.read_line(&mut line).await.ok()?;
        let status: u16 = line.split_whitespace().nth(1)?.parse().ok()?;
        let (mut length, mut version) = (0usize, None);
        loop {
            line.clear();
            self.stream.read_line(&mut line).await.ok()?;
            let header = line.trim_end();
            if header.is_empty() {
                break;
            }
            let (name, value) = header.split_once(':')?;
            match name.to_ascii_lowercase().as_str() {
                "content-length" => length = value.trim().parse().ok()?,
                "x-stanch-route-version" => version = value.trim().parse().ok(),
                _ => {}
            }
        }
        let mut body = vec![0; length];
        self.stream.read_exact(&mut body).await.ok()?;
        Some((status, version))
    }

    /// Reads the SSE stream (chunked) up to the next event's id.
    async fn next_sse_id(&mut self) -> Option<u64> {
        use tokio::io::AsyncReadExt;
        let mut buf = [0u8; 16 * 1024];
        loop {
            if let Some(at) = self.pending.find("\nid:") {
                let rest = &self.pending[at + 4..];
                if let Some(end) = rest.find('\n') {
                    let id = rest[..end].trim().parse().ok();
                    self.pending.drain(..at + 4 + end);
                    if id.is_some() {
                        return id;
                    }
                    continue;
                }
            }
            let n = self.stream.read(&mut buf).await.ok()?;
            if n == 0 {
                return None;
            }
            self.pending.push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Webhook received → new version visible on `GET /v1/routes`, one client, a round at a
/// time (each webhook changes the table), for at most a minute; sorted.
async fn webhook_latency(
    http: &reqwest::Client,
    base: &str,
    rounds: std::ops::Range<usize>,
) -> anyhow::Result<Vec<Duration>> {
    let (hook, routes) = (
        format!("{base}/v1/alerts/alertmanager"),
        format!("{base}/v1/routes"),
    );
    let mut samples = Vec::with_capacity(rounds.len());
    let deadline = Instant::now() + Duration::from_secs(60);
    for round in rounds {
        if Instant::now() > deadline {
            break;
        }
        let started = Instant::now();
        let answer: Value = webhook(http, &hook, toggling_webhook(round))
            .send()
            .await?
            .json()
            .await?;
        let version = answer["version"]
            .as_u64()
            .context("version in the answer")?;
        let seen: Value = http.get(&routes).send().await?.json().await?;
        let elapsed = started.elapsed();
        if seen["version"].as_u64() < Some(version) {
            bail!("version {version} acknowledged but not visible");
        }
        samples.push(elapsed);
    }
    samples.sort();
    Ok(samples)
}

fn show(d: Duration) -> String {
    if d < Duration::from_millis(1) {
        format!("{} µs", d.as_micros())
    } else {
        format!("{:.2} ms", d.as_secs_f64() * 1e3)
    }
}

// Size: a benchmark's script, start to finish, read top to bottom.
async fn controller(args: ControllerArgs) -> anyhow::Result<()> {
    let server = Server::start(&args.stanch).await?;
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(4096)
        .build()?;
    println!(
        "stanch-bench controller: {} (file store, fsync per commit)",
        args.stanch.display()
    );
    println!("idle RSS: {} KiB", server.rss_kib());

    // 1. Webhook received → new version visible on GET /v1/routes.
    let hook = format!("{}/v1/alerts/alertmanager", server.base);
    let routes = format!("{}/v1/routes", server.base);
    let samples = webhook_latency(&http, &server.base, 0..args.latency_rounds).await?;
    println!(
        "webhook -> visible on GET /v1/routes ({} rounds, one client): p50 {}  p90 {}  p99 {}  max {}",
        samples.len(),
        show(percentile(&samples, 0.50)),
        show(percentile(&samples, 0.90)),
        show(percentile(&samples, 0.99)),
        show(*samples.last().unwrap_or(&Duration::ZERO)),
    );

    // 2. Intake throughput: batches of 10 alerts from a pool of 1000, many senders.
    let sent = Arc::new(AtomicU64::new(0));
    let stop_at = Instant::now() + Duration::from_secs(args.throughput_secs);
    let max_batches = 500_000u64;
    let mut tasks = Vec::new();
    for sender in 0..args.senders {
        let (http, hook, sent) = (http.clone(), hook.clone(), sent.clone());
        tasks.push(tokio::spawn(async move {
            let mut i = sender;
            while Instant::now() < stop_at && sent.load(Ordering::Relaxed) < max_batches * 10 {
                let alerts: Vec<Value> = (0..10)
                    .map(|k| {
                        let n = (i * 10 + k) % 1000;
                        json!({"status": "firing", "labels": {"alertname": "Load", "instance": format!("host-{n}")},
                               "startsAt": "2026-11-30T00:00:00Z", "endsAt": "0001-01-01T00:00:00Z"})
                    })
                    .collect();
                let body = json!({"version": "4", "status": "firing", "alerts": alerts}).to_string();
                match webhook(&http, &hook, body).send().await {
                    Ok(r) if r.status().is_success() => {
                        sent.fetch_add(10, Ordering::Relaxed);
                    }
                    Ok(r) => eprintln!("intake answered {}", r.status()),
                    Err(e) => eprintln!("intake failed: {e}"),
                }
                i += args.senders;
            }
        }));
    }
    let started = Instant::now();
    for t in tasks {
        t.await?;
    }
    let secs = started.elapsed().as_secs_f64();
    let total = sent.load(Ordering::Relaxed);
    println!(
        "intake throughput ({} senders, batches of 10, {:.1} s): {} alerts/s ({} alerts acknowledged durable)",
        args.senders,
        secs,
        (total as f64 / secs) as u64,
        total
    );

    // 3. Fan-out: SSE and long-poll watchers, webhook → last watcher holding the version.
    let latest = Arc::new(AtomicU64::new(0));
    let arrivals: Arc<Mutex<Vec<(u64, Instant)>>> = Arc::new(Mutex::new(Vec::new()));
    let start_version: u64 = http.get(&routes).send().await?.json::<Value>().await?["version"]
        .as_u64()
        .unwrap_or(0);
    latest.store(start_version, Ordering::Relaxed);
    let mut watchers = Vec::new();
    let addr = server.base.trim_start_matches("http://").to_owned();
    for i in 0..args.sse {
        let (addr, arrivals) = (addr.clone(), arrivals.clone());
        watchers.push(tokio::spawn(async move {
            let request = format!("GET /v1/routes/stream HTTP/1.1\r\nHost: {addr}\r\nX-Stanch-Gateway: sse-{i}\r\n\r\n");
            let Ok(mut conn) = RawConn::open(&addr, &request).await else { return };
            while let Some(id) = conn.next_sse_id().await {
                arrivals.lock().unwrap().push((id, Instant::now()));
            }
        }));
        if i % 100 == 99 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    for i in 0..args.long_poll {
        let (addr, arrivals, latest) = (addr.clone(), arrivals.clone(), latest.clone());
        watchers.push(tokio::spawn(async move {
            let mut have = latest.load(Ordering::Relaxed);
            let Ok(mut conn) = RawConn::open(&addr, "").await else { return };
            loop {
                let request = format!(
                    "GET /v1/routes?after={have}&wait=30s HTTP/1.1\r\nHost: {addr}\r\nX-Stanch-Gateway: lp-{i}\r\nX-Stanch-Applied-Version: {have}\r\n\r\n"
                );
                let Some((status, version)) = conn.exchange(&request).await else { return };
                if status == 200
                    && let Some(v) = version {
                        have = v;
                        arrivals.lock().unwrap().push((have, Instant::now()));
                    }
            }
        }));
        if i % 100 == 99 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let status: Value = http
        .get(format!("{}/metrics", server.base))
        .send()
        .await?
        .text()
        .await
        .map(|t| {
            let connected: u64 = t
                .lines()
                .filter(|l| l.starts_with("stanch_watchers{"))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
                .sum();
            json!(connected)
        })?;
    println!(
        "watchers connected: {status} (asked for {} SSE + {} long-poll)",
        args.sse, args.long_poll
    );
    let rss_connected = server.rss_kib();
    let expected = args.sse + args.long_poll;
    let mut fanout = Vec::new();
    for round in 0..args.fanout_rounds {
        arrivals.lock().unwrap().clear();
        let started = Instant::now();
        // The toggle goes on from the latency rounds, so each round changes the table
        // whatever their count.
        let answer: Value = webhook(&http, &hook, toggling_webhook(args.latency_rounds + round))
            .send()
            .await?
            .json()
            .await?;
        let version = answer["version"].as_u64().context("version")?;
        latest.store(version, Ordering::Relaxed);
        let give_up = started + Duration::from_secs(5);
        loop {
            let got: Vec<Instant> = arrivals
                .lock()
                .unwrap()
                .iter()
                .filter(|(v, _)| *v >= version)
                .map(|(_, t)| *t)
                .collect();
            if got.len() >= expected || Instant::now() > give_up {
                let last = got.iter().max().copied().unwrap_or(give_up);
                if got.len() < expected {
                    println!(
                        "round {round}: only {} of {expected} watchers got version {version}",
                        got.len()
                    );
                }
                fanout.push(last.duration_since(started));
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    fanout.sort();
    println!(
        "webhook -> last of {expected} watchers holding the version ({} rounds): p50 {}  p99 {}  max {}",
        fanout.len(),
        show(percentile(&fanout, 0.50)),
        show(percentile(&fanout, 0.99)),
        show(*fanout.last().unwrap_or(&Duration::ZERO)),
    );
    println!(
        "RSS with watchers connected: {} KiB ({:.1} MiB); after the rounds: {} KiB",
        rss_connected,
        rss_connected as f64 / 1024.0,
        server.rss_kib()
    );
    for w in watchers {
        w.abort();
    }
    Ok(())
}
