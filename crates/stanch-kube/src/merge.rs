//! The policy in force when the configuration file and policy resources are used
//! together.
//!
//! The rules, in order:
//! 1. **A resource wins over the file.** A `StanchPolicy` for a model the file also
//!    has replaces the file's entry (and the file's mapping rules aimed at that model
//!    give way to the resource's); the resource says so in its status
//!    ([`Outcome::ReplacesFile`]). The file is what a chart ships and a resource is
//!    what a team applies for its model, so the more specific word wins.
//! 2. **Between resources, the oldest wins.** Two resources for one model: the one
//!    created first (then by namespace and name) is in force; the other is refused
//!    ([`Outcome::Duplicate`]) until the first is deleted.
//! 3. **A resource is taken whole or not at all.** Each is checked with the file's
//!    rules against everything else in force (its fallback may be a model of the file
//!    or of another resource); one that fails is refused with every problem
//!    ([`Outcome::Invalid`]) and changes nothing. Refusing one can make another
//!    invalid (its fallback was the refused one's model), so checking repeats until
//!    nothing more is refused.
//!
//! A refused resource's model keeps whatever was in force for it before: the file's
//! entry, if the file has one. Deciding what is in force is pure; putting it in force
//! is `Input::Configure`.

use std::collections::BTreeMap;

use stanch_api::Timestamp;
use stanch_core::{Config, Problem};

use crate::crd::StanchPolicySpec;
use crate::policy::Policy;

/// A policy resource, as listed.
#[derive(Debug, Clone, PartialEq)]
pub struct Listed {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// When it was created.
    pub created: Timestamp,
    /// Its spec.
    pub spec: StanchPolicySpec,
}

impl Listed {
    /// `namespace/name`, as [`key`] makes it.
    pub fn key(&self) -> String {
        key(&self.namespace, &self.name)
    }
}

/// A resource's key in [`Merged::outcomes`]: `namespace/name`.
pub fn key(namespace: &str, name: &str) -> String {
    format!("{namespace}/{name}")
}

/// What became of one resource.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// In force, for a model the file does not have.
    InForce,
    /// In force, in place of the file's entry for the same model.
    ReplacesFile,
    /// Refused: an older resource (`namespace/name`) is in force for the same model.
    Duplicate(String),
    /// Refused: these problems, each at its path in the resource.
    Invalid(Vec<Problem>),
}

impl Outcome {
    /// Whether the resource's spec is in force.
    pub fn in_force(&self) -> bool {
        matches!(self, Outcome::InForce | Outcome::ReplacesFile)
    }
}

/// The policy in force, and what became of each resource (by `namespace/name`).
#[derive(Debug, Clone)]
pub struct Merged {
    /// The whole configuration to put in force.
    pub config: Config,
    /// Every listed resource's outcome.
    pub outcomes: BTreeMap<String, Outcome>,
}

/// The policy in force for `file` and the `listed` resources.
pub fn merge(file: &Config, listed: &[Listed]) -> Merged {
    let mut outcomes = BTreeMap::new();
    // Rule 2: per model, the oldest resource is the candidate.
    let mut by_age: Vec<&Listed> = listed.iter().collect();
    by_age.sort_by(|a, b| {
        (a.created, &a.namespace, &a.name).cmp(&(b.created, &b.namespace, &b.name))
    });
    let mut candidates: BTreeMap<&str, &Listed> = BTreeMap::new();
    for r in by_age {
        match candidates.get(r.spec.model.as_str()) {
            Some(first) => {
                outcomes.insert(r.key(), Outcome::Duplicate(first.key()));
            }
            None => {
                candidates.insert(r.spec.model.as_str(), r);
            }
        }
    }
    // Rule 3: check each candidate against the file and the other candidates, until
    // none is refused.
    loop {
        let mut refused = Vec::new();
        for (model, r) in &candidates {
            let others: Vec<&Listed> = candidates
                .iter()
                .filter(|(m, _)| m != &model)
                .map(|(_, r)| *r)
                .collect();
            let base = with(file, &others);
            if let Err(problems) = Policy::check(&r.spec, &base) {
                refused.push((*model, r.key(), problems));
            }
        }
        if refused.is_empty() {
            break;
        }
        for (model, key, problems) in refused {
            candidates.remove(model);
            outcomes.insert(key, Outcome::Invalid(problems));
        }
    }
    let accepted: Vec<&Listed> = candidates.values().copied().collect();
    for r in &accepted {
        let outcome = if file.models.contains_key(&r.spec.model) {
            Outcome::ReplacesFile
        } else {
            Outcome::InForce
        };
        outcomes.insert(r.key(), outcome);
    }
    let config = with(file, &accepted);
    // Each accepted resource was checked with all the others in place, so the whole
    // validates; should it not (a rule that spans resources), nothing is put in force
    // half-way: every resource is refused with the problems, and the file stands.
    let problems = config.validate();
    if !problems.is_empty() {
        for r in accepted {
            outcomes.insert(r.key(), Outcome::Invalid(problems.clone()));
        }
        return Merged {
            config: file.clone(),
            outcomes,
        };
    }
    Merged { config, outcomes }
}

