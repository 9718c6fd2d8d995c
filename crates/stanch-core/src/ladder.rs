//! One model's degradation ladder.
//!
//! The conditions of the active alerts give each rung a verdict: is its target
//! healthy (viable)? The [`Plan`] is the lowest viable rung at or above the rung the
//! conditions require. [`evaluate`] moves the model toward it: up at once, down one
//! viable rung at a time after the stabilization window and the minimum dwell, never
//! while pinned by the flap guard, and not at all while forced or frozen.
//!
//! A condition can move a share of a pool's traffic rather than all of it (a slow
//! pool keeps a quarter of its traffic, say). The pools then split the model's
//! traffic by [`split`]: the first pool in failover order keeps what its shift leaves
//! it and passes the rest on, and so on, the last pool that can take traffic keeping
//! what reaches it. Shares obey the same rules as rungs: traffic moves away from a
//! pool at once and back only after the stabilization window and the minimum dwell,
//! never while the flap guard holds, and every move counts toward the flap guard.

use std::collections::BTreeMap;

use stanch_api::routes::PoolShare;
use stanch_api::status::PinInfo;
use stanch_api::{Fingerprint, HumanDuration, Rung, Timestamp};

use crate::config::{LadderPolicy, ModelConfig};
use crate::decision::{Decision, Rule};
use crate::failback;
use crate::mapping::{ALL, Condition};

mod route;

use self::route::refresh_route;
pub(crate) use self::route::{Route, route_for, split, spread};
use crate::state::{AlertRecord, BlockKey, FleetStats, ModelState};

/// The health facts of all active alerts, indexed by model.
#[derive(Debug, Default)]
pub(crate) struct Health {
    /// Model → unhealthy pool → the largest share of its traffic an alert moves
    /// away, and the alerts saying so.
    down: BTreeMap<String, BTreeMap<String, (u8, Vec<Fingerprint>)>>,
    /// Model → (fallback named by the alert, alerts).
    saturated: BTreeMap<String, (Option<String>, Vec<Fingerprint>)>,
    /// Model → alerts asking for the FAQ.
    statics: BTreeMap<String, Vec<Fingerprint>>,
}

impl Health {
    pub(crate) fn from_alerts<'a>(
        alerts: impl IntoIterator<Item = (&'a Fingerprint, &'a AlertRecord)>,
    ) -> Health {
        let mut h = Health::default();
        for (fp, record) in alerts {
            match &record.condition {
                Some(Condition::PoolDown { model, pool, shift }) => {
                    let entry = h
                        .down
                        .entry(model.clone())
                        .or_default()
                        .entry(pool.clone())
                        .or_default();
                    entry.0 = entry.0.max(*shift);
                    entry.1.push(*fp);
                }
                Some(Condition::Saturated { model, fallback }) => {
                    let entry = h.saturated.entry(model.clone()).or_default();
                    // The first alert naming a fallback decides it (alerts iterate in
                    // fingerprint order, so this is deterministic).
                    if entry.0.is_none() {
                        entry.0.clone_from(fallback);
                    }
                    entry.1.push(*fp);
                }
                Some(Condition::Static { model }) => {
                    h.statics.entry(model.clone()).or_default().push(*fp)
                }
                Some(Condition::BlockEndpoint { .. }) | None => {}
            }
        }
        h
    }

    /// The share of `pool`'s traffic to move away (100: all of it) and the alerts
    /// asking for it, if any does.
    fn pool_down(&self, model: &str, pool: &str) -> Option<&(u8, Vec<Fingerprint>)> {
        self.down.get(model).and_then(|pools| pools.get(pool))
    }

    /// Whether an alert moves all of `pool`'s traffic away.
    fn pool_failing(&self, model: &str, pool: &str) -> bool {
        self.pool_down(model, pool)
            .is_some_and(|(shift, _)| *shift == ALL)
    }

    /// A model is a healthy fallback target when nothing says it is saturated or
    /// failing everywhere and at least one of its pools can take traffic (a slow one
    /// still can).
    fn model_healthy(&self, model: &str, models: &BTreeMap<String, ModelConfig>) -> bool {
        !self.statics.contains_key(model)
            && !self.saturated.contains_key(model)
            && models
                .get(model)
                .is_some_and(|m| m.pools.iter().any(|p| !self.pool_failing(model, p.name())))
    }
}

