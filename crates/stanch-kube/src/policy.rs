//! A `StanchPolicy`'s spec as the engine's configuration: the model's entry and its
//! mapping rules, checked in the context of the rest of the policy (the fallback and
//! the FAQ set must exist, durations must be stanch durations within bounds) with the
//! configuration file's own rules. A spec is taken whole or not at all: every problem
//! comes back at its path in the resource (`spec.ladder.recoverAfter`), for the
//! policy's `Ready` condition and its Event.

use stanch_api::HumanDuration;
use stanch_core::config::{
    BackoffPolicy, FlapPolicy, LadderOverrides, MappingConfig, ModelConfig, PoolConfig,
};
use stanch_core::{Config, Problem};

use crate::crd::{PolicyLadder, PolicyMapping, StanchPolicySpec};

/// A policy's spec, as configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    /// The model's name.
    pub model: String,
    /// Its entry, as a `models` entry of the file would be.
    pub config: ModelConfig,
    /// Its mapping rules, each aimed at the model.
    pub mappings: Vec<MappingConfig>,
}

impl Policy {
    /// Reads `spec` as configuration, without checking it against anything: the
    /// policy, and the problems reading found (durations that do not read, which stand
    /// as one second in the policy returned).
    pub fn read(spec: &StanchPolicySpec) -> (Policy, Vec<Problem>) {
        let mut problems = Vec::new();
        let policy = Policy {
            model: spec.model.clone(),
            config: ModelConfig {
                pools: spec
                    .pools
                    .iter()
                    .map(|p| PoolConfig::Full {
                        name: p.name.clone(),
                        endpoints: p.endpoints.clone(),
                    })
                    .collect(),
                fallback: spec.fallback.clone(),
                faq: spec.faq.clone(),
                alias_exempt: spec
                    .alias_exempt
                    .clone()
                    .unwrap_or_else(|| vec!["vip".to_owned()]),
                ladder: spec
                    .ladder
                    .as_ref()
                    .map(|l| ladder(l, &mut problems))
                    .unwrap_or_default(),
            },
            mappings: spec
                .mappings
                .iter()
                .map(|m| mapping(m, &spec.model))
                .collect(),
        };
        (policy, problems)
    }

    /// Reads `spec`, and checks it within `base` (the configuration it joins): the
    /// policy, or every problem found, each at its path in the resource.
    pub fn check(spec: &StanchPolicySpec, base: &Config) -> Result<Policy, Vec<Problem>> {
        let (policy, mut problems) = Policy::read(spec);
        let mut joined = base.clone();
        joined
            .models
            .insert(policy.model.clone(), policy.config.clone());
        let first_mapping = joined.mappings.len();
        joined.mappings.extend(policy.mappings.iter().cloned());
        let own_model = format!("models.{}", policy.model);
        for p in joined.validate() {
            if let Some(rest) = p.path.strip_prefix(&own_model) {
                problems.push(at(&format!("spec{}", camel(rest)), p.message));
            } else if let Some(i) = mapping_index(&p.path)
                && i >= first_mapping
            {
                let rest = &p.path[p.path.find(']').map_or(p.path.len(), |e| e + 1)..];
                let path = format!("spec.mappings[{}]{}", i - first_mapping, camel(rest));
                problems.push(at(&path, p.message));
            }
            // Anything else is the base's, not this policy's.
        }
        if problems.is_empty() {
            Ok(policy)
        } else {
            Err(problems)
        }
    }
}

fn at(path: &str, message: String) -> Problem {
    Problem {
        path: path.to_owned(),
        message,
    }
}

/// `mappings[3].pool` → 3.
fn mapping_index(path: &str) -> Option<usize> {
    path.strip_prefix("mappings[")?
        .split(']')
        .next()?
        .parse()
        .ok()
}

/// A configuration path's snake_case segments as the resource's camelCase ones.
fn camel(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    let mut upper = false;
    for c in path.chars() {
        match c {
            '_' => upper = true,
            c if upper => {
                out.extend(c.to_uppercase());
                upper = false;
            }
            c => out.push(c),
        }
    }
    out
}

fn duration(path: &str, text: &str, problems: &mut Vec<Problem>) -> HumanDuration {
    text.parse().unwrap_or_else(|e| {
        problems.push(at(path, format!("{e}")));
        HumanDuration::secs(1)
    })
}

