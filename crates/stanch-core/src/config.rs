//! The configuration model and its validation.
//!
//! Policy lives here: models and their pools, the ladder's timings, blocking, alert
//! mappings. The controller's own settings in the same file (intake and watch limits,
//! history bounds, token files, Alertmanager) are `stanch_server::config`'s; ports,
//! paths and log format are flags of the binary, not config. Parsing
//! is strict (`deny_unknown_fields`), and [`Config::validate`] reports every problem
//! with its path, not just the first.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use stanch_api::HumanDuration;
use stanch_api::routes::{MAX_ENDPOINT_BYTES, MAX_MODEL_BYTES, valid_endpoint};

use crate::rules::{Action, Matcher};

/// The default configuration `stanch serve` runs with when given no `--config`.
pub const DEFAULT_CONFIG_YAML: &str = include_str!("default-config.yaml");

pub use self::failback::FailbackPolicy;
use self::failback::failback_problems;

mod failback;

/// The longest any ladder, blocking, alert or watch timing may be: 30 days. Longer
/// than that is not a timing but a decision an operator makes with an override.
pub const MAX_POLICY_DURATION: HumanDuration = HumanDuration::secs(30 * 86_400);

/// The whole controller configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Models by name, as clients request them.
    pub models: BTreeMap<String, ModelConfig>,
    /// FAQ sets the gateways know; a model's `faq` must name one.
    #[serde(default = "default_faq_sets")]
    pub faq_sets: Vec<String>,
    /// Timings of the degradation ladder.
    #[serde(default)]
    pub ladder: LadderPolicy,
    /// Endpoint soft-blocking.
    #[serde(default)]
    pub blocking: BlockPolicy,
    /// How alerts are kept.
    #[serde(default)]
    pub alerts: AlertPolicy,
    /// Extra rules mapping existing alerts to actions, tried in order after the
    /// `action` label convention.
    #[serde(default)]
    pub mappings: Vec<MappingConfig>,
    /// Start in dry-run: decide and report, publish nothing new.
    #[serde(default)]
    pub dry_run: bool,
}

fn default_faq_sets() -> Vec<String> {
    vec!["default".to_owned()]
}

/// One model's serving layout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// Pools in failover order; the first is the primary.
    pub pools: Vec<PoolConfig>,
    /// The model non-VIP traffic moves to when this one is degraded.
    #[serde(default)]
    pub fallback: Option<String>,
    /// The FAQ set answered from on the static rung.
    #[serde(default)]
    pub faq: Option<String>,
    /// Tenant classes that keep this model while it is degraded.
    #[serde(default = "default_alias_exempt")]
    pub alias_exempt: Vec<String>,
    /// This model's own ladder timings, over the file's `ladder`.
    #[serde(default, skip_serializing_if = "LadderOverrides::is_empty")]
    pub ladder: LadderOverrides,
}

impl ModelConfig {
    /// The ladder timings this model moves by: `base` (the file's `ladder`), with each
    /// timing the model gives of its own in its place.
    pub fn ladder_policy(&self, base: &LadderPolicy) -> LadderPolicy {
        let own = &self.ladder;
        LadderPolicy {
            recover_after: own.recover_after.unwrap_or(base.recover_after),
            min_dwell: own.min_dwell.unwrap_or(base.min_dwell),
            lease: base.lease,
            flap: own.flap.clone().unwrap_or_else(|| base.flap.clone()),
            backoff: own.backoff.clone().unwrap_or_else(|| base.backoff.clone()),
            failback: base.failback.clone(),
        }
    }
}

/// A model's own ladder timings; each one given replaces the file's. The lease is not
/// among them: gateways honour the whole table for one lease.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LadderOverrides {
    /// As `ladder.recover_after`, for this model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recover_after: Option<HumanDuration>,
    /// As `ladder.min_dwell`, for this model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_dwell: Option<HumanDuration>,
    /// As `ladder.flap`, for this model (the whole guard).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flap: Option<FlapPolicy>,
    /// As `ladder.backoff`, for this model (the whole backoff).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backoff: Option<BackoffPolicy>,
}

impl LadderOverrides {
    /// Whether the model gives no timing of its own.
    pub fn is_empty(&self) -> bool {
        *self == LadderOverrides::default()
    }
}

fn default_alias_exempt() -> Vec<String> {
    vec!["vip".to_owned()]
}

