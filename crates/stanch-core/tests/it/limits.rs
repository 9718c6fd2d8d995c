//! The alert limits: a flood of new alerts (a high-cardinality rule routed to stanch),
//! or of large ones, is turned away beyond `alerts.max_active` alerts or
//! `alerts.max_bytes` held, reported once per step, and never costs the alerts that
//! act on the table.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use proptest::prelude::*;
use stanch_api::alerts::{AlertSource, IncomingAlert};
use stanch_api::{Fingerprint, Rung, Timestamp};
use stanch_core::{Config, Decision, Input};

use crate::harness::{AlertBuilder, T0, base_config, engine};

const LIMIT: usize = 4;

fn config(limit: usize) -> Config {
    let mut c = base_config();
    c.alerts.max_active = limit;
    c
}

/// Limits in bytes, with room for many alerts in count.
fn bytes_config(max_bytes: usize) -> Config {
    let mut c = base_config();
    c.alerts.max_active = 100;
    c.alerts.max_bytes = max_bytes;
    c
}

/// Whether alert `i` maps to a condition: the even ones do.
fn acts(i: usize) -> bool {
    i.is_multiple_of(2)
}

/// Alert `i`: the ones that act fail pool dc-a of qwen-72b over, the others map to
/// nothing.
fn alert(i: usize) -> AlertBuilder {
    let b = AlertBuilder::firing(&format!("A{i}"));
    if acts(i) {
        b.label("action", "trigger-failover")
            .label("target_model", "qwen-72b")
            .label("pool", "dc-a")
    } else {
        b.label("pod", &format!("pod-{i}"))
    }
}

fn fire(alerts: impl IntoIterator<Item = IncomingAlert>) -> Input {
    Input::Alerts {
        alerts: alerts.into_iter().collect(),
    }
}

fn limits(decisions: &[Decision]) -> Vec<(usize, usize, Vec<String>)> {
    decisions
        .iter()
        .filter_map(|d| match d {
            Decision::AlertLimit {
                refused,
                displaced,
                alertnames,
                source,
                ..
            } => {
                assert_eq!(*source, AlertSource::Alertmanager);
                Some((*refused, *displaced, alertnames.clone()))
            }
            _ => None,
        })
        .collect()
}

#[test]
fn a_flood_is_refused_beyond_the_limit_in_one_decision() {
    let mut e = engine(config(LIMIT));
    let flood: Vec<_> = (0..50).map(|i| alert(2 * i + 1).build()).collect();
    let step = e.step(fire(flood.clone()), T0 + Duration::from_secs(1));
    assert_eq!(e.state().alerts.len(), LIMIT);
    let taken = step
        .decisions
        .iter()
        .filter(|d| matches!(d, Decision::AlertActive { .. }))
        .count();
    assert_eq!(taken, LIMIT);
    let names: Vec<String> = (LIMIT..LIMIT + Decision::NAMES_KEPT)
        .map(|i| format!("A{}", 2 * i + 1))
        .collect();
    assert_eq!(limits(&step.decisions), [(50 - LIMIT, 0, names)]);
    let line = step
        .decisions
        .iter()
        .find(|d| d.kind() == "alert_limit")
        .unwrap()
        .to_string();
    assert!(
        line.starts_with(
            "alert limit (4 active or 16384 KiB held) reached: refused 46 new from Alertmanager (A9, "
        ),
        "{line}"
    );

    // The same notification again: what was taken is refreshed, the rest refused again.
    let again = e.step(fire(flood), T0 + Duration::from_secs(2));
    assert_eq!(limits(&again.decisions)[0].0, 50 - LIMIT);
    assert_eq!(e.state().alerts.len(), LIMIT);

    // A resolution makes room for the next.
    let resolved = alert(1).resolved().build();
    e.step(fire([resolved]), T0 + Duration::from_secs(3));
    let step = e.step(fire([alert(99).build()]), T0 + Duration::from_secs(4));
    assert!(limits(&step.decisions).is_empty(), "{:?}", step.decisions);
    assert_eq!(e.state().alerts.len(), LIMIT);
}

