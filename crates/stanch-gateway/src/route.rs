//! Route: what the route table says of the requested model, and so what serves it.
//!
//! The table's entry for the model (honoured only within its lease: past it, routing
//! is as if there were no table, fail-open) puts it on a rung of the ladder: normal or
//! failover (its pools, the table's active pool first), degraded (its alias, unless the
//! caller is exempt), or static (the FAQ). What serves the request then becomes a
//! [`plan`]: the (model, pool) targets to try in order, which [`crate::serving`] works
//! through.
//!
//! A split spreads requests by share: with `shares`, the pool a request tries first
//! is drawn by the model's turn, so that of every 100 requests each pool is first for
//! exactly its percentage, interleaved (turn × 61 mod 100 visits every percent once in
//! 100 turns); with `alias_percent`, that many of every 100 non-exempt requests go to
//! the alias while degraded, the rest to the model itself.

use std::sync::atomic::{AtomicU64, Ordering};

use stanch_api::{ModelRoute, RouteTable, Rung, Timestamp};

use crate::Gateway;
use crate::metrics::{Label, ModelLabel};
use crate::request::Ctx;

/// A (model, pool index) of a plan.
pub(crate) type Target<'g> = (&'g str, usize);

/// What serves an admitted request.
pub(crate) enum Route<'g> {
    /// The FAQ: this set, if the table names one.
    Faq(Option<String>),
    /// The plan of the model that serves it (`Ctx::serving`, set here).
    Plan(Vec<Target<'g>>),
}

/// What the table's word on a model comes to.
#[derive(Debug, PartialEq, Eq)]
enum Decision<'g> {
    /// Serve it from this model's pools (its own, or its alias's, when degraded).
    Serve { model: &'g str, degraded: bool },
    /// Answer from the FAQ: this set, if the table names one.
    Faq(Option<String>),
}

/// Routes an admitted request: the model that serves it (its own, or its alias,
/// counted, while degraded) and its plan, or the FAQ.
pub(crate) fn route<'g>(ctx: &mut Ctx<'g>) -> Route<'g> {
    match decide(ctx) {
        Decision::Faq(set) => Route::Faq(set),
        Decision::Serve { model, degraded } => {
            if degraded {
                ctx.degraded = true;
                ctx.gw
                    .metrics
                    .degraded
                    .get_or_create(&ModelLabel {
                        model: Label::from(ctx.model),
                    })
                    .inc();
            }
            ctx.serving = model;
            Route::Plan(plan(ctx.gw, model, ctx.route_table(), ctx.wall))
        }
    }
}

/// The table's word on the request's model. An alias is followed once: a degraded
/// model's alias that is itself static answers from the FAQ, whatever the alias's
/// own alias.
fn decide<'g>(ctx: &Ctx<'g>) -> Decision<'g> {
    let gw: &'g Gateway = ctx.gw;
    let (model, table) = (ctx.model, ctx.route_table());
    let faq_answers = ctx.api.answers_from_faq();
    let Some(entry) = honoured(table, model, ctx.wall) else {
        return Decision::Serve {
            model,
            degraded: false,
        };
    };
    match entry.rung {
        Rung::Static if faq_answers => Decision::Faq(entry.faq.clone()),
        Rung::Degraded => {
            let exempt = ctx.vip() && entry.alias_exempt.iter().any(|c| c == "vip");
            let alias = entry
                .alias
                .as_ref()
                .filter(|_| !exempt)
                .and_then(|a| gw.models.get_key_value(a.as_str()))
                .map(|(name, _)| name.as_str());
            // A split of the alias's traffic: this request's turn may keep the model.
            let alias = alias.filter(|_| {
                entry.alias_percent.is_none_or(|percent| {
                    gw.models
                        .get(model)
                        .is_none_or(|plan| percent_of(next(&plan.alias_turn)) < percent)
                })
            });
            match alias {
                None => Decision::Serve {
                    model,
                    degraded: false,
                },
                Some(alias) => match honoured(table, alias, ctx.wall) {
                    Some(e) if e.rung == Rung::Static && faq_answers => {
                        Decision::Faq(e.faq.clone())
                    }
                    _ => Decision::Serve {
                        model: alias,
                        degraded: true,
                    },
                },
            }
        }
        _ => Decision::Serve {
            model,
            degraded: false,
        },
    }
}

/// The table's entry for `model`, unless its lease has passed: an expired entry is not
/// honoured, and routing falls back to normal (fail-open).
fn honoured<'t>(
    table: Option<&'t RouteTable>,
    model: &str,
    wall: Timestamp,
) -> Option<&'t ModelRoute> {
    table?.models.get(model).filter(|e| e.lease_until > wall)
}

