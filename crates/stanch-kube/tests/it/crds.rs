//! The CRDs committed under `charts/stanch/crds/` are exactly what the types generate,
//! and the resources carry what they promise.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde_json::Value;
use stanch_api::{BlockedEndpoint, ModelRoute, RouteTable, Rung, Timestamp};
use stanch_kube::crd::{StanchPolicy, StanchRouteTableStatus};
use stanch_kube::policy::Policy;

fn committed() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../charts/stanch/crds"
    ))
}

/// Regenerate with `cargo run -- crdgen --out charts/stanch/crds`.
#[test]
fn the_committed_crds_are_what_the_types_generate() {
    let crds = stanch_kube::crds();
    for (file, crd) in &crds {
        let on_disk = std::fs::read_to_string(committed().join(file)).unwrap_or_else(|e| {
            panic!("{file}: {e}; run `stanch crdgen --out charts/stanch/crds`")
        });
        assert!(
            on_disk == stanch_kube::crd_yaml(crd),
            "{file} differs from what the types generate: run `stanch crdgen --out charts/stanch/crds`"
        );
    }
    let mut files: Vec<String> = std::fs::read_dir(committed())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    let mut expected: Vec<String> = crds.iter().map(|(f, _)| (*f).to_owned()).collect();
    expected.sort();
    assert_eq!(files, expected, "no CRD file the types do not make");
}

/// Every schema node says its type (a structural schema, as the API server requires),
/// and the rules that span fields are there for the API server to enforce.
#[test]
fn the_schemas_are_structural_and_carry_their_rules() {
    fn walk(path: &str, node: &Value, untyped: &mut Vec<String>) {
        let Some(obj) = node.as_object() else { return };
        let typed = obj.contains_key("type") || obj.contains_key("x-kubernetes-int-or-string");
        if !typed
            && (obj.contains_key("properties")
                || obj.contains_key("items")
                || obj.contains_key("description"))
        {
            untyped.push(path.to_owned());
        }
        for (key, child) in obj {
            match key.as_str() {
                "properties" | "additionalProperties" => {
                    if let Some(props) = child.as_object().filter(|_| key == "properties") {
                        for (name, p) in props {
                            walk(&format!("{path}.{name}"), p, untyped);
                        }
                    } else {
                        walk(&format!("{path}.*"), child, untyped);
                    }
                }
                "items" => walk(&format!("{path}[]"), child, untyped),
                _ => {}
            }
        }
    }
    for (file, crd) in stanch_kube::crds() {
        let crd = serde_json::to_value(&crd).unwrap();
        let schema = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
        let mut untyped = Vec::new();
        walk("", schema, &mut untyped);
        assert!(
            untyped.is_empty(),
            "{file}: untyped schema nodes {untyped:?}"
        );
        assert_eq!(
            crd["spec"]["versions"][0]["subresources"]["status"],
            serde_json::json!({}),
            "{file}: status subresource"
        );
    }
    let policy = serde_json::to_value(stanch_kube::crds()[0].1.clone()).unwrap();
    let spec = &policy["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
    let rules: Vec<&str> = spec["x-kubernetes-validations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["rule"].as_str().unwrap())
        .collect();
    assert!(
        rules
            .iter()
            .any(|r| r.contains("self.fallback != self.model")),
        "{rules:?}"
    );
    assert!(
        rules.iter().any(|r| r.contains("q.name == p.name")),
        "{rules:?}"
    );
    // The CEL rules' cost is bounded by the lists' lengths.
    assert_eq!(spec["properties"]["pools"]["maxItems"], 16);
    // Names become metric labels and log fields: the API server refuses control
    // characters in them, as the controller's configuration does.
    for name in [
        &spec["properties"]["model"],
        &spec["properties"]["fallback"],
        &spec["properties"]["pools"]["items"]["properties"]["name"],
    ] {
        let pattern = regex::Regex::new(name["pattern"].as_str().expect("a pattern")).unwrap();
        for good in ["qwen-72b", "Qwen/Qwen2.5-72B-Instruct", "模型 1"] {
            assert!(pattern.is_match(good), "{good}");
        }
        for bad in ["a\nb", "a\u{1b}[2J", "tab\there", "del\u{7f}", ""] {
            assert!(!pattern.is_match(bad), "{bad:?}");
        }
    }
}

/// The route-table resource's status is the table as the HTTP watch serves it:
/// the same JSON, field for field.
#[test]
fn the_route_table_status_is_the_table_as_the_watch_serves_it() {
    let t = Timestamp::from_millis(1_764_460_800_000);
    let models = BTreeMap::from([(
        "qwen-72b".to_owned(),
        ModelRoute {
            rung: Rung::Failover,
            pool: "dc-b".into(),
            alias: None,
            alias_exempt: vec!["vip".into()],
            faq: Some("default".into()),
            since: t,
            lease_until: t + std::time::Duration::from_secs(120),
            reason: "pool dc-a failing".into(),
            alerts: vec![],
            overridden: false,
            shares: Vec::new(),
            alias_percent: None,
        },
    )]);
    let blocked = vec![BlockedEndpoint {
        endpoint: "10.0.0.7:8000".into(),
        model: None,
        until: t,
        reason: "fleet".into(),
    }];
    let table = RouteTable {
        version: 42,
        epoch: "e1".into(),
        hash: RouteTable::content_hash(&models, &blocked),
        generated_at: t,
        models,
        blocked,
    };
    let status = StanchRouteTableStatus {
        table: Some(table.clone()),
    };
    let json = serde_json::to_value(&status).unwrap();
    assert_eq!(json["table"], serde_json::to_value(&table).unwrap());
    let back: StanchRouteTableStatus = serde_json::from_value(json).unwrap();
    assert_eq!(back.table, Some(table));
}

/// A policy as an operator writes it reads as the model's configuration.
#[test]
fn a_policy_resource_reads_as_the_models_configuration() {
    let resource: StanchPolicy = serde_yaml::from_str(
        r#"
apiVersion: stanch.dev/v1alpha1
kind: StanchPolicy
metadata: {name: qwen-72b, namespace: monitoring}
spec:
  model: qwen-72b
  pools:
    - {name: dc-a, endpoints: ["10.1.0.5:8000"]}
    - {name: dc-b}
  fallback: qwen-14b
  faq: default
  ladder: {recoverAfter: 2m, minDwell: 30s}
  mappings:
    - name: pool-down
      matchers: ['alertname="PoolDown"']
      action: trigger-failover
      poolLabel: pool
"#,
    )
    .unwrap();
    let base = stanch_core::Config::default_config();
    let policy = Policy::check(&resource.spec, &base).unwrap_or_else(|p| panic!("{p:?}"));
    assert_eq!(policy.config.pools.len(), 2);
    assert_eq!(policy.mappings[0].pool_label.as_deref(), Some("pool"));
}

/// The Python with the validators: `STANCH_TEST_PYTHON` (which `scripts/test.sh`
/// sets), else the virtual environment `scripts/install-test-deps.sh` makes.
fn python() -> PathBuf {
    let venv = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../target/test-venv/bin/python"
    ));
    match std::env::var_os("STANCH_TEST_PYTHON") {
        Some(p) => PathBuf::from(p),
        None if venv.exists() => venv,
        None => panic!(
            "STANCH_TEST_PYTHON is not set: run scripts/test.sh (it installs kubernetes-validate \
             and jsonschema in a virtual environment)"
        ),
    }
}

