//! What the demo runs, on loopback: three model servers, the controller, a gateway.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use stanch_core::Config;
use stanch_gateway::Gateway;
use stanch_gateway::config::GatewayConfig;
use stanch_mock::{Mock, MockConfig};
use stanch_ports::clock::SystemClock;
use stanch_server::{Controller, Settings};

const CONTROLLER: &str = "models:
  qwen-72b: {pools: [dc-a, dc-b], fallback: qwen-14b, faq: default}
  qwen-14b: {pools: [dc-a], faq: default}
ladder: {recover_after: 8s, min_dwell: 4s, lease: 2m}
";

/// Everything the demo started, in this process.
pub(crate) struct Stage {
    /// qwen-72b in dc-a, qwen-72b in dc-b, qwen-14b in dc-a: each URL and its handle.
    pub(crate) mocks: Vec<(String, Mock)>,
    controller: Controller,
    /// The controller's URL.
    pub(crate) stanch: String,
    /// The gateway's URL.
    pub(crate) gateway: String,
}

impl Stage {
    pub(crate) async fn start() -> anyhow::Result<Stage> {
        let mut mocks = Vec::new();
        for (model, name) in [
            ("qwen-72b", "dc-a"),
            ("qwen-72b", "dc-b"),
            ("qwen-14b", "dc-a"),
        ] {
            let mut config = MockConfig::new(model, name);
            config.token_interval = Duration::from_millis(2);
            let mock = Mock::new(config);
            mocks.push((stanch_mock::spawn(mock.clone()).await, mock));
        }
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
        let gateway = start_gateway(&stanch, &mocks).await?;
        println!("gateway (stanch-gateway): {gateway}   (try: curl {gateway}/status)");
        Ok(Stage {
            mocks,
            controller,
            stanch,
            gateway,
        })
    }

    /// What Prometheus scrapes: the gateway and the model servers.
    pub(crate) fn scrape_targets(&self) -> Vec<&str> {
        std::iter::once(self.gateway.as_str())
            .chain(self.mocks.iter().map(|(u, _)| u.as_str()))
            .collect()
    }

    /// Stops the controller, letting it save its state; the rest stops with the runtime.
    pub(crate) async fn stop(self) {
        self.controller.shutdown().await;
    }
}

/// A gateway following the controller, with the mocks as its pools; its URL.
async fn start_gateway(stanch: &str, mocks: &[(String, Mock)]) -> anyhow::Result<String> {
    let yaml = format!(
        "models:\n  qwen-72b:\n    faq: default\n    fallbacks: [qwen-14b]\n    pools:\n      - {{name: dc-a, endpoints: [{{url: '{}'}}]}}\n      - {{name: dc-b, endpoints: [{{url: '{}'}}]}}\n  qwen-14b:\n    pools:\n      - {{name: dc-a, endpoints: [{{url: '{}'}}]}}\n\
         faq_sets:\n  default: {{default_answer: 'We are busy right now; please try again shortly.'}}\n\
         tenants:\n  - {{name: acme, key: acme-key}}\n  - {{name: bigco, key: vip-key, vip: true}}\n\
         blocking: {{probe: {{enabled: true, interval: 1s}}}}\n",
        mocks[0].0, mocks[1].0, mocks[2].0
    );
    let config = GatewayConfig::from_yaml(&yaml).context("demo gateway configuration")?;
    let (routes, _watch) = stanch_client::start(
        stanch_client::WatchConfig::new(stanch, "demo-gateway"),
        Some(Gateway::validator(&config)),
    );
    let gateway = Arc::new(Gateway::new(config, Some(routes), Arc::new(SystemClock))?);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(stanch_gateway::serve(
        listener,
        gateway.clone(),
        std::future::pending(),
    ));
    // Idle endpoints (blocked, or in a pool failed away from) are probed, so the rules
    // see when a failed pool is back.
    tokio::spawn(stanch_gateway::probe_loop(gateway));
    Ok(url)
}