#[test]
fn an_alert_that_acts_takes_the_place_of_noise() {
    let mut e = engine(config(LIMIT));
    for (s, i) in [1, 3, 5, 7].into_iter().enumerate() {
        e.step(
            fire([alert(i).build()]),
            T0 + Duration::from_secs(s as u64 + 1),
        );
    }
    assert_eq!(e.state().alerts.len(), LIMIT);
    let at = T0 + Duration::from_secs(10);
    let step = e.step(fire([alert(0).build()]), at);
    // A1 was refreshed longest ago: it goes, and the model fails over at once.
    assert_eq!(limits(&step.decisions), [(0, 1, vec!["A1".to_owned()])]);
    let left: BTreeSet<Fingerprint> = e.state().alerts.keys().copied().collect();
    assert!(!left.contains(&alert(1).build().fingerprint));
    assert!(left.contains(&alert(0).build().fingerprint));
    assert_eq!(e.state().models["qwen-72b"].rung, Rung::Failover);

    // Noise never displaces noise, nor anything that acts.
    let step = e.step(fire([alert(9).build()]), at + Duration::from_secs(1));
    assert_eq!(limits(&step.decisions), [(1, 0, vec!["A9".to_owned()])]);
    for (s, i) in [2, 4, 6].into_iter().enumerate() {
        e.step(
            fire([alert(i).build()]),
            at + Duration::from_secs(s as u64 + 2),
        );
    }
    let step = e.step(fire([alert(8).build()]), at + Duration::from_secs(9));
    assert_eq!(limits(&step.decisions), [(1, 0, vec!["A8".to_owned()])]);
    assert!(e.state().alerts.values().all(|r| r.condition.is_some()));
}

#[test]
fn a_notification_that_fills_the_engine_again_still_makes_room() {
    let mut e = engine(config(LIMIT));
    let t = T0 + Duration::from_secs(1);
    e.step(fire([0, 2, 4, 6].map(|i| alert(i).build())), t);
    // Full of alerts that act: A8 is refused. Then one resolves, noise takes its
    // place, and A10, which acts, must take the noise's.
    let batch = [
        alert(8).build(),
        alert(0).resolved().build(),
        alert(1).build(),
        alert(10).build(),
    ];
    let step = e.step(fire(batch), t + Duration::from_secs(1));
    assert_eq!(
        limits(&step.decisions),
        [(1, 1, vec!["A8".to_owned(), "A1".to_owned()])]
    );
    let held: BTreeSet<Fingerprint> = e.state().alerts.keys().copied().collect();
    let want: BTreeSet<Fingerprint> = [2, 4, 6, 10].map(|i| alert(i).build().fingerprint).into();
    assert_eq!(held, want);
}

#[test]
fn the_limits_are_checked_with_their_paths() {
    let err = Config::from_yaml(
        "models: {a: {pools: [p]}}\nalerts: {max_active: 2000000, max_bytes: 1000}\n",
    )
    .unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("alerts.max_active: must be between 1 and 1000000"),
        "{text}"
    );
    assert!(
        text.contains("alerts.max_bytes: must be between 1048576 (1 MiB) and 1073741824 (1 GiB)"),
        "{text}"
    );
}

#[derive(Debug, Clone, Copy)]
enum Op {
    /// Alert `i`, with an annotation of this many bytes.
    Fire(usize, usize),
    Resolve(usize),
}

/// Alert `i` firing at `now` with `size` bytes of annotation.
fn sized(i: usize, size: usize, now: Timestamp) -> IncomingAlert {
    alert(i)
        .annotation("description", &"d".repeat(size))
        .at(now)
        .build()
}

fn op(sizes: &'static [usize]) -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (0..12usize, proptest::sample::select(sizes)).prop_map(|(i, s)| Op::Fire(i, s)),
        1 => (0..12usize).prop_map(Op::Resolve),
    ]
}

/// One active alert in the [`Model`].
#[derive(Debug)]
struct Held {
    mapped: bool,
    /// When the instance held started.
    started: Timestamp,
    received: Timestamp,
    fingerprint: Fingerprint,
    bytes: usize,
}

/// The limits, alert by alert, as plain maps: what the engine is held to.
#[derive(Debug)]
struct Model {
    max_active: usize,
    max_bytes: usize,
    active: BTreeMap<usize, Held>,
    /// Alert index → the start of the instance last resolved: a firing that started
    /// no later is a late duplicate of it.
    resolved: BTreeMap<usize, Timestamp>,
}

impl Model {
    fn new(config: &Config) -> Model {
        Model {
            max_active: config.alerts.max_active,
            max_bytes: config.alerts.max_bytes,
            active: BTreeMap::new(),
            resolved: BTreeMap::new(),
        }
    }

    fn held(&self) -> usize {
        self.active.values().map(|h| h.bytes).sum()
    }

