//! The gateway's metrics, named in one place. Labels are bounded: models and endpoint
//! URLs come from the configuration, never from requests.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use prometheus_client::encoding::{EncodeLabelSet, EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::{self, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::exponential_buckets;
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::Registry;
pub use stanch_net::exposition::Label;

use crate::per_worker::PerWorker;

/// A counter that every request moves, kept per worker thread.
pub type WorkerCounter = Counter<u64, CounterShares>;

/// A counter's value as a share per worker thread, summed when read.
#[derive(Debug, Default)]
pub struct CounterShares(PerWorker<AtomicU64>);

impl counter::Atomic<u64> for CounterShares {
    fn inc(&self) -> u64 {
        self.inc_by(1)
    }

    /// Returns this thread's share before the increment (not the total: summing the
    /// shares would read every worker's cache line, which is what this avoids).
    fn inc_by(&self, v: u64) -> u64 {
        self.0.mine().fetch_add(v, Ordering::Relaxed)
    }

    fn get(&self) -> u64 {
        self.0.iter().map(|s| s.load(Ordering::Relaxed)).sum()
    }
}

/// A histogram kept as a share per worker thread (a single one is a lock that every
/// request takes, on every core), summed when scraped.
#[derive(Debug, Clone)]
pub struct WorkerHistogram(Arc<Shares>);

#[derive(Debug)]
struct Shares {
    /// Upper bounds, ascending; `+Inf` is implied.
    bounds: Box<[f64]>,
    shares: PerWorker<Mutex<Share>>,
}

/// One thread's observations.
#[derive(Debug)]
struct Share {
    sum: f64,
    count: u64,
    /// Per bucket (not cumulative), `+Inf` last.
    buckets: Box<[u64]>,
}

impl WorkerHistogram {
    /// A histogram with these upper bounds (ascending).
    pub fn new(bounds: impl IntoIterator<Item = f64>) -> WorkerHistogram {
        let bounds: Box<[f64]> = bounds.into_iter().collect();
        let shares = PerWorker::new(|| {
            Mutex::new(Share {
                sum: 0.0,
                count: 0,
                buckets: vec![0; bounds.len() + 1].into(),
            })
        });
        WorkerHistogram(Arc::new(Shares { bounds, shares }))
    }

    /// Counts `v` in the first bucket whose bound is at least `v`.
    pub fn observe(&self, v: f64) {
        let bucket = self.0.bounds.partition_point(|b| *b < v);
        let mut share = self.0.shares.mine().lock().expect("histogram lock");
        share.sum += v;
        share.count += 1;
        share.buckets[bucket] += 1;
    }

    /// (sum, count, per-bucket counts with their bounds), over every thread's share.
    fn total(&self) -> (f64, u64, Vec<(f64, u64)>) {
        let mut buckets: Vec<(f64, u64)> = self
            .0
            .bounds
            .iter()
            .copied()
            .chain([f64::MAX])
            .map(|b| (b, 0))
            .collect();
        let (mut sum, mut count) = (0.0, 0);
        for share in self.0.shares.iter() {
            let share = share.lock().expect("histogram lock");
            sum += share.sum;
            count += share.count;
            for (total, n) in buckets.iter_mut().zip(&share.buckets) {
                total.1 += n;
            }
        }
        (sum, count, buckets)
    }
}

impl TypedMetric for WorkerHistogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for WorkerHistogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let (sum, count, buckets) = self.total();
        encoder.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

/// Labels of a finished request.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// The model asked for (its configured name).
    pub model: Label,
    /// The model that answered (an alias, a fallback, or `faq`).
    pub served_model: Label,
    /// The pool that answered.
    pub pool: Label,
    /// The endpoint that answered.
    pub endpoint: Label,
    /// `2xx`, `4xx`, `5xx`.
    pub status_class: &'static str,
    /// The last attempt's outcome, or `static`/`faq_fallback`.
    pub outcome: &'static str,
}

/// Labels of a broken stream's resume.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResumeLabels {
    /// `prefill`, `regenerate` or `none`.
    pub how: &'static str,
    /// `spliced`, `diverged` or `unavailable`.
    pub result: &'static str,
}

