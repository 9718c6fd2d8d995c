//! Gradual fail-back: a step down from failover or degraded that returns the traffic
//! in steps (`ladder.failback.steps`, e.g. 10, 25, 50 then 100 %), each held for
//! `hold` and then gated: the conditions must still allow the lower rung, and the
//! outcomes the gateways report where the traffic returns must fail no more than
//! `max_error_rate`, over at least `min_samples` (a step without them waits up to
//! `max_wait`, then moves on the conditions alone, and says so). A failed gate aborts:
//! all of the traffic goes back where it was, the stabilization window starts over
//! with backoff, and the abort counts toward the flap guard.
//!
//! While it runs the model stays on the rung it leaves; its route is a blend of where
//! that rung sent the traffic when the fail-back began and where the lower rung sends
//! it: shares across pools, and for a degraded model the part of its non-exempt
//! traffic still on the alias (`alias_percent`). VIP traffic, exempt from the alias,
//! is on the model throughout. The last step is the step down itself.

use stanch_api::admin::FailbackAction;
use stanch_api::routes::{PoolShare, endpoint_names, largest_share};
use stanch_api::status::FailbackStatus;
use stanch_api::{HumanDuration, Rung, Timestamp};

use crate::decision::{Decision, Rule};
use crate::ladder::{Ctx, Route, count_move, guard_flapping, move_to, route_for, spread};
use crate::mapping::ALL;
use crate::state::{Failback, ModelState};

/// Whether stepping down from the model's rung to `to` moves traffic that a fail-back
/// can return in steps: off the alias, or between pools. (A step that moves nothing,
/// such as failover to normal on the same pool, is taken whole.)
pub(crate) fn worth_it(st: &ModelState, to: Rung, cx: &Ctx<'_>) -> bool {
    match st.rung {
        Rung::Degraded if st.alias.is_some() => true,
        Rung::Failover | Rung::Degraded => {
            let lower = route_for(&st.pool, to, cx.model, cx.plan);
            spread(cx.model, &st.pool, &st.shares) != spread(cx.model, &lower.pool, &lower.shares)
        }
        Rung::Normal | Rung::Static => false,
    }
}

/// Begins a fail-back from the model's rung to `to`: the first step's share returns.
pub(crate) fn start(st: &mut ModelState, to: Rung, cx: &Ctx<'_>, out: &mut Vec<Decision>) {
    let failback = Failback {
        from: st.rung,
        to,
        step: 0,
        since: cx.now,
        from_pool: st.pool.clone(),
        from_shares: st.shares.clone(),
        order: None,
    };
    st.failback = Some(failback);
    st.shares_back_since = None;
    apply_route(st, cx);
    count_move(st, cx.now, false);
    out.push(step_decision(
        st,
        cx,
        None,
        "the conditions have been clear for the window",
    ));
    guard_flapping(st, cx, out);
}

/// Judges the fail-back under way, if its step is due: the next step, the end (the
/// step down), or an abort.
pub(crate) fn advance(st: &mut ModelState, cx: &Ctx<'_>, out: &mut Vec<Decision>) {
    let Some(fb) = st.failback.clone() else {
        return;
    };
    let policy = &cx.policy.failback;
    match &fb.order {
        Some((FailbackAction::Skip, reason)) => {
            let why = format!("skipped to the end by an operator: {reason}");
            finish(st, &fb, cx, out, None, &why);
            return;
        }
        Some((FailbackAction::Abort, reason)) => {
            abort(
                st,
                &fb,
                cx,
                out,
                format!("aborted by an operator: {reason}"),
            );
            return;
        }
        None => {}
    }
    if cx.plan.target > fb.to {
        let why = format!(
            "the conditions need {} again: {}",
            cx.plan.target,
            cx.plan.conditions.join("; ")
        );
        abort(st, &fb, cx, out, why);
        return;
    }
    // A pool the traffic is leaving (and not returning to) fails outright: the rest
    // returns at once.
    let lower = route_for(&fb.from_pool, fb.to, cx.model, cx.plan);
    let returning = |p: &String| *p == lower.pool || lower.shares.iter().any(|s| s.pool == *p);
    let mut leaving = std::iter::once(&fb.from_pool).chain(fb.from_shares.iter().map(|s| &s.pool));
    if let Some(failing) = leaving.find(|p| !returning(p) && cx.plan.unhealthy_pools.contains(p)) {
        let why = format!("pool {failing} failing: the rest returns at once");
        finish(st, &fb, cx, out, None, &why);
        return;
    }
    apply_route(st, cx);
    if st.pin.is_some() {
        // The flap guard holds the model where it is: so does the fail-back.
        return;
    }
    let (outcomes, why) = match judge(st, &fb, cx) {
        Gate::Wait(until) => {
            wake(st, until);
            return;
        }
        Gate::Failed(why) => {
            abort(st, &fb, cx, out, why);
            return;
        }
        Gate::Passed(outcomes, why) => (outcomes, why),
    };
    let next = fb.step + 1;
    if policy.steps.get(next).is_none_or(|p| *p >= ALL) {
        finish(st, &fb, cx, out, outcomes, &why);
        return;
    }
    if let Some(f) = st.failback.as_mut() {
        f.step = next;
        f.since = cx.now;
    }
    apply_route(st, cx);
    count_move(st, cx.now, false);
    out.push(step_decision(st, cx, outcomes, &why));
    guard_flapping(st, cx, out);
    wake(st, cx.now + policy.hold.0);
}

