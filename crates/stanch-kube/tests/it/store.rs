//! The Kubernetes state store against the fake API server: what a replica
//! acknowledged survives the replica, a replica that lost the store never writes
//! again, a write whose answer was lost is not written twice, a large incident fits
//! under the objects' size limit, and, under faults injected at any write, nothing
//! acknowledged is lost.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::api::PostParams;
use proptest::prelude::*;
use proptest::test_runner::{Config as RunnerConfig, TestCaseError, TestRunner};
use stanch_api::alerts::{AlertSource, AlertStatus, IncomingAlert};
use stanch_api::{Fingerprint, Labels, Timestamp};
use stanch_core::{Engine, EngineState, Input};
use stanch_fake_apiserver::{FakeApiServer, WriteFault};
use stanch_kube::store::{Guard, KubeStore};
use stanch_ports::store::{Loaded, Record, StateStore, StoreError};
use stanch_server::config::ConfigFile;

const NS: &str = "monitoring";
const STATE: &str = "stanch-state";

/// A runtime for the fake API server and the store's calls; the store itself is
/// called from the test's thread, as the engine task calls it from a blocking one.
struct World {
    runtime: tokio::runtime::Runtime,
    api: FakeApiServer,
}

impl World {
    fn new() -> World {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let api = runtime.block_on(FakeApiServer::start());
        World { runtime, api }
    }

    fn config_maps(&self) -> Api<ConfigMap> {
        let _entered = self.runtime.enter();
        let mut config = kube::Config::new(self.api.url().parse().unwrap());
        // As the controller builds it: stanch retries, so a 5xx reaches the store.
        config.default_retry = false;
        Api::namespaced(kube::Client::try_from(config).unwrap(), NS)
    }

    fn store_guarded(&self, identity: &str, guard: Guard) -> KubeStore {
        let api = self.config_maps();
        let _entered = self.runtime.enter();
        KubeStore::new(api, STATE, identity, guard, Duration::from_secs(5))
    }

    fn store(&self, identity: &str) -> KubeStore {
        self.store_guarded(identity, Arc::new(|| true))
    }

    /// Every ConfigMap of the namespace, as stored.
    fn objects(&self) -> Vec<serde_json::Value> {
        self.api
            .names("api/v1", "configmaps", NS)
            .iter()
            .filter_map(|n| self.api.object("api/v1", "configmaps", NS, n))
            .collect()
    }
}

fn at(ms: i64) -> Timestamp {
    Timestamp::from_millis(1_764_460_800_000 + ms)
}

fn record(seq: u64) -> Record {
    Record {
        seq,
        at: at(seq as i64),
        input: Input::Tick,
    }
}

fn records(seqs: std::ops::RangeInclusive<u64>) -> Vec<Record> {
    seqs.map(record).collect()
}

/// A state marked with `version`, so that a snapshot read back can be told apart.
fn state(version: u64) -> EngineState {
    let mut state = Engine::fresh_state("e1".into(), at(0));
    state.version = version;
    state
}

fn seqs(loaded: &Loaded) -> Vec<u64> {
    loaded.journal.iter().map(|r| r.seq).collect()
}

#[test]
fn what_one_replica_wrote_is_what_the_next_loads() {
    let world = World::new();
    let mut a = world.store("stanch-0");
    let first = a.load().unwrap();
    assert!(first.snapshot.is_none() && first.journal.is_empty());
    a.append(&records(1..=3)).unwrap();
    a.snapshot(&state(3), 3).unwrap();
    a.append(&records(4..=5)).unwrap();

    let mut b = world.store("stanch-1");
    let loaded = b.load().unwrap();
    let (snapshot, seq) = loaded.snapshot.as_ref().unwrap();
    assert_eq!((snapshot.version, *seq), (3, 3));
    assert_eq!(seqs(&loaded), [4, 5]);
    assert!(loaded.corruption.is_none());
    // The state object names its holder.
    let object = world.api.object("api/v1", "configmaps", NS, STATE).unwrap();
    assert_eq!(object["data"]["holder"], "stanch-1");
}

