//! The store under injected faults: any write, fsync, rename or read may fail, fail
//! part-way, lose its data, or crash the process, and the disk may fill up; then the
//! machine loses power and the controller starts again on what reached the disk.
//!
//! The property, checked after every restart:
//! - the controller starts (a failing read at start refuses to start, and the next
//!   start on a healthy disk succeeds with everything);
//! - every alert, block and override acknowledged (and not touched since by an input
//!   that may or may not have landed) is in the restored state;
//! - the epoch is the same, and the version is at least the newest one ever published:
//!   nothing unacknowledged was published, and versions never go back;
//! - one version number never stands for two contents.
//!
//! `STANCH_FAULT_CASES` sets the number of cases (default 2,000); see
//! docs/operations.md for the longer run.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config as RunnerConfig, TestCaseError, TestRunner};
use stanch_api::alerts::{AlertSource, AlertStatus, IncomingAlert};
use stanch_api::{Fingerprint, HumanDuration, Labels, Rung, Timestamp};
use stanch_core::engine::Command;
use stanch_core::{EngineState, Input};
use stanch_ports::clock::{Clock, ManualClock};
use stanch_ports::store::StateStore;
use stanch_server::engine_task::{EngineTask, Started};
use stanch_server::history::History;
use stanch_server::metrics::Metrics;
use stanch_server::store::FileStore;
use stanch_server::store::sim::{Fault, SimFs, Writeback};

use crate::support::{fixture_time, test_config};

const DIR: &str = "/data";

#[derive(Debug, Clone)]
enum Op {
    Fire(u8),
    Resolve(u8),
    Block(u8),
    Unblock(u8),
    Force(Rung),
    Release,
    /// Time passes: timers run, leases renew.
    Advance(u16),
    /// The disk fills up until the given number of later ops has run.
    FillDisk {
        extra: u16,
        ops: u8,
    },
    /// The policy changes: with an extra model, or back to the one every start is
    /// given (which a restart then puts back in force, as a change of its own).
    Configure {
        extra_model: bool,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..6).prop_map(Op::Fire),
        2 => (0u8..6).prop_map(Op::Resolve),
        2 => (0u8..4).prop_map(Op::Block),
        1 => (0u8..4).prop_map(Op::Unblock),
        1 => prop_oneof![Just(Rung::Failover), Just(Rung::Static)].prop_map(Op::Force),
        1 => Just(Op::Release),
        2 => (1u16..400).prop_map(Op::Advance),
        1 => (0u16..3000, 1u8..6).prop_map(|(extra, ops)| Op::FillDisk { extra, ops }),
        1 => any::<bool>().prop_map(|extra_model| Op::Configure { extra_model }),
    ]
}

fn fault() -> impl Strategy<Value = Fault> {
    prop_oneof![
        Just(Fault::Fail),
        (0u16..1000).prop_map(|per_mille| Fault::Partial { per_mille }),
        Just(Fault::SyncFails),
        (0u16..=1000).prop_map(|per_mille| Fault::Crash { per_mille }),
    ]
}

fn writeback() -> impl Strategy<Value = Writeback> {
    prop_oneof![
        Just(Writeback::None),
        Just(Writeback::All),
        any::<u64>().prop_map(Writeback::Mixed),
    ]
}

#[derive(Debug, Clone)]
struct Round {
    ops: Vec<Op>,
    /// Faults at offsets from the round's first disk operation.
    faults: Vec<(u8, Fault)>,
    /// How the disk looks after the power cut that ends the round.
    writeback: Writeback,
    /// A fault in the round's start, in the store's own operations.
    start_fault: Option<(u8, Fault)>,
}

fn round() -> impl Strategy<Value = Round> {
    (
        prop::collection::vec(op(), 1..16),
        prop::collection::vec((0u8..80, fault()), 0..4),
        writeback(),
        prop::option::weighted(0.3, (0u8..8, fault())),
    )
        .prop_map(|(ops, faults, writeback, start_fault)| Round {
            ops,
            faults,
            writeback,
            start_fault,
        })
}

