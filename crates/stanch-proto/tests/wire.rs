//! Wire compatibility of the gRPC watch: messages encoded by the first schema, and by
//! a later one with fields this one does not know, decode to the same table (see
//! `tests/wire/README.md`); a table with splits, from the schema that added them.

use prost::Message;
use stanch_api::RouteTable;
use stanch_proto::v1::{self, watch_response};

fn sample(name: &str) -> Vec<u8> {
    let path = format!("{}/tests/wire/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn expected() -> RouteTable {
    serde_json::from_slice(&sample("route-table.v1.json")).unwrap()
}

fn table_of(bytes: &[u8]) -> RouteTable {
    match v1::WatchResponse::decode(bytes).unwrap().kind {
        Some(watch_response::Kind::Table(t)) => RouteTable::try_from(t).unwrap(),
        other => panic!("a table, not {other:?}"),
    }
}

#[test]
fn a_table_encoded_by_the_first_schema_decodes_to_the_same_table() {
    assert_eq!(table_of(&sample("route-table.v1.bin")), expected());
}

#[test]
fn fields_of_a_later_schema_are_ignored() {
    let newer = sample("route-table.newer.bin");
    assert_ne!(
        newer,
        sample("route-table.v1.bin"),
        "the sample has more in it"
    );
    assert_eq!(table_of(&newer), expected());
}

#[test]
fn a_message_kind_of_a_later_schema_decodes_as_none() {
    let message = v1::WatchResponse::decode(sample("unknown-kind.newer.bin").as_slice()).unwrap();
    assert_eq!(message.kind, None, "clients skip what they do not know");
}

/// Today's encoder still writes what the first schema wrote: a peer that has the first
/// schema only reads today's messages.
#[test]
fn todays_message_for_the_sample_table_decodes_as_the_first_schemas_did() {
    let today = v1::WatchResponse {
        kind: Some(watch_response::Kind::Table((&expected()).into())),
    };
    let decoded_by_first = v1::WatchResponse::decode(today.encode_to_vec().as_slice()).unwrap();
    let first = v1::WatchResponse::decode(sample("route-table.v1.bin").as_slice()).unwrap();
    assert_eq!(decoded_by_first, first);
}

/// The table with splits (`shares`, `alias_percent`) that the second sample holds.
fn expected_v2() -> RouteTable {
    serde_json::from_slice(&sample("route-table.v2.json")).unwrap()
}

#[test]
fn a_table_with_splits_encoded_by_another_implementation_decodes_to_the_same_table() {
    // Encoded by Python's protobuf from the schema, not by this crate.
    assert_eq!(table_of(&sample("route-table.v2.bin")), expected_v2());
}

#[test]
fn todays_message_for_a_table_with_splits_is_the_samples() {
    let today = v1::WatchResponse {
        kind: Some(watch_response::Kind::Table((&expected_v2()).into())),
    };
    let sample = v1::WatchResponse::decode(sample("route-table.v2.bin").as_slice()).unwrap();
    assert_eq!(today, sample);
}

/// What a peer built on the first schema decodes of a model's entry: the fields it
/// knows, nothing of `shares` or `alias_percent` (protobuf skips unknown fields).
#[derive(Clone, PartialEq, prost::Message)]
struct FirstSchemaModelRoute {
    #[prost(int32, tag = "1")]
    rung: i32,
    #[prost(string, tag = "2")]
    pool: String,
    #[prost(string, optional, tag = "3")]
    alias: Option<String>,
}

#[test]
fn a_first_schema_peer_reads_a_split_as_all_on_the_largest_share() {
    let table = expected_v2();
    let split = &table.models["qwen-72b"];
    let encoded = prost::Message::encode_to_vec(&v1::ModelRoute::from(split));
    let seen = FirstSchemaModelRoute::decode(encoded.as_slice()).unwrap();
    assert_eq!(seen.pool, "dc-b", "the pool it sends everything to");
    let largest = split.shares.iter().max_by_key(|s| s.percent).unwrap();
    assert_eq!(seen.pool, largest.pool, "the largest share");
    assert_eq!(
        seen.alias.as_deref(),
        Some("qwen-14b"),
        "all non-VIP traffic to the alias"
    );
    assert_eq!(seen.rung, v1::Rung::Degraded as i32);
}
