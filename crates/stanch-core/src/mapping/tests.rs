//! The tests of `mapping`.

use super::*;
use crate::rules::BadMatcher;

fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn mapper(extra: &str) -> Mapper {
    let yaml = format!(
        "models:\n  qwen-72b: {{pools: [dc-a, dc-b], fallback: qwen-14b}}\n  qwen-14b: {{pools: [dc-a]}}\n{extra}"
    );
    Mapper::new(&Config::from_yaml(&yaml).unwrap())
}

#[test]
fn seed_convention() {
    let m = mapper("");
    assert_eq!(
        m.map(&labels(&[
            ("action", "trigger-failover"),
            ("target_model", "qwen-72b"),
            ("pool", "dc-a")
        ])),
        Ok(Condition::PoolDown {
            model: "qwen-72b".into(),
            pool: "dc-a".into(),
            shift: ALL,
        })
    );
    assert_eq!(
        m.map(&labels(&[
            ("action", "trigger-model-degradation"),
            ("target_model", "qwen-72b"),
            ("fallback_model", "qwen-14b")
        ])),
        Ok(Condition::Saturated {
            model: "qwen-72b".into(),
            fallback: Some("qwen-14b".into())
        })
    );
    assert_eq!(
        m.map(&labels(&[
            ("action", "block-endpoint"),
            ("endpoint", "10.0.0.1:8000")
        ])),
        Ok(Condition::BlockEndpoint {
            endpoint: "10.0.0.1:8000".into(),
            model: None
        })
    );
}

#[test]
fn unmapped_says_why() {
    let m = mapper("");
    let why = |l: &[(&str, &str)]| m.map(&labels(l)).unwrap_err().0;
    assert!(why(&[("alertname", "X")]).contains("no action label"));
    assert!(why(&[("action", "reboot")]).contains("unknown action"));
    assert!(why(&[("action", "trigger-failover")]).contains("needs the label target_model"));
    assert!(
        why(&[("action", "trigger-failover"), ("target_model", "gpt-9")])
            .contains("not configured")
    );
    assert!(
        why(&[
            ("action", "trigger-failover"),
            ("target_model", "qwen-72b"),
            ("pool", "dc-z")
        ])
        .contains("not a pool of qwen-72b")
    );
    assert_eq!(
        m.map(&labels(&[
            ("action", "trigger-failover"),
            ("target_model", "qwen-72b")
        ])),
        Ok(Condition::PoolDown {
            model: "qwen-72b".into(),
            pool: "dc-a".into(),
            shift: ALL,
        }),
        "no pool label means the primary"
    );
}

