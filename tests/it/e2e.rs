//! The closed loop, end to end: real Prometheus and Alertmanager (Debian's packages,
//! installed by scripts/install-test-deps.sh), the stanch controller as a process, two
//! gateway replicas and mock upstreams, all on loopback. Prometheus scrapes the gateways
//! and evaluates the rules of `rules/` (their windows and `for:` shortened so a test
//! takes seconds); Alertmanager notifies stanch; stanch decides; the gateways follow.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use stanch_gateway::Gateway;
use stanch_gateway::config::GatewayConfig;
use stanch_mock::{Mock, MockConfig};
use stanch_ports::clock::SystemClock;
use stanch_testkit::http::Fetch;
use stanch_testkit::net::free_port as port;
use stanch_testkit::process::{Running, program};
use tokio::time::Instant;

const INGEST: &str = "e2e-ingest";

/// Waits for `url` to answer 200: a process started by the closed loop.
async fn ready(url: &str) {
    stanch_testkit::http::ready(url, Duration::from_secs(15)).await;
}

/// The rules of rules/, with windows and holds shortened for a test's time scale.
fn fast_rules() -> String {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/rules/stanch.rules.yml"
    ))
    .unwrap();
    text.replace("[1m]", "[5s]")
        .replace("[5m]", "[10s]")
        .replace("for: 30s", "for: 1s")
        .replace("for: 1m", "for: 2s")
        .replace("keep_firing_for: 1m", "keep_firing_for: 2s")
        .replace("keep_firing_for: 2m", "keep_firing_for: 3s")
}

/// What happened, in seconds since the scenario began: the test's own marks and the
/// controller's history, each at the time it happened.
struct Timeline {
    start: Instant,
    /// The wall clock at `start`, to place the controller's history events.
    wall: stanch_api::Timestamp,
    events: std::sync::Mutex<Vec<(Duration, String)>>,
}

impl Timeline {
    fn new() -> Timeline {
        use stanch_ports::clock::Clock;
        Timeline {
            start: Instant::now(),
            wall: SystemClock.now(),
            events: Default::default(),
        }
    }

    fn mark(&self, what: impl Into<String>) -> Duration {
        let at = self.start.elapsed();
        self.events.lock().unwrap().push((at, what.into()));
        at
    }

    /// Adds a controller history event at the time the controller recorded it;
    /// returns that time.
    fn history(&self, event: &Value) -> Option<Duration> {
        let at = stanch_api::Timestamp::parse_rfc3339(event["at"].as_str()?).ok()?;
        let offset = Duration::from_millis(
            u64::try_from(at.as_millis() - self.wall.as_millis()).unwrap_or(0),
        );
        let summary = event["summary"].as_str().unwrap_or("");
        self.events
            .lock()
            .unwrap()
            .push((offset, format!("controller: {summary}")));
        Some(offset)
    }

    fn print(&self, title: &str) {
        let mut events = self.events.lock().unwrap().clone();
        events.sort_by_key(|(at, _)| *at);
        eprintln!("timeline: {title}");
        for (at, what) in events {
            eprintln!("  {:>8.3}s  {what}", at.as_secs_f64());
        }
    }
}

struct Loop {
    _procs: Vec<Running>,
    dir: tempfile::TempDir,
    controller: String,
    controller_port: u16,
    controller_proc: Option<Running>,
    gateways: Vec<(String, Arc<Gateway>)>,
    mocks: Vec<(String, Mock)>,
    prometheus: String,
}

/// The controller's configuration: the default layout, with windows short enough for a test.
const CONTROLLER_CONFIG: &str = "models:
  qwen-72b: {pools: [dc-a, dc-b], fallback: qwen-14b, faq: default}
  qwen-14b: {pools: [dc-a], faq: default}
ladder:
  recover_after: 4s
  min_dwell: 2s
  lease: 2m
  flap: {max_transitions: 2, window: 1m, hold: 1m}
";

fn start_controller(dir: &Path, port: u16) -> Running {
    std::fs::write(dir.join("stanch.yaml"), CONTROLLER_CONFIG).unwrap();
    Running::spawn(
        Command::new(env!("CARGO_BIN_EXE_stanch"))
            .args([
                "serve",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--config",
            ])
            .arg(dir.join("stanch.yaml"))
            .arg("--data-dir")
            .arg(dir.join("stanch"))
            .env("STANCH_INGEST_TOKEN", INGEST)
            .env_remove("STANCH_ADMIN_TOKEN")
            .env_remove("STANCH_READ_TOKEN")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    )
}

/// Gateways' passive blocking as shipped, with probes on.
const BLOCKING: &str = "{probe: {enabled: true, interval: 500ms, successes: 2, timeout: 1s}}";

async fn closed_loop() -> Loop {
    closed_loop_with(fast_rules(), BLOCKING).await
}

