//! The gRPC schema against buf, the tool most teams check protobuf with: its lint rules
//! (`proto/buf.yaml`), and no break of the binary encoding or of protobuf's JSON mapping
//! since the first published schema, frozen as a descriptor set in
//! `crates/stanch-proto/tests/wire/watch.v1.binpb`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::chart::text;

const PROTO: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/proto");
const FIRST: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/crates/stanch-proto/tests/wire/watch.v1.binpb"
);

/// buf, from the npm package `scripts/install-test-deps.sh` installs.
pub(crate) fn buf() -> PathBuf {
    crate::chart::tool("STANCH_TEST_NODE_MODULES", "test-tools/node/node_modules").join(".bin/buf")
}

fn run(dir: &Path, args: &[&str]) -> Output {
    Command::new("timeout")
        .arg("120")
        .arg(buf())
        .args(args)
        .current_dir(dir)
        .output()
        .expect("buf runs")
}

#[test]
fn the_schema_passes_bufs_lint() {
    let out = run(Path::new(PROTO), &["lint"]);
    assert!(out.status.success(), "{}", text(&out));
}

#[test]
fn the_schema_keeps_the_first_schemas_wire_and_json() {
    let out = run(Path::new(PROTO), &["breaking", "--against", FIRST]);
    assert!(out.status.success(), "{}", text(&out));
}

/// The check above can fail: a copy of the schema with one field renumbered, and one
/// with a field renamed (which changes its JSON name), are each refused, naming what
/// broke.
#[test]
fn a_renumbered_or_renamed_field_is_a_break() {
    let schema = std::fs::read_to_string(format!("{PROTO}/stanch/v1/watch.proto")).unwrap();
    let config = std::fs::read_to_string(format!("{PROTO}/buf.yaml")).unwrap();
    for (from, to, complaint) in [
        (
            "string gateway_id = 1;",
            "string gateway_id = 9;",
            "deleted",
        ),
        ("string gateway_id = 1;", "string gateway = 1;", "json_name"),
    ] {
        assert_eq!(
            schema.matches(from).count(),
            1,
            "{from} is in the schema once"
        );
        let copy = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(copy.path().join("stanch/v1")).unwrap();
        std::fs::write(copy.path().join("buf.yaml"), &config).unwrap();
        std::fs::write(
            copy.path().join("stanch/v1/watch.proto"),
            schema.replace(from, to),
        )
        .unwrap();
        let out = run(copy.path(), &["breaking", "--against", FIRST]);
        assert!(!out.status.success(), "{from} -> {to} passed");
        assert!(
            text(&out).contains(complaint),
            "{from} -> {to}: {}",
            text(&out)
        );
    }
}