/// What the test knows of one key (an alert, a block, the override).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Known {
    /// The last input on it was acknowledged: it must be so after a restart.
    Acked(bool),
    /// An input on it was refused or never answered: it may have landed or not.
    Unsure,
}

#[derive(Debug, Default)]
struct Expect {
    alerts: BTreeMap<u8, Known>,
    blocks: BTreeMap<u8, Known>,
    force: Option<Known>,
    /// The epoch, once anything of it was durable: a table past version 0 is
    /// published only then. A first start that dies before that promised nothing.
    epoch: Option<String>,
    newest_published: u64,
    contents: BTreeMap<u64, String>,
}

impl Expect {
    fn note(slot: &mut Known, acked: bool, on: bool) {
        *slot = if acked {
            Known::Acked(on)
        } else {
            Known::Unsure
        };
    }

    /// Records a published table; a version must always mean one content.
    fn published(&mut self, epoch: &str, version: u64, hash: &str) -> Result<(), TestCaseError> {
        if version == 0 {
            return Ok(());
        }
        let durable = self.epoch.get_or_insert_with(|| epoch.to_owned());
        prop_assert_eq!(durable.as_str(), epoch, "a new epoch while running");
        self.newest_published = self.newest_published.max(version);
        let seen = self
            .contents
            .entry(version)
            .or_insert_with(|| hash.to_owned());
        prop_assert_eq!(
            seen.as_str(),
            hash,
            "version {} published with two contents",
            version
        );
        Ok(())
    }

    fn check(&self, state: &EngineState) -> Result<(), TestCaseError> {
        prop_assert_eq!(Some(&state.epoch), self.epoch.as_ref(), "epoch changed");
        prop_assert!(
            state.version >= self.newest_published,
            "version went back: {} < {}",
            state.version,
            self.newest_published
        );
        for (&n, &known) in &self.alerts {
            if let Known::Acked(firing) = known {
                let present = state.alerts.contains_key(&fingerprint(n));
                prop_assert_eq!(
                    present,
                    firing,
                    "alert {} acknowledged as firing={}",
                    n,
                    firing
                );
            }
        }
        for (&n, &known) in &self.blocks {
            if let Known::Acked(blocked) = known {
                let present = state.blocks.keys().any(|k| k.endpoint == endpoint(n));
                prop_assert_eq!(present, blocked, "block {} acknowledged as {}", n, blocked);
            }
        }
        if let Some(Known::Acked(forced)) = self.force {
            let present = state.models["qwen-14b"].force.is_some();
            prop_assert_eq!(present, forced, "force acknowledged as {}", forced);
        }
        Ok(())
    }
}

