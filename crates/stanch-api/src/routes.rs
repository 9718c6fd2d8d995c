//! The route table: the one thing the controller publishes and every gateway applies.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::hash::Fnv64;
use crate::{Fingerprint, Timestamp};

/// A rung of a model's degradation ladder. Higher is more degraded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "lowercase")]
pub enum Rung {
    /// Route to the model's primary pool.
    Normal = 0,
    /// Route to the next healthy pool in the configured order.
    Failover = 1,
    /// Non-VIP tenants are served by the fallback model.
    Degraded = 2,
    /// Answer from the static FAQ set.
    Static = 3,
}

impl Rung {
    /// Every rung, lowest first.
    pub const ALL: [Rung; 4] = [Rung::Normal, Rung::Failover, Rung::Degraded, Rung::Static];

    /// The rung's position on the ladder, 0 to 3.
    pub const fn index(self) -> usize {
        self as usize
    }

    /// The rung at position `i`, if there is one.
    pub fn from_index(i: usize) -> Option<Rung> {
        Self::ALL.get(i).copied()
    }

    /// The wire name (`normal`, `failover`, `degraded`, `static`).
    pub const fn as_str(self) -> &'static str {
        match self {
            Rung::Normal => "normal",
            Rung::Failover => "failover",
            Rung::Degraded => "degraded",
            Rung::Static => "static",
        }
    }
}

impl fmt::Display for Rung {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The error for a rung name that is not one of the four.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown rung {0:?}: expected normal, failover, degraded or static (or 0 to 3)")]
pub struct BadRung(String);

impl FromStr for Rung {
    type Err = BadRung;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Rung::ALL
            .into_iter()
            .find(|r| r.as_str() == s || r.index().to_string() == s)
            .ok_or_else(|| BadRung(s.to_owned()))
    }
}

/// An immutable, versioned snapshot of how every gateway should route.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct RouteTable {
    /// Increases by one with every published change, within an epoch.
    pub version: u64,
    /// Changes only when the controller lost its state history; versions from
    /// different epochs are not comparable.
    pub epoch: String,
    /// FNV-1a hash of `models` and `blocked`, so clients can detect identical content.
    pub hash: String,
    /// When this version was made.
    pub generated_at: Timestamp,
    /// Routing per model, keyed by model name.
    pub models: BTreeMap<String, ModelRoute>,
    /// Endpoints that gateways should give the lowest priority until `until`.
    pub blocked: Vec<BlockedEndpoint>,
}

impl RouteTable {
    /// The content hash of `models` and `blocked`, as 16 hex digits.
    pub fn content_hash(
        models: &BTreeMap<String, ModelRoute>,
        blocked: &[BlockedEndpoint],
    ) -> String {
        let mut h = Fnv64::default();
        // serde_json of BTreeMaps and Vecs is deterministic.
        h.write(&serde_json::to_vec(models).unwrap_or_default());
        h.write(&serde_json::to_vec(blocked).unwrap_or_default());
        format!("{:016x}", h.finish())
    }
}

/// How gateways route one model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct ModelRoute {
    /// The ladder rung in force.
    pub rung: Rung,
    /// The pool that serves the model's own traffic (and VIP traffic when degraded).
    pub pool: String,
    /// When degraded: the model that serves non-VIP tenants.
    pub alias: Option<String>,
    /// Tenant classes that keep the original model while degraded.
    #[serde(default)]
    pub alias_exempt: Vec<String>,
    /// When static: the FAQ set gateways answer from.
    pub faq: Option<String>,
    /// When this rung (and pool) took effect.
    pub since: Timestamp,
    /// Gateways honour this entry until then; after it, they route normally (fail-open).
    pub lease_until: Timestamp,
    /// Why the model is on this rung, for humans.
    pub reason: String,
    /// Fingerprints of the alerts behind the decision.
    #[serde(default)]
    pub alerts: Vec<Fingerprint>,
    /// True when an operator's override, not automation, set this entry.
    pub overridden: bool,
    /// While the model's own traffic moves between pools (a partial failover, a
    /// fail-back in steps): each pool's share of it, in percent, in the configured
    /// pool order, summing to 100. Empty when `pool` takes all of it. A client that
    /// does not know this field sends everything to `pool`, which is always the pool
    /// with the largest share (the earlier in pool order on a tie).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shares: Vec<PoolShare>,
    /// While non-VIP traffic moves to or from `alias` in steps: the percentage of it
    /// the alias serves, the rest staying on the model. Absent when the alias takes
    /// all of it. A client that does not know this field sends all non-VIP traffic to
    /// `alias` whenever it is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(range(min = 1, max = 99)))]
    pub alias_percent: Option<u8>,
}