#[test]
fn a_replica_whose_store_was_taken_over_never_writes_again() {
    let world = World::new();
    let mut a = world.store("stanch-0");
    a.load().unwrap();
    a.append(&records(1..=2)).unwrap();
    let mut b = world.store("stanch-1");
    b.load().unwrap();

    let revision = world.api.revision();
    match a.append(&records(3..=3)) {
        Err(StoreError::Fenced { holder, .. }) => assert_eq!(holder, "stanch-1"),
        other => panic!("fenced, not {other:?}"),
    }
    assert!(a.fenced().load(Ordering::Relaxed));
    assert!(matches!(
        a.snapshot(&state(9), 3),
        Err(StoreError::Fenced { .. })
    ));
    assert_eq!(world.api.revision(), revision, "nothing of a's landed");
    b.append(&records(3..=3)).unwrap();
    assert_eq!(seqs(&world.store("stanch-2").load().unwrap()), [1, 2, 3]);
}

#[test]
fn nothing_is_sent_while_the_guard_says_the_replica_does_not_lead() {
    let world = World::new();
    let leads = Arc::new(AtomicBool::new(true));
    let guard = {
        let leads = leads.clone();
        Arc::new(move || leads.load(Ordering::Relaxed))
    };
    let mut a = world.store_guarded("stanch-0", guard);
    a.load().unwrap();
    leads.store(false, Ordering::Relaxed);
    let revision = world.api.revision();
    assert!(a.append(&records(1..=1)).is_err());
    assert!(a.snapshot(&state(1), 1).is_err());
    assert_eq!(world.api.revision(), revision, "not one write sent");
    leads.store(true, Ordering::Relaxed);
    a.append(&records(1..=1)).unwrap();
}

#[test]
fn a_write_whose_answer_was_lost_is_not_written_twice() {
    let world = World::new();
    let mut a = world.store("stanch-0");
    a.load().unwrap();
    a.append(&records(1..=1)).unwrap();
    // The next write lands, but its answer is a 504.
    let mut once = Some(WriteFault::Unconfirmed);
    world
        .api
        .plan_faults(move |method, _| (method == "PUT").then(|| once.take()).flatten());
    assert!(a.append(&records(2..=3)).is_err(), "not acknowledged");
    // The engine sends the same records again, with more.
    a.append(&records(2..=4)).unwrap();
    assert_eq!(seqs(&world.store("stanch-1").load().unwrap()), [1, 2, 3, 4]);
}

#[test]
fn an_api_server_down_fails_writes_and_they_succeed_when_it_is_back() {
    let world = World::new();
    let mut a = world.store("stanch-0");
    a.load().unwrap();
    world.api.set_down(true);
    assert!(matches!(
        a.append(&records(1..=2)),
        Err(StoreError::Remote { .. })
    ));
    assert!(a.append(&records(1..=3)).is_err(), "still down");
    world.api.set_down(false);
    a.append(&records(1..=3)).unwrap();
    assert_eq!(seqs(&world.store("stanch-1").load().unwrap()), [1, 2, 3]);
}

#[test]
fn an_unreadable_state_object_is_copied_aside_and_a_new_history_begins() {
    let world = World::new();
    let mut a = world.store("stanch-0");
    a.load().unwrap();
    a.append(&records(1..=2)).unwrap();
    // Someone edits it by hand.
    let api = world.config_maps();
    world.runtime.block_on(async {
        let mut object = api.get(STATE).await.unwrap();
        object
            .data
            .as_mut()
            .unwrap()
            .insert("journal".into(), "{\"seq\": 1, not json\n".into());
        api.replace(STATE, &PostParams::default(), &object)
            .await
            .unwrap();
    });
    let loaded = world.store("stanch-1").load().unwrap();
    let why = loaded.corruption.expect("said");
    assert!(why.contains("journal"), "{why}");
    assert!(loaded.snapshot.is_none() && loaded.journal.is_empty());
    let copies: Vec<String> = world
        .api
        .names("api/v1", "configmaps", NS)
        .into_iter()
        .filter(|n| n.starts_with("stanch-state-unreadable-"))
        .collect();
    assert_eq!(copies.len(), 1, "{copies:?}");
    assert!(why.contains(&copies[0]), "{why}");
}

