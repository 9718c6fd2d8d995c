//! The gRPC watch's wire types, compiled from `proto/stanch/v1` at build time, and
//! their conversion to and from the route table of `stanch-api`.
//!
//! Apart from `stanch-api` so that the serde wire types, and the pure core built on
//! them, do not carry the generated code's dependencies (prost, tonic): only the
//! gRPC server, the gRPC client and tools that speak the watch depend on this crate.
//!
//! The protobuf table is the JSON one field for field: a table converted to protobuf
//! and back is the same table, so every transport serves one content (a test in
//! `stanch-server` holds HTTP, SSE and gRPC to it).

use std::collections::BTreeMap;

use stanch_api::{
    BlockedEndpoint, Fingerprint, ModelRoute, PoolShare, RouteTable, Rung, Timestamp,
};

/// Package `stanch.v1`: messages, `route_watch_client` and `route_watch_server`.
#[allow(
    missing_docs,
    clippy::all,
    clippy::pedantic,
    reason = "generated code; the proto file documents every field"
)]
pub mod v1 {
    include!(concat!(env!("OUT_DIR"), "/stanch.v1.rs"));
}

/// The encoded `FileDescriptorSet` of `proto/stanch/v1`, with its comments, for
/// server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/stanch.v1.descriptors.bin"));

/// The full name of the watch service, as gRPC health and reflection name it.
pub const ROUTE_WATCH_SERVICE: &str = "stanch.v1.RouteWatch";

/// `message` as gRPC puts it on the wire: a byte saying it is not compressed, its
/// length in 4 bytes, big-endian, then the message. For clients written on HTTP/2
/// itself (the benchmark's lean watchers, tests of what no gRPC library would send).
pub fn grpc_frame(message: &impl prost::Message) -> Vec<u8> {
    let len = message.encoded_len();
    let mut frame = Vec::with_capacity(5 + len);
    frame.push(0);
    frame.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes());
    message.encode(&mut frame).expect("a Vec grows");
    frame
}

/// Why a protobuf route table is not one stanch can apply; names the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {problem}")]
pub struct BadTable {
    /// The field, as a path (`models["qwen-72b"].rung`).
    pub field: String,
    /// What is wrong with it.
    pub problem: String,
}

fn bad(field: impl Into<String>, problem: impl Into<String>) -> BadTable {
    BadTable {
        field: field.into(),
        problem: problem.into(),
    }
}

impl From<Rung> for v1::Rung {
    fn from(rung: Rung) -> v1::Rung {
        match rung {
            Rung::Normal => v1::Rung::Normal,
            Rung::Failover => v1::Rung::Failover,
            Rung::Degraded => v1::Rung::Degraded,
            Rung::Static => v1::Rung::Static,
        }
    }
}

impl From<&RouteTable> for v1::RouteTable {
    fn from(t: &RouteTable) -> v1::RouteTable {
        v1::RouteTable {
            version: t.version,
            epoch: t.epoch.clone(),
            hash: t.hash.clone(),
            generated_at_unix_ms: t.generated_at.as_millis(),
            models: t
                .models
                .iter()
                .map(|(name, m)| (name.clone(), v1::ModelRoute::from(m)))
                .collect(),
            blocked: t.blocked.iter().map(v1::BlockedEndpoint::from).collect(),
        }
    }
}

impl From<&ModelRoute> for v1::ModelRoute {
    fn from(m: &ModelRoute) -> v1::ModelRoute {
        v1::ModelRoute {
            rung: v1::Rung::from(m.rung).into(),
            pool: m.pool.clone(),
            alias: m.alias.clone(),
            alias_exempt: m.alias_exempt.clone(),
            faq: m.faq.clone(),
            since_unix_ms: m.since.as_millis(),
            lease_until_unix_ms: m.lease_until.as_millis(),
            reason: m.reason.clone(),
            alerts: m.alerts.iter().map(ToString::to_string).collect(),
            overridden: m.overridden,
            shares: m
                .shares
                .iter()
                .map(|s| v1::PoolShare {
                    pool: s.pool.clone(),
                    percent: s.percent.into(),
                })
                .collect(),
            alias_percent: m.alias_percent.map(u32::from),
        }
    }
}

