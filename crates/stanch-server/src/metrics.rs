//! Every metric the controller exports, named in one place. Labels are bounded sets:
//! model names come from the configuration, never from requests.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use stanch_api::routes::share_of;
pub use stanch_net::exposition::Label;

/// Label: which intake endpoint.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceLabel {
    /// `alertmanager` or `prometheus` or `reconcile`.
    pub source: &'static str,
}

/// Labels: why an alert or payload was rejected.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RejectLabels {
    /// The intake endpoint.
    pub source: &'static str,
    /// A stable reason.
    pub reason: &'static str,
}

/// Label: a configured model.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabel {
    /// The model.
    pub model: Label,
}

/// Labels: a pool of a model.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolLabels {
    /// The model.
    pub model: Label,
    /// The pool.
    pub pool: Label,
}

/// Labels: a rung transition.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TransitionLabels {
    /// The model.
    pub model: Label,
    /// `up` or `down`.
    pub direction: &'static str,
}

/// Label: a kind of thing, from a fixed set.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    /// The kind.
    pub kind: &'static str,
}

/// Labels: gateways by convergence and transport.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GatewayLabels {
    /// `converged`, `lagging` or `stale`.
    pub kind: &'static str,
    /// `poll`, `long_poll`, `sse` or `grpc`.
    pub transport: &'static str,
}

/// Label: a watch transport.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TransportLabel {
    /// `poll`, `long_poll`, `sse` or `grpc`.
    pub transport: &'static str,
}

/// Label: an override action.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ActionLabel {
    /// `force`, `release`, `freeze`, ...
    pub action: Label,
}

/// The controller's metrics.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Alerts accepted, by intake.
    pub alerts_received: Family<SourceLabel, Counter>,
    /// Alerts and payloads refused, by intake and reason.
    pub alerts_rejected: Family<RejectLabels, Counter>,
    /// Alerts that mapped to no condition.
    pub alerts_unmapped: Counter,
    /// Active alerts.
    pub alerts_active: Gauge,
    /// The rung per model (0 normal … 3 static), as published.
    pub model_rung: Family<ModelLabel, Gauge>,
    /// Rung changes per model and direction.
    pub transitions: Family<TransitionLabels, Counter>,
    /// Each pool's published share of a model's traffic, in percent.
    pub pool_share: Family<PoolLabels, Gauge>,
    /// 1 while the flap guard holds a model.
    pub flap_pinned: Family<ModelLabel, Gauge>,
    /// Active endpoint blocks.
    pub blocks_active: Gauge,
    /// Blocks made.
    pub blocks: Counter,
    /// Blocks not made at `blocking.max_blocks`, by reason (`limit`).
    pub blocks_refused: Family<KindLabel, Counter>,
    /// Report entries not counted, by reason (`unknown_model`, `unknown_endpoint`,
    /// `limit`).
    pub reports_refused: Family<KindLabel, Counter>,
    /// Overrides applied, by action.
    pub overrides: Family<ActionLabel, Counter>,
    /// The published route version.
    pub route_version: Gauge,
    /// Connected watchers by kind (`sse`, `long_poll`, `grpc`).
    pub watchers: Family<KindLabel, Gauge>,
    /// Seconds from an input's arrival to its route version being published.
    pub publish_latency: Histogram,
    /// State store failures, by operation.
    pub store_errors: Family<KindLabel, Counter>,
    /// 1 when the controller started over because its state was unreadable.
    pub state_corrupt_recovered: Gauge,
    /// 1 while dry-run is on.
    pub dry_run: Gauge,
    /// Frozen models; the global freeze counts every model.
    pub frozen: Gauge,
    /// Gateways by convergence (`converged`, `lagging`, `stale`) and transport.
    pub gateways: Family<GatewayLabels, Gauge>,
    /// The most versions a gateway that is not stale is behind, by transport.
    pub gateway_max_lag: Family<TransportLabel, Gauge>,
    /// Route tables gateways refused (each refused version counted once per gateway).
    pub gateway_nacks: Family<TransportLabel, Counter>,
    /// Alertmanager reconciliations by result.
    pub reconciliations: Family<KindLabel, Counter>,
    /// Decisions recorded in the history, by kind.
    pub decisions: Family<KindLabel, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Adds the API port's connections: `stanch_connections_open` and
    /// `stanch_connections_refused_total{reason}`.
    pub fn register_connections(&mut self, conns: &std::sync::Arc<stanch_net::Connections>) {
        self.registry.register_collector(conns.collector());
    }

    /// Registers every metric.
    // Size: one registration per metric, each named and described once.
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("stanch");
        let m = Metrics {
            alerts_received: Family::default(),
            alerts_rejected: Family::default(),
            alerts_unmapped: Counter::default(),
            alerts_active: Gauge::default(),
            model_rung: Family::default(),
            transitions: Family::default(),
            pool_share: Family::default(),
            flap_pinned: Family::default(),
            blocks_active: Gauge::default(),
            blocks_refused: Family::default(),
            reports_refused: Family::default(),
            blocks: Counter::default(),
            overrides: Family::default(),
            route_version: Gauge::default(),
            watchers: Family::default(),
            publish_latency: Histogram::new(exponential_buckets(0.000_05, 2.0, 18)),
            store_errors: Family::default(),
            state_corrupt_recovered: Gauge::default(),
            dry_run: Gauge::default(),
            frozen: Gauge::default(),
            gateways: Family::default(),
            gateway_max_lag: Family::default(),
            gateway_nacks: Family::default(),
            reconciliations: Family::default(),
            decisions: Family::default(),
            registry: Registry::default(),
        };
        registry.register(
            "alerts_received",
            "Alerts accepted, by intake",
            m.alerts_received.clone(),
        );
        registry.register(
            "alerts_rejected",
            "Alerts or payloads refused, by intake and reason",
            m.alerts_rejected.clone(),
        );
        registry.register(
            "alerts_unmapped",
            "Alerts that mapped to no condition",
            m.alerts_unmapped.clone(),
        );
        registry.register("alerts_active", "Active alerts", m.alerts_active.clone());
        registry.register(
            "model_rung",
            "Published ladder rung per model: 0 normal, 1 failover, 2 degraded, 3 static",
            m.model_rung.clone(),
        );
        registry.register(
            "transitions",
            "Rung changes per model and direction",
            m.transitions.clone(),
        );
        registry.register(
            "model_pool_share",
            "Published share of each model's traffic per pool, in percent: 100 on the pool taking it all, 0 on the others",
            m.pool_share.clone(),
        );
        registry.register(
            "flap_pinned",
            "1 while the flap guard holds the model",
            m.flap_pinned.clone(),
        );
        registry.register(
            "blocks_active",
            "Active endpoint blocks",
            m.blocks_active.clone(),
        );
        registry.register("blocks", "Endpoint blocks made", m.blocks.clone());
        registry.register(
            "blocks_refused",
            "Endpoint blocks not made at blocking.max_blocks, by reason",
            m.blocks_refused.clone(),
        );
        registry.register(
            "reports_refused",
            "Gateway report entries not counted, by reason",
            m.reports_refused.clone(),
        );
        registry.register(
            "overrides",
            "Operator overrides applied, by action",
            m.overrides.clone(),
        );
        registry.register(
            "route_version",
            "The published route table version",
            m.route_version.clone(),
        );
        registry.register(
            "watchers",
            "Connected route watchers, by kind",
            m.watchers.clone(),
        );
        registry.register(
            "publish_latency_seconds",
            "From an input's arrival to its route version being published",
            m.publish_latency.clone(),
        );
        registry.register(
            "store_errors",
            "State store failures, by operation",
            m.store_errors.clone(),
        );
        registry.register(
            "state_corrupt_recovered",
            "1 when the controller started over because its state was unreadable",
            m.state_corrupt_recovered.clone(),
        );
        registry.register("dry_run", "1 while dry-run is on", m.dry_run.clone());
        registry.register(
            "frozen_models",
            "Models automation may not move",
            m.frozen.clone(),
        );
        registry.register(
            "gateways",
            "Gateways by convergence state and watch transport",
            m.gateways.clone(),
        );
        registry.register(
            "gateway_max_lag_versions",
            "The most route versions a gateway that is not stale is behind, by watch transport",
            m.gateway_max_lag.clone(),
        );
        registry.register(
            "gateway_nacks",
            "Route tables gateways refused, by watch transport",
            m.gateway_nacks.clone(),
        );
        registry.register(
            "reconciliations",
            "Alertmanager reconciliations, by result",
            m.reconciliations.clone(),
        );
        registry.register(
            "decisions",
            "Decisions recorded, by kind",
            m.decisions.clone(),
        );
        Metrics { registry, ..m }
    }

    /// Counts a refused route table.
    pub fn count_nack(&self, transport: stanch_api::status::WatchTransport) {
        self.gateway_nacks
            .get_or_create(&TransportLabel {
                transport: transport.as_str(),
            })
            .inc();
    }

    /// The Prometheus text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}

