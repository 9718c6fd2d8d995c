//! The gateway's configuration: models, pools, endpoints, tenants, FAQ sets, and the
//! policies for timeouts, retries and blocking. Validated like the controller's: every
//! problem is reported with its path.
//!
//! Size: the whole configuration reference: each section a type with its defaults and checks, read beside docs/configuration.md.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use secrecy::SecretString;
use serde::Deserialize;
use stanch_api::HumanDuration;

/// The whole gateway configuration.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayConfig {
    /// Models by the name clients request; a name with `*` or `?` is a glob that
    /// forwards the requested name upstream.
    pub models: BTreeMap<String, ModelConfig>,
    /// Callers by API key.
    #[serde(default)]
    pub tenants: Vec<TenantConfig>,
    /// Refuse callers whose key is not a configured tenant (401).
    #[serde(default)]
    pub require_tenant: bool,
    /// FAQ sets answered from on the static rung and as the last resort.
    #[serde(default)]
    pub faq_sets: BTreeMap<String, FaqSetConfig>,
    /// Timeouts of an upstream attempt.
    #[serde(default)]
    pub timeouts: Timeouts,
    /// Retries per request.
    #[serde(default)]
    pub retry: RetryPolicy,
    /// Passive blocking of failing endpoints.
    #[serde(default)]
    pub blocking: BlockingPolicy,
    /// The controller to follow, if any.
    #[serde(default)]
    pub controller: Option<ControllerConfig>,
    /// Request bodies above this are refused with 413.
    #[serde(default = "default_max_body")]
    pub max_body_bytes: usize,
    /// Bytes a second that extend `timeouts.body` by a second each: a large prompt
    /// sent at a fair rate is read, a trickle is cut off. 0 extends nothing.
    #[serde(default = "default_body_min_rate")]
    pub body_min_rate: u64,
    /// The bytes that request bodies still arriving may hold together; a body that
    /// would pass it gets 503 with `Retry-After`. Bodies that arrive whole at once
    /// (most) do not count.
    #[serde(default = "default_max_partial_bodies")]
    pub max_partial_body_bytes: usize,
    /// A whole (non-streamed) upstream answer above this is a failed attempt: the
    /// gateway holds a whole answer in memory before passing it on.
    #[serde(default = "default_max_response")]
    pub max_response_bytes: usize,
    /// How `https` endpoints and an `https` controller are trusted.
    #[serde(default)]
    pub tls: TlsTrust,
    /// Caller connections open at once, lingering ones included; one more is closed
    /// as soon as it is accepted (and counted in
    /// `stanch_gateway_connections_refused_total`). Not per source: callers often
    /// come through a load balancer's few addresses.
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
}

/// Trust for `https` endpoints and controller: the Mozilla root certificates, plus a
/// private CA's.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsTrust {
    /// A PEM file of further CA certificates (an internal CA in front of model servers
    /// or of the controller).
    #[serde(default)]
    pub ca_file: Option<String>,
}

fn default_max_connections() -> usize {
    16_384
}

fn default_max_body() -> usize {
    4 * 1024 * 1024
}

fn default_body_min_rate() -> u64 {
    64 * 1024
}

fn default_max_partial_bodies() -> usize {
    64 * 1024 * 1024
}

fn default_max_response() -> usize {
    64 * 1024 * 1024
}

/// One model.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// Pools in failover order; the first is the primary.
    pub pools: Vec<PoolConfig>,
    /// Models tried, in order, when every pool of this one failed.
    #[serde(default)]
    pub fallbacks: Vec<String>,
    /// A model with a longer context, for prompts this one refuses as too long.
    #[serde(default)]
    pub larger_context: Option<String>,
    /// The FAQ set for this model's static answers.
    #[serde(default)]
    pub faq: Option<String>,
    /// Time to first token, overriding `timeouts.first_token`.
    #[serde(default)]
    pub first_token_timeout: Option<HumanDuration>,
    /// A stream with no first token after this long is sent to the next target as
    /// well, and the first of the two to stream serves the caller (the other is
    /// cancelled); unset, a stream waits its whole first-token timeout. It must be
    /// shorter than that timeout.
    #[serde(default)]
    pub hedge_after: Option<HumanDuration>,
}

