//! Two `stanch serve --store kubernetes` processes against one fake API server: one
//! leads, the other serves the leader's table and refuses writes with 503 and the
//! leader's name; the leader is killed with `kill -9` mid-incident and the other takes
//! over within a lease, with everything acknowledged; a leader stopped with SIGTERM
//! hands over in about a second.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use stanch_fake_apiserver::FakeApiServer;
use stanch_testkit::http::blocking::ready_within;
use stanch_testkit::process::Running;
use stanch_testkit::wait::blocking::until_some;
use tokio::time::Instant;

use crate::process::client;

const NS: &str = "monitoring";
/// The replicas' lease: 3 s, short so the tests are; `STANCH_HA_LEASE_SECS=15`
/// measures with the default.
fn lease() -> Duration {
    std::env::var("STANCH_HA_LEASE_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .map_or(Duration::from_secs(3), Duration::from_secs)
}

pub(crate) struct Replica {
    identity: String,
    pub(crate) child: Running,
    pub(crate) base: String,
}

impl Replica {
    fn start(identity: &str, kubeconfig: &Path) -> Replica {
        Replica::start_with(identity, kubeconfig, &[])
    }

    /// A replica with more `stanch serve` arguments.
    pub(crate) fn start_with(identity: &str, kubeconfig: &Path, extra: &[&str]) -> Replica {
        let port = stanch_testkit::net::free_port();
        let child = Running::spawn(
            Command::new(env!("CARGO_BIN_EXE_stanch"))
                .args([
                    "serve",
                    "--store",
                    "kubernetes",
                    "--kubernetes-namespace",
                    NS,
                ])
                .args(["--lease-duration", &format!("{}s", lease().as_secs())])
                .args(["--listen", &format!("127.0.0.1:{port}")])
                .args(extra)
                .env("KUBECONFIG", kubeconfig)
                .env_remove("KUBERNETES_SERVICE_HOST")
                .env("POD_NAME", identity)
                .env("STANCH_ADMIN_TOKEN", "adm")
                .env("STANCH_INGEST_TOKEN", "ing")
                .env("STANCH_READ_TOKEN", "rd")
                .env("RUST_LOG", "warn")
                .stdout(Stdio::null())
                // STANCH_HA_LOGS=1 shows what the replicas log.
                .stderr(if std::env::var_os("STANCH_HA_LOGS").is_some() {
                    Stdio::inherit()
                } else {
                    Stdio::null()
                }),
        );
        let replica = Replica {
            identity: identity.to_owned(),
            child,
            base: format!("http://127.0.0.1:{port}"),
        };
        let healthz = format!("{}/healthz", replica.base);
        assert!(
            ready_within(&client(), &healthz, Duration::from_secs(10)),
            "{identity} did not start"
        );
        replica
    }

    fn get(&self, path: &str) -> Value {
        client()
            .get(format!("{}{path}", self.base))
            .bearer_auth("rd")
            .send()
            .unwrap()
            .json()
            .unwrap()
    }

    pub(crate) fn post_alert(&self, n: u64) -> reqwest::blocking::Response {
        client()
            .post(format!("{}/v1/alerts/alertmanager", self.base))
            .bearer_auth("ing")
            .json(&alert(n))
            .send()
            .unwrap()
    }

    pub(crate) fn signal(&self, signal: &str) {
        self.child.signal(signal);
    }
}

fn alert(n: u64) -> Value {
    json!({"version": "4", "status": "firing", "receiver": "stanch", "alerts": [{
        "status": "firing", "fingerprint": format!("{n:016x}"),
        "labels": {"alertname": "Drill", "case": n.to_string(), "action": "trigger-failover",
                   "target_model": "qwen-72b", "pool": "dc-a"},
        "annotations": {"summary": "集群故障"},
        "startsAt": "2026-11-30T00:00:00Z", "endsAt": "0001-01-01T00:00:00Z"}]})
}

pub(crate) fn kubeconfig(dir: &Path, api: &FakeApiServer) -> PathBuf {
    let path = dir.join("kubeconfig");
    api.write_kubeconfig(&path, NS).unwrap();
    path
}

/// The Lease's holder, as stored.
pub(crate) fn holder(api: &FakeApiServer) -> Option<String> {
    let lease = api.object("apis/coordination.k8s.io/v1", "leases", NS, "stanch")?;
    lease["spec"]["holderIdentity"].as_str().map(str::to_owned)
}

/// One fake API server, and two replicas of which one leads.
struct Cluster {
    api: FakeApiServer,
    kubeconfig: PathBuf,
    leader: Replica,
    follower: Replica,
    // Held for the fake API server, and the kubeconfig's directory.
    _runtime: tokio::runtime::Runtime,
    _dir: tempfile::TempDir,
}

impl Cluster {
    /// Starts it, and waits until one replica holds the Lease.
    fn start() -> Cluster {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let api = runtime.block_on(FakeApiServer::start());
        let dir = tempfile::tempdir().unwrap();
        let kubeconfig = kubeconfig(dir.path(), &api);
        let mut replicas = vec![
            Replica::start("stanch-0", &kubeconfig),
            Replica::start("stanch-1", &kubeconfig),
        ];
        let leader_name = until_some("a leader", Duration::from_secs(10), || holder(&api));
        let at = replicas
            .iter()
            .position(|r| r.identity == leader_name)
            .unwrap();
        let leader = replicas.remove(at);
        let follower = replicas.pop().unwrap();
        Cluster {
            api,
            kubeconfig,
            leader,
            follower,
            _runtime: runtime,
            _dir: dir,
        }
    }
}

/// The fingerprints of the alerts `replica` holds for the 72B model.
fn alerts(replica: &Replica) -> BTreeSet<String> {
    replica.get("/v1/status")["models"]["qwen-72b"]["alerts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_str().unwrap().to_owned())
        .collect()
}

/// A table as seen: (replica, epoch, version, hash).
type Sighting = (String, String, u64, String);

/// What a gateway sees: every replica's table, polled until stopped.
struct Observer {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<Vec<Sighting>>>,
}

impl Observer {
    /// Polls `bases` every 20 ms: (replica, epoch, version, hash) of each answer.
    fn start(bases: Vec<String>) -> Observer {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            let http = client();
            let mut seen = Vec::new();
            let deadline = Instant::now() + Duration::from_secs(300);
            while !stopped.load(Ordering::Relaxed) && Instant::now() < deadline {
                for base in &bases {
                    let Ok(r) = http
                        .get(format!("{base}/v1/routes"))
                        .bearer_auth("rd")
                        .send()
                    else {
                        continue; // Killed, or stopping.
                    };
                    let Ok(t) = r.json::<Value>() else { continue };
                    if let (Some(epoch), Some(version), Some(hash)) = (
                        t["epoch"].as_str(),
                        t["version"].as_u64(),
                        t["hash"].as_str(),
                    ) {
                        seen.push((base.clone(), epoch.to_owned(), version, hash.to_owned()));
                    }
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            seen
        });
        Observer {
            stop,
            thread: Some(thread),
        }
    }

    /// Stops, and checks what was seen: no replica's version went back, and no
    /// version was served with two contents, by any replica, across the leader change.
    fn check(mut self) -> usize {
        self.stop.store(true, Ordering::Relaxed);
        let seen = self.thread.take().unwrap().join().unwrap();
        let mut last: BTreeMap<&str, (&str, u64)> = BTreeMap::new();
        let mut content: BTreeMap<(&str, u64), &str> = BTreeMap::new();
        for (base, epoch, version, hash) in &seen {
            if let Some((e, v)) = last.get(base.as_str()) {
                assert!(
                    *e != epoch.as_str() || *v <= *version,
                    "{base} went back from {v} to {version}"
                );
            }
            last.insert(base, (epoch, *version));
            let first = content.entry((epoch, *version)).or_insert(hash);
            assert_eq!(
                *first,
                hash.as_str(),
                "version {version} served with two contents"
            );
        }
        seen.len()
    }
}

/// Sends alerts to `replica` until one is taken; how long that took.
fn until_taken(replica: &Replica, n: u64, within: Duration) -> Duration {
    let start = Instant::now();
    until_some("a write taken by the new leader", within, || {
        let r = client()
            .post(format!("{}/v1/alerts/alertmanager", replica.base))
            .bearer_auth("ing")
            .json(&alert(n))
            .send()
            .ok()?;
        (r.status() == 200).then(|| start.elapsed())
    })
}

#[test]
fn a_follower_takes_over_a_killed_leader_with_everything_acknowledged() {
    // Moved out of a named binding, the rest (the runtime, the directory) lives to the
    // end of the test.
    let cluster = Cluster::start();
    let Cluster {
        api,
        kubeconfig,
        leader,
        follower,
        ..
    } = cluster;
    let leader_name = leader.identity.clone();
    let observer = Observer::start(vec![leader.base.clone(), follower.base.clone()]);

    // The incident: alerts acknowledged by the leader.
    let mut acked = BTreeSet::new();
    for n in 1..=40 {
        let r = until_some("the leader taking alerts", Duration::from_secs(10), || {
            let r = leader.post_alert(n);
            (r.status() != 503).then_some(r)
        });
        assert_eq!(r.status(), 200);
        acked.insert(format!("{n:016x}"));
    }

    // The follower refuses writes, naming the leader, so Alertmanager retries.
    let refused = follower.post_alert(1000);
    assert_eq!(refused.status(), 503);
    assert_eq!(refused.headers()["retry-after"], "1");
    assert_eq!(refused.headers()["x-stanch-leader"], leader_name.as_str());
    // It serves the leader's table: the same version, the same content.
    let table = leader.get("/v1/routes");
    until_some(
        "the follower serving the leader's table",
        Duration::from_secs(5),
        || (follower.get("/v1/routes") == table).then_some(()),
    );
    assert_eq!(
        alerts(&follower),
        acked,
        "the follower holds what was acknowledged"
    );
    // The route-table resource holds it too, as the watch serves it.
    let served: stanch_api::RouteTable = serde_json::from_value(table.clone()).unwrap();
    until_some("the route-table resource", Duration::from_secs(10), || {
        let resource = api.object(
            "apis/stanch.dev/v1alpha1",
            "stanchroutetables",
            NS,
            "stanch",
        )?;
        // The same table: the resource leaves out what is null, as the API server
        // stores an applied object.
        let held: stanch_api::RouteTable =
            serde_json::from_value(resource["status"]["table"].clone()).ok()?;
        (held == served).then_some(())
    });
    // And the gRPC watch, from either replica: one table everywhere.
    for replica in [&leader, &follower] {
        let over_grpc = crate::process::first_grpc_table(&replica.base, "rd", None);
        assert_eq!(over_grpc, served, "{} over gRPC", replica.identity);
    }

    // kill -9 mid-incident: no chance to give the lease up.
    leader.signal("-9");
    let lease = lease();
    let failover = until_taken(&follower, 41, lease * 4);
    acked.insert(format!("{:016x}", 41));
    eprintln!(
        "kill -9 of the leader -> the follower taking writes: {failover:?} (lease {lease:?})"
    );
    assert!(
        failover <= lease + Duration::from_secs(2),
        "failover took {failover:?}"
    );
    assert_eq!(holder(&api).as_deref(), Some(follower.identity.as_str()));
    let status = follower.get("/v1/status");
    assert_eq!(status["epoch"], table["epoch"], "the same epoch");
    assert!(status["version"].as_u64() > table["version"].as_u64());
    let held = alerts(&follower);
    let lost: Vec<&String> = acked.difference(&held).collect();
    assert!(lost.is_empty(), "acknowledged alerts lost: {lost:?}");
    drop(leader);
    let observed = observer.check();
    assert!(
        observed > 50,
        "the tables were watched throughout: {observed}"
    );

    // A new replica follows; the leader stopped with SIGTERM hands over to it.
    let next = Replica::start("stanch-2", &kubeconfig);
    let table = follower.get("/v1/routes");
    until_some("the new replica following", Duration::from_secs(5), || {
        (next.get("/v1/routes") == table).then_some(())
    });
    follower.signal("-TERM");
    let handover = until_taken(&next, 42, lease * 4);
    eprintln!("SIGTERM of the leader -> the next taking writes: {handover:?}");
    assert!(
        handover <= Duration::from_millis(1_500),
        "handover took {handover:?}"
    );
    acked.insert(format!("{:016x}", 42));
    let held = alerts(&next);
    let lost: Vec<&String> = acked.difference(&held).collect();
    assert!(lost.is_empty(), "acknowledged alerts lost: {lost:?}");
}

#[test]
fn a_leader_paused_past_its_lease_wakes_up_a_follower_and_writes_nothing() {
    let cluster = Cluster::start();
    let Cluster {
        api,
        leader: paused,
        follower: other,
        ..
    } = cluster;
    let mut acked = BTreeSet::new();
    for n in 1..=10 {
        until_some("the leader taking alerts", Duration::from_secs(10), || {
            (paused.post_alert(n).status() == 200).then_some(())
        });
        acked.insert(format!("{n:016x}"));
    }

    // Paused (a long GC, a frozen node) past its lease: the other takes over.
    paused.signal("-STOP");
    until_taken(&other, 11, lease() * 4);
    acked.insert(format!("{:016x}", 11));
    paused.signal("-CONT");

    // Awake, it finds its term over: it refuses writes, naming the new leader, and
    // follows the new leader's table.
    // Until it has looked at the Lease its term is over all the same: it takes
    // nothing (503) from the moment it wakes.
    let refused = until_some(
        "the woken replica naming the leader",
        Duration::from_secs(5),
        || {
            let r = paused.post_alert(12);
            assert_eq!(r.status(), 503, "a write taken by a deposed leader");
            r.headers().contains_key("x-stanch-leader").then_some(r)
        },
    );
    assert_eq!(
        refused.headers()["x-stanch-leader"],
        other.identity.as_str()
    );
    let table = other.get("/v1/routes");
    until_some(
        "the woken replica following",
        Duration::from_secs(5),
        || (paused.get("/v1/routes") == table).then_some(()),
    );
    let state = api
        .object("api/v1", "configmaps", NS, "stanch-state")
        .unwrap();
    assert_eq!(state["data"]["holder"], other.identity.as_str());
    assert_eq!(
        holder(&api).as_deref(),
        Some(other.identity.as_str()),
        "the woken replica did not take the lease back"
    );
    let held = alerts(&other);
    let lost: Vec<&String> = acked.difference(&held).collect();
    assert!(lost.is_empty(), "acknowledged alerts lost: {lost:?}");
}

#[test]
fn an_api_server_down_for_a_minute_leaves_the_table_served_and_decisions_resume() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let api = runtime.block_on(FakeApiServer::start());
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = kubeconfig(dir.path(), &api);
    let replica = Replica::start("stanch-0", &kubeconfig);
    until_some("a leader", Duration::from_secs(10), || holder(&api));
    let mut acked = BTreeSet::new();
    for n in 1..=5 {
        until_some("the leader taking alerts", Duration::from_secs(10), || {
            (replica.post_alert(n).status() == 200).then_some(())
        });
        acked.insert(format!("{n:016x}"));
    }
    let table = replica.get("/v1/routes");

    // Down for a minute (STANCH_HA_OUTAGE_SECS), far past the lease: the table stays
    // served, nothing is taken.
    let outage = std::env::var("STANCH_HA_OUTAGE_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .map_or(Duration::from_secs(60), Duration::from_secs);
    api.set_down(true);
    let down = Instant::now();
    while down.elapsed() < outage {
        assert_eq!(replica.get("/v1/routes"), table, "the last table is served");
        assert_eq!(
            replica.post_alert(100).status(),
            503,
            "nothing taken unstored"
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // Back: it leads again, from the stored state, and takes inputs.
    api.set_down(false);
    until_taken(&replica, 6, Duration::from_secs(10));
    acked.insert(format!("{:016x}", 6));
    let status = replica.get("/v1/status");
    assert_eq!(status["epoch"], table["epoch"], "the same history");
    let held = alerts(&replica);
    let lost: Vec<&String> = acked.difference(&held).collect();
    assert!(lost.is_empty(), "acknowledged alerts lost: {lost:?}");
    assert!(
        !held.contains(&format!("{:016x}", 100)),
        "what was refused is not in"
    );
}

#[test]
fn a_replica_that_has_read_no_state_serves_no_table() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let api = runtime.block_on(FakeApiServer::start());
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = kubeconfig(dir.path(), &api);
    // Started while the API server cannot be reached: it has read nothing, so a table
    // it served would be one no leader made (all healthy, mid-incident perhaps).
    api.set_down(true);
    let replica = Replica::start("stanch-0", &kubeconfig);
    let http = client();
    for path in ["/v1/routes", "/v1/routes/stream", "/v1/status", "/readyz"] {
        let r = http
            .get(format!("{}{path}", replica.base))
            .bearer_auth("rd")
            .send()
            .unwrap();
        assert_eq!(r.status(), 503, "{path}");
    }
    // Back: it leads, from the stored state (none: a new history), and serves it.
    api.set_down(false);
    until_taken(&replica, 1, Duration::from_secs(10));
    let table = replica.get("/v1/routes");
    assert!(table["version"].as_u64() > Some(0), "{table}");
    assert_eq!(
        http.get(format!("{}/readyz", replica.base))
            .send()
            .unwrap()
            .status(),
        200
    );
}
