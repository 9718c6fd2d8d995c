//! The gRPC watch against an independent peer: grpcio (gRPC's C core) with stubs that
//! protoc generates from `proto/`, its reflection client (what grpcurl uses) and its
//! health client (what Kubernetes' gRPC probes use), talking to the `stanch` binary;
//! buf curl (Go's gRPC, over TLS too); and the grpcurl and buf curl examples of
//! docs/api.md, run as written.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};
use stanch_testkit::wait::blocking::until_some;

use crate::process::Server;

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
    let published = server.fail_over();
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
    check_documented(&DocumentedClient {
        marker: "With [grpcurl]",
        bin: bin.path(),
        listing: " list",
        listed: [
            "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
            "stanch.v1.RouteWatch",
        ],
        // grpcurl exits with 64 plus the gRPC code; UNAUTHENTICATED is 16.
        unauthenticated: (64 + 16, "Code: Unauthenticated"),
        gateway_id: "grpcurl",
    });
}

/// The buf curl commands of docs/api.md, as written there, with buf itself: a second
/// independent gRPC implementation (Go's), with its own reflection client and JSON
/// mapping.
#[test]
fn the_buf_curl_examples_in_the_api_docs_work() {
    let buf = crate::proto::buf();
    check_documented(&DocumentedClient {
        marker: "Or with [buf curl]",
        bin: buf.parent().unwrap(),
        listing: "--list-methods",
        listed: [
            "grpc.health.v1.Health/Check",
            "grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            "stanch.v1.RouteWatch/WatchRoutes",
        ],
        // buf curl exits with eight times the gRPC code.
        unauthenticated: (8 * 16, "\"unauthenticated\""),
        gateway_id: "buf",
    });
}

