//! The gateway itself: its models, tenants, FAQs, endpoints, metrics and the table it
//! applies, made once from the configuration ([`Gateway::new`]) and shared by every
//! request.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use secrecy::SecretString;
use stanch_api::RouteTable;
use stanch_ports::clock::Clock;

use crate::budget::RetryBudget;
use crate::config::{GatewayConfig, is_glob, secret};
use crate::endpoints::{Endpoint, glob};
use crate::faq::Faq;
use crate::metrics::{
    AttemptLabels, EndpointLabels, Label, Metrics, ModelLabel, ProbeLabels, RequestLabels,
    WorkerHistogram,
};
use crate::{endpoints, outcome, table, upstream};

/// A configured model, ready to serve.
pub(crate) struct ModelPlan {
    pub pools: Vec<(String, Vec<Arc<Endpoint>>)>,
    /// Requests routed by a split of this model's pools so far: the turn that spreads
    /// the next one by the shares (`crate::route`).
    pub turn: std::sync::atomic::AtomicU64,
    /// The same, for the split between this model and its alias.
    pub alias_turn: std::sync::atomic::AtomicU64,
}

/// A caller.
pub(crate) struct Tenant {
    pub key: SecretString,
    pub name: String,
    pub vip: bool,
}

/// The gateway, shared by every request.
pub struct Gateway {
    pub(crate) config: GatewayConfig,
    pub(crate) models: BTreeMap<String, ModelPlan>,
    pub(crate) globs: Vec<String>,
    pub(crate) tenants: Vec<Tenant>,
    pub(crate) faqs: BTreeMap<String, Faq>,
    pub(crate) budget: RetryBudget,
    pub(crate) routes: Option<stanch_client::Routes>,
    /// The current table with its blocks indexed, made once per table.
    applied: arc_swap::ArcSwapOption<table::Applied>,
    pub(crate) metrics: Metrics,
    /// How connections are made: the endpoints' pools and the controller's.
    pub(crate) connector: upstream::Connector,
    /// Per-model latency and time-to-first-token histograms, resolved once.
    pub(crate) model_histograms:
        std::collections::HashMap<String, (WorkerHistogram, WorkerHistogram)>,
    pub(crate) clock: Arc<dyn Clock>,
    /// How a caller's request body must arrive.
    pub(crate) body_limits: stanch_net::body::BodyLimits,
    /// The bytes of request bodies still arriving, held together.
    pub(crate) body_budget: stanch_net::body::BodyBudget,
    /// The worker threads' connection counts, when it serves on workers.
    pub(crate) workers: std::sync::OnceLock<stanch_net::Load>,
    /// The caller-facing listener's limits and its connections.
    pub(crate) conns: Arc<stanch_net::Connections>,
    /// How many log lines the process's log writer dropped, when it has one.
    pub(crate) log_drops: std::sync::OnceLock<stanch_log::Dropped>,
}

/// Every configured endpoint, model by model and pool by pool.
fn endpoints_of(models: &BTreeMap<String, ModelPlan>) -> impl Iterator<Item = &Arc<Endpoint>> {
    models
        .values()
        .flat_map(|m| m.pools.iter().flat_map(|(_, eps)| eps.iter()))
}

/// Why the gateway could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A secret named in the configuration could not be read.
    #[error("{what}: {why}")]
    Secret {
        /// Which setting.
        what: String,
        /// Why.
        why: String,
    },
    /// An endpoint's URL or key, or the upstream TLS settings, cannot be used.
    #[error("{what}")]
    Upstream {
        /// Which setting.
        what: String,
        /// Why.
        #[source]
        why: upstream::SetupError,
    },
}

