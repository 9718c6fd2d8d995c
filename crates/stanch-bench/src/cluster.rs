//! `stanch-bench cluster`: `stanch serve --store kubernetes` against the fake API
//! server of stanch-fake-apiserver, in this process: webhook → new version visible, and an
//! alert storm's API writes and webhook latency, beside the file store's.
//!
//! The fake API server answers from memory on loopback, so what is measured is
//! stanch's own cost; a real API server adds its round trips (a write is an etcd
//! commit, typically 5–20 ms), paid once per engine commit since commits queue behind
//! the write in flight.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, bail};
use serde_json::{Value, json};
use stanch_fake_apiserver::FakeApiServer;
use tokio::time::Instant;

use crate::{percentile, show, toggling_webhook, webhook_latency};

#[derive(Debug, clap::Args)]
pub struct ClusterArgs {
    /// The stanch binary to measure (build it with --release).
    #[arg(long, default_value = "target/release/stanch")]
    stanch: PathBuf,
    /// Webhooks for the latency measurement.
    #[arg(long, default_value_t = 1000)]
    latency_rounds: usize,
    /// Alerts in the storm.
    #[arg(long, default_value_t = 10_000)]
    storm_alerts: usize,
    /// Alerts a webhook carries in the storm.
    #[arg(long, default_value_t = 10)]
    storm_batch: usize,
    /// Seconds the storm is spread over.
    #[arg(long, default_value_t = 10)]
    storm_secs: u64,
}

struct Process {
    child: Child,
    base: String,
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// When a started process is ready.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Ready {
    /// It takes a webhook: a replica alone, or the leader once it took charge.
    Webhook,
    /// `/readyz` answers 200: a follower that has read the leader's state.
    Readyz,
}

/// Starts `stanch serve` with `args` as replica `identity`, logging as shipped (the
/// default `info` filter) to `logs/<identity>.log`.
async fn start(
    bin: &Path,
    args: &[&str],
    env: &[(&str, &Path)],
    identity: &str,
    logs: &Path,
    ready: Ready,
) -> anyhow::Result<Process> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let log = std::fs::File::create(logs.join(format!("{identity}.log")))?;
    let mut command = Command::new(bin);
    command
        .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .args(args)
        .env_remove("RUST_LOG")
        .env("POD_NAME", identity)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .stdout(Stdio::null())
        .stderr(log);
    for (k, v) in env {
        command.env(k, v);
    }
    let child = command
        .spawn()
        .with_context(|| format!("cannot run {}", bin.display()))?;
    let process = Process {
        child,
        base: format!("http://127.0.0.1:{port}"),
    };
    let http = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        let answered = match ready {
            Ready::Webhook => {
                let hook = format!("{}/v1/alerts/alertmanager", process.base);
                crate::webhook(&http, &hook, toggling_webhook(0))
                    .send()
                    .await
            }
            Ready::Readyz => http.get(format!("{}/readyz", process.base)).send().await,
        };
        if answered.is_ok_and(|r| r.status().is_success()) {
            return Ok(process);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("{identity} was not ready within 30 s")
}

