//! Kubernetes Events on a policy, so that `kubectl describe stanchpolicy` tells the
//! story of an incident: every rung transition, pool change, flap pin, block and
//! override of its model, and every refusal of its spec.
//!
//! Events are `events.k8s.io/v1`, reported by controller `stanch.dev/controller`, with
//! a CamelCase `reason` per kind of decision, `type` `Warning` for what made things
//! worse or refused a spec and `Normal` otherwise, and the decision's own one-line
//! account as the `note` (cut to the API server's 1 KiB). Alert bookkeeping and
//! publishing are the history's, not Events: an alert storm must not become an Event
//! storm.

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use stanch_api::Timestamp;
use stanch_core::Decision;

use crate::merge::Outcome;

/// The controller Events are reported by.
pub const REPORTING_CONTROLLER: &str = "stanch.dev/controller";

/// The longest note the API server takes.
const MAX_NOTE: usize = 1024;

/// What an Event says, before it is addressed to a policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Said {
    /// `Normal` or `Warning`.
    pub type_: &'static str,
    /// CamelCase, per kind of decision: `Escalated`, `Recovered`, `Blocked`, ...
    pub reason: &'static str,
    /// What stanch did: `Transition`, `Block`, `Override`, `Validate`, ...
    pub action: &'static str,
    /// The decision's account.
    pub note: String,
}

/// What a decision says as an Event on its model's policy, and the model; `None` for
/// decisions that are not Events.
pub fn said(decision: &Decision) -> Option<(String, Said)> {
    let (type_, reason, action) = match decision {
        Decision::Transition { from, to, .. } if to > from => {
            ("Warning", "Escalated", "Transition")
        }
        Decision::Transition { .. } => ("Normal", "Recovered", "Transition"),
        Decision::PoolChanged { .. } => ("Warning", "PoolChanged", "Transition"),
        Decision::SharesChanged { away: true, .. } => ("Warning", "SharesMoved", "Transition"),
        Decision::SharesChanged { .. } => ("Normal", "SharesReturned", "Transition"),
        Decision::FailbackStep { .. } => ("Normal", "FailingBack", "Transition"),
        Decision::FailbackAborted { .. } => ("Warning", "FailbackAborted", "Transition"),
        Decision::FlapPinned { .. } => ("Warning", "FlapPinned", "Transition"),
        Decision::PinEnded { .. } => ("Normal", "PinEnded", "Transition"),
        Decision::Blocked { .. } => ("Warning", "EndpointBlocked", "Block"),
        Decision::BlockSkipped { .. } => ("Normal", "BlockSkipped", "Block"),
        Decision::Unblocked { .. } => ("Normal", "EndpointUnblocked", "Block"),
        Decision::Override { .. } => ("Normal", "Override", "Override"),
        Decision::OverrideEnded { .. } => ("Normal", "OverrideEnded", "Override"),
        _ => return None,
    };
    let model = decision.model()?.to_owned();
    Some((
        model,
        Said {
            type_,
            reason,
            action,
            note: crate::cut(decision.to_string(), MAX_NOTE),
        },
    ))
}

/// What a spec's outcome says, when it is refused.
pub fn refused(outcome: &Outcome) -> Option<Said> {
    let note = match outcome {
        Outcome::InForce | Outcome::ReplacesFile => return None,
        Outcome::Duplicate(winner) => {
            format!("{winner} is older and in force for the same model; this spec is not")
        }
        Outcome::Invalid(problems) => format!(
            "spec refused, the last good one stays in force: {}",
            problems
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; ")
        ),
    };
    Some(Said {
        type_: "Warning",
        reason: "SpecRefused",
        action: "Validate",
        note: crate::cut(note, MAX_NOTE),
    })
}

/// `said` as an Event on `regarding`, from replica `instance`, at `now`, the
/// `serial`-th this replica made. Its name is the object's, the time's and the
/// serial's, as client-go's recorder names them by the object and the nanosecond: two
/// decisions of one commit share their millisecond, and an Event whose name exists is
/// refused.
pub fn event(
    said: Said,
    regarding: &ObjectReference,
    instance: &str,
    now: Timestamp,
    serial: u64,
) -> Event {
    let name = format!(
        "{}.{:x}.{serial:x}",
        regarding.name.as_deref().unwrap_or("stanch"),
        now.as_millis()
    );
    Event {
        metadata: ObjectMeta {
            name: Some(name),
            namespace: regarding.namespace.clone(),
            ..ObjectMeta::default()
        },
        event_time: Some(crate::micro_time(now)),
        reporting_controller: Some(REPORTING_CONTROLLER.to_owned()),
        reporting_instance: Some(instance.to_owned()),
        action: Some(said.action.to_owned()),
        reason: Some(said.reason.to_owned()),
        note: Some(said.note),
        type_: Some(said.type_.to_owned()),
        regarding: Some(regarding.clone()),
        ..Event::default()
    }
}

#[cfg(test)]
mod tests {
    use stanch_api::{HumanDuration, Rung};
    use stanch_core::{Problem, Rule};

    use super::*;

    fn transition(from: Rung, to: Rung) -> Decision {
        Decision::Transition {
            model: "qwen-72b".into(),
            from,
            to,
            pool: "dc-b".into(),
            shares: Vec::new(),
            alias: None,
            rule: Rule::Escalate {
                required: to,
                unviable: vec![],
                conditions: vec!["pool dc-a failing".into()],
            },
        }
    }