/// A pool: a name, or a name with the endpoints in it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum PoolConfig {
    /// Just the name (`dc-a`).
    Name(String),
    /// The name and its endpoints, which enables the single-endpoint block guard.
    Full {
        /// The pool's name.
        name: String,
        /// Endpoints as gateways name them (URL or host:port).
        #[serde(default)]
        endpoints: Vec<String>,
    },
}

impl PoolConfig {
    /// The pool's name.
    pub fn name(&self) -> &str {
        match self {
            PoolConfig::Name(n) | PoolConfig::Full { name: n, .. } => n,
        }
    }

    /// The endpoints listed for the pool (none for the short form).
    pub fn endpoints(&self) -> &[String] {
        match self {
            PoolConfig::Name(_) => &[],
            PoolConfig::Full { endpoints, .. } => endpoints,
        }
    }
}

/// Timings of the degradation ladder.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LadderPolicy {
    /// How long a higher rung's conditions must stay clear before stepping down.
    pub recover_after: HumanDuration,
    /// The least time a rung is held before stepping down from it.
    pub min_dwell: HumanDuration,
    /// How long gateways honour a route entry without hearing from the controller.
    pub lease: HumanDuration,
    /// The flap guard.
    pub flap: FlapPolicy,
    /// Backoff of `recover_after` for repeated degradation.
    pub backoff: BackoffPolicy,
    /// How traffic returns when a model steps down from failover or degraded.
    pub failback: FailbackPolicy,
}

impl Default for LadderPolicy {
    fn default() -> Self {
        Self {
            recover_after: HumanDuration::secs(60),
            min_dwell: HumanDuration::secs(30),
            lease: HumanDuration::secs(120),
            flap: FlapPolicy::default(),
            backoff: BackoffPolicy {
                factor: 2,
                max: HumanDuration::secs(16 * 60),
                reset_after: HumanDuration::secs(30 * 60),
            },
            failback: FailbackPolicy::default(),
        }
    }
}

/// More than `max_transitions` within `window` pins a model for `hold`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FlapPolicy {
    /// Rung changes allowed within `window`.
    pub max_transitions: usize,
    /// The counting window.
    pub window: HumanDuration,
    /// How long the model is held at the highest rung seen.
    pub hold: HumanDuration,
}

impl Default for FlapPolicy {
    fn default() -> Self {
        Self {
            max_transitions: 4,
            window: HumanDuration::secs(10 * 60),
            hold: HumanDuration::secs(15 * 60),
        }
    }
}

/// Exponential backoff: each repeat within `reset_after` multiplies by `factor`, up to `max`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackoffPolicy {
    /// The multiplier per repeat.
    pub factor: u32,
    /// The cap.
    pub max: HumanDuration,
    /// A repeat later than this starts over.
    pub reset_after: HumanDuration,
}

impl BackoffPolicy {
    /// `base × factor^level`, capped at `max` (and never below `base`).
    pub fn scaled(&self, base: Duration, level: u32) -> Duration {
        let factor = u64::from(self.factor.max(1)).saturating_pow(level.min(32));
        let ms = u64::try_from(base.as_millis())
            .unwrap_or(u64::MAX)
            .saturating_mul(factor);
        Duration::from_millis(ms).min(self.max.0.max(base))
    }
}

/// Endpoint soft-blocking.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BlockPolicy {
    /// The first block's length.
    pub ttl: HumanDuration,
    /// Random spread of each block's length, as a fraction (0.1 = ±10 %).
    pub jitter: f64,
    /// Backoff for repeat offenders.
    pub backoff: BackoffPolicy,
    /// Endpoint globs (`*`, `?`) that are never blocked.
    pub never_block: Vec<String>,
    /// Seed of the deterministic jitter.
    pub seed: u64,
    /// Blocking from gateways' merged outcome reports.
    pub fleet: FleetPolicy,
    /// The most blocks held at once. At the limit a block from the fleet's reports
    /// is refused; one from an alert or an operator takes the place of the fleet
    /// block (then the alert block) that ends soonest, and is refused only when
    /// every block is of its own kind or above. With each entry's fields bounded,
    /// this bounds the table's blocked list in bytes too.
    pub max_blocks: usize,
}

/// The most [`BlockPolicy::max_blocks`] may be: with every field of a block at its
/// bound, a table of this many blocks stays within half of
/// [`MAX_TABLE_BYTES`](stanch_api::routes::MAX_TABLE_BYTES), so every watch transport
/// delivers it.
pub const MAX_BLOCKS: usize = 5_000;