/// A pool of endpoints.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// Its name, as in the controller's configuration (`dc-a`).
    pub name: String,
    /// Its endpoints.
    pub endpoints: Vec<EndpointConfig>,
    /// Whether its endpoints continue a partial answer given as a trailing assistant
    /// message, which is how a broken stream is continued here.
    #[serde(default)]
    pub prefill: Prefill,
}

/// How a pool's endpoints take a partial answer to continue (an assistant prefill).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Prefill {
    /// Not at all: a broken stream is continued here only by regenerating the answer,
    /// and spliced only if the new one begins with exactly what the caller has.
    #[default]
    None,
    /// A trailing assistant message is continued (Anthropic's and llama.cpp's
    /// OpenAI-compatible APIs); for `/v1/completions`, the prompt with the partial
    /// text appended.
    Assistant,
    /// As `assistant`, with `continue_final_message: true` and
    /// `add_generation_prompt: false`, which vLLM and SGLang need to continue it.
    Vllm,
}

/// One upstream endpoint.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointConfig {
    /// Base URL, e.g. `http://10.0.0.7:8000` (paths `/v1/...` are appended).
    pub url: String,
    /// Relative share of traffic.
    #[serde(default = "one")]
    pub weight: u32,
    /// The model name upstream; defaults to the requested name.
    #[serde(default)]
    pub upstream_model: Option<String>,
    /// Environment variable holding the API key.
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// File holding the API key.
    #[serde(default)]
    pub api_key_file: Option<String>,
    /// Concurrent requests it handles well, for load scoring.
    #[serde(default = "default_capacity")]
    pub capacity: u32,
}

fn one() -> u32 {
    1
}

fn default_capacity() -> u32 {
    64
}

/// A caller.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    /// A name for logs (never the key).
    pub name: String,
    /// Environment variable holding the caller's API key.
    #[serde(default)]
    pub key_env: Option<String>,
    /// File holding the caller's API key.
    #[serde(default)]
    pub key_file: Option<String>,
    /// The key itself (for tests and demos; prefer `key_env` or `key_file`).
    #[serde(default)]
    pub key: Option<String>,
    /// VIP callers keep the original model while it is degraded.
    #[serde(default)]
    pub vip: bool,
}

/// A FAQ set.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaqSetConfig {
    /// The answer when no entry matches well enough.
    pub default_answer: String,
    /// The BM25 score an entry needs to be chosen.
    #[serde(default = "default_threshold")]
    pub threshold: f64,
    /// Entries: question variants and their answer.
    #[serde(default)]
    pub entries: Vec<FaqEntryConfig>,
}

fn default_threshold() -> f64 {
    1.0
}

/// One FAQ entry.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaqEntryConfig {
    /// Ways callers ask it.
    pub questions: Vec<String>,
    /// The answer.
    pub answer: String,
}

/// Timeouts of one upstream attempt.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Timeouts {
    /// TCP connect.
    pub connect: HumanDuration,
    /// Until response headers.
    pub first_byte: HumanDuration,
    /// Until the first streamed token.
    pub first_token: HumanDuration,
    /// Between streamed chunks.
    pub stream_idle: HumanDuration,
    /// The whole request, all attempts included.
    pub total: HumanDuration,
    /// Keep-alive connections to an upstream are not reused after this long idle.
    /// Keep it below the upstreams' own keep-alive timeout (uvicorn, hence vLLM: 5 s),
    /// so a request never races an upstream closing the connection it goes out on.
    pub idle_connection: HumanDuration,
    /// A caller's connection must bring a request's headers within this of starting
    /// to wait for one: a slow sender is cut off (slowloris), and a kept-alive
    /// connection idle this long is closed. Keep it above the idle timeout of any load
    /// balancer in front (AWS ALB: 60 s; GCP's: 600 s), so the balancer never sends a
    /// request on a connection the gateway is closing. nginx's `keepalive_timeout`
    /// default, 75 s.
    pub caller_idle: HumanDuration,
    /// A request's body must arrive within this of its headers, extended by a second
    /// for every `body_min_rate` bytes received (Apache's `mod_reqtimeout`), or the
    /// caller gets 408 and the connection is closed.
    pub body: HumanDuration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            connect: HumanDuration::secs(2),
            first_byte: HumanDuration::secs(30),
            first_token: HumanDuration::secs(15),
            stream_idle: HumanDuration::secs(30),
            total: HumanDuration::secs(300),
            idle_connection: HumanDuration::secs(4),
            caller_idle: HumanDuration::secs(75),
            body: HumanDuration::secs(10),
        }
    }
}

