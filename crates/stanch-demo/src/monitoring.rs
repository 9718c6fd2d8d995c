//! Prometheus and Alertmanager, when installed, running stanch's own rules on the
//! demo's time scale.

use std::time::Duration;

/// Prometheus and Alertmanager, started for the demo and stopped with it.
pub(crate) struct Monitoring {
    children: Vec<std::process::Child>,
    _dir: tempfile::TempDir,
    pub(crate) prometheus: String,
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
    pub(crate) async fn start(
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
        let rules: String = include_str!("../../../rules/stanch.rules.yml")
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
