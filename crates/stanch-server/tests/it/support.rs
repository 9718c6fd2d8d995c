//! Starts controllers on loopback with a hand-moved clock, and talks to them.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use stanch_api::Timestamp;
use stanch_core::Config;
use stanch_ports::clock::ManualClock;
use stanch_server::auth::Tokens;
use stanch_server::config::ServerConfig;
use stanch_server::{Controller, Settings};

pub const INGEST: &str = "ingest-token";
pub const ADMIN: &str = "admin-token";
pub const READ: &str = "read-token";
pub const REPORT: &str = "report-token";

/// The time the shared fixtures were captured: 2026-11-30T00:07:00Z.
pub fn fixture_time() -> Timestamp {
    Timestamp::parse_rfc3339("2026-11-30T00:07:00Z").unwrap()
}

pub fn fixture(name: &str) -> Vec<u8> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

pub fn test_config() -> Config {
    let mut c = Config::default_config();
    c.blocking.jitter = 0.0;
    c
}

pub struct Harness {
    pub controller: Option<Controller>,
    pub base: String,
    pub dir: PathBuf,
    pub clock: ManualClock,
    pub http: reqwest::Client,
    pub config: Config,
    pub server: ServerConfig,
    pub tokens: bool,
    _tmp: Option<tempfile::TempDir>,
}

pub struct Options {
    pub config: Config,
    pub server: ServerConfig,
    pub tokens: bool,
    pub dir: Option<PathBuf>,
    pub clock: Option<ManualClock>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            config: test_config(),
            server: ServerConfig::default(),
            tokens: true,
            dir: None,
            clock: None,
        }
    }
}

impl Harness {
    pub async fn start() -> Harness {
        Harness::with(Options::default()).await
    }

    pub async fn with(opts: Options) -> Harness {
        let (tmp, dir) = match opts.dir {
            Some(d) => (None, d),
            None => {
                let t = tempfile::tempdir().unwrap();
                let d = t.path().to_owned();
                (Some(t), d)
            }
        };
        let clock = opts
            .clock
            .unwrap_or_else(|| ManualClock::new(fixture_time()));
        let controller = launch(&opts.config, &opts.server, opts.tokens, &dir, &clock).await;
        let base = format!("http://{}", controller.addr());
        let http = reqwest::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(20))
            .build()
            .unwrap();
        Harness {
            controller: Some(controller),
            base,
            dir,
            clock,
            http,
            config: opts.config,
            server: opts.server,
            tokens: opts.tokens,
            _tmp: tmp,
        }
    }

    /// Simulates `kill -9`: tasks are aborted, nothing is saved on the way out.
    pub async fn crash(&mut self) {
        drop(self.controller.take());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    /// Starts a new controller on the same data directory.
    pub async fn restart(&mut self) {
        let controller = launch(
            &self.config,
            &self.server,
            self.tokens,
            &self.dir,
            &self.clock,
        )
        .await;
        self.base = format!("http://{}", controller.addr());
        self.controller = Some(controller);
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub async fn post(
        &self,
        path: &str,
        token: Option<&str>,
        body: impl Into<reqwest::Body>,
    ) -> reqwest::Response {
        let mut req = self
            .http
            .post(self.url(path))
            .header("content-type", "application/json")
            .body(body);
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        req.send().await.unwrap()
    }

    pub async fn get(&self, path: &str, token: Option<&str>) -> reqwest::Response {
        let mut req = self.http.get(self.url(path));
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        req.send().await.unwrap()
    }

    pub async fn json(&self, path: &str) -> Value {
        let r = self.get(path, Some(READ)).await;
        assert!(r.status().is_success(), "{path}: {}", r.status());
        r.json().await.unwrap()
    }

    pub async fn routes(&self) -> Value {
        self.json("/v1/routes").await
    }

    pub async fn admin(&self, action: &str, body: Value) -> reqwest::Response {
        self.post(
            &format!("/v1/admin/{action}"),
            Some(ADMIN),
            body.to_string(),
        )
        .await
    }

    pub async fn webhook(&self, body: impl Into<reqwest::Body>) -> reqwest::Response {
        self.post("/v1/alerts/alertmanager", Some(INGEST), body)
            .await
    }
}

async fn launch(
    config: &Config,
    server: &ServerConfig,
    tokens: bool,
    dir: &Path,
    clock: &ManualClock,
) -> Controller {
    let tokens = if tokens {
        Tokens::new(Some(INGEST.into()), Some(ADMIN.into()), Some(READ.into()))
            .with_report(Some(REPORT.into()))
    } else {
        Tokens::default()
    };
    let settings = Settings {
        storage: stanch_server::Storage::Dir(dir.to_owned()),
        tokens,
        server: server.clone(),
        ..Settings::in_memory(config.clone())
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    Controller::start(settings, listener, Arc::new(clock.clone()))
        .await
        .expect("controller starts")
}

/// An Alertmanager webhook body with one alert.
/// Sends the fixture that fails pool dc-a of qwen-72b; returns the version it made.
pub async fn fail_dc_a(h: &Harness) -> u64 {
    let r = h
        .webhook(fixture("alertmanager-v4-firing-failover.json"))
        .await;
    assert_eq!(r.status(), 200);
    r.json::<Value>().await.unwrap()["version"]
        .as_u64()
        .unwrap()
}

pub fn webhook_body(status: &str, labels: &[(&str, &str)], starts_at: &str) -> String {
    let labels: serde_json::Map<String, Value> = labels
        .iter()
        .map(|(k, v)| (k.to_string(), Value::String(v.to_string())))
        .collect();
    serde_json::json!({
        "version": "4", "status": status, "receiver": "stanch",
        "alerts": [{"status": status, "labels": labels, "annotations": {},
                    "startsAt": starts_at, "endsAt": "0001-01-01T00:00:00Z"}]
    })
    .to_string()
}
