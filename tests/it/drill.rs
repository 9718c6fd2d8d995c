//! Crash-consistency drills with the real binary and real files: `kill -9` at random
//! moments of an incident, and a data directory on a filesystem that fills up.
//!
//! Inputs are sent by several threads at once; each acknowledged one (a 200) is
//! remembered, and after every restart each must be there: an alert by its
//! fingerprint, a block by its endpoint. Every restart must be clean: the same epoch,
//! no version going back, nothing moved aside.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use serde_json::{Value, json};

use crate::process::{Server, client};

/// What was acknowledged: alert fingerprints and blocked endpoints.
#[derive(Default)]
struct Acked {
    alerts: BTreeSet<String>,
    blocks: BTreeSet<String>,
}

/// A firing alert of `size` bytes or so, with a fingerprint of its own.
fn alert(n: u64, size: usize) -> Value {
    json!({"version": "4", "status": "firing", "receiver": "stanch", "alerts": [{
        "status": "firing", "fingerprint": format!("{n:016x}"),
        "labels": {"alertname": "Drill", "case": n.to_string(), "action": "trigger-failover",
                   "target_model": "qwen-72b", "pool": "dc-a"},
        "annotations": {"summary": "集群故障 ".repeat(size / 13 + 1)},
        "startsAt": "2026-11-30T00:00:00Z", "endsAt": "0001-01-01T00:00:00Z"}]})
}

/// Sends alerts and blocks from `threads` threads until `stop` or an error; records
/// what was acknowledged. Returns the number of 503s seen.
fn send(
    base: &str,
    threads: usize,
    size: usize,
    next: &AtomicU64,
    acked: &Mutex<Acked>,
    stop: &AtomicBool,
) -> u64 {
    let unavailable = AtomicU64::new(0);
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                let http = client();
                while !stop.load(Ordering::Relaxed) {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    let (path, token, body) = if n.is_multiple_of(4) {
                        let endpoint = format!("http://drill-{n}:8000");
                        (
                            "/v1/admin/block",
                            "adm",
                            json!({"endpoint": endpoint, "ttl": "30d", "reason": "drill"}),
                        )
                    } else {
                        ("/v1/alerts/alertmanager", "ing", alert(n, size))
                    };
                    let Ok(r) = http
                        .post(format!("{base}{path}"))
                        .bearer_auth(token)
                        .json(&body)
                        .send()
                    else {
                        return; // Killed.
                    };
                    match r.status().as_u16() {
                        200 => {
                            let mut acked = acked.lock().unwrap();
                            if n.is_multiple_of(4) {
                                acked.blocks.insert(format!("http://drill-{n}:8000"));
                            } else {
                                acked.alerts.insert(format!("{n:016x}"));
                            }
                        }
                        503 => {
                            unavailable.fetch_add(1, Ordering::Relaxed);
                            std::thread::sleep(Duration::from_millis(5));
                        }
                        other => panic!("{path}: {other} {}", r.text().unwrap_or_default()),
                    }
                }
            });
        }
    });
    unavailable.into_inner()
}

