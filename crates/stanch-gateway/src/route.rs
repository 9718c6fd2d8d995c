//! Route: what the route table says of the requested model, and so what serves it.
//!
//! The table's entry for the model (honoured only within its lease: past it, routing
//! is as if there were no table, fail-open) puts it on a rung of the ladder: normal or
//! failover (its pools, the table's active pool first), degraded (its alias, unless the
//! caller is exempt), or static (the FAQ). What serves the request then becomes a plan:
//! the (model, pool) pairs to try in order, which [`crate::attempt`] works through.

use stanch_api::{ModelRoute, RouteTable, Rung, Timestamp};

use crate::Gateway;
use crate::admit::Ctx;
use crate::endpoints::Endpoint;
use crate::metrics::ModelLabel;

/// What the table's word on a model comes to.
#[derive(Debug, PartialEq, Eq)]
enum Decision<'g> {
    /// Serve it from this model's pools (its own, or its alias's, when degraded).
    Serve { model: &'g str, degraded: bool },
    /// Answer from the FAQ: this set, if the table names one.
    Faq(Option<String>),
}

/// Routes an admitted request and answers it.
pub(crate) async fn route(ctx: &mut Ctx<'_>) -> axum::response::Response {
    match decide(ctx) {
        Decision::Faq(set) => crate::respond::faq(ctx, set.as_deref(), "static"),
        Decision::Serve { model, degraded } => {
            if degraded {
                ctx.degraded = true;
                ctx.gw
                    .metrics
                    .degraded
                    .get_or_create(&ModelLabel {
                        model: ctx.model.to_owned(),
                    })
                    .inc();
            }
            ctx.serving = model;
            crate::attempt::serve(ctx).await
        }
    }
}

/// The table's word on the request's model. An alias is followed once: a degraded
/// model's alias that is itself static answers from the FAQ, whatever the alias's
/// own alias.
fn decide<'g>(ctx: &Ctx<'g>) -> Decision<'g> {
    let gw: &'g Gateway = ctx.gw;
    let (model, table) = (ctx.model, ctx.table.as_deref());
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
pub(crate) fn honoured<'t>(
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
) -> Vec<(&'g str, usize)> {
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

/// The block the route table puts on an endpoint for its model, if any.
pub(crate) fn table_block(table: &RouteTable, e: &Endpoint, now: Timestamp) -> Option<Timestamp> {
    table
        .blocked
        .iter()
        .filter(|b| b.until > now && b.model.as_ref().is_none_or(|m| *m == e.model))
        // A block names the endpoint by URL or by host:port, which the URL ends with
        // right after `//` (compared in place: this runs for every candidate).
        .filter(|b| {
            e.url == b.endpoint
                || e.url
                    .strip_suffix(b.endpoint.as_str())
                    .is_some_and(|scheme| scheme.ends_with("//"))
        })
        .map(|b| b.until)
        .min()
}

#[cfg(test)]
mod tests {
    use stanch_api::{BlockedEndpoint, RouteTable, Timestamp};

    use super::table_block;
    use crate::endpoints::Endpoint;

    #[test]
    fn a_table_block_names_an_endpoint_by_url_or_host_and_port() {
        let e = Endpoint::new(
            "http://10.0.0.7:8000",
            "qwen-72b",
            "dc-a",
            1,
            10,
            None,
            None,
            false,
            &crate::upstream::Connector::testing(),
        )
        .unwrap();
        let block = |endpoint: &str, model: Option<&str>, until: i64| BlockedEndpoint {
            endpoint: endpoint.to_owned(),
            model: model.map(str::to_owned),
            until: Timestamp::from_millis(until),
            reason: "test".into(),
        };
        let table = |blocked: Vec<BlockedEndpoint>| RouteTable {
            version: 1,
            epoch: "e".into(),
            hash: String::new(),
            generated_at: Timestamp::from_millis(0),
            models: Default::default(),
            blocked,
        };
        let now = Timestamp::from_millis(1_000);
        let blocked = |b: BlockedEndpoint| table_block(&table(vec![b]), &e, now);
        assert_eq!(
            blocked(block("http://10.0.0.7:8000", None, 2_000)),
            Some(Timestamp::from_millis(2_000))
        );
        assert_eq!(
            blocked(block("10.0.0.7:8000", Some("qwen-72b"), 3_000)),
            Some(Timestamp::from_millis(3_000))
        );
        assert_eq!(
            blocked(block("0.0.7:8000", None, 2_000)),
            None,
            "a suffix is not a host"
        );
        assert_eq!(
            blocked(block("10.0.0.7:8000", Some("qwen-14b"), 2_000)),
            None,
            "another model"
        );
        assert_eq!(blocked(block("10.0.0.7:8000", None, 500)), None, "expired");
    }
}
