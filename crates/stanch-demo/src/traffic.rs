//! The callers: 20 requests a second through the gateway, one in five from a VIP
//! tenant, each answer counted in the second it came back.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};

/// What callers got in the last second.
#[derive(Default)]
pub(crate) struct Window {
    pub(crate) ok: u64,
    pub(crate) errors: u64,
    /// Answers per model that gave them.
    pub(crate) served: BTreeMap<String, u64>,
    pub(crate) degraded: u64,
    pub(crate) faq: u64,
}

/// Sends requests to `gateway` until aborted, counting answers in `window`.
pub(crate) fn callers(
    window: Arc<Mutex<Window>>,
    http: reqwest::Client,
    gateway: String,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        for i in 0..100_000u64 {
            let key = if i % 5 == 0 { "vip-key" } else { "acme-key" };
            let (window, http, url) = (
                window.clone(),
                http.clone(),
                format!("{gateway}/v1/chat/completions"),
            );
            tokio::spawn(async move {
                let answer = call(&http, &url, key).await;
                // Everything awaited first; the window is locked once, briefly.
                window.lock().expect("window lock").count(answer);
            });
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
}

/// One request: `Some((x-llm-degraded, the answering model))`, or `None` for an error.
async fn call(http: &reqwest::Client, url: &str, key: &str) -> Option<(Option<String>, String)> {
    let body = json!({"model": "qwen-72b", "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]});
    let r = http.post(url).bearer_auth(key).json(&body).send().await;
    match r {
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
    }
}

impl Window {
    fn count(&mut self, answer: Option<(Option<String>, String)>) {
        let Some((degraded, served)) = answer else {
            self.errors += 1;
            return;
        };
        self.ok += 1;
        match degraded.as_deref() {
            Some("static") => self.faq += 1,
            Some(_) => self.degraded += 1,
            None => {}
        }
        *self.served.entry(served).or_default() += 1;
    }
}
