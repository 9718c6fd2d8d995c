//! Every real sleep in a `tests/` folder is accounted for: the test kit's docs list
//! them by file with why (`crates/stanch-testkit/src/lib.rs`, "Time in tests"), and
//! this test fails when the list and the code differ, either way. A new sleep is
//! either replaced by a bounded wait (`stanch_testkit::wait`) or listed with its
//! reason.

use std::collections::BTreeMap;
use std::path::Path;

use stanch_testkit::files::rust_sources;

/// A call of a sleep, qualified or not (`tokio::time::sleep(`, `thread::sleep(`,
/// `sleep(` imported), written so that this file holds none; not `sleep_until(`.
const SLEEP: &str = concat!(r"\bsle", r"ep\(");

/// What the kit's docs list: file → sleeps.
fn listed(root: &Path) -> BTreeMap<String, usize> {
    let docs = std::fs::read_to_string(root.join("crates/stanch-testkit/src/lib.rs")).unwrap();
    docs.lines()
        .filter_map(|l| l.strip_prefix("//! | `"))
        .map(|row| {
            let (file, rest) = row.split_once("` | ").expect("| `file` | n | why |");
            let n = rest.split(' ').next().unwrap().parse().expect("a count");
            (file.to_owned(), n)
        })
        .collect()
}

/// What the code holds: file → calls of a `sleep` (tokio's or the thread's) outside
/// comments.
fn found(root: &Path) -> BTreeMap<String, usize> {
    let mut dirs = vec![root.join("tests")];
    for entry in std::fs::read_dir(root.join("crates")).unwrap().flatten() {
        dirs.push(entry.path().join("tests"));
    }
    let sleep = regex::Regex::new(SLEEP).unwrap();
    let mut counts = BTreeMap::new();
    for file in dirs.iter().flat_map(|d| rust_sources(d, true)) {
        let text = std::fs::read_to_string(&file).unwrap();
        let n: usize = text
            .lines()
            .filter(|l| !l.trim_start().starts_with("//"))
            .map(|l| sleep.find_iter(l).count())
            .sum();
        if n > 0 {
            let relative = file.strip_prefix(root).unwrap();
            counts.insert(relative.display().to_string(), n);
        }
    }
    counts
}

#[test]
fn every_real_sleep_in_the_test_suites_is_listed_with_why() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let (listed, found) = (listed(root), found(root));
    assert!(!listed.is_empty(), "the kit's docs hold the list");
    let differ: Vec<String> = listed
        .keys()
        .chain(found.keys())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .filter(|f| listed.get(*f) != found.get(*f))
        .map(|f| {
            format!(
                "{f}: {} in the code, {} listed",
                found.get(f).unwrap_or(&0),
                listed.get(f).unwrap_or(&0)
            )
        })
        .collect();
    assert!(
        differ.is_empty(),
        "the real sleeps and the test kit's list differ (wait with stanch_testkit::wait, \
         or list the sleep with why):\n{}",
        differ.join("\n")
    );
}

#[test]
fn a_sleep_not_listed_and_a_listing_without_its_sleep_are_both_found() {
    let root = tempfile::tempdir().unwrap();
    let kit = root.path().join("crates/stanch-testkit/src");
    std::fs::create_dir_all(&kit).unwrap();
    std::fs::create_dir_all(root.path().join("tests/it")).unwrap();
    std::fs::write(
        kit.join("lib.rs"),
        "//! | `tests/it/gone.rs` | 1 | pacing |\n",
    )
    .unwrap();
    // Written in pieces, so that this file holds no call of its own.
    let (call, until) = (concat!("sle", "ep("), concat!("sle", "ep_until("));
    std::fs::write(
        root.path().join("tests/it/new.rs"),
        format!(
            "// std::thread::{call}x) in a comment is not one\n\
             fn f() {{ std::thread::{call}d); }}\n\
             async fn g() {{ {call}d).await; tokio::time::{until}t).await; }}\n"
        ),
    )
    .unwrap();
    assert_eq!(
        found(root.path()),
        BTreeMap::from([("tests/it/new.rs".to_owned(), 2)]),
        "qualified and imported calls count; a comment and sleep_until do not"
    );
    assert_eq!(
        listed(root.path()),
        BTreeMap::from([("tests/it/gone.rs".to_owned(), 1)])
    );
}