impl From<&BlockedEndpoint> for v1::BlockedEndpoint {
    fn from(b: &BlockedEndpoint) -> v1::BlockedEndpoint {
        v1::BlockedEndpoint {
            endpoint: b.endpoint.clone(),
            model: b.model.clone(),
            until_unix_ms: b.until.as_millis(),
            reason: b.reason.clone(),
        }
    }
}

/// A time the JSON form can write too (RFC 3339 years 0 to 9999), or why not.
fn timestamp(field: impl FnOnce() -> String, ms: i64) -> Result<Timestamp, BadTable> {
    let t = Timestamp::from_millis(ms);
    if t.as_millis() == ms {
        Ok(t)
    } else {
        Err(bad(
            field(),
            format!("{ms} ms since the Unix epoch is outside years 0 to 9999"),
        ))
    }
}

impl TryFrom<v1::RouteTable> for RouteTable {
    type Error = BadTable;

    fn try_from(t: v1::RouteTable) -> Result<RouteTable, BadTable> {
        let mut models = BTreeMap::new();
        for (name, m) in t.models {
            let route = model_route(&name, m)?;
            models.insert(name, route);
        }
        let blocked = t
            .blocked
            .into_iter()
            .enumerate()
            .map(|(i, b)| {
                Ok(BlockedEndpoint {
                    until: timestamp(|| format!("blocked[{i}].until_unix_ms"), b.until_unix_ms)?,
                    endpoint: b.endpoint,
                    model: b.model,
                    reason: b.reason,
                })
            })
            .collect::<Result<_, BadTable>>()?;
        Ok(RouteTable {
            version: t.version,
            generated_at: timestamp(|| "generated_at_unix_ms".into(), t.generated_at_unix_ms)?,
            epoch: t.epoch,
            hash: t.hash,
            models,
            blocked,
        })
    }
}

