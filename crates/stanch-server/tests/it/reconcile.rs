//! Against a real Alertmanager (Debian's `prometheus-alertmanager`, installed by
//! `scripts/install-test-deps.sh`): its webhook reaches stanch with bearer auth, and
//! reconciliation repairs what lost notifications left out.

use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};
use stanch_api::HumanDuration;
use stanch_server::config::{AlertmanagerConfig, ServerConfig};
use stanch_testkit::net::free_port;
use stanch_testkit::process::{Running, program};
use stanch_testkit::wait::until;

use crate::support::*;

struct Alertmanager {
    _child: Running,
    url: String,
    _dir: tempfile::TempDir,
}

impl Alertmanager {
    /// Starts Alertmanager on `port`, sending receiver `stanch` to `webhook` with the ingest token.
    async fn start(port: u16, webhook: &str) -> Alertmanager {
        let dir = tempfile::tempdir().unwrap();
        let config = format!(
            r#"route:
  receiver: stanch
  group_wait: 0s
  group_interval: 1s
  repeat_interval: 1h
  group_by: ['alertname', 'target_model']
receivers:
  - name: stanch
    webhook_configs:
      - url: '{webhook}'
        send_resolved: true
        max_alerts: 0
        http_config:
          authorization: {{type: Bearer, credentials: {INGEST}}}
"#
        );
        std::fs::write(dir.path().join("am.yml"), config).unwrap();
        let child = Running::spawn(
            Command::new(program(&["prometheus-alertmanager", "alertmanager"]))
                .arg(format!(
                    "--config.file={}",
                    dir.path().join("am.yml").display()
                ))
                .arg(format!(
                    "--storage.path={}",
                    dir.path().join("data").display()
                ))
                .arg(format!("--web.listen-address=127.0.0.1:{port}"))
                .arg("--cluster.listen-address=")
                .stdout(Stdio::null())
                .stderr(Stdio::null()),
        );
        let am = Alertmanager {
            _child: child,
            url: format!("http://127.0.0.1:{port}"),
            _dir: dir,
        };
        stanch_testkit::http::ready(&format!("{}/-/ready", am.url), Duration::from_secs(10)).await;
        am
    }

    async fn post(&self, alerts: Value) {
        let http = reqwest::Client::builder().no_proxy().build().unwrap();
        let r = http
            .post(format!("{}/api/v2/alerts", self.url))
            .json(&alerts)
            .send()
            .await
            .unwrap();
        assert!(
            r.status().is_success(),
            "Alertmanager refused the alerts: {}",
            r.status()
        );
    }
}

fn failover_alert(ends: Option<&str>) -> Value {
    let mut a = json!({
        "labels": {"alertname": "LLMModelHighFailureRate", "action": "trigger-failover",
                   "target_model": "qwen-72b", "pool": "dc-a"},
        "annotations": {"summary": "dc-a failing"},
        "startsAt": ago(60),
    });
    if let Some(e) = ends {
        a["endsAt"] = json!(e);
    }
    json!([a])
}

fn ago(secs: u64) -> String {
    let now = std::time::SystemTime::UNIX_EPOCH
        .elapsed()
        .unwrap()
        .as_secs()
        - secs;
    stanch_api::Timestamp::from_millis(now as i64 * 1000).to_string()
}

#[tokio::test]
async fn alertmanager_webhooks_reach_stanch() {
    let h = Harness::start().await;
    let am = Alertmanager::start(free_port(), &h.url("/v1/alerts/alertmanager")).await;
    am.post(failover_alert(None)).await;
    until("qwen-72b failed over", Duration::from_secs(5), || async {
        h.routes().await["models"]["qwen-72b"]["rung"] == "failover"
    })
    .await;
    am.post(failover_alert(Some(&ago(1)))).await;
    until("no alert active", Duration::from_secs(5), || async {
        h.json("/v1/status").await["alerts"]["active"] == 0
    })
    .await;
}

#[tokio::test]
async fn reconciliation_repairs_lost_notifications() {
    // Alertmanager's notifications go nowhere: every one of them is lost.
    let port = free_port();
    let server = ServerConfig {
        alertmanager: Some(AlertmanagerConfig {
            url: format!("http://127.0.0.1:{port}"),
            receiver: "stanch".into(),
            interval: HumanDuration::secs(3600),
            token_file: None,
        }),
        ..ServerConfig::default()
    };
    let h = Harness::with(Options {
        server,
        ..Options::default()
    })
    .await;
    let am = Alertmanager::start(port, "http://127.0.0.1:9/lost").await;

    am.post(failover_alert(None)).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        h.routes().await["models"]["qwen-72b"]["rung"],
        "normal",
        "nothing arrived"
    );

    // A notification saying Alertmanager truncated it makes stanch ask for the full list.
    let truncated = json!({"version": "4", "status": "firing", "alerts": [], "truncatedAlerts": 1});
    assert_eq!(h.webhook(truncated.to_string()).await.status(), 200);
    until("qwen-72b failed over", Duration::from_secs(5), || async {
        h.routes().await["models"]["qwen-72b"]["rung"] == "failover"
    })
    .await;

    // The resolution is lost too; the next reconciliation applies it.
    am.post(failover_alert(Some(&ago(1)))).await;
    h.clock.advance(Duration::from_secs(1));
    assert_eq!(h.webhook(truncated.to_string()).await.status(), 200);
    until("no alert active", Duration::from_secs(5), || async {
        h.json("/v1/status").await["alerts"]["active"] == 0
    })
    .await;
    let history: Vec<Value> = h.get("/v1/history", Some(READ)).await.json().await.unwrap();
    assert!(history.iter().any(|e| {
        e["summary"]
            .as_str()
            .unwrap()
            .contains("Alertmanager no longer lists it")
    }));
    let metrics = h.get("/metrics", None).await.text().await.unwrap();
    assert!(
        metrics.contains(r#"stanch_reconciliations_total{kind="ok"}"#),
        "{metrics}"
    );
}