/// Where the conditions point one model.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    /// The rung the conditions require.
    pub required: Rung,
    /// The lowest viable rung at or above `required`.
    pub target: Rung,
    /// Per rung: is its target healthy?
    pub viable: [bool; 4],
    /// The first healthy pool in failover order.
    pub first_healthy_pool: Option<String>,
    /// The fallback model for the degraded rung.
    pub alias: Option<String>,
    /// Pools said to be unhealthy: all of their traffic moves away.
    pub unhealthy_pools: Vec<String>,
    /// The model's traffic across its pools while a pool is slow (a share of its
    /// traffic moves away); empty when one pool takes it all.
    pub split: Vec<PoolShare>,
    /// The conditions, for humans.
    pub conditions: Vec<String>,
    /// The alerts behind them.
    pub alerts: Vec<Fingerprint>,
}

pub(crate) fn plan(
    name: &str,
    model: &ModelConfig,
    health: &Health,
    models: &BTreeMap<String, ModelConfig>,
) -> Plan {
    let mut conditions = Vec::new();
    let mut alerts = Vec::new();
    let shifts = shifts(name, model, health, &mut conditions, &mut alerts);
    let unhealthy_pools: Vec<String> = shifts
        .iter()
        .filter(|(_, s)| *s == ALL)
        .map(|(p, _)| (*p).to_owned())
        .collect();
    let first_healthy_pool = shifts
        .iter()
        .find(|(_, s)| *s < ALL)
        .map(|(p, _)| (*p).to_owned());
    let primary_healthy = shifts.first().is_none_or(|(_, s)| *s < ALL);
    let mut required = pools_require(&shifts, &mut conditions);
    let split = split(&shifts);
    let saturated = health.saturated.get(name);
    if let Some((_, fps)) = saturated {
        required = required.max(Rung::Degraded);
        conditions.push("saturated".to_owned());
        alerts.extend(fps);
    }
    if let Some(fps) = health.statics.get(name) {
        required = Rung::Static;
        conditions.push("failing everywhere (static fallback asked for)".to_owned());
        alerts.extend(fps);
    }
    let alias = saturated
        .and_then(|(fb, _)| fb.clone())
        .or_else(|| model.fallback.clone());
    let alias_healthy = alias
        .as_deref()
        .is_some_and(|a| health.model_healthy(a, models));
    if required >= Rung::Failover && required <= Rung::Degraded && !alias_healthy {
        match &alias {
            Some(a) => conditions.push(format!("fallback {a} unhealthy")),
            None if first_healthy_pool.is_none() || required == Rung::Degraded => {
                conditions.push("no fallback model configured".to_owned());
            }
            None => {}
        }
    }
    let viable = [
        primary_healthy,
        first_healthy_pool.is_some(),
        alias_healthy,
        true,
    ];
    let target = (required.index()..4)
        .find(|&r| viable[r])
        .and_then(Rung::from_index)
        .unwrap_or(Rung::Static);
    alerts.sort_unstable();
    alerts.dedup();
    Plan {
        required,
        target,
        viable,
        first_healthy_pool,
        alias,
        unhealthy_pools,
        split,
        conditions,
        alerts,
    }
}

