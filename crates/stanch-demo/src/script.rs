//! The outage: dc-a fails at 6 s, qwen-72b's KV cache saturates in dc-b at 22 s,
//! everything recovers at 38 s. With no Prometheus, the demo sends stanch the alerts
//! Alertmanager would.

use serde_json::{Value, json};
use stanch_mock::Mock;
use stanch_ports::clock::{Clock, SystemClock};

use crate::stage::Stage;

/// Where the outage is, and how to move it on.
pub(crate) struct Script {
    step: u8,
    /// Whether the demo sends the alerts itself.
    simulated: bool,
    http: reqwest::Client,
    stanch: String,
    /// qwen-72b in dc-a, whose server fails.
    dc_a: Mock,
    /// qwen-72b in dc-b's admin URL, whose KV cache fills.
    dc_b: String,
    started_at: String,
}

impl Script {
    pub(crate) fn new(stage: &Stage, http: reqwest::Client, simulated: bool) -> Script {
        Script {
            step: 0,
            simulated,
            http,
            stanch: stage.stanch.clone(),
            dc_a: stage.mocks[0].1.clone(),
            dc_b: stage.mocks[1].0.clone(),
            started_at: SystemClock.now().to_string(),
        }
    }

    /// Takes the next step if its time `t` (seconds since the start) has come.
    pub(crate) async fn advance(&mut self, t: u64) -> anyhow::Result<()> {
        match self.step {
            0 if t >= 6 => self.dc_a_fails().await?,
            1 if t >= 22 => self.kv_cache_saturates().await?,
            2 if t >= 38 => self.recovery().await?,
            _ => return Ok(()),
        }
        self.step += 1;
        Ok(())
    }

    async fn dc_a_fails(&self) -> anyhow::Result<()> {
        println!("\n>>> datacenter dc-a starts failing: its model server answers 503");
        fault(&self.dc_a, json!({"kind": "status", "status": 503}));
        if self.simulated {
            println!(
                ">>> (Alertmanager would now send stanch the StanchPoolFailing alert; the demo sends it)"
            );
            self.alert("firing", failover()).await?;
        } else {
            println!(
                ">>> (Prometheus will see it in the gateway's metrics within seconds; Alertmanager tells stanch)"
            );
        }
        Ok(())
    }

    async fn kv_cache_saturates(&self) -> anyhow::Result<()> {
        println!("\n>>> qwen-72b's KV cache saturates in dc-b (vllm:gpu_cache_usage_perc 0.98)");
        self.kv_cache(0.98).await;
        if self.simulated {
            self.alert("firing", saturated()).await?;
        }
        Ok(())
    }

    async fn recovery(&self) -> anyhow::Result<()> {
        println!("\n>>> recovery: dc-a answers again, the KV cache drains; the alerts resolve");
        fault(&self.dc_a, json!({"kind": "none"}));
        self.kv_cache(0.4).await;
        if self.simulated {
            self.alert("resolved", failover()).await?;
            self.alert("resolved", saturated()).await?;
        }
        println!(">>> stanch steps down one rung at a time, after each stabilization window");
        Ok(())
    }

    async fn kv_cache(&self, value: f64) {
        let url = format!("{}/admin/kv-cache", self.dc_b);
        let body = json!({ "value": value }).to_string();
        let _ = self.http.put(url).body(body).send().await;
    }

    /// Sends stanch one alert as Alertmanager's webhook would.
    async fn alert(&self, status: &str, labels: Value) -> anyhow::Result<()> {
        let ends = if status == "firing" {
            "0001-01-01T00:00:00Z".to_owned()
        } else {
            SystemClock.now().to_string()
        };
        let body = json!({"version": "4", "status": status, "receiver": "stanch",
            "alerts": [{"status": status, "labels": labels, "annotations": {},
                        "startsAt": self.started_at, "endsAt": ends}]});
        let url = format!("{}/v1/alerts/alertmanager", self.stanch);
        self.http.post(url).json(&body).send().await?;
        Ok(())
    }
}

fn failover() -> Value {
    json!({"alertname": "StanchPoolFailing", "action": "trigger-failover", "target_model": "qwen-72b", "pool": "dc-a", "severity": "critical"})
}

fn saturated() -> Value {
    json!({"alertname": "StanchKVCacheSaturated", "action": "trigger-model-degradation", "target_model": "qwen-72b", "severity": "warning"})
}

fn fault(mock: &Mock, spec: Value) {
    mock.set_fault(serde_json::from_value(spec).expect("a fault the mock knows"));
}
