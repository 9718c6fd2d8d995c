//! The real process: `kill -9` mid-incident, `stanch ctl`, and TLS.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;
use stanch_testkit::http::blocking::ready_within;
use stanch_testkit::process::Running;

const FIXTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/crates/stanch-server/tests/fixtures/alertmanager-v4-firing-failover.json"
);

pub(crate) struct Server {
    pub(crate) child: Running,
    pub(crate) base: String,
}

impl Server {
    pub(crate) fn start(data: &Path, extra: &[&str], scheme: &str) -> Server {
        Server::start_logging(data, extra, scheme, "warn", Stdio::null())
    }

    /// Starts with `RUST_LOG=filter`, standard error to `log`.
    fn start_logging(
        data: &Path,
        extra: &[&str],
        scheme: &str,
        filter: &str,
        log: impl Into<Stdio>,
    ) -> Server {
        Server::start_with(data, extra, scheme, filter, log, ["adm", "ing", "rd"])
    }

    /// Starts with these admin, ingest and read tokens.
    pub(crate) fn start_with(
        data: &Path,
        extra: &[&str],
        scheme: &str,
        filter: &str,
        log: impl Into<Stdio>,
        [admin, ingest, read]: [&str; 3],
    ) -> Server {
        let port = stanch_testkit::net::free_port();
        let child = Running::spawn(
            Command::new(env!("CARGO_BIN_EXE_stanch"))
                .args([
                    "serve",
                    "--listen",
                    &format!("127.0.0.1:{port}"),
                    "--data-dir",
                ])
                .arg(data)
                .args(extra)
                .env("STANCH_ADMIN_TOKEN", admin)
                .env("STANCH_INGEST_TOKEN", ingest)
                .env("STANCH_READ_TOKEN", read)
                .env("RUST_LOG", filter)
                .stdout(Stdio::null())
                .stderr(log),
        );
        let server = Server {
            child,
            base: format!("{scheme}://127.0.0.1:{port}"),
        };
        let ready = format!("{}/readyz", server.base);
        assert!(
            ready_within(&client(), &ready, Duration::from_secs(5)),
            "stanch did not become ready"
        );
        server
    }

    /// Starts serving TLS only, with a fresh self-signed certificate for `localhost`
    /// and 127.0.0.1 written under `dir`; returns the server and the certificate's path
    /// (what a client trusts).
    pub(crate) fn start_tls(dir: &Path) -> (Server, PathBuf) {
        let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
        let made = Command::new("openssl")
            .args([
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "1",
                "-subj",
                "/CN=localhost",
                // A server certificate, trusted as itself: named for the address, not a CA.
                "-addext",
                "subjectAltName=DNS:localhost,IP:127.0.0.1",
                "-addext",
                "basicConstraints=critical,CA:FALSE",
            ])
            .arg("-keyout")
            .arg(&key)
            .arg("-out")
            .arg(&cert)
            .stderr(Stdio::null())
            .status()
            .expect("openssl is installed by scripts/install-test-deps.sh");
        assert!(made.success());
        let server = Server::start(
            &dir.join("data"),
            &[
                "--tls-cert",
                cert.to_str().unwrap(),
                "--tls-key",
                key.to_str().unwrap(),
            ],
            "https",
        );
        (server, cert)
    }

    /// Sends Alertmanager's webhook for a failover of the 72B model (the fixture);
    /// returns the version it published.
    pub(crate) fn fail_over(&self) -> u64 {
        let r = client()
            .post(format!("{}/v1/alerts/alertmanager", self.base))
            .bearer_auth("ing")
            .body(std::fs::read(FIXTURE).unwrap())
            .send()
            .unwrap();
        assert_eq!(r.status(), 200);
        r.json::<Value>().unwrap()["version"].as_u64().unwrap()
    }

    pub(crate) fn routes(&self) -> Value {
        client()
            .get(format!("{}/v1/routes", self.base))
            .bearer_auth("rd")
            .send()
            .unwrap()
            .json()
            .unwrap()
    }

    /// `/metrics`, as text.
    pub(crate) fn metrics(&self) -> String {
        client()
            .get(format!("{}/metrics", self.base))
            .bearer_auth("rd")
            .send()
            .unwrap()
            .text()
            .unwrap()
    }

    pub(crate) fn status(&self) -> Value {
        client()
            .get(format!("{}/v1/status", self.base))
            .bearer_auth("rd")
            .send()
            .unwrap()
            .json()
            .unwrap()
    }

    fn ctl(&self, args: &[&str]) -> std::process::Output {
        Command::new(env!("CARGO_BIN_EXE_stanch"))
            .arg("ctl")
            .args(["--server", &self.base])
            .args(args)
            .output()
            .unwrap()
    }
}