/// Per pool of `model` in failover order, the share of its traffic the alerts move
/// away (0 to 100), the conditions and alerts behind them added to `conditions` and
/// `alerts`.
fn shifts<'m>(
    name: &str,
    model: &'m ModelConfig,
    health: &Health,
    conditions: &mut Vec<String>,
    alerts: &mut Vec<Fingerprint>,
) -> Vec<(&'m str, u8)> {
    let mut shifts = Vec::with_capacity(model.pools.len());
    for pool in &model.pools {
        let shift = match health.pool_down(name, pool.name()) {
            Some((ALL, fps)) => {
                conditions.push(format!("pool {} failing", pool.name()));
                alerts.extend(fps);
                ALL
            }
            Some((shift, fps)) => {
                conditions.push(format!(
                    "pool {} slow: {shift}% of its traffic moves",
                    pool.name()
                ));
                alerts.extend(fps);
                *shift
            }
            None => 0,
        };
        shifts.push((pool.name(), shift));
    }
    shifts
}

/// The rung the pools' shifts require: failover when the primary fails, or is slow
/// and another pool can take its share; else normal. A slow primary with no pool to
/// hand a share to keeps all of its traffic (slow is better than nothing), as
/// `conditions` then says.
fn pools_require(shifts: &[(&str, u8)], conditions: &mut Vec<String>) -> Rung {
    let Some((primary, shift)) = shifts.first() else {
        return Rung::Normal;
    };
    let takers = shifts.iter().skip(1).any(|(_, s)| *s < ALL);
    match *shift {
        0 => Rung::Normal,
        ALL => Rung::Failover,
        _ if takers => Rung::Failover,
        _ => {
            conditions.push(format!(
                "pool {primary} keeps all of its traffic: no other pool can take a share"
            ));
            Rung::Normal
        }
    }
}

/// The inputs of one evaluation that do not change within it.
pub(crate) struct Ctx<'a> {
    pub name: &'a str,
    pub model: &'a ModelConfig,
    pub policy: &'a LadderPolicy,
    pub plan: &'a Plan,
    pub now: Timestamp,
    /// The gateways' outcome reports, which gate a fail-back's steps.
    pub fleet: &'a BTreeMap<BlockKey, FleetStats>,
}

/// Moves one model per its plan, recording what it did in `out`.
// Size: the ladder's rules in the order they apply: clear times, a force, a freeze,
// escalation with backoff, one step down when due, the wake-up, the reason, the pin.
pub(crate) fn evaluate(
    st: &mut ModelState,
    frozen_by: Option<&str>,
    cx: &Ctx<'_>,
    out: &mut Vec<Decision>,
) {
    let now = cx.now;
    for r in 1..4 {
        if cx.plan.target.index() >= r {
            st.clear_since[r] = None;
        } else if st.clear_since[r].is_none() {
            st.clear_since[r] = Some(now);
        }
    }
    st.unhealthy_pools.clone_from(&cx.plan.unhealthy_pools);
    st.alerts.clone_from(&cx.plan.alerts);
    st.wake_at = None;

    if let Some(force) = &st.force {
        let (rung, reason) = (force.rung, force.info.reason.clone());
        failback::cancel(st, cx, out, &format!("an operator forced {rung}"));
        if st.rung != rung {
            move_to(
                st,
                rung,
                Rule::Forced {
                    reason: reason.clone(),
                },
                false,
                cx,
                out,
            );
        }
        refresh_route(st, cx, out);
        st.reason = format!("forced to {rung} by operator: {reason}");
        return;
    }
    if let Some(why) = frozen_by {
        st.reason = format!("frozen by operator ({why}); automation paused");
        return;
    }

    if cx.plan.target > st.rung {
        let escalation_after_recovery = match (st.last_deescalation, st.last_escalation) {
            (Some(down), Some(up)) => down > up,
            (Some(_), None) => true,
            _ => false,
        };
        let recent = st
            .last_deescalation
            .is_some_and(|t| now.since(t) <= cx.policy.backoff.reset_after.0);
        st.backoff_level = match (escalation_after_recovery, recent) {
            (true, true) => (st.backoff_level + 1).min(16),
            (_, true) => st.backoff_level,
            (_, false) => 0,
        };
        st.last_escalation = Some(now);
        let unviable = (cx.plan.required.index()..cx.plan.target.index())
            .filter_map(Rung::from_index)
            .collect();
        let rule = Rule::Escalate {
            required: cx.plan.required,
            unviable,
            conditions: cx.plan.conditions.clone(),
        };
        if let Some(fb) = st.failback.take() {
            out.push(Decision::FailbackAborted {
                model: cx.name.to_owned(),
                from: fb.from,
                to: fb.to,
                percent: failback::percent(&fb, &cx.policy.failback.steps),
                why: format!("the conditions need {}", cx.plan.target),
            });
        }
        move_to(st, cx.plan.target, rule, true, cx, out);
    } else if st.failback.is_some() {
        failback::advance(st, cx, out);
    } else if let Some((to, ready_at, rule)) = next_step_down(st, cx)
        && now >= ready_at
    {
        if cx.policy.failback.gradual() && failback::worth_it(st, to, cx) {
            failback::start(st, to, cx, out);
        } else {
            move_to(st, to, rule, true, cx, out);
            st.last_deescalation = Some(now);
        }
    }
    refresh_route(st, cx, out);
    if st.failback.is_none()
        && let Some((_, ready_at, _)) = next_step_down(st, cx)
    {
        let at = ready_at.max(now + std::time::Duration::from_millis(1));
        st.wake_at = Some(st.wake_at.map_or(at, |w| w.min(at)));
    }
    st.reason = if !cx.plan.conditions.is_empty() {
        cx.plan.conditions.join("; ")
    } else if let Some(fb) = &st.failback {
        format!(
            "failing back to {}: {}% back since {}, each step held {} and judged by the outcomes there",
            fb.to,
            failback::percent(fb, &cx.policy.failback.steps),
            fb.since,
            cx.policy.failback.hold
        )
    } else if st.rung != Rung::Normal {
        let window = cx
            .policy
            .backoff
            .scaled(cx.policy.recover_after.0, st.backoff_level);
        format!(
            "recovering: conditions clear; steps down after a {} window",
            HumanDuration(window)
        )
    } else {
        "healthy".to_owned()
    };
    if let Some(pin) = &st.pin {
        st.reason = format!(
            "{}; held at {} or above by the flap guard until {}",
            st.reason, pin.rung, pin.until
        );
    }
}