/// A step's gate, judged.
enum Gate {
    /// Not yet: judged again at this time (or on new outcomes).
    Wait(Timestamp),
    /// Passed, on these outcomes (if any could be had), for this reason.
    Passed(Option<(u64, u64)>, String),
    /// Failed, for this reason.
    Failed(String),
}

/// Judges the step under way: once held for `hold`, by the outcomes where the traffic
/// returns (or, without enough of them by `max_wait`, by the conditions alone).
fn judge(st: &ModelState, fb: &Failback, cx: &Ctx<'_>) -> Gate {
    let policy = &cx.policy.failback;
    let due = fb.since + policy.hold.0;
    if cx.now < due {
        return Gate::Wait(due);
    }
    let outcomes = outcomes(st, fb, cx);
    match outcomes {
        None => Gate::Passed(
            None,
            format!(
                "held {} with the conditions clear (no endpoints configured there to judge by)",
                policy.hold
            ),
        ),
        Some((ok, failed)) if ok + failed >= policy.min_samples => {
            let total = ok + failed;
            let rate = failed as f64 / total as f64;
            let max = policy.max_error_rate * 100.0;
            if rate > policy.max_error_rate {
                Gate::Failed(format!(
                    "{failed} of {total} outcomes failed ({:.1}%, above {max:.1}%)",
                    rate * 100.0
                ))
            } else {
                Gate::Passed(
                    outcomes,
                    format!("{failed} of {total} outcomes failed, within {max:.1}%"),
                )
            }
        }
        Some((ok, failed)) if cx.now >= fb.since + policy.max_wait.0 => Gate::Passed(
            outcomes,
            format!(
                "only {} outcomes in {} (fewer than {}): moved on the conditions alone",
                ok + failed,
                policy.max_wait,
                policy.min_samples
            ),
        ),
        Some(_) => Gate::Wait(fb.since + policy.max_wait.0),
    }
}

/// What status shows of the fail-back under way, if any.
pub(crate) fn status(st: &ModelState, cx: &Ctx<'_>) -> Option<FailbackStatus> {
    let fb = st.failback.as_ref()?;
    Some(FailbackStatus {
        from: fb.from,
        to: fb.to,
        percent: percent(fb, &cx.policy.failback.steps),
        since: fb.since,
        judged_at: fb.since + cx.policy.failback.hold.0,
        outcomes: outcomes(st, fb, cx),
    })
}

/// The percentage of the traffic back at the fail-back's current step.
pub(crate) fn percent(fb: &Failback, steps: &[u8]) -> u8 {
    steps.get(fb.step).copied().unwrap_or(ALL).min(ALL)
}

/// The share of a degraded model's non-exempt traffic still on its alias while it
/// fails back, for the route table.
pub(crate) fn alias_percent(st: &ModelState, steps: &[u8]) -> Option<u8> {
    let fb = st.failback.as_ref()?;
    (fb.from == Rung::Degraded && st.alias.is_some())
        .then(|| ALL - percent(fb, steps))
        .filter(|p| (1..ALL).contains(p))
}

/// Sets the model's route to the blend of the step: its share of the lower rung's
/// route, the rest as the rung left sent it.
fn apply_route(st: &mut ModelState, cx: &Ctx<'_>) {
    let Some(fb) = &st.failback else {
        return;
    };
    let back = u32::from(percent(fb, &cx.policy.failback.steps));
    let from = spread(cx.model, &fb.from_pool, &fb.from_shares);
    let lower = route_for(&fb.from_pool, fb.to, cx.model, cx.plan);
    let to = spread(cx.model, &lower.pool, &lower.shares);
    let mut blend: Vec<u32> = from
        .iter()
        .zip(&to)
        .map(|(f, t)| (u32::from(*f) * (100 - back) + u32::from(*t) * back + 50) / 100)
        .collect();
    // Rounding may leave the sum a percent off: the largest part takes the difference.
    let sum: u32 = blend.iter().sum();
    if let Some(top) = (0..blend.len()).max_by_key(|i| (blend[*i], std::cmp::Reverse(*i))) {
        blend[top] = (blend[top] + 100).saturating_sub(sum);
    }
    let shares: Vec<PoolShare> = cx
        .model
        .pools
        .iter()
        .zip(&blend)
        .filter(|(_, p)| **p > 0)
        .map(|(pool, p)| PoolShare {
            pool: pool.name().to_owned(),
            percent: u8::try_from(*p).unwrap_or(ALL),
        })
        .collect();
    let Route { alias, .. } = route_for(&st.pool, st.rung, cx.model, cx.plan);
    st.alias = alias;
    match shares.as_slice() {
        [one] => {
            st.pool.clone_from(&one.pool);
            st.shares.clear();
        }
        _ => {
            if let Some(pool) = largest_share(&shares) {
                st.pool = pool.to_owned();
            }
            st.shares = shares;
        }
    }
}

