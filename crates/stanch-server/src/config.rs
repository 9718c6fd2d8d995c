//! The controller's own settings, as the configuration file gives them: what this
//! process listens with and how much it takes (role tokens' files, intake and watch
//! limits, history bounds, Alertmanager reconciliation), apart from the fleet's policy
//! (models, ladder, blocking, alerts, mappings), which is `stanch_core::Config`.
//!
//! One file holds both; [`ConfigFile::from_yaml`] splits it by its top-level keys,
//! parses each part strictly (`deny_unknown_fields`: an unknown key anywhere is an
//! error), and validates both, reporting every problem with its path.

use serde::{Deserialize, Serialize};
use stanch_api::HumanDuration;
use stanch_core::Config;
use stanch_core::config::{ConfigError, DEFAULT_CONFIG_YAML, MAX_POLICY_DURATION, Problem};

/// The top-level keys of the configuration file that are the controller's own.
pub const SERVER_KEYS: [&str; 6] = [
    "alertmanager",
    "auth",
    "intake",
    "watch",
    "history",
    "connections",
];

/// A whole configuration file: the policy, and the controller's own settings.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigFile {
    /// The fleet's policy.
    pub policy: Config,
    /// The controller's own settings.
    pub server: ServerConfig,
}

impl ConfigFile {
    /// Parses and validates YAML text.
    pub fn from_yaml(text: &str) -> Result<ConfigFile, ConfigError> {
        let parse = |e: serde_yaml::Error| ConfigError::Parse(e.to_string());
        let serde_yaml::Value::Mapping(mut policy) = serde_yaml::from_str(text).map_err(parse)?
        else {
            return Err(ConfigError::Parse(
                "the configuration must be a mapping of keys (models, ladder, blocking, ...)"
                    .into(),
            ));
        };
        let mut server = serde_yaml::Mapping::new();
        for key in SERVER_KEYS {
            if let Some(v) = policy.remove(key) {
                server.insert(key.into(), v);
            }
        }
        let file = ConfigFile {
            policy: serde_yaml::from_value(serde_yaml::Value::Mapping(policy)).map_err(parse)?,
            server: serde_yaml::from_value(serde_yaml::Value::Mapping(server)).map_err(parse)?,
        };
        let mut problems = file.policy.validate();
        problems.extend(file.server.validate());
        if problems.is_empty() {
            Ok(file)
        } else {
            Err(ConfigError::Invalid(problems))
        }
    }

    /// The embedded default configuration (`stanch serve` without `--config`).
    pub fn default_file() -> ConfigFile {
        ConfigFile::from_yaml(DEFAULT_CONFIG_YAML)
            .expect("the embedded default configuration is valid")
    }
}

/// The controller's own settings.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    /// Reconciliation against Alertmanager's API.
    #[serde(default)]
    pub alertmanager: Option<AlertmanagerConfig>,
    /// Where the role tokens come from, when not from the environment.
    #[serde(default)]
    pub auth: AuthConfig,
    /// Intake limits.
    #[serde(default)]
    pub intake: IntakeConfig,
    /// Watch protocol limits.
    #[serde(default)]
    pub watch: WatchConfig,
    /// Audit history limits.
    #[serde(default)]
    pub history: HistoryConfig,
    /// Connection limits of the API port.
    #[serde(default)]
    pub connections: ConnectionsConfig,
}

