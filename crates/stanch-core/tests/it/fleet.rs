//! Reports and blocks under hostile input: what a report may name, how much of the
//! fleet's statistics it can make the engine hold, and the block limit.

use std::time::Duration;

use proptest::prelude::*;
use stanch_api::reports::EndpointReport;
use stanch_core::config::PoolConfig;
use stanch_core::engine::ReportRefusals;
use stanch_core::state::{BlockSource, FleetStats};
use stanch_core::{Command, Config, Decision, Engine, EngineState, Input, OverrideAction};

use crate::harness::{AlertBuilder, T0, base_config, engine};

fn entry(endpoint: &str, model: &str, ok: u64, failed: u64, run: u32) -> EndpointReport {
    EndpointReport {
        endpoint: endpoint.to_owned(),
        model: model.to_owned(),
        successes: ok,
        failures: failed,
        consecutive_failures: run,
    }
}

fn report(gateway: &str, endpoints: Vec<EndpointReport>) -> Input {
    Input::Reports {
        gateway: gateway.to_owned(),
        endpoints,
    }
}

/// qwen-72b with its pools' endpoints listed; qwen-14b without.
fn listed_config() -> Config {
    let mut c = base_config();
    let m = c.models.get_mut("qwen-72b").expect("default model");
    m.pools = vec![
        PoolConfig::Full {
            name: "dc-a".into(),
            endpoints: vec!["a1:8000".into(), "http://a2:8000".into()],
        },
        PoolConfig::Full {
            name: "dc-b".into(),
            endpoints: vec!["b1:8000".into()],
        },
    ];
    c
}

/// A `block-endpoint` alert for `endpoint`, firing since `T0`.
fn block_alert(name: &str, endpoint: &str) -> Input {
    let alert = AlertBuilder::firing(name)
        .label("action", "block-endpoint")
        .label("endpoint", endpoint)
        .at(T0)
        .build();
    Input::Alerts {
        alerts: vec![alert],
    }
}

fn blocked(e: &Engine) -> Vec<(String, Option<String>, BlockSource)> {
    e.state()
        .blocks
        .iter()
        .map(|(k, b)| (k.endpoint.clone(), k.model.clone(), b.source.clone()))
        .collect()
}

fn block_limits(decisions: &[Decision]) -> Vec<(usize, usize)> {
    decisions
        .iter()
        .filter_map(|d| match d {
            Decision::BlockLimit {
                refused, displaced, ..
            } => Some((*refused, *displaced)),
            _ => None,
        })
        .collect()
}

#[test]
fn a_report_names_only_endpoints_of_the_configured_pools() {
    let e = engine(listed_config());
    let (admitted, refused) = e.admit(report(
        "gw",
        vec![
            entry("http://a1:8000", "qwen-72b", 1, 0, 0), // listed as host:port
            entry("https://a1:8000/", "qwen-72b", 1, 0, 0), // a path: not what gateways match
            entry("http://a2:8000", "qwen-72b", 1, 0, 0), // listed as the URL
            entry("http://evil:1", "qwen-72b", 1, 0, 0),  // not in its pools
            entry("a2:8000", "qwen-72b", 1, 0, 0),        // a URL is listed: not this
            entry("http://x:1", "qwen-14b", 1, 0, 0),     // no endpoints listed
            entry("http://a1:8000", "llama", 1, 0, 0),    // not managed here
        ],
    ));
    let Input::Reports { endpoints, .. } = admitted.input() else {
        panic!("a report stays a report");
    };
    let kept: Vec<&str> = endpoints.iter().map(|r| r.endpoint.as_str()).collect();
    assert_eq!(kept, ["http://a1:8000", "http://a2:8000", "http://x:1"]);
    assert_eq!(
        refused,
        ReportRefusals {
            unknown_model: 1,
            unknown_endpoint: 3,
            limit: 0,
        }
    );
}

#[test]
fn unlisted_models_track_at_most_max_endpoints_pairs_until_the_window_forgets_them() {
    let mut c = base_config();
    c.blocking.fleet.max_endpoints = 3;
    let mut e = engine(c);
    let many: Vec<EndpointReport> = (0..10)
        .map(|i| entry(&format!("http://e{i}:1"), "qwen-14b", 1, 0, 0))
        .collect();
    let (admitted, refused) = e.admit(report("gw", many.clone()));
    assert_eq!(refused.limit, 7);
    e.step_admitted(admitted, T0);
    assert_eq!(e.state().fleet.len(), 3);
    // Pairs already tracked keep being counted; new ones still are not.
    let (_, refused) = e.admit(report("gw", many.clone()));
    assert_eq!(refused.limit, 7);
    // A window later the three are forgotten, and three others can be tracked.
    let later = T0 + Duration::from_secs(61);
    e.step(Input::Tick, later);
    assert!(e.state().fleet.is_empty());
    let (admitted, refused) = e.admit(report("gw", many[5..].to_vec()));
    assert_eq!(refused.limit, 2);
    e.step_admitted(admitted, later);
    assert_eq!(e.state().fleet.len(), 3);
}

