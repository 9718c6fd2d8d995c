//! `stanch demo`: the whole system in one process, healing a simulated outage while
//! you watch. Mock model servers, the controller, and a gateway start on loopback;
//! steady traffic flows; a datacenter fails, a KV cache saturates, and everything
//! recovers. Each second shows what callers got and what stanch decided.
//!
//! When Prometheus and Alertmanager are installed, the demo starts them with stanch's
//! own rules (windows shortened to seconds) and the alerts are real; otherwise, or with
//! `--simulate-alerts`, it sends stanch the payloads Alertmanager would, and says so.
//! Everything else runs in this process; the two servers are its children and are
//! stopped with it, Ctrl-C included.
#![expect(clippy::print_stdout, reason = "a demo prints what happens")]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;

use anyhow::Context;
use serde_json::{Value, json};
use stanch_core::Config;
use stanch_gateway::Gateway;
use stanch_gateway::config::GatewayConfig;
use stanch_mock::{Mock, MockConfig};
use stanch_server::clock::SystemClock;
use stanch_server::{Controller, Settings};
use tokio::time::Instant;

const CONTROLLER: &str = "models:
  qwen-72b: {pools: [dc-a, dc-b], fallback: qwen-14b, faq: default}
  qwen-14b: {pools: [dc-a], faq: default}
ladder: {recover_after: 8s, min_dwell: 4s, lease: 2m}
";

/// Prometheus and Alertmanager, started for the demo and stopped with it.
struct Monitoring {
    children: Vec<std::process::Child>,
    _dir: tempfile::TempDir,
    prometheus: String,
}