/// The most [`FleetPolicy::max_endpoints`] may be.
pub const MAX_FLEET_ENDPOINTS: usize = 100_000;

/// Triggers applied to the outcome reports of every gateway replica, merged.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FleetPolicy {
    /// Block when one replica reports this many failures in a row (0: off).
    pub consecutive_failures: u32,
    /// Block after this many failures across replicas within `window` (0: off).
    pub window_failures: u64,
    /// Block when the failure rate across replicas within `window` reaches this (0: off)...
    pub failure_rate: f64,
    /// ...with at least this many requests.
    pub min_requests: u64,
    /// The counting window.
    pub window: HumanDuration,
    /// The most (endpoint, model) pairs tracked from reports for models whose pools
    /// list no endpoints. A report naming a new pair beyond it is not counted. Where
    /// a model's pools list their endpoints, reports may name only those, and this
    /// bound does not apply.
    pub max_endpoints: usize,
}

impl Default for FleetPolicy {
    fn default() -> Self {
        FleetPolicy {
            consecutive_failures: 5,
            window_failures: 0,
            failure_rate: 0.5,
            min_requests: 20,
            window: HumanDuration::secs(60),
            max_endpoints: 1_000,
        }
    }
}

impl Default for BlockPolicy {
    fn default() -> Self {
        Self {
            ttl: HumanDuration::secs(5 * 60),
            jitter: 0.1,
            backoff: BackoffPolicy {
                factor: 2,
                max: HumanDuration::secs(60 * 60),
                reset_after: HumanDuration::secs(60 * 60),
            },
            never_block: Vec::new(),
            seed: 0,
            fleet: FleetPolicy::default(),
            max_blocks: 1_000,
        }
    }
}

/// How alerts are kept.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AlertPolicy {
    /// How long a pushed alert without `endsAt` stays active (Alertmanager's `resolve_timeout`).
    pub resolve_timeout: HumanDuration,
    /// How long a resolved alert is remembered, so that a late duplicate of its firing
    /// notification is recognised and ignored.
    pub remember_resolved: HumanDuration,
    /// The most alerts active at once. A new alert beyond it is refused (and the
    /// notification answered 503, so Alertmanager retries it); one that maps to a
    /// condition takes the place of the longest-unrefreshed one that maps to nothing.
    /// A bound on what a high-cardinality rule routed to stanch can make it hold.
    pub max_active: usize,
    /// The most bytes active alerts may hold together, as
    /// `IncomingAlert::held_bytes` counts them (about 1 KiB for a typical alert, at
    /// most about 20 KiB). A new alert past it is treated as one past `max_active`; a
    /// refresh that would pass it keeps the alert's last content.
    pub max_bytes: usize,
}

/// The most [`AlertPolicy::max_active`] may be.
pub const MAX_ACTIVE_ALERTS: usize = 1_000_000;
/// The least and the most [`AlertPolicy::max_bytes`] may be.
pub const ALERT_BYTES_RANGE: std::ops::RangeInclusive<usize> = (1 << 20)..=(1 << 30);

impl Default for AlertPolicy {
    fn default() -> Self {
        Self {
            resolve_timeout: HumanDuration::secs(5 * 60),
            remember_resolved: HumanDuration::secs(60 * 60),
            max_active: 10_000,
            max_bytes: 16 << 20,
        }
    }
}

/// A rule that maps alerts the user already has to an action.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MappingConfig {
    /// A name for status and history.
    pub name: String,
    /// Alertmanager-style matchers, all of which must hold:
    /// `alertname="KVCacheFull"`, `model_name=~"qwen-.*"`, `env!="dev"`.
    pub matchers: Vec<String>,
    /// The action: `trigger-failover`, `trigger-model-degradation`,
    /// `trigger-static-fallback` or `block-endpoint`.
    pub action: String,
    /// The model acted on, literally...
    #[serde(default)]
    pub target_model: Option<String>,
    /// ...or read from this label of the alert.
    #[serde(default)]
    pub target_model_label: Option<String>,
    /// The fallback model for degradation, if not the model's configured one.
    #[serde(default)]
    pub fallback_model: Option<String>,
    /// The failing pool, literally...
    #[serde(default)]
    pub pool: Option<String>,
    /// ...or read from this label.
    #[serde(default)]
    pub pool_label: Option<String>,
    /// For `trigger-failover`: the percentage of the pool's traffic to move to the
    /// next pool (1 to 100; all of it when not given), literally...
    #[serde(default)]
    pub shift: Option<u8>,
    /// ...or read from this label of the alert (`75` or `75%`).
    #[serde(default)]
    pub shift_label: Option<String>,
    /// For `block-endpoint`: the label naming the endpoint.
    #[serde(default)]
    pub endpoint_label: Option<String>,
}

