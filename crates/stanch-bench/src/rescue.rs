//! `stanch-bench rescue`: what callers see when an upstream breaks in the ways a careful
//! client would rescue. The gateway as shipped (default retry and blocking settings)
//! serves qwen-72b from one pool of one endpoint, falling back to qwen-14b; each phase
//! breaks that endpoint on purpose (a one-off 500, a reset, a 429 with `Retry-After`, a
//! dead pool) and counts, per request, the caller-visible errors, who answered, the
//! attempts it took and the time to answer. Every phase runs twice: as shipped, and with
//! same-endpoint retries off (`retry.same_endpoint: 0`, `retry_after_max: 0s`), which
//! is how the gateway behaved before them.
//!
//! Then streams: one in ten breaks after 4 tokens, continued by a fallback model that
//! takes a prefill, by one that does not (its regenerated answer differs), by a second
//! pool of the same model without prefill (regenerated, the same answer), or not at all
//! (`retry.stream_resumes: 0`, as before); and one in ten has its first token 20 s late,
//! with and without `hedge_after`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::Context;
use serde_json::Value;
use tokio::time::Instant;

use crate::gateway::{Proc, admin, mock_requests, port, ready, spawn_mock};
use crate::{percentile, show};

/// Arguments of the rescue benchmark.
#[derive(Debug, clap::Args)]
pub struct RescueArgs {
    /// The stanch-gateway binary.
    #[arg(long, default_value = "target/release/stanch-gateway")]
    gateway: PathBuf,
    /// The stanch-mock binary.
    #[arg(long, default_value = "target/release/stanch-mock")]
    mock: PathBuf,
    /// Requests per phase (one in ten of them meets the fault; the Retry-After phase
    /// sends a tenth as many).
    #[arg(long, default_value_t = 200)]
    requests: usize,
    /// Seconds of the dead-pool phase.
    #[arg(long, default_value_t = 10)]
    dead_seconds: u64,
    /// Streams in the slow-first-token phase (one in ten is slow; unhedged, each of
    /// those takes the 15 s first-token timeout).
    #[arg(long, default_value_t = 30)]
    slow_requests: usize,
}

/// The two configurations compared.
const SETTINGS: [(&str, &str); 2] = [
    ("as shipped", ""),
    (
        "no same-endpoint retries",
        "retry: {same_endpoint: 0, retry_after_max: 0s}\n",
    ),
];

/// What one request came to.
struct Answer {
    /// 200 and a model's answer (not the FAQ).
    ok: bool,
    /// The model that answered, or `faq`, or the status.
    by: String,
    attempts: u64,
    took: Duration,
}

/// Prints one line for the answers of a phase: errors, who answered, attempts, and
/// the distribution of the time to answer.
fn report(name: &str, answers: &[Answer]) {
    let n = answers.len();
    let errors = answers.iter().filter(|a| !a.ok).count();
    let mut by: Vec<(&str, usize)> = Vec::new();
    for a in answers {
        match by.iter_mut().find(|(m, _)| *m == a.by) {
            Some((_, c)) => *c += 1,
            None => by.push((&a.by, 1)),
        }
    }
    let by: Vec<String> = by.iter().map(|(m, c)| format!("{m} {c}")).collect();
    let attempts: u64 = answers.iter().map(|a| a.attempts).sum();
    let mut took: Vec<Duration> = answers.iter().map(|a| a.took).collect();
    took.sort();
    println!(
        "  {name:<34} {n:>4} requests, {errors} caller-visible errors (error or FAQ); answered by {}; attempts/request {:.2} (max {}); time to answer p50 {}  p99 {}  max {}",
        by.join(", "),
        attempts as f64 / n.max(1) as f64,
        answers.iter().map(|a| a.attempts).max().unwrap_or(0),
        show(percentile(&took, 0.5)),
        show(percentile(&took, 0.99)),
        show(took.last().copied().unwrap_or_default()),
    );
}