/// `file` with the `resources`' models and rules in place of its own for those models.
fn with(file: &Config, resources: &[&Listed]) -> Config {
    let mut config = file.clone();
    for r in resources {
        let (policy, _) = Policy::read(&r.spec);
        config
            .mappings
            .retain(|m| m.target_model.as_deref() != Some(policy.model.as_str()));
        config.mappings.extend(policy.mappings);
        config.models.insert(policy.model, policy.config);
    }
    config
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file() -> Config {
        Config::from_yaml(
            "models:\n  qwen-72b: {pools: [dc-a, dc-b], fallback: qwen-14b}\n  qwen-14b: {pools: [dc-a]}\n",
        )
        .unwrap()
    }

    fn listed(ns: &str, name: &str, created: i64, spec: &str) -> Listed {
        Listed {
            namespace: ns.into(),
            name: name.into(),
            created: Timestamp::from_millis(created),
            spec: serde_yaml::from_str(spec).unwrap(),
        }
    }

    #[test]
    fn a_resource_replaces_the_files_entry_and_adds_what_the_file_lacks() {
        let merged = merge(
            &file(),
            &[
                listed(
                    "team-a",
                    "big",
                    1,
                    "model: qwen-72b\npools: [{name: dc-c}]\nfallback: qwen-32b\n",
                ),
                listed(
                    "team-b",
                    "mid",
                    2,
                    "model: qwen-32b\npools: [{name: dc-a}]\n",
                ),
            ],
        );
        assert_eq!(merged.outcomes["team-a/big"], Outcome::ReplacesFile);
        assert_eq!(merged.outcomes["team-b/mid"], Outcome::InForce);
        let big = &merged.config.models["qwen-72b"];
        assert_eq!(big.pools[0].name(), "dc-c");
        assert_eq!(
            big.fallback.as_deref(),
            Some("qwen-32b"),
            "a fallback another resource defines"
        );
        assert!(
            merged.config.models.contains_key("qwen-14b"),
            "the file's other models stay"
        );
        assert!(merged.config.validate().is_empty());
    }

    #[test]
    fn between_resources_for_one_model_the_oldest_wins() {
        let merged = merge(
            &file(),
            &[
                listed("b", "newer", 20, "model: qwen-32b\npools: [{name: dc-b}]\n"),
                listed("a", "older", 10, "model: qwen-32b\npools: [{name: dc-a}]\n"),
            ],
        );
        assert_eq!(merged.outcomes["a/older"], Outcome::InForce);
        assert_eq!(
            merged.outcomes["b/newer"],
            Outcome::Duplicate("a/older".into())
        );
        assert_eq!(merged.config.models["qwen-32b"].pools[0].name(), "dc-a");
    }

    /// An invalid resource changes nothing; one that needed it is refused in turn; the
    /// file's entry stays in force for a refused resource's model.
    #[test]
    fn refusals_cascade_and_leave_what_was_in_force() {
        let merged = merge(
            &file(),
            &[
                listed(
                    "a",
                    "broken",
                    1,
                    "model: qwen-14b\npools: [{name: dc-a}]\nfaq: nope\n",
                ),
                listed("a", "new", 2, "model: qwen-7b\npools: [{name: dc-a}]\n"),
                listed(
                    "a",
                    "needs-7b",
                    3,
                    "model: qwen-3b\npools: [{name: dc-a}]\nfallback: qwen-7b\n",
                ),
                listed(
                    "a",
                    "bad-7b",
                    4,
                    "model: qwen-1b\npools: [{name: dc-a}]\nladder: {recoverAfter: soon}\n",
                ),
            ],
        );
        let Outcome::Invalid(problems) = &merged.outcomes["a/broken"] else {
            panic!("{:?}", merged.outcomes["a/broken"]);
        };
        assert_eq!(problems[0].path, "spec.faq");
        assert!(
            merged.config.models["qwen-14b"].faq.is_none(),
            "the file's entry stays"
        );
        assert!(merged.outcomes["a/new"].in_force());
        assert!(
            merged.outcomes["a/needs-7b"].in_force(),
            "its fallback is another resource's"
        );
        assert!(!merged.outcomes["a/bad-7b"].in_force());
        assert!(!merged.config.models.contains_key("qwen-1b"));
        assert!(merged.config.validate().is_empty());
    }

    #[test]
    fn a_resource_whose_fallback_was_refused_is_refused_too() {
        let merged = merge(
            &file(),
            &[
                listed(
                    "a",
                    "bad",
                    1,
                    "model: qwen-7b\npools: [{name: dc-a}]\nfaq: nope\n",
                ),
                listed(
                    "a",
                    "needs-bad",
                    2,
                    "model: qwen-3b\npools: [{name: dc-a}]\nfallback: qwen-7b\n",
                ),
            ],
        );
        assert!(!merged.outcomes["a/bad"].in_force());
        let Outcome::Invalid(problems) = &merged.outcomes["a/needs-bad"] else {
            panic!("{:?}", merged.outcomes["a/needs-bad"]);
        };
        assert_eq!(problems[0].path, "spec.fallback");
        assert!(merged.config.validate().is_empty());
    }
}
