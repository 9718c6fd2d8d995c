//! The Helm chart (`charts/stanch`), rendered by the real `helm` and read back: what
//! an SRE relies on when installing it next to kube-prometheus-stack. The manifests
//! are validated against Kubernetes' schemas (`kubernetes-validate`) and the
//! Prometheus Operator's (its published validators); the configuration files the chart
//! writes are checked by the binaries that read them; the RBAC it grants is compared
//! with what the controller asks of an API server.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::{Value, json};

pub(crate) const CHART: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/charts/stanch");
pub(crate) const NS: &str = "monitoring";

/// A tool `scripts/install-test-deps.sh` puts under `target/`: `env` names its
/// override.
pub(crate) fn tool(env: &str, under_target: &str) -> PathBuf {
    if let Some(p) = std::env::var_os(env) {
        return PathBuf::from(p);
    }
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("target")
        .join(under_target);
    assert!(
        p.exists(),
        "{} is missing: run scripts/install-test-deps.sh (or set {env})",
        p.display()
    );
    p
}

pub(crate) fn helm() -> PathBuf {
    tool("STANCH_TEST_HELM", "test-tools/bin/helm")
}

pub(crate) fn venv_bin(name: &str) -> PathBuf {
    match std::env::var_os("STANCH_TEST_PYTHON") {
        Some(p) => Path::new(&p).with_file_name(name),
        None => tool("STANCH_TEST_VENV_BIN", &format!("test-venv/bin/{name}")),
    }
}

/// A command's standard output, then its standard error.
pub(crate) fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `helm template stanch charts/stanch -n monitoring` with these arguments: the
/// output, or helm's error.
pub(crate) fn try_render(args: &[&str]) -> Result<String, String> {
    let out = Command::new(helm())
        .args(["template", "stanch", CHART, "--namespace", NS])
        .args(args)
        .output()
        .expect("helm runs");
    if out.status.success() {
        Ok(String::from_utf8(out.stdout).unwrap())
    } else {
        Err(text(&out))
    }
}

/// The rendered objects.
pub(crate) fn render(args: &[&str]) -> Vec<Value> {
    let yaml = try_render(args).unwrap_or_else(|e| panic!("helm template {args:?}: {e}"));
    parse(&yaml)
}

fn parse(yaml: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(yaml)
        .map(|doc| {
            let v: serde_yaml::Value = serde::Deserialize::deserialize(doc).expect("YAML");
            serde_json::to_value(v).expect("JSON-like YAML")
        })
        .filter(|v: &Value| !v.is_null())
        .collect()
}

/// Every values file the chart is tested with: none (the defaults), every option on,
/// and each documented example.
fn values_files() -> Vec<Vec<String>> {
    let mut all = vec![
        vec![],
        vec![
            "-f".to_owned(),
            format!("{CHART}/ci/all-options-values.yaml"),
        ],
    ];
    let mut examples: Vec<PathBuf> = std::fs::read_dir(format!("{CHART}/examples"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    examples.sort();
    assert!(examples.len() >= 4, "the documented examples: {examples:?}");
    for e in examples {
        all.push(vec!["-f".to_owned(), e.display().to_string()]);
    }
    all
}

fn as_args(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn of_kind<'a>(objects: &'a [Value], kind: &str) -> Vec<&'a Value> {
    objects.iter().filter(|o| o["kind"] == kind).collect()
}

fn one<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

/// The pod templates of every workload, with the workload's name.
fn pods(objects: &[Value]) -> Vec<(String, &Value)> {
    of_kind(objects, "Deployment")
        .into_iter()
        .map(|d| {
            (
                d["metadata"]["name"].as_str().unwrap().to_owned(),
                &d["spec"]["template"]["spec"],
            )
        })
        .collect()
}

#[test]
fn helm_lint_strict_passes_with_every_values_file() {
    for values in values_files() {
        let out = Command::new(helm())
            .args(["lint", "--strict", CHART])
            .args(&values)
            .output()
            .unwrap();
        assert!(out.status.success(), "{values:?}: {}", text(&out));
    }
}

/// The manifests of every values file and the CRDs pass Kubernetes' schemas with
/// unknown fields refused, for the oldest Kubernetes the chart supports and a current
/// one; the Prometheus Operator's kinds pass its validators. The validators are first
/// shown to refuse what they must, so a pass means something.
#[test]
fn rendered_manifests_pass_the_kubernetes_and_operator_schemas() {
    let dir = tempfile::tempdir().unwrap();
    let validate = |files: &[PathBuf], version: &str| {
        Command::new(venv_bin("kubernetes-validate"))
            .args(["--strict", "--quiet", "--no-warn", "-k", version])
            .args(files)
            .output()
            .expect("kubernetes-validate runs")
    };
    // A typo in a container's field, and a wrong type, are refused.
    let mut bad = render(&[]);
    let deployment = bad.iter_mut().find(|o| o["kind"] == "Deployment").unwrap();
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"]["periodSecond"] =
        json!(5);
    let typo = dir.path().join("typo.yaml");
    std::fs::write(&typo, serde_yaml::to_string(deployment).unwrap()).unwrap();
    assert!(!validate(&[typo], "1.27.0").status.success());

    let mut files = vec![];
    for (i, values) in values_files().iter().enumerate() {
        let path = dir.path().join(format!("render-{i}.yaml"));
        std::fs::write(&path, try_render(&as_args(values)).unwrap()).unwrap();
        files.push(path);
    }
    for crd in std::fs::read_dir(format!("{CHART}/crds")).unwrap() {
        files.push(crd.unwrap().path());
    }
    for version in ["1.27.0", "1.33.0"] {
        let out = validate(&files, version);
        assert!(out.status.success(), "Kubernetes {version}: {}", text(&out));
    }

    // The Prometheus Operator's kinds, from every render.
    let mut operator = vec![];
    for values in values_files() {
        for o in render(&as_args(&values)) {
            if o["apiVersion"]
                .as_str()
                .is_some_and(|v| v.starts_with("monitoring.coreos.com/"))
            {
                operator.push(o);
            }
        }
    }
    let kinds: BTreeSet<&str> = operator.iter().filter_map(|o| o["kind"].as_str()).collect();
    assert_eq!(
        kinds,
        BTreeSet::from(["AlertmanagerConfig", "PrometheusRule", "ServiceMonitor"])
    );
    let mut wrong = operator
        .iter()
        .find(|o| o["kind"] == "ServiceMonitor")
        .unwrap()
        .clone();
    wrong["spec"]["endpoints"][0]["port"] = json!(9797);
    wrong["metadata"]["name"] = json!("must-be-refused");
    operator.push(wrong);
    let input = dir.path().join("operator.json");
    std::fs::write(&input, serde_json::to_vec(&operator).unwrap()).unwrap();
    let out = Command::new("node")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/chart/validate-operator.mjs"
        ))
        .arg(&input)
        .env(
            "NODE_PATH",
            tool("STANCH_TEST_NODE_MODULES", "test-tools/node/node_modules"),
        )
        .output()
        .expect("node runs");
    let report = text(&out);
    assert!(out.status.success(), "{report}");
    assert_eq!(report.matches(": refused:").count(), 1, "{report}");
    assert!(
        report.contains("ServiceMonitor must-be-refused: refused:"),
        "{report}"
    );
    assert_eq!(
        report.matches(": valid").count(),
        operator.len() - 1,
        "{report}"
    );
}