#[test]
fn one_pair_named_many_times_is_one_entry() {
    let e = engine(base_config());
    let same: Vec<EndpointReport> = (0..10_000)
        .map(|_| entry("http://e:1", "qwen-14b", 2, 1, 1))
        .collect();
    let (admitted, refused) = e.admit(report("gw", same));
    assert_eq!(refused.total(), 0);
    let Input::Reports { endpoints, .. } = admitted.input() else {
        panic!("a report stays a report");
    };
    assert_eq!(
        *endpoints,
        [entry("http://e:1", "qwen-14b", 20_000, 10_000, 1)]
    );
}

#[test]
fn fleet_statistics_stay_bounded_per_pair_and_forget_silent_gateways() {
    let mut e = engine(base_config());
    // A report every 100 ms for two windows, from 100 gateways each with a run going.
    for step in 0..1_200u64 {
        let now = T0 + Duration::from_millis(100 * step);
        let gw = format!("gw-{}", step % 100);
        e.step(
            report(&gw, vec![entry("http://e:1", "qwen-14b", 10, 0, 0)]),
            now,
        );
        let stats = &e.state().fleet.values().next().expect("tracked");
        assert!(stats.samples.len() as u64 <= FleetStats::SLOTS + 1);
    }
    // Failures from many gateways: only the longest runs are kept.
    let now = T0 + Duration::from_secs(200);
    for g in 0..100u32 {
        let run = 1 + g % 4; // below the trigger of 5
        e.step(
            report(
                &format!("gw-{g}"),
                vec![entry("http://e:1", "qwen-14b", 0, u64::from(run), run)],
            ),
            now,
        );
    }
    let stats = e.state().fleet.values().next().expect("tracked");
    assert_eq!(stats.streaks.len(), FleetStats::MAX_STREAKS);
    assert!(
        stats.streaks.values().all(|s| s.run == 4),
        "the longest runs stay"
    );
    // A gateway that stops reporting is forgotten after a window, though others go on.
    let later = now + Duration::from_secs(61);
    e.step(
        report("gw-new", vec![entry("http://e:1", "qwen-14b", 1, 0, 0)]),
        later,
    );
    e.step(Input::Tick, later);
    let stats = e.state().fleet.values().next().expect("still tracked");
    assert!(stats.streaks.is_empty(), "{:?}", stats.streaks);
}

#[test]
fn a_snapshot_from_before_runs_were_dated_still_loads() {
    let mut e = engine(base_config());
    e.step(
        report("gw", vec![entry("http://e:1", "qwen-14b", 0, 2, 2)]),
        T0,
    );
    let mut json = serde_json::to_value(e.state()).expect("serializes");
    // The old form: a gateway's run as a bare number.
    json["fleet"][0][1]["streaks"]["gw"] = serde_json::json!(2);
    let old: EngineState = serde_json::from_value(json).expect("the old form reads");
    let run = old.fleet.values().next().expect("tracked").streaks["gw"];
    assert_eq!(run.run, 2);
}