#[test]
fn a_journal_past_its_cap_moves_to_segments_read_back_whole_and_dropped_by_a_snapshot() {
    let world = World::new();
    let mut a = world.store("stanch-0").with_journal_cap(1000);
    a.load().unwrap();
    for seq in 1..=60 {
        a.append(&[record(seq)]).unwrap();
    }
    let segments = || -> Vec<String> {
        world
            .api
            .names("api/v1", "configmaps", NS)
            .into_iter()
            .filter(|n| n.starts_with("stanch-state-journal-"))
            .collect()
    };
    assert!(segments().len() >= 2, "{:?}", segments());
    let state_object = world.api.object("api/v1", "configmaps", NS, STATE).unwrap();
    assert!(state_object["data"]["journal"].as_str().unwrap().len() <= 1000);

    // Another replica reads every record, once, in order; a follower too.
    let mut follower = world.store("stanch-9");
    let looked = follower.look().unwrap().unwrap();
    assert_eq!(seqs(&looked), (1..=60).collect::<Vec<_>>());
    let mut b = world.store("stanch-1");
    assert_eq!(seqs(&b.load().unwrap()), (1..=60).collect::<Vec<_>>());

    // A snapshot covering them drops the segments.
    b.snapshot(&state(60), 60).unwrap();
    assert_eq!(segments(), Vec::<String>::new());
    let loaded = world.store("stanch-2").load().unwrap();
    assert_eq!(loaded.snapshot.unwrap().1, 60);
    assert!(loaded.journal.is_empty());
}

#[test]
fn a_segment_altered_by_hand_is_corruption_not_a_partial_journal() {
    let world = World::new();
    let mut a = world.store("stanch-0").with_journal_cap(300);
    a.load().unwrap();
    for seq in 1..=20 {
        a.append(&[record(seq)]).unwrap();
    }
    let segment = world
        .api
        .names("api/v1", "configmaps", NS)
        .into_iter()
        .find(|n| n.starts_with("stanch-state-journal-"))
        .unwrap();
    let api = world.config_maps();
    world.runtime.block_on(async {
        let mut object = api.get(&segment).await.unwrap();
        let data = object.data.as_mut().unwrap();
        let text = data["journal"].clone();
        // One record dropped: still JSON lines, but not what was written.
        let shorter: String = text.lines().skip(1).map(|l| format!("{l}\n")).collect();
        data.insert("journal".into(), shorter);
        api.replace(&segment, &PostParams::default(), &object)
            .await
            .unwrap();
    });
    let loaded = world.store("stanch-1").load().unwrap();
    let why = loaded.corruption.expect("said");
    assert!(why.contains("does not match"), "{why}");
    assert!(loaded.journal.is_empty() && loaded.snapshot.is_none());
}

