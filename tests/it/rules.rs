//! The alerting rules: the Operator manifest carries exactly the plain file's groups,
//! and every healing rule raises an action the engine understands. The rules' logic is
//! tested by `promtool test rules` in scripts/test.sh.

use serde_yaml::Value;

fn load(path: &str) -> Value {
    let full = format!("{}/{path}", env!("CARGO_MANIFEST_DIR"));
    serde_yaml::from_str(&std::fs::read_to_string(&full).unwrap())
        .unwrap_or_else(|e| panic!("{full}: {e}"))
}

#[test]
fn the_prometheusrule_manifest_matches_the_rule_file() {
    let plain = load("rules/stanch.rules.yml");
    let manifest = load("rules/stanch-prometheusrule.yaml");
    assert_eq!(manifest["kind"], "PrometheusRule");
    assert_eq!(
        manifest["spec"], plain,
        "rules/stanch-prometheusrule.yaml drifted: run scripts/gen-prometheusrule.py"
    );
}

#[test]
fn healing_rules_speak_the_action_convention() {
    let plain = load("rules/stanch.rules.yml");
    let heal = plain["groups"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|g| g["name"] == "stanch-heal")
        .unwrap();
    let actions: Vec<&str> = heal["rules"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(|r| r["labels"]["action"].as_str())
        .collect();
    for action in [
        "trigger-failover",
        "trigger-model-degradation",
        "trigger-static-fallback",
        "block-endpoint",
    ] {
        assert!(actions.contains(&action), "no rule raises {action}");
        assert!(action.parse::<stanch_core::Action>().is_ok());
    }
}
