//! One model's degradation ladder.
//!
//! The conditions of the active alerts give each rung a verdict: is its target
//! healthy (viable)? The [`Plan`] is the lowest viable rung at or above the rung the
//! conditions require. [`evaluate`] moves the model toward it: up at once, down one
//! viable rung at a time after the stabilization window and the minimum dwell, never
//! while pinned by the flap guard, and not at all while forced or frozen.

use std::collections::BTreeMap;

use stanch_api::status::PinInfo;
use stanch_api::{Fingerprint, HumanDuration, Rung, Timestamp};

use crate::config::{LadderPolicy, ModelConfig};
use crate::decision::{Decision, Rule};
use crate::mapping::Condition;
use crate::state::{AlertRecord, ModelState};

/// The health facts of all active alerts, indexed by model.
#[derive(Debug, Default)]
pub(crate) struct Health {
    /// Model → unhealthy pool → alerts saying so.
    down: BTreeMap<String, BTreeMap<String, Vec<Fingerprint>>>,
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
                Some(Condition::PoolDown { model, pool }) => h
                    .down
                    .entry(model.clone())
                    .or_default()
                    .entry(pool.clone())
                    .or_default()
                    .push(*fp),
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

    fn pool_down(&self, model: &str, pool: &str) -> Option<&Vec<Fingerprint>> {
        self.down.get(model).and_then(|pools| pools.get(pool))
    }

    /// A model is a healthy fallback target when nothing says it is saturated or
    /// failing everywhere and at least one of its pools is healthy.
    fn model_healthy(&self, model: &str, models: &BTreeMap<String, ModelConfig>) -> bool {
        !self.statics.contains_key(model)
            && !self.saturated.contains_key(model)
            && models.get(model).is_some_and(|m| {
                m.pools
                    .iter()
                    .any(|p| self.pool_down(model, p.name()).is_none())
            })
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
    /// Pools said to be unhealthy.
    pub unhealthy_pools: Vec<String>,
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
    let mut unhealthy_pools = Vec::new();
    let mut first_healthy_pool = None;
    for pool in &model.pools {
        match health.pool_down(name, pool.name()) {
            Some(fps) => {
                unhealthy_pools.push(pool.name().to_owned());
                conditions.push(format!("pool {} failing", pool.name()));
                alerts.extend(fps);
            }
            None if first_healthy_pool.is_none() => {
                first_healthy_pool = Some(pool.name().to_owned())
            }
            None => {}
        }
    }
    let primary = model.pools.first().map(|p| p.name()).unwrap_or_default();
    let primary_healthy = !unhealthy_pools.iter().any(|p| p == primary);
    let mut required = if primary_healthy {
        Rung::Normal
    } else {
        Rung::Failover
    };
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
        conditions,
        alerts,
    }
}

/// The pool and alias a model has on `rung`: the primary when normal; otherwise the
/// current pool while it stays healthy (no needless moves), else the first healthy one.
fn route_for(
    current_pool: &str,
    rung: Rung,
    model: &ModelConfig,
    plan: &Plan,
) -> (String, Option<String>) {
    let primary = model.pools.first().map(|p| p.name()).unwrap_or_default();
    let pool = if rung == Rung::Normal {
        primary.to_owned()
    } else if model.pools.iter().any(|p| p.name() == current_pool)
        && !plan.unhealthy_pools.iter().any(|p| p == current_pool)
    {
        current_pool.to_owned()
    } else {
        plan.first_healthy_pool
            .clone()
            .unwrap_or_else(|| primary.to_owned())
    };
    let alias = (rung == Rung::Degraded)
        .then(|| plan.alias.clone().or_else(|| model.fallback.clone()))
        .flatten();
    (pool, alias)
}

/// The inputs of one evaluation that do not change within it.
pub(crate) struct Ctx<'a> {
    pub name: &'a str,
    pub model: &'a ModelConfig,
    pub policy: &'a LadderPolicy,
    pub plan: &'a Plan,
    pub now: Timestamp,
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
        refresh_pool(st, cx, out);
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
        move_to(st, cx.plan.target, rule, true, cx, out);
    } else if let Some((to, ready_at, rule)) = next_step_down(st, cx)
        && now >= ready_at
    {
        move_to(st, to, rule, true, cx, out);
        st.last_deescalation = Some(now);
    }
    refresh_pool(st, cx, out);
    if let Some((_, ready_at, _)) = next_step_down(st, cx) {
        st.wake_at = Some(ready_at.max(now + std::time::Duration::from_millis(1)));
    }
    st.reason = if !cx.plan.conditions.is_empty() {
        cx.plan.conditions.join("; ")
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
    let (to, at, _) = next_step_down(st, cx)?;
    if st.pin.is_none() {
        let mut transitions = st.transitions.clone();
        transitions.push_back((at, st.rung, to));
        let window = cx.policy.flap.window.0;
        while transitions
            .front()
            .is_some_and(|(t, _, _)| at.since(*t) > window)
        {
            transitions.pop_front();
        }
        if swings(&transitions) > cx.policy.flap.max_transitions {
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

fn move_to(
    st: &mut ModelState,
    to: Rung,
    rule: Rule,
    counts: bool,
    cx: &Ctx<'_>,
    out: &mut Vec<Decision>,
) {
    let from = st.rung;
    let (pool, alias) = route_for(&st.pool, to, cx.model, cx.plan);
    st.rung = to;
    st.since = cx.now;
    st.pool.clone_from(&pool);
    st.alias.clone_from(&alias);
    out.push(Decision::Transition {
        model: cx.name.to_owned(),
        from,
        to,
        pool,
        alias,
        rule,
    });
    if !counts {
        return;
    }
    let window = cx.policy.flap.window.0;
    st.transitions.push_back((cx.now, from, to));
    while st
        .transitions
        .front()
        .is_some_and(|(t, _, _)| cx.now.since(*t) > window)
    {
        st.transitions.pop_front();
    }
    let swings = swings(&st.transitions);
    if st.pin.is_none() && swings > cx.policy.flap.max_transitions {
        let high = st
            .transitions
            .iter()
            .map(|(_, a, b)| (*a).max(*b))
            .max()
            .unwrap_or(to);
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

/// Counts the transitions that reverse direction (and the first one): a run of steps
/// in one direction, such as an incident escalating 0 → 1 → 2 → 3, is one movement,
/// not three, while up-down-up is three. Only reversals are flapping.
pub(crate) fn swings(transitions: &std::collections::VecDeque<(Timestamp, Rung, Rung)>) -> usize {
    let mut count = 0;
    let mut last_up = None;
    for (_, from, to) in transitions {
        let up = to > from;
        if last_up != Some(up) {
            count += 1;
            last_up = Some(up);
        }
    }
    count
}

/// Moves off a pool that became unhealthy while the rung stays the same.
fn refresh_pool(st: &mut ModelState, cx: &Ctx<'_>, out: &mut Vec<Decision>) {
    let (pool, alias) = route_for(&st.pool, st.rung, cx.model, cx.plan);
    if pool != st.pool {
        let why = if cx.plan.unhealthy_pools.contains(&st.pool) {
            format!("pool {} failing", st.pool)
        } else {
            "route recomputed".to_owned()
        };
        out.push(Decision::PoolChanged {
            model: cx.name.to_owned(),
            from: std::mem::replace(&mut st.pool, pool.clone()),
            to: pool,
            why,
        });
    }
    st.alias = alias;
}