fn labels(n: usize) -> Labels {
    [
        ("alertname", "KvCacheSaturated".to_owned()),
        ("pool", format!("pool-{n:05}")),
        ("action", "trigger-failover".to_owned()),
        ("target_model", "qwen-72b".to_owned()),
        (
            "summary",
            format!("KV cache at 97% on replica {n} of the 72B pool in dc-a, 集群故障"),
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect()
}

#[test]
fn a_large_incident_is_cut_under_the_object_limit_and_read_back_whole() {
    let world = World::new();
    let config = ConfigFile::default_file().policy;
    let mut engine = Engine::new(config, Engine::fresh_state("e1".into(), at(0)), at(0));
    let alerts = (0..10_000)
        .map(|n| IncomingAlert {
            fingerprint: Fingerprint::of(&labels(n)),
            status: AlertStatus::Firing,
            labels: labels(n),
            annotations: Labels::new(),
            starts_at: at(0),
            ends_at: None,
            source: AlertSource::Alertmanager,
        })
        .collect();
    engine.step(Input::Alerts { alerts }, at(1));
    let big = engine.state().clone();
    assert_eq!(big.alerts.len(), 10_000);

    let mut a = world.store("stanch-0");
    a.load().unwrap();
    a.snapshot(&big, 1).unwrap();
    let sizes: Vec<usize> = world
        .objects()
        .iter()
        .map(|o| serde_json::to_vec(o).unwrap().len())
        .collect();
    assert!(
        sizes.len() >= 3,
        "several shards and the state object: {sizes:?}"
    );
    assert!(
        sizes.iter().all(|s| *s < 1024 * 1024),
        "every object under 1 MiB: {sizes:?}"
    );
    let loaded = world.store("stanch-1").load().unwrap();
    let (back, seq) = loaded.snapshot.unwrap();
    assert_eq!(seq, 1);
    assert_eq!(
        serde_json::to_value(&back).unwrap(),
        serde_json::to_value(&big).unwrap()
    );

    // The next snapshot replaces the shards: the old ones go.
    let before = world.api.names("api/v1", "configmaps", NS);
    let mut b = world.store("stanch-2");
    b.load().unwrap();
    b.snapshot(&state(2), 2).unwrap();
    let after = world.api.names("api/v1", "configmaps", NS);
    assert!(
        before.len() > 3 && after.len() == 2,
        "{before:?} -> {after:?}"
    );
}

/// One thing the engine task does to its store.
#[derive(Debug, Clone)]
enum Op {
    /// New records, written with those not acknowledged yet.
    Append(u64),
    /// A snapshot covering every record made so far.
    Snapshot,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![3 => (1u64..4).prop_map(Op::Append), 1 => Just(Op::Snapshot)]
}

fn fault() -> impl Strategy<Value = Option<WriteFault>> {
    prop_oneof![
        4 => Just(None),
        1 => Just(Some(WriteFault::Refuse)),
        1 => Just(Some(WriteFault::Unconfirmed)),
    ]
}

/// Runs `ops` against a store whose writes fail as `faults` say (in turn, one each),
/// retrying what was not acknowledged as the engine task does; then a new replica
/// loads: every acknowledged record is there, once, in order.
fn run_case(ops: &[Op], faults: Vec<Option<WriteFault>>) -> Result<(), TestCaseError> {
    let world = World::new();
    // A journal of a few records a segment, so that segments come and go.
    let mut store = world.store("stanch-0").with_journal_cap(400);
    store.load().unwrap();
    let mut plan = faults.into_iter();
    world.api.plan_faults(move |_, _| plan.next().flatten());
    let mut next_seq = 1;
    let mut unsynced: Vec<Record> = Vec::new();
    let mut acked: Vec<u64> = Vec::new();
    let mut covered = 0;
    for op in ops {
        match op {
            Op::Append(n) => {
                for _ in 0..*n {
                    unsynced.push(record(next_seq));
                    next_seq += 1;
                }
                // As the engine task does: a snapshot when the store prefers one.
                if store.prefers_snapshot(&unsynced) {
                    let seq = next_seq - 1;
                    if store.snapshot(&state(seq), seq).is_ok() {
                        acked.extend(unsynced.drain(..).map(|r| r.seq));
                        covered = seq;
                    }
                } else if store.append(&unsynced).is_ok() {
                    acked.extend(unsynced.drain(..).map(|r| r.seq));
                }
            }
            Op::Snapshot => {
                let seq = next_seq - 1;
                if store.snapshot(&state(seq), seq).is_ok() {
                    // The snapshot's state holds every record made, written or not.
                    acked.extend(unsynced.drain(..).map(|r| r.seq));
                    covered = seq;
                }
            }
        }
    }
    world.api.clear_faults();
    let loaded = world.store("stanch-1").load().unwrap();
    let from = match &loaded.snapshot {
        Some((state, seq)) => {
            prop_assert_eq!(
                state.version,
                *seq,
                "the snapshot is the one its manifest names"
            );
            *seq
        }
        None => 0,
    };
    prop_assert!(
        from >= covered,
        "a snapshot acknowledged at {} is in force, not {}",
        covered,
        from
    );
    let journal = seqs(&loaded);
    let contiguous: Vec<u64> = (from + 1..from + 1 + journal.len() as u64).collect();
    prop_assert_eq!(
        &journal,
        &contiguous,
        "the journal follows its snapshot, each record once"
    );
    for seq in acked {
        prop_assert!(
            seq <= from || journal.contains(&seq),
            "acknowledged record {} lost",
            seq
        );
    }
    Ok(())
}

#[test]
fn nothing_acknowledged_is_lost_whichever_write_fails() {
    let cases = std::env::var("STANCH_KUBE_FAULT_CASES")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(32);
    let mut runner = TestRunner::new(RunnerConfig {
        cases,
        failure_persistence: None,
        ..RunnerConfig::default()
    });
    let strategy = (
        proptest::collection::vec(op(), 1..40),
        proptest::collection::vec(fault(), 0..40),
    );
    runner
        .run(&strategy, |(ops, faults)| run_case(&ops, faults))
        .unwrap();
}