/// A closed loop with these rules and this gateway `blocking:` section.
async fn closed_loop_with(rules: String, blocking: &str) -> Loop {
    let dir = tempfile::tempdir().unwrap();
    let mut procs = Vec::new();

    // Upstreams: qwen-72b in dc-a and dc-b, qwen-14b.
    let mut mocks = Vec::new();
    for (model, name) in [
        ("qwen-72b", "dc-a"),
        ("qwen-72b", "dc-b"),
        ("qwen-14b", "small"),
    ] {
        let mock = Mock::new(MockConfig::new(model, name));
        let base = stanch_mock::spawn(mock.clone()).await;
        mocks.push((base, mock));
    }

    // The controller, as a process.
    let cport = port();
    let controller = format!("http://127.0.0.1:{cport}");
    let controller_proc = start_controller(dir.path(), cport);
    ready(&format!("{controller}/readyz")).await;

    // Two gateway replicas following it, one by SSE, one by the gRPC stream.
    let gateway_yaml = format!(
        "models:\n  qwen-72b:\n    faq: default\n    fallbacks: [qwen-14b]\n    pools:\n      - {{name: dc-a, endpoints: [{{url: '{}'}}]}}\n      - {{name: dc-b, endpoints: [{{url: '{}'}}]}}\n  qwen-14b:\n    pools:\n      - {{name: dc-a, endpoints: [{{url: '{}'}}]}}\n\
         faq_sets:\n  default: {{default_answer: 'We are busy; please try again shortly.'}}\n\
         tenants:\n  - {{name: acme, key: acme-key}}\n  - {{name: bigco, key: vip-key, vip: true}}\n\
         retry: {{backoff_base: 1ms, backoff_max: 2ms, budget_min_retries: 100000}}\n\
         blocking: {blocking}\n",
        mocks[0].0, mocks[1].0, mocks[2].0
    );
    let mut gateways = Vec::new();
    for (id, transport) in [
        ("gw-1", stanch_client::Transport::Sse),
        ("gw-2", stanch_client::Transport::Grpc),
    ] {
        let config = GatewayConfig::from_yaml(&gateway_yaml).unwrap();
        let mut watch = stanch_client::WatchConfig::new(&controller, id);
        watch.transport = transport;
        let (routes, _) = stanch_client::start(watch, Some(Gateway::validator(&config)));
        let gw = Arc::new(Gateway::new(config, Some(routes), Arc::new(SystemClock)).unwrap());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(stanch_gateway::serve(
            listener,
            gw.clone(),
            std::future::pending(),
        ));
        tokio::spawn(stanch_gateway::probe_loop(gw.clone()));
        gateways.push((base, gw));
    }

    // Alertmanager, notifying stanch.
    let am_port = port();
    let am_config = format!(
        "route:\n  receiver: stanch\n  group_wait: 0s\n  group_interval: 1s\n  repeat_interval: 1h\n  group_by: ['alertname', 'target_model', 'pool', 'endpoint']\n\
         receivers:\n  - name: stanch\n    webhook_configs:\n      - url: '{controller}/v1/alerts/alertmanager'\n        send_resolved: true\n        http_config: {{authorization: {{type: Bearer, credentials: {INGEST}}}}}\n"
    );
    std::fs::write(dir.path().join("am.yml"), am_config).unwrap();
    procs.push(Running::spawn(
        Command::new(program(&["prometheus-alertmanager", "alertmanager"]))
            .arg(format!(
                "--config.file={}",
                dir.path().join("am.yml").display()
            ))
            .arg(format!(
                "--storage.path={}",
                dir.path().join("am").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{am_port}"))
            .arg("--cluster.listen-address=")
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    ));
    ready(&format!("http://127.0.0.1:{am_port}/-/ready")).await;

    // Prometheus, scraping the controller, gateways and mocks every second, with the
    // rules of rules/.
    std::fs::write(dir.path().join("rules.yml"), rules).unwrap();
    let targets = |urls: Vec<&str>| {
        urls.iter()
            .map(|u| format!("'{}'", u.trim_start_matches("http://")))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let prom_port = port();
    let prom_config = format!(
        "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\nrule_files: ['{}']\n\
         alerting:\n  alertmanagers:\n    - static_configs: [{{targets: ['127.0.0.1:{am_port}']}}]\n\
         scrape_configs:\n  - job_name: stanch\n    static_configs: [{{targets: ['127.0.0.1:{cport}']}}]\n  - job_name: stanch-gateway\n    static_configs: [{{targets: [{}]}}]\n  - job_name: vllm\n    static_configs: [{{targets: [{}]}}]\n",
        dir.path().join("rules.yml").display(),
        targets(gateways.iter().map(|(b, _)| b.as_str()).collect()),
        targets(mocks.iter().map(|(b, _)| b.as_str()).collect()),
    );
    std::fs::write(dir.path().join("prom.yml"), prom_config).unwrap();
    procs.push(Running::spawn(
        Command::new(program(&["prometheus"]))
            .arg(format!(
                "--config.file={}",
                dir.path().join("prom.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("prom").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{prom_port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    ));
    ready(&format!("http://127.0.0.1:{prom_port}/-/ready")).await;
    Loop {
        _procs: procs,
        dir,
        controller,
        controller_port: cport,
        controller_proc: Some(controller_proc),
        gateways,
        mocks,
        prometheus: format!("http://127.0.0.1:{prom_port}"),
    }
}

impl Loop {
    /// The gateways, once both have applied a table from the controller.
    async fn following(&self) -> Vec<Arc<Gateway>> {
        let gateways: Vec<Arc<Gateway>> = self.gateways.iter().map(|(_, g)| g.clone()).collect();
        until(Duration::from_secs(10), || {
            gateways.iter().all(|g| rung(g, "qwen-72b").is_some())
        })
        .await
        .expect("gateways follow the controller");
        gateways
    }

    /// Returns once Prometheus has scraped every target at least `samples` times.
    /// Prometheus applies new scrape targets on a 5 s tick, so it has no data for the
    /// first seconds after it starts; a fault injected then is detected late.
    async fn scraped(&self, samples: u32) {
        // The gateways, the mocks and the controller.
        let targets = self.gateways.len() + self.mocks.len() + 1;
        let url = format!(
            "{}/api/v1/query?query=count_over_time(up[1m])",
            self.prometheus
        );
        let enough = || async {
            let Ok(r) = reqwest::get(&url).await else {
                return false;
            };
            let v: Value = r.json().await.unwrap_or_default();
            let counts: Vec<u32> = v["data"]["result"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|s| s["value"][1].as_str()?.parse().ok())
                        .collect()
                })
                .unwrap_or_default();
            counts.len() == targets && counts.iter().all(|c| *c >= samples)
        };
        stanch_testkit::wait::until(
            &format!("Prometheus scraping every target {samples} times"),
            Duration::from_secs(30),
            enough,
        )
        .await;
    }

    /// The controller's audit history, with a query string.
    async fn history(&self, query: &str) -> Vec<Value> {
        reqwest::get(format!("{}/v1/history?{query}", self.controller))
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }
}

/// Switches a mock's fault (`{"kind": "none"}` heals it).
fn set_fault(mock: &Mock, spec: Value) {
    mock.set_fault(serde_json::from_value(spec).expect("a fault spec"));
}

/// Steady traffic through both gateways until dropped; counts what callers got.
struct Traffic {
    ok: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Traffic {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn traffic(gateways: &[(String, Arc<Gateway>)], timeline: Arc<Timeline>) -> Traffic {
    let ok = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let bases: Vec<String> = gateways.iter().map(|(b, _)| b.clone()).collect();
    let (o, f) = (ok.clone(), failed.clone());
    let task = tokio::spawn(async move {
        let http = reqwest::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(5))
            .build()
            .unwrap();
        // Bounded: at most 20 minutes of requests every 20 ms.
        for i in 0..60_000u64 {
            let base = &bases[(i % 2) as usize];
            let body = json!({"model": "qwen-72b", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]});
            match http
                .post(format!("{base}/v1/chat/completions"))
                .json(&body)
                .send()
                .await
            {
                Ok(r) if r.status().is_success() => {
                    o.fetch_add(1, Ordering::Relaxed);
                }
                _ => {
                    f.fetch_add(1, Ordering::Relaxed);
                    timeline.mark("a caller got an error");
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    Traffic { ok, failed, task }
}

/// Waits until `check` holds (up to `within`), returning when it first did.
async fn until<F: Fn() -> bool>(within: Duration, check: F) -> Option<Duration> {
    let start = Instant::now();
    stanch_testkit::wait::some_within(within, || {
        std::future::ready(check().then(|| start.elapsed()))
    })
    .await
}

fn rung(gw: &Gateway, model: &str) -> Option<(String, String, u64)> {
    let t = stanch_gateway::applied_table(gw)?;
    let m = t.models.get(model)?;
    Some((m.rung.to_string(), m.pool.clone(), t.version))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_datacenter_moves_every_gateway_to_the_other() {
    let lp = closed_loop().await;
    let timeline = Arc::new(Timeline::new());
    let load = traffic(&lp.gateways, timeline.clone());
    let gateways = lp.following().await;
    lp.scraped(3).await; // Prometheus has a baseline.

    set_fault(&lp.mocks[0].1, json!({"kind": "status", "status": 503}));
    let fault = timeline.mark("dc-a starts answering 503");
    let moved = until(Duration::from_secs(45), || {
        gateways.iter().all(|g| {
            rung(g, "qwen-72b").is_some_and(|(r, pool, _)| r == "failover" && pool == "dc-b")
        })
    })
    .await;
    let both = timeline.mark("both gateways hold qwen-72b → failover, pool dc-b");
    let history: Vec<Value> = lp.history("model=qwen-72b").await;
    let mut webhook = None;
    for e in history
        .iter()
        .filter(|e| ["alert_active", "transition"].contains(&e["kind"].as_str().unwrap_or("")))
    {
        let at = timeline.history(e);
        if e["kind"] == "alert_active" && webhook.is_none() {
            webhook = at;
        }
    }
    timeline.print("a failing datacenter");
    assert!(moved.is_some(), "both gateways moved to dc-b");
    let last_error = timeline
        .events
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, what)| what == "a caller got an error")
        .map(|(at, _)| *at)
        .max();
    eprintln!(
        "fault → last failing response seen by callers: {}",
        last_error.map_or("none".to_owned(), |at| format!(
            "{:.2}s",
            at.saturating_sub(fault).as_secs_f64()
        ))
    );
    if let Some(webhook) = webhook {
        // Polled every 20 ms here; the time-to-heal benchmark polls every millisecond.
        eprintln!(
            "webhook received → both gateways on the new version: ≤ {} ms",
            both.saturating_sub(webhook).as_millis()
        );
    }
    eprintln!(
        "fault → both gateways on dc-b: {:.2}s; callers: {} answered, {} errors",
        (both - fault).as_secs_f64(),
        load.ok.load(Ordering::Relaxed),
        load.failed.load(Ordering::Relaxed)
    );
    assert_eq!(
        load.failed.load(Ordering::Relaxed),
        0,
        "callers never saw the failure: gateways retried elsewhere"
    );
    // The controller knows both applied the decision, each over its own transport.
    let status = format!("{}/v1/status", lp.controller);
    stanch_testkit::wait::until(
        "both gateways acknowledged over SSE and gRPC",
        Duration::from_secs(5),
        || async {
            let status: Value = reqwest::get(&status).await.unwrap().json().await.unwrap();
            let gateways = status["gateways"].as_array().cloned().unwrap_or_default();
            let holds = |id: &str, transport: &str| {
                gateways.iter().any(|g| {
                    g["id"] == id
                        && g["transport"] == transport
                        && g["converged"] == true
                        && g["connected"] == true
                })
            };
            holds("gw-1", "sse") && holds("gw-2", "grpc")
        },
    )
    .await;
}

async fn chat_as(base: &str, key: &str) -> (u16, Value, reqwest::header::HeaderMap) {
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let body = json!({"model": "qwen-72b", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]});
    let r = http
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth(key)
        .json(&body)
        .send()
        .await
        .unwrap();
    let (status, headers) = (r.status().as_u16(), r.headers().clone());
    (status, r.json().await.unwrap_or_default(), headers)
}

async fn put(url: &str, body: &str) {
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    assert!(
        http.put(url)
            .body(body.to_owned())
            .send()
            .await
            .unwrap()
            .status()
            .is_success()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saturated_kv_cache_degrades_non_vip_callers_only() {
    let lp = closed_loop().await;
    let timeline = Arc::new(Timeline::new());
    let gateways = lp.following().await;
    put(
        &format!("{}/admin/kv-cache", lp.mocks[0].0),
        r#"{"value": 0.98}"#,
    )
    .await;
    let saturated = timeline.mark("dc-a's KV cache at 98 %");
    let degraded = until(Duration::from_secs(30), || {
        gateways
            .iter()
            .all(|g| rung(g, "qwen-72b").is_some_and(|(r, _, _)| r == "degraded"))
    })
    .await;
    let at = timeline.mark("both gateways hold qwen-72b → degraded (alias qwen-14b)");
    timeline.print("a saturated KV cache");
    assert!(degraded.is_some(), "degraded");
    eprintln!(
        "saturation → both gateways degraded: {:.2}s",
        (at - saturated).as_secs_f64()
    );
    for (base, _) in &lp.gateways {
        let (status, body, headers) = chat_as(base, "acme-key").await;
        assert_eq!(status, 200);
        assert_eq!(
            body["model"], "qwen-14b",
            "non-VIP callers get the smaller model"
        );
        assert_eq!(headers["x-llm-degraded"], "true");
        let (status, body, headers) = chat_as(base, "vip-key").await;
        assert_eq!(status, 200);
        assert_eq!(body["model"], "qwen-72b", "VIP callers keep the model");
        assert!(headers.get("x-llm-degraded").is_none());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_everything_fails_callers_get_faq_answers_never_a_5xx() {
    let lp = closed_loop().await;
    let timeline = Arc::new(Timeline::new());
    let gateways = lp.following().await;
    let load = traffic(&lp.gateways, timeline.clone());
    tokio::time::sleep(Duration::from_secs(2)).await;
    for (_, mock) in &lp.mocks {
        set_fault(mock, json!({"kind": "status", "status": 503}));
    }
    timeline.mark("every upstream answers 503");
    let fell_back = until(Duration::from_secs(40), || {
        gateways
            .iter()
            .all(|g| rung(g, "qwen-72b").is_some_and(|(r, _, _)| r == "static"))
    })
    .await;
    timeline.mark("both gateways hold qwen-72b → static");
    timeline.print("everything failing");
    assert!(fell_back.is_some(), "the controller chose the static rung");
    for (base, _) in &lp.gateways {
        let (status, body, headers) = chat_as(base, "vip-key").await;
        assert_eq!(status, 200);
        assert_eq!(headers["x-llm-degraded"], "static");
        assert!(
            body["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .contains("busy")
        );
    }
    assert_eq!(
        load.failed.load(Ordering::Relaxed),
        0,
        "never a 5xx: FAQ answers throughout"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_controller_leaves_gateways_serving_and_resumes_its_state() {
    let mut lp = closed_loop().await;
    let timeline = Arc::new(Timeline::new());
    let gateways = lp.following().await;
    let load = traffic(&lp.gateways, timeline.clone());
    set_fault(&lp.mocks[0].1, json!({"kind": "status", "status": 503}));
    timeline.mark("dc-a starts answering 503");
    until(Duration::from_secs(30), || {
        gateways
            .iter()
            .all(|g| rung(g, "qwen-72b").is_some_and(|r| r.0 == "failover"))
    })
    .await
    .expect("failed over");
    let before = rung(&gateways[0], "qwen-72b").unwrap();
    let routes_before: Value = reqwest::get(format!("{}/v1/routes", lp.controller))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    timeline.mark(format!("mid-incident at version {}", before.2));

    drop(lp.controller_proc.take()); // SIGKILL
    timeline.mark("controller killed with SIGKILL");
    tokio::time::sleep(Duration::from_secs(2)).await;
    for g in &gateways {
        assert_eq!(
            rung(g, "qwen-72b").unwrap().0,
            "failover",
            "gateways keep the last table"
        );
    }
    lp.controller_proc = Some(start_controller(lp.dir.path(), lp.controller_port));
    ready(&format!("{}/readyz", lp.controller)).await;
    timeline.mark("controller restarted");
    let routes_after: Value = reqwest::get(format!("{}/v1/routes", lp.controller))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    timeline.print("a killed controller");
    assert_eq!(routes_after["epoch"], routes_before["epoch"], "same epoch");
    assert!(
        routes_after["version"].as_u64() >= routes_before["version"].as_u64(),
        "versions continue"
    );
    assert_eq!(
        routes_after["models"]["qwen-72b"]["rung"], "failover",
        "the incident's state resumed"
    );
    assert_eq!(
        load.failed.load(Ordering::Relaxed),
        0,
        "callers never noticed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovery_steps_down_one_rung_at_a_time_without_flapping() {
    let lp = closed_loop().await;
    let timeline = Arc::new(Timeline::new());
    let gateways = lp.following().await;
    let _load = traffic(&lp.gateways, timeline.clone());
    tokio::time::sleep(Duration::from_secs(2)).await;
    for (_, mock) in &lp.mocks {
        set_fault(mock, json!({"kind": "status", "status": 503}));
    }
    timeline.mark("every upstream answers 503");
    until(Duration::from_secs(40), || {
        gateways
            .iter()
            .all(|g| rung(g, "qwen-72b").is_some_and(|r| r.0 == "static"))
    })
    .await
    .expect("static");
    timeline.mark("static");
    for (_, mock) in &lp.mocks {
        set_fault(mock, json!({"kind": "none"}));
    }
    let cleared = timeline.mark("faults cleared");
    let recovered = until(Duration::from_secs(60), || {
        gateways
            .iter()
            .all(|g| rung(g, "qwen-72b").is_some_and(|r| r.0 == "normal"))
    })
    .await;
    timeline.mark("both gateways back to normal");
    let history: Vec<Value> = lp.history("model=qwen-72b&limit=1000").await;
    let moves: Vec<(String, String, String)> = history
        .iter()
        .filter(|e| e["kind"] == "transition")
        .map(|e| {
            let d = &e["detail"];
            (
                d["from"].as_str().unwrap_or("").to_owned(),
                d["to"].as_str().unwrap_or("").to_owned(),
                e["at"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect();
    for e in history.iter().filter(|e| e["kind"] == "transition") {
        timeline.history(e);
    }
    timeline.print("recovery");
    assert!(
        recovered.is_some(),
        "recovered; {:.1}s after clearing",
        (timeline.start.elapsed() - cleared).as_secs_f64()
    );
    let last_static = moves
        .iter()
        .rposition(|(_, to, _)| to == "static")
        .expect("went static");
    let down: Vec<(&str, &str)> = moves[last_static + 1..]
        .iter()
        .map(|(f, t, _)| (f.as_str(), t.as_str()))
        .collect();
    assert_eq!(
        down,
        [
            ("static", "degraded"),
            ("degraded", "failover"),
            ("failover", "normal")
        ],
        "one rung at a time, and never back up (no flapping)"
    );
}

/// dc-a fails for 3 s and works for 2 s, over and over: faster than the stabilization
/// window. The model is held on dc-b instead of bounced: gateways probe the pool the
/// table failed away from, and its failing probes keep the pool alert firing through
/// each brief recovery, so nothing moves for the rest of the flapping. (Whether the
/// endpoint-error rule also soft-blocks dc-a's endpoint depends on where in a cycle the
/// failover lands: it needs its `for` to pass while dc-a still has traffic. Either
/// way the model stays put.) (When traffic does keep
/// reaching a flapping pool, the flap guard pins the model: engine scenario
/// `flap_guard_pins`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flapping_fault_settles_instead_of_bouncing() {
    let lp = closed_loop().await;
    let timeline = Arc::new(Timeline::new());
    let gateways = lp.following().await;
    let load = traffic(&lp.gateways, timeline.clone());
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mock = lp.mocks[0].1.clone();
    let flapper = {
        let timeline = timeline.clone();
        tokio::spawn(async move {
            for cycle in 0..7 {
                set_fault(&mock, json!({"kind": "status", "status": 503}));
                timeline.mark(format!("cycle {cycle}: dc-a fails for 3 s"));
                tokio::time::sleep(Duration::from_secs(3)).await;
                set_fault(&mock, json!({"kind": "none"}));
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
        })
    };
    // Where gw-1 sends qwen-72b, sampled every 100 ms through the flapping.
    let route = |g: &Gateway| {
        let t = stanch_gateway::applied_table(g).unwrap();
        let m = &t.models["qwen-72b"];
        (m.rung.to_string(), m.pool.clone())
    };
    let mut samples = Vec::new();
    for _ in 0..330 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        samples.push(route(&gateways[0]));
    }
    flapper.abort();
    let changes: Vec<usize> = (1..samples.len())
        .filter(|i| samples[*i] != samples[i - 1])
        .collect();
    let history: Vec<Value> = lp.history("limit=1000").await;
    for e in history.iter().filter(|e| {
        ["transition", "blocked", "flap_pinned"].contains(&e["kind"].as_str().unwrap_or(""))
    }) {
        timeline.history(e);
    }
    timeline.print("a flapping fault");
    let transitions = history.iter().filter(|e| e["kind"] == "transition").count();
    assert!(
        transitions <= 2,
        "at most one round trip: {transitions} transitions"
    );
    let last = samples.last().unwrap();
    assert_eq!(
        (last.0.as_str(), last.1.as_str()),
        ("failover", "dc-b"),
        "held on the healthy pool"
    );
    assert!(
        changes.last().is_none_or(|i| *i < samples.len() - 100),
        "nothing moved in the last 10 s of flapping"
    );
    for g in &gateways {
        assert_eq!(route(g), *samples.last().unwrap(), "both replicas agree");
    }
    assert_eq!(
        load.failed.load(Ordering::Relaxed),
        0,
        "callers never saw the flapping"
    );
}

/// dc-a's KV cache saturates again each time stanch steps back. Each recovery waits for
/// the stabilization window, so nothing bounces faster than that; and when the fault
/// keeps returning, the flap guard (here: more than two reversals a minute) pins
/// qwen-72b on degraded and holds it there while the cache looks fine, instead of
/// moving callers between models again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fault_that_returns_after_every_recovery_pins_the_model() {
    let lp = closed_loop().await;
    let timeline = Arc::new(Timeline::new());
    let gateways = lp.following().await;
    let load = traffic(&lp.gateways, timeline.clone());
    let kv = format!("{}/admin/kv-cache", lp.mocks[0].0);
    let all_on = |want: &str| {
        gateways
            .iter()
            .all(|g| rung(g, "qwen-72b").is_some_and(|(r, _, _)| r == want))
    };
    let pinned = || async {
        lp.history("limit=1000")
            .await
            .iter()
            .any(|e| e["kind"] == "flap_pinned")
    };
    let mut cycles = 0;
    for cycle in 0..3 {
        cycles += 1;
        put(&kv, r#"{"value": 0.98}"#).await;
        timeline.mark(format!("cycle {cycle}: dc-a's KV cache at 98 %"));
        until(Duration::from_secs(30), || all_on("degraded"))
            .await
            .expect("degraded");
        timeline.mark("both gateways degraded");
        if pinned().await {
            break;
        }
        put(&kv, r#"{"value": 0.30}"#).await;
        timeline.mark("KV cache back to 30 %");
        until(Duration::from_secs(40), || all_on("normal"))
            .await
            .expect("stanch steps back once the cache is fine");
        timeline.mark("both gateways back to normal");
    }
    put(&kv, r#"{"value": 0.30}"#).await;
    let fine = timeline.mark("KV cache back to 30 %; watching for 12 s");
    let moved = until(Duration::from_secs(12), || !all_on("degraded")).await;
    for e in lp
        .history("limit=1000")
        .await
        .iter()
        .filter(|e| ["transition", "flap_pinned"].contains(&e["kind"].as_str().unwrap_or("")))
    {
        timeline.history(e);
    }
    timeline.print("a fault that returns after every recovery");
    assert_eq!(
        cycles, 2,
        "pinned on the second saturation (third reversal)"
    );
    assert!(pinned().await, "the flap guard engaged");
    assert!(
        moved.is_none(),
        "held on degraded {:.1}s after the cache recovered",
        (timeline.start.elapsed() - fine).as_secs_f64()
    );
    let metrics = reqwest::get(format!("{}/metrics", lp.controller))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.lines().any(|l| l.starts_with("stanch_flap_pinned{")
            && l.contains("qwen-72b")
            && l.ends_with(" 1")),
        "stanch_flap_pinned says so"
    );
    assert_eq!(
        load.failed.load(Ordering::Relaxed),
        0,
        "callers never saw an error"
    );
}

/// The time-to-heal benchmark (docs/benchmarks.md): scrape and evaluation every 1 s,
/// `for: 0s`, `group_wait: 0s`. Prints the split; asserts only that healing happened.
/// Run: `cargo test -p stanch --test it time_to_heal -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a benchmark: prints numbers"]
async fn time_to_heal() {
    use stanch_api::Timestamp;
    use stanch_ports::clock::Clock;
    // 1 s scrapes: a 3 s rate window holds 3 to 4 samples, as the rules' 1m window does at
    // a 15 s scrape interval.
    let zero_for = with_every_for_at_zero(&fast_rules().replace("[5s]", "[3s]"));
    let mut rows = Vec::new();
    // Three runs with gateways as shipped (their own blocks are evidence too), three with
    // passive blocking off (the failure-ratio rule alone).
    let setups = [BLOCKING; 3]
        .into_iter()
        .chain(["{consecutive_failures: 0}"; 3]);
    for (run, blocking) in setups.enumerate() {
        let lp = closed_loop_with(zero_for.clone(), blocking).await;
        let gateways = lp.following().await;
        let _load = traffic(&lp.gateways, Arc::new(Timeline::new()));
        // A full rate window of traffic, as in steady state.
        lp.scraped(4).await;
        set_fault(&lp.mocks[0].1, json!({"kind": "status", "status": 503}));
        let fault = SystemClock.now();
        // Polled every millisecond: this is what propagation is measured with.
        let mut healed = None;
        for i in 0..30_000 {
            if gateways
                .iter()
                .all(|g| rung(g, "qwen-72b").is_some_and(|(r, _, _)| r == "failover"))
            {
                healed = Some(i);
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let applied = SystemClock.now();
        assert!(healed.is_some(), "run {run}: healed");
        let alerts: Value = reqwest::get(format!("{}/api/v1/alerts", lp.prometheus))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        // Whichever failover alert came first: the failure ratio (StanchPoolFailing) or
        // the gateways' own blocks (StanchPoolBlocked).
        let (active_at, alertname) = alerts["data"]["alerts"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|a| {
                a["labels"]["action"] == "trigger-failover" && a["labels"]["pool"] == "dc-a"
            })
            .filter_map(|a| {
                let at = Timestamp::parse_rfc3339(a["activeAt"].as_str()?).ok()?;
                Some((at, a["labels"]["alertname"].as_str()?.to_owned()))
            })
            .min()
            .expect("Prometheus lists the alert");
        let history: Vec<Value> = lp.history("limit=1000").await;
        let at = |kind: &str, text: &str| {
            history
                .iter()
                .find(|e| e["kind"] == kind && e["summary"].as_str().unwrap_or("").contains(text))
                .and_then(|e| Timestamp::parse_rfc3339(e["at"].as_str()?).ok())
                .expect(kind)
        };
        let received = at("alert_active", &alertname);
        let decided = at("transition", "normal -> failover");
        let ms = |a: Timestamp, b: Timestamp| b.as_millis() - a.as_millis();
        rows.push((
            alertname,
            ms(fault, active_at),
            ms(active_at, received),
            ms(received, decided),
            ms(decided, applied),
            ms(fault, applied),
            ms(received, applied),
        ));
    }
    eprintln!(
        "time to heal (ms): detection (fault → Prometheus alert active), notification (→ stanch received), decision (→ published), propagation (→ both gateways applied), total; stanch's own part (received → both applied)"
    );
    for (alert, d, n, dec, p, total, own) in &rows {
        eprintln!(
            "  detection {d:>5}  notification {n:>5}  decision {dec:>3}  propagation {p:>4}  total {total:>5}  stanch {own:>4}  ({alert})"
        );
    }
}

/// The rules with every `for:` at 0s.
fn with_every_for_at_zero(rules: &str) -> String {
    rules
        .lines()
        .map(|l| {
            if l.trim_start().starts_with("for: ") {
                format!("{}for: 0s", &l[..l.len() - l.trim_start().len()])
            } else {
                l.to_owned()
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Only gw-1 carries traffic, so only gw-1 sees dc-a's endpoint fail; both replicas
/// report outcomes to the controller, which blocks the endpoint for the fleet: gw-2 gets
/// the block without ever having sent the endpoint a request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_one_replica_saw_failing_is_blocked_on_both() {
    let lp = closed_loop().await;
    let timeline = Arc::new(Timeline::new());
    let gateways = lp.following().await;
    for (i, g) in gateways.iter().enumerate() {
        let id = format!("gw-{}", i + 1);
        let token = Some(secrecy::SecretString::from(INGEST.to_owned()));
        tokio::spawn(stanch_gateway::report_loop(
            g.clone(),
            lp.controller.clone(),
            token,
            id,
            Duration::from_millis(500),
        ));
    }
    // Traffic through gw-1 only.
    let only_gw1 = vec![lp.gateways[0].clone(), lp.gateways[0].clone()];
    let load = traffic(&only_gw1, timeline.clone());
    tokio::time::sleep(Duration::from_secs(1)).await;
    let bad = lp.mocks[0].0.clone();
    set_fault(&lp.mocks[0].1, json!({"kind": "status", "status": 503}));
    let fault = timeline.mark(format!(
        "dc-a's endpoint {bad} starts answering 503; only gw-1 has traffic"
    ));
    let blocked_on = |g: &Gateway| {
        stanch_gateway::applied_table(g)
            .is_some_and(|t| t.blocked.iter().any(|b| b.endpoint == bad))
    };
    let both = until(Duration::from_secs(30), || {
        gateways.iter().all(|g| blocked_on(g))
    })
    .await;
    let at = timeline.mark("both gateways hold the block");
    for e in lp
        .history("limit=1000")
        .await
        .iter()
        .filter(|e| e["kind"] != "gateway_acked")
    {
        timeline.history(e);
    }
    timeline.print("an endpoint failing on one replica");
    assert!(both.is_some(), "the block reached both replicas");
    eprintln!(
        "fault → blocked on both replicas: {:.2}s",
        (at - fault).as_secs_f64()
    );
    let gw2: Value = reqwest::get(format!("{}/v1/status", lp.gateways[1].0))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let seen_by_gw2 = gw2["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["url"] == bad.as_str())
        .unwrap();
    assert_eq!(
        seen_by_gw2["failures"], 0,
        "gw-2 never saw the endpoint fail"
    );
    assert!(
        !seen_by_gw2["table_blocked_until"].is_null(),
        "yet it holds the block"
    );
    assert_eq!(
        load.failed.load(Ordering::Relaxed),
        0,
        "callers never saw the failure"
    );
}

/// Every expression of the Grafana dashboard the chart ships
/// (`charts/stanch/files/dashboard.json`) returns data from a real Prometheus scraping
/// the controller and the gateways through an incident (a datacenter failing over, an
/// endpoint blocked by hand), with the rules of `rules/` loaded; and every metric it
/// names is one Prometheus has seen (its metadata) or a recording rule it evaluates, so
/// no panel is empty because of a typo, including those that fall back to 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_query_returns_data_in_an_incident() {
    let dashboard: Value =
        serde_json::from_str(include_str!("../../charts/stanch/files/dashboard.json")).unwrap();
    let mut exprs: Vec<(String, String)> = vec![];
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            exprs.push((
                panel["title"].as_str().unwrap().to_owned(),
                target["expr"].as_str().unwrap().to_owned(),
            ));
        }
    }
    assert!(exprs.len() >= 20, "{} expressions", exprs.len());
    let variable = dashboard["templating"]["list"][1]["query"]["query"]
        .as_str()
        .unwrap()
        .to_owned();

    let lp = closed_loop().await;
    let timeline = Arc::new(Timeline::new());
    let _load = traffic(&lp.gateways, timeline.clone());
    let gateways = lp.following().await;
    lp.scraped(3).await;
    set_fault(&lp.mocks[0].1, json!({"kind": "status", "status": 503}));
    until(Duration::from_secs(45), || {
        gateways
            .iter()
            .all(|g| rung(g, "qwen-72b").is_some_and(|(r, _, _)| r == "failover"))
    })
    .await
    .expect("the incident: qwen-72b fails over");
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let blocked = http
        .post(format!("{}/v1/admin/block", lp.controller))
        .json(&json!({"endpoint": "10.9.9.9:8000", "reason": "dashboard test", "ttl": "10m"}))
        .send()
        .await
        .unwrap();
    assert!(blocked.status().is_success(), "{:?}", blocked.text().await);
    // The decisions and the block scraped a few times over.
    tokio::time::sleep(Duration::from_secs(4)).await;

    let query = |q: String| {
        let http = http.clone();
        let url = format!("{}/api/v1/query", lp.prometheus);
        async move {
            let v: Value = http
                .get(url)
                .query(&[("query", q.as_str())])
                .fetch_json()
                .await;
            v
        }
    };
    // The model variable lists the models.
    let label = variable
        .strip_prefix("label_values(")
        .and_then(|v| v.strip_suffix(", model)"))
        .expect("label_values(metric, model)");
    let models = query(format!("count by (model) ({label})")).await;
    assert!(
        models["data"]["result"].as_array().unwrap().len() >= 2,
        "{models}"
    );

    let api = |path: &'static str| {
        let request = http.get(format!("{}/api/v1/{path}", lp.prometheus));
        async move { request.fetch_json::<Value>().await }
    };
    let metadata = api("metadata").await;
    let known: BTreeSet<String> = metadata["data"]
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    let rules = api("rules").await;
    let recorded: BTreeSet<String> = rules["data"]["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap())
        .filter(|r| r["type"] == "recording")
        .map(|r| r["name"].as_str().unwrap().to_owned())
        .collect();
    let names = regex::Regex::new(r"stanch[a-z0-9_:]*").unwrap();
    let mut empty = vec![];
    for (title, expr) in &exprs {
        for name in names.find_iter(expr).map(|m| m.as_str()) {
            let family = ["_total", "_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .unwrap_or(name);
            assert!(
                known.contains(name) || known.contains(family) || recorded.contains(name),
                "{title}: {name} is no metric Prometheus has seen nor a recording rule"
            );
        }
        let q = expr
            .replace("$__rate_interval", "1m")
            .replace("$model", ".*");
        let v = query(q.clone()).await;
        assert_eq!(v["status"], "success", "{title}: {q}: {v}");
        if v["data"]["result"].as_array().is_none_or(|r| r.is_empty()) {
            empty.push(format!("{title}: {q}"));
        }
    }
    assert!(
        empty.is_empty(),
        "panels without data:\n{}",
        empty.join("\n")
    );
}
