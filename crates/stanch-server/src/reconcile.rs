//! Reconciliation against Alertmanager's API: alerts whose notification we missed are
//! added, and alerts whose resolution we missed are resolved. Runs every interval and
//! whenever a notification says Alertmanager truncated it.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use secrecy::{ExposeSecret, SecretString};
use stanch_api::alerts::parse_alertmanager_list;
use stanch_core::Input;
use tokio::sync::Notify;
use tracing::{Instrument, info, info_span, warn};

use crate::engine_task::EngineHandle;
use crate::metrics::{KindLabel, Metrics};
use stanch_ports::clock::Clock;

/// Why a reconciliation failed.
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    /// Alertmanager could not be reached or did not answer in time.
    #[error("cannot reach Alertmanager at {url}")]
    Request {
        /// The URL asked.
        url: String,
        /// The cause.
        #[source]
        source: reqwest::Error,
    },
    /// Alertmanager answered with an error status.
    #[error("Alertmanager answered {status} for {url}")]
    Status {
        /// The URL asked.
        url: String,
        /// The status.
        status: reqwest::StatusCode,
    },
    /// The answer was not a list of alerts.
    #[error("Alertmanager's answer is not an alert list: {0}")]
    Payload(String),
    /// The engine did not record the result.
    #[error(transparent)]
    Engine(#[from] crate::engine_task::EngineUnavailable),
}

impl ReconcileError {
    /// A stable label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            ReconcileError::Request { .. } => "unreachable",
            ReconcileError::Status { .. } => "bad_status",
            ReconcileError::Payload(_) => "bad_payload",
            ReconcileError::Engine(_) => "engine",
        }
    }
}

/// The reconciler.
pub struct Reconciler {
    client: reqwest::Client,
    base: String,
    receiver: String,
    token: Option<SecretString>,
    interval: Duration,
    engine: EngineHandle,
    clock: Arc<dyn Clock>,
    metrics: Arc<Metrics>,
    wake: Arc<Notify>,
}

/// Escapes a receiver name for Alertmanager's receiver regex filter.
fn regex_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    for c in s.chars() {
        if "\\.+*?()|[]{}^$".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

impl Reconciler {
    /// A reconciler for the Alertmanager at `base` (e.g. `http://am:9093`).
    #[expect(
        clippy::too_many_arguments,
        reason = "one constructor wiring every part"
    )]
    pub fn new(
        base: &str,
        receiver: &str,
        token: Option<SecretString>,
        interval: Duration,
        engine: EngineHandle,
        clock: Arc<dyn Clock>,
        metrics: Arc<Metrics>,
        wake: Arc<Notify>,
    ) -> Reconciler {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .connect_timeout(Duration::from_secs(3))
            .build()
            .expect("an HTTP client with default TLS builds");
        Reconciler {
            client,
            base: base.trim_end_matches('/').to_owned(),
            receiver: receiver.to_owned(),
            token,
            interval,
            engine,
            clock,
            metrics,
            wake,
        }
    }

    /// Reconciles every interval, or when woken, until `shutdown`.
    pub async fn run(self, shutdown: impl Future<Output = ()>) {
        let span = info_span!("reconcile", alertmanager = %self.base);
        async move {
            tokio::pin!(shutdown);
            loop {
                tokio::select! {
                    () = &mut shutdown => break,
                    () = self.wake.notified() => {}
                    () = tokio::time::sleep(self.interval) => {}
                }
                match self.once().await {
                    Ok(n) => {
                        self.metrics.reconciliations.get_or_create(&KindLabel { kind: "ok" }).inc();
                        info!(active = n, "reconciled with Alertmanager");
                    }
                    Err(e) => {
                        self.metrics.reconciliations.get_or_create(&KindLabel { kind: e.kind() }).inc();
                        warn!(error = %e, source = ?std::error::Error::source(&e), "reconciliation failed; will retry");
                    }
                }
            }
        }
        .instrument(span)
        .await;
    }

    /// One reconciliation: returns how many alerts Alertmanager lists as active.
    pub async fn once(&self) -> Result<usize, ReconcileError> {
        let as_of = self.clock.now();
        let url = format!("{}/api/v2/alerts", self.base);
        let receiver = format!("^{}$", regex_escape(&self.receiver));
        let mut request = self.client.get(&url).query(&[
            ("receiver", receiver.as_str()),
            ("active", "true"),
            ("silenced", "false"),
            ("inhibited", "false"),
        ]);
        if let Some(token) = &self.token {
            request = request.bearer_auth(token.expose_secret());
        }
        let response = request
            .send()
            .await
            .map_err(|source| ReconcileError::Request {
                url: url.clone(),
                source,
            })?;
        if !response.status().is_success() {
            return Err(ReconcileError::Status {
                url,
                status: response.status(),
            });
        }
        let body = response
            .bytes()
            .await
            .map_err(|source| ReconcileError::Request { url, source })?;
        let batch =
            parse_alertmanager_list(&body).map_err(|e| ReconcileError::Payload(e.to_string()))?;
        let n = batch.alerts.len();
        self.engine
            .apply(Input::Reconcile {
                alerts: batch.alerts,
                as_of,
            })
            .await?;
        Ok(n)
    }
}
