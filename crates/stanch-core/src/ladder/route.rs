//! Where a model's traffic goes: the split of a model's traffic across its pools while
//! a pool is slow, the route each rung gives, and how a route moves while the rung
//! stays (away from the primary at once, back only after the window).

use stanch_api::routes::{PoolShare, largest_share, share_of};
use stanch_api::{HumanDuration, Rung};

use super::{Ctx, Plan, count_move, guard_flapping};
use crate::config::ModelConfig;
use crate::decision::Decision;
use crate::mapping::ALL;
use crate::state::ModelState;

/// The model's traffic across its pools, in failover order, given the share of each
/// pool's traffic to move away: each pool that can take traffic keeps what its shift
/// leaves of what reaches it and passes the rest on; the last one keeps all that
/// reaches it. Empty when one pool takes everything (a whole switch, or no shift at
/// all): then the rung's pool says where traffic goes.
pub(crate) fn split(shifts: &[(&str, u8)]) -> Vec<PoolShare> {
    let takers: Vec<_> = shifts.iter().filter(|(_, s)| *s < ALL).collect();
    let mut left = u32::from(ALL);
    let mut shares = Vec::new();
    for (i, (pool, shift)) in takers.iter().enumerate() {
        let kept = if i + 1 == takers.len() {
            left
        } else {
            // Rounded to the nearest percent; what is left still sums to 100.
            (left * u32::from(ALL - *shift) + 50) / 100
        };
        left -= kept;
        if kept > 0 {
            shares.push(PoolShare {
                pool: (*pool).to_owned(),
                percent: u8::try_from(kept).unwrap_or(ALL),
            });
        }
    }
    if shares.len() > 1 { shares } else { Vec::new() }
}

/// Where a model's traffic goes on a rung.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Route {
    /// The pool: the largest share when the traffic is split.
    pub pool: String,
    /// The split across pools, if any.
    pub shares: Vec<PoolShare>,
    /// The alias while degraded.
    pub alias: Option<String>,
}

/// Where a model's traffic goes on `rung`: the primary when normal; otherwise split as
/// the plan says while a pool is slow, else the current pool while it stays healthy
/// (no needless moves), else the first healthy one.
pub(crate) fn route_for(current_pool: &str, rung: Rung, model: &ModelConfig, plan: &Plan) -> Route {
    let primary = model.pools.first().map(|p| p.name()).unwrap_or_default();
    let mut shares = Vec::new();
    let pool = if rung == Rung::Normal {
        primary.to_owned()
    } else if let Some(largest) = largest_share(&plan.split) {
        shares.clone_from(&plan.split);
        largest.to_owned()
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
    Route {
        pool,
        shares,
        alias,
    }
}

/// Each pool's share of the model's traffic, in failover order: how far two routes
/// are from the primary compare as these do (the greater, the nearer).
pub(crate) fn spread(model: &ModelConfig, pool: &str, shares: &[PoolShare]) -> Vec<u8> {
    model
        .pools
        .iter()
        .map(|p| share_of(pool, shares, p.name()))
        .collect()
}

/// Moves a model's traffic between pools while its rung stays the same: off a pool
/// that became unhealthy at once; by share, away from the primary at once and back
/// toward it only once the conditions have allowed it for the stabilization window,
/// the route has been held for the minimum dwell, and the flap guard does not hold.
pub(super) fn refresh_route(st: &mut ModelState, cx: &Ctx<'_>, out: &mut Vec<Decision>) {
    if st.failback.is_some() {
        // The fail-back sets the route, step by step.
        return;
    }
    let route = route_for(&st.pool, st.rung, cx.model, cx.plan);
    st.alias.clone_from(&route.alias);
    if route.pool == st.pool && route.shares == st.shares {
        st.shares_back_since = None;
        return;
    }
    if route.shares.is_empty() && st.shares.is_empty() {
        let why = if cx.plan.unhealthy_pools.contains(&st.pool) {
            format!("pool {} failing", st.pool)
        } else {
            "route recomputed".to_owned()
        };
        out.push(Decision::PoolChanged {
            model: cx.name.to_owned(),
            from: std::mem::replace(&mut st.pool, route.pool.clone()),
            to: route.pool,
            why,
        });
        return;
    }
    // A pool that fails outright is left at once, whichever way that moves traffic.
    let must_leave = cx
        .plan
        .unhealthy_pools
        .iter()
        .any(|p| *p == st.pool || st.shares.iter().any(|s| s.pool == *p));
    if cx.plan.target < st.rung && cx.plan.split.is_empty() && !must_leave {
        // The conditions are clearing and ask for no split: the step down brings the
        // traffic back. (A split they still ask for applies while the rung is held
        // above them, by an operator or the flap guard.)
        st.shares_back_since = None;
        return;
    }
    let now = cx.now;
    let before = spread(cx.model, &st.pool, &st.shares);
    let after = spread(cx.model, &route.pool, &route.shares);
    let away = after < before;
    if !away && !must_leave {
        let since = *st.shares_back_since.get_or_insert(now);
        let window = cx
            .policy
            .backoff
            .scaled(cx.policy.recover_after.0, st.backoff_level);
        let held_from = st.shares_since.unwrap_or(st.since).max(st.since);
        let ready_at = (since + window).max(held_from + cx.policy.min_dwell.0);
        if st.pin.is_some() || now < ready_at {
            if st.pin.is_none() {
                st.wake_at = Some(st.wake_at.map_or(ready_at, |w| w.min(ready_at)));
            }
            return;
        }
    }
    let why = if away || must_leave {
        cx.plan.conditions.join("; ")
    } else {
        let clear_for = now.since(st.shares_back_since.unwrap_or(now));
        format!(
            "shares back toward the primary after {}",
            HumanDuration(clear_for)
        )
    };
    st.shares_since = Some(now);
    st.shares_back_since = None;
    count_move(st, now, away);
    out.push(Decision::SharesChanged {
        model: cx.name.to_owned(),
        from: std::mem::replace(&mut st.shares, route.shares.clone()),
        to: route.shares,
        from_pool: std::mem::replace(&mut st.pool, route.pool.clone()),
        to_pool: route.pool,
        away,
        why,
    });
    guard_flapping(st, cx, out);
}