impl Gateway {
    /// Builds the gateway; `routes` follows a controller when there is one.
    pub fn new(
        config: GatewayConfig,
        routes: Option<stanch_client::Routes>,
        clock: Arc<dyn Clock>,
    ) -> Result<Gateway, StartError> {
        let connector = upstream::Connector {
            tls: upstream::tls_connector(config.tls.ca_file.as_deref().map(Path::new)).map_err(
                |why| StartError::Upstream {
                    what: "tls.ca_file".into(),
                    why,
                },
            )?,
            connect_timeout: config.timeouts.connect.0,
            idle_timeout: config.timeouts.idle_connection.0,
        };
        let models = model_plans(&config, &connector)?;
        let tenants = tenants(&config)?;
        let faqs = config
            .faq_sets
            .iter()
            .map(|(name, set)| (name.clone(), Faq::new(set)))
            .collect();
        let r = &config.retry;
        let budget = RetryBudget::new(r.budget_ratio, r.budget_min_retries, r.budget_window.0);
        let globs = config
            .models
            .keys()
            .filter(|k| is_glob(k))
            .cloned()
            .collect();
        let conns = stanch_net::Connections::new(limits(&config));
        let mut metrics = Metrics::new();
        metrics.register_connections(&conns);
        for e in endpoints_of(&models) {
            start_counting(&metrics, e);
        }
        let model_histograms = config
            .models
            .keys()
            .map(|m| {
                let label = ModelLabel {
                    model: Label::from(m),
                };
                let latency = metrics.latency.get_or_create(&label).clone();
                let ttft = metrics.ttft.get_or_create(&label).clone();
                (m.clone(), (latency, ttft))
            })
            .collect();
        Ok(Gateway {
            models,
            globs,
            tenants,
            faqs,
            budget,
            routes,
            applied: arc_swap::ArcSwapOption::empty(),
            metrics,
            connector,
            model_histograms,
            clock,
            body_limits: stanch_net::body::BodyLimits {
                max_bytes: config.max_body_bytes,
                timeout: config.timeouts.body.0,
                min_rate: config.body_min_rate,
            },
            body_budget: stanch_net::body::BodyBudget::new(config.max_partial_body_bytes),
            config,
            workers: std::sync::OnceLock::new(),
            conns,
            log_drops: std::sync::OnceLock::new(),
        })
    }

    /// Reports the log writer's dropped lines as `stanch_gateway_log_lines_dropped_total`.
    pub fn count_log_drops(&self, dropped: stanch_log::Dropped) {
        let _ = self.log_drops.set(dropped);
    }

    /// Every configured endpoint.
    pub(crate) fn endpoints(&self) -> impl Iterator<Item = &Arc<Endpoint>> {
        endpoints_of(&self.models)
    }

    /// Whether active probing of blocked endpoints is on.
    pub fn config_probing(&self) -> bool {
        self.config.blocking.probe.enabled
    }

    /// The configured model serving a requested name: exact, else the first glob.
    pub(crate) fn resolve(&self, requested: &str) -> Option<&str> {
        if let Some((k, _)) = self.models.get_key_value(requested)
            && !is_glob(k)
        {
            return Some(k);
        }
        self.globs
            .iter()
            .find(|g| glob(g, requested))
            .map(String::as_str)
    }

    /// The applied route table, if any, with its blocks indexed.
    pub(crate) fn table(&self) -> Option<Arc<table::Applied>> {
        let current = self.routes.as_ref()?.current()?;
        if let Some(applied) = self.applied.load_full()
            && Arc::ptr_eq(applied.table(), &current)
        {
            return Some(applied);
        }
        // A new table: the first request to see it indexes it (workers that race
        // here each index it once; the last stored wins, and all are equal).
        let applied = Arc::new(table::Applied::new(current));
        self.applied.store(Some(applied.clone()));
        Some(applied)
    }

    /// Checks that a route table can be applied here (the controller hears why not).
    pub fn validator(config: &GatewayConfig) -> stanch_client::Validator {
        let faqs: Vec<String> = config.faq_sets.keys().cloned().collect();
        Arc::new(move |t: &RouteTable| {
            for (name, m) in &t.models {
                m.check_split().map_err(|e| {
                    stanch_api::Invalid::new(format!("models.{name}.{}", e.field), e.problem)
                })?;
                if let Some(faq) = &m.faq
                    && !faqs.contains(faq)
                {
                    return Err(stanch_api::Invalid::new(
                        format!("models.{name}.faq"),
                        format!("unknown FAQ set {faq:?}"),
                    ));
                }
            }
            Ok(())
        })
    }
}

