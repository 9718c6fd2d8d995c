//! A policy's status from what the controller published: the model's place on the
//! ladder, its blocked endpoints, and Kubernetes-style conditions, `Ready` (is the
//! spec in force?), `Degraded` (is the model off the normal rung?) and `Overridden`
//! (does an operator hold it?).
//!
//! [`next`] gives the status to write, or `None` when nothing changed, so that a
//! controller writes only on change; a condition keeps its `lastTransitionTime` while
//! its status stays the same, as Kubernetes' conventions ask.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use stanch_api::status::ModelStatus;
use stanch_api::{BlockedEndpoint, ModelRoute, Rung, Timestamp};

use crate::crd::{PolicyBlock, StanchPolicyStatus};
use crate::merge::Outcome;

/// The longest condition message written (the API server allows 32 KiB).
const MAX_MESSAGE: usize = 1024;

/// What the controller knows of a policy's model now.
#[derive(Debug, Clone, Copy)]
pub struct Observed<'a> {
    /// The policy's model.
    pub name: &'a str,
    /// The resource's `metadata.generation`.
    pub generation: Option<i64>,
    /// What became of the resource's spec.
    pub outcome: &'a Outcome,
    /// The model's published route entry, if the table has one.
    pub route: Option<&'a ModelRoute>,
    /// The model's status as decided (overrides, freezes).
    pub model: Option<&'a ModelStatus>,
    /// The published table's blocks (those for the model, or for every model, are
    /// the policy's).
    pub blocked: &'a [BlockedEndpoint],
    /// Now, for conditions that change.
    pub now: Timestamp,
}

/// The status to write for `observed`, or `None` when `previous` already says it all.
pub fn next(
    previous: Option<&StanchPolicyStatus>,
    observed: &Observed<'_>,
) -> Option<StanchPolicyStatus> {
    let mut status = desired(observed);
    // Conditions whose status did not change keep their transition time.
    for c in &mut status.conditions {
        if let Some(old) = previous
            .into_iter()
            .flat_map(|p| &p.conditions)
            .find(|o| o.type_ == c.type_ && o.status == c.status)
        {
            c.last_transition_time = old.last_transition_time.clone();
        }
    }
    (previous != Some(&status)).then_some(status)
}

fn desired(o: &Observed<'_>) -> StanchPolicyStatus {
    let route = o.route.filter(|_| o.outcome.in_force());
    let model = route.and(o.model);
    let overridden = route.is_some_and(|r| r.overridden);
    let frozen = model.is_some_and(|m| m.freeze.is_some());
    let blocked_endpoints = o
        .blocked
        .iter()
        .filter(|_| route.is_some())
        .filter(|b| b.model.as_deref().is_none_or(|m| m == o.name))
        .map(|b| PolicyBlock {
            endpoint: b.endpoint.clone(),
            until: b.until,
            reason: b.reason.clone(),
        })
        .collect();
    let condition = |type_: &str, on: bool, reason: &str, message: String| Condition {
        type_: type_.to_owned(),
        status: if on { "True" } else { "False" }.to_owned(),
        reason: reason.to_owned(),
        message: crate::cut(message, MAX_MESSAGE),
        observed_generation: o.generation,
        last_transition_time: crate::time(o.now),
    };
    let ready = match o.outcome {
        Outcome::InForce => condition("Ready", true, "InForce", "the spec is in force".into()),
        Outcome::ReplacesFile => condition(
            "Ready",
            true,
            "ReplacesFile",
            "the spec is in force, in place of the configuration file's entry for the model".into(),
        ),
        Outcome::Duplicate(winner) => condition(
            "Ready",
            false,
            "Duplicate",
            format!("{winner} is older and in force for the same model; this spec is not"),
        ),
        Outcome::Invalid(problems) => condition(
            "Ready",
            false,
            "Invalid",
            problems
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; "),
        ),
    };
    let degraded = match route {
        Some(r) if r.rung != Rung::Normal => {
            condition("Degraded", true, rung_reason(r.rung), r.reason.clone())
        }
        _ => condition("Degraded", false, "Normal", "on the normal rung".into()),
    };
    let held = match (
        route.filter(|r| r.overridden),
        model.and_then(|m| m.freeze.as_ref()),
    ) {
        (Some(r), _) => condition("Overridden", true, "Forced", r.reason.clone()),
        (None, Some(f)) => condition("Overridden", true, "Frozen", f.reason.clone()),
        (None, None) => condition("Overridden", false, "None", "no operator override".into()),
    };
    StanchPolicyStatus {
        observed_generation: o.generation,
        rung: route.map(|r| r.rung),
        active_pool: route.map(|r| r.pool.clone()),
        alias: route.and_then(|r| r.alias.clone()),
        reason: route.map(|r| r.reason.clone()),
        since: route.map(|r| r.since),
        lease_until: route.map(|r| r.lease_until),
        overridden,
        frozen,
        blocked_endpoints,
        conditions: vec![ready, degraded, held],
    }
}

/// A condition's reason for a rung: `Failover`, `Degraded`, `Static`.
fn rung_reason(rung: Rung) -> &'static str {
    match rung {
        Rung::Normal => "Normal",
        Rung::Failover => "Failover",
        Rung::Degraded => "Degraded",
        Rung::Static => "Static",
    }
}

#[cfg(test)]
mod tests;
