//! The tests of `status`.

use stanch_core::Problem;

use super::*;

fn route(rung: Rung, overridden: bool) -> ModelRoute {
    ModelRoute {
        rung,
        pool: "dc-b".into(),
        alias: None,
        alias_exempt: vec![],
        faq: None,
        since: Timestamp::from_millis(1_000),
        lease_until: Timestamp::from_millis(121_000),
        reason: "pool dc-a failing".into(),
        alerts: vec![],
        overridden,
        shares: Vec::new(),
        alias_percent: None,
    }
}

fn observed<'a>(
    outcome: &'a Outcome,
    route: Option<&'a ModelRoute>,
    blocked: &'a [BlockedEndpoint],
    now: i64,
) -> Observed<'a> {
    Observed {
        name: "qwen-72b",
        generation: Some(3),
        outcome,
        route,
        model: None,
        blocked,
        now: Timestamp::from_millis(now),
    }
}

fn condition<'a>(s: &'a StanchPolicyStatus, type_: &str) -> &'a Condition {
    s.conditions.iter().find(|c| c.type_ == type_).unwrap()
}

#[test]
fn the_status_says_where_the_model_is_and_why() {
    let r = route(Rung::Failover, false);
    let blocked = [
        BlockedEndpoint {
            endpoint: "a:1".into(),
            model: Some("qwen-72b".into()),
            until: Timestamp::from_millis(9),
            reason: "fleet".into(),
        },
        BlockedEndpoint {
            endpoint: "b:1".into(),
            model: Some("qwen-14b".into()),
            until: Timestamp::from_millis(9),
            reason: "fleet".into(),
        },
        BlockedEndpoint {
            endpoint: "c:1".into(),
            model: None,
            until: Timestamp::from_millis(9),
            reason: "drill".into(),
        },
    ];
    let s = next(
        None,
        &observed(&Outcome::InForce, Some(&r), &blocked, 5_000),
    )
    .unwrap();
    assert_eq!(
        (s.rung, s.active_pool.as_deref()),
        (Some(Rung::Failover), Some("dc-b"))
    );
    assert_eq!(s.observed_generation, Some(3));
    let endpoints: Vec<&str> = s
        .blocked_endpoints
        .iter()
        .map(|b| b.endpoint.as_str())
        .collect();
    assert_eq!(
        endpoints,
        ["a:1", "c:1"],
        "its own and every model's, not another's"
    );
    assert_eq!(condition(&s, "Ready").status, "True");
    let degraded = condition(&s, "Degraded");
    assert_eq!(
        (degraded.status.as_str(), degraded.reason.as_str()),
        ("True", "Failover")
    );
    assert_eq!(degraded.message, "pool dc-a failing");
    assert_eq!(condition(&s, "Overridden").status, "False");
}

/// Nothing to write when nothing changed, whatever the time; a condition that
/// flips gets a new transition time, the others keep theirs.
#[test]
fn a_status_is_written_only_when_it_changes() {
    let r = route(Rung::Failover, false);
    let first = next(None, &observed(&Outcome::InForce, Some(&r), &[], 5_000)).unwrap();
    assert!(
        next(
            Some(&first),
            &observed(&Outcome::InForce, Some(&r), &[], 65_000)
        )
        .is_none()
    );
    let forced = route(Rung::Failover, true);
    let second = next(
        Some(&first),
        &observed(&Outcome::InForce, Some(&forced), &[], 65_000),
    )
    .unwrap();
    assert_eq!(condition(&second, "Overridden").status, "True");
    assert_eq!(
        condition(&second, "Overridden").last_transition_time,
        crate::time(Timestamp::from_millis(65_000))
    );
    assert_eq!(
        condition(&second, "Ready").last_transition_time,
        crate::time(Timestamp::from_millis(5_000)),
        "kept"
    );
}

#[test]
fn a_refused_spec_says_why_and_shows_no_place_on_the_ladder() {
    let r = route(Rung::Failover, false);
    let invalid = Outcome::Invalid(vec![Problem {
        path: "spec.faq".into(),
        message: "FAQ set \"nope\" is not in faq_sets".into(),
    }]);
    let s = next(None, &observed(&invalid, Some(&r), &[], 5_000)).unwrap();
    let ready = condition(&s, "Ready");
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("False", "Invalid")
    );
    assert!(
        ready.message.contains("spec.faq: FAQ set"),
        "{}",
        ready.message
    );
    assert_eq!(s.rung, None, "the model's entry is not this spec's");
    let duplicate = Outcome::Duplicate("team-a/big".into());
    let s = next(None, &observed(&duplicate, Some(&r), &[], 5_000)).unwrap();
    assert!(condition(&s, "Ready").message.contains("team-a/big"));
    let long = Outcome::Invalid(vec![Problem {
        path: "spec".into(),
        message: "é".repeat(2000),
    }]);
    let s = next(None, &observed(&long, None, &[], 0)).unwrap();
    assert!(condition(&s, "Ready").message.len() <= MAX_MESSAGE);
}
