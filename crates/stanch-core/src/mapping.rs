//! Alerts to conditions.
//!
//! An alert maps by the seed convention (the `action` label with `target_model`,
//! `fallback_model`, `pool`, `shift`, `endpoint`) or, failing that, by the configured
//! matcher rules in order. An alert that maps to nothing is kept and counted as unmapped, with
//! the reason: it is not an error.

use std::fmt;

use serde::{Deserialize, Serialize};
use stanch_api::Labels;

use crate::config::{Config, MappingConfig};
use crate::rules::{Action, Matcher};

/// What an active alert means for routing.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Condition {
    /// `pool` of `model` is unhealthy: `shift` percent of its traffic should move to
    /// the next pool (100, all of it, unless the alert or its mapping asks for less).
    PoolDown {
        /// The model.
        model: String,
        /// The unhealthy pool.
        pool: String,
        /// The share of the pool's traffic to move away, 1 to 100.
        #[serde(default = "all", skip_serializing_if = "is_all")]
        shift: u8,
    },
    /// `model` is saturated; its non-VIP traffic should move to `fallback`.
    Saturated {
        /// The model.
        model: String,
        /// The model to move to, if the alert names one.
        fallback: Option<String>,
    },
    /// `model` should answer from its FAQ.
    Static {
        /// The model.
        model: String,
    },
    /// `endpoint` should be soft-blocked, for `model` or for every model.
    BlockEndpoint {
        /// The endpoint as gateways name it.
        endpoint: String,
        /// The model, or `None` for every model.
        model: Option<String>,
    },
}

/// A shift of everything: what a failover alert asks for unless it says otherwise.
pub const ALL: u8 = 100;

fn all() -> u8 {
    ALL
}

#[expect(
    clippy::trivially_copy_pass_by_ref,
    reason = "serde's skip_serializing_if passes a reference"
)]
fn is_all(shift: &u8) -> bool {
    *shift == ALL
}

/// Reads a shift as alerts and mappings give it: `75` or `75%`, from 1 to 100.
pub fn parse_shift(raw: &str) -> Result<u8, Unmapped> {
    let digits = raw
        .trim()
        .strip_suffix('%')
        .unwrap_or(raw.trim())
        .trim_end();
    digits
        .parse::<u8>()
        .ok()
        .filter(|p| (1..=ALL).contains(p))
        .ok_or_else(|| {
            Unmapped(format!(
                "shift {raw:?} is not a percentage from 1 to 100 (such as 75 or 75%)"
            ))
        })
}

impl Condition {
    /// The model the condition acts on, if it is about one.
    pub fn model(&self) -> Option<&str> {
        match self {
            Condition::PoolDown { model, .. }
            | Condition::Saturated { model, .. }
            | Condition::Static { model } => Some(model),
            Condition::BlockEndpoint { model, .. } => model.as_deref(),
        }
    }
}

impl fmt::Display for Condition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Condition::PoolDown {
                model,
                pool,
                shift: ALL,
            } => write!(f, "{model} pool {pool} failing"),
            Condition::PoolDown { model, pool, shift } => {
                write!(
                    f,
                    "{model} pool {pool} slow: {shift}% of its traffic to move"
                )
            }
            Condition::Saturated {
                model,
                fallback: Some(fb),
            } => {
                write!(f, "{model} saturated (fallback {fb})")
            }
            Condition::Saturated {
                model,
                fallback: None,
            } => write!(f, "{model} saturated"),
            Condition::Static { model } => write!(f, "{model} failing everywhere"),
            Condition::BlockEndpoint {
                endpoint,
                model: Some(m),
            } => {
                write!(f, "endpoint {endpoint} failing for {m}")
            }
            Condition::BlockEndpoint {
                endpoint,
                model: None,
            } => {
                write!(f, "endpoint {endpoint} failing")
            }
        }
    }
}

/// What an alert or its mapping names besides the target model and the endpoint.
struct Named {
    fallback: Option<String>,
    pool: Option<String>,
    shift: Option<String>,
    optional_model: Option<String>,
}

/// A validated mapping rule.
#[derive(Debug, Clone)]
struct Rule {
    config: MappingConfig,
    action: Action,
    matchers: Vec<Matcher>,
}

/// Why an alert maps to no condition.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unmapped(pub String);

/// Maps alerts to conditions, from a validated [`Config`].
#[derive(Debug, Clone)]
pub struct Mapper {
    rules: Vec<Rule>,
    /// Configured models with their pool names.
    models: std::collections::BTreeMap<String, Vec<String>>,
}