impl ModelRoute {
    /// Whether `shares` and `alias_percent` are as the wire promises: shares of
    /// distinct pools, each over 0, summing to 100, `pool` the largest (the first on
    /// a tie); an alias percentage from 1 to 99, with an alias. What a gateway checks
    /// before it applies a table.
    pub fn check_split(&self) -> Result<(), crate::Invalid> {
        use crate::Invalid;
        if !self.shares.is_empty() {
            for (i, s) in self.shares.iter().enumerate() {
                if s.percent == 0 {
                    return Err(Invalid::new(format!("shares[{i}].percent"), "0"));
                }
                if self.shares[..i].iter().any(|t| t.pool == s.pool) {
                    return Err(Invalid::new(
                        format!("shares[{i}].pool"),
                        format!("{:?} has a share already", s.pool),
                    ));
                }
            }
            let total: u32 = self.shares.iter().map(|s| u32::from(s.percent)).sum();
            if total != 100 {
                return Err(Invalid::new(
                    "shares",
                    format!("they sum to {total}, not 100"),
                ));
            }
            let largest = largest_share(&self.shares);
            if largest != Some(self.pool.as_str()) {
                return Err(Invalid::new(
                    "pool",
                    format!("{:?} is not the largest share ({largest:?} is)", self.pool),
                ));
            }
        }
        let field = "alias_percent";
        match self.alias_percent {
            Some(p) if !(1..=99).contains(&p) => {
                Err(Invalid::new(field, format!("{p} is not from 1 to 99")))
            }
            Some(_) if self.alias.is_none() => Err(Invalid::new(field, "set without an alias")),
            _ => Ok(()),
        }
    }
}

/// The pool with the largest share, the first of them on a tie: what `pool` names
/// while a model's traffic is split.
pub fn largest_share(shares: &[PoolShare]) -> Option<&str> {
    shares
        .iter()
        .reduce(|a, b| if b.percent > a.percent { b } else { a })
        .map(|s| s.pool.as_str())
}

/// The percentage of a model's traffic that `of` gets from a route to `pool` split by
/// `shares`: its share while split, else all of it for `pool` and none for the rest.
pub fn share_of(pool: &str, shares: &[PoolShare], of: &str) -> u8 {
    if shares.is_empty() {
        if of == pool { 100 } else { 0 }
    } else {
        shares
            .iter()
            .find(|s| s.pool == of)
            .map_or(0, |s| s.percent)
    }
}

/// One pool's share of a model's traffic.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct PoolShare {
    /// The pool.
    pub pool: String,
    /// Its share, in percent (1 to 100).
    #[cfg_attr(feature = "schema", schemars(range(min = 1, max = 100)))]
    pub percent: u8,
}

/// An endpoint soft-block: lowest priority, not removal.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct BlockedEndpoint {
    /// The endpoint as gateways name it (URL or host:port).
    pub endpoint: String,
    /// The model the block applies to; `null` blocks the endpoint for every model.
    pub model: Option<String>,
    /// When the block ends on its own.
    pub until: Timestamp,
    /// Why it was blocked.
    pub reason: String,
}

/// The longest route table, in bytes of its JSON, that any watch transport carries:
/// clients read SSE events and gRPC messages up to this size. The controller's limits
/// keep every table it can publish well within it.
pub const MAX_TABLE_BYTES: usize = 32 << 20;

/// The longest endpoint name a block may carry (reports, alerts, overrides and the
/// configuration are held to it), in bytes.
pub const MAX_ENDPOINT_BYTES: usize = 512;

/// The longest model name, in bytes.
pub const MAX_MODEL_BYTES: usize = 256;

/// The longest reason a block carries in the table, in characters (a longer one is
/// cut, with `…`; the history keeps the decision that made it).
pub const MAX_BLOCK_REASON_CHARS: usize = 256;

/// Whether `name` can name an endpoint: 1 to [`MAX_ENDPOINT_BYTES`] bytes, no control
/// characters.
pub fn valid_endpoint(name: &str) -> bool {
    !name.trim().is_empty()
        && name.len() <= MAX_ENDPOINT_BYTES
        && !name.chars().any(char::is_control)
}