async fn chat(http: &reqwest::Client, gateway: &str) -> anyhow::Result<Answer> {
    let sent = Instant::now();
    let r = http
        .post(format!("http://{gateway}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(r#"{"model":"qwen-72b","max_tokens":8,"messages":[{"role":"user","content":"hello there"}]}"#)
        .send()
        .await?;
    let status = r.status().as_u16();
    let attempts = r
        .headers()
        .get("x-stanch-attempts")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .unwrap_or(0);
    let faq = r
        .headers()
        .get("x-llm-degraded")
        .is_some_and(|v| v == "static");
    let body: Value = r.json().await.unwrap_or_default();
    let took = sent.elapsed();
    let by = if faq {
        "faq".to_owned()
    } else if status == 200 {
        body["model"].as_str().unwrap_or("?").to_owned()
    } else {
        format!("status {status}")
    };
    Ok(Answer {
        ok: status == 200 && !faq,
        by,
        attempts,
        took,
    })
}

/// A streamed chat: complete (ending with `[DONE]`, no error event) and whole (16
/// words) or not, the models whose chunks made it, and the mock that started it.
async fn stream(http: &reqwest::Client, gateway: &str) -> anyhow::Result<Answer> {
    let sent = Instant::now();
    let r = http
        .post(format!("http://{gateway}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(r#"{"model":"qwen-72b","max_tokens":16,"stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hello there"}]}"#)
        .send()
        .await?;
    let status = r.status().as_u16();
    let text = r.text().await.unwrap_or_default();
    let took = sent.elapsed();
    let events: Vec<&str> = text
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .collect();
    let chunks: Vec<Value> = events
        .iter()
        .filter_map(|e| serde_json::from_str(e).ok())
        .collect();
    let errored = chunks.iter().any(|c| c.get("error").is_some());
    let words: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    let mut models: Vec<&str> = Vec::new();
    for c in &chunks {
        if let Some(m) = c["model"].as_str()
            && models.last() != Some(&m)
        {
            models.push(m);
        }
    }
    let complete = status == 200
        && !errored
        && events.last() == Some(&"[DONE]")
        && words.split_whitespace().count() == 16;
    // A mock's stream id names its instance; a spliced stream keeps the first one's.
    let from = chunks
        .first()
        .and_then(|c| c["id"].as_str()?.strip_prefix("chatcmpl-"))
        .unwrap_or("?");
    let by = match (status, complete) {
        (200, true) => format!("{}, started by {from}", models.join("+")),
        (200, false) => "an error event".to_owned(),
        _ => format!("status {status}"),
    };
    Ok(Answer {
        ok: complete,
        by,
        attempts: 0,
        took,
    })
}

/// A gateway process for `config` (logging on, to a file in `dir`), answering.
async fn start_gateway(binary: &Path, dir: &Path, config: &str) -> anyhow::Result<(Proc, String)> {
    let gw_port = port()?;
    let path = dir.join(format!("gateway-{gw_port}.yaml"));
    std::fs::write(&path, config)?;
    let log = std::fs::File::create(dir.join(format!("gateway-{gw_port}.log")))?;
    let proc = Proc(
        Command::new(binary)
            .arg("--config")
            .arg(&path)
            .args(["--listen", &format!("127.0.0.1:{gw_port}")])
            .env_remove("RUST_LOG")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("cannot run {}", binary.display()))?,
    );
    let gateway = format!("127.0.0.1:{gw_port}");
    ready(&gateway, "/v1/chat/completions").await?;
    Ok((proc, gateway))
}

/// Sends `requests` streams, the fault set on `faulty` before one in ten; reports the
/// faulted and the others, with the upstream requests each took and the mocks
/// (`(instance, address)`) that had them, as the mocks count them: one id names the
/// whole of a spliced stream, so its chunks cannot tell.
async fn stream_phase(
    name: &str,
    http: &reqwest::Client,
    gateway: &str,
    mocks: &[(&str, String)],
    faulty: &str,
    fault: &str,
    requests: usize,
) -> anyhow::Result<()> {
    let addrs: Vec<String> = mocks.iter().map(|(_, addr)| addr.clone()).collect();
    let (mut others, mut faulted) = (Vec::new(), Vec::new());
    for i in 0..requests {
        let hit = i % 10 == 5;
        if hit {
            admin(faulty, "PUT", "/admin/fault", fault).await?;
        }
        let before = mock_requests(&addrs).await?;
        let mut a = stream(http, gateway).await?;
        let after = mock_requests(&addrs).await?;
        a.attempts = after.iter().sum::<u64>() - before.iter().sum::<u64>();
        if a.ok {
            let upstreams: Vec<&str> = mocks
                .iter()
                .zip(before.iter().zip(&after))
                .filter(|(_, (b, a))| a > b)
                .map(|((instance, _), _)| *instance)
                .collect();
            a.by = format!("{} (requests at {})", a.by, upstreams.join("+"));
        }
        if hit {
            faulted.push(a);
        } else {
            others.push(a);
        }
    }
    report(&format!("{name}: the faulted"), &faulted);
    report(&format!("{name}: the others"), &others);
    Ok(())
}

/// The streaming phases: a stream broken midway, continued four ways; a slow first
/// token, hedged and not.
async fn stream_phases(
    args: &RescueArgs,
    dir: &Path,
    http: &reqwest::Client,
) -> anyhow::Result<()> {
    let mut procs = Vec::new();
    let mut mocks = Vec::new();
    for (model, instance, prefill) in [
        ("qwen-72b", "dc-a", "ignore"),
        ("qwen-72b", "dc-b", "continue"),
        ("qwen-14b", "small", "continue"),
    ] {
        let (proc, addr) = spawn_mock(&args.mock, model, instance, &["--prefill", prefill])?;
        procs.push(proc);
        mocks.push((instance, addr));
    }
    for (_, m) in &mocks {
        ready(m, "/v1/chat/completions").await?;
    }
    let (a, b, small) = (&mocks[0].1, &mocks[1].1, &mocks[2].1);
    let faq = "faq_sets:\n  default: {default_answer: 'We are busy; please try again shortly.'}\n";
    let fallback = |prefill: &str, extra: &str| {
        format!(
            "models:
  qwen-72b:
    faq: default
    fallbacks: [qwen-14b]
    pools: [{{name: dc-a, endpoints: [{{url: 'http://{a}'}}]}}]
  qwen-14b:
    pools: [{{name: dc-a, prefill: {prefill}, endpoints: [{{url: 'http://{small}'}}]}}]
{faq}{extra}"
        )
    };
    let second_pool = |extra: &str| {
        format!(
            "models:
  qwen-72b:
    faq: default
    {extra}
    pools:
      - {{name: dc-a, endpoints: [{{url: 'http://{a}'}}]}}
      - {{name: dc-b, endpoints: [{{url: 'http://{b}'}}]}}
{faq}"
        )
    };
    println!(
        "streams: qwen-72b (16 tokens, usage on); one in ten breaks after 4 tokens; defaults otherwise, logging on"
    );
    let cut = r#"{"kind": "break", "after_tokens": 4, "count": 1}"#;
    for (name, config) in [
        ("fallback qwen-14b, prefill: vllm", fallback("vllm", "")),
        ("fallback qwen-14b, prefill: none", fallback("none", "")),
        ("second qwen-72b pool, prefill: none", second_pool("")),
        (
            "stream_resumes: 0 (before)",
            fallback("vllm", "retry: {stream_resumes: 0}\n"),
        ),
    ] {
        let (gateway_proc, gateway) = start_gateway(&args.gateway, dir, &config).await?;
        stream_phase(name, http, &gateway, &mocks, a, cut, args.requests).await?;
        drop(gateway_proc);
    }
    println!(
        "streams: qwen-72b in two pools; one in ten has its first token 20 s late (first_token timeout 15 s)"
    );
    let slow = r#"{"kind": "slow_first_token", "ms": 20000, "count": 1}"#;
    for (name, extra) in [
        ("hedge_after: 500ms", "hedge_after: 500ms"),
        ("no hedging (before)", ""),
    ] {
        let (gateway_proc, gateway) =
            start_gateway(&args.gateway, dir, &second_pool(extra)).await?;
        stream_phase(name, http, &gateway, &mocks, a, slow, args.slow_requests).await?;
        drop(gateway_proc);
    }
    admin(a, "PUT", "/admin/fault", r#"{"kind": "none"}"#).await?;
    drop(procs);
    Ok(())
}

pub async fn run(args: RescueArgs) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(60))
        .build()?;
    whole_phases(&args, dir.path(), &http).await?;
    stream_phases(&args, dir.path(), &http).await
}