/// A gRPC command-line client whose examples docs/api.md gives, and what they must show.
struct DocumentedClient<'a> {
    /// The text in docs/api.md that the examples' `sh` block follows.
    marker: &'static str,
    /// The directory holding the client's command, put first on `PATH`.
    bin: &'a std::path::Path,
    /// What marks the example that lists the server's services or methods...
    listing: &'static str,
    /// ...and the lines that listing must have.
    listed: [&'static str; 3],
    /// The client's exit code, and what its standard error says, for UNAUTHENTICATED.
    unauthenticated: (i32, &'static str),
    /// The gateway id the documented watch says hello with.
    gateway_id: &'static str,
}

/// Runs the three examples of `client` against a fresh controller: the listing, a
/// health check, and a watch that gets the current table (and, with a wrong token,
/// UNAUTHENTICATED) and reaches the status report.
fn check_documented(client: &DocumentedClient) {
    let data = tempfile::tempdir().unwrap();
    let server = Server::start(data.path(), &[], "http");
    let routes = server.routes();
    let path = format!(
        "{}:{}",
        client.bin.display(),
        std::env::var("PATH").unwrap()
    );
    let address = server.base.trim_start_matches("http://").to_owned();
    let run = |command: &str, token: &str| as_documented(command, &address, &path, token);

    let commands = doc_examples(client.marker);
    assert_eq!(commands.len(), 3, "{commands:?}");
    for command in &commands {
        let (code, out, err) = run(command, "rd");
        assert_eq!(code, Some(0), "{command}\n{out}\n{err}");
        if command.contains(client.listing) {
            let lines: Vec<&str> = out.lines().collect();
            for listed in client.listed {
                assert!(lines.contains(&listed), "{listed}: {out}");
            }
        } else if command.contains("grpc.health.v1.Health/Check") {
            let health: Value = serde_json::from_str(&out).unwrap();
            assert_eq!(health["status"], "SERVING", "{out}");
        } else if command.contains("stanch.v1.RouteWatch/WatchRoutes") {
            // The table the gateway lacks, then the end of the stream, since the
            // client half-closes after its one message.
            let reply: Value = serde_json::from_str(&out).unwrap();
            let table = &reply["table"];
            assert_eq!(table["version"], routes["version"].to_string(), "{out}");
            assert_eq!(table["epoch"], routes["epoch"], "{out}");
            assert_eq!(table["hash"], routes["hash"], "{out}");
            assert_eq!(table["models"]["qwen-72b"]["rung"], "RUNG_NORMAL", "{out}");

            let (code, out, err) = run(command, "not-the-token");
            let (exit, says) = client.unauthenticated;
            assert_eq!(code, Some(exit), "the exit for UNAUTHENTICATED: {out}{err}");
            assert!(err.contains(says), "{err}");
        } else {
            panic!("an example this test does not check yet: {command}");
        }
    }
    let status = server.status();
    assert!(
        status["gateways"]
            .as_array()
            .unwrap()
            .iter()
            .any(|g| g["id"] == client.gateway_id && g["transport"] == "grpc"),
        "the documented watch reached the status report: {status}"
    );
}

/// A whole watch session through buf curl over TLS (Go's TLS and HTTP/2, h2 chosen by
/// ALPN, the certificate trusted by `--cacert`), with the Ack and the Nack written to
/// its standard input as an operator would type them: the table, its Ack in the status
/// report, the next version, its Nack and the reason there, and a clean end of the
/// stream when the input closes.
#[test]
fn a_buf_curl_session_over_tls_acks_and_nacks() {
    let dir = tempfile::tempdir().unwrap();
    let (server, cert) = Server::start_tls(dir.path());
    let mut session = Command::new("timeout")
        .arg("60")
        .arg(crate::proto::buf())
        .args(["curl", "--protocol", "grpc", "--cacert"])
        .arg(&cert)
        .args(["-H", "authorization: Bearer rd", "-d", "@-"])
        .arg(format!("{}/stanch.v1.RouteWatch/WatchRoutes", server.base))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = session.stdin.take().unwrap();
    let output = session.stdout.take().unwrap();
    let (sent, messages) = std::sync::mpsc::channel::<Value>();
    std::thread::spawn(move || {
        for message in serde_json::Deserializer::from_reader(output).into_iter() {
            if sent.send(message.unwrap()).is_err() {
                break;
            }
        }
    });
    let next_table = || loop {
        let message = messages
            .recv_timeout(Duration::from_secs(20))
            .expect("a message within 20 s");
        match message.get("table") {
            Some(table) => break table.clone(),
            None => assert!(message.get("heartbeat").is_some(), "{message}"),
        }
    };
    let gateway = |server: &Server| {
        let status = server.status();
        status["gateways"]
            .as_array()
            .unwrap()
            .iter()
            .find(|g| g["id"] == "buf-tls")
            .cloned()
    };
    let hello = json!({"hello": {"gateway_id": "buf-tls", "version": 0, "epoch": ""}});
    writeln!(input, "{hello}").unwrap();
    let first = next_table();
    let routes = server.routes();
    assert_eq!(first["version"], routes["version"].to_string(), "{first}");
    assert_eq!(first["hash"], routes["hash"], "{first}");
    let ack = json!({"ack": {"version": first["version"], "epoch": first["epoch"]}});
    writeln!(input, "{ack}").unwrap();
    let held = routes["version"].as_u64().unwrap();
    until_some(
        "the Ack in the status report",
        Duration::from_secs(10),
        || gateway(&server).filter(|g| g["applied_version"] == held),
    );

    let published = server.fail_over();
    let next = next_table();
    assert_eq!(next["version"], published.to_string(), "{next}");
    assert_eq!(
        next["models"]["qwen-72b"]["rung"], "RUNG_FAILOVER",
        "{next}"
    );
    let nack = json!({"nack": {
        "version": next["version"],
        "epoch": next["epoch"],
        "reason": "drill: refused by hand",
    }});
    writeln!(input, "{nack}").unwrap();
    let refused = until_some(
        "the Nack in the status report",
        Duration::from_secs(10),
        || {
            gateway(&server)
                .filter(|g| g["rejected"] == json!([published, "drill: refused by hand"]))
        },
    );
    assert_eq!(
        refused["applied_version"], held,
        "it keeps the table it had"
    );
    assert_eq!(refused["transport"], "grpc");

    drop(input);
    let ended = session.wait_with_output().unwrap();
    assert!(
        ended.status.success(),
        "a half-closed stream ends cleanly: {ended:?}"
    );
}

/// Runs a command of docs/api.md as written, through bash with `path` as `PATH`, the
/// documented `localhost:9797` being `address` and `$STANCH_READ_TOKEN` being `token`:
/// its exit code, standard output and standard error.
fn as_documented(
    command: &str,
    address: &str,
    path: &str,
    token: &str,
) -> (Option<i32>, String, String) {
    let out = Command::new("timeout")
        .args([
            "60",
            "bash",
            "-c",
            &command.replace("localhost:9797", address),
        ])
        .env("PATH", path)
        .env("STANCH_READ_TOKEN", token)
        .output()
        .unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code(), text(&out.stdout), text(&out.stderr))
}

/// The commands of the `sh` block after `marker` in docs/api.md, each with its
/// continuation lines joined.
fn doc_examples(marker: &str) -> Vec<String> {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/api.md")).unwrap();
    let (_, after) = doc
        .split_once(marker)
        .unwrap_or_else(|| panic!("{marker:?} in docs/api.md"));
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