/// How long after now `follower` serves the version `leader` serves.
async fn convergence(leader: &str, follower: &str) -> anyhow::Result<Duration> {
    let http = reqwest::Client::new();
    let version = |base: String| {
        let http = http.clone();
        async move {
            let t: Value = http
                .get(format!("{base}/v1/routes"))
                .send()
                .await?
                .json()
                .await?;
            anyhow::Ok(t["version"].as_u64().unwrap_or(0))
        }
    };
    let target = version(leader.to_owned()).await?;
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(30) {
        if version(follower.to_owned()).await? >= target {
            return Ok(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    bail!("the follower did not reach version {target} within 30 s")
}

/// Webhook → new version visible, `rounds` times. Round 0 was the readiness check:
/// starting at 1, every webhook changes the table.
async fn latency(base: &str, rounds: usize) -> anyhow::Result<Vec<Duration>> {
    webhook_latency(&reqwest::Client::new(), base, 1..rounds + 1).await
}

/// What a storm did: each webhook's latency, and how many were refused.
struct Storm {
    latencies: Vec<Duration>,
    refused: usize,
    seconds: f64,
}

/// `alerts` distinct alerts in webhooks of `batch`, sent at an even pace over `secs`
/// (open loop: a slow answer does not slow the sending).
async fn storm(base: &str, alerts: usize, batch: usize, secs: u64) -> anyhow::Result<Storm> {
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(256)
        .build()?;
    let hook = format!("{base}/v1/alerts/alertmanager");
    let webhooks = alerts.div_ceil(batch.max(1));
    let every = Duration::from_secs(secs) / u32::try_from(webhooks.max(1)).unwrap_or(u32::MAX);
    let latencies = Arc::new(Mutex::new(Vec::with_capacity(webhooks)));
    let refused = Arc::new(Mutex::new(0usize));
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(webhooks);
    for w in 0..webhooks {
        tokio::time::sleep_until(start + every * u32::try_from(w).unwrap_or(u32::MAX)).await;
        let body: Vec<Value> = (0..batch)
            .map(|k| {
                let n = w * batch + k;
                json!({"status": "firing",
                       "labels": {"alertname": "KvCacheSaturated", "action": "trigger-failover",
                                  "target_model": "qwen-72b", "pool": "dc-a",
                                  "instance": format!("replica-{n:05}")},
                       "annotations": {"summary": format!("KV cache at 97% on replica {n}")},
                       "startsAt": "2026-11-30T00:00:00Z", "endsAt": "0001-01-01T00:00:00Z"})
            })
            .collect();
        let body = json!({"version": "4", "status": "firing", "alerts": body}).to_string();
        let (http, hook, latencies, refused) = (
            http.clone(),
            hook.clone(),
            latencies.clone(),
            refused.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let sent = Instant::now();
            let ok = tokio::time::timeout(
                Duration::from_secs(30),
                crate::webhook(&http, &hook, body).send(),
            )
            .await
            .ok()
            .and_then(Result::ok)
            .is_some_and(|r| r.status().is_success());
            if ok {
                latencies.lock().expect("latencies").push(sent.elapsed());
            } else {
                *refused.lock().expect("refused") += 1;
            }
        }));
    }
    for t in tasks {
        t.await?;
    }
    let seconds = start.elapsed().as_secs_f64();
    let mut latencies = std::mem::take(&mut *latencies.lock().expect("latencies"));
    latencies.sort();
    let refused = *refused.lock().expect("refused");
    Ok(Storm {
        latencies,
        refused,
        seconds,
    })
}

fn line(what: &str, samples: &[Duration]) -> String {
    format!(
        "{what} ({} samples): p50 {}  p90 {}  p99 {}  max {}",
        samples.len(),
        show(percentile(samples, 0.50)),
        show(percentile(samples, 0.90)),
        show(percentile(samples, 0.99)),
        show(*samples.last().unwrap_or(&Duration::ZERO)),
    )
}

// Size: a benchmark's script, start to finish, read top to bottom.
pub async fn run(args: ClusterArgs) -> anyhow::Result<()> {
    let api = FakeApiServer::start().await;
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig, "monitoring")?;
    println!(
        "stanch-bench cluster: {} with --store kubernetes (a leader and a follower) against the fake API server (in process, loopback), and with the file store; logs as shipped, to files",
        args.stanch.display()
    );

    // As the chart ships it: two replicas, one leading; the follower reads the
    // leader's writes all through. Logs as shipped, to files beside the kubeconfig.
    let kube_env = [("KUBECONFIG", kubeconfig.as_path())];
    let kube_args = ["--store", "kubernetes"];
    let cluster = start(
        &args.stanch,
        &kube_args,
        &kube_env,
        "stanch-0",
        dir.path(),
        Ready::Webhook,
    )
    .await?;
    let follower = start(
        &args.stanch,
        &kube_args,
        &kube_env,
        "stanch-1",
        dir.path(),
        Ready::Readyz,
    )
    .await?;
    let samples = latency(&cluster.base, args.latency_rounds).await?;
    println!(
        "{}",
        line(
            "kubernetes store: webhook -> visible on GET /v1/routes",
            &samples
        )
    );

    let data = tempfile::tempdir()?;
    let file = start(
        &args.stanch,
        &["--data-dir", &data.path().display().to_string()],
        &[],
        "stanch-file",
        dir.path(),
        Ready::Webhook,
    )
    .await?;
    let samples = latency(&file.base, args.latency_rounds).await?;
    println!(
        "{}",
        line(
            "file store:       webhook -> visible on GET /v1/routes",
            &samples
        )
    );

    println!(
        "alert storm: {} alerts in webhooks of {} over {} s",
        args.storm_alerts, args.storm_batch, args.storm_secs
    );
    let before = api.revision();
    let kube = storm(
        &cluster.base,
        args.storm_alerts,
        args.storm_batch,
        args.storm_secs,
    )
    .await?;
    let writes = api.revision() - before;
    println!(
        "{}; refused {}; {:.1} s",
        line(
            "kubernetes store: webhook latency in the storm",
            &kube.latencies
        ),
        kube.refused,
        kube.seconds
    );
    println!(
        "kubernetes store: API writes during the storm: {writes} ({:.1}/s: state object, snapshot shards, route-table resource)",
        writes as f64 / kube.seconds
    );
    let caught_up = convergence(&cluster.base, &follower.base).await?;
    println!(
        "kubernetes store: the follower served the leader's last version {} after the storm",
        show(caught_up)
    );
    let files = storm(
        &file.base,
        args.storm_alerts,
        args.storm_batch,
        args.storm_secs,
    )
    .await?;
    println!(
        "{}; refused {}; {:.1} s",
        line(
            "file store:       webhook latency in the storm",
            &files.latencies
        ),
        files.refused,
        files.seconds
    );
    let ratio = percentile(&kube.latencies, 0.99).as_secs_f64()
        / percentile(&files.latencies, 0.99).as_secs_f64().max(1e-9);
    println!("storm webhook p99, kubernetes store / file store: {ratio:.2}x");
    Ok(())
}