    #[test]
    fn what_made_things_worse_is_a_warning_and_recovery_is_normal() {
        let (model, up) = said(&transition(Rung::Normal, Rung::Failover)).unwrap();
        assert_eq!(model, "qwen-72b");
        assert_eq!((up.type_, up.reason), ("Warning", "Escalated"));
        assert!(up.note.contains("normal -> failover"), "{}", up.note);
        let (_, down) = said(&transition(Rung::Failover, Rung::Normal)).unwrap();
        assert_eq!((down.type_, down.reason), ("Normal", "Recovered"));
        let blocked = Decision::Blocked {
            endpoint: "10.0.0.7:8000".into(),
            model: Some("qwen-72b".into()),
            until: Timestamp::from_millis(0),
            ttl: HumanDuration::secs(300),
            strikes: 1,
            reason: "fleet".into(),
        };
        assert_eq!(said(&blocked).unwrap().1.reason, "EndpointBlocked");
        // Shares and fail-backs alike: traffic moving away is a warning, back is not.
        let shares = |away| Decision::SharesChanged {
            model: "qwen-72b".into(),
            from: vec![],
            to: vec![],
            from_pool: "dc-a".into(),
            to_pool: "dc-b".into(),
            away,
            why: "pool dc-a slow".into(),
        };
        let kind = |d: &Decision| {
            let (_, s) = said(d).unwrap();
            (s.type_, s.reason)
        };
        assert_eq!(kind(&shares(true)), ("Warning", "SharesMoved"));
        assert_eq!(kind(&shares(false)), ("Normal", "SharesReturned"));
        let step = Decision::FailbackStep {
            model: "qwen-72b".into(),
            from: Rung::Failover,
            to: Rung::Normal,
            percent: 25,
            outcomes: Some((99, 1)),
            why: "1 of 100 outcomes failed".into(),
        };
        assert_eq!(kind(&step), ("Normal", "FailingBack"));
        let aborted = Decision::FailbackAborted {
            model: "qwen-72b".into(),
            from: Rung::Failover,
            to: Rung::Normal,
            percent: 25,
            why: "9 of 20 outcomes failed".into(),
        };
        assert_eq!(kind(&aborted), ("Warning", "FailbackAborted"));
    }

    #[test]
    fn bookkeeping_and_decisions_about_no_model_are_not_events() {
        assert!(
            said(&Decision::Published {
                version: 3,
                lease_renewal: false
            })
            .is_none()
        );
        let everywhere = Decision::Blocked {
            endpoint: "10.0.0.7:8000".into(),
            model: None,
            until: Timestamp::from_millis(0),
            ttl: HumanDuration::secs(300),
            strikes: 1,
            reason: "drill".into(),
        };
        assert!(said(&everywhere).is_none(), "no policy to put it on");
    }

    #[test]
    fn a_refused_spec_is_a_warning_with_every_problem() {
        let outcome = Outcome::Invalid(vec![
            Problem {
                path: "spec.faq".into(),
                message: "FAQ set \"nope\" is not in faq_sets".into(),
            },
            Problem {
                path: "spec.fallback".into(),
                message: "model \"qwen-7b\" is not configured".into(),
            },
        ]);
        let s = refused(&outcome).unwrap();
        assert_eq!((s.type_, s.reason), ("Warning", "SpecRefused"));
        assert!(
            s.note.contains("spec.faq") && s.note.contains("spec.fallback"),
            "{}",
            s.note
        );
        assert!(refused(&Outcome::InForce).is_none());
        let long = Outcome::Invalid(vec![Problem {
            path: "spec".into(),
            message: "界".repeat(1000),
        }]);
        assert!(refused(&long).unwrap().note.len() <= MAX_NOTE);
    }

    #[test]
    fn an_event_is_addressed_to_its_policy_and_named_uniquely() {
        let regarding = ObjectReference {
            api_version: Some("stanch.dev/v1alpha1".into()),
            kind: Some("StanchPolicy".into()),
            name: Some("qwen-72b".into()),
            namespace: Some("monitoring".into()),
            uid: Some("u-1".into()),
            ..ObjectReference::default()
        };
        let (_, s) = said(&transition(Rung::Normal, Rung::Failover)).unwrap();
        let at = Timestamp::from_millis(1_764_460_800_123);
        let e = event(s.clone(), &regarding, "stanch-0", at, 1);
        assert_eq!(e.metadata.namespace.as_deref(), Some("monitoring"));
        assert_eq!(
            e.reporting_controller.as_deref(),
            Some(REPORTING_CONTROLLER)
        );
        assert_eq!(
            e.regarding.as_ref().and_then(|r| r.uid.as_deref()),
            Some("u-1")
        );
        // Two decisions of one commit share their millisecond: still two names.
        let same_moment = event(s.clone(), &regarding, "stanch-0", at, 2);
        assert_ne!(e.metadata.name, same_moment.metadata.name);
        let later = event(
            s,
            &regarding,
            "stanch-0",
            Timestamp::from_millis(1_764_460_800_124),
            3,
        );
        assert_ne!(e.metadata.name, later.metadata.name);
        let name = e.metadata.name.unwrap();
        assert!(
            name.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-'),
            "a DNS subdomain: {name}"
        );
    }
}