/// Labels of a hedged stream.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WinnerLabel {
    /// `original`, `hedge` or `neither`.
    pub winner: &'static str,
}

/// Labels of one upstream attempt.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AttemptLabels {
    /// The model the endpoint served.
    pub model: Label,
    /// The endpoint's pool.
    pub pool: Label,
    /// The endpoint.
    pub endpoint: Label,
    /// Its outcome.
    pub outcome: &'static str,
}

/// Labels of one active probe.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProbeLabels {
    /// The model the endpoint serves.
    pub model: Label,
    /// The endpoint's pool.
    pub pool: Label,
    /// The endpoint.
    pub endpoint: Label,
    /// `success` or `failure`.
    pub outcome: &'static str,
}

/// A model label.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabel {
    /// The model.
    pub model: Label,
}

/// A kind label from a fixed set.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    /// The kind.
    pub kind: &'static str,
}

/// An endpoint, its model and its pool.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EndpointLabels {
    /// The endpoint.
    pub endpoint: Label,
    /// The model.
    pub model: Label,
    /// The endpoint's pool: lets a rule see a pool whose every endpoint is blocked.
    pub pool: Label,
}

/// A worker thread, by index.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WorkerLabel {
    /// The worker's index (`0`, `1`, ...).
    pub worker: u32,
}

