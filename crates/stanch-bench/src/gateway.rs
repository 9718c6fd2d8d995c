//! `stanch-bench gateway`: three mock upstreams, measured directly, through
//! stanch-gateway, through a bare hyper proxy (the floor under the gateway's features)
//! and through nginx, at the same concurrency; then one upstream turns to 503 mid-run.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::{percentile, show};

/// Arguments of the gateway benchmark.
#[derive(Debug, clap::Args)]
pub struct GatewayArgs {
    /// The stanch-gateway binary.
    #[arg(long, default_value = "target/release/stanch-gateway")]
    gateway: PathBuf,
    /// The stanch-mock binary.
    #[arg(long, default_value = "target/release/stanch-mock")]
    mock: PathBuf,
    /// The nginx binary.
    #[arg(long, default_value = "/usr/sbin/nginx")]
    nginx: PathBuf,
    /// Concurrent keep-alive connections.
    #[arg(long, default_value_t = 16)]
    connections: usize,
    /// Seconds measured per target (after 1 s of warm-up).
    #[arg(long, default_value_t = 5)]
    seconds: u64,
    /// The gateway's --worker-threads.
    #[arg(long, default_value_t = 0)]
    gateway_threads: usize,
    /// Requests per second, over all connections, for the added-latency measure.
    #[arg(long, default_value_t = 4000.0)]
    paced_rate: f64,
    /// Streamed answers (SSE, 16 tokens each) instead of whole ones; nginx then runs
    /// with `proxy_buffering off`, as it must in front of an SSE upstream.
    #[arg(long)]
    stream: bool,
    /// Rounds of every measure. Each round measures every proxy one after another, so
    /// that a slow spell of the machine weighs on all of them; the summary gives the
    /// median over rounds.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
}

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// nginx's master process. SIGKILL would orphan its workers, which keep their ports;
/// SIGQUIT stops them all (and SIGKILL follows if that takes too long).
struct Nginx(Proc);

impl Drop for Nginx {
    fn drop(&mut self) {
        let child = &mut (self.0).0;
        let _ = Command::new("kill")
            .args(["-QUIT", &child.id().to_string()])
            .status();
        for _ in 0..50 {
            if matches!(child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// CPU seconds (user + system) a process and its children have used, from /proc.
fn cpu_seconds(pid: u32) -> f64 {
    let ticks = |pid: u32| -> (f64, Option<u32>) {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // Fields after the command name, which is in parentheses and may hold spaces.
        let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
        let f: Vec<&str> = rest.split_whitespace().collect();
        let num = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
        (num(11) + num(12), f.get(1).and_then(|v| v.parse().ok()))
    };
    let mut total = ticks(pid).0;
    // Worker processes (nginx) are children of the process measured.
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for e in entries.flatten() {
            if let Some(child) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) {
                let (t, parent) = ticks(child);
                if parent == Some(pid) {
                    total += t;
                }
            }
        }
    }
    total / 100.0 // USER_HZ
}

fn port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

const BODY: &str =
    r#"{"model":"qwen-72b","max_tokens":8,"messages":[{"role":"user","content":"hello there"}]}"#;
const STREAM_BODY: &str = r#"{"model":"qwen-72b","max_tokens":16,"stream":true,"messages":[{"role":"user","content":"hello there"}]}"#;

/// A keep-alive HTTP/1.1 connection that posts a chat request and reads the answer.
struct Conn {
    stream: BufReader<TcpStream>,
    request: Vec<u8>,
}

impl Conn {
    async fn open(addr: &str, path: &str, body: &str) -> std::io::Result<Conn> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let request = format!(
            "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        Ok(Conn {
            stream: BufReader::new(stream),
            request: request.into_bytes(),
        })
    }