fn ladder(l: &PolicyLadder, problems: &mut Vec<Problem>) -> LadderOverrides {
    let mut d = |path: &str, text: &str| duration(&format!("spec.ladder.{path}"), text, problems);
    LadderOverrides {
        recover_after: l.recover_after.as_deref().map(|t| d("recoverAfter", t)),
        min_dwell: l.min_dwell.as_deref().map(|t| d("minDwell", t)),
        flap: l.flap.as_ref().map(|f| FlapPolicy {
            max_transitions: f.max_transitions as usize,
            window: d("flap.window", &f.window),
            hold: d("flap.hold", &f.hold),
        }),
        backoff: l.backoff.as_ref().map(|b| BackoffPolicy {
            factor: b.factor,
            max: d("backoff.max", &b.max),
            reset_after: d("backoff.resetAfter", &b.reset_after),
        }),
    }
}

fn mapping(m: &PolicyMapping, model: &str) -> MappingConfig {
    let action = serde_json::to_value(m.action)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default();
    MappingConfig {
        name: m.name.clone(),
        matchers: m.matchers.clone(),
        action,
        target_model: Some(model.to_owned()),
        target_model_label: None,
        fallback_model: m.fallback_model.clone(),
        pool: m.pool.clone(),
        pool_label: m.pool_label.clone(),
        shift: m.shift,
        shift_label: m.shift_label.clone(),
        endpoint_label: m.endpoint_label.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{PolicyAction, PolicyPool};

    fn base() -> Config {
        Config::from_yaml("models:\n  qwen-14b: {pools: [dc-a, dc-b]}\nfaq_sets: [default]\n")
            .unwrap()
    }

    fn spec() -> StanchPolicySpec {
        serde_yaml::from_str(
            "model: qwen-72b\npools: [{name: dc-a, endpoints: ['10.0.0.1:8000']}, {name: dc-b}]\n\
             fallback: qwen-14b\nfaq: default\nladder: {recoverAfter: 2m}\n\
             mappings:\n  - {name: pool-down, matchers: ['alertname=\"PoolDown\"'], \
             action: trigger-failover, poolLabel: pool}\n",
        )
        .unwrap()
    }

    #[test]
    fn a_valid_spec_is_the_models_entry_and_its_rules() {
        let policy = Policy::check(&spec(), &base()).unwrap();
        assert_eq!(policy.model, "qwen-72b");
        assert_eq!(policy.config.pools[0].endpoints(), ["10.0.0.1:8000"]);
        assert_eq!(policy.config.fallback.as_deref(), Some("qwen-14b"));
        assert_eq!(policy.config.alias_exempt, ["vip"], "the default");
        assert_eq!(
            policy.config.ladder.recover_after,
            Some(HumanDuration::secs(120))
        );
        let rule = &policy.mappings[0];
        assert_eq!(
            (rule.action.as_str(), rule.target_model.as_deref()),
            ("trigger-failover", Some("qwen-72b"))
        );
    }

    /// Every problem, at its path in the resource: the controller's own checks, with
    /// the resource's names.
    #[test]
    fn a_bad_spec_is_refused_whole_with_every_problem_at_its_path() {
        let mut bad = spec();
        bad.fallback = Some("qwen-7b".into());
        bad.faq = Some("nope".into());
        bad.pools.push(PolicyPool {
            name: "dc-a".into(),
            endpoints: vec![],
        });
        bad.ladder.as_mut().unwrap().recover_after = Some("soon".into());
        bad.ladder.as_mut().unwrap().min_dwell = Some("400d".into());
        bad.mappings[0].action = PolicyAction::BlockEndpoint;
        let problems = Policy::check(&bad, &base()).unwrap_err();
        let paths: Vec<&str> = problems.iter().map(|p| p.path.as_str()).collect();
        for path in [
            "spec.fallback",
            "spec.faq",
            "spec.pools[2]",
            "spec.ladder.recoverAfter",
            "spec.ladder.minDwell",
            "spec.mappings[0].endpointLabel",
        ] {
            assert!(paths.contains(&path), "{path} in {paths:?}");
        }
    }

    #[test]
    fn paths_read_as_the_resource_names_them() {
        assert_eq!(camel(".ladder.recover_after"), ".ladder.recoverAfter");
        assert_eq!(camel(".alias_exempt[0]"), ".aliasExempt[0]");
        assert_eq!(mapping_index("mappings[12].pool_label"), Some(12));
        assert_eq!(mapping_index("models.x"), None);
    }
}