fn model_route(name: &str, m: v1::ModelRoute) -> Result<ModelRoute, BadTable> {
    let field = |f: &str| format!("models[{name:?}].{f}");
    let rung = match v1::Rung::try_from(m.rung) {
        Ok(v1::Rung::Normal) => Rung::Normal,
        Ok(v1::Rung::Failover) => Rung::Failover,
        Ok(v1::Rung::Degraded) => Rung::Degraded,
        Ok(v1::Rung::Static) => Rung::Static,
        Ok(v1::Rung::Unspecified) => return Err(bad(field("rung"), "unspecified")),
        Err(_) => {
            return Err(bad(
                field("rung"),
                format!("{} is not a rung this gateway knows", m.rung),
            ));
        }
    };
    let alerts = m
        .alerts
        .iter()
        .enumerate()
        .map(|(i, a)| {
            a.parse::<Fingerprint>()
                .map_err(|e| bad(field(&format!("alerts[{i}]")), e.to_string()))
        })
        .collect::<Result<_, _>>()?;
    let percent = |f: String, p: u32| {
        u8::try_from(p)
            .ok()
            .filter(|p| *p <= 100)
            .ok_or_else(|| bad(f, format!("{p} is not a percentage")))
    };
    let shares = m
        .shares
        .into_iter()
        .enumerate()
        .map(|(i, s)| {
            Ok(PoolShare {
                percent: percent(field(&format!("shares[{i}].percent")), s.percent)?,
                pool: s.pool,
            })
        })
        .collect::<Result<_, BadTable>>()?;
    let alias_percent = m
        .alias_percent
        .map(|p| percent(field("alias_percent"), p))
        .transpose()?;
    Ok(ModelRoute {
        rung,
        since: timestamp(|| field("since_unix_ms"), m.since_unix_ms)?,
        lease_until: timestamp(|| field("lease_until_unix_ms"), m.lease_until_unix_ms)?,
        pool: m.pool,
        alias: m.alias,
        alias_exempt: m.alias_exempt,
        faq: m.faq,
        reason: m.reason,
        alerts,
        overridden: m.overridden,
        shares,
        alias_percent,
    })
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn stamp() -> impl Strategy<Value = Timestamp> {
        (Timestamp::MIN.as_millis()..=Timestamp::MAX.as_millis()).prop_map(Timestamp::from_millis)
    }

    fn model_route() -> impl Strategy<Value = ModelRoute> {
        (
            (0usize..4).prop_map(|i| Rung::from_index(i).expect("a rung")),
            ".{0,12}",
            proptest::option::of(".{0,12}"),
            proptest::collection::vec(".{0,8}", 0..3),
            proptest::option::of(".{0,12}"),
            (stamp(), stamp()),
            ".{0,24}",
            proptest::collection::vec(any::<u64>().prop_map(Fingerprint), 0..3),
            any::<bool>(),
            proptest::collection::vec(
                (".{0,8}", 0u8..=100).prop_map(|(pool, percent)| PoolShare { pool, percent }),
                0..3,
            ),
            proptest::option::of(0u8..=100),
        )
            .prop_map(
                |(
                    rung,
                    pool,
                    alias,
                    alias_exempt,
                    faq,
                    (since, lease_until),
                    reason,
                    alerts,
                    overridden,
                    shares,
                    alias_percent,
                )| {
                    ModelRoute {
                        rung,
                        pool,
                        alias,
                        alias_exempt,
                        faq,
                        since,
                        lease_until,
                        reason,
                        alerts,
                        overridden,
                        shares,
                        alias_percent,
                    }
                },
            )
    }

    fn table() -> impl Strategy<Value = RouteTable> {
        (
            any::<u64>(),
            "[a-z0-9]{0,12}",
            stamp(),
            proptest::collection::btree_map(".{0,12}", model_route(), 0..4),
            proptest::collection::vec(
                (
                    ".{0,16}",
                    proptest::option::of(".{0,8}"),
                    stamp(),
                    ".{0,16}",
                )
                    .prop_map(|(endpoint, model, until, reason)| BlockedEndpoint {
                        endpoint,
                        model,
                        until,
                        reason,
                    }),
                0..4,
            ),
        )
            .prop_map(
                |(version, epoch, generated_at, models, blocked)| RouteTable {
                    version,
                    hash: RouteTable::content_hash(&models, &blocked),
                    epoch,
                    generated_at,
                    models,
                    blocked,
                },
            )
    }

    proptest! {
        /// Every table survives protobuf, encoded and decoded: the gRPC watch serves
        /// what the JSON one does.
        #[test]
        fn every_table_round_trips_through_protobuf(t in table()) {
            let bytes = prost::Message::encode_to_vec(&v1::RouteTable::from(&t));
            let decoded: v1::RouteTable = prost::Message::decode(bytes.as_slice()).unwrap();
            prop_assert_eq!(RouteTable::try_from(decoded).unwrap(), t);
        }
    }

    #[test]
    fn what_the_json_form_cannot_hold_is_refused_by_field() {
        let mut t = v1::RouteTable {
            version: 3,
            epoch: "e".into(),
            ..Default::default()
        };
        t.models.insert(
            "qwen-72b".into(),
            v1::ModelRoute {
                rung: v1::Rung::Unspecified.into(),
                ..Default::default()
            },
        );
        let err = RouteTable::try_from(t.clone()).unwrap_err();
        assert_eq!(err.to_string(), "models[\"qwen-72b\"].rung: unspecified");

        let m = t.models.get_mut("qwen-72b").unwrap();
        m.rung = 9;
        let err = RouteTable::try_from(t.clone()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "models[\"qwen-72b\"].rung: 9 is not a rung this gateway knows"
        );

        let m = t.models.get_mut("qwen-72b").unwrap();
        m.rung = v1::Rung::Static.into();
        m.alerts = vec!["not-hex".into()];
        let err = RouteTable::try_from(t.clone()).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("models[\"qwen-72b\"].alerts[0]: "),
            "{err}"
        );

        let m = t.models.get_mut("qwen-72b").unwrap();
        m.alerts.clear();
        m.lease_until_unix_ms = i64::MAX;
        let err = RouteTable::try_from(t).unwrap_err();
        assert_eq!(err.field, "models[\"qwen-72b\"].lease_until_unix_ms");
    }
}
