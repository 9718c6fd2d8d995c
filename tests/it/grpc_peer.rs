//! The gRPC watch against an independent peer: grpcio (gRPC's C core) with stubs that
//! protoc generates from `proto/`, its reflection client (what grpcurl uses) and its
//! health client (what Kubernetes' gRPC probes use), talking to the `stanch` binary;
//! and the grpcurl examples of docs/api.md, run as written.

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

/// The grpcurl commands of docs/api.md, as written there, through bash, with `grpcurl`
/// on the path being tests/grpc/grpcurl.py (grpcurl's command line on grpcio:
/// reflection, protobuf's JSON mapping, metadata; grpcurl itself is not packaged
/// where the tests install from).
#[test]
fn the_grpcurl_examples_in_the_api_docs_work() {
    let data = tempfile::tempdir().unwrap();
    let server = Server::start(data.path(), &[], "http");
    let routes = server.routes();
    let bin = tempfile::tempdir().unwrap();
    let shim = bin.path().join("grpcurl");
    std::fs::write(
        &shim,
        format!(
            "#!/bin/sh\nexec '{}' '{}' \"$@\"\n",
            crate::chart::venv_bin("python").display(),
            concat!(env!("CARGO_MANIFEST_DIR"), "/tests/grpc/grpcurl.py"),
        ),
    )
    .unwrap();
    std::fs::set_permissions(&shim, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let path = format!(
        "{}:{}",
        bin.path().display(),
        std::env::var("PATH").unwrap()
    );
    let address = server.base.trim_start_matches("http://").to_owned();
    let run = |command: &str, token: &str| {
        let out = Command::new("timeout")
            .args([
                "60",
                "bash",
                "-c",
                &command.replace("localhost:9797", &address),
            ])
            .env("PATH", &path)
            .env("STANCH_READ_TOKEN", token)
            .output()
            .unwrap();
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        (out.status.code(), text(&out.stdout), text(&out.stderr))
    };

    let commands = grpcurl_examples();
    assert_eq!(commands.len(), 3, "{commands:?}");
    for command in &commands {
        let (code, out, err) = run(command, "rd");
        assert_eq!(code, Some(0), "{command}\n{out}\n{err}");
        if command.ends_with(" list") {
            let services: Vec<&str> = out.lines().collect();
            for service in [
                "grpc.health.v1.Health",
                "grpc.reflection.v1.ServerReflection",
                "stanch.v1.RouteWatch",
            ] {
                assert!(services.contains(&service), "{service}: {out}");
            }
        } else if command.contains("grpc.health.v1.Health/Check") {
            let health: Value = serde_json::from_str(&out).unwrap();
            assert_eq!(health["status"], "SERVING", "{out}");
        } else if command.contains("stanch.v1.RouteWatch/WatchRoutes") {
            // The table the gateway lacks, then the end of the stream, since grpcurl
            // half-closes after its one message.
            let reply: Value = serde_json::from_str(&out).unwrap();
            let table = &reply["table"];
            assert_eq!(table["version"], routes["version"].to_string(), "{out}");
            assert_eq!(table["epoch"], routes["epoch"], "{out}");
            assert_eq!(table["hash"], routes["hash"], "{out}");
            assert_eq!(table["models"]["qwen-72b"]["rung"], "RUNG_NORMAL", "{out}");

            let (code, out, err) = run(command, "not-the-token");
            assert_eq!(
                code,
                Some(64 + 16),
                "grpcurl's exit for UNAUTHENTICATED: {out}{err}"
            );
            assert!(err.contains("Code: Unauthenticated"), "{err}");
        } else {
            panic!("a grpcurl example this test does not check yet: {command}");
        }
    }
    let status = server.status();
    assert!(
        status["gateways"]
            .as_array()
            .unwrap()
            .iter()
            .any(|g| g["id"] == "grpcurl" && g["transport"] == "grpc"),
        "the documented watch reached the status report: {status}"
    );
}

/// The commands of the `sh` block after "With [grpcurl]" in docs/api.md, each with
/// its continuation lines joined.
fn grpcurl_examples() -> Vec<String> {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/api.md")).unwrap();
    let (_, after) = doc
        .split_once("With [grpcurl]")
        .expect("the grpcurl example in docs/api.md");
    let (_, block) = after.split_once("```sh\n").expect("its sh block");
    let (block, _) = block.split_once("```").expect("the block's end");
    let mut commands = vec![String::new()];
    for line in block.lines() {
        let command = commands.last_mut().unwrap();
        match line.strip_suffix('\\') {
            Some(part) => command.push_str(part),
            None => {
                command.push_str(line);
                commands.push(String::new());
            }
        }
    }
    commands.retain(|c| !c.trim().is_empty());
    commands.iter().map(|c| c.trim().to_owned()).collect()
}
