//! Mocks, a gateway in front of them, and a hand-set route table.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use stanch_api::{ModelRoute, RouteTable, Rung};
use stanch_gateway::Gateway;
use stanch_gateway::config::GatewayConfig;
use stanch_mock::{Mock, MockConfig};
use stanch_ports::clock::{Clock, SystemClock};
use stanch_testkit::http::Fetch;

pub struct Upstream {
    pub base: String,
    pub mock: Mock,
}

impl Upstream {
    pub async fn start(model: &str, name: &str) -> Upstream {
        Upstream::with(MockConfig::new(model, name)).await
    }

    pub async fn with(config: MockConfig) -> Upstream {
        let mock = Mock::new(config);
        let base = stanch_mock::spawn(mock.clone()).await;
        Upstream { base, mock }
    }

    pub fn fault(&self, spec: Value) {
        self.mock.set_fault(serde_json::from_value(spec).unwrap());
    }

    pub fn requests(&self) -> u64 {
        self.mock.stats().requests
    }
}

pub struct Setup {
    pub base: String,
    pub http: reqwest::Client,
    pub routes: stanch_client::ManualRoutes,
    pub version: u64,
}

/// A gateway for `yaml` (endpoints named `{name}` are replaced by mock URLs).
pub async fn gateway(yaml: &str, upstreams: &[(&str, &Upstream)]) -> Setup {
    let mut text = yaml.to_owned();
    for (name, u) in upstreams {
        text = text.replace(&format!("{{{name}}}"), &u.base);
    }
    let config = GatewayConfig::from_yaml(&text).unwrap_or_else(|e| panic!("{e}"));
    let (routes, manual) = stanch_client::Routes::manual();
    let gw = Arc::new(Gateway::new(config, Some(routes), Arc::new(SystemClock)).unwrap());
    if gw.config_probing() {
        tokio::spawn(stanch_gateway::probe_loop(gw.clone()));
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(stanch_gateway::serve(listener, gw, std::future::pending()));
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    Setup {
        base,
        http,
        routes: manual,
        version: 0,
    }
}

/// Quick timeouts and retries, blocking after 3 failures in a row.
pub const POLICY: &str = r#"
timeouts: {connect: 500ms, first_byte: 400ms, first_token: 400ms, stream_idle: 400ms, total: 10s}
retry: {max_attempts: 4, attempts_per_pool: 3, backoff_base: 1ms, backoff_max: 5ms, budget_min_retries: 1000}
blocking: {consecutive_failures: 3, jitter: 0, ttl: 60s, slow_start: 0s}
faq_sets:
  default:
    default_answer: "We are busy; please try again shortly."
    entries:
      - questions: ["how do I reset my password", "如何重置密码"]
        answer: "Use the reset link on the sign-in page."
tenants:
  - {name: acme, key: acme-key}
  - {name: bigco, key: vip-key, vip: true}
"#;

impl Setup {
    pub async fn status(&self) -> Value {
        self.http
            .get(format!("{}/v1/status", self.base))
            .fetch_json()
            .await
    }

    pub async fn metrics(&self) -> String {
        self.http
            .get(format!("{}/metrics", self.base))
            .fetch_text()
            .await
    }

    pub async fn chat(&self, model: &str, stream: bool) -> reqwest::Response {
        self.chat_as(model, stream, "acme-key", "hello").await
    }

    pub async fn chat_as(
        &self,
        model: &str,
        stream: bool,
        key: &str,
        text: &str,
    ) -> reqwest::Response {
        let body = json!({"model": model, "stream": stream, "max_tokens": 4, "messages": [{"role": "user", "content": text}]});
        self.chat_body(&body, key).await
    }

    /// Sends `body` to the chat API as the tenant with `key`.
    pub async fn chat_body(&self, body: &Value, key: &str) -> reqwest::Response {
        self.http
            .post(format!("{}/v1/chat/completions", self.base))
            .bearer_auth(key)
            .json(body)
            .send()
            .await
            .unwrap()
    }

    /// Publishes a table where each (model, rung, pool, alias) is as given.
    pub fn table(
        &mut self,
        entries: &[(&str, Rung, &str, Option<&str>)],
        blocked: Vec<stanch_api::BlockedEndpoint>,
    ) {
        self.table_with_lease(entries, blocked, Duration::from_secs(120));
    }

    /// Publishes a table whose one entry splits `model`'s traffic: `shares` across
    /// its pools (the largest named as the pool), and `alias` with the percentage of
    /// non-exempt traffic it serves, degraded.
    pub fn split(&mut self, model: &str, shares: &[(&str, u8)], alias: Option<(&str, u8)>) {
        let largest = shares
            .iter()
            .reduce(|a, b| if b.1 > a.1 { b } else { a })
            .map_or("dc-a", |(pool, _)| *pool);
        let rung = if alias.is_some() {
            Rung::Degraded
        } else {
            Rung::Failover
        };
        let mut table = self.build(
            &[(model, rung, largest, alias.map(|(a, _)| a))],
            vec![],
            Duration::from_secs(120),
        );
        let entry = table.models.get_mut(model).expect("just made");
        entry.shares = shares
            .iter()
            .map(|(pool, percent)| stanch_api::PoolShare {
                pool: (*pool).to_owned(),
                percent: *percent,
            })
            .collect();
        entry.alias_percent = alias.map(|(_, percent)| percent);
        table.hash = RouteTable::content_hash(&table.models, &table.blocked);
        self.routes.set(table);
    }

    pub fn table_with_lease(
        &mut self,
        entries: &[(&str, Rung, &str, Option<&str>)],
        blocked: Vec<stanch_api::BlockedEndpoint>,
        lease: Duration,
    ) {
        let table = self.build(entries, blocked, lease);
        self.routes.set(table);
    }

    /// The next version's table, where each (model, rung, pool, alias) is as given.
    fn build(
        &mut self,
        entries: &[(&str, Rung, &str, Option<&str>)],
        blocked: Vec<stanch_api::BlockedEndpoint>,
        lease: Duration,
    ) -> RouteTable {
        self.version += 1;
        let now = SystemClock.now();
        let models: BTreeMap<String, ModelRoute> = entries
            .iter()
            .map(|(m, rung, pool, alias)| {
                let route = ModelRoute {
                    rung: *rung,
                    pool: pool.to_string(),
                    alias: alias.map(str::to_owned),
                    alias_exempt: vec!["vip".into()],
                    faq: (*rung == Rung::Static).then(|| "default".to_owned()),
                    since: now,
                    lease_until: now + lease,
                    reason: "test".into(),
                    alerts: vec![],
                    overridden: false,
                    shares: Vec::new(),
                    alias_percent: None,
                };
                (m.to_string(), route)
            })
            .collect();
        let hash = RouteTable::content_hash(&models, &blocked);
        RouteTable {
            version: self.version,
            epoch: "e".into(),
            hash,
            generated_at: now,
            models,
            blocked,
        }
    }
}

/// The `data:` payloads of an SSE body.
pub fn events(text: &str) -> Vec<String> {
    text.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .map(str::to_owned)
        .collect()
}

/// The concatenated content of a chat stream.
pub fn content(events: &[String]) -> String {
    events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter_map(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect()
}

/// The sum of the samples of `name` (labelled or not) whose labels include every
/// `key="value"` in `labels`; 0 when there is none, as for a labelled family none of
/// whose series exists yet.
pub fn sample(metrics: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    metrics
        .lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A private CA and a certificate it signed for `localhost`, made with openssl.
pub fn certificates(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let path = |name: &str| dir.join(name);
    let openssl = |args: &[&str]| {
        let status = Command::new("openssl")
            .current_dir(dir)
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("openssl is installed by scripts/install-test-deps.sh");
        assert!(status.success(), "openssl {args:?}");
    };
    openssl(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=test CA",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
    ]);
    openssl(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=localhost",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
    ]);
    std::fs::write(
        path("server.ext"),
        "subjectAltName=DNS:localhost\nbasicConstraints=CA:FALSE\n",
    )
    .unwrap();
    openssl(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "1",
        "-extfile",
        "server.ext",
        "-out",
        "server.pem",
    ]);
    (path("ca.pem"), path("server.pem"), path("server.key"))
}
