//! stanch-core does no IO and reads no clock, and nothing it is built with can.
//!
//! The dependency test walks `cargo metadata` over the core's whole graph of normal
//! dependencies, not only its manifest: a wire-type crate that grew a gRPC runtime
//! would otherwise bring tokio in unseen.

use std::collections::BTreeSet;
use std::path::Path;

use stanch_testkit::deps::Graph;

/// Runtimes, network stacks and clients: what doing IO would take.
const BANNED: &[&str] = &[
    "tokio", "tonic", "prost", "hyper", "axum", "kube", "reqwest", "tower", "h2", "mio",
];

#[test]
fn nothing_the_core_is_built_with_does_io_or_reads_the_clock() {
    let graph = Graph::load(&[]);
    let core = graph.normal_closure("stanch-core");
    let names: BTreeSet<&str> = graph.names(&core).into_iter().collect();
    // The walk reaches past the manifest: the wire types and what they are built with.
    for expected in ["stanch-api", "serde", "serde_json", "chrono"] {
        assert!(
            names.contains(expected),
            "{expected} is in the graph: {names:?}"
        );
    }
    let banned = graph.paths_to(&core, BANNED);
    assert!(banned.is_empty(), "stanch-core is built with {banned:#?}");
    let clocks = graph.chrono_clock_askers(&core);
    assert!(
        clocks.is_empty(),
        "chrono's clock is asked for by {clocks:#?}"
    );
}

/// The same walk finds what it looks for where it is: the controller shell runs on
/// tokio and serves gRPC.
#[test]
fn the_walk_sees_the_runtime_where_there_is_one() {
    let graph = Graph::load(&[]);
    let server = graph.normal_closure("stanch-server");
    let banned = graph.paths_to(&server, BANNED);
    for expected in ["tokio", "tonic", "prost", "hyper"] {
        assert!(
            banned
                .iter()
                .any(|path| path.ends_with(&format!("→ {expected}"))),
            "{expected} in {banned:#?}"
        );
    }
}

#[test]
fn core_sources_read_no_clock() {
    let mut dirs = vec![Path::new(env!("CARGO_MANIFEST_DIR")).join("src")];
    let mut read = 0;
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                read += 1;
                let text = std::fs::read_to_string(&path).unwrap();
                for banned in [
                    "SystemTime",
                    "Instant::now",
                    "std::fs",
                    "std::net",
                    "thread_rng",
                ] {
                    assert!(!text.contains(banned), "{} uses {banned}", path.display());
                }
            }
        }
    }
    // Every module, the engine's and the mapper's folders included.
    assert!(read >= 10, "read {read} files");
}
