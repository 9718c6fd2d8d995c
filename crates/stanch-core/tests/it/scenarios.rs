//! Scenario files in `tests/scenarios/*.scenario`, each checked against its
//! `.expected` snapshot. Refresh snapshots with `UPDATE_EXPECT=1 cargo test -p stanch-core`.

use std::path::PathBuf;

use crate::harness;

fn check(name: &str) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/scenarios");
    let text = std::fs::read_to_string(dir.join(format!("{name}.scenario"))).unwrap();
    let actual = harness::run(&text);
    expect_test::expect_file![dir.join(format!("{name}.expected"))].assert_eq(&actual);
}

macro_rules! scenarios {
    ($($name:ident),* $(,)?) => {
        $( #[test] fn $name() { check(stringify!($name)); } )*
        const LISTED: &[&str] = &[$(stringify!($name)),*];
    };
}

#[test]
fn every_scenario_file_is_listed() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/scenarios");
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "scenario") {
            let name = path.file_stem().unwrap().to_str().unwrap().to_owned();
            assert!(
                LISTED.contains(&name.as_str()),
                "{name}.scenario is not in scenarios!()"
            );
        }
    }
}

scenarios!(
    failover_and_recovery,
    verified_ladder_skips_unhealthy_targets,
    degradation_keeps_vip_and_recovers_one_rung_at_a_time,
    static_when_everything_fails,
    flap_guard_pins,
    a_model_recovers_by_its_own_timings,
    a_policy_changed_mid_incident,
    backoff_doubles_recover_after,
    prometheus_alerts_expire,
    duplicates_and_out_of_order,
    overrides,
    dry_run,
    endpoint_blocks,
    reconciliation,
    unmapped_alerts,
    fleet_reports,
    fleet_streaks_are_held_to_their_failures,
    a_slow_pool_keeps_a_share,
    a_slow_pool_alone_keeps_its_traffic,
    shares_flapping_are_pinned,
    a_split_applies_under_an_override,
    failback_returns_in_gated_steps,
    failback_aborts,
    failback_from_degraded,
    failback_skipped_and_aborted_by_an_operator,
);