impl Mapper {
    /// Builds the mapper; `config` must have passed validation.
    pub fn new(config: &Config) -> Mapper {
        let rules = config
            .mappings
            .iter()
            .filter_map(|m| {
                Some(Rule {
                    action: m.action.parse().ok()?,
                    matchers: m
                        .matchers
                        .iter()
                        .map(|r| Matcher::parse(r))
                        .collect::<Result<_, _>>()
                        .ok()?,
                    config: m.clone(),
                })
            })
            .collect();
        let models = config
            .models
            .iter()
            .map(|(name, m)| {
                (
                    name.clone(),
                    m.pools.iter().map(|p| p.name().to_owned()).collect(),
                )
            })
            .collect();
        Mapper { rules, models }
    }

    /// The condition an alert's labels ask for.
    pub fn map(&self, labels: &Labels) -> Result<Condition, Unmapped> {
        if let Some(action) = labels.get("action")
            && let Ok(action) = action.parse::<Action>()
        {
            return self.seed(action, labels);
        }
        for rule in &self.rules {
            if rule.matchers.iter().all(|m| m.matches(labels)) {
                return self.by_rule(rule, labels);
            }
        }
        Err(Unmapped(match labels.get("action") {
            Some(a) => format!("unknown action {a:?} and no mapping rule matched"),
            None => "no action label and no mapping rule matched".to_owned(),
        }))
    }

    fn known_model(&self, model: &str) -> Result<String, Unmapped> {
        if self.models.contains_key(model) {
            Ok(model.to_owned())
        } else {
            Err(Unmapped(format!("model {model:?} is not configured")))
        }
    }

    fn seed(&self, action: Action, labels: &Labels) -> Result<Condition, Unmapped> {
        let label = |name: &str| labels.get(name).filter(|v| !v.is_empty()).cloned();
        let need = |name: &str| {
            label(name)
                .ok_or_else(|| Unmapped(format!("{} needs the label {name}", action.as_str())))
        };
        self.build(
            action,
            Named {
                fallback: label("fallback_model"),
                pool: label("pool"),
                shift: label("shift"),
                optional_model: label("target_model"),
            },
            || need("target_model"),
            || need("endpoint"),
        )
    }

    fn by_rule(&self, rule: &Rule, labels: &Labels) -> Result<Condition, Unmapped> {
        let c = &rule.config;
        let from = |literal: &Option<String>, label: &Option<String>| -> Option<String> {
            literal.clone().or_else(|| {
                label
                    .as_ref()
                    .and_then(|l| labels.get(l))
                    .filter(|v| !v.is_empty())
                    .cloned()
            })
        };
        let target = from(&c.target_model, &c.target_model_label);
        let named = format!("mapping {:?}", c.name);
        let shift = c
            .shift
            .map(|s| s.to_string())
            .or_else(|| from(&None, &c.shift_label));
        self.build(
            rule.action,
            Named {
                fallback: c.fallback_model.clone(),
                pool: from(&c.pool, &c.pool_label),
                shift,
                optional_model: target.clone(),
            },
            || {
                target
                    .clone()
                    .ok_or_else(|| Unmapped(format!("{named}: alert lacks the target model label")))
            },
            || {
                from(&None, &c.endpoint_label)
                    .ok_or_else(|| Unmapped(format!("{named}: alert lacks the endpoint label")))
            },
        )
    }

    fn build(
        &self,
        action: Action,
        named: Named,
        target: impl Fn() -> Result<String, Unmapped>,
        endpoint: impl Fn() -> Result<String, Unmapped>,
    ) -> Result<Condition, Unmapped> {
        let Named {
            fallback,
            pool,
            shift,
            optional_model,
        } = named;
        Ok(match action {
            Action::TriggerFailover => {
                let model = self.known_model(&target()?)?;
                // Without a pool label, the alert is about the model's primary pool.
                let pools = &self.models[&model];
                let pool = match pool {
                    None => pools.first().cloned().unwrap_or_default(),
                    Some(p) if pools.contains(&p) => p,
                    Some(p) => {
                        return Err(Unmapped(format!("pool {p:?} is not a pool of {model}")));
                    }
                };
                let shift = shift.as_deref().map_or(Ok(ALL), parse_shift)?;
                Condition::PoolDown { model, pool, shift }
            }
            Action::TriggerModelDegradation => Condition::Saturated {
                model: self.known_model(&target()?)?,
                fallback: fallback.map(|f| self.known_model(&f)).transpose()?,
            },
            Action::TriggerStaticFallback => Condition::Static {
                model: self.known_model(&target()?)?,
            },
            Action::BlockEndpoint => Condition::BlockEndpoint {
                endpoint: Some(endpoint()?)
                    .filter(|e| stanch_api::routes::valid_endpoint(e))
                    .ok_or_else(|| {
                        Unmapped(format!(
                            "the endpoint is not 1 to {} bytes without control characters",
                            stanch_api::routes::MAX_ENDPOINT_BYTES
                        ))
                    })?,
                model: optional_model.map(|m| self.known_model(&m)).transpose()?,
            },
        })
    }
}

#[cfg(test)]
mod tests;
