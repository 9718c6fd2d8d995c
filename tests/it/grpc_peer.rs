//! The gRPC watch against an independent peer: grpcio (gRPC's C core) with stubs that
//! protoc generates from `proto/`, its reflection client (what grpcurl uses) and its
//! health client (what Kubernetes' gRPC probes use), talking to the `stanch` binary.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use serde_json::Value;

use crate::process::{Server, client};

const FIXTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/crates/stanch-server/tests/fixtures/alertmanager-v4-firing-failover.json"
);

#[test]
fn grpcio_reflects_checks_health_and_watches_with_acks() {
    let data = tempfile::tempdir().unwrap();
    let server = Server::start(data.path(), &[], "http");
    let before = server.routes();
    let out = tempfile::tempdir().unwrap();
    let mut peer = Command::new(crate::chart::venv_bin("python"))
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/grpc/peer.py"))
        .arg(server.base.trim_start_matches("http://"))
        .arg("rd")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/proto"))
        .arg(out.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("the test venv's python (scripts/install-test-deps.sh)");
    let mut lines = BufReader::new(peer.stdout.take().unwrap()).lines();
    let ready = lines.next().expect("a line").unwrap();
    assert_eq!(ready, "ready", "the peer got its first table");
    let r = client()
        .post(format!("{}/v1/alerts/alertmanager", server.base))
        .bearer_auth("ing")
        .body(std::fs::read(FIXTURE).unwrap())
        .send()
        .unwrap();
    assert_eq!(r.status(), 200);
    let published = r.json::<Value>().unwrap()["version"].as_u64().unwrap();
    let seen: Value = serde_json::from_str(&lines.next().expect("a report").unwrap()).unwrap();
    assert!(peer.wait().unwrap().success());

    let services = seen["services"].as_array().unwrap();
    for service in [
        "stanch.v1.RouteWatch",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    ] {
        assert!(services.iter().any(|s| s == service), "{service}: {seen}");
    }
    assert_eq!(
        seen["reflection_matches_protoc"], true,
        "the served schema is protoc's reading of proto/: {seen}"
    );
    assert_eq!(seen["health"]["(server)"], "SERVING", "{seen}");
    assert_eq!(seen["health"]["stanch.v1.RouteWatch"], "SERVING", "{seen}");
    assert_eq!(seen["without_token"], "UNAUTHENTICATED", "{seen}");

    let tables = seen["tables"].as_array().unwrap();
    assert_eq!(tables[0]["version"], before["version"]);
    assert_eq!(tables[0]["hash"], before["hash"]);
    assert_eq!(tables[0]["rungs"]["qwen-72b"], "RUNG_NORMAL");
    assert_eq!(tables[1]["version"], published);
    assert_eq!(tables[1]["rungs"]["qwen-72b"], "RUNG_FAILOVER");
    assert_eq!(tables[1]["pools"]["qwen-72b"], "dc-b");
    assert_eq!(tables[1]["hash"], server.routes()["hash"]);
    assert_eq!(
        seen["ended"], "OK",
        "a half-closed stream ends cleanly: {seen}"
    );

    // Its Acks reached the status report.
    let status = server.status();
    let peer = status["gateways"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["id"] == "py-grpcio")
        .unwrap_or_else(|| panic!("{status}"));
    assert_eq!(peer["transport"], "grpc");
    assert_eq!(peer["applied_version"], published);
}
