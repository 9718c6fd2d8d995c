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

mod monitoring;
mod script;
mod stage;
mod traffic;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use tokio::time::Instant;

use crate::monitoring::Monitoring;
use crate::script::Script;
use crate::stage::Stage;
use crate::traffic::Window;

/// Runs the demo for `seconds` (the script needs about 70).
pub async fn run(seconds: u64, simulate_alerts: bool) -> anyhow::Result<()> {
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(10))
        .build()?;
    let stage = Stage::start().await?;
    let monitoring = if simulate_alerts {
        None
    } else {
        Monitoring::start(&http, &stage.stanch, &stage.scrape_targets()).await?
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
    let window = Arc::new(Mutex::new(Window::default()));
    let callers = traffic::callers(window.clone(), http.clone(), stage.gateway.clone());
    let mut script = Script::new(&stage, http.clone(), monitoring.is_none());
    let mut seen = 0u64;
    let start = Instant::now();
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
        script.advance(t).await?;
        let last_second = std::mem::take(&mut *window.lock().expect("window lock"));
        report(&http, &stage.stanch, t, &last_second, &mut seen).await?;
    }
    callers.abort();
    drop(monitoring);
    stage.stop().await;
    println!(
        "\ndone: every demo process stopped. Run it again with `stanch demo`, or read docs/operations.md."
    );
    Ok(())
}

/// Prints second `t`: what callers got, where qwen-72b is routed, and every decision
/// stanch made since the history entry `seen`.
async fn report(
    http: &reqwest::Client,
    stanch: &str,
    t: u64,
    w: &Window,
    seen: &mut u64,
) -> anyhow::Result<()> {
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
        *seen = (*seen).max(e["seq"].as_u64().unwrap_or(0));
        let kind = e["kind"].as_str().unwrap_or("");
        if ["transition", "pool_changed", "flap_pinned"].contains(&kind) {
            println!(
                "       stanch decided: {}",
                e["summary"].as_str().unwrap_or("")
            );
        }
    }
    Ok(())
}