/// One problem found in a configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// Where, as a dotted path (`models.qwen-72b.fallback`).
    pub path: String,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// Why a configuration was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The text is not valid YAML of the expected shape.
    #[error("cannot parse configuration: {0}")]
    Parse(String),
    /// The shape is right but the content is not.
    #[error("invalid configuration ({} problem{}):\n{}", .0.len(), if .0.len() == 1 { "" } else { "s" }, .0.iter().map(|p| format!("  - {p}")).collect::<Vec<_>>().join("\n"))]
    Invalid(Vec<Problem>),
}

impl Config {
    /// Parses and validates YAML text.
    pub fn from_yaml(text: &str) -> Result<Config, ConfigError> {
        let config: Config =
            serde_yaml::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))?;
        let problems = config.validate();
        if problems.is_empty() {
            Ok(config)
        } else {
            Err(ConfigError::Invalid(problems))
        }
    }

    /// The embedded default configuration.
    pub fn default_config() -> Config {
        Config::from_yaml(DEFAULT_CONFIG_YAML).expect("the embedded default configuration is valid")
    }

    /// Every problem, with its path. Empty means valid.
    pub fn validate(&self) -> Vec<Problem> {
        let mut out = Vec::new();
        let mut problem = |path: String, message: String| out.push(Problem { path, message });
        self.model_problems(&mut problem);
        self.duration_problems(&mut problem);
        self.limit_problems(&mut problem);
        self.mapping_problems(&mut problem);
        out
    }

    /// The models: names, pools and their endpoints, fallbacks, FAQ sets, own ladders.
    fn model_problems(&self, problem: &mut impl FnMut(String, String)) {
        if self.models.is_empty() {
            problem("models".into(), "at least one model is needed".into());
        }
        let faq_sets: BTreeSet<&str> = self.faq_sets.iter().map(String::as_str).collect();
        for (name, model) in &self.models {
            let at = format!("models.{name}");
            if name.trim().is_empty() {
                problem(at.clone(), "model name is empty".into());
            } else if name.len() > MAX_MODEL_BYTES || name.chars().any(char::is_control) {
                problem(
                    at.clone(),
                    format!("model name: at most {MAX_MODEL_BYTES} bytes, no control characters"),
                );
            }
            if model.pools.is_empty() {
                problem(
                    format!("{at}.pools"),
                    "a model needs at least one pool".into(),
                );
            }
            let mut seen = BTreeSet::new();
            for (i, pool) in model.pools.iter().enumerate() {
                for (j, endpoint) in pool.endpoints().iter().enumerate() {
                    if !valid_endpoint(endpoint) {
                        problem(
                            format!("{at}.pools[{i}].endpoints[{j}]"),
                            format!("1 to {MAX_ENDPOINT_BYTES} bytes, no control characters"),
                        );
                    }
                }
                if pool.name().trim().is_empty() {
                    problem(format!("{at}.pools[{i}]"), "pool name is empty".into());
                } else if !seen.insert(pool.name()) {
                    problem(
                        format!("{at}.pools[{i}]"),
                        format!("pool {:?} is listed twice", pool.name()),
                    );
                }
            }
            if let Some(fallback) = &model.fallback {
                if fallback == name {
                    problem(
                        format!("{at}.fallback"),
                        "a model cannot fall back to itself".into(),
                    );
                } else if !self.models.contains_key(fallback) {
                    problem(
                        format!("{at}.fallback"),
                        format!("model {fallback:?} is not configured"),
                    );
                }
            }
            own_ladder_problems(&format!("{at}.ladder"), &model.ladder, problem);
            if let Some(faq) = &model.faq
                && !faq_sets.contains(faq.as_str())
            {
                problem(
                    format!("{at}.faq"),
                    format!("FAQ set {faq:?} is not in faq_sets"),
                );
            }
        }
    }

    /// Durations: positive where zero means nothing, and none past the longest a policy may say.
    fn duration_problems(&self, problem: &mut impl FnMut(String, String)) {
        let ladder = &self.ladder;
        for (path, d) in [
            ("ladder.recover_after", ladder.recover_after),
            ("ladder.lease", ladder.lease),
            ("ladder.flap.window", ladder.flap.window),
            ("ladder.flap.hold", ladder.flap.hold),
            ("blocking.ttl", self.blocking.ttl),
            ("alerts.resolve_timeout", self.alerts.resolve_timeout),
        ] {
            if d.0.is_zero() {
                problem(path.into(), "must be longer than 0s".into());
            } else if d > MAX_POLICY_DURATION {
                problem(
                    path.into(),
                    format!("must be at most {MAX_POLICY_DURATION}"),
                );
            }
        }
        for (path, d) in [
            ("ladder.backoff.max", ladder.backoff.max),
            ("ladder.backoff.reset_after", ladder.backoff.reset_after),
            ("blocking.backoff.max", self.blocking.backoff.max),
            (
                "blocking.backoff.reset_after",
                self.blocking.backoff.reset_after,
            ),
            ("blocking.fleet.window", self.blocking.fleet.window),
            ("ladder.min_dwell", ladder.min_dwell),
            ("alerts.remember_resolved", self.alerts.remember_resolved),
        ] {
            if d > MAX_POLICY_DURATION {
                problem(
                    path.into(),
                    format!("must be at most {MAX_POLICY_DURATION}"),
                );
            }
        }
    }

    /// Limits and fractions within their ranges.
    fn limit_problems(&self, problem: &mut impl FnMut(String, String)) {
        let ladder = &self.ladder;
        if !(1..=MAX_ACTIVE_ALERTS).contains(&self.alerts.max_active) {
            problem(
                "alerts.max_active".into(),
                format!("must be between 1 and {MAX_ACTIVE_ALERTS}"),
            );
        }
        if !ALERT_BYTES_RANGE.contains(&self.alerts.max_bytes) {
            problem(
                "alerts.max_bytes".into(),
                format!(
                    "must be between {} (1 MiB) and {} (1 GiB)",
                    ALERT_BYTES_RANGE.start(),
                    ALERT_BYTES_RANGE.end()
                ),
            );
        }
        for (path, n, max) in [
            ("blocking.max_blocks", self.blocking.max_blocks, MAX_BLOCKS),
            (
                "blocking.fleet.max_endpoints",
                self.blocking.fleet.max_endpoints,
                MAX_FLEET_ENDPOINTS,
            ),
        ] {
            if !(1..=max).contains(&n) {
                problem(path.into(), format!("must be between 1 and {max}"));
            }
        }
        if ladder.lease.0 < Duration::from_secs(10) {
            problem(
                "ladder.lease".into(),
                "must be at least 10s, or gateways fail open between renewals".into(),
            );
        }
        failback_problems(&ladder.failback, problem);
        if ladder.flap.max_transitions < 2 {
            problem(
                "ladder.flap.max_transitions".into(),
                "must be at least 2 (one down and one up is not a flap)".into(),
            );
        }
        for (path, b) in [
            ("ladder.backoff", &ladder.backoff),
            ("blocking.backoff", &self.blocking.backoff),
        ] {
            if b.factor == 0 {
                problem(format!("{path}.factor"), "must be at least 1".into());
            }
        }
        if !(0.0..=1.0).contains(&self.blocking.fleet.failure_rate) {
            problem(
                "blocking.fleet.failure_rate".into(),
                "must be between 0 and 1".into(),
            );
        }
        if self.blocking.fleet.window.0.is_zero() {
            problem(
                "blocking.fleet.window".into(),
                "must be longer than 0s".into(),
            );
        }
        if !(0.0..=0.5).contains(&self.blocking.jitter) {
            problem(
                "blocking.jitter".into(),
                "must be between 0 and 0.5 (a fraction: 0.1 is ±10 %)".into(),
            );
        }
        for (i, glob) in self.blocking.never_block.iter().enumerate() {
            if glob.is_empty() {
                problem(format!("blocking.never_block[{i}]"), "empty pattern".into());
            }
        }
    }

    /// Mapping rules: matchers that parse, a known action, and the labels or models it needs.
    fn mapping_problems(&self, problem: &mut impl FnMut(String, String)) {
        for (i, m) in self.mappings.iter().enumerate() {
            let at = format!("mappings[{i}]");
            if m.matchers.is_empty() {
                problem(
                    format!("{at}.matchers"),
                    "at least one matcher is needed".into(),
                );
            }
            for (j, raw) in m.matchers.iter().enumerate() {
                if let Err(e) = Matcher::parse(raw) {
                    problem(format!("{at}.matchers[{j}]"), e.to_string());
                }
            }
            let action = match m.action.parse::<Action>() {
                Ok(a) => Some(a),
                Err(e) => {
                    problem(format!("{at}.action"), e.to_string());
                    None
                }
            };
            match (&m.target_model, &m.target_model_label) {
                (Some(_), Some(_)) => problem(
                    at.clone(),
                    "give target_model or target_model_label, not both".into(),
                ),
                (Some(t), None) if !self.models.contains_key(t) => {
                    problem(
                        format!("{at}.target_model"),
                        format!("model {t:?} is not configured"),
                    );
                }
                (None, None) if action.is_some_and(|a| a != Action::BlockEndpoint) => {
                    problem(
                        at.clone(),
                        "needs target_model or target_model_label".into(),
                    );
                }
                _ => {}
            }
            if let Some(f) = &m.fallback_model
                && !self.models.contains_key(f)
            {
                problem(
                    format!("{at}.fallback_model"),
                    format!("model {f:?} is not configured"),
                );
            }
            if m.pool.is_some() && m.pool_label.is_some() {
                problem(at.clone(), "give pool or pool_label, not both".into());
            }
            if m.shift.is_some() && m.shift_label.is_some() {
                problem(at.clone(), "give shift or shift_label, not both".into());
            }
            if let Some(shift) = m.shift
                && !(1..=crate::mapping::ALL).contains(&shift)
            {
                problem(
                    format!("{at}.shift"),
                    format!("{shift} is not a percentage from 1 to 100"),
                );
            }
            if (m.shift.is_some() || m.shift_label.is_some())
                && action.is_some_and(|a| a != Action::TriggerFailover)
            {
                problem(
                    format!("{at}.shift"),
                    "only trigger-failover moves a share of a pool's traffic".into(),
                );
            }
            if action == Some(Action::BlockEndpoint) && m.endpoint_label.is_none() {
                problem(
                    format!("{at}.endpoint_label"),
                    "block-endpoint needs the label naming the endpoint".into(),
                );
            }
        }
    }
}