/// Every gateway metric.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Requests by model, served model, pool, endpoint, status class and outcome.
    pub requests: Family<RequestLabels, WorkerCounter>,
    /// Upstream attempts by model, pool, endpoint and outcome (the alerting rules' input).
    pub attempts: Family<AttemptLabels, WorkerCounter>,
    /// Request latency (to the last byte), by model.
    pub latency: Family<ModelLabel, WorkerHistogram>,
    /// Time to first token of streamed answers, by model.
    pub ttft: Family<ModelLabel, WorkerHistogram>,
    /// Requests turned away before routing (bad JSON, unknown model, unknown key, too
    /// large), by kind: bounded, unlike the names callers send.
    pub rejected: Family<KindLabel, Counter>,
    /// Retries, by model.
    pub retries: Family<ModelLabel, Counter>,
    /// Attempts again at the same endpoint, by why: `transient` (a one-off fault) or
    /// `retry_after` (a 429's wait, waited out).
    pub same_endpoint_retries: Family<KindLabel, Counter>,
    /// Streams that broke after their first token and were continued elsewhere, by
    /// how (`prefill`, `regenerate`; `none` when no target gave a continuation) and
    /// how it went (`spliced`: the continuation reached the caller; `diverged`: a
    /// regenerated answer did not match what the caller had; `unavailable`).
    pub stream_resumes: Family<ResumeLabels, Counter>,
    /// Streams sent to a second target after `hedge_after` without a first token,
    /// by which of the two served the caller (`original`, `hedge`, `neither`).
    pub hedges: Family<WinnerLabel, Counter>,
    /// Fallbacks by kind: `pool`, `model`, `larger_context`, `faq`.
    pub fallbacks: Family<KindLabel, Counter>,
    /// Answers from an alias model while degraded, by requested model.
    pub degraded: Family<ModelLabel, Counter>,
    /// Static (FAQ) answers, by model.
    pub static_answers: Family<ModelLabel, Counter>,
    /// Active probes of endpoints that get no traffic (blocked here, or in a pool the
    /// route table has failed away from), by model, pool, endpoint and outcome: the
    /// rules' evidence about a pool that no longer has traffic.
    pub probes: Family<ProbeLabels, Counter>,
    /// Passive blocks made, by trigger.
    pub blocks: Family<KindLabel, Counter>,
    /// 1 while an endpoint is blocked for a model (locally or by the table).
    pub endpoint_blocked: Family<EndpointLabels, Gauge>,
    /// 1 while this gateway's own passive blocking holds an endpoint: evidence the
    /// controller does not have (it knows its own blocks).
    pub endpoint_blocked_locally: Family<EndpointLabels, Gauge>,
    /// Connections opened to an endpoint: about one per request means keep-alive is not
    /// working (an upstream closing after each answer, or an idle limit too short).
    pub connections_opened: Family<EndpointLabels, Counter>,
    /// Keep-alive connections to an endpoint held idle for reuse.
    pub connections_idle: Family<EndpointLabels, Gauge>,
    /// Times every candidate was blocked and one was used anyway.
    pub all_blocked: Counter,
    /// Malformed stream chunks dropped.
    pub malformed_chunks: Counter,
    /// Retries refused by the retry budget.
    pub budget_exhausted: Counter,
    /// Log lines dropped because the log output could not keep up; set from the
    /// writer's count at each scrape.
    pub log_lines_dropped: Counter,
    /// Caller connections each worker thread serves.
    pub worker_connections: Family<WorkerLabel, Gauge>,
    /// The applied route version (0 without one).
    pub route_version: Gauge,
    /// Seconds since the applied route table was generated.
    pub route_age_seconds: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Adds the caller-facing listener's connections: `stanch_gateway_connections_open`
    /// and `stanch_gateway_connections_refused_total{reason}`.
    pub fn register_connections(&mut self, conns: &Arc<stanch_net::Connections>) {
        self.registry.register_collector(conns.collector());
    }

    /// Registers every metric: one registration a family, in the order `/metrics` lists
    /// them (long, and flat on purpose: it is the catalogue).
    // Size: one registration per metric, each named and described once.
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("stanch_gateway");
        let histogram = || WorkerHistogram::new(exponential_buckets(0.000_5, 2.0, 18));
        let m = Metrics {
            registry: Registry::default(),
            requests: Family::default(),
            attempts: Family::default(),
            latency: Family::new_with_constructor(histogram),
            ttft: Family::new_with_constructor(histogram),
            rejected: Family::default(),
            retries: Family::default(),
            same_endpoint_retries: Family::default(),
            stream_resumes: Family::default(),
            hedges: Family::default(),
            fallbacks: Family::default(),
            degraded: Family::default(),
            static_answers: Family::default(),
            probes: Family::default(),
            blocks: Family::default(),
            endpoint_blocked: Family::default(),
            endpoint_blocked_locally: Family::default(),
            connections_opened: Family::default(),
            connections_idle: Family::default(),
            worker_connections: Family::default(),
            all_blocked: Counter::default(),
            malformed_chunks: Counter::default(),
            budget_exhausted: Counter::default(),
            log_lines_dropped: Counter::default(),
            route_version: Gauge::default(),
            route_age_seconds: Gauge::default(),
        };
        registry.register(
            "requests",
            "Requests by model, served model, pool, endpoint, status class and outcome",
            m.requests.clone(),
        );
        registry.register(
            "upstream_attempts",
            "Upstream attempts by model, pool, endpoint and outcome",
            m.attempts.clone(),
        );
        registry.register(
            "request_duration_seconds",
            "Request latency to the last byte",
            m.latency.clone(),
        );
        registry.register(
            "time_to_first_token_seconds",
            "Time to the first streamed token",
            m.ttft.clone(),
        );
        registry.register(
            "rejected_requests",
            "Requests turned away before routing, by kind",
            m.rejected.clone(),
        );
        registry.register(
            "retries",
            "Retries on another endpoint, pool or model",
            m.retries.clone(),
        );
        registry.register(
            "same_endpoint_retries",
            "Attempts again at the same endpoint, by why (transient, retry_after)",
            m.same_endpoint_retries.clone(),
        );
        registry.register(
            "stream_resumes",
            "Broken streams continued elsewhere, by how and result",
            m.stream_resumes.clone(),
        );
        registry.register(
            "hedged_streams",
            "Streams hedged to a second target, by which served the caller",
            m.hedges.clone(),
        );
        registry.register("fallbacks", "Fallbacks by kind", m.fallbacks.clone());
        registry.register(
            "degraded_answers",
            "Answers from the alias model while degraded",
            m.degraded.clone(),
        );
        registry.register("static_answers", "FAQ answers", m.static_answers.clone());
        registry.register(
            "probes",
            "Active probes of endpoints without traffic, by outcome",
            m.probes.clone(),
        );
        registry.register(
            "blocks",
            "Passive endpoint blocks made, by trigger",
            m.blocks.clone(),
        );
        registry.register(
            "endpoint_blocked",
            "1 while the endpoint is blocked for the model",
            m.endpoint_blocked.clone(),
        );
        registry.register(
            "endpoint_blocked_locally",
            "1 while this gateway's passive blocking holds the endpoint",
            m.endpoint_blocked_locally.clone(),
        );
        registry.register(
            "upstream_connections_opened",
            "Connections opened to the endpoint",
            m.connections_opened.clone(),
        );
        registry.register(
            "worker_connections",
            "Caller connections each worker thread is serving",
            m.worker_connections.clone(),
        );
        registry.register(
            "upstream_connections_idle",
            "Keep-alive connections to the endpoint held for reuse",
            m.connections_idle.clone(),
        );
        registry.register(
            "all_candidates_blocked",
            "Requests sent to a blocked endpoint because every candidate was blocked",
            m.all_blocked.clone(),
        );
        registry.register(
            "malformed_chunks",
            "Malformed stream chunks dropped",
            m.malformed_chunks.clone(),
        );
        registry.register(
            "retry_budget_exhausted",
            "Retries refused by the retry budget",
            m.budget_exhausted.clone(),
        );
        registry.register(
            "log_lines_dropped",
            "Log lines (access log included) dropped because the log output could not keep up",
            m.log_lines_dropped.clone(),
        );
        registry.register(
            "route_version",
            "The applied route table version",
            m.route_version.clone(),
        );
        registry.register(
            "route_age_seconds",
            "Seconds since the applied route table was generated",
            m.route_age_seconds.clone(),
        );
        Metrics { registry, ..m }
    }

    /// The OpenMetrics text.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn shares_kept_on_every_worker_are_scraped_as_one_series() {
        let metrics = Arc::new(Metrics::new());
        let model = ModelLabel { model: "m".into() };
        let workers = stanch_net::Workers::start(2, "test-metrics").unwrap();
        // 0.3 ms, 3 ms and 300 s: in the first bucket (0.5 ms), the fourth (4 ms), +Inf.
        for (worker, seconds) in [(0, 0.000_3), (1, 0.003), (1, 300.0)] {
            let (metrics, model) = (metrics.clone(), model.clone());
            workers
                .spawn_on(worker, async move {
                    metrics.latency.get_or_create(&model).observe(seconds);
                    let labels = AttemptLabels {
                        model: "m".into(),
                        pool: "p".into(),
                        endpoint: "e".into(),
                        outcome: "success",
                    };
                    metrics.attempts.get_or_create(&labels).inc();
                })
                .await
                .unwrap();
        }
        let text = metrics.encode();
        let line = |name: &str| {
            text.lines()
                .find(|l| l.starts_with(name))
                .unwrap_or_else(|| panic!("no {name} in\n{text}"))
                .rsplit(' ')
                .next()
                .unwrap()
                .to_owned()
        };
        assert_eq!(
            line(
                r#"stanch_gateway_upstream_attempts_total{model="m",pool="p",endpoint="e",outcome="success"}"#
            ),
            "3"
        );
        assert_eq!(
            line(r#"stanch_gateway_request_duration_seconds_count{model="m"}"#),
            "3"
        );
        let sum: f64 = line(r#"stanch_gateway_request_duration_seconds_sum{model="m"}"#)
            .parse()
            .unwrap();
        assert!((sum - 300.0033).abs() < 1e-9, "{sum}");
        // Cumulative, as Prometheus reads buckets.
        let bucket = |le: &str| {
            line(&format!(
                r#"stanch_gateway_request_duration_seconds_bucket{{le="{le}",model="m"}}"#
            ))
        };
        assert_eq!(bucket("0.0005"), "1");
        assert_eq!(bucket("0.002"), "1");
        assert_eq!(bucket("0.004"), "2");
        assert_eq!(bucket("65.536"), "2");
        assert_eq!(bucket("+Inf"), "3");
    }
}