fn labels(n: u8) -> Labels {
    [
        ("alertname", "FaultCase".to_owned()),
        ("case", n.to_string()),
        ("action", "trigger-failover".to_owned()),
        ("target_model", "qwen-72b".to_owned()),
        // Multi-byte text, so torn lines can end inside a character.
        ("summary", "集群故障".to_owned()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect()
}

fn fingerprint(n: u8) -> Fingerprint {
    Fingerprint::of(&labels(n))
}

fn endpoint(n: u8) -> String {
    format!("http://ep-{n}:8000")
}

fn alert(n: u8, status: AlertStatus, at: Timestamp) -> Input {
    Input::Alerts {
        alerts: vec![IncomingAlert {
            fingerprint: fingerprint(n),
            status,
            labels: labels(n),
            annotations: Labels::new(),
            starts_at: at,
            ends_at: None,
            source: AlertSource::Alertmanager,
        }],
    }
}

/// The policy every start is given, or the same with one more model: a change that
/// shows in the published table, so a replay under the wrong policy would publish
/// different content under a version already seen.
fn policy(extra_model: bool) -> stanch_core::Config {
    let mut c = test_config();
    if extra_model {
        let small = c.models["qwen-14b"].clone();
        c.models.insert("qwen-7b".into(), small);
    }
    c
}

fn command(command: Command) -> Input {
    Input::Command { command }
}

/// Starts the engine on `fs` (not yet running); `Err` names the store failure that
/// refused the start.
fn start(fs: &SimFs, clock: &ManualClock) -> Result<Started, &'static str> {
    let store = FileStore::open_on(Arc::new(fs.clone()), DIR, "restart").map_err(|e| e.kind())?;
    let mut started = EngineTask::start(
        test_config(),
        Box::new(store) as Box<dyn StateStore>,
        Arc::new(History::in_memory(100)),
        Arc::new(Metrics::new()),
        Arc::new(clock.clone()),
    )
    .map_err(|e| e.kind())?;
    started.task.set_snapshot_every(7);
    Ok(started)
}

async fn case(rounds: Vec<Round>) -> Result<(), TestCaseError> {
    let clock = ManualClock::new(fixture_time());
    let mut fs = SimFs::new();
    let mut expect = Expect::default();
    for round in rounds {
        // Start, on a disk that may fail during the start itself.
        if let Some((offset, fault)) = round.start_fault {
            fs.fail_at(fs.ops() + u64::from(offset), fault);
        }
        let started = match start(&fs, &clock) {
            Ok(started) => started,
            Err(kind) => {
                // Refusing to start on a disk that cannot be read is right (starting
                // over would lose everything); the next start, on a healthy disk,
                // must succeed and find everything.
                prop_assert!(
                    matches!(kind, "load" | "open_dir"),
                    "start refused: {}",
                    kind
                );
                fs = fs.restarted(Writeback::None);
                start(&fs, &clock).map_err(TestCaseError::fail)?
            }
        };
        let Started {
            task,
            handle,
            publisher,
            ..
        } = started;
        if expect.epoch.is_some() {
            expect.check(task.state())?;
        }
        let running = tokio::spawn(task.run(std::future::pending()));
        let snap = publisher.load();
        expect.published(&snap.table.epoch, snap.table.version, &snap.table.hash)?;

        let base = fs.ops();
        for (offset, fault) in &round.faults {
            fs.fail_at(base + u64::from(*offset), *fault);
        }
        let mut full_until = None;
        for (i, op) in round.ops.iter().enumerate() {
            if full_until.is_some_and(|end| i >= end) {
                fs.set_capacity(None);
                full_until = None;
            }
            // Each input a second after the last, so a firing after a resolve is new
            // (not a late duplicate of the resolved one).
            clock.advance(Duration::from_secs(1));
            let now = clock.now();
            let input = match *op {
                Op::Fire(n) => alert(n, AlertStatus::Firing, now),
                Op::Resolve(n) => alert(n, AlertStatus::Resolved, now),
                Op::Block(n) => command(Command::Block {
                    endpoint: endpoint(n),
                    model: None,
                    ttl: Some(HumanDuration::secs(24 * 3600)),
                    reason: "drill".into(),
                }),
                Op::Unblock(n) => command(Command::Unblock {
                    endpoint: endpoint(n),
                    model: None,
                    reason: "drill".into(),
                }),
                Op::Force(rung) => command(Command::Force {
                    model: "qwen-14b".into(),
                    rung,
                    ttl: None,
                    reason: "drill".into(),
                }),
                Op::Release => command(Command::Release {
                    model: "qwen-14b".into(),
                    reason: "drill".into(),
                }),
                Op::Advance(secs) => {
                    clock.advance(Duration::from_secs(u64::from(secs)));
                    Input::Tick
                }
                Op::FillDisk { extra, ops } => {
                    fs.set_capacity(Some(fs.used() + u64::from(extra)));
                    full_until = Some(i + 1 + usize::from(ops));
                    continue;
                }
                Op::Configure { extra_model } => Input::Configure {
                    config: Box::new(policy(extra_model)),
                },
            };
            let acked = handle.apply(input).await.is_ok();
            match *op {
                Op::Fire(n) => {
                    Expect::note(expect.alerts.entry(n).or_insert(Known::Unsure), acked, true)
                }
                Op::Resolve(n) => Expect::note(
                    expect.alerts.entry(n).or_insert(Known::Unsure),
                    acked,
                    false,
                ),
                Op::Block(n) => {
                    Expect::note(expect.blocks.entry(n).or_insert(Known::Unsure), acked, true)
                }
                Op::Unblock(n) => Expect::note(
                    expect.blocks.entry(n).or_insert(Known::Unsure),
                    acked,
                    false,
                ),
                Op::Force(_) => {
                    Expect::note(expect.force.get_or_insert(Known::Unsure), acked, true)
                }
                Op::Release => {
                    Expect::note(expect.force.get_or_insert(Known::Unsure), acked, false)
                }
                Op::Advance(_) | Op::FillDisk { .. } | Op::Configure { .. } => {}
            }
            let snap = publisher.load();
            expect.published(&snap.table.epoch, snap.table.version, &snap.table.hash)?;
            if fs.has_crashed() {
                break;
            }
        }
        // The power goes out.
        fs.crash();
        running.abort();
        let _ = running.await;
        fs = fs.restarted(round.writeback);
    }
    // The last start, on a healthy disk.
    let started = start(&fs, &clock).map_err(TestCaseError::fail)?;
    if expect.epoch.is_some() {
        expect.check(started.task.state())?;
    }
    Ok(())
}

fn cases() -> u32 {
    std::env::var("STANCH_FAULT_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2_000)
}

#[test]
fn nothing_acknowledged_is_lost_under_any_fault() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let mut runner = TestRunner::new(RunnerConfig {
        cases: cases(),
        failure_persistence: None,
        ..RunnerConfig::default()
    });
    let result = runner.run(&prop::collection::vec(round(), 1..4), |rounds| {
        rt.block_on(case(rounds))
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// The defect this family was found by: a write cut short on a full disk, the disk
/// enlarged, more alerts acknowledged, then `kill -9`. Before the fix, the failed
/// append was cut back by the whole batch's length, into records already synced.
#[test]
fn a_partial_write_on_a_full_disk_never_cuts_into_acknowledged_records() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    rt.block_on(async {
        let clock = ManualClock::new(fixture_time());
        let fs = SimFs::new();
        let Started {
            task,
            handle,
            publisher,
            ..
        } = start(&fs, &clock).unwrap();
        let epoch = task.state().epoch.clone();
        let running = tokio::spawn(task.run(std::future::pending()));
        let fire = |n| alert(n, AlertStatus::Firing, clock.now());
        for n in 0..3 {
            handle.apply(fire(n)).await.unwrap();
        }
        // Room for a small part of the next record only.
        fs.set_capacity(Some(fs.used() + 40));
        assert!(handle.apply(fire(3)).await.is_err());
        let refused_at = publisher.load().table.version;
        fs.set_capacity(None);
        // The refused record is retried first, then these are written after it.
        for n in 4..6 {
            handle.apply(fire(n)).await.unwrap();
        }
        assert!(publisher.load().table.version > refused_at);
        fs.crash();
        running.abort();
        let after = fs.restarted(Writeback::None);
        let journal = after
            .contents(&Path::new(DIR).join("journal.jsonl"))
            .unwrap();
        assert!(journal.ends_with(b"\n"), "no torn line after a repair");
        let started = start(&after, &clock).unwrap();
        let state = started.task.state();
        assert_eq!(state.epoch, epoch, "the same history, not a new epoch");
        for n in 0..6 {
            assert!(state.alerts.contains_key(&fingerprint(n)), "alert {n} lost");
        }
    });
}