/// The most `retry.same_endpoint` may be: more is a retry storm on one endpoint.
const MAX_SAME_ENDPOINT: u32 = 3;
/// The most `retry.stream_resumes` may be: a stream that keeps breaking is not
/// worth chasing across the fleet.
const MAX_STREAM_RESUMES: u32 = 3;

/// Retries of one request.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetryPolicy {
    /// Upstream attempts per request at most, across pools and fallbacks.
    pub max_attempts: u32,
    /// Attempts within one pool before moving to the next.
    pub attempts_per_pool: u32,
    /// First backoff between attempts.
    pub backoff_base: HumanDuration,
    /// Backoff cap.
    pub backoff_max: HumanDuration,
    /// Retries may be at most this fraction of requests over `budget_window`...
    pub budget_ratio: f64,
    /// ...over this window...
    pub budget_window: HumanDuration,
    /// ...plus this many, so a quiet gateway can still retry.
    pub budget_min_retries: u32,
    /// Attempts again at the same endpoint, per request, after a one-off fault (a 500,
    /// 502, 503 or 504, a reset, a connection closed before any answer) when the model
    /// has no other endpoint open to try; 0 never sends a request to an endpoint twice.
    pub same_endpoint: u32,
    /// A 429 whose `Retry-After` is at most this is waited out at the same endpoint
    /// (never less than it says) when the model has no other endpoint open to try; a
    /// longer one moves on at once. `0s` never waits.
    pub retry_after_max: HumanDuration,
    /// Times one stream that breaks or stalls after its first token is continued on
    /// another endpoint or a fallback model (with the partial answer as a prefill where
    /// the pool takes one, else regenerated and spliced only where it matches); 0 ends
    /// it with an error event at once.
    pub stream_resumes: u32,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 4,
            attempts_per_pool: 2,
            backoff_base: HumanDuration(Duration::from_millis(10)),
            backoff_max: HumanDuration(Duration::from_millis(500)),
            budget_ratio: 0.2,
            budget_window: HumanDuration::secs(10),
            budget_min_retries: 10,
            same_endpoint: 1,
            retry_after_max: HumanDuration::secs(5),
            stream_resumes: 1,
        }
    }
}

/// Passive blocking of (endpoint, model) pairs.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BlockingPolicy {
    /// Block after this many failures in a row (0 turns the trigger off).
    pub consecutive_failures: u32,
    /// Block after this many failures within `window` (0 turns it off).
    pub window_failures: u32,
    /// Block when the failure rate within `window` reaches this (0 turns it off)...
    pub failure_rate: f64,
    /// ...with at least this many requests in the window.
    pub min_requests: u32,
    /// The counting window.
    pub window: HumanDuration,
    /// A first block's length.
    pub ttl: HumanDuration,
    /// ± spread of block lengths.
    pub jitter: f64,
    /// Repeat offenders: each block within `backoff_reset` of the last doubles, up to this.
    pub max_ttl: HumanDuration,
    /// A block later than this after the previous starts over at `ttl`.
    pub backoff_reset: HumanDuration,
    /// After a block, an endpoint's share ramps up over this long.
    pub slow_start: HumanDuration,
    /// Endpoint URL globs never blocked.
    pub never_block: Vec<String>,
    /// Active probing of blocked endpoints.
    pub probe: ProbePolicy,
}

/// Probing blocked endpoints with a tiny real completion, to lift a block early.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ProbePolicy {
    /// Off by default: probes are real (if tiny) completions.
    pub enabled: bool,
    /// How often each blocked endpoint is probed.
    pub interval: HumanDuration,
    /// Successes in a row that lift a block.
    pub successes: u32,
    /// A probe not answered within this fails.
    pub timeout: HumanDuration,
}

