//! Floods at the API's maximum against the real process: whatever one holder of a
//! token sends, the controller's memory, its data directory and the table it serves
//! stay within the bounds docs/operations.md lists, and so does a restart after it.

use std::path::Path;

use serde_json::{Value, json};

use crate::process::{Server, client};

/// The most endpoints one report may carry (`stanch_api::reports::MAX_REPORT_ENDPOINTS`).
const MAX_REPORT_ENDPOINTS: usize = 10_000;

/// The controller's peak resident memory, from the kernel.
fn peak_rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM");
    kib / 1024.0
}

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .expect("data dir")
        .filter_map(Result::ok)
        .map(|e| e.metadata().map_or(0, |m| m.len()))
        .sum()
}

/// One report at the API's maximum: 10,000 endpoints never seen before, each failing
/// five times in a row, from a gateway with a 128-byte name.
fn report(round: usize) -> Value {
    let gateway = format!("{round:0>128}");
    let endpoints: Vec<Value> = (0..MAX_REPORT_ENDPOINTS)
        .map(|i| {
            json!({
                "endpoint": format!("h{round}-{i}:1"),
                "model": "qwen-14b",
                "successes": 0,
                "failures": 5,
                "consecutive_failures": 5,
            })
        })
        .collect();
    json!({ "gateway": gateway, "endpoints": endpoints })
}

/// The bound on the table's size with the default limits: 1,000 blocks of at most
/// 512 bytes of endpoint, a model name and a reason of a fleet block, and the models.
const TABLE_BOUND: usize = 1_000 * 1_024 + 64 * 1_024;

#[test]
fn a_report_flood_at_the_api_maximum_stays_within_bounds() {
    let data = tempfile::tempdir().unwrap();
    // As shipped: the default log level, written out.
    let log_path = data.path().join("stanch.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let mut server =
        Server::start_with(data.path(), &[], "http", "info", log, ["adm", "ing", "rd"]);
    let http = client();
    let rounds = 30;
    let mut refused = 0u64;
    for round in 0..rounds {
        let r = http
            .post(format!("{}/v1/reports", server.base))
            .bearer_auth("ing")
            .json(&report(round))
            .send()
            .unwrap();
        assert_eq!(r.status(), 200, "round {round}");
        let body: Value = r.json().unwrap();
        refused += body["refused"].as_u64().expect("refused is counted");
    }
    // 1,000 pairs are tracked at a time, each counted once into a block.
    assert!(
        refused >= (rounds as u64 - 1) * 9_000,
        "most entries are refused: {refused}"
    );
    let table = http
        .get(format!("{}/v1/routes", server.base))
        .bearer_auth("rd")
        .send()
        .unwrap()
        .bytes()
        .unwrap();
    let parsed: Value = serde_json::from_slice(&table).unwrap();
    let blocks = parsed["blocked"].as_array().unwrap().len();
    assert_eq!(blocks, 1_000, "blocking.max_blocks holds");
    assert!(table.len() < TABLE_BOUND, "table {} bytes", table.len());
    let metrics = server.metrics();
    assert!(
        metrics.contains("stanch_blocks_refused_total{kind=\"limit\"}"),
        "refused blocks are counted"
    );
    assert!(metrics.contains("stanch_reports_refused_total{kind=\"limit\"}"));

    // A flood is a warning a minute, not a line per report.
    let logged = std::fs::read_to_string(&log_path).unwrap();
    for warning in ["report entries not counted", "block limit reached"] {
        assert_eq!(
            logged.matches(warning).count(),
            1,
            "{warning:?} once in:\n{logged}"
        );
    }

    let rss = peak_rss_mib(server.child.id());
    let disk = dir_bytes(data.path()) - std::fs::metadata(&log_path).unwrap().len();
    eprintln!(
        "after {rounds} reports of {MAX_REPORT_ENDPOINTS}: peak RSS {rss:.0} MiB, data dir {} KiB, table {} KiB",
        disk / 1024,
        table.len() / 1024
    );
    assert!(rss < 64.0, "peak RSS {rss:.0} MiB");
    assert!(disk < 16 << 20, "data dir {disk} bytes");

    // A restart after the flood, from a kill: it replays within the same bounds.
    server.child.kill().unwrap();
    server.child.wait().unwrap();
    let server = Server::start(data.path(), &[], "http");
    let replayed: Value = server.routes();
    assert_eq!(replayed["blocked"].as_array().unwrap().len(), 1_000);
    let rss = peak_rss_mib(server.child.id());
    eprintln!("restarted: peak RSS {rss:.0} MiB");
    assert!(rss < 64.0, "peak RSS after restart {rss:.0} MiB");
}
