//! Wire compatibility of the gRPC watch: messages encoded by the first schema, and by
//! a later one with fields this one does not know, decode to the same table (see
//! `tests/wire/README.md`).

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