    /// Applies one step's batch, every alert started at `now`; returns (refused,
    /// displaced).
    fn step(&mut self, batch: &[Op], now: Timestamp) -> (usize, usize) {
        let (mut refused, mut displaced) = (0, 0);
        for op in batch {
            match *op {
                Op::Resolve(i) => match self.active.remove(&i) {
                    Some(held) => {
                        self.resolved.insert(i, held.started);
                    }
                    None => {
                        if self.resolved.get(&i).is_none_or(|t| *t <= now) {
                            self.resolved.insert(i, now);
                        }
                    }
                },
                Op::Fire(i, size) => {
                    if self.resolved.get(&i).is_some_and(|t| *t >= now) {
                        continue;
                    }
                    let bytes = sized(i, size, now).held_bytes();
                    let held = self.held();
                    if let Some(entry) = self.active.get_mut(&i) {
                        entry.received = now;
                        if bytes > entry.bytes && held + bytes - entry.bytes > self.max_bytes {
                            refused += 1;
                        } else {
                            entry.bytes = bytes;
                        }
                        continue;
                    }
                    let mapped = acts(i);
                    loop {
                        if self.active.len() < self.max_active
                            && self.held() + bytes <= self.max_bytes
                        {
                            break;
                        }
                        let oldest = self
                            .active
                            .iter()
                            .filter(|(_, h)| !h.mapped)
                            .min_by_key(|(_, h)| (h.received, h.fingerprint))
                            .map(|(j, _)| *j);
                        match oldest {
                            Some(j) if mapped => {
                                self.active.remove(&j);
                                displaced += 1;
                            }
                            _ => break,
                        }
                    }
                    if self.active.len() >= self.max_active || self.held() + bytes > self.max_bytes
                    {
                        refused += 1;
                        continue;
                    }
                    self.resolved.remove(&i);
                    let fingerprint = alert(i).build().fingerprint;
                    self.active.insert(
                        i,
                        Held {
                            mapped,
                            started: now,
                            received: now,
                            fingerprint,
                            bytes,
                        },
                    );
                }
            }
        }
        (refused, displaced)
    }
}

/// Runs `steps` through an engine under `config` and the [`Model`], checking after
/// each that they hold the same alerts and report the same refusals and drops.
fn against_the_model(config: Config, steps: Vec<Vec<Op>>) -> Result<(), TestCaseError> {
    let mut model = Model::new(&config);
    let mut e = engine(config);
    let mut now = T0;
    for batch in steps {
        now = now + Duration::from_secs(7);
        // Each firing a new instance, so that an earlier resolution's tombstone
        // does not make it a late duplicate.
        let input = if batch.is_empty() {
            Input::Tick
        } else {
            fire(batch.iter().map(|op| match *op {
                Op::Fire(i, size) => sized(i, size, now),
                Op::Resolve(i) => alert(i).at(now).resolved().build(),
            }))
        };
        let step = e.step(input, now);
        let expected = model.step(&batch, now);

        let held: BTreeSet<Fingerprint> = e.state().alerts.keys().copied().collect();
        let want: BTreeSet<Fingerprint> = model.active.values().map(|h| h.fingerprint).collect();
        prop_assert_eq!(held, want, "after {:?}", batch);
        let bytes: usize = e
            .state()
            .alerts
            .values()
            .map(|r| r.alert.held_bytes())
            .sum();
        prop_assert_eq!(bytes, model.held(), "after {:?}", batch);
        prop_assert!(bytes <= model.max_bytes);
        let reported = limits(&step.decisions);
        prop_assert!(reported.len() <= 1);
        let (refused, displaced, _) = reported.first().cloned().unwrap_or_default();
        prop_assert_eq!((refused, displaced), expected, "after {:?}", batch);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Over any sequence of notifications, each a batch of firings and resolutions: the
    /// engine holds exactly the alerts the reference model does (so never more than
    /// the limit; a new alert refused only when full, and one that acts only when
    /// nothing unmapped is left to drop; only unmapped alerts ever dropped, the one
    /// refreshed longest ago first), and each step's decision counts every refusal and
    /// every drop.
    #[test]
    fn the_limit_holds_and_accounts_for_every_alert(
        steps in proptest::collection::vec(proptest::collection::vec(op(&[0]), 0..6), 1..40),
    ) {
        against_the_model(config(LIMIT), steps)?;
    }

    /// The same in bytes: alerts of different sizes, refreshed larger and smaller,
    /// never hold more than `alerts.max_bytes`; a refresh that would pass it keeps the
    /// alert's last content and is counted as refused.
    #[test]
    fn the_byte_limit_holds_and_accounts_for_every_alert(
        steps in proptest::collection::vec(
            proptest::collection::vec(op(&[0, 300, 1_500, 4_000]), 0..6),
            1..40,
        ),
    ) {
        against_the_model(bytes_config(8_000), steps)?;
    }
}