pub(crate) fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .no_proxy()
        .danger_accept_invalid_certs(true)
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

/// `stanch ctl watch` prints each version as it arrives, over each transport, and
/// `stanch ctl status` then shows each watcher with its transport and what it applied.
#[test]
fn ctl_watch_follows_over_every_transport_and_status_shows_the_watchers() {
    let data = tempfile::tempdir().unwrap();
    let server = Server::start(data.path(), &[], "http");
    let version = server.routes()["version"].as_u64().unwrap();
    for transport in ["grpc", "sse", "long-poll"] {
        let out = server.ctl(&[
            "--token",
            "rd",
            "watch",
            "--transport",
            transport,
            "--id",
            &format!("ctl-{transport}"),
            "--count",
            "1",
        ]);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{transport}: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            text.contains(&format!("version {version} "))
                && text.contains(&format!("via {transport}:")),
            "{transport}: {text}"
        );
    }
    let out = server.ctl(&["--token", "rd", "status"]);
    let text = String::from_utf8_lossy(&out.stdout);
    let header = text
        .lines()
        .find(|l| l.starts_with("GATEWAY"))
        .unwrap_or_else(|| panic!("{text}"));
    for column in [
        "TRANSPORT",
        "APPLIED",
        "LAG",
        "STATE",
        "LAST SEEN",
        "LAST NACK",
    ] {
        assert!(header.contains(column), "{header}");
    }
    // gRPC acknowledges before the next message is read, so that watcher has
    // applied the version; the others say so on their next request.
    let grpc = text
        .lines()
        .find(|l| l.starts_with("ctl-grpc "))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(grpc.contains(" grpc "), "{grpc}");
    let sse = text
        .lines()
        .find(|l| l.starts_with("ctl-sse "))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(sse.contains(" sse "), "{sse}");
}