impl Default for ProbePolicy {
    fn default() -> Self {
        ProbePolicy {
            enabled: false,
            interval: HumanDuration::secs(5),
            successes: 3,
            timeout: HumanDuration::secs(5),
        }
    }
}

impl Default for BlockingPolicy {
    fn default() -> Self {
        BlockingPolicy {
            consecutive_failures: 5,
            window_failures: 0,
            failure_rate: 0.0,
            min_requests: 20,
            window: HumanDuration::secs(30),
            ttl: HumanDuration::secs(60),
            jitter: 0.1,
            max_ttl: HumanDuration::secs(600),
            backoff_reset: HumanDuration::secs(1800),
            slow_start: HumanDuration::secs(30),
            never_block: Vec::new(),
            probe: ProbePolicy::default(),
        }
    }
}

/// The controller to follow.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ControllerConfig {
    /// Its base URL: the watch API, and where reports go. May be left out when the
    /// table comes from the route-table resource; reports are then not sent.
    #[serde(default)]
    pub url: Option<String>,
    /// Follow the route-table resource through the Kubernetes API instead of the
    /// watch API (a gateway built with feature `kubernetes`).
    #[serde(default)]
    pub route_table: Option<RouteTableRef>,
    /// Environment variable holding a read token.
    #[serde(default)]
    pub token_env: Option<String>,
    /// File holding a read token.
    #[serde(default)]
    pub token_file: Option<String>,
    /// This gateway's identity; defaults to the host name.
    #[serde(default)]
    pub gateway_id: Option<String>,
    /// How to follow the watch API at `url`.
    #[serde(default)]
    pub watch: WatchTransport,
    /// Where the last-known-good table is kept.
    #[serde(default)]
    pub state_file: Option<String>,
    /// How often to report endpoint outcomes (`POST /v1/reports`); `0s` turns it off.
    #[serde(default = "default_report_interval")]
    pub report_interval: HumanDuration,
    /// Environment variable holding the report token, what reports are sent with.
    #[serde(default)]
    pub report_token_env: Option<String>,
    /// File holding the report token.
    #[serde(default)]
    pub report_token_file: Option<String>,
    /// Environment variable holding an ingest token, which the controller accepts for
    /// reports too; used when no report token is named. Prefer the report token: it
    /// can do nothing but report.
    #[serde(default)]
    pub ingest_token_env: Option<String>,
    /// File holding an ingest token, as `ingest_token_env`.
    #[serde(default)]
    pub ingest_token_file: Option<String>,
}

impl ControllerConfig {
    /// Where the token reports are sent with comes from: (env, file), the report
    /// token's when either is named, else the ingest token's.
    pub fn report_token_source(&self) -> (Option<&String>, Option<&String>) {
        if self.report_token_env.is_some() || self.report_token_file.is_some() {
            (
                self.report_token_env.as_ref(),
                self.report_token_file.as_ref(),
            )
        } else {
            (
                self.ingest_token_env.as_ref(),
                self.ingest_token_file.as_ref(),
            )
        }
    }
}

/// The route-table resource a gateway follows.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteTableRef {
    /// The controller's namespace.
    pub namespace: String,
    /// The resource's name: the controller's Lease name.
    #[serde(default = "default_route_table_name")]
    pub name: String,
}

/// How a gateway follows the controller's watch API.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WatchTransport {
    /// SSE, falling back to long-poll where the stream is refused (a proxy that
    /// does not pass it).
    #[default]
    Auto,
    /// Only SSE.
    Sse,
    /// Only long-poll.
    LongPoll,
    /// The gRPC stream (HTTP/2), acknowledging every table on it.
    Grpc,
}

impl From<WatchTransport> for stanch_client::Transport {
    fn from(t: WatchTransport) -> stanch_client::Transport {
        match t {
            WatchTransport::Auto => stanch_client::Transport::Auto,
            WatchTransport::Sse => stanch_client::Transport::Sse,
            WatchTransport::LongPoll => stanch_client::Transport::LongPoll,
            WatchTransport::Grpc => stanch_client::Transport::Grpc,
        }
    }
}

fn default_route_table_name() -> String {
    "stanch".to_owned()
}