/// Every configured model's pools and endpoints, each endpoint with its key and its
/// connection pool.
fn model_plans(
    config: &GatewayConfig,
    connector: &upstream::Connector,
) -> Result<BTreeMap<String, ModelPlan>, StartError> {
    let mut models = BTreeMap::new();
    for (name, m) in &config.models {
        let mut pools = Vec::new();
        // The only endpoint the model can be served from: a block on it leaves requests
        // nowhere else to go, so it is never extended.
        let alone =
            m.fallbacks.is_empty() && m.pools.iter().map(|p| p.endpoints.len()).sum::<usize>() == 1;
        for pool in &m.pools {
            let mut eps = Vec::new();
            for (j, e) in pool.endpoints.iter().enumerate() {
                let what = || format!("models.{name}.pools.{}.endpoints[{j}]", pool.name);
                let key = secret(e.api_key_env.as_ref(), e.api_key_file.as_ref(), None)
                    .map_err(|why| StartError::Secret { what: what(), why })?;
                let upstream = e
                    .upstream_model
                    .clone()
                    .or_else(|| (!is_glob(name)).then(|| name.clone()));
                let endpoint = Endpoint::new(
                    &e.url, name, &pool.name, e.weight, e.capacity, upstream, key, alone, connector,
                )
                .map_err(|why| StartError::Upstream { what: what(), why })?;
                eps.push(Arc::new(endpoint));
            }
            pools.push((pool.name.clone(), eps));
        }
        models.insert(
            name.clone(),
            ModelPlan {
                pools,
                turn: std::sync::atomic::AtomicU64::new(0),
                alias_turn: std::sync::atomic::AtomicU64::new(0),
            },
        );
    }
    Ok(models)
}

/// The callers, each with its key.
fn tenants(config: &GatewayConfig) -> Result<Vec<Tenant>, StartError> {
    let mut tenants = Vec::new();
    for (i, t) in config.tenants.iter().enumerate() {
        let key = secret(t.key_env.as_ref(), t.key_file.as_ref(), t.key.as_ref())
            .map_err(|why| StartError::Secret {
                what: format!("tenants[{i}]"),
                why,
            })?
            .ok_or_else(|| StartError::Secret {
                what: format!("tenants[{i}]"),
                why: "no key".into(),
            })?;
        tenants.push(Tenant {
            key,
            name: t.name.clone(),
            vip: t.vip,
        });
    }
    Ok(tenants)
}

/// Makes an endpoint's series exist from the start, at zero (a series that exists
/// before the first failure lets `rate()` see that failure on the very next scrape),
/// and hands it the counters every successful request increments.
fn start_counting(metrics: &Metrics, e: &Endpoint) {
    let requests_ok = metrics
        .requests
        .get_or_create(&RequestLabels {
            model: Label::from(&e.model),
            served_model: Label::from(&e.model),
            pool: Label::from(&e.pool),
            endpoint: Label::from(&e.url),
            status_class: "2xx",
            outcome: "success",
        })
        .clone();
    let attempts_ok = metrics
        .attempts
        .get_or_create(&AttemptLabels {
            model: Label::from(&e.model),
            pool: Label::from(&e.pool),
            endpoint: Label::from(&e.url),
            outcome: "success",
        })
        .clone();
    // Every outcome's series exists from the start, at zero.
    for outcome in outcome::LABELS {
        let _ = metrics.attempts.get_or_create(&AttemptLabels {
            model: Label::from(&e.model),
            pool: Label::from(&e.pool),
            endpoint: Label::from(&e.url),
            outcome,
        });
    }
    for outcome in ["success", "failure"] {
        let _ = metrics.probes.get_or_create(&ProbeLabels {
            model: Label::from(&e.model),
            pool: Label::from(&e.pool),
            endpoint: Label::from(&e.url),
            outcome,
        });
    }
    e.conns.count_opened_in(
        metrics
            .connections_opened
            .get_or_create(&EndpointLabels {
                endpoint: Label::from(&e.url),
                model: Label::from(&e.model),
                pool: Label::from(&e.pool),
            })
            .clone(),
    );
    let _ = e.hot.set(endpoints::HotCounters {
        requests_ok,
        attempts_ok,
    });
}

/// The route table a gateway has applied, if any (for status pages and tests).
pub fn applied_table(gateway: &Gateway) -> Option<Arc<RouteTable>> {
    gateway.table().map(|a| a.table().clone())
}

/// How the gateway's listener treats connections: a caller brings each request's
/// headers within `timeouts.caller_idle` (which also closes kept-alive connections
/// idle that long), a caller that takes no bytes for 30 s is cut off, and at shutdown
/// streams in flight get 30 s to finish (Kubernetes' default grace period) before
/// they are closed.
fn limits(config: &GatewayConfig) -> stanch_net::ConnLimits {
    stanch_net::ConnLimits {
        write_timeout: Duration::from_secs(30),
        header_timeout: config.timeouts.caller_idle.0,
        drain: Duration::from_secs(30),
        // Callers speak HTTP/1.1, as the OpenAI API does.
        http2: None,
        max_connections: config.max_connections,
        ..stanch_net::ConnLimits::default()
    }
}
