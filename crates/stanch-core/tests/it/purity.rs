//! stanch-core does no IO and reads no clock: its manifest must not grow the crates
//! that would let it.

#[test]
fn core_has_no_io_dependencies() {
    let manifest = include_str!("../../Cargo.toml");
    let deps = manifest
        .split("[dependencies]")
        .nth(1)
        .and_then(|rest| rest.split("\n[").next())
        .expect("a [dependencies] section");
    for banned in [
        "tokio", "axum", "hyper", "reqwest", "kube", "tonic", "tower", "chrono", "rand", "std-fs",
    ] {
        let present = deps.lines().any(|l| l.trim_start().starts_with(banned));
        assert!(!present, "stanch-core must not depend on {banned}");
    }
}

#[test]
fn core_sources_read_no_clock() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "rs") {
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