#[test]
fn a_failover_moves_the_share_its_alert_or_mapping_asks_for() {
    let m = mapper(
        r#"mappings:
  - name: slow
    matchers: ['alertname="SlowPool"']
    action: trigger-failover
    target_model_label: model_name
    pool_label: dc
    shift: 75
  - name: slow-by-label
    matchers: ['alertname="SlowPoolLabelled"']
    action: trigger-failover
    target_model_label: model_name
    shift_label: move
"#,
    );
    let down = |pool: &str, shift| {
        Ok(Condition::PoolDown {
            model: "qwen-72b".into(),
            pool: pool.into(),
            shift,
        })
    };
    let seed = |shift: &str| {
        m.map(&labels(&[
            ("action", "trigger-failover"),
            ("target_model", "qwen-72b"),
            ("shift", shift),
        ]))
    };
    assert_eq!(seed("75"), down("dc-a", 75));
    assert_eq!(seed("75%"), down("dc-a", 75));
    assert_eq!(seed(" 30 % "), down("dc-a", 30));
    assert_eq!(seed("100"), down("dc-a", ALL));
    assert_eq!(seed(""), down("dc-a", ALL), "an empty label is no label");
    for bad in ["0", "101", "-5", "75.5", "most", "%", "1e2"] {
        let why = seed(bad).unwrap_err().0;
        assert!(
            why.contains(&format!("shift {bad:?} is not a percentage from 1 to 100")),
            "{bad}: {why}"
        );
    }
    assert_eq!(
        m.map(&labels(&[
            ("alertname", "SlowPool"),
            ("model_name", "qwen-72b"),
            ("dc", "dc-b")
        ])),
        down("dc-b", 75)
    );
    assert_eq!(
        m.map(&labels(&[
            ("alertname", "SlowPoolLabelled"),
            ("model_name", "qwen-72b"),
            ("move", "40%")
        ])),
        down("dc-a", 40)
    );
    assert_eq!(
        m.map(&labels(&[
            ("alertname", "SlowPoolLabelled"),
            ("model_name", "qwen-72b")
        ])),
        down("dc-a", ALL),
        "without the label, everything moves"
    );
    // Only the failover reads a shift; elsewhere the label means nothing.
    assert_eq!(
        m.map(&labels(&[
            ("action", "trigger-static-fallback"),
            ("target_model", "qwen-72b"),
            ("shift", "most"),
        ])),
        Ok(Condition::Static {
            model: "qwen-72b".into()
        })
    );
    // Kept across the journal: a condition written before shifts existed reads as
    // moving everything, and one moving everything is written as it was.
    let old: Condition =
        serde_json::from_str(r#"{"kind": "pool_down", "model": "qwen-72b", "pool": "dc-a"}"#)
            .unwrap();
    assert_eq!(Ok(old.clone()), down("dc-a", ALL));
    assert_eq!(
        serde_json::to_string(&old).unwrap(),
        r#"{"kind":"pool_down","model":"qwen-72b","pool":"dc-a"}"#
    );
    assert_eq!(
        down("dc-a", 75).unwrap().to_string(),
        "qwen-72b pool dc-a slow: 75% of its traffic to move"
    );
}

#[test]
fn configured_rules_map_existing_alerts() {
    let m = mapper(
        r#"mappings:
  - name: kv-cache
    matchers: ['alertname="VLLMKVCacheFull"', 'model_name=~"qwen-7.*"']
    action: trigger-model-degradation
    target_model_label: model_name
  - name: bad-endpoint
    matchers: ['alertname="EndpointErrors"', 'env!="dev"']
    action: block-endpoint
    endpoint_label: instance
"#,
    );
    assert_eq!(
        m.map(&labels(&[
            ("alertname", "VLLMKVCacheFull"),
            ("model_name", "qwen-72b")
        ])),
        Ok(Condition::Saturated {
            model: "qwen-72b".into(),
            fallback: None
        })
    );
    assert!(
        m.map(&labels(&[
            ("alertname", "VLLMKVCacheFull"),
            ("model_name", "qwen-14b")
        ]))
        .is_err()
    );
    assert_eq!(
        m.map(&labels(&[
            ("alertname", "EndpointErrors"),
            ("instance", "h:1")
        ])),
        Ok(Condition::BlockEndpoint {
            endpoint: "h:1".into(),
            model: None
        })
    );
    assert!(
        m.map(&labels(&[
            ("alertname", "EndpointErrors"),
            ("instance", "h:1"),
            ("env", "dev")
        ]))
        .is_err()
    );
}

#[test]
fn matcher_syntax() {
    assert!(
        Matcher::parse("alertname=\"A\"")
            .unwrap()
            .matches(&labels(&[("alertname", "A")]))
    );
    assert!(
        Matcher::parse("x!~\"a|b\"")
            .unwrap()
            .matches(&labels(&[("x", "c")]))
    );
    assert!(
        !Matcher::parse("x=~\"a\"")
            .unwrap()
            .matches(&labels(&[("x", "ab")])),
        "anchored"
    );
    assert!(Matcher::parse("no operator").is_err());
    assert!(Matcher::parse("=\"v\"").is_err());
    assert!(matches!(
        Matcher::parse("x=~\"(\""),
        Err(BadMatcher::Regex { .. })
    ));
}