/// The next step down and when it becomes possible, for the status report. A step the
/// flap guard would undo in the same decision (it would make one swing too many within
/// `flap.window`: the model is pinned where it is, and gateways never see the step) is
/// not one: none is reported.
pub(crate) fn step_down(st: &ModelState, cx: &Ctx<'_>) -> Option<(Rung, Timestamp)> {
    if st.failback.is_some() {
        return None;
    }
    let (to, at, _) = next_step_down(st, cx)?;
    if st.pin.is_none() {
        let window = cx.policy.flap.window.0;
        let mut moves = moves(st);
        moves.retain(|(t, _)| at.since(*t) <= window);
        moves.push((at, false));
        if swings(moves) > cx.policy.flap.max_transitions {
            return None;
        }
    }
    Some((to, at))
}

/// The next step down, when it becomes possible, and the rule for it.
fn next_step_down(st: &ModelState, cx: &Ctx<'_>) -> Option<(Rung, Timestamp, Rule)> {
    if cx.plan.target >= st.rung {
        return None;
    }
    let floor = st.pin.as_ref().map_or(Rung::Normal, |p| p.rung);
    let lowest = cx.plan.target.max(floor);
    if lowest >= st.rung {
        return None;
    }
    // The highest viable rung below the current one: a rung whose target is unhealthy
    // is never a place to stop, so the step passes over it.
    let to = (lowest.index()..st.rung.index())
        .rev()
        .find(|&r| cx.plan.viable[r])?;
    let clear_from = st.clear_since[to + 1]?;
    let window = cx
        .policy
        .backoff
        .scaled(cx.policy.recover_after.0, st.backoff_level);
    let min_dwell = cx.policy.min_dwell.0;
    let ready_at = (clear_from + window).max(st.since + min_dwell);
    let rule = Rule::Deescalate {
        clear_for: HumanDuration(cx.now.since(clear_from)),
        recover_after: HumanDuration(window),
        held_for: HumanDuration(cx.now.since(st.since)),
        min_dwell: HumanDuration(min_dwell),
        unviable: (to + 1..st.rung.index())
            .filter_map(Rung::from_index)
            .collect(),
    };
    Some((Rung::from_index(to)?, ready_at, rule))
}

