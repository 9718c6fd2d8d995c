//! Route: what the route table says of the requested model, and so what serves it.
//!
//! The table's entry for the model (honoured only within its lease: past it, routing
//! is as if there were no table, fail-open) puts it on a rung of the ladder: normal or
//! failover (its pools, the table's active pool first), degraded (its alias, unless the
//! caller is exempt), or static (the FAQ). What serves the request then becomes a
//! [`plan`]: the (model, pool) targets to try in order, which [`crate::serving`] works
//! through.

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
            .and_then(|e| plan.pools.iter().position(|(name, _)| *name == e.pool))
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