impl Metrics {
    /// The gauges that follow the engine's state: each model's rung and flap pin,
    /// frozen models, dry-run, active alerts and blocks, the route version.
    pub(crate) fn set_state(&self, s: &stanch_core::EngineState) {
        let m = self;
        for (name, route) in &s.published.models {
            m.model_rung
                .get_or_create(&ModelLabel { model: name.into() })
                .set(route.rung.index() as i64);
            // Every configured pool, so that one losing its share reads 0, not stale.
            let configured = s.config.as_ref().and_then(|c| c.models.get(name));
            let pools = configured
                .into_iter()
                .flat_map(|c| c.pools.iter().map(|p| p.name()))
                .chain(configured.is_none().then_some(route.pool.as_str()));
            for pool in pools {
                let percent = share_of(&route.pool, &route.shares, pool);
                m.pool_share
                    .get_or_create(&PoolLabels {
                        model: name.into(),
                        pool: pool.into(),
                    })
                    .set(i64::from(percent));
            }
        }
        for (name, st) in &s.models {
            m.flap_pinned
                .get_or_create(&ModelLabel { model: name.into() })
                .set(i64::from(st.pin.is_some()));
        }
        let frozen = if s.global_freeze.is_some() {
            s.models.len()
        } else {
            s.models.values().filter(|m| m.freeze.is_some()).count()
        };
        m.frozen.set(frozen as i64);
        m.dry_run.set(i64::from(s.dry_run.is_some()));
        m.alerts_active.set(s.alerts.len() as i64);
        m.blocks_active.set(s.blocks.len() as i64);
        m.route_version
            .set(i64::try_from(s.version).unwrap_or(i64::MAX));
    }
}
