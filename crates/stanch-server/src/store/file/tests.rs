//! The tests of `file`.

use std::fs::{self, OpenOptions};
use std::io::Write;

use proptest::prelude::*;
use stanch_api::Timestamp;
use stanch_core::{Engine, Input};

use super::*;

fn record(seq: u64) -> Record {
    Record {
        seq,
        at: Timestamp::from_millis(seq as i64),
        input: Input::Tick,
    }
}

#[test]
fn journal_and_snapshot_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = FileStore::open(dir.path(), "t").unwrap();
    store.load().unwrap();
    store.append(&[record(1), record(2)]).unwrap();
    let state = Engine::fresh_state("e1".into(), Timestamp::from_millis(0));
    store.snapshot(&state, 2).unwrap();
    store.append(&[record(3)]).unwrap();
    let loaded = FileStore::open(dir.path(), "t").unwrap().load().unwrap();
    assert_eq!(loaded.snapshot.unwrap().1, 2);
    assert_eq!(loaded.journal, vec![record(3)]);
    assert!(loaded.corruption.is_none());
}

/// A record of about `bytes` bytes.
fn big_record(seq: u64, bytes: usize) -> Record {
    Record {
        seq,
        at: Timestamp::from_millis(seq as i64),
        input: Input::Reports {
            gateway: "g".repeat(bytes),
            endpoints: Vec::new(),
        },
    }
}

#[test]
fn a_journal_past_its_byte_bound_asks_for_a_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = FileStore::open(dir.path(), "t").unwrap();
    store.load().unwrap();
    let mb = 1 << 20;
    store.append(&[big_record(1, 15 * mb)]).unwrap();
    assert!(!store.prefers_snapshot(&[]), "under 16 MiB");
    store.append(&[big_record(2, 2 * mb)]).unwrap();
    assert!(store.prefers_snapshot(&[]), "over 16 MiB");

    // A larger state allows a journal of twice its size, also after a restart.
    let state = Engine::fresh_state("e".repeat(12 * mb), Timestamp::from_millis(0));
    store.snapshot(&state, 2).unwrap();
    assert!(
        !store.prefers_snapshot(&[]),
        "a snapshot empties the journal"
    );
    let mut store = FileStore::open(dir.path(), "t").unwrap();
    store.load().unwrap();
    store.append(&[big_record(3, 20 * mb)]).unwrap();
    assert!(
        !store.prefers_snapshot(&[]),
        "under twice the 12 MiB snapshot"
    );
    store.append(&[big_record(4, 5 * mb)]).unwrap();
    assert!(store.prefers_snapshot(&[]), "over twice the snapshot");
}

/// A store with record 1 in its journal, then `tail` written after it as a crash or
/// a damaged disk would leave it; the store is returned to append more.
fn journal_then(tail: &[u8]) -> (tempfile::TempDir, FileStore, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let mut store = FileStore::open(dir.path(), "t").unwrap();
    store.load().unwrap();
    store.append(&[record(1)]).unwrap();
    let path = dir.path().join(JOURNAL);
    let mut f = OpenOptions::new().append(true).open(&path).unwrap();
    f.write_all(tail).unwrap();
    (dir, store, path)
}

#[test]
fn torn_last_line_is_dropped_and_truncated() {
    let (dir, _, path) = journal_then(br#"{"seq":2,"at":"2026-"#);
    let loaded = FileStore::open(dir.path(), "t").unwrap().load().unwrap();
    assert_eq!(loaded.journal, vec![record(1)]);
    assert!(loaded.corruption.is_none());
    let text = fs::read_to_string(&path).unwrap();
    assert!(text.ends_with("}\n"), "torn tail truncated: {text:?}");
}

#[test]
fn a_torn_line_ending_inside_a_utf8_character_is_dropped() {
    let full = "{\"seq\":2,\"alertname\":\"集群故障\"}";
    let cut = &full.as_bytes()[..full.find('群').unwrap() + 1]; // Half of 群.
    let (dir, _, _) = journal_then(cut);
    let loaded = FileStore::open(dir.path(), "t").unwrap().load().unwrap();
    assert_eq!(loaded.journal, vec![record(1)]);
    assert!(loaded.corruption.is_none());
}

#[test]
fn corrupt_snapshot_is_moved_aside_and_reported() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join(SNAPSHOT), b"{ not json").unwrap();
    let loaded = FileStore::open(dir.path(), "t1").unwrap().load().unwrap();
    assert!(loaded.snapshot.is_none());
    let why = loaded.corruption.unwrap();
    assert!(why.contains("snapshot unreadable"), "{why}");
    assert!(dir.path().join("state.json.corrupt-t1").exists());
    assert!(!dir.path().join(SNAPSHOT).exists());
}

#[test]
fn corrupt_journal_line_in_the_middle_starts_over() {
    let (dir, mut store, _) = journal_then(b"garbage \xff\xfe\n");
    store.append(&[record(3)]).unwrap();
    let mut again = FileStore::open(dir.path(), "t2").unwrap();
    let loaded = again.load().unwrap();
    assert!(loaded.journal.is_empty());
    assert!(loaded.corruption.unwrap().contains("line 2"));
    assert!(dir.path().join("journal.jsonl.corrupt-t2").exists());
    // The new epoch's journal starts empty, not after the corrupt one.
    again.append(&[record(1)]).unwrap();
    let loaded = FileStore::open(dir.path(), "t3").unwrap().load().unwrap();
    assert_eq!(loaded.journal, vec![record(1)]);
}

#[test]
fn a_batch_written_twice_replays_once() {
    let mut line = serde_json::to_vec(&record(1)).unwrap();
    line.push(b'\n');
    let twice = [line.clone(), line].concat();
    let (records, good) = parse_journal(&twice).unwrap();
    assert_eq!(records, vec![record(1)]);
    assert_eq!(good, twice.len() as u64);
}

proptest! {
    /// Whatever bytes the journal holds, reading it never fails on them: it gives
    /// records or a line to blame, and a prefix of whole lines.
    #[test]
    fn any_journal_bytes_parse_or_name_a_line(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        match parse_journal(&bytes) {
            Ok((_, good)) => {
                prop_assert!(good as usize <= bytes.len());
                prop_assert!(good == 0 || bytes[good as usize - 1] == b'\n');
            }
            Err(what) => prop_assert!(what.starts_with("line ")),
        }
    }

    /// Cutting a valid journal anywhere loses only the cut line.
    #[test]
    fn a_journal_cut_anywhere_keeps_its_whole_lines(n in 1u64..8, cut in any::<prop::sample::Index>()) {
        let mut bytes = Vec::new();
        for seq in 1..=n {
            serde_json::to_writer(&mut bytes, &record(seq)).unwrap();
            bytes.push(b'\n');
        }
        let at = cut.index(bytes.len() + 1);
        let (records, good) = parse_journal(&bytes[..at]).unwrap();
        let whole = bytes[..at].iter().filter(|&&b| b == b'\n').count();
        prop_assert_eq!(records.len(), whole);
        prop_assert_eq!(good as usize, bytes[..at].iter().rposition(|&b| b == b'\n').map_or(0, |p| p + 1));
    }
}