pub(crate) fn move_to(
    st: &mut ModelState,
    to: Rung,
    rule: Rule,
    counts: bool,
    cx: &Ctx<'_>,
    out: &mut Vec<Decision>,
) {
    let from = st.rung;
    let Route {
        pool,
        shares,
        alias,
    } = route_for(&st.pool, to, cx.model, cx.plan);
    st.rung = to;
    st.since = cx.now;
    st.failback = None;
    st.pool.clone_from(&pool);
    if shares != st.shares {
        st.shares_since = Some(cx.now);
    }
    st.shares.clone_from(&shares);
    st.shares_back_since = None;
    st.alias.clone_from(&alias);
    out.push(Decision::Transition {
        model: cx.name.to_owned(),
        from,
        to,
        pool,
        shares,
        alias,
        rule,
    });
    if !counts {
        return;
    }
    count_move(st, cx.now, to > from);
    st.transitions.push_back((cx.now, from, to));
    guard_flapping(st, cx, out);
}

/// Forgets the moves older than the flap window, and pins the model at the highest
/// rung of the window when its moves, rungs and shares alike, swing too often.
pub(crate) fn guard_flapping(st: &mut ModelState, cx: &Ctx<'_>, out: &mut Vec<Decision>) {
    let window = cx.policy.flap.window.0;
    let old = |t: &Timestamp| cx.now.since(*t) > window;
    while st.transitions.front().is_some_and(|(t, _, _)| old(t)) {
        st.transitions.pop_front();
    }
    while st.moves.front().is_some_and(|(t, _)| old(t)) {
        st.moves.pop_front();
    }
    let swings = swings(moves(st));
    if st.pin.is_none() && swings > cx.policy.flap.max_transitions {
        let to = st.rung;
        let high = st
            .transitions
            .iter()
            .map(|(_, a, b)| (*a).max(*b))
            .max()
            .unwrap_or(to)
            .max(to);
        let until = cx.now + cx.policy.flap.hold.0;
        let transitions = swings;
        st.pin = Some(PinInfo {
            rung: high,
            until,
            transitions,
        });
        out.push(Decision::FlapPinned {
            model: cx.name.to_owned(),
            rung: high,
            until,
            transitions,
            window: cx.policy.flap.window,
        });
        if st.rung < high {
            move_to(st, high, Rule::FlapHold, false, cx, out);
        }
    }
}

/// The moves the flap guard counts, in order: when, and whether up the ladder (or
/// away from the primary). A state kept before share moves were counted has only its
/// rung changes.
fn moves(st: &ModelState) -> Vec<(Timestamp, bool)> {
    if st.moves.is_empty() {
        st.transitions
            .iter()
            .map(|(t, from, to)| (*t, to > from))
            .collect()
    } else {
        st.moves.iter().copied().collect()
    }
}

/// Adds a move for the flap guard to count.
pub(crate) fn count_move(st: &mut ModelState, at: Timestamp, up: bool) {
    if st.moves.is_empty() {
        // Kept before share moves were counted: its rung changes come first.
        st.moves = moves(st).into();
    }
    st.moves.push_back((at, up));
}

/// Counts the moves that reverse direction (and the first one): a run of steps in one
/// direction, such as an incident escalating 0 → 1 → 2 → 3, is one movement, not
/// three, while up-down-up is three. Only reversals are flapping.
pub(crate) fn swings(moves: impl IntoIterator<Item = (Timestamp, bool)>) -> usize {
    let mut count = 0;
    let mut last_up = None;
    for (_, up) in moves {
        if last_up != Some(up) {
            count += 1;
            last_up = Some(up);
        }
    }
    count
}