/// A typo, a wrong type or an absurd value in the values fails `helm template` (and so
/// `helm install`) and names what was wrong.
#[test]
fn a_values_typo_fails_and_names_the_key() {
    for (set, says) in [
        ("replica=3", "'replica' not allowed"),
        ("gateway.replicaz=2", "'replicaz' not allowed"),
        ("serviceMonitor.enable=true", "'enable' not allowed"),
        ("config.modles.x.pools={a}", "'modles' not allowed"),
        ("store=disk", "store"),
        ("replicas=0", "replicas"),
        ("leaseDuration=15", "leaseDuration"),
        (
            "securityContext.readOnlyRootFileSystem=true",
            "'readOnlyRootFileSystem' not allowed",
        ),
    ] {
        let err = try_render(&["--set", set]).expect_err(set);
        assert!(err.contains(says), "--set {set}: {err}");
    }
}

#[test]
fn replicas_with_a_store_they_cannot_share_are_refused_with_why() {
    let err = try_render(&["--set", "store=file"]).unwrap_err();
    assert!(
        err.contains("only store: kubernetes shares state between replicas"),
        "{err}"
    );
    let err = try_render(&["--set", "store=memory,replicas=3"]).unwrap_err();
    assert!(err.contains("replicas is 3"), "{err}");
    // The chart's own parts of the files are not the user's to set.
    let err = try_render(&["--set", "config.auth.admin_token_file=/x"]).unwrap_err();
    assert!(
        err.contains("at '/config': additional properties 'auth' not allowed"),
        "{err}"
    );
    let err = try_render(&["--set", "gateway.config.controller.url=http://x"]).unwrap_err();
    assert!(
        err.contains("additional properties 'controller' not allowed"),
        "{err}"
    );
    let err = try_render(&["--set", "gateway.enabled=true"]).unwrap_err();
    assert!(err.contains("gateway.config.models is empty"), "{err}");
    let err = try_render(&["--set", "persistence.enabled=true"]).unwrap_err();
    assert!(
        err.contains("persistence.enabled is true but store is \"kubernetes\""),
        "{err}"
    );
    assert!(try_render(&["--set", "store=file,replicas=1"]).is_ok());
}

/// Every container of every values file runs as non-root on a read-only root, with no
/// capabilities, no privilege escalation, the runtime's seccomp profile, and requests
/// and limits.
#[test]
fn every_container_is_locked_down() {
    for values in values_files() {
        let objects = render(&as_args(&values));
        let pods = pods(&objects);
        assert!(!pods.is_empty());
        for (name, pod) in pods {
            let at = format!("{values:?} {name}");
            assert_eq!(pod["securityContext"]["runAsNonRoot"], true, "{at}");
            assert_eq!(
                pod["securityContext"]["seccompProfile"]["type"], "RuntimeDefault",
                "{at}"
            );
            assert_ne!(pod["securityContext"]["runAsUser"], 0, "{at}");
            let containers = pod["containers"].as_array().unwrap();
            assert!(pod.get("initContainers").is_none(), "{at}");
            for c in containers {
                let sc = &c["securityContext"];
                assert_eq!(sc["readOnlyRootFilesystem"], true, "{at}");
                assert_eq!(sc["allowPrivilegeEscalation"], false, "{at}");
                assert_eq!(sc["runAsNonRoot"], true, "{at}");
                assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]), "{at}");
                assert!(sc.get("privileged").is_none_or(|p| p == false), "{at}");
                for k in ["requests", "limits"] {
                    assert!(c["resources"][k]["cpu"].is_string(), "{at} {k}");
                    assert!(c["resources"][k]["memory"].is_string(), "{at} {k}");
                }
            }
        }
    }
}