fn default_report_interval() -> HumanDuration {
    HumanDuration::secs(5)
}

/// One problem, with its path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// Where.
    pub path: String,
    /// What.
    pub message: String,
}

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// Not YAML of the right shape.
    #[error("cannot parse configuration: {0}")]
    Parse(String),
    /// Shape right, content wrong.
    #[error("invalid configuration ({} problem(s)):\n{}", .0.len(), .0.iter().map(|p| format!("  - {}: {}", p.path, p.message)).collect::<Vec<_>>().join("\n"))]
    Invalid(Vec<Problem>),
}

/// Whether a model name is a glob.
pub fn is_glob(name: &str) -> bool {
    name.contains(['*', '?'])
}

impl GatewayConfig {
    /// Parses and validates YAML.
    pub fn from_yaml(text: &str) -> Result<GatewayConfig, ConfigError> {
        let config: GatewayConfig =
            serde_yaml::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))?;
        let problems = config.validate();
        if problems.is_empty() {
            Ok(config)
        } else {
            Err(ConfigError::Invalid(problems))
        }
    }

    /// Every problem, with its path.
    pub fn validate(&self) -> Vec<Problem> {
        let mut out = Vec::new();
        let mut problem = |path: String, message: String| out.push(Problem { path, message });
        if self.models.is_empty() {
            problem("models".into(), "at least one model is needed".into());
        }
        self.validate_models(&mut problem);
        self.validate_callers_and_faqs(&mut problem);
        self.validate_limits(&mut problem);
        out
    }

    /// Each model: its pools, their endpoints, and the models it names.
    fn validate_models(&self, mut problem: impl FnMut(String, String)) {
        for (name, m) in &self.models {
            let at = format!("models.{name}");
            if m.pools.is_empty() {
                problem(
                    format!("{at}.pools"),
                    "a model needs at least one pool".into(),
                );
            }
            let mut seen = BTreeSet::new();
            for (i, pool) in m.pools.iter().enumerate() {
                if !seen.insert(&pool.name) {
                    problem(
                        format!("{at}.pools[{i}]"),
                        format!("pool {:?} is listed twice", pool.name),
                    );
                }
                if pool.endpoints.is_empty() {
                    problem(
                        format!("{at}.pools[{i}].endpoints"),
                        "a pool needs at least one endpoint".into(),
                    );
                }
                for (j, e) in pool.endpoints.iter().enumerate() {
                    let ep = format!("{at}.pools[{i}].endpoints[{j}]");
                    validate_endpoint(&ep, e, &mut problem);
                }
            }
            if let Some(hedge) = m.hedge_after {
                let first_token = m.first_token_timeout.unwrap_or(self.timeouts.first_token);
                if hedge.0.is_zero() || hedge.0 >= first_token.0 {
                    problem(
                        format!("{at}.hedge_after"),
                        format!(
                            "{hedge} must be more than 0s and less than the first-token timeout ({first_token})"
                        ),
                    );
                }
            }
            for (i, f) in m.fallbacks.iter().enumerate() {
                if f == name || !self.models.contains_key(f) || is_glob(f) {
                    problem(
                        format!("{at}.fallbacks[{i}]"),
                        format!("{f:?} is not another configured model"),
                    );
                }
            }
            if let Some(l) = &m.larger_context
                && (l == name || !self.models.contains_key(l))
            {
                problem(
                    format!("{at}.larger_context"),
                    format!("{l:?} is not another configured model"),
                );
            }
            if let Some(faq) = &m.faq
                && !self.faq_sets.contains_key(faq)
            {
                problem(
                    format!("{at}.faq"),
                    format!("FAQ set {faq:?} is not configured"),
                );
            }
        }
    }

    /// Tenants' keys, and FAQ sets' answers.
    fn validate_callers_and_faqs(&self, mut problem: impl FnMut(String, String)) {
        for (i, t) in self.tenants.iter().enumerate() {
            let sources = [t.key_env.is_some(), t.key_file.is_some(), t.key.is_some()]
                .iter()
                .filter(|s| **s)
                .count();
            if sources != 1 {
                problem(
                    format!("tenants[{i}]"),
                    "give exactly one of key_env, key_file, key".into(),
                );
            }
        }
        for (name, set) in &self.faq_sets {
            if set.default_answer.trim().is_empty() {
                problem(
                    format!("faq_sets.{name}.default_answer"),
                    "must not be empty".into(),
                );
            }
            for (i, e) in set.entries.iter().enumerate() {
                if e.questions.is_empty() {
                    problem(
                        format!("faq_sets.{name}.entries[{i}].questions"),
                        "at least one question".into(),
                    );
                }
            }
        }
    }

    /// Retries, blocking, sizes, timeouts and the controller's URL.
    // Size: one check per limit, in the order of the configuration reference.
    fn validate_limits(&self, mut problem: impl FnMut(String, String)) {
        let r = &self.retry;
        if r.max_attempts == 0 || r.attempts_per_pool == 0 {
            problem(
                "retry".into(),
                "max_attempts and attempts_per_pool must be at least 1".into(),
            );
        }
        if r.same_endpoint > MAX_SAME_ENDPOINT {
            problem(
                "retry.same_endpoint".into(),
                format!(
                    "{} attempts again at one endpoint is too many: at most {MAX_SAME_ENDPOINT}",
                    r.same_endpoint
                ),
            );
        }
        if r.stream_resumes > MAX_STREAM_RESUMES {
            problem(
                "retry.stream_resumes".into(),
                format!(
                    "{} resumes of one stream is too many: at most {MAX_STREAM_RESUMES}",
                    r.stream_resumes
                ),
            );
        }
        if r.retry_after_max.0 >= self.timeouts.total.0 {
            problem(
                "retry.retry_after_max".into(),
                format!(
                    "{} would wait out the whole request: it must be shorter than timeouts.total ({})",
                    r.retry_after_max, self.timeouts.total
                ),
            );
        }
        if !(0.0..=1.0).contains(&r.budget_ratio) {
            problem(
                "retry.budget_ratio".into(),
                "must be between 0 and 1".into(),
            );
        }
        let b = &self.blocking;
        if !(0.0..=1.0).contains(&b.failure_rate) {
            problem(
                "blocking.failure_rate".into(),
                "must be between 0 and 1".into(),
            );
        }
        if b.probe.enabled && b.probe.successes == 0 {
            problem(
                "blocking.probe.successes".into(),
                "must be at least 1".into(),
            );
        }
        for (path, bytes) in [
            ("max_body_bytes", self.max_body_bytes),
            ("max_response_bytes", self.max_response_bytes),
            ("max_partial_body_bytes", self.max_partial_body_bytes),
            ("max_connections", self.max_connections),
        ] {
            if bytes == 0 {
                problem(path.into(), "must be at least 1".into());
            }
        }
        if !(0.0..=0.5).contains(&b.jitter) {
            problem("blocking.jitter".into(), "must be between 0 and 0.5".into());
        }
        for (path, d) in [
            ("timeouts.connect", self.timeouts.connect),
            ("timeouts.body", self.timeouts.body),
            ("timeouts.first_byte", self.timeouts.first_byte),
            ("timeouts.first_token", self.timeouts.first_token),
            ("timeouts.stream_idle", self.timeouts.stream_idle),
            ("timeouts.total", self.timeouts.total),
            ("timeouts.caller_idle", self.timeouts.caller_idle),
            ("blocking.ttl", b.ttl),
            ("blocking.probe.interval", b.probe.interval),
            ("blocking.probe.timeout", b.probe.timeout),
            ("blocking.window", b.window),
        ] {
            if d.0.is_zero() {
                problem(path.into(), "must be longer than 0s".into());
            }
        }
        if let Some(c) = &self.controller {
            match &c.url {
                Some(url) if !(url.starts_with("http://") || url.starts_with("https://")) => {
                    problem(
                        "controller.url".into(),
                        format!("{url:?} is not an http(s) URL"),
                    );
                }
                None if c.route_table.is_none() => problem(
                    "controller".into(),
                    "give url (the watch API), route_table (the resource), or both".into(),
                ),
                _ => {}
            }
            if let Some(r) = &c.route_table {
                if !cfg!(feature = "kubernetes") {
                    problem(
                        "controller.route_table".into(),
                        "this gateway was built without feature `kubernetes`".into(),
                    );
                }
                for (path, value) in [("namespace", &r.namespace), ("name", &r.name)] {
                    if value.is_empty() || value.len() > 253 {
                        problem(
                            format!("controller.route_table.{path}"),
                            "must be 1 to 253 characters".into(),
                        );
                    }
                }
            }
        }
    }
}