/// The problems of a model's own ladder timings, by the rules of the file's `ladder`.
fn own_ladder_problems(at: &str, own: &LadderOverrides, problem: &mut impl FnMut(String, String)) {
    let positive = [
        ("recover_after", own.recover_after),
        ("flap.window", own.flap.as_ref().map(|f| f.window)),
        ("flap.hold", own.flap.as_ref().map(|f| f.hold)),
    ];
    for (path, d) in positive.into_iter().filter_map(|(p, d)| Some((p, d?))) {
        if d.0.is_zero() {
            problem(format!("{at}.{path}"), "must be longer than 0s".into());
        }
    }
    let bounded = [
        ("recover_after", own.recover_after),
        ("min_dwell", own.min_dwell),
        ("flap.window", own.flap.as_ref().map(|f| f.window)),
        ("flap.hold", own.flap.as_ref().map(|f| f.hold)),
        ("backoff.max", own.backoff.as_ref().map(|b| b.max)),
        (
            "backoff.reset_after",
            own.backoff.as_ref().map(|b| b.reset_after),
        ),
    ];
    for (path, d) in bounded.into_iter().filter_map(|(p, d)| Some((p, d?))) {
        if d > MAX_POLICY_DURATION {
            problem(
                format!("{at}.{path}"),
                format!("must be at most {MAX_POLICY_DURATION}"),
            );
        }
    }
    if own.flap.as_ref().is_some_and(|f| f.max_transitions < 2) {
        problem(
            format!("{at}.flap.max_transitions"),
            "must be at least 2 (one down and one up is not a flap)".into(),
        );
    }
    if own.backoff.as_ref().is_some_and(|b| b.factor == 0) {
        problem(format!("{at}.backoff.factor"), "must be at least 1".into());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_model_may_have_ladder_timings_of_its_own() {
        let c = Config::from_yaml(
            "ladder: {recover_after: 60s, min_dwell: 30s}\n\
             models:\n  a: {pools: [p], ladder: {recover_after: 5m}}\n  b: {pools: [p]}\n",
        )
        .unwrap();
        let a = c.models["a"].ladder_policy(&c.ladder);
        assert_eq!(a.recover_after, HumanDuration::secs(300));
        assert_eq!(
            a.min_dwell,
            HumanDuration::secs(30),
            "the file's, where not given"
        );
        assert_eq!(a.lease, c.ladder.lease);
        assert_eq!(c.models["b"].ladder_policy(&c.ladder), c.ladder);
        let Err(ConfigError::Invalid(problems)) = Config::from_yaml(
            "models:\n  a:\n    pools: [p]\n    ladder:\n      recover_after: 0s\n      \
             min_dwell: 400d\n      flap: {max_transitions: 1, window: 1m, hold: 0s}\n      \
             backoff: {factor: 0, max: 1m, reset_after: 1m}\n",
        ) else {
            panic!("refused");
        };
        let paths: Vec<&str> = problems.iter().map(|p| p.path.as_str()).collect();
        for path in [
            "models.a.ladder.recover_after",
            "models.a.ladder.min_dwell",
            "models.a.ladder.flap.max_transitions",
            "models.a.ladder.flap.hold",
            "models.a.ladder.backoff.factor",
        ] {
            assert!(paths.contains(&path), "{path} in {paths:?}");
        }
        assert!(
            Config::from_yaml("models:\n  a: {pools: [p], ladder: {lease: 1m}}\n").is_err(),
            "the lease is the table's, not a model's"
        );
    }

    #[test]
    fn default_config_is_valid_and_as_documented() {
        let c = Config::default_config();
        let big = &c.models["qwen-72b"];
        let pools: Vec<_> = big.pools.iter().map(PoolConfig::name).collect();
        assert_eq!(pools, ["dc-a", "dc-b"]);
        assert_eq!(big.fallback.as_deref(), Some("qwen-14b"));
        assert_eq!(c.models["qwen-14b"].pools.len(), 2);
        assert_eq!(c.faq_sets, ["default"]);
    }

    #[test]
    fn every_problem_is_reported_with_its_path() {
        let yaml = r#"
models:
  a:
    pools: [p1, p1]
    fallback: ghost
    faq: nope
  b:
    pools: []
    fallback: b
ladder:
  recover_after: 0s
  failback: {steps: [50, 25, 90], hold: 0s, max_error_rate: 2}
blocking:
  jitter: 2.0
alerts:
  max_active: 0
mappings:
  - name: m
    matchers: ['alertname=~"("']
    action: explode
  - name: too-far
    matchers: ['alertname="Slow"']
    action: trigger-failover
    target_model: a
    shift: 101
  - name: not-a-failover
    matchers: ['alertname="Full"']
    action: trigger-model-degradation
    target_model: a
    shift_label: move
"#;
        let err = Config::from_yaml(yaml).unwrap_err();
        let ConfigError::Invalid(problems) = &err else {
            panic!("{err}")
        };
        let paths: Vec<_> = problems.iter().map(|p| p.path.as_str()).collect();
        for expected in [
            "models.a.pools[1]",
            "models.a.fallback",
            "models.a.faq",
            "models.b.pools",
            "models.b.fallback",
            "ladder.recover_after",
            "ladder.failback.steps",
            "ladder.failback.steps[0]",
            "ladder.failback.hold",
            "ladder.failback.max_error_rate",
            "blocking.jitter",
            "alerts.max_active",
            "mappings[0].matchers[0]",
            "mappings[0].action",
            "mappings[1].shift",
            "mappings[2].shift",
        ] {
            assert!(paths.contains(&expected), "missing {expected} in {paths:?}");
        }
    }

    #[test]
    fn unknown_fields_and_bad_durations_are_parse_errors() {
        let err = Config::from_yaml("models: {}\nladdr: {}\n").unwrap_err();
        assert!(err.to_string().contains("unknown field `laddr`"), "{err}");
        let err = Config::from_yaml("models: {a: {pools: [p]}}\nladder: {recover_after: 60}\n")
            .unwrap_err();
        assert!(err.to_string().contains("not a duration"), "{err}");
    }

    #[test]
    fn backoff_scales_and_caps() {
        let b = BackoffPolicy {
            factor: 2,
            max: HumanDuration::secs(240),
            reset_after: HumanDuration::secs(600),
        };
        let base = Duration::from_secs(60);
        let got: Vec<_> = (0..4).map(|l| b.scaled(base, l).as_secs()).collect();
        assert_eq!(got, [60, 120, 240, 240]);
    }
}
