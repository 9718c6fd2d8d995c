//! `stanch check-config`, start-up refusals, and reloading the policy on SIGHUP.

use std::process::Command;
use std::time::Duration;

use stanch_testkit::wait::blocking::until_some;

fn stanch() -> Command {
    Command::new(env!("CARGO_BIN_EXE_stanch"))
}

fn write(dir: &tempfile::TempDir, name: &str, text: &str) -> std::path::PathBuf {
    let path = dir.path().join(name);
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn check_config_accepts_a_good_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(&dir, "ok.yaml", "models:\n  llama: {pools: [east, west]}\n");
    let out = stanch().arg("check-config").arg(&path).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("ok (1 model(s): llama)"));
}

#[test]
fn check_config_lists_every_problem_and_exits_64() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(
        &dir,
        "bad.yaml",
        "models:\n  a: {pools: [p], fallback: ghost}\n  b: {pools: []}\nladder: {min_dwell: 5s, recover_after: 0s}\n",
    );
    let out = stanch().arg("check-config").arg(&path).output().unwrap();
    assert_eq!(out.status.code(), Some(64));
    let err = String::from_utf8_lossy(&out.stderr);
    for expected in [
        "3 problems",
        "models.a.fallback",
        "models.b.pools",
        "ladder.recover_after",
    ] {
        assert!(err.contains(expected), "missing {expected} in {err}");
    }
}

#[test]
fn check_config_names_unknown_fields() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(
        &dir,
        "typo.yaml",
        "models:\n  a: {pools: [p], fallbak: b}\n",
    );
    let out = stanch().arg("check-config").arg(&path).output().unwrap();
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown field `fallbak`"));
}

#[test]
fn serve_with_bad_config_exits_64_before_listening() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(&dir, "bad.yaml", "models: {}\n");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let out = stanch()
        .args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--config",
        ])
        .arg(&path)
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("at least one model"));
    assert!(!dir.path().join("data").exists(), "nothing was started");
}

#[test]
fn serve_refuses_open_roles_off_loopback() {
    let dir = tempfile::tempdir().unwrap();
    let out = stanch()
        .args(["serve", "--listen", "0.0.0.0:0", "--data-dir"])
        .arg(dir.path())
        .env_remove("STANCH_INGEST_TOKEN")
        .env_remove("STANCH_ADMIN_TOKEN")
        .env_remove("STANCH_READ_TOKEN")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("without a token for role(s) ingest, report, admin, read"),
        "{err}"
    );
}

/// `GET /v1/routes` of a controller on loopback (no token needed there), as JSON.
fn routes(port: u16) -> Option<serde_json::Value> {
    reqwest::blocking::Client::builder()
        .no_proxy()
        .build()
        .unwrap()
        .get(format!("http://127.0.0.1:{port}/v1/routes"))
        .send()
        .ok()?
        .json()
        .ok()
}

/// SIGHUP puts the file's policy in force live; a file that does not validate changes
/// nothing and the controller keeps running.
#[test]
fn sighup_reloads_the_policy_and_an_invalid_file_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let one = "models:\n  qwen-72b: {pools: [dc-a, dc-b]}\n";
    let path = write(&dir, "stanch.yaml", one);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = stanch()
        .args(["serve", "--store", "memory", "--listen"])
        .arg(format!("127.0.0.1:{port}"))
        .arg("--config")
        .arg(&path)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let hup = |child: &std::process::Child| {
        let sent = Command::new("kill")
            .args(["-HUP", &child.id().to_string()])
            .status()
            .unwrap();
        assert!(sent.success());
    };
    let models = |port| routes(port).map(|r| r["models"].as_object().unwrap().len());
    until_some("the controller serves", Duration::from_secs(10), || {
        (models(port) == Some(1)).then_some(())
    });

    write(
        &dir,
        "stanch.yaml",
        &format!("{one}  qwen-14b: {{pools: [dc-a]}}\n"),
    );
    hup(&child);
    until_some("the new model is served", Duration::from_secs(10), || {
        (models(port) == Some(2)).then_some(())
    });
    let version = routes(port).unwrap()["version"].clone();

    write(&dir, "stanch.yaml", "models: {}\n");
    hup(&child);
    std::thread::sleep(std::time::Duration::from_millis(500));
    let after = routes(port).expect("still serving");
    assert_eq!(after["version"], version, "nothing changed");
    assert_eq!(after["models"].as_object().unwrap().len(), 2);
    assert!(child.try_wait().unwrap().is_none(), "still running");
    let _ = child.kill();
    let _ = child.wait();
}
