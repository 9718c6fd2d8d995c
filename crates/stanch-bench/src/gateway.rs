//! `stanch-bench gateway`: three mock upstreams, measured directly, through
//! stanch-gateway, through a bare hyper proxy (the floor under the gateway's features)
//! and through nginx, at the same concurrency; then one upstream turns to 503 mid-run.
//!
//! Size: the gateway benchmark with its load generator and its report, kept together so that a change to what is measured is seen with how.

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
    /// Saturation only: skip the paced measure of added latency, so that many rounds
    /// of the throughput comparison fit in a few minutes.
    #[arg(long)]
    throughput_only: bool,
    /// Another stanch-gateway binary (a build to compare with), measured in the same
    /// rounds with the same configuration.
    #[arg(long)]
    compare: Option<PathBuf>,
    /// Both proxies without access logs. By default both log as shipped: the gateway
    /// at its default level (`info`, an access line a request) to a file, nginx with
    /// `access_log ... buffer=256k flush=1s`.
    #[arg(long)]
    logs_off: bool,
}

pub(crate) struct Proc(pub(crate) Child);

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

/// What a process and its children (nginx's workers) have used so far, from /proc.
#[derive(Clone, Copy, Default)]
struct Usage {
    /// CPU seconds in user space.
    user: f64,
    /// CPU seconds in the kernel.
    system: f64,
    /// Context switches of all their threads, voluntary (waiting for I/O) or not.
    switches: f64,
}

/// The fields of `/proc/PID/stat` after the command name (which is in parentheses and
/// may hold spaces): state, parent, ..., user time at 11, system time at 12.
fn stat_fields(pid: u32) -> Vec<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    rest.split_whitespace().map(str::to_owned).collect()
}

impl Usage {
    fn of(pid: u32) -> Usage {
        let mut total = Usage::default();
        let mut add = |pid: u32| {
            let f = stat_fields(pid);
            let num = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
            total.user += num(11) / 100.0; // USER_HZ
            total.system += num(12) / 100.0;
            let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
                .into_iter()
                .flatten();
            for task in tasks.flatten() {
                let status =
                    std::fs::read_to_string(task.path().join("status")).unwrap_or_default();
                total.switches += status
                    .lines()
                    .filter(|l| l.contains("ctxt_switches:"))
                    .filter_map(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
                    .sum::<f64>();
            }
        };
        add(pid);
        // Worker processes (nginx) are children of the process measured.
        let children: Vec<u32> = std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
            .filter(|&p| p != pid)
            .collect();
        for child in children {
            let parent = stat_fields(child)
                .get(1)
                .and_then(|v| v.parse::<u32>().ok());
            if parent == Some(pid) {
                add(child);
            }
        }
        total
    }

    /// What was used since `before`, per request.
    fn per_request(self, before: Usage, requests: f64) -> Usage {
        Usage {
            user: (self.user - before.user) / requests,
            system: (self.system - before.system) / requests,
            switches: (self.switches - before.switches) / requests,
        }
    }

    fn cpu(&self) -> f64 {
        self.user + self.system
    }
}

/// A stanch-mock process serving `model` as `instance` on a free loopback port, and
/// its address.
pub(crate) fn spawn_mock(
    binary: &Path,
    model: &str,
    instance: &str,
    extra: &[&str],
) -> anyhow::Result<(Proc, String)> {
    let addr = format!("127.0.0.1:{}", port()?);
    let child = Command::new(binary)
        .args(["--listen", &addr, "--model", model, "--instance", instance])
        .args(extra)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("cannot run {}", binary.display()))?;
    Ok((Proc(child), addr))
}