    /// One request; returns the status.
    async fn call(&mut self) -> std::io::Result<u16> {
        self.stream.get_mut().write_all(&self.request).await?;
        let mut line = String::new();
        self.stream.read_line(&mut line).await?;
        let status: u16 = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let (mut length, mut chunked) = (None, false);
        loop {
            line.clear();
            if self.stream.read_line(&mut line).await? == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            let h = line.trim_end().to_ascii_lowercase();
            if h.is_empty() {
                break;
            }
            if let Some(v) = h.strip_prefix("content-length:") {
                length = v.trim().parse::<usize>().ok();
            }
            if h.starts_with("transfer-encoding:") && h.contains("chunked") {
                chunked = true;
            }
        }
        if chunked {
            loop {
                line.clear();
                self.stream.read_line(&mut line).await?;
                let size = usize::from_str_radix(line.trim(), 16).unwrap_or(0);
                let mut chunk = vec![0; size + 2];
                self.stream.read_exact(&mut chunk).await?;
                if size == 0 {
                    break;
                }
            }
        } else {
            let mut body = vec![0; length.unwrap_or(0)];
            self.stream.read_exact(&mut body).await?;
        }
        Ok(status)
    }
}

async fn ready(addr: &str, path: &str) -> anyhow::Result<()> {
    for _ in 0..200 {
        if let Ok(mut c) = Conn::open(addr, path, BODY).await {
            if c.call().await.is_ok_and(|s| s == 200) {
                return Ok(());
            }
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    bail!("{addr} did not answer 200")
}

struct Load {
    latencies: Vec<Duration>,
    errors: u64,
    elapsed: Duration,
}

/// How a load's connections send.
#[derive(Clone, Copy)]
enum Pace {
    /// The next request as soon as the last is answered: the most the target carries.
    Saturate,
    /// Together, this many requests a second at a steady pace: what a request costs
    /// when nothing is queueing behind a saturated CPU.
    Rate(f64),
}

/// `connections` connections spread over `addrs`, sending at `pace` for `warmup` plus
/// `measure`; latency is taken from the moment each request is written.
async fn load(
    addrs: &[String],
    body: &'static str,
    connections: usize,
    pace: Pace,
    warmup: Duration,
    measure: Duration,
) -> anyhow::Result<Load> {
    let start = Instant::now() + warmup;
    let stop = start + measure;
    // Paced, each connection sends when told to by a pacer thread (below).
    let (turns, pacer): (Vec<_>, Vec<_>) = (0..connections)
        .map(|_| match pace {
            Pace::Saturate => (None, None),
            Pace::Rate(_) => {
                let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<()>();
                (Some(rx), Some(tx))
            }
        })
        .unzip();
    let mut tasks = Vec::new();
    for (i, mut turn) in turns.into_iter().enumerate() {
        let addr = addrs[i % addrs.len()].clone();
        tasks.push(tokio::spawn(async move {
            let mut conn = Conn::open(&addr, "/v1/chat/completions", body).await?;
            let mut latencies = Vec::with_capacity(100_000);
            let mut errors = 0u64;
            // Bounded in count as well as time.
            for _ in 0..2_000_000u64 {
                if let Some(turn) = &mut turn
                    && turn.recv().await.is_none()
                {
                    break;
                }
                let sent = Instant::now();
                if sent >= stop {
                    break;
                }
                let status = match conn.call().await {
                    Ok(s) => s,
                    Err(_) => {
                        conn = Conn::open(&addr, "/v1/chat/completions", body).await?;
                        0
                    }
                };
                if sent >= start {
                    latencies.push(sent.elapsed());
                    if status != 200 {
                        errors += 1;
                    }
                }
            }
            Ok::<_, std::io::Error>((latencies, errors))
        }));
    }
    // tokio's timers have a resolution of a millisecond: paced with them, 4,000
    // requests a second leave in bursts of four, each queueing behind the others. A
    // thread sleeping between turns (the kernel's timers, tens of microseconds) gives
    // each connection its turn in rotation, evenly spaced.
    if let Pace::Rate(rate) = pace {
        let every = Duration::from_secs_f64(1.0 / rate);
        let senders: Vec<_> = pacer.into_iter().flatten().collect();
        std::thread::Builder::new()
            .name("pacer".into())
            .spawn(move || {
                let mut due = Instant::now();
                let turns = (stop - due).as_secs_f64() * rate;
                for turn in senders.iter().cycle().take(turns as usize + 1) {
                    due += every;
                    if due >= stop {
                        break;
                    }
                    std::thread::sleep(due.saturating_duration_since(Instant::now()));
                    let _ = turn.send(());
                }
            })?;
    }
    let mut all = Load {
        latencies: Vec::new(),
        errors: 0,
        elapsed: measure,
    };
    for t in tasks {
        let (l, e) = t.await??;
        all.latencies.extend(l);
        all.errors += e;
    }
    all.latencies.sort();
    Ok(all)
}

/// `through`'s latency minus `direct`'s at percentile `p`.
/// One round's measures of one proxy.
#[derive(Clone)]
struct Round {
    throughput: f64,
    /// Seconds of CPU per request.
    cpu: f64,
    added_p50: Duration,
    added_p99: Duration,
}

fn throughput(l: &Load) -> f64 {
    l.latencies.len() as f64 / l.elapsed.as_secs_f64()
}

/// The median (the mean of the middle two for an even count).
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => 0.0,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

fn added(through: &Load, direct: &Load, p: f64) -> Duration {
    percentile(&through.latencies, p).saturating_sub(percentile(&direct.latencies, p))
}

fn line(name: &str, l: &Load) -> String {
    format!(
        "{name:<16} {:>9.0} req/s   p50 {:>8}   p99 {:>8}   errors {}",
        throughput(l),
        show(percentile(&l.latencies, 0.5)),
        show(percentile(&l.latencies, 0.99)),
        l.errors
    )
}

async fn admin(addr: &str, method: &str, path: &str, body: &str) -> anyhow::Result<String> {
    let mut s = TcpStream::connect(addr).await?;
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await?;
    let mut out = String::new();
    s.read_to_string(&mut out).await?;
    Ok(out.split("\r\n\r\n").nth(1).unwrap_or_default().to_owned())
}

/// Requests the mock answered with its injected status fault: exactly those sent to it
/// after the fault began.
async fn mock_faulted(addr: &str) -> anyhow::Result<u64> {
    let body = admin(addr, "GET", "/admin/stats", "").await?;
    let v: serde_json::Value = serde_json::from_str(&body).context("stats JSON")?;
    Ok(v["by_outcome"]["fault:status"].as_u64().unwrap_or(0))
}

fn nginx_conf(dir: &Path, listen: u16, upstreams: &[String], stream: bool) -> String {
    let buffering = if stream {
        "      proxy_buffering off;\n"
    } else {
        ""
    };
    let servers: String = upstreams
        .iter()
        .map(|u| format!("    server {u};\n"))
        .collect();
    let d = dir.display();
    format!(
        "worker_processes auto;\nerror_log {d}/error.log warn;\npid {d}/nginx.pid;\nevents {{ worker_connections 1024; }}\nhttp {{\n  access_log off;\n  keepalive_requests 1000000;\n  client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n  fastcgi_temp_path {d}/fastcgi;\n  uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n  upstream mocks {{\n{servers}    keepalive 64;\n    keepalive_requests 1000000;\n  }}\n  server {{\n    listen 127.0.0.1:{listen};\n    location / {{\n      proxy_pass http://mocks;\n      proxy_http_version 1.1;\n      proxy_set_header Connection \"\";\n      proxy_next_upstream error timeout http_500 http_502 http_503 http_504;\n{buffering}    }}\n  }}\n}}\n"
    )
}

/// Runs the benchmark and prints its numbers.
pub async fn run(args: GatewayArgs) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )?;
    let mut procs = Vec::new();
    let mut mocks = Vec::new();
    for i in 0..3 {
        let p = port()?;
        let child = Command::new(&args.mock)
            .args([
                "--listen",
                &format!("127.0.0.1:{p}"),
                "--model",
                "qwen-72b",
                "--instance",
                &format!("m{i}"),
            ])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("cannot run {}", args.mock.display()))?;
        procs.push(Proc(child));
        mocks.push(format!("127.0.0.1:{p}"));
    }
    let gw_port = port()?;
    let endpoints: String = mocks
        .iter()
        .map(|m| format!("{{url: 'http://{m}'}}, "))
        .collect();
    let config = format!(
        "models:\n  qwen-72b:\n    pools:\n      - name: dc-a\n        endpoints: [{endpoints}]\nblocking: {{consecutive_failures: 5, ttl: 60s}}\n"
    );
    let config_path = dir.path().join("gateway.yaml");
    std::fs::write(&config_path, config)?;
    let gateway_proc = Proc(
        Command::new(&args.gateway)
            .args([
                "--config",
                config_path.to_str().unwrap_or_default(),
                "--listen",
                &format!("127.0.0.1:{gw_port}"),
            ])
            .args(["--worker-threads", &args.gateway_threads.to_string()])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("cannot run {}", args.gateway.display()))?,
    );
    let gateway_pid = gateway_proc.0.id();
    procs.push(gateway_proc);
    let bare_port = port()?;
    // The bare proxy runs as many threads as the gateway.
    let threads = match args.gateway_threads {
        0 => std::thread::available_parallelism().map_or(1, usize::from),
        n => n,
    };
    let bare_proc = Proc(
        Command::new(std::env::current_exe()?)
            .args(["bare-proxy", "--listen", &format!("127.0.0.1:{bare_port}")])
            .args(["--threads", &threads.to_string()])
            .args(mocks.iter().flat_map(|m| ["--upstream", m.as_str()]))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .context("cannot run the bare proxy")?,
    );
    let bare_pid = bare_proc.0.id();
    procs.push(bare_proc);
    let bare = format!("127.0.0.1:{bare_port}");
    let nginx_port = port()?;
    std::fs::write(
        dir.path().join("nginx.conf"),
        nginx_conf(dir.path(), nginx_port, &mocks, args.stream),
    )?;
    let nginx = Command::new(&args.nginx)
        .arg("-p")
        .arg(dir.path())
        .arg("-c")
        .arg(dir.path().join("nginx.conf"))
        .args(["-g", "daemon off;"])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn();
    let nginx = match nginx {
        Ok(c) => Some(Nginx(Proc(c))),
        Err(e) => {
            eprintln!(
                "nginx not run ({}): {e}; install Debian's nginx to compare",
                args.nginx.display()
            );
            None
        }
    };
    let gateway = format!("127.0.0.1:{gw_port}");
    let nginx_addr = format!("127.0.0.1:{nginx_port}");
    for m in &mocks {
        ready(m, "/v1/chat/completions").await?;
    }
    ready(&gateway, "/v1/chat/completions").await?;
    ready(&bare, "/v1/chat/completions").await?;
    if nginx.is_some() {
        ready(&nginx_addr, "/v1/chat/completions").await?;
    }
    let (warm, measure, n) = (
        Duration::from_secs(1),
        Duration::from_secs(args.seconds),
        args.connections,
    );
    let (body, kind) = if args.stream {
        (STREAM_BODY, "streamed chat, 16 tokens")
    } else {
        (BODY, "non-streaming chat")
    };
    println!(
        "stanch-bench gateway: 3 stanch-mock upstreams, {n} keep-alive connections, {}s each, {kind}",
        args.seconds
    );
    // The proxies measured: the gateway, the bare hyper proxy under it, and nginx.
    let mut proxies = vec![
        ("stanch-gateway", gateway.clone(), gateway_pid),
        ("bare hyper proxy", bare.clone(), bare_pid),
    ];
    if let Some(p) = &nginx {
        proxies.push(("nginx", nginx_addr.clone(), (p.0).0.id()));
    }
    let rate = args.paced_rate;
    // Per proxy, per round: throughput, CPU per request, and paced added p50 and p99.
    let mut results: Vec<Vec<Round>> = vec![Vec::new(); proxies.len()];
    for round in 1..=args.rounds.max(1) {
        println!("round {round}: saturation");
        let direct = load(&mocks, body, n, Pace::Saturate, warm, measure).await?;
        println!("{}", line("direct to mocks", &direct));
        let mut saturated = Vec::new();
        for (name, addr, pid) in &proxies {
            let cpu0 = cpu_seconds(*pid);
            let l = load(
                std::slice::from_ref(addr),
                body,
                n,
                Pace::Saturate,
                warm,
                measure,
            )
            .await?;
            // Warm-up requests used CPU too; they are not in `latencies`.
            let requests =
                l.latencies.len() as f64 * (1.0 + warm.as_secs_f64() / measure.as_secs_f64());
            let cpu = (cpu_seconds(*pid) - cpu0) / requests;
            println!("{}   proxy CPU {:.1} µs/request", line(name, &l), cpu * 1e6);
            saturated.push((throughput(&l), cpu));
        }

        // Added latency at a steady rate below saturation.
        println!("round {round}: paced, {rate:.0} req/s over the same {n} connections");
        let direct = load(&mocks, body, n, Pace::Rate(rate), warm, measure).await?;
        println!("{}", line("direct to mocks", &direct));
        for (i, (name, addr, _)) in proxies.iter().enumerate() {
            let l = load(
                std::slice::from_ref(addr),
                body,
                n,
                Pace::Rate(rate),
                warm,
                measure,
            )
            .await?;
            let (p50, p99) = (added(&l, &direct, 0.5), added(&l, &direct, 0.99));
            println!(
                "{}   added p50 {}  p99 {}",
                line(name, &l),
                show(p50),
                show(p99)
            );
            results[i].push(Round {
                throughput: saturated[i].0,
                cpu: saturated[i].1,
                added_p50: p50,
                added_p99: p99,
            });
        }
    }
    println!("median of {} round(s):", args.rounds.max(1));
    let nginx_rounds = nginx.as_ref().map(|_| &results[proxies.len() - 1]);
    for ((name, _, _), rounds) in proxies.iter().zip(&results) {
        // Each round's throughput against nginx's in the same round.
        let against_nginx = nginx_rounds
            .map(|ng| {
                let ratios = rounds
                    .iter()
                    .zip(ng)
                    .map(|(r, n)| r.throughput / n.throughput)
                    .collect();
                format!("   {:.0} % of nginx", median(ratios) * 100.0)
            })
            .unwrap_or_default();
        println!(
            "{name:<16} {:>9.0} req/s{against_nginx}   proxy CPU {:.1} µs/request   paced added p50 {}  p99 {}",
            median(rounds.iter().map(|r| r.throughput).collect()),
            median(rounds.iter().map(|r| r.cpu * 1e6).collect()),
            show(Duration::from_secs_f64(median(
                rounds.iter().map(|r| r.added_p50.as_secs_f64()).collect()
            ))),
            show(Duration::from_secs_f64(median(
                rounds.iter().map(|r| r.added_p99.as_secs_f64()).collect()
            ))),
        );
    }

    // One of three upstreams turns to 503 mid-run.
    let failing = mocks[1].clone();
    let flip = {
        let failing = failing.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(2)).await;
            admin(
                &failing,
                "PUT",
                "/admin/fault",
                r#"{"kind": "status", "status": 503}"#,
            )
            .await
        })
    };
    let during = load(
        std::slice::from_ref(&gateway),
        body,
        n,
        Pace::Saturate,
        Duration::ZERO,
        Duration::from_secs(6),
    )
    .await?;
    flip.await??;
    let after = mock_faulted(&failing).await?;
    println!(
        "one of three upstreams at 503 from 2 s into a 6 s run: {} requests, {} client-visible errors; the failing upstream got {after} requests after the fault (block threshold: 5 consecutive failures)",
        during.latencies.len(),
        during.errors
    );
    drop(nginx);
    drop(procs);
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_median_is_the_middle_value_or_the_mean_of_the_middle_two() {
        assert_eq!(super::median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(super::median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(super::median(vec![7.0]), 7.0);
        assert_eq!(super::median(vec![]), 0.0);
    }
}