/// Reads a secret from an environment variable or a file.
pub fn secret(
    env: Option<&String>,
    file: Option<&String>,
    literal: Option<&String>,
) -> Result<Option<SecretString>, String> {
    if let Some(var) = env {
        return std::env::var(var)
            .map(|v| Some(SecretString::from(v.trim().to_owned())))
            .map_err(|_| format!("environment variable {var} is not set"));
    }
    if let Some(path) = file {
        return std::fs::read_to_string(path)
            .map(|v| Some(SecretString::from(v.trim().to_owned())))
            .map_err(|e| format!("cannot read {path}: {e}"));
    }
    Ok(literal.map(|v| SecretString::from(v.clone())))
}

/// One endpoint, at `ep` in the configuration.
fn validate_endpoint(ep: &str, e: &EndpointConfig, problem: &mut impl FnMut(String, String)) {
    if !(e.url.starts_with("http://") || e.url.starts_with("https://")) {
        problem(
            format!("{ep}.url"),
            format!("{:?} is not an http(s) URL", e.url),
        );
    }
    if let Err(why) = e
        .url
        .parse::<axum::http::Uri>()
        .map_err(|e| e.to_string())
        .and_then(|u| {
            if u.host().is_none_or(str::is_empty) {
                Err("no host".to_owned())
            } else if u.query().is_some() {
                Err("a query string cannot be joined with /v1 paths".to_owned())
            } else {
                Ok(())
            }
        })
    {
        problem(format!("{ep}.url"), format!("{:?}: {why}", e.url));
    }
    if e.weight == 0 {
        problem(format!("{ep}.weight"), "must be at least 1".into());
    }
    if e.capacity == 0 {
        problem(format!("{ep}.capacity"), "must be at least 1".into());
    }
    if e.api_key_env.is_some() && e.api_key_file.is_some() {
        problem(
            ep.to_owned(),
            "give api_key_env or api_key_file, not both".into(),
        );
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_watch_transport_is_chosen_in_config_and_a_wrong_one_refused() {
        let base = "models: {m: {pools: [{name: p, endpoints: [{url: 'http://127.0.0.1:1'}]}]}}\n";
        for (word, transport) in [
            ("auto", stanch_client::Transport::Auto),
            ("sse", stanch_client::Transport::Sse),
            ("long_poll", stanch_client::Transport::LongPoll),
            ("grpc", stanch_client::Transport::Grpc),
        ] {
            let yaml = format!("{base}controller: {{url: 'http://c:9797', watch: {word}}}\n");
            let config = GatewayConfig::from_yaml(&yaml).unwrap();
            let chosen: stanch_client::Transport = config.controller.unwrap().watch.into();
            assert_eq!(chosen, transport, "{word}");
        }
        let yaml = format!("{base}controller: {{url: 'http://c:9797', watch: grcp}}\n");
        let err = GatewayConfig::from_yaml(&yaml).unwrap_err().to_string();
        assert!(
            err.contains("controller.watch") && err.contains("grpc"),
            "{err}"
        );
    }

    use super::*;

    /// The problems of `yaml`, as `path: message` lines.
    fn problems(yaml: &str) -> Vec<String> {
        match GatewayConfig::from_yaml(yaml) {
            Ok(_) => Vec::new(),
            Err(ConfigError::Invalid(problems)) => problems
                .into_iter()
                .map(|p| format!("{}: {}", p.path, p.message))
                .collect(),
            Err(e) => vec![e.to_string()],
        }
    }

    #[test]
    fn every_problem_is_named_by_its_path() {
        let found = problems(
            r#"
models:
  m:
    fallbacks: [ghost]
    hedge_after: 20s
    pools:
      - name: a
        prefill: vllm
        endpoints:
          - {url: "ftp://10.0.0.1"}
          - {url: "http://10.0.0.2:8000/?v=1", weight: 0}
          - {url: "https://", capacity: 0}
timeouts: {connect: 0s, total: 30s}
max_response_bytes: 0
retry: {same_endpoint: 50, retry_after_max: 1m, stream_resumes: 9}
"#,
        );
        let expected = [
            "models.m.pools[0].endpoints[0].url: \"ftp://10.0.0.1\" is not an http(s) URL",
            "models.m.pools[0].endpoints[1].url: \"http://10.0.0.2:8000/?v=1\": a query string cannot be joined with /v1 paths",
            "models.m.pools[0].endpoints[1].weight: must be at least 1",
            "models.m.pools[0].endpoints[2].capacity: must be at least 1",
            "max_response_bytes: must be at least 1",
            "timeouts.connect: must be longer than 0s",
            "retry.same_endpoint: 50 attempts again at one endpoint is too many: at most 3",
            "retry.stream_resumes: 9 resumes of one stream is too many: at most 3",
            "models.m.hedge_after: 20s must be more than 0s and less than the first-token timeout (15s)",
            "retry.retry_after_max: 1m would wait out the whole request: it must be shorter than timeouts.total (30s)",
        ];
        for line in expected {
            assert!(found.iter().any(|f| f == line), "{line}\nin {found:#?}");
        }
        assert!(
            found
                .iter()
                .any(|f| f.starts_with("models.m.pools[0].endpoints[2].url:")),
            "a URL without a host: {found:#?}"
        );
        assert!(
            found.iter().any(|f| f.starts_with("models.m.fallbacks")),
            "{found:#?}"
        );
    }

    #[test]
    fn a_controller_needs_a_url_or_the_route_table_resource() {
        let models =
            "models:\n  m:\n    pools: [{name: a, endpoints: [{url: 'http://10.0.0.1'}]}]\n";
        let neither = problems(&format!(
            "{models}controller: {{state_file: /tmp/r.json}}\n"
        ));
        assert_eq!(
            neither,
            ["controller: give url (the watch API), route_table (the resource), or both"]
        );
        let resource = format!("{models}controller: {{route_table: {{namespace: monitoring}}}}\n");
        // The tests build the gateway with feature `kubernetes`.
        assert_eq!(problems(&resource), Vec::<String>::new());
        let config = GatewayConfig::from_yaml(&resource).unwrap();
        let route_table = config.controller.unwrap().route_table.unwrap();
        assert_eq!(
            (route_table.namespace.as_str(), route_table.name.as_str()),
            ("monitoring", "stanch")
        );
        let empty = problems(&format!(
            "{models}controller: {{route_table: {{namespace: ''}}}}\n"
        ));
        assert_eq!(
            empty,
            ["controller.route_table.namespace: must be 1 to 253 characters"]
        );
    }

    #[test]
    fn the_documented_example_is_valid() {
        let doc = include_str!("../../../docs/gateway.md");
        let section = &doc[doc
            .find("## Configuration")
            .expect("a configuration section")..];
        let example = section
            .split("```yaml\n")
            .nth(1)
            .and_then(|rest| rest.split("```").next())
            .expect("a YAML example");
        let config = GatewayConfig::from_yaml(example).unwrap_or_else(|e| panic!("{e}"));
        assert!(config.models.contains_key("qwen-72b"));
        assert_eq!(
            config.tls.ca_file.as_deref(),
            Some("/etc/gw/internal-ca.pem")
        );
    }

    #[test]
    fn unknown_keys_are_refused_and_defaults_are_sound() {
        let found = problems("models: {}\nupstream_tls: {ca_file: x}\n");
        assert!(
            found[0].contains("unknown field `upstream_tls`"),
            "{found:?}"
        );
        let config = GatewayConfig::from_yaml(
            "models:\n  m:\n    pools: [{name: a, endpoints: [{url: 'https://api.example.com/openai'}]}]\n",
        )
        .unwrap();
        assert_eq!(config.timeouts.idle_connection.0, Duration::from_secs(4));
        assert_eq!(config.timeouts.caller_idle.0, Duration::from_secs(75));
        assert_eq!(config.max_response_bytes, 64 << 20);
        assert!(config.tls.ca_file.is_none());
    }
}