impl ServerConfig {
    /// Every problem, with its path. Empty means valid.
    pub fn validate(&self) -> Vec<Problem> {
        let mut out = Vec::new();
        let mut problem = |path: &str, message: String| {
            out.push(Problem {
                path: path.to_owned(),
                message,
            })
        };
        let durations = [
            ("watch.max_wait", Some(self.watch.max_wait)),
            ("watch.heartbeat", Some(self.watch.heartbeat)),
            (
                "watch.slow_client_timeout",
                Some(self.watch.slow_client_timeout),
            ),
            ("intake.body_timeout", Some(self.intake.body_timeout)),
            (
                "connections.http2_idle_timeout",
                Some(self.connections.http2_idle_timeout),
            ),
            (
                "alertmanager.interval",
                self.alertmanager.as_ref().map(|a| a.interval),
            ),
        ];
        for (path, d) in durations {
            match d {
                Some(d) if d.0.is_zero() => problem(path, "must be longer than 0s".into()),
                Some(d) if d > MAX_POLICY_DURATION => {
                    problem(path, format!("must be at most {MAX_POLICY_DURATION}"))
                }
                _ => {}
            }
        }
        if let Some(am) = &self.alertmanager {
            if !(am.url.starts_with("http://") || am.url.starts_with("https://")) {
                problem(
                    "alertmanager.url",
                    format!("{:?} is not an http(s) URL", am.url),
                );
            }
            if am.receiver.trim().is_empty() {
                problem(
                    "alertmanager.receiver",
                    "name the receiver that routes to stanch".into(),
                );
            }
        }
        if self.intake.max_body_bytes < 1024 {
            problem("intake.max_body_bytes", "must be at least 1024".into());
        }
        if self.watch.max_watchers == 0 {
            problem("watch.max_watchers", "must be at least 1".into());
        }
        if self.connections.max == 0 {
            problem("connections.max", "must be at least 1".into());
        }
        if self.connections.max_per_source == 0 {
            problem("connections.max_per_source", "must be at least 1".into());
        }
        if self.history.max_entries == 0 {
            problem("history.max_entries", "must be at least 1".into());
        }
        out
    }
}

/// Reconciliation against Alertmanager's API.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AlertmanagerConfig {
    /// Alertmanager's base URL, e.g. `http://alertmanager:9093`.
    pub url: String,
    /// The receiver that routes to stanch; only its alerts are reconciled.
    pub receiver: String,
    /// How often to reconcile when no notification asks for it.
    #[serde(default = "default_reconcile_interval")]
    pub interval: HumanDuration,
    /// A file holding a bearer token for Alertmanager, if it needs one.
    #[serde(default)]
    pub token_file: Option<String>,
}

fn default_reconcile_interval() -> HumanDuration {
    HumanDuration::secs(60)
}

/// Files holding role tokens; the environment (`STANCH_*_TOKEN`) wins over them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthConfig {
    /// Token for alert intake and gateway reports.
    #[serde(default)]
    pub ingest_token_file: Option<String>,
    /// Token for gateway reports only, the one gateways hold (without it, reports
    /// take the ingest token).
    #[serde(default)]
    pub report_token_file: Option<String>,
    /// Token for overrides.
    #[serde(default)]
    pub admin_token_file: Option<String>,
    /// Token for routes, status and history.
    #[serde(default)]
    pub read_token_file: Option<String>,
}

/// Intake limits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct IntakeConfig {
    /// Request bodies above this are refused with 413.
    pub max_body_bytes: usize,
    /// A request's body must arrive within this of its headers, extended by a second
    /// for every `body_min_rate` bytes received; past it the sender gets 408 and the
    /// connection is closed, so a stalled sender holds neither a connection nor memory.
    pub body_timeout: HumanDuration,
    /// Bytes a second that extend `body_timeout` by a second each; 0 extends nothing.
    pub body_min_rate: u64,
    /// The bytes that request bodies still arriving may hold together; past it a
    /// request gets 503 (Alertmanager retries).
    pub max_partial_body_bytes: usize,
}

impl Default for IntakeConfig {
    fn default() -> Self {
        Self {
            max_body_bytes: 1024 * 1024,
            body_timeout: HumanDuration::secs(10),
            body_min_rate: 64 * 1024,
            max_partial_body_bytes: 16 * 1024 * 1024,
        }
    }
}

/// Watch protocol limits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WatchConfig {
    /// The longest long-poll wait a client may ask for.
    pub max_wait: HumanDuration,
    /// SSE comment interval, so proxies keep the stream open.
    pub heartbeat: HumanDuration,
    /// An SSE client that has not taken an event for this long is disconnected.
    pub slow_client_timeout: HumanDuration,
    /// The most watchers at once (long-poll, SSE and gRPC together); more are
    /// refused with 503 (gRPC: UNAVAILABLE).
    pub max_watchers: usize,
    /// Serve the gRPC watch, health checking and reflection on the API port (HTTP/2
    /// beside HTTP/1.1). Off, the port speaks HTTP/1.1 only.
    pub grpc: bool,
}