#[test]
fn at_the_block_limit_reports_are_refused_and_alerts_and_operators_take_their_place() {
    let mut c = base_config();
    c.blocking.max_blocks = 2;
    let mut e = engine(c);
    let fail = |ep: &str| entry(ep, "qwen-14b", 0, 5, 5);
    let s = e.step(
        report(
            "gw",
            vec![
                fail("http://f1:1"),
                fail("http://f2:1"),
                fail("http://f3:1"),
            ],
        ),
        T0,
    );
    assert_eq!(block_limits(&s.decisions), [(1, 0)]);
    assert_eq!(e.state().blocks.len(), 2);
    // An alert's block takes the place of a fleet block.
    let s = e.step(block_alert("EndpointDown", "http://a:1"), T0);
    assert_eq!(block_limits(&s.decisions), [(0, 1)], "{:#?}", s.decisions);
    assert_eq!(e.state().blocks.len(), 2);
    assert!(blocked(&e).iter().any(|(ep, _, _)| ep == "http://a:1"));
    // An operator's takes the place of the other fleet block, then of the alert's.
    let block = |ep: &str| Input::Command {
        command: Command::Block {
            endpoint: ep.into(),
            model: None,
            ttl: None,
            reason: "by hand".into(),
        },
    };
    for ep in ["http://o1:1", "http://o2:1"] {
        let s = e.step(block(ep), T0);
        assert_eq!(block_limits(&s.decisions), [(0, 1)]);
        assert!(s.decisions.iter().any(
            |d| matches!(d, Decision::Override { action, .. } if *action == OverrideAction::Block)
        ));
    }
    assert!(
        blocked(&e)
            .iter()
            .all(|(_, _, source)| *source == BlockSource::Operator)
    );
    // With only operators' blocks held, another is refused, and says so.
    let s = e.step(block("http://o3:1"), T0);
    assert_eq!(block_limits(&s.decisions), [(1, 0)]);
    assert!(
        !s.decisions
            .iter()
            .any(|d| matches!(d, Decision::Override { .. }))
    );
    assert_eq!(e.state().blocks.len(), 2);
    // A refusal is one decision per step, however many blocks it turned away.
    let mut e2 = engine({
        let mut c = base_config();
        c.blocking.max_blocks = 1;
        c
    });
    let flood: Vec<EndpointReport> = (0..500).map(|i| fail(&format!("http://x{i}:1"))).collect();
    let s = e2.step(report("gw", flood), T0);
    assert_eq!(block_limits(&s.decisions), [(499, 0)]);
}

#[test]
fn the_new_limits_are_checked_with_their_paths() {
    let mut c = base_config();
    c.blocking.max_blocks = 0;
    c.blocking.fleet.max_endpoints = 100_001;
    let paths: Vec<String> = c.validate().into_iter().map(|p| p.path).collect();
    assert!(
        paths.contains(&"blocking.max_blocks".to_owned()),
        "{paths:?}"
    );
    assert!(
        paths.contains(&"blocking.fleet.max_endpoints".to_owned()),
        "{paths:?}"
    );
}

/// Something a hostile or broken fleet does.
#[derive(Debug, Clone)]
enum Op {
    /// A gateway reports (endpoint index, model index, successes, failures, run) entries.
    Report(u8, Vec<(u8, u8, u8, u8, u8)>),
    /// An operator blocks endpoint n.
    Block(u8),
    /// An alert blocks endpoint n.
    AlertBlock(u8),
    /// Time passes, in seconds.
    Wait(u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (any::<u8>(), prop::collection::vec(
            (any::<u8>(), 0u8..3, 0u8..4, 0u8..8, 0u8..8), 0..40))
            .prop_map(|(g, es)| Op::Report(g, es)),
        1 => any::<u8>().prop_map(Op::Block),
        1 => any::<u8>().prop_map(Op::AlertBlock),
        2 => (0u8..90).prop_map(Op::Wait),
    ]
}

const MODELS: [&str; 3] = ["qwen-72b", "qwen-14b", "unknown"];
const MAX_BLOCKS: usize = 6;
const MAX_ENDPOINTS: usize = 5;

fn to_input(op: &Op) -> Option<Input> {
    Some(match op {
        Op::Report(g, es) => report(
            &format!("gw-{}", g % 40),
            es.iter()
                .map(|(ep, m, ok, failed, run)| {
                    // Endpoints a1 and b1 are listed for qwen-72b; the rest are not.
                    let endpoint = match ep % 24 {
                        0 => "a1:8000".to_owned(),
                        1 => "http://b1:8000".to_owned(),
                        n => format!("http://e{n}:1"),
                    };
                    entry(
                        &endpoint,
                        MODELS[*m as usize],
                        u64::from(*ok),
                        u64::from(*failed),
                        u32::from(*run),
                    )
                })
                .collect(),
        ),
        Op::Block(n) => Input::Command {
            command: Command::Block {
                endpoint: format!("http://o{}:1", n % 10),
                model: None,
                ttl: None,
                reason: "by hand".into(),
            },
        },
        Op::AlertBlock(n) => block_alert(
            &format!("Down{}", n % 10),
            &format!("http://al{}:1", n % 10),
        ),
        Op::Wait(_) => return None,
    })
}