/// The phases of whole answers at a model's only endpoint.
// Size: the suite's phases in order, as its report lists them.
async fn whole_phases(args: &RescueArgs, dir: &Path, http: &reqwest::Client) -> anyhow::Result<()> {
    let mut procs = Vec::new();
    let mut mocks = Vec::new();
    for (model, instance) in [("qwen-72b", "dc-a"), ("qwen-14b", "small")] {
        let (proc, addr) = spawn_mock(&args.mock, model, instance, &[])?;
        procs.push(proc);
        mocks.push(addr);
    }
    for m in &mocks {
        ready(m, "/v1/chat/completions").await?;
    }
    let (lone, small) = (&mocks[0], &mocks[1]);
    println!(
        "stanch-bench rescue: qwen-72b from one pool of one endpoint, falling back to qwen-14b; the gateway's default retry and blocking settings, logging on"
    );
    for (name, extra) in SETTINGS {
        println!("{name}:");
        let config = format!(
            "models:
  qwen-72b:
    faq: default
    fallbacks: [qwen-14b]
    pools: [{{name: dc-a, endpoints: [{{url: 'http://{lone}'}}]}}]
  qwen-14b:
    pools: [{{name: dc-a, endpoints: [{{url: 'http://{small}'}}]}}]
faq_sets:
  default: {{default_answer: 'We are busy; please try again shortly.'}}
{extra}"
        );
        let (gateway_proc, gateway) = start_gateway(&args.gateway, dir, &config).await?;

        for (phase, fault, requests) in [
            (
                "one 500, 1 request in 10",
                r#"{"kind": "status", "status": 500, "count": 1}"#,
                args.requests,
            ),
            (
                "a reset, 1 request in 10",
                r#"{"kind": "reset", "count": 1}"#,
                args.requests,
            ),
            (
                "429 Retry-After: 2, 1 request in 10",
                r#"{"kind": "status", "status": 429, "retry_after": 2, "count": 1}"#,
                (args.requests / 10).max(10),
            ),
        ] {
            let (mut others, mut faulted) = (Vec::new(), Vec::new());
            for i in 0..requests {
                let hit = i % 10 == 5;
                if hit {
                    admin(lone, "PUT", "/admin/fault", fault).await?;
                }
                let a = chat(http, &gateway).await?;
                if hit {
                    faulted.push(a);
                } else {
                    others.push(a);
                }
            }
            report(&format!("{phase}: the faulted"), &faulted);
            report(&format!("{phase}: the others"), &others);
            // The 429 phase leaves the endpoint blocked for its Retry-After.
            tokio::time::sleep(Duration::from_secs(3)).await;
        }

        // A dead pool: every request to it fails, for the whole phase, with 4 callers.
        admin(
            lone,
            "PUT",
            "/admin/fault",
            r#"{"kind": "status", "status": 500}"#,
        )
        .await?;
        let before = mock_requests(&mocks).await?;
        let stop = Instant::now() + Duration::from_secs(args.dead_seconds);
        let mut callers = Vec::new();
        for _ in 0..4 {
            let (http, gateway) = (http.clone(), gateway.clone());
            callers.push(tokio::spawn(async move {
                let mut answers = Vec::new();
                // Bounded in count as well as time.
                for _ in 0..100_000 {
                    if Instant::now() >= stop {
                        break;
                    }
                    answers.push(chat(&http, &gateway).await?);
                }
                anyhow::Ok(answers)
            }));
        }
        let mut dead = Vec::new();
        for c in callers {
            dead.extend(c.await??);
        }
        let after = mock_requests(&mocks).await?;
        report(
            &format!("dead pool, 4 callers, {} s", args.dead_seconds),
            &dead,
        );
        println!(
            "  {:<34} the dead endpoint got {} attempts in {} s (block threshold 5 in a row, first block 60 s)",
            "",
            after[0] - before[0],
            args.dead_seconds
        );
        admin(lone, "PUT", "/admin/fault", r#"{"kind": "none"}"#).await?;
        drop(gateway_proc);
    }
    drop(procs);
    Ok(())
}