pub(crate) fn port() -> anyhow::Result<u16> {
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

pub(crate) async fn ready(addr: &str, path: &str) -> anyhow::Result<()> {
    for _ in 0..200 {
        if let Ok(mut c) = Conn::open(addr, path, BODY).await
            && c.call().await.is_ok_and(|s| s == 200)
        {
            return Ok(());
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
// Size: the load loop and its measurements, in one place so that its cost is seen.
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

/// One round's measures of one proxy.
#[derive(Clone)]
struct Round {
    throughput: f64,
    /// CPU and context switches per request.
    used: Usage,
    /// Paced added latency at p50 and p99; none with `--throughput-only`.
    added: Option<(Duration, Duration)>,
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

/// The mean and its standard error (the sample's standard deviation over √n).
fn mean_and_error(values: &[f64]) -> (f64, f64) {
    let n = values.len() as f64;
    if values.is_empty() {
        return (0.0, 0.0);
    }
    let mean = values.iter().sum::<f64>() / n;
    if values.len() < 2 {
        return (mean, 0.0);
    }
    let variance = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, (variance / n).sqrt())
}

/// `through`'s latency minus `direct`'s at percentile `p`.
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

pub(crate) async fn admin(
    addr: &str,
    method: &str,
    path: &str,
    body: &str,
) -> anyhow::Result<String> {
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

/// Requests each mock has answered so far.
pub(crate) async fn mock_requests(mocks: &[String]) -> anyhow::Result<Vec<u64>> {
    let mut out = Vec::new();
    for m in mocks {
        let body = admin(m, "GET", "/admin/stats", "").await?;
        let v: serde_json::Value = serde_json::from_str(&body).context("stats JSON")?;
        out.push(v["requests"].as_u64().unwrap_or(0));
    }
    Ok(out)
}

/// Each upstream's share of `counts`, in percent.
fn show_split(counts: &[u64]) -> String {
    let total = counts.iter().sum::<u64>().max(1) as f64;
    counts
        .iter()
        .map(|&c| format!("{:.1} %", 100.0 * c as f64 / total))
        .collect::<Vec<_>>()
        .join(" / ")
}

/// Requests the mock answered with its injected status fault: exactly those sent to it
/// after the fault began.
async fn mock_faulted(addr: &str) -> anyhow::Result<u64> {
    let body = admin(addr, "GET", "/admin/stats", "").await?;
    let v: serde_json::Value = serde_json::from_str(&body).context("stats JSON")?;
    Ok(v["by_outcome"]["fault:status"].as_u64().unwrap_or(0))
}

fn nginx_conf(dir: &Path, listen: u16, upstreams: &[String], stream: bool, logs: bool) -> String {
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
    let access_log = if logs {
        format!("access_log {d}/access.log combined buffer=256k flush=1s;")
    } else {
        "access_log off;".to_owned()
    };
    format!(
        "worker_processes auto;\nerror_log {d}/error.log warn;\npid {d}/nginx.pid;\nevents {{ worker_connections 1024; }}\nhttp {{\n  {access_log}\n  keepalive_requests 1000000;\n  client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n  fastcgi_temp_path {d}/fastcgi;\n  uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n  upstream mocks {{\n{servers}    keepalive 64;\n    keepalive_requests 1000000;\n  }}\n  server {{\n    listen 127.0.0.1:{listen};\n    location / {{\n      proxy_pass http://mocks;\n      proxy_http_version 1.1;\n      proxy_set_header Connection \"\";\n      proxy_next_upstream error timeout http_500 http_502 http_503 http_504;\n{buffering}    }}\n  }}\n}}\n"
    )
}

/// Runs the benchmark and prints its numbers.
// Size: a benchmark's script, start to finish, read top to bottom.
pub async fn run(args: GatewayArgs) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )?;
    let mut procs = Vec::new();
    let mut mocks = Vec::new();
    for i in 0..3 {
        let (proc, addr) = spawn_mock(&args.mock, "qwen-72b", &format!("m{i}"), &[])?;
        procs.push(proc);
        mocks.push(addr);
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
    let start_gateway = |binary: &Path, port: u16| -> anyhow::Result<Proc> {
        let mut command = Command::new(binary);
        command
            .args([
                "--config",
                config_path.to_str().unwrap_or_default(),
                "--listen",
                &format!("127.0.0.1:{port}"),
            ])
            .args(["--worker-threads", &args.gateway_threads.to_string()])
            .stdout(Stdio::null());
        if args.logs_off {
            command.env("RUST_LOG", "warn").stderr(Stdio::inherit());
        } else {
            // As shipped: the default level, an access line a request, to a file.
            let log = std::fs::File::create(dir.path().join(format!("gateway-{port}.log")))?;
            command.env_remove("RUST_LOG").stderr(log);
        }
        let child = command
            .spawn()
            .with_context(|| format!("cannot run {}", binary.display()))?;
        Ok(Proc(child))
    };
    let gateway_proc = start_gateway(&args.gateway, gw_port)?;
    let gateway_pid = gateway_proc.0.id();
    procs.push(gateway_proc);
    let compared = match &args.compare {
        Some(binary) => {
            let port = port()?;
            let proc = start_gateway(binary, port)?;
            let pid = proc.0.id();
            procs.push(proc);
            Some((format!("127.0.0.1:{port}"), pid))
        }
        None => None,
    };
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
        nginx_conf(dir.path(), nginx_port, &mocks, args.stream, !args.logs_off),
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
    if let Some((addr, _)) = &compared {
        ready(addr, "/v1/chat/completions").await?;
    }
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
    let mut proxies = vec![("stanch-gateway", gateway.clone(), gateway_pid)];
    if let Some((addr, pid)) = &compared {
        proxies.push(("compared gateway", addr.clone(), *pid));
    }
    proxies.push(("bare hyper proxy", bare.clone(), bare_pid));
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
        // Every other round in the reverse order, so that whatever drifts within a
        // round (the page cache, another tenant of the host) does not always favour
        // the same proxy.
        let mut order: Vec<usize> = (0..proxies.len()).collect();
        if round % 2 == 0 {
            order.reverse();
        }
        let mut saturated = vec![(0.0, Usage::default()); proxies.len()];
        for &i in &order {
            let (name, addr, pid) = &proxies[i];
            let served_before = mock_requests(&mocks).await?;
            let before = Usage::of(*pid);
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
            let used = Usage::of(*pid).per_request(before, requests);
            println!(
                "{}   proxy CPU {:.1} µs/request (user {:.1}, kernel {:.1}), {:.2} context switches/request",
                line(name, &l),
                used.cpu() * 1e6,
                used.user * 1e6,
                used.system * 1e6,
                used.switches
            );
            saturated[i] = (throughput(&l), used);
            let served = mock_requests(&mocks).await?;
            let split: Vec<u64> = served
                .iter()
                .zip(&served_before)
                .map(|(a, b)| a - b)
                .collect();
            println!(
                "{:<16} split over the upstreams: {}",
                "",
                show_split(&split)
            );
        }
        if args.throughput_only {
            for (i, &(throughput, used)) in saturated.iter().enumerate() {
                results[i].push(Round {
                    throughput,
                    used,
                    added: None,
                });
            }
            continue;
        }

        // Added latency at a steady rate below saturation.
        println!("round {round}: paced, {rate:.0} req/s over the same {n} connections");
        let direct = load(&mocks, body, n, Pace::Rate(rate), warm, measure).await?;
        println!("{}", line("direct to mocks", &direct));
        // In the round's order too: the first measured after the saturation runs
        // meets the writeback of their logs, and should not always be the same one.
        let mut paced = vec![None; proxies.len()];
        for &i in &order {
            let (name, addr, _) = &proxies[i];
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
            paced[i] = Some((p50, p99));
        }
        for (i, added) in paced.into_iter().enumerate() {
            results[i].push(Round {
                throughput: saturated[i].0,
                used: saturated[i].1,
                added,
            });
        }
    }
    println!("median of {} round(s):", args.rounds.max(1));
    let nginx_rounds = nginx.as_ref().map(|_| &results[proxies.len() - 1]);
    let mut shares = Vec::new();
    for ((name, _, _), rounds) in proxies.iter().zip(&results) {
        // Each round's throughput against nginx's in the same round.
        let ratios: Vec<f64> = nginx_rounds
            .map(|ng| {
                rounds
                    .iter()
                    .zip(ng)
                    .map(|(r, n)| r.throughput / n.throughput)
                    .collect()
            })
            .unwrap_or_default();
        let against_nginx = if ratios.is_empty() {
            String::new()
        } else {
            format!("   {:.0} % of nginx", median(ratios.clone()) * 100.0)
        };
        let paced = if args.throughput_only {
            String::new()
        } else {
            let at = |pick: fn(&(Duration, Duration)) -> Duration| {
                let values = rounds
                    .iter()
                    .filter_map(|r| r.added.as_ref().map(|a| pick(a).as_secs_f64()))
                    .collect();
                show(Duration::from_secs_f64(median(values)))
            };
            format!("   paced added p50 {}  p99 {}", at(|a| a.0), at(|a| a.1))
        };
        println!(
            "{name:<16} {:>9.0} req/s{against_nginx}   proxy CPU {:.1} µs/request (user {:.1}, kernel {:.1}), {:.2} switches/request{paced}",
            median(rounds.iter().map(|r| r.throughput).collect()),
            median(rounds.iter().map(|r| r.used.cpu() * 1e6).collect()),
            median(rounds.iter().map(|r| r.used.user * 1e6).collect()),
            median(rounds.iter().map(|r| r.used.system * 1e6).collect()),
            median(rounds.iter().map(|r| r.used.switches).collect()),
        );
        shares.push((name, ratios));
    }
    // How sure the comparison is: one round's share varies by tens of percent here.
    for (name, ratios) in shares.iter().filter(|(name, _)| **name != "nginx") {
        if ratios.len() < 2 {
            continue;
        }
        let (mean, error) = mean_and_error(ratios);
        let above = ratios.iter().filter(|r| **r > 1.0).count();
        println!(
            "{name:<16} share of nginx's throughput over {} rounds: mean {:.1} % ± {:.1} % (standard error), above nginx in {above}",
            ratios.len(),
            mean * 100.0,
            error * 100.0,
        );
    }

    if compared.is_some() {
        // The two builds, round by round: the mean and standard error of `of(new, old)`.
        let by_round = |of: fn(&Round, &Round) -> f64| {
            let values: Vec<f64> = results[1]
                .iter()
                .zip(&results[0])
                .map(|(b, a)| of(b, a))
                .collect();
            mean_and_error(&values)
        };
        let (mean, error) = by_round(|b, a| b.throughput / a.throughput);
        let (cpu_mean, cpu_error) = by_round(|b, a| (b.used.cpu() - a.used.cpu()) * 1e6);
        let (user_mean, user_error) = by_round(|b, a| (b.used.user - a.used.user) * 1e6);
        println!(
            "compared gateway against stanch-gateway, mean ± standard error over rounds: throughput {:.1} % ± {:.1} %, CPU {cpu_mean:+.2} ± {cpu_error:.2} µs/request, of which user {user_mean:+.2} ± {user_error:.2}",
            mean * 100.0,
            error * 100.0,
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

    #[test]
    fn the_standard_error_is_the_sample_deviation_over_the_root_of_the_count() {
        let (mean, error) = super::mean_and_error(&[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(mean, 2.5);
        // Sample variance 5/3; over n = 4, √(5/12).
        assert!((error - (5.0f64 / 12.0).sqrt()).abs() < 1e-12);
        assert_eq!(super::mean_and_error(&[7.0]), (7.0, 0.0));
        assert_eq!(super::mean_and_error(&[]), (0.0, 0.0));
    }
}
