//! The metrics exposition under names from outside: every label value that is not a
//! constant of the code is written escaped, and what both servers expose parses with
//! Prometheus' own parser (`promtool check metrics`).

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

use crate::process::Server;

/// A name that ends a label value early, opens a new one and forges a sample when it
/// is written as it is.
pub(crate) const HOSTILE: &str = r#"qwen"} 1 x{y="\"#;

/// Prometheus' own parser over `text`: panics with its complaint when it cannot parse
/// it. Lint findings (help text, naming) are not parse errors.
pub(crate) fn promtool_parses(text: &str) {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool: run scripts/install-test-deps.sh (Debian's prometheus)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // 0: clean; 3: lint findings only; 1: it could not parse the text.
    assert!(
        matches!(out.status.code(), Some(0 | 3)) && !said.contains("parsing error"),
        "promtool could not parse the exposition: {said}"
    );
}

#[test]
fn the_controllers_metrics_parse_with_a_model_named_to_forge_a_sample() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("stanch.yaml");
    let name = serde_json::to_string(HOSTILE).unwrap();
    std::fs::write(
        &config,
        format!("models:\n  {name}:\n    pools: [dc-a, dc-b]\nfaq_sets: [default]\n"),
    )
    .unwrap();
    let data = dir.path().join("data");
    let server = Server::start(&data, &["--config", config.to_str().unwrap()], "http");
    let text = server.metrics();
    assert!(
        text.contains(r#"stanch_model_rung{model="qwen\"} 1 x{y=\"\\"} 0"#),
        "the model's name, escaped: {text}"
    );
    promtool_parses(&text);
}

/// Every label set of both servers holds values that are escaped (`Label`) or
/// constants of the code: a `String` field would be written as it is.
#[test]
fn every_label_from_outside_is_escaped() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut checked = 0;
    for file in [
        "crates/stanch-server/src/metrics.rs",
        "crates/stanch-gateway/src/metrics.rs",
    ] {
        let text = std::fs::read_to_string(root.join(file)).unwrap();
        for block in text.split("EncodeLabelSet)]").skip(1) {
            let body = &block[block.find('{').unwrap() + 1..block.find('}').unwrap()];
            for field in body
                .lines()
                .map(str::trim)
                .filter(|l| l.starts_with("pub "))
            {
                let ty = field
                    .split(':')
                    .nth(1)
                    .unwrap()
                    .trim()
                    .trim_end_matches(',');
                assert!(
                    matches!(ty, "Label" | "&'static str" | "u32" | "u64" | "usize"),
                    "{file}: `{field}` is written as it is: make it a Label"
                );
                checked += 1;
            }
        }
    }
    assert!(checked > 20, "found the label sets ({checked} fields)");
}

#[test]
fn the_gateways_metrics_parse_with_names_made_to_forge_samples() {
    use stanch_gateway::metrics::{
        AttemptLabels, EndpointLabels, Label, Metrics, ModelLabel, ProbeLabels, RequestLabels,
    };

    let m = Metrics::new();
    let hostile = || Label::from(HOSTILE);
    m.requests
        .get_or_create(&RequestLabels {
            model: hostile(),
            served_model: hostile(),
            pool: hostile(),
            endpoint: hostile(),
            status_class: "2xx",
            outcome: "success",
        })
        .inc();
    m.attempts
        .get_or_create(&AttemptLabels {
            model: hostile(),
            pool: hostile(),
            endpoint: hostile(),
            outcome: "success",
        })
        .inc();
    m.probes
        .get_or_create(&ProbeLabels {
            model: hostile(),
            pool: hostile(),
            endpoint: hostile(),
            outcome: "success",
        })
        .inc();
    m.retries
        .get_or_create(&ModelLabel { model: hostile() })
        .inc();
    m.endpoint_blocked
        .get_or_create(&EndpointLabels {
            endpoint: hostile(),
            model: hostile(),
            pool: hostile(),
        })
        .set(1);
    let text = m.encode();
    assert!(
        !text.contains(HOSTILE),
        "no name is written as it is: {text}"
    );
    promtool_parses(&text);
}