/// The committed CRDs pass Kubernetes' own schema for a CustomResourceDefinition
/// (kubernetes-validate, for the oldest Kubernetes the CRDs are for), the example
/// resources pass the CRDs' schemas, and resources the schemas must refuse are
/// refused.
#[test]
fn the_crds_pass_kubernetes_schemas_and_hold_resources_to_theirs() {
    let fixtures = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures"));
    let out = std::process::Command::new(python())
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/validate.py"))
        .arg(committed())
        .arg("1.33.0")
        .arg(fixtures.join("policy-qwen-72b.yaml"))
        .arg(fixtures.join("routetable.yaml"))
        .arg("--invalid")
        .arg(fixtures.join("policies-invalid.yaml"))
        .output()
        .expect("python runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    assert_eq!(text.matches(": refused:").count(), 5, "{text}");
    assert_eq!(text.matches("valid against its CRD").count(), 2, "{text}");
}

/// The example policy the schema accepts is one the controller accepts too.
#[test]
fn the_example_policy_is_one_the_controller_takes() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/policy-qwen-72b.yaml"
    ))
    .unwrap();
    let resource: StanchPolicy = serde_yaml::from_str(&text).unwrap();
    let policy = Policy::check(&resource.spec, &stanch_core::Config::default_config())
        .unwrap_or_else(|p| panic!("{p:?}"));
    assert_eq!(policy.mappings.len(), 2);
}