#[test]
fn kill_9_mid_incident_resumes_the_same_state() {
    let data = tempfile::tempdir().unwrap();
    let mut first = Server::start(data.path(), &[], "http");
    first.fail_over();
    let out = first.ctl(&[
        "--token", "adm", "force", "qwen-14b", "static", "--ttl", "1h", "--reason", "drill",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let before = first.routes();

    first.child.kill().unwrap(); // SIGKILL: no chance to save anything on the way out.
    first.child.wait().unwrap();

    let second = Server::start(data.path(), &[], "http");
    let after = second.routes();
    assert_eq!(after["epoch"], before["epoch"]);
    assert_eq!(after["version"], before["version"]);
    assert_eq!(after["models"], before["models"]);
    assert_eq!(after["models"]["qwen-72b"]["rung"], "failover");
    assert_eq!(after["models"]["qwen-14b"]["rung"], "static");
}

/// Alert labels and an operator's reason carrying a newline, NUL and a terminal escape
/// reach the text log as escaped text on the line of their event: nothing from
/// outside can write a line of its own.
#[test]
fn values_from_outside_cannot_forge_log_lines() {
    let data = tempfile::tempdir().unwrap();
    let log_path = data.path().join("stanch.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let server = Server::start_logging(&data.path().join("data"), &[], "http", "info", log);
    let forged = "x\n2026-11-30T00:00:00.000000Z ERROR stanch: FAKE INJECTED LINE\u{0}\u{1b}[31m";
    let body = serde_json::json!({"version": "4", "status": "firing", "receiver": "stanch",
        "alerts": [{"status": "firing", "startsAt": "2026-11-30T00:00:00Z", "endsAt": "0001-01-01T00:00:00Z",
            "labels": {"alertname": forged, "action": "trigger-failover", "target_model": "qwen-72b"}},
            {"status": "bogus", "labels": {"alertname": forged}}]});
    let r = client()
        .post(format!("{}/v1/alerts/alertmanager", server.base))
        .bearer_auth("ing")
        .json(&body)
        .send()
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = client()
        .post(format!("{}/v1/admin/freeze", server.base))
        .bearer_auth("adm")
        .json(&serde_json::json!({"model": "qwen-72b", "reason": forged}))
        .send()
        .unwrap();
    assert_eq!(r.status(), 200);
    // Stopped as an operator stops it: the buffered log is written out on the way.
    let mut server = server;
    let stopped = Command::new("kill")
        .args(["-TERM", &server.child.id().to_string()])
        .status()
        .unwrap();
    assert!(stopped.success());
    assert!(server.child.wait().unwrap().success(), "a clean stop");
    let text = std::fs::read_to_string(&log_path).unwrap();
    assert!(
        text.contains("FAKE INJECTED LINE"),
        "the value was logged:\n{text}"
    );
    for line in text.lines() {
        assert!(
            line.starts_with("20") && line.as_bytes().get(4) == Some(&b'-'),
            "every line is an event's own line: {line:?}\n{text}"
        );
        assert!(!line.contains('\0') && !line.contains('\u{1b}'), "{line:?}");
    }
}

#[test]
fn ctl_shows_tables_json_and_errors() {
    let data = tempfile::tempdir().unwrap();
    let server = Server::start(data.path(), &[], "http");
    let out = server.ctl(&["--token", "rd", "status"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("MODEL") && text.contains("qwen-72b") && text.contains("normal"),
        "{text}"
    );

    let out = server.ctl(&[
        "--token", "adm", "--output", "json", "freeze", "--model", "qwen-72b", "--reason", "look",
    ]);
    assert!(out.status.success());
    let answer: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(answer["changed"], true);

    let out = server.ctl(&["--token", "rd", "unblock-all", "--reason", "x"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("401"),
        "a read token cannot override"
    );

    let out = server.ctl(&[
        "--token", "adm", "force", "ghost", "static", "--reason", "x",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("model: \"ghost\" is not configured"));

    let out = server.ctl(&["--token", "rd", "history"]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("frozen"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// `stanch ctl status` shows what the status page shows, from the same report: the
/// alert behind a rung with its labels, when the model steps down, where a block came
/// from; and `--output json` is that report itself.
#[test]
fn ctl_status_shows_why_what_next_and_where_blocks_came_from() {
    let data = tempfile::tempdir().unwrap();
    let server = Server::start(data.path(), &[], "http");
    let http = client();
    let webhook = |fixture: &str| {
        let r = http
            .post(format!("{}/v1/alerts/alertmanager", server.base))
            .bearer_auth("ing")
            .body(std::fs::read(fixture).unwrap())
            .send()
            .unwrap();
        assert_eq!(r.status(), 200);
    };
    let status = || {
        let out = server.ctl(&["--token", "rd", "status"]);
        assert!(out.status.success());
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    webhook(FIXTURE);
    let text = status();
    let line = |prefix: &str| {
        text.lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("a line for {prefix}: {text}"))
            .to_owned()
    };
    assert!(text.contains("STEPS DOWN"), "{text}");
    let condition = line("qwen-72b  LLMModelHighFailureRate");
    assert!(condition.contains("pool dc-a failing"), "{condition}");
    assert!(condition.contains(r#"pool="dc-a""#), "{condition}");

    webhook(&FIXTURE.replace("firing", "resolved"));
    let out = server.ctl(&[
        "--token",
        "adm",
        "block",
        "10.0.0.7:8000",
        "--ttl",
        "1h",
        "--reason",
        "bad GPU",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = status();
    let model = text
        .lines()
        .find(|l| l.starts_with("qwen-72b ") && l.contains("failover"))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(model.contains("normal in "), "when it steps down: {model}");
    let block = text
        .lines()
        .find(|l| l.starts_with("10.0.0.7:8000"))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(
        block.contains("operator") && block.contains("bad GPU"),
        "{block}"
    );

    let out = server.ctl(&["--token", "rd", "--output", "json", "status"]);
    let json: Value = serde_json::from_slice(&out.stdout).unwrap();
    let api = server.status();
    // The same facts (what counts down aside): the report itself.
    let facts = |r: &Value| {
        let mut blocked = r["blocked"].clone();
        blocked[0]["seconds_left"] = Value::Null;
        let m = &r["models"]["qwen-72b"];
        (m["conditions"].clone(), m["step_down"].clone(), blocked)
    };
    assert_eq!(facts(&json), facts(&api));
    assert_eq!(json["blocked"][0]["source"], "operator");
}

/// What `stanch ctl` prints of values from outside (an alert's name and labels, the
/// endpoint a `block-endpoint` alert names, an operator's reason) stays text on the
/// line it belongs to: no forged line, no terminal control, in every view.
#[test]
fn ctl_prints_values_from_outside_as_text() {
    let data = tempfile::tempdir().unwrap();
    let server = Server::start(data.path(), &[], "http");
    let forged = "x\nFAKE LINE\r\u{1b}[2J\u{0}";
    let body = serde_json::json!({"version": "4", "status": "firing", "receiver": "stanch",
        "alerts": [
            {"status": "firing", "startsAt": "2026-11-30T00:00:00Z", "endsAt": "0001-01-01T00:00:00Z",
             "labels": {"alertname": forged, "note": forged, "action": "trigger-failover", "target_model": "qwen-72b"}},
            {"status": "firing", "startsAt": "2026-11-30T00:00:00Z", "endsAt": "0001-01-01T00:00:00Z",
             "labels": {"alertname": "EndpointDown", "action": "block-endpoint", "endpoint": forged}}]});
    let r = client()
        .post(format!("{}/v1/alerts/alertmanager", server.base))
        .bearer_auth("ing")
        .json(&body)
        .send()
        .unwrap();
    assert_eq!(r.status(), 200);
    // An argument cannot hold a NUL; the rest of it can.
    let typed = forged.trim_end_matches('\u{0}');
    let out = server.ctl(&["--token", "adm", "dry-run", "on", "--reason", typed]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut seen = 0;
    for view in [
        &["status"][..],
        &["history"],
        &["routes"],
        &["unblock-all", "--reason", typed],
    ] {
        let token = if view[0] == "unblock-all" {
            "adm"
        } else {
            "rd"
        };
        let out = server.ctl(&[&["--token", token][..], view].concat());
        assert!(
            out.status.success(),
            "{view:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8(out.stdout).unwrap();
        for line in text.lines() {
            assert!(
                !line.starts_with("FAKE"),
                "{view:?}: a forged line:\n{text}"
            );
            assert!(
                !line.chars().any(char::is_control),
                "{view:?}: a control character in {line:?}"
            );
        }
        seen += text.matches(r"x\nFAKE LINE\r\u{1b}[2J").count();
    }
    assert!(seen >= 4, "the values are shown, escaped ({seen} times)");
}

#[test]
fn serves_tls_when_given_a_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let (server, cert) = Server::start_tls(dir.path());
    assert_eq!(server.routes()["models"]["qwen-72b"]["rung"], "normal");
    let plain = server.base.replace("https://", "http://");
    assert!(
        client().get(format!("{plain}/healthz")).send().is_err(),
        "plain HTTP is not served"
    );

    // The gRPC watch, on the same port and certificate (h2 by ALPN), trusting it.
    let table = first_grpc_table(&server.base, "rd", Some(std::fs::read(&cert).unwrap()));
    assert_eq!(serde_json::to_value(&table).unwrap(), server.routes());
}

/// The first table a gRPC watch of `base` gets, as a gateway receives it
/// (`stanch-client`), trusting `ca_pem` for `https`.
pub(crate) fn first_grpc_table(
    base: &str,
    token: &str,
    ca_pem: Option<Vec<u8>>,
) -> stanch_api::RouteTable {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let mut config = stanch_client::WatchConfig::new(base, "gw-test");
        config.transport = stanch_client::Transport::Grpc;
        config.token = Some(token.into());
        config.ca_pem = ca_pem;
        let (mut routes, task) = stanch_client::start(config, None);
        let table = tokio::time::timeout(Duration::from_secs(10), routes.changed_from(0))
            .await
            .expect("a table over gRPC within 10 s")
            .unwrap();
        task.abort();
        (*table).clone()
    })
}

/// Runs `stanch demo` with `args`; returns what it printed, having checked
/// it succeeded and that no caller saw an error in any second it reported.
fn demo(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_stanch"))
        .arg("demo")
        .args(args)
        .env("RUST_LOG", "error")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let seconds: Vec<&str> = text.lines().filter(|l| l.starts_with('[')).collect();
    assert!(!seconds.is_empty(), "a line a second:\n{text}");
    assert!(
        seconds.iter().all(|l| l.contains(" 0 errors")),
        "callers saw no errors:\n{text}"
    );
    text
}

#[test]
#[cfg_attr(
    not(feature = "demo"),
    ignore = "needs `--features demo` (scripts/test.sh builds it)"
)]
fn the_demo_heals_a_datacenter_failure_and_cleans_up() {
    let text = demo(&["--seconds", "9", "--simulate-alerts"]);
    assert!(
        text.contains(">>> datacenter dc-a starts failing"),
        "{text}"
    );
    assert!(
        text.contains("stanch decided: qwen-72b: normal -> failover (pool dc-b)"),
        "{text}"
    );
    assert!(
        text.contains("the demo sends stanch the alerts Alertmanager would send"),
        "says what it simulates"
    );
    let seconds = text.lines().filter(|l| l.starts_with('[')).count();
    assert!(seconds >= 8, "a line a second:\n{text}");
    assert!(text.contains("done: every demo process stopped"));
}

#[test]
#[cfg_attr(
    not(feature = "demo"),
    ignore = "needs `--features demo` (scripts/test.sh builds it)"
)]
fn the_demo_uses_real_prometheus_and_alertmanager_when_installed() {
    let text = demo(&["--seconds", "22"]);
    assert!(
        text.contains("and Alertmanager: running stanch's rules"),
        "the test command installs both:\n{text}"
    );
    assert!(
        text.contains(
            "stanch decided: qwen-72b: normal -> failover (pool dc-b) escalated: pool dc-a failing"
        ),
        "a real alert moved the route:\n{text}"
    );
}