/// Checks that a restarted controller has everything acknowledged, cleanly.
fn check(server: &Server, acked: &Acked, epoch: &mut Option<String>, version: &mut u64) {
    let status = server.status();
    assert!(
        status["store"]["recovered_from_corruption"].is_null(),
        "a clean restart: {}",
        status["store"]
    );
    let now_epoch = status["epoch"].as_str().unwrap().to_owned();
    assert_eq!(
        epoch.get_or_insert_with(|| now_epoch.clone()),
        &now_epoch,
        "same epoch"
    );
    let now_version = status["version"].as_u64().unwrap();
    assert!(
        now_version >= *version,
        "version went back: {now_version} < {version}"
    );
    *version = now_version;
    let alerts: BTreeSet<String> = status["models"]["qwen-72b"]["alerts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_str().unwrap().to_owned())
        .collect();
    let lost: Vec<&String> = acked.alerts.difference(&alerts).collect();
    assert!(
        lost.is_empty(),
        "{} acknowledged alerts lost: {lost:?}",
        lost.len()
    );
    let blocks: BTreeSet<String> = server.routes()["blocked"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["endpoint"].as_str().unwrap().to_owned())
        .collect();
    let lost: Vec<&String> = acked.blocks.difference(&blocks).collect();
    assert!(
        lost.is_empty(),
        "{} acknowledged blocks lost: {lost:?}",
        lost.len()
    );
}

/// A pseudo-random number from a seed and a counter.
fn pick(seed: u64, i: u64, below: u64) -> u64 {
    let bytes = [seed.to_le_bytes(), i.to_le_bytes()].concat();
    stanch_api::hash::fnv64(&bytes) % below
}

#[test]
fn kill_9_at_random_moments_loses_nothing_acknowledged() {
    let kills: u64 = std::env::var("STANCH_DRILL_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50);
    let seed: u64 = std::env::var("STANCH_DRILL_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| u64::from(std::process::id()));
    eprintln!("kill -9 drill: {kills} kills, seed {seed} (STANCH_DRILL_SEED to replay)");
    let data = tempfile::tempdir().unwrap();
    let acked = Mutex::new(Acked::default());
    let next = AtomicU64::new(1);
    let (mut epoch, mut version) = (None, 0);
    let deadline = Instant::now() + Duration::from_secs(240);
    for kill in 0..kills {
        assert!(Instant::now() < deadline, "the drill is bounded in time");
        let mut server = Server::start(data.path(), &[], "http");
        check(&server, &acked.lock().unwrap(), &mut epoch, &mut version);
        let stop = Arc::new(AtomicBool::new(false));
        let pid = server.child.id();
        let wait = Duration::from_millis(10 + pick(seed, kill, 250));
        let killer = std::thread::spawn(move || {
            std::thread::sleep(wait);
            // SIGKILL: no chance to save anything on the way out.
            let _ = std::process::Command::new("kill")
                .args(["-9", &pid.to_string()])
                .status();
        });
        let base = server.base.clone();
        send(&base, 4, 300, &next, &acked, &stop);
        stop.store(true, Ordering::Relaxed);
        killer.join().unwrap();
        server.child.wait().unwrap();
    }
    let server = Server::start(data.path(), &[], "http");
    check(&server, &acked.lock().unwrap(), &mut epoch, &mut version);
    let acked = acked.lock().unwrap();
    eprintln!(
        "kill -9 drill: {} alerts and {} blocks acknowledged, all kept through {kills} kills",
        acked.alerts.len(),
        acked.blocks.len()
    );
    assert!(
        acked.alerts.len() > kills as usize,
        "the drill sent inputs between kills"
    );
}

/// A tmpfs of `size` mounted at `dir`, unmounted when dropped; `None` where this
/// machine does not allow mounting (not root, or in a container without the right).
struct Tmpfs<'a>(&'a Path);

impl<'a> Tmpfs<'a> {
    fn mount(dir: &'a Path, size: &str) -> Option<Tmpfs<'a>> {
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        ok.then_some(Tmpfs(dir))
    }

    fn resize(&self, size: &str) {
        let status = std::process::Command::new("mount")
            .args(["-o", &format!("remount,size={size}")])
            .arg(self.0)
            .status()
            .unwrap();
        assert!(status.success(), "remount to {size}");
    }
}

impl Drop for Tmpfs<'_> {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(self.0).status();
    }
}

/// Needs root, to mount a tmpfs, so it is ignored by `cargo test` and run by
/// `scripts/test.sh` when it runs as root (CI does): elsewhere it shows as ignored,
/// and the simulated disk of `tests/it/faults.rs` in stanch-server covers the same
/// faults.
#[test]
#[ignore = "mounts a tmpfs, which needs root: scripts/test.sh runs it as root"]
fn a_full_filesystem_loses_nothing_acknowledged() {
    let dir = tempfile::tempdir().unwrap();
    let fs = Tmpfs::mount(dir.path(), "1m")
        .expect("a tmpfs mounted (this test needs root and the right to mount)");
    let acked = Mutex::new(Acked::default());
    let next = AtomicU64::new(1);
    let (mut epoch, mut version) = (None, 0);
    let server = Server::start(dir.path(), &[], "http");
    check(&server, &acked.lock().unwrap(), &mut epoch, &mut version);

    // ~2 KB alerts until the disk is full and writes are refused for a while.
    let stop = AtomicBool::new(false);
    let refused = std::thread::scope(|scope| {
        let sender = scope.spawn(|| send(&server.base, 4, 2000, &next, &acked, &stop));
        let started = Instant::now();
        let http = client();
        while started.elapsed() < Duration::from_secs(60) {
            let ready = http
                .get(format!("{}/readyz", server.base))
                .send()
                .unwrap()
                .status();
            if ready == 503 {
                std::thread::sleep(Duration::from_millis(300)); // Refusals pile up.
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        stop.store(true, Ordering::Relaxed);
        sender.join().unwrap()
    });
    assert!(
        refused > 0,
        "the disk filled up and inputs were refused with 503"
    );
    let full = acked.lock().unwrap().alerts.len();
    assert!(full > 50, "{full} alerts fit before the disk was full");

    // More room: the held records are written, readiness returns, inputs are taken.
    fs.resize("8m");
    let http = client();
    let recovered = (0..200).any(|_| {
        std::thread::sleep(Duration::from_millis(25));
        http.get(format!("{}/readyz", server.base))
            .send()
            .unwrap()
            .status()
            == 200
            || {
                let n = next.fetch_add(1, Ordering::Relaxed);
                let r = http
                    .post(format!("{}/v1/alerts/alertmanager", server.base))
                    .bearer_auth("ing")
                    .json(&alert(n, 2000))
                    .send()
                    .unwrap();
                if r.status() == 200 {
                    acked.lock().unwrap().alerts.insert(format!("{n:016x}"));
                }
                false
            }
    });
    assert!(recovered, "ready again once there is room");
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let sender = scope.spawn(|| send(&server.base, 4, 2000, &next, &acked, &stop));
        std::thread::sleep(Duration::from_millis(300));
        stop.store(true, Ordering::Relaxed);
        sender.join().unwrap();
    });
    check(&server, &acked.lock().unwrap(), &mut epoch, &mut version);

    // kill -9, and a clean restart with everything.
    let mut server = server;
    server.child.kill().unwrap();
    server.child.wait().unwrap();
    let server = Server::start(dir.path(), &[], "http");
    check(&server, &acked.lock().unwrap(), &mut epoch, &mut version);
    drop(server);
    drop(fs);
}