impl Default for WatchConfig {
    fn default() -> Self {
        Self {
            max_wait: HumanDuration::secs(60),
            heartbeat: HumanDuration::secs(15),
            slow_client_timeout: HumanDuration::secs(10),
            max_watchers: 10_000,
            grpc: true,
        }
    }
}

/// Connection limits of the API port: every connection counts, whatever it carries
/// (watches, scrapes, notifications) and however it ends (a connection closed by the
/// controller lingers a while, `docs/operations.md`, "Limits and what happens at
/// them"). One past a limit is closed as soon as it is accepted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConnectionsConfig {
    /// Open at once: room for `watch.max_watchers` watchers, one connection each,
    /// and for the rest (Prometheus, Alertmanager, operators).
    pub max: usize,
    /// Open at once from one IP address (a gateway holds one or two).
    pub max_per_source: usize,
    /// An HTTP/2 connection with no stream open for this long is closed (an idle
    /// HTTP/1.1 one is closed when `intake`'s header timeout, 30 s, passes).
    pub http2_idle_timeout: HumanDuration,
}

impl Default for ConnectionsConfig {
    fn default() -> Self {
        Self {
            max: 11_000,
            max_per_source: 1_000,
            http2_idle_timeout: HumanDuration::secs(60),
        }
    }
}

/// Audit history limits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HistoryConfig {
    /// Entries kept in memory for `GET /v1/history`.
    pub max_entries: usize,
    /// The JSON-lines file under the data dir is rotated above this size.
    pub max_file_bytes: u64,
}

impl Default for HistoryConfig {
    fn default() -> Self {
        Self {
            max_entries: 10_000,
            max_file_bytes: 64 * 1024 * 1024,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICY: &str = "models:\n  qwen-72b:\n    pools: [dc-a]\n";

    #[test]
    fn one_file_holds_the_policy_and_the_controllers_settings() {
        let file = ConfigFile::from_yaml(&format!(
            "{POLICY}intake:\n  max_body_bytes: 4096\nwatch:\n  max_watchers: 5\n\
             alertmanager:\n  url: http://am:9093\n  receiver: stanch\n"
        ))
        .unwrap();
        assert!(file.policy.models.contains_key("qwen-72b"));
        assert_eq!(file.server.intake.max_body_bytes, 4096);
        assert_eq!(file.server.watch.max_watchers, 5);
        assert_eq!(file.server.history, HistoryConfig::default());
        assert_eq!(file.server.alertmanager.unwrap().receiver, "stanch");
        let default = ConfigFile::default_file();
        assert_eq!(default.server, ServerConfig::default());
        assert_eq!(default.policy, Config::default_config());
    }

    /// Every problem of both halves, each at its path in the file, in one answer.
    #[test]
    fn problems_in_either_half_are_all_reported_at_their_paths() {
        let text = "models: {}\nintake:\n  max_body_bytes: 10\nwatch:\n  max_wait: 0s\n\
                    alertmanager:\n  url: am:9093\n  receiver: ' '\n  interval: 90d\n";
        let Err(ConfigError::Invalid(problems)) = ConfigFile::from_yaml(text) else {
            panic!("refused");
        };
        let paths: Vec<&str> = problems.iter().map(|p| p.path.as_str()).collect();
        for path in [
            "models",
            "intake.max_body_bytes",
            "watch.max_wait",
            "alertmanager.url",
            "alertmanager.receiver",
            "alertmanager.interval",
        ] {
            assert!(paths.contains(&path), "{path} in {paths:?}");
        }
    }

    #[test]
    fn unknown_keys_are_refused_in_either_half() {
        for text in [
            format!("{POLICY}intakes: {{}}\n"),
            format!("{POLICY}intake:\n  max_body: 10\n"),
            format!("{POLICY}ladder:\n  recover: 1m\n"),
            "- a list\n".to_owned(),
        ] {
            let e = ConfigFile::from_yaml(&text).unwrap_err();
            assert!(matches!(e, ConfigError::Parse(_)), "{text:?}: {e}");
        }
        let e = ConfigFile::from_yaml(&format!("{POLICY}intake:\n  max_body: 10\n")).unwrap_err();
        assert!(e.to_string().contains("max_body"), "{e}");
    }
}