/// The (model, pool) pairs to try in order: the model's active pool, its other pools,
/// then each fallback model's active and other pools.
pub(crate) fn plan<'g>(
    gw: &'g Gateway,
    model: &str,
    table: Option<&RouteTable>,
    wall: Timestamp,
) -> Vec<Target<'g>> {
    let mut out = Vec::new();
    let Some((model, config)) = gw.config.models.get_key_value(model) else {
        return out;
    };
    for m in std::iter::once(model).chain(&config.fallbacks) {
        let Some(plan) = gw.models.get(m) else {
            continue;
        };
        let active = honoured(table, m, wall)
            .and_then(|e| {
                let pool = if e.shares.is_empty() {
                    e.pool.as_str()
                } else {
                    by_share(percent_of(next(&plan.turn)), e)
                };
                plan.pools.iter().position(|(name, _)| name == pool)
            })
            .unwrap_or(0);
        out.push((m.as_str(), active));
        out.extend(
            (0..plan.pools.len())
                .filter(|i| *i != active)
                .map(|i| (m.as_str(), i)),
        );
    }
    out
}

/// The next turn of a split.
fn next(turn: &AtomicU64) -> u64 {
    turn.fetch_add(1, Ordering::Relaxed)
}

/// Where a turn falls among 100 percents: every 100 consecutive turns visit each
/// percent once, spread out rather than in runs (61 and 100 share no factor).
fn percent_of(turn: u64) -> u8 {
    u8::try_from(turn.wrapping_mul(61) % 100).unwrap_or(0)
}

/// The pool whose share holds `percent`, counting the shares in order; the entry's
/// `pool` if they do not reach it (a table the gateway checked sums them to 100).
fn by_share(percent: u8, entry: &ModelRoute) -> &str {
    let mut upto = 0u16;
    for share in &entry.shares {
        upto += u16::from(share.percent);
        if u16::from(percent) < upto {
            return &share.pool;
        }
    }
    &entry.pool
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use stanch_api::PoolShare;

    use super::*;

    fn split(shares: &[(&str, u8)]) -> ModelRoute {
        let route: ModelRoute = serde_json::from_value(serde_json::json!({
            "rung": "failover", "pool": "dc-b", "alias": null, "alias_exempt": [],
            "faq": null, "since": "2026-12-07T00:00:00Z", "lease_until": "2026-12-07T00:02:00Z",
            "reason": "", "alerts": [], "overridden": false,
        }))
        .unwrap();
        ModelRoute {
            shares: shares
                .iter()
                .map(|(pool, percent)| PoolShare {
                    pool: (*pool).to_owned(),
                    percent: *percent,
                })
                .collect(),
            ..route
        }
    }

    /// Requests per pool over `turns` turns from `from`.
    fn count(entry: &ModelRoute, from: u64, turns: u64) -> BTreeMap<String, u64> {
        let mut seen = BTreeMap::new();
        for turn in from..from + turns {
            *seen
                .entry(by_share(percent_of(turn), entry).to_owned())
                .or_default() += 1;
        }
        seen
    }

    #[test]
    fn every_hundred_turns_give_each_pool_exactly_its_share() {
        for shares in [
            vec![("dc-a", 25), ("dc-b", 75)],
            vec![("dc-a", 1), ("dc-b", 99)],
            vec![("dc-a", 25), ("dc-b", 38), ("dc-c", 37)],
            vec![("dc-a", 50), ("dc-b", 50)],
        ] {
            let entry = split(&shares);
            // From any turn (the counter wraps only after 2^64 requests).
            for from in [0, 7, 1_000_003, u64::MAX / 2] {
                let seen = count(&entry, from, 100);
                for (pool, percent) in &shares {
                    assert_eq!(seen[*pool], u64::from(*percent), "{shares:?} from {from}");
                }
            }
        }
    }

    #[test]
    fn shares_interleave_rather_than_run() {
        // A quarter to dc-a: never more than 4 requests in a row on one pool, and dc-a
        // is first within the first 5 turns of any window.
        let entry = split(&[("dc-a", 25), ("dc-b", 75)]);
        let pools: Vec<_> = (0..400)
            .map(|turn| by_share(percent_of(turn), &entry) == "dc-a")
            .collect();
        let longest_b = pools.split(|a| *a).map(<[bool]>::len).max().unwrap();
        let longest_a = pools.split(|a| !*a).map(<[bool]>::len).max().unwrap();
        assert!(longest_b <= 4, "{longest_b} on dc-b in a row");
        assert!(longest_a <= 2, "{longest_a} on dc-a in a row");
    }
}