/// Probes reach routes each binary serves: /healthz and /readyz of the controller's
/// router, /healthz of the gateway's, on the container's named port. (The image test
/// runs both with the chart's arguments and calls them.)
#[test]
fn probes_point_at_real_routes_on_the_container_port() {
    let objects = render(&["-f", &format!("{CHART}/examples/with-gateway.yaml")]);
    let controller_routes = include_str!("../../crates/stanch-server/src/api/mod.rs");
    let gateway_routes = include_str!("../../crates/stanch-gateway/src/front.rs");
    for (name, pod) in pods(&objects) {
        let routes = if name.ends_with("-gateway") {
            gateway_routes
        } else {
            controller_routes
        };
        let c = &pod["containers"][0];
        let ports: Vec<&str> = c["ports"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["name"].as_str().unwrap())
            .collect();
        for probe in ["startupProbe", "livenessProbe", "readinessProbe"] {
            let get = &c[probe]["httpGet"];
            let path = get["path"]
                .as_str()
                .unwrap_or_else(|| panic!("{name} {probe}"));
            assert!(
                routes.contains(&format!(".route(\"{path}\"")),
                "{name} {probe}: {path} is not a route"
            );
            assert!(
                ports.contains(&get["port"].as_str().unwrap()),
                "{name} {probe}"
            );
        }
    }
    let controller = one(&objects, "Deployment", "stanch");
    let c = &controller["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    // Longer than the drain and the final snapshot.
    assert!(
        controller["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            .as_u64()
            .unwrap()
            > 5 + 10
    );
    let gateway = one(&objects, "Deployment", "stanch-gateway");
    assert!(
        gateway["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            .as_u64()
            .unwrap()
            > 30
    );
}

/// The tokens reach the pods only as files of the Secret: never in the environment,
/// never in a ConfigMap, the Deployment or the NOTES; the controller's configuration
/// names the files, the gateway's names the two it uses.
#[test]
fn tokens_are_files_of_the_secret_and_appear_nowhere_else() {
    let all = format!("{CHART}/ci/all-options-values.yaml");
    let yaml = try_render(&["-f", &all]).unwrap();
    let objects = parse(&yaml);
    let secret = one(&objects, "Secret", "stanch-prod-tokens");
    for (key, value) in [
        ("ingest-token", "ingest-secret-value"),
        ("report-token", "report-secret-value"),
        ("admin-token", "admin-secret-value"),
        ("read-token", "read-secret-value"),
    ] {
        assert_eq!(secret["data"][key], b64(value));
        assert!(!yaml.contains(value), "{value} in plain text");
        let elsewhere = objects
            .iter()
            .filter(|o| o["kind"] != "Secret")
            .any(|o| o.to_string().contains(&b64(value)));
        assert!(!elsewhere, "{key} outside the Secret");
    }
    for (name, pod) in pods(&objects) {
        let c = &pod["containers"][0];
        for env in c["env"].as_array().into_iter().flatten() {
            assert!(
                env["valueFrom"]["secretKeyRef"]["name"] != "stanch-prod-tokens",
                "{name}: a token in the environment"
            );
        }
        let tokens = pod["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["secret"]["secretName"] == "stanch-prod-tokens")
            .unwrap_or_else(|| panic!("{name} mounts no tokens"));
        let mount = c["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["name"] == tokens["name"])
            .unwrap();
        assert_eq!(mount["readOnly"], true);
        let keys: Vec<&str> = tokens["secret"]["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i["key"].as_str().unwrap())
            .collect();
        if name.ends_with("-gateway") {
            assert_eq!(
                keys,
                ["read-token", "report-token"],
                "least a gateway needs: never the ingest token"
            );
        } else {
            assert_eq!(
                keys,
                ["ingest-token", "report-token", "admin-token", "read-token"]
            );
        }
    }
    let config = config_of(&objects, "stanch-prod-config", "stanch.yaml");
    assert_eq!(
        config["auth"]["admin_token_file"],
        "/etc/stanch/tokens/admin-token"
    );
    let gateway = config_of(&objects, "stanch-prod-gateway-config", "gateway.yaml");
    assert_eq!(
        gateway["controller"]["token_file"],
        "/etc/stanch-gateway/tokens/read-token"
    );
    assert_eq!(
        gateway["controller"]["report_token_file"],
        "/etc/stanch-gateway/tokens/report-token"
    );
    assert_eq!(
        config["auth"]["report_token_file"],
        "/etc/stanch/tokens/report-token"
    );
    assert_eq!(
        gateway["controller"]["url"],
        "http://stanch-prod.monitoring.svc:9898"
    );

    // Tokens left empty are generated: 40 characters, distinct.
    let objects = render(&[]);
    let data = &one(&objects, "Secret", "stanch-tokens")["data"];
    let tokens: BTreeSet<String> = ["ingest-token", "report-token", "admin-token", "read-token"]
        .iter()
        .map(|k| unb64(data[k].as_str().unwrap()))
        .collect();
    assert_eq!(tokens.len(), 4);
    assert!(tokens.iter().all(|t| t.len() == 40));
    // A Secret of one's own: the chart makes none and mounts that one.
    let objects = render(&["--set", "auth.existingSecret=mine"]);
    assert!(of_kind(&objects, "Secret").is_empty());
    let (_, pod) = &pods(&objects)[0];
    assert!(
        pod["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v["secret"]["secretName"] == "mine")
    );
}

fn b64(s: &str) -> String {
    base64(&["-w0"], s)
}

pub(crate) fn unb64(s: &str) -> String {
    base64(&["-d"], s)
}

/// coreutils' `base64` with `args` over `input`: the encoding Kubernetes uses.
fn base64(args: &[&str], input: &str) -> String {
    use std::io::Write;
    let mut child = Command::new("base64")
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    String::from_utf8(child.wait_with_output().unwrap().stdout).unwrap()
}

/// A configuration file the chart writes, parsed.
fn config_of(objects: &[Value], configmap: &str, key: &str) -> Value {
    let text = one(objects, "ConfigMap", configmap)["data"][key]
        .as_str()
        .unwrap()
        .to_owned();
    serde_yaml::from_str(&text).unwrap()
}

/// The configuration files the chart writes, for every values file, are accepted by
/// `stanch check-config` and `stanch-gateway --check`: the binaries that will read them.
#[test]
fn the_configuration_files_written_are_ones_the_binaries_accept() {
    let dir = tempfile::tempdir().unwrap();
    let gateway_bin = Path::new(env!("CARGO_BIN_EXE_stanch")).with_file_name("stanch-gateway");
    let mut gateways = 0;
    for values in values_files() {
        for cm in of_kind(&render(&as_args(&values)), "ConfigMap") {
            let (binary, args, file) = if let Some(t) = cm["data"]["stanch.yaml"].as_str() {
                (
                    PathBuf::from(env!("CARGO_BIN_EXE_stanch")),
                    ["check-config"].as_slice(),
                    t,
                )
            } else if let Some(t) = cm["data"]["gateway.yaml"].as_str() {
                gateways += 1;
                (gateway_bin.clone(), ["--check", "--config"].as_slice(), t)
            } else {
                continue;
            };
            let path = dir.path().join("config.yaml");
            std::fs::write(&path, file).unwrap();
            let out = Command::new(&binary)
                .args(args)
                .arg(&path)
                .output()
                .unwrap();
            assert!(out.status.success(), "{values:?}: {}\n{file}", text(&out));
        }
    }
    assert!(gateways >= 2);
}

/// The ServiceMonitors select their Services, in their namespace, on a port the
/// Service has; /metrics is served without a token.
#[test]
fn the_service_monitors_select_the_services() {
    let objects = render(&["-f", &format!("{CHART}/ci/all-options-values.yaml")]);
    let monitors = of_kind(&objects, "ServiceMonitor");
    assert_eq!(monitors.len(), 2);
    for sm in monitors {
        let selector = sm["spec"]["selector"]["matchLabels"].as_object().unwrap();
        let selected: Vec<&Value> = of_kind(&objects, "Service")
            .into_iter()
            .filter(|s| {
                selector
                    .iter()
                    .all(|(k, v)| &s["metadata"]["labels"][k] == v)
            })
            .collect();
        assert_eq!(selected.len(), 1, "{}", sm["metadata"]["name"]);
        let svc = selected[0];
        assert_eq!(sm["spec"]["namespaceSelector"]["matchNames"], json!([NS]));
        assert_eq!(svc["metadata"]["namespace"], NS);
        let port = sm["spec"]["endpoints"][0]["port"].as_str().unwrap();
        assert!(
            svc["spec"]["ports"]
                .as_array()
                .unwrap()
                .iter()
                .any(|p| p["name"] == port)
        );
        assert_eq!(sm["spec"]["endpoints"][0]["path"], "/metrics");
        assert!(sm["spec"]["endpoints"][0].get("authorization").is_none());
        assert_eq!(sm["metadata"]["labels"]["release"], "kube-prometheus-stack");
        // The Service's selector picks exactly one Deployment's pods.
        let pods: Vec<&Value> = of_kind(&objects, "Deployment")
            .into_iter()
            .filter(|d| {
                svc["spec"]["selector"]
                    .as_object()
                    .unwrap()
                    .iter()
                    .all(|(k, v)| &d["spec"]["template"]["metadata"]["labels"][k] == v)
            })
            .collect();
        assert_eq!(pods.len(), 1);
    }
    let controller_api = include_str!("../../crates/stanch-server/src/api/mod.rs");
    let open = controller_api
        .split("let open = Router::new()")
        .nth(1)
        .unwrap();
    assert!(open.split(';').next().unwrap().contains("\"/metrics\""));
}

/// The PrometheusRule carries the rules of `rules/` unchanged: the chart's copy is the
/// same file, and the rendered groups are the file's.
#[test]
fn the_prometheus_rule_is_the_repository_rules() {
    let rules = concat!(env!("CARGO_MANIFEST_DIR"), "/rules/stanch.rules.yml");
    let copy = format!("{CHART}/files/stanch.rules.yml");
    assert_eq!(
        std::fs::read_to_string(rules).unwrap(),
        std::fs::read_to_string(&copy).unwrap(),
        "{copy} differs from rules/stanch.rules.yml: copy it over"
    );
    let want: Value = serde_yaml::from_str(&std::fs::read_to_string(rules).unwrap()).unwrap();
    let objects = render(&["--set", "prometheusRule.enabled=true"]);
    let rule = one(&objects, "PrometheusRule", "stanch");
    assert_eq!(rule["spec"]["groups"], want["groups"]);
    assert!(render(&[]).iter().all(|o| o["kind"] != "PrometheusRule"));
}

/// A PodDisruptionBudget exactly when more than one replica runs, for the controller
/// and the gateway.
#[test]
fn a_disruption_budget_exactly_when_replicas_exceed_one() {
    let gw = format!("{CHART}/examples/with-gateway.yaml");
    for (args, controller, gateway) in [
        (vec![], true, false),
        (vec!["--set", "store=file,replicas=1"], false, false),
        (vec!["--set", "replicas=1"], false, false),
        (vec!["-f", &gw], true, true),
        (vec!["-f", &gw, "--set", "gateway.replicas=1"], true, false),
        (
            vec![
                "-f",
                &gw,
                "--set",
                "replicas=1,podDisruptionBudget.enabled=false",
            ],
            false,
            true,
        ),
    ] {
        let objects = render(&args);
        let pdbs: BTreeSet<&str> = of_kind(&objects, "PodDisruptionBudget")
            .iter()
            .map(|p| p["metadata"]["name"].as_str().unwrap())
            .collect();
        assert_eq!(pdbs.contains("stanch"), controller, "{args:?}");
        assert_eq!(pdbs.contains("stanch-gateway"), gateway, "{args:?}");
    }
}

/// A change of the configuration or of a token rolls the pods; rendering the same
/// values again does not.
#[test]
fn a_config_or_token_change_rolls_the_pods() {
    let annotations = |args: &[&str]| -> (Value, Value) {
        let objects = render(args);
        let d = one(&objects, "Deployment", "stanch");
        let a = &d["spec"]["template"]["metadata"]["annotations"];
        (a["checksum/config"].clone(), a["checksum/tokens"].clone())
    };
    let tokens = "auth.ingestToken=a,auth.reportToken=r,auth.adminToken=b,auth.readToken=c";
    let base = annotations(&["--set", tokens]);
    assert_eq!(base, annotations(&["--set", tokens]));
    let config = annotations(&["--set", tokens, "--set", "config.dry_run=true"]);
    assert_ne!(config.0, base.0);
    assert_eq!(config.1, base.1);
    let token = annotations(&[
        "--set",
        "auth.ingestToken=a,auth.reportToken=r,auth.adminToken=b,auth.readToken=d",
    ]);
    assert_eq!(token.0, base.0);
    assert_ne!(token.1, base.1);
}

/// The spread: anti-affinity over nodes (soft by default, required when asked), zones
/// spread, the file store replaced rather than rolled (one writer of its volume).
#[test]
fn replicas_are_spread_and_rolled_safely() {
    let objects = render(&[]);
    let d = one(&objects, "Deployment", "stanch");
    let pod = &d["spec"]["template"]["spec"];
    let term =
        &pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0];
    assert_eq!(
        term["podAffinityTerm"]["topologyKey"],
        "kubernetes.io/hostname"
    );
    assert_eq!(
        term["podAffinityTerm"]["labelSelector"]["matchLabels"],
        d["spec"]["selector"]["matchLabels"]
    );
    assert_eq!(
        pod["topologySpreadConstraints"][0]["labelSelector"]["matchLabels"],
        d["spec"]["selector"]["matchLabels"]
    );
    assert_eq!(d["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"], 0);
    let hard = render(&["--set", "podAntiAffinity=hard"]);
    let pod = &one(&hard, "Deployment", "stanch")["spec"]["template"]["spec"];
    assert!(
        pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            .is_array()
    );
    let file = render(&["--set", "store=file,replicas=1,persistence.enabled=true"]);
    let d = one(&file, "Deployment", "stanch");
    assert_eq!(d["spec"]["strategy"]["type"], "Recreate");
    let args = d["spec"]["template"]["spec"]["containers"][0]["args"].to_string();
    assert!(args.contains("--data-dir=/var/lib/stanch"));
    assert!(!args.contains("--kubernetes"), "{args}");
    assert_eq!(
        d["spec"]["template"]["spec"]["automountServiceAccountToken"],
        false
    );
    assert_eq!(of_kind(&file, "PersistentVolumeClaim").len(), 1);
    assert!(of_kind(&file, "Role").is_empty());
}

/// The AlertmanagerConfig sends the alerts of `rules/` to the controller's Service
/// with the ingest token, resolutions included; the plain receiver in the NOTES is
/// a configuration the real Alertmanager accepts, with the same route.
#[test]
fn alertmanager_is_wired_to_the_controller_with_the_ingest_token() {
    let objects = render(&["--set", "alertmanagerConfig.enabled=true"]);
    let amc = one(&objects, "AlertmanagerConfig", "stanch");
    let route = &amc["spec"]["route"];
    assert_eq!(route["receiver"], "stanch");
    assert_eq!(route["groupWait"], "0s");
    assert_eq!(route["continue"], true);
    let hook = &amc["spec"]["receivers"][0]["webhookConfigs"][0];
    assert_eq!(
        hook["url"],
        "http://stanch.monitoring.svc:9797/v1/alerts/alertmanager"
    );
    assert_eq!(hook["sendResolved"], true);
    assert_eq!(
        hook["httpConfig"]["authorization"]["credentials"],
        json!({"name": "stanch-tokens", "key": "ingest-token"})
    );
    // Every action of rules/ matches the route's matcher.
    let matcher = &route["matchers"][0];
    assert_eq!(matcher["name"], "action");
    let re = regex::Regex::new(&format!("^(?:{})$", matcher["value"].as_str().unwrap())).unwrap();
    let rules = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/rules/stanch.rules.yml"
    ))
    .unwrap();
    let actions: BTreeSet<&str> = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("action: "))
        .collect();
    assert!(actions.len() >= 4, "{actions:?}");
    for a in actions {
        assert!(re.is_match(a), "{a} is not routed to stanch");
    }

    // The NOTES' receiver, in a whole configuration, through amtool.
    let out = Command::new(helm())
        .args([
            "install",
            "stanch",
            CHART,
            "--namespace",
            NS,
            "--dry-run=client",
        ])
        .output()
        .unwrap();
    let notes = String::from_utf8(out.stdout).unwrap();
    let notes = notes.split("NOTES:").nth(1).expect("NOTES printed");
    let snippet: Vec<&str> = notes
        .lines()
        .skip_while(|l| l.trim() != "route:")
        .take_while(|l| !l.trim().is_empty())
        .collect();
    assert!(snippet.len() > 10, "{notes}");
    let snippet: String = snippet.iter().map(|l| format!("{}\n", &l[5..])).collect();
    let mut config: Value = serde_yaml::from_str(&snippet).unwrap();
    config["route"]["receiver"] = json!("oncall");
    config["receivers"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "oncall"}));
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("alertmanager.yml");
    std::fs::write(&file, serde_yaml::to_string(&config).unwrap()).unwrap();
    let out = Command::new("amtool")
        .arg("check-config")
        .arg(&file)
        .output()
        .expect("amtool runs (prometheus-alertmanager)");
    assert!(out.status.success(), "{}\n{snippet}", text(&out));
    // The same route as the AlertmanagerConfig's.
    let plain = &config["route"]["routes"][0];
    assert_eq!(
        plain["matchers"][0],
        format!("action=~\"{}\"", matcher["value"].as_str().unwrap())
    );
    assert_eq!(plain["receiver"], "stanch");
    let webhook = &config["receivers"][0]["webhook_configs"][0];
    assert_eq!(webhook["url"], hook["url"]);
    assert_eq!(webhook["send_resolved"], true);
}

#[test]
fn the_network_policy_admits_only_prometheus_alertmanager_and_gateways() {
    let gw = format!("{CHART}/examples/with-gateway.yaml");
    // On by default.
    let objects = render(&["-f", &gw]);
    let np = one(&objects, "NetworkPolicy", "stanch");
    let from = np["spec"]["ingress"][0]["from"].as_array().unwrap();
    let any_namespace = json!({});
    for (peer, (key, value)) in from.iter().zip([
        ("app.kubernetes.io/name", "prometheus"),
        ("app.kubernetes.io/name", "alertmanager"),
        ("stanch.dev/gateway", "true"),
    ]) {
        assert_eq!(peer["namespaceSelector"], any_namespace);
        assert_eq!(peer["podSelector"]["matchLabels"], json!({key: value}));
    }
    // The release's gateways, by their pods' labels; nothing else.
    assert_eq!(from.len(), 4, "{from:?}");
    let gateway = one(&objects, "Deployment", "stanch-gateway");
    let labels = &gateway["spec"]["template"]["metadata"]["labels"];
    for (k, v) in from[3]["podSelector"]["matchLabels"].as_object().unwrap() {
        assert_eq!(&labels[k], v);
    }
    assert!(
        from.iter()
            .all(|p| p["podSelector"] != json!({}) || p.get("namespaceSelector").is_some()),
        "no peer admits every pod of the namespace"
    );
    assert_eq!(np["spec"]["ingress"][0]["ports"][0]["port"], "http");
    assert_eq!(np["spec"]["policyTypes"], json!(["Ingress"]));
    // More peers are added, not swapped in.
    let objects = render(&[
        "-f",
        &gw,
        "--set",
        "networkPolicy.from[0].podSelector.matchLabels.app=stanch-ctl",
    ]);
    let np = one(&objects, "NetworkPolicy", "stanch");
    let from = np["spec"]["ingress"][0]["from"].as_array().unwrap();
    assert_eq!(from.len(), 5);
    assert_eq!(from[4]["podSelector"]["matchLabels"]["app"], "stanch-ctl");
    let off = render(&["--set", "networkPolicy.enabled=false"]);
    assert!(of_kind(&off, "NetworkPolicy").is_empty());
}

/// The dashboard is the committed JSON, for Grafana's sidecar.
#[test]
fn the_dashboard_is_a_configmap_for_the_grafana_sidecar() {
    let objects = render(&["--set", "dashboard.enabled=true"]);
    let cm = one(&objects, "ConfigMap", "stanch-dashboard");
    assert_eq!(cm["metadata"]["labels"]["grafana_dashboard"], "1");
    let json: Value = serde_json::from_str(cm["data"]["stanch.json"].as_str().unwrap()).unwrap();
    let file: Value = serde_json::from_str(
        &std::fs::read_to_string(format!("{CHART}/files/dashboard.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(json, file);
    assert_eq!(json["uid"], "stanch-overview");
}

/// The chart's README documents every value: its table is generated from
/// `values.schema.json` (descriptions) and `values.yaml` (defaults). Every property
/// of the schema has a description, and every value of values.yaml is in the schema.
/// `UPDATE_EXPECT=1` writes the table.
#[test]
fn every_value_is_documented_in_the_chart_readme() {
    let schema: Value = serde_json::from_str(
        &std::fs::read_to_string(format!("{CHART}/values.schema.json")).unwrap(),
    )
    .unwrap();
    let values: Value =
        serde_yaml::from_str(&std::fs::read_to_string(format!("{CHART}/values.yaml")).unwrap())
            .unwrap();
    let mut rows = BTreeMap::new();
    walk(&schema, &schema, &values, "", &mut rows);
    let mut table = String::from("| value | default | description |\n|---|---|---|\n");
    for (path, (default, description)) in &rows {
        table.push_str(&format!("| `{path}` | {default} | {description} |\n"));
    }
    let readme_path = format!("{CHART}/README.md");
    let readme = std::fs::read_to_string(&readme_path).unwrap();
    let (begin, end) = ("<!-- values:begin -->\n", "<!-- values:end -->");
    let start = readme.find(begin).expect("the values markers") + begin.len();
    let stop = readme.find(end).unwrap();
    if std::env::var_os("UPDATE_EXPECT").is_some() {
        let updated = format!("{}{table}{}", &readme[..start], &readme[stop..]);
        std::fs::write(&readme_path, updated).unwrap();
        return;
    }
    assert_eq!(
        readme[start..stop],
        table,
        "charts/stanch/README.md's values table is stale: UPDATE_EXPECT=1 cargo test --test it chart"
    );
}

/// Rows of the values table: a leaf's path, its default and its description. Objects
/// whose properties the schema lists are walked into; the rest are leaves.
fn walk(
    root: &Value,
    schema: &Value,
    default: &Value,
    path: &str,
    rows: &mut BTreeMap<String, (String, String)>,
) {
    let resolved = match schema["$ref"].as_str() {
        Some(r) => &root["$defs"][r.trim_start_matches("#/$defs/")],
        None => schema,
    };
    let description = schema["description"]
        .as_str()
        .or(resolved["description"].as_str());
    let walk_into = path.is_empty()
        || (resolved["properties"].is_object()
            && resolved["additionalProperties"] == false
            && !matches!(
                path,
                "config" | "gateway.config" | "resources" | "gateway.resources"
            )
            && !path.ends_with("ecurityContext")
            && !path.ends_with("affinity"));
    if walk_into {
        let props = resolved["properties"].as_object().unwrap();
        if let Some(given) = default.as_object() {
            for key in given.keys() {
                assert!(
                    props.contains_key(key),
                    "{path}.{key} is in values.yaml, not in the schema"
                );
            }
        }
        for (key, sub) in props {
            let p = if path.is_empty() {
                key.clone()
            } else {
                format!("{path}.{key}")
            };
            walk(root, sub, &default[key], &p, rows);
        }
        return;
    }
    let description =
        description.unwrap_or_else(|| panic!("{path} has no description in values.schema.json"));
    let shown = match default {
        Value::Null => "—".to_owned(),
        Value::String(s) if s.is_empty() => "`\"\"`".to_owned(),
        other => format!("`{}`", other.to_string().replace('|', "\\|")),
    };
    rows.insert(path.to_owned(), (shown, description.replace('|', "\\|")));
}

/// The Role grants exactly what the controller asks of the API server: the controller
/// runs with `--store kubernetes --kubernetes-policies` against an API server that
/// records every request as authorization sees it (group, resource, verb), through
/// everything it does there: taking the Lease, an incident (journal writes, a decision
/// written as a policy status and an Event, the route table), a handover with its last
/// snapshot, a restart that reads it back and clears what it replaces, and a state
/// object found unreadable and moved aside. The set asked for and the set granted are
/// equal: nothing missing, nothing spare.
#[test]
fn the_role_grants_exactly_what_the_controller_uses() {
    use stanch_testkit::wait::blocking::until_some;

    use crate::ha::{Replica, holder, kubeconfig};
    use std::time::Duration;

    let runtime = tokio::runtime::Runtime::new().unwrap();
    let api = runtime.block_on(stanch_fake_apiserver::FakeApiServer::start());
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = kubeconfig(dir.path(), &api);
    runtime.block_on(async {
        let client = kube::Client::try_from(kube::Config::new(api.url().parse().unwrap())).unwrap();
        let policies: kube::Api<stanch_kube::crd::StanchPolicy> = kube::Api::namespaced(client, NS);
        let spec = serde_json::from_value(
            json!({"model": "qwen-72b", "pools": [{"name": "dc-a"}, {"name": "dc-b"}], "faq": "default"}),
        )
        .unwrap();
        policies
            .create(
                &Default::default(),
                &stanch_kube::crd::StanchPolicy::new("qwen-72b", spec),
            )
            .await
            .unwrap();
    });
    let config = dir.path().join("stanch.yaml");
    std::fs::write(&config, "models:\n  qwen-14b: {pools: [dc-a]}\n").unwrap();
    let args = [
        "--kubernetes-policies",
        "--config",
        config.to_str().unwrap(),
    ];
    let state = |api: &stanch_fake_apiserver::FakeApiServer| api.names("api/v1", "configmaps", NS);
    let until_exit = |replica: &mut Replica| {
        replica.signal("-TERM");
        until_some("the replica exits", Duration::from_secs(20), || {
            replica.child.try_wait().unwrap()
        });
    };

    for (round, alert) in [(0, 1), (1, 2)] {
        let mut replica = Replica::start_with("stanch-0", &kubeconfig, &args);
        until_some("the Lease taken", Duration::from_secs(15), || {
            (holder(&api).as_deref() == Some("stanch-0")).then_some(())
        });
        until_some("the alert taken", Duration::from_secs(10), || {
            replica
                .post_alert(alert)
                .status()
                .is_success()
                .then_some(())
        });
        until_some(
            "the route table, status and Event",
            Duration::from_secs(10),
            || {
                let table = api.object(
                    "apis/stanch.dev/v1alpha1",
                    "stanchroutetables",
                    NS,
                    "stanch",
                )?;
                let policy =
                    api.object("apis/stanch.dev/v1alpha1", "stanchpolicies", NS, "qwen-72b")?;
                (table["status"]["table"]["version"].as_u64()? > 1
                    && policy["status"]["rung"].is_string()
                    && !api.names("apis/events.k8s.io/v1", "events", NS).is_empty())
                .then_some(())
            },
        );
        until_exit(&mut replica);
        assert!(state(&api).len() >= 2, "round {round}: {:?}", state(&api));
    }
    // An unreadable state object: moved aside, a new history begun.
    runtime.block_on(async {
        let client = kube::Client::try_from(kube::Config::new(api.url().parse().unwrap())).unwrap();
        let maps: kube::Api<k8s_openapi::api::core::v1::ConfigMap> =
            kube::Api::namespaced(client, NS);
        let mut object = maps.get("stanch-state").await.unwrap();
        object.data = Some([("journal".to_owned(), "{not json".to_owned())].into());
        maps.replace("stanch-state", &Default::default(), &object)
            .await
            .unwrap();
    });
    let mut replica = Replica::start_with("stanch-0", &kubeconfig, &args);
    until_some(
        "the unreadable state moved aside",
        Duration::from_secs(15),
        || {
            state(&api)
                .iter()
                .any(|n| n.starts_with("stanch-state-unreadable-"))
                .then_some(())
        },
    );
    until_exit(&mut replica);

    let accesses = api.accesses();
    let asked: BTreeSet<(String, String, String)> = accesses
        .iter()
        .map(|a| (a.group.clone(), a.resource.clone(), a.verb.clone()))
        .collect();
    let objects = render(&["--set", "kubernetesPolicies.enabled=true"]);
    let role = one(&objects, "Role", "stanch");
    let strings = |v: &Value| -> Vec<String> {
        v.as_array()
            .into_iter()
            .flatten()
            .map(|s| s.as_str().unwrap().to_owned())
            .collect()
    };
    let mut granted = BTreeSet::new();
    // (group, resource, verb) → the names a rule limits it to, where one does.
    let mut named: BTreeMap<(String, String, String), Vec<String>> = BTreeMap::new();
    for rule in role["rules"].as_array().unwrap() {
        for group in strings(&rule["apiGroups"]) {
            for resource in strings(&rule["resources"]) {
                for verb in strings(&rule["verbs"]) {
                    let key = (group.clone(), resource.clone(), verb);
                    if rule.get("resourceNames").is_some() {
                        named.insert(key.clone(), strings(&rule["resourceNames"]));
                    }
                    granted.insert(key);
                }
            }
        }
    }
    // Where the names are known, the Role names them, and the controller asks for
    // no other.
    for (group, resource, verbs) in [
        (
            "coordination.k8s.io",
            "leases",
            ["get", "update"].as_slice(),
        ),
        ("stanch.dev", "stanchroutetables", &["patch"]),
        ("stanch.dev", "stanchroutetables/status", &["patch"]),
    ] {
        for verb in verbs {
            let key = (group.to_owned(), resource.to_owned(), (*verb).to_owned());
            let names = named
                .get(&key)
                .unwrap_or_else(|| panic!("{key:?} is limited by resourceNames"));
            assert_eq!(names, &["stanch"], "{key:?}");
        }
    }
    for a in &accesses {
        let key = (a.group.clone(), a.resource.clone(), a.verb.clone());
        if let Some(names) = named.get(&key) {
            let name = a.name.as_deref().unwrap_or("");
            assert!(names.iter().any(|n| n == name), "{a:?} outside {names:?}");
        }
    }
    // The test's own requests (creating the policy, corrupting the state) are not the
    // controller's.
    let test_only = BTreeSet::from([(
        "stanch.dev".to_owned(),
        "stanchpolicies".to_owned(),
        "create".to_owned(),
    )]);
    let asked: BTreeSet<_> = asked.difference(&test_only).cloned().collect();
    let missing: Vec<_> = asked.difference(&granted).collect();
    let spare: Vec<_> = granted.difference(&asked).collect();
    assert!(
        missing.is_empty() && spare.is_empty(),
        "missing from the Role: {missing:?}\nspare in the Role: {spare:?}"
    );
}