/// The names a block, a report or a configuration may give the endpoint at `url`: the
/// URL itself, then what follows each `//` in it (`host:port`, with any path). One
/// relation for every place that matches an endpoint to its name, so that the
/// controller takes a report for exactly the endpoints a gateway would apply a block to.
pub fn endpoint_names(url: &str) -> impl Iterator<Item = &str> {
    std::iter::once(url).chain(url.match_indices("//").map(|(at, _)| &url[at + 2..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endpoint_is_named_by_its_url_or_what_follows_a_double_slash() {
        let names: Vec<&str> = endpoint_names("http://10.0.0.7:8000").collect();
        assert_eq!(names, ["http://10.0.0.7:8000", "10.0.0.7:8000"]);
        let names: Vec<&str> = endpoint_names("10.0.0.7:8000").collect();
        assert_eq!(names, ["10.0.0.7:8000"]);
        let names: Vec<&str> = endpoint_names("http://a:1//b:2").collect();
        assert_eq!(names, ["http://a:1//b:2", "a:1//b:2", "b:2"]);
    }

    #[test]
    fn rung_wire_names_and_order() {
        assert_eq!(
            serde_json::to_string(&Rung::Degraded).unwrap(),
            "\"degraded\""
        );
        assert!(Rung::Normal < Rung::Failover && Rung::Degraded < Rung::Static);
        assert_eq!("static".parse::<Rung>().unwrap(), Rung::Static);
        assert_eq!("1".parse::<Rung>().unwrap(), Rung::Failover);
        assert!("panic".parse::<Rung>().is_err());
    }

    fn route(
        pool: &str,
        shares: &[(&str, u8)],
        alias: Option<&str>,
        alias_percent: Option<u8>,
    ) -> ModelRoute {
        let t = Timestamp::from_millis(0);
        ModelRoute {
            rung: Rung::Failover,
            pool: pool.into(),
            alias: alias.map(Into::into),
            alias_exempt: vec![],
            faq: None,
            since: t,
            lease_until: t,
            reason: String::new(),
            alerts: vec![],
            overridden: false,
            shares: shares
                .iter()
                .map(|(pool, percent)| PoolShare {
                    pool: (*pool).into(),
                    percent: *percent,
                })
                .collect(),
            alias_percent,
        }
    }

    #[test]
    fn an_entry_without_a_split_is_written_as_before_splits_existed() {
        let json = serde_json::to_value(route("dc-a", &[], None, None)).unwrap();
        assert!(json.get("shares").is_none(), "{json}");
        assert!(json.get("alias_percent").is_none(), "{json}");
        let back: ModelRoute = serde_json::from_value(json).unwrap();
        assert!(back.shares.is_empty() && back.alias_percent.is_none());
    }

    #[test]
    fn a_malformed_split_is_refused_naming_the_field() {
        let good = [
            route("dc-a", &[], None, None),
            route("dc-b", &[("dc-a", 25), ("dc-b", 75)], None, None),
            route("dc-a", &[("dc-a", 50), ("dc-b", 50)], None, None),
            route("dc-a", &[], Some("qwen-14b"), Some(50)),
        ];
        for r in good {
            assert_eq!(r.check_split(), Ok(()), "{r:?}");
        }
        let bad = [
            (
                route("dc-a", &[("dc-a", 60), ("dc-b", 50)], None, None),
                "shares",
                "they sum to 110, not 100",
            ),
            (
                route("dc-a", &[("dc-a", 100), ("dc-b", 0)], None, None),
                "shares[1].percent",
                "0",
            ),
            (
                route("dc-a", &[("dc-a", 50), ("dc-a", 50)], None, None),
                "shares[1].pool",
                "\"dc-a\" has a share already",
            ),
            (
                route("dc-a", &[("dc-a", 25), ("dc-b", 75)], None, None),
                "pool",
                "\"dc-a\" is not the largest share (Some(\"dc-b\") is)",
            ),
            (
                route("dc-b", &[("dc-a", 50), ("dc-b", 50)], None, None),
                "pool",
                "\"dc-b\" is not the largest share (Some(\"dc-a\") is)",
            ),
            (
                route("dc-a", &[], Some("qwen-14b"), Some(100)),
                "alias_percent",
                "100 is not from 1 to 99",
            ),
            (
                route("dc-a", &[], Some("qwen-14b"), Some(0)),
                "alias_percent",
                "0 is not from 1 to 99",
            ),
            (
                route("dc-a", &[], None, Some(50)),
                "alias_percent",
                "set without an alias",
            ),
        ];
        for (r, field, problem) in bad {
            assert_eq!(
                r.check_split(),
                Err(crate::Invalid::new(field, problem)),
                "{r:?}"
            );
        }
    }
}