/// The gateways' outcomes, since the step began, at the endpoints of the pools that
/// the step gave traffic back to (for a degraded model, every pool of its own route):
/// (successes, failures); `None` when the configuration lists no endpoints there.
fn outcomes(st: &ModelState, fb: &Failback, cx: &Ctx<'_>) -> Option<(u64, u64)> {
    let before = spread(cx.model, &fb.from_pool, &fb.from_shares);
    let now = spread(cx.model, &st.pool, &st.shares);
    let endpoints: Vec<&str> = cx
        .model
        .pools
        .iter()
        .zip(before.iter().zip(&now))
        .filter(|(_, (b, n))| n > b || (fb.from == Rung::Degraded && **n > 0))
        .flat_map(|(pool, _)| pool.endpoints().iter().map(String::as_str))
        .collect();
    if endpoints.is_empty() {
        return None;
    }
    let mut seen = (0, 0);
    for (key, stats) in cx.fleet {
        let here = key.model.as_deref() == Some(cx.name)
            && endpoint_names(&key.endpoint).any(|name| endpoints.contains(&name));
        if !here {
            continue;
        }
        for (at, ok, failed) in &stats.samples {
            if *at >= fb.since {
                seen.0 += ok;
                seen.1 += failed;
            }
        }
    }
    Some(seen)
}

/// Ends the fail-back with its last step, the step down itself.
fn finish(
    st: &mut ModelState,
    fb: &Failback,
    cx: &Ctx<'_>,
    out: &mut Vec<Decision>,
    outcomes: Option<(u64, u64)>,
    why: &str,
) {
    out.push(Decision::FailbackStep {
        model: cx.name.to_owned(),
        from: fb.from,
        to: fb.to,
        percent: ALL,
        outcomes,
        why: why.to_owned(),
    });
    st.failback = None;
    let window = cx
        .policy
        .backoff
        .scaled(cx.policy.recover_after.0, st.backoff_level);
    let clear_from = st.clear_since[fb.to.index() + 1].unwrap_or(cx.now);
    let rule = Rule::Deescalate {
        clear_for: HumanDuration(cx.now.since(clear_from)),
        recover_after: HumanDuration(window),
        held_for: HumanDuration(cx.now.since(st.since)),
        min_dwell: cx.policy.min_dwell,
        unviable: (fb.to.index() + 1..fb.from.index())
            .filter_map(Rung::from_index)
            .collect(),
    };
    move_to(st, fb.to, rule, true, cx, out);
    st.last_deescalation = Some(cx.now);
}

/// Ends a fail-back an operator's override takes over from: the traffic goes back
/// where the rung left sent it, without the backoff or the flap count of an abort.
pub(crate) fn cancel(st: &mut ModelState, cx: &Ctx<'_>, out: &mut Vec<Decision>, why: &str) {
    let Some(fb) = st.failback.take() else {
        return;
    };
    st.pool.clone_from(&fb.from_pool);
    st.shares.clone_from(&fb.from_shares);
    st.shares_since = Some(cx.now);
    out.push(Decision::FailbackAborted {
        model: cx.name.to_owned(),
        from: fb.from,
        to: fb.to,
        percent: percent(&fb, &cx.policy.failback.steps),
        why: why.to_owned(),
    });
}

/// Gives the fail-back up: the traffic goes back where the rung left sent it, the
/// window starts over with backoff, and the abort is a move up for the flap guard.
fn abort(st: &mut ModelState, fb: &Failback, cx: &Ctx<'_>, out: &mut Vec<Decision>, why: String) {
    let percent = percent(fb, &cx.policy.failback.steps);
    st.failback = None;
    st.pool.clone_from(&fb.from_pool);
    st.shares.clone_from(&fb.from_shares);
    st.shares_since = Some(cx.now);
    st.backoff_level = (st.backoff_level + 1).min(16);
    st.last_escalation = Some(cx.now);
    for r in fb.to.index() + 1..=fb.from.index() {
        st.clear_since[r] = Some(cx.now);
    }
    count_move(st, cx.now, true);
    out.push(Decision::FailbackAborted {
        model: cx.name.to_owned(),
        from: fb.from,
        to: fb.to,
        percent,
        why,
    });
    guard_flapping(st, cx, out);
}

fn step_decision(
    st: &ModelState,
    cx: &Ctx<'_>,
    outcomes: Option<(u64, u64)>,
    why: &str,
) -> Decision {
    let fb = st.failback.as_ref().expect("a fail-back under way");
    Decision::FailbackStep {
        model: cx.name.to_owned(),
        from: fb.from,
        to: fb.to,
        percent: percent(fb, &cx.policy.failback.steps),
        outcomes,
        why: why.to_owned(),
    }
}

fn wake(st: &mut ModelState, at: Timestamp) {
    st.wake_at = Some(st.wake_at.map_or(at, |w| w.min(at)));
}