impl Drop for Monitoring {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn find(names: &[&str]) -> Option<std::path::PathBuf> {
    let path = std::env::var("PATH").unwrap_or_default();
    names
        .iter()
        .flat_map(|n| {
            path.split(':')
                .map(move |d| std::path::Path::new(d).join(n))
        })
        .find(|p| p.is_file())
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

async fn wait_ready(http: &reqwest::Client, url: &str) -> anyhow::Result<()> {
    for _ in 0..200 {
        if http
            .get(url)
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
        {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    anyhow::bail!("{url} did not become ready")
}

impl Monitoring {
    /// Starts both when installed; `None` when either is missing.
    async fn start(
        http: &reqwest::Client,
        stanch: &str,
        scrape: &[&str],
    ) -> anyhow::Result<Option<Monitoring>> {
        let (Some(prometheus), Some(alertmanager)) = (
            find(&["prometheus"]),
            find(&["prometheus-alertmanager", "alertmanager"]),
        ) else {
            return Ok(None);
        };
        let dir = tempfile::tempdir()?;
        let d = dir.path();
        // stanch's rules, on a demo's time scale: seconds instead of minutes.
        let rules: String = include_str!("../rules/stanch.rules.yml")
            .replace("[1m]", "[5s]")
            .lines()
            .map(|l| match l.trim_start() {
                t if t.starts_with("for: ") || t.starts_with("keep_firing_for: ") => {
                    let key = t.split(':').next().unwrap_or("for");
                    format!("{}{key}: 2s", &l[..l.len() - t.len()])
                }
                _ => l.to_owned(),
            })
            .collect::<Vec<_>>()
            .join("\n");
        std::fs::write(d.join("rules.yml"), rules)?;
        let (am_port, prom_port) = (free_port()?, free_port()?);
        std::fs::write(
            d.join("am.yml"),
            format!(
                "route: {{receiver: stanch, group_wait: 0s, group_interval: 1s, repeat_interval: 1h, group_by: [alertname, target_model, pool]}}\n\
                 receivers: [{{name: stanch, webhook_configs: [{{url: '{stanch}/v1/alerts/alertmanager', send_resolved: true}}]}}]\n"
            ),
        )?;
        let targets = scrape
            .iter()
            .map(|u| format!("'{}'", u.trim_start_matches("http://")))
            .collect::<Vec<_>>()
            .join(", ");
        std::fs::write(
            d.join("prom.yml"),
            format!(
                "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\nrule_files: ['{}']\n\
                 alerting: {{alertmanagers: [{{static_configs: [{{targets: ['127.0.0.1:{am_port}']}}]}}]}}\n\
                 scrape_configs: [{{job_name: demo, static_configs: [{{targets: [{targets}]}}]}}]\n",
                d.join("rules.yml").display()
            ),
        )?;
        let quiet = || std::process::Stdio::null();
        let mut children = Vec::new();
        children.push(
            std::process::Command::new(alertmanager)
                .arg(format!("--config.file={}", d.join("am.yml").display()))
                .arg(format!("--storage.path={}", d.join("am").display()))
                .arg(format!("--web.listen-address=127.0.0.1:{am_port}"))
                .arg("--cluster.listen-address=")
                .stdout(quiet())
                .stderr(quiet())
                .spawn()?,
        );
        children.push(
            std::process::Command::new(prometheus)
                .arg(format!("--config.file={}", d.join("prom.yml").display()))
                .arg(format!("--storage.tsdb.path={}", d.join("prom").display()))
                .arg(format!("--web.listen-address=127.0.0.1:{prom_port}"))
                .stdout(quiet())
                .stderr(quiet())
                .spawn()?,
        );
        let monitoring = Monitoring {
            children,
            _dir: dir,
            prometheus: format!("http://127.0.0.1:{prom_port}"),
        };
        wait_ready(http, &format!("http://127.0.0.1:{am_port}/-/ready")).await?;
        wait_ready(http, &format!("{}/-/ready", monitoring.prometheus)).await?;
        Ok(Some(monitoring))
    }
}

/// What callers got in the last second.
#[derive(Default)]
struct Window {
    ok: u64,
    errors: u64,
    served: BTreeMap<String, u64>,
    degraded: u64,
    faq: u64,
}

fn alert(status: &str, labels: Value, starts: &str) -> Value {
    let ends = if status == "firing" {
        "0001-01-01T00:00:00Z".to_owned()
    } else {
        stanch_server::clock::Clock::now(&SystemClock).to_string()
    };
    json!({"version": "4", "status": status, "receiver": "stanch",
           "alerts": [{"status": status, "labels": labels, "annotations": {}, "startsAt": starts, "endsAt": ends}]})
}

/// Runs the demo for `seconds` (the script needs about 70).
pub async fn run(seconds: u64, simulate_alerts: bool) -> anyhow::Result<()> {
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(10))
        .build()?;

    let mocks: Vec<(String, Mock)> = {
        let mut v = Vec::new();
        for (model, name) in [
            ("qwen-72b", "dc-a"),
            ("qwen-72b", "dc-b"),
            ("qwen-14b", "dc-a"),
        ] {
            let mut config = MockConfig::new(model, name);
            config.token_interval = Duration::from_millis(2);
            let mock = Mock::new(config);
            v.push((stanch_mock::spawn(mock.clone()).await, mock));
        }
        v
    };
    println!(
        "model servers (stanch-mock): qwen-72b in dc-a at {}, in dc-b at {}; qwen-14b at {}",
        mocks[0].0, mocks[1].0, mocks[2].0
    );

    // State in memory: nothing is left behind.
    let settings =
        Settings::in_memory(Config::from_yaml(CONTROLLER).context("demo configuration")?);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let controller = Controller::start(settings, listener, Arc::new(SystemClock)).await?;
    let stanch = format!("http://{}", controller.addr());
    println!(
        "stanch controller: {stanch}   (status page: {stanch}/ ; or: stanch ctl --server {stanch} status)"
    );

    let yaml = format!(
        "models:\n  qwen-72b:\n    faq: default\n    fallbacks: [qwen-14b]\n    pools:\n      - {{name: dc-a, endpoints: [{{url: '{}'}}]}}\n      - {{name: dc-b, endpoints: [{{url: '{}'}}]}}\n  qwen-14b:\n    pools:\n      - {{name: dc-a, endpoints: [{{url: '{}'}}]}}\n\
         faq_sets:\n  default: {{default_answer: 'We are busy right now; please try again shortly.'}}\n\
         tenants:\n  - {{name: acme, key: acme-key}}\n  - {{name: bigco, key: vip-key, vip: true}}\n\
         blocking: {{probe: {{enabled: true, interval: 1s}}}}\n",
        mocks[0].0, mocks[1].0, mocks[2].0
    );
    let config = GatewayConfig::from_yaml(&yaml).context("demo gateway configuration")?;
    let (routes, _watch) = stanch_client::start(
        stanch_client::WatchConfig::new(&stanch, "demo-gateway"),
        Some(Gateway::validator(&config)),
    );
    let gateway = Arc::new(Gateway::new(config, Some(routes), Arc::new(SystemClock))?);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let gw = format!("http://{}", listener.local_addr()?);
    tokio::spawn(stanch_gateway::serve(
        listener,
        gateway.clone(),
        std::future::pending(),
    ));
    // Idle endpoints (blocked, or in a pool failed away from) are probed, so the rules
    // see when a failed pool is back.
    tokio::spawn(stanch_gateway::probe_loop(gateway.clone()));
    println!("gateway (stanch-gateway): {gw}   (try: curl {gw}/status)");
    let scrape: Vec<&str> = std::iter::once(gw.as_str())
        .chain(mocks.iter().map(|(u, _)| u.as_str()))
        .collect();
    let monitoring = if simulate_alerts {
        None
    } else {
        Monitoring::start(&http, &stanch, &scrape).await?
    };
    match &monitoring {
        Some(m) => println!(
            "Prometheus ({}) and Alertmanager: running stanch's rules on 1 s scrapes; the alerts are real.\n",
            m.prometheus
        ),
        None => println!(
            "Prometheus and Alertmanager are not started: the demo sends stanch the alerts Alertmanager would send.\n"
        ),
    }
    let simulated = monitoring.is_none();

    // Callers: 20 requests a second, one in five from a VIP tenant.
    let window = Arc::new(Mutex::new(Window::default()));
    let traffic = {
        let (window, http, gw) = (window.clone(), http.clone(), gw.clone());
        tokio::spawn(async move {
            for i in 0..100_000u64 {
                let key = if i % 5 == 0 { "vip-key" } else { "acme-key" };
                let body = json!({"model": "qwen-72b", "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]});
                let (window, http, gw) = (window.clone(), http.clone(), gw.clone());
                tokio::spawn(async move {
                    let r = http
                        .post(format!("{gw}/v1/chat/completions"))
                        .bearer_auth(key)
                        .json(&body)
                        .send()
                        .await;
                    // Everything awaited first; the window is locked once, briefly.
                    let answer = match r {
                        Ok(r) if r.status().is_success() => {
                            let degraded = r
                                .headers()
                                .get("x-llm-degraded")
                                .and_then(|v| v.to_str().ok())
                                .map(str::to_owned);
                            let served = r
                                .json::<Value>()
                                .await
                                .ok()
                                .and_then(|v| v["model"].as_str().map(str::to_owned));
                            Some((degraded, served.unwrap_or_default()))
                        }
                        _ => None,
                    };
                    let mut w = window.lock().expect("window lock");
                    match answer {
                        Some((degraded, served)) => {
                            w.ok += 1;
                            match degraded.as_deref() {
                                Some("static") => w.faq += 1,
                                Some(_) => w.degraded += 1,
                                None => {}
                            }
                            *w.served.entry(served).or_default() += 1;
                        }
                        None => w.errors += 1,
                    }
                });
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };

    let post = |body: Value| {
        let (http, url) = (http.clone(), format!("{stanch}/v1/alerts/alertmanager"));
        async move { http.post(url).json(&body).send().await.map(|_| ()) }
    };
    let failover = json!({"alertname": "StanchPoolFailing", "action": "trigger-failover", "target_model": "qwen-72b", "pool": "dc-a", "severity": "critical"});
    let saturated = json!({"alertname": "StanchKVCacheSaturated", "action": "trigger-model-degradation", "target_model": "qwen-72b", "severity": "warning"});
    let start = Instant::now();
    let started_at = stanch_server::clock::Clock::now(&SystemClock).to_string();
    let mut seen = 0u64;
    let mut step = 0;
    let fault = |mock: &Mock, spec: Value| {
        mock.set_fault(serde_json::from_value(spec).expect("fault spec"))
    };
    let mut ticker = tokio::time::interval(Duration::from_secs(1));
    let mut interrupted = std::pin::pin!(tokio::signal::ctrl_c());
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = &mut interrupted => {
                println!("\ninterrupted: stopping everything");
                break;
            }
        }
        let t = start.elapsed().as_secs();
        if t >= seconds {
            break;
        }
        // The script.
        if step == 0 && t >= 6 {
            println!("\n>>> datacenter dc-a starts failing: its model server answers 503");
            fault(&mocks[0].1, json!({"kind": "status", "status": 503}));
            if simulated {
                println!(
                    ">>> (Alertmanager would now send stanch the StanchPoolFailing alert; the demo sends it)"
                );
                post(alert("firing", failover.clone(), &started_at)).await?;
            } else {
                println!(
                    ">>> (Prometheus will see it in the gateway's metrics within seconds; Alertmanager tells stanch)"
                );
            }
            step = 1;
        } else if step == 1 && t >= 22 {
            println!(
                "\n>>> qwen-72b's KV cache saturates in dc-b (vllm:gpu_cache_usage_perc 0.98)"
            );
            put(
                &http,
                &format!("{}/admin/kv-cache", mocks[1].0),
                r#"{"value": 0.98}"#,
            )
            .await;
            if simulated {
                post(alert("firing", saturated.clone(), &started_at)).await?;
            }
            step = 2;
        } else if step == 2 && t >= 38 {
            println!("\n>>> recovery: dc-a answers again, the KV cache drains; the alerts resolve");
            fault(&mocks[0].1, json!({"kind": "none"}));
            put(
                &http,
                &format!("{}/admin/kv-cache", mocks[1].0),
                r#"{"value": 0.4}"#,
            )
            .await;
            if simulated {
                post(alert("resolved", failover.clone(), &started_at)).await?;
                post(alert("resolved", saturated.clone(), &started_at)).await?;
            }
            println!(">>> stanch steps down one rung at a time, after each stabilization window");
            step = 3;
        }
        let w = std::mem::take(&mut *window.lock().expect("window lock"));
        let routes: Value = http
            .get(format!("{stanch}/v1/routes"))
            .send()
            .await?
            .json()
            .await?;
        let m = &routes["models"]["qwen-72b"];
        let served: Vec<String> = w.served.iter().map(|(k, v)| format!("{k} {v}")).collect();
        println!(
            "[{t:>2}s] callers: {:>2} ok, {} errors | answered by: {:<22} | degraded {:>2}, FAQ {:>2} | qwen-72b: {} via {}{}",
            w.ok,
            w.errors,
            served.join(", "),
            w.degraded,
            w.faq,
            m["rung"].as_str().unwrap_or("?"),
            m["pool"].as_str().unwrap_or("?"),
            m["alias"]
                .as_str()
                .map_or(String::new(), |a| format!(", non-VIP → {a}")),
        );
        let history: Vec<Value> = http
            .get(format!("{stanch}/v1/history?after={seen}"))
            .send()
            .await?
            .json()
            .await?;
        for e in history {
            seen = seen.max(e["seq"].as_u64().unwrap_or(0));
            let kind = e["kind"].as_str().unwrap_or("");
            if ["transition", "pool_changed", "flap_pinned"].contains(&kind) {
                println!(
                    "       stanch decided: {}",
                    e["summary"].as_str().unwrap_or("")
                );
            }
        }
    }
    traffic.abort();
    drop(monitoring);
    controller.shutdown().await;
    println!(
        "\ndone: every demo process stopped. Run it again with `stanch demo`, or read docs/operations.md."
    );
    Ok(())
}

async fn put(http: &reqwest::Client, url: &str, body: &str) {
    let _ = http.put(url).body(body.to_owned()).send().await;
}