/// Every bound the engine promises over what reports can make it hold.
fn check_bounds(e: &Engine) -> Result<(), TestCaseError> {
    let s = e.state();
    prop_assert!(s.blocks.len() <= MAX_BLOCKS, "blocks {}", s.blocks.len());
    let unlisted = s
        .fleet
        .keys()
        .filter(|k| k.model.as_deref() != Some("qwen-72b"))
        .count();
    prop_assert!(unlisted <= MAX_ENDPOINTS, "unlisted pairs {unlisted}");
    for (key, stats) in &s.fleet {
        prop_assert!(key.model.as_deref() != Some("unknown"));
        if key.model.as_deref() == Some("qwen-72b") {
            prop_assert!(
                ["a1:8000", "http://b1:8000"].contains(&key.endpoint.as_str()),
                "{key}"
            );
        }
        prop_assert!(stats.samples.len() as u64 <= FleetStats::SLOTS + 1);
        prop_assert!(stats.streaks.len() <= FleetStats::MAX_STREAKS);
        prop_assert!(stats.streaks.values().all(|s| s.run > 0));
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Whatever the fleet sends, the engine holds no more than its bounds, and the
    /// trimmed report it journals steps to exactly the state the whole one does.
    #[test]
    fn reports_are_bounded_and_trimming_them_changes_nothing(
        ops in prop::collection::vec(op(), 1..60),
    ) {
        let mut c = listed_config();
        c.models.get_mut("qwen-72b").expect("model").pools = vec![
            PoolConfig::Full { name: "dc-a".into(), endpoints: vec!["a1:8000".into()] },
            PoolConfig::Full { name: "dc-b".into(), endpoints: vec!["b1:8000".into()] },
        ];
        c.blocking.max_blocks = MAX_BLOCKS;
        c.blocking.fleet.max_endpoints = MAX_ENDPOINTS;
        let mut whole = engine(c.clone());
        let mut trimmed = engine(c);
        let mut now = T0;
        for op in &ops {
            if let Op::Wait(s) = op {
                now = now + Duration::from_secs(u64::from(*s));
                whole.step(Input::Tick, now);
                trimmed.step(Input::Tick, now);
            } else if let Some(input) = to_input(op) {
                let (admitted, _) = trimmed.admit(input.clone());
                let a = whole.step(input, now);
                let b = trimmed.step_admitted(admitted, now);
                prop_assert_eq!(a.decisions, b.decisions);
            }
            prop_assert_eq!(whole.state(), trimmed.state());
            check_bounds(&whole)?;
        }
    }
}

/// Every field of a block at its bound, as many blocks as the largest
/// `blocking.max_blocks` allows: the table is still one every watch transport carries.
#[test]
fn the_largest_table_the_limits_allow_is_one_every_transport_carries() {
    use stanch_api::routes::{MAX_ENDPOINT_BYTES, MAX_MODEL_BYTES, MAX_TABLE_BYTES};
    use stanch_core::config::MAX_BLOCKS;

    // Quotes double in JSON; four-byte characters are the longest per character.
    let model = "\"".repeat(MAX_MODEL_BYTES);
    let mut c = base_config();
    let served = c.models["qwen-14b"].clone();
    c.models.insert(model.clone(), served);
    c.blocking.max_blocks = MAX_BLOCKS;
    c.alerts.max_active = 2 * MAX_BLOCKS;
    c.alerts.max_bytes = *stanch_core::config::ALERT_BYTES_RANGE.end();
    assert_eq!(c.validate(), []);
    let mut e = engine(c);
    // As long as the intake lets a label value be.
    let alertname = "𝄞\"".repeat(stanch_api::alerts::MAX_LABEL_VALUE / 5);
    let alerts = (0..MAX_BLOCKS + 100)
        .map(|i| {
            let endpoint = format!("{i:08}{}", "\"".repeat(MAX_ENDPOINT_BYTES - 8));
            AlertBuilder::firing(&alertname)
                .label("action", "block-endpoint")
                .label("endpoint", &endpoint)
                .label("target_model", &model)
                .at(T0)
                .build()
        })
        .collect();
    let s = e.step(Input::Alerts { alerts }, T0);
    assert_eq!(block_limits(&s.decisions), [(100, 0)]);
    assert_eq!(e.state().blocks.len(), MAX_BLOCKS);
    let json = serde_json::to_vec(&e.route_table()).expect("serializes");
    eprintln!("the largest table: {} bytes", json.len());
    assert!(
        json.len() <= MAX_TABLE_BYTES / 2,
        "{} bytes against {MAX_TABLE_BYTES}",
        json.len()
    );
}

#[test]
fn an_alert_naming_an_endpoint_no_block_could_carry_maps_to_nothing() {
    let mut e = engine(base_config());
    for endpoint in ["x".repeat(513), "a\nb".to_owned()] {
        let s = e.step(block_alert("Down", &endpoint), T0);
        assert!(
            s.decisions.iter().any(|d| matches!(
                d,
                Decision::AlertActive { unmapped: Some(why), .. } if why.contains("endpoint")
            )),
            "{:?}",
            s.decisions
        );
        assert!(e.state().blocks.is_empty());
    }
}
