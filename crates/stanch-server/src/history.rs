//! The audit history: every decision with its rule, bounded in memory and appended as
//! JSON lines to `history.jsonl` under the data dir (rotated to `history.jsonl.1`).
//!
//! The history is a record for humans; the journal is what restores state. So a
//! history write that fails (a full disk) is counted and logged, never fatal.

use std::collections::VecDeque;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use stanch_api::Timestamp;
use stanch_api::status::HistoryEntry;
use stanch_core::Decision;

/// How much of an existing file is read back at start.
const TAIL_BYTES: u64 = 4 * 1024 * 1024;

/// The audit history, shared by the engine task (writer) and the API (readers).
#[derive(Debug)]
pub struct History {
    inner: Mutex<Inner>,
}

#[derive(Debug)]
struct Inner {
    ring: VecDeque<HistoryEntry>,
    max_entries: usize,
    next_seq: u64,
    file: Option<HistoryFile>,
}

#[derive(Debug)]
struct HistoryFile {
    path: PathBuf,
    file: File,
    written: u64,
    max_bytes: u64,
}

impl History {
    /// A history kept in memory only.
    pub fn in_memory(max_entries: usize) -> History {
        History::with_file(max_entries, None)
    }

    /// A history appended to `dir/history.jsonl`, its recent tail read back.
    pub fn open(dir: &Path, max_entries: usize, max_bytes: u64) -> std::io::Result<History> {
        let path = dir.join("history.jsonl");
        let tail = read_tail(&path, max_entries)?;
        let file = OpenOptions::new().create(true).append(true).open(&path)?;
        let written = file.metadata()?.len();
        let history = History::with_file(
            max_entries,
            Some(HistoryFile {
                path,
                file,
                written,
                max_bytes,
            }),
        );
        {
            let mut inner = history.inner.lock().expect("history lock");
            inner.next_seq = tail.last().map_or(1, |e| e.seq + 1);
            inner.ring = tail.into();
        }
        Ok(history)
    }

    fn with_file(max_entries: usize, file: Option<HistoryFile>) -> History {
        History {
            inner: Mutex::new(Inner {
                ring: VecDeque::new(),
                max_entries: max_entries.max(1),
                next_seq: 1,
                file,
            }),
        }
    }

    /// Records decisions made at `at`. Lease renewals are left out: they are routine.
    pub fn record(
        &self,
        at: Timestamp,
        decisions: &[Decision],
        dry_run: bool,
    ) -> std::io::Result<()> {
        let mut inner = self.inner.lock().expect("history lock");
        let mut lines = Vec::new();
        for d in decisions {
            if matches!(
                d,
                Decision::Published {
                    lease_renewal: true,
                    ..
                }
            ) {
                continue;
            }
            let entry = HistoryEntry {
                seq: inner.next_seq,
                at,
                kind: d.kind().to_owned(),
                model: d.model().map(str::to_owned),
                summary: d.to_string(),
                detail: serde_json::to_value(d).unwrap_or_default(),
                dry_run: dry_run && !matches!(d, Decision::Override { .. }),
            };
            inner.next_seq += 1;
            if inner.file.is_some() {
                serde_json::to_writer(&mut lines, &entry).expect("entries serialize");
                lines.push(b'\n');
            }
            if inner.ring.len() == inner.max_entries {
                inner.ring.pop_front();
            }
            inner.ring.push_back(entry);
        }
        match &mut inner.file {
            Some(f) if !lines.is_empty() => f.append(&lines),
            _ => Ok(()),
        }
    }

    /// The newest `limit` entries after `after`, optionally of one model, oldest first.
    pub fn list(&self, limit: usize, model: Option<&str>, after: Option<u64>) -> Vec<HistoryEntry> {
        let inner = self.inner.lock().expect("history lock");
        let mut out: Vec<HistoryEntry> = inner
            .ring
            .iter()
            .rev()
            .filter(|e| after.is_none_or(|a| e.seq > a))
            .filter(|e| model.is_none_or(|m| e.model.as_deref() == Some(m)))
            .take(limit)
            .cloned()
            .collect();
        out.reverse();
        out
    }
}

impl HistoryFile {
    fn append(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        if self.written + bytes.len() as u64 > self.max_bytes {
            let rotated = self.path.with_extension("jsonl.1");
            fs::rename(&self.path, rotated)?;
            self.file = OpenOptions::new()
                .create(true)
                .append(true)
                .open(&self.path)?;
            self.written = 0;
        }
        if let Err(e) = self.file.write_all(bytes) {
            // Cut a partial entry off, so the next one does not start mid-line.
            let _ = self.file.set_len(self.written);
            return Err(e);
        }
        self.written += bytes.len() as u64;
        Ok(())
    }
}

fn read_tail(path: &Path, max_entries: usize) -> std::io::Result<Vec<HistoryEntry>> {
    let mut file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let len = file.metadata()?.len();
    let start = len.saturating_sub(TAIL_BYTES);
    file.seek(SeekFrom::Start(start))?;
    let mut bytes = Vec::new();
    file.take(TAIL_BYTES).read_to_end(&mut bytes)?;
    // Bytes, not text: a torn or damaged line (any bytes) costs that entry only.
    let mut lines: Vec<&[u8]> = bytes.split(|&b| b == b'\n').collect();
    if start > 0 && !lines.is_empty() {
        lines.remove(0); // Most likely cut in the middle.
    }
    let mut entries: Vec<HistoryEntry> = lines
        .iter()
        .filter_map(|l| serde_json::from_slice(l).ok())
        .collect();
    let excess = entries.len().saturating_sub(max_entries);
    entries.drain(..excess);
    Ok(entries)
}

#[cfg(test)]
mod tests {
    use super::*;
    use stanch_api::Rung;
    use stanch_core::Rule;

    fn transition(model: &str) -> Decision {
        Decision::Transition {
            model: model.into(),
            from: Rung::Normal,
            to: Rung::Failover,
            pool: "dc-b".into(),
            alias: None,
            rule: Rule::Forced {
                reason: "test".into(),
            },
        }
    }

    #[test]
    fn bounded_filtered_and_read_back_after_restart() {
        let dir = tempfile::tempdir().unwrap();
        let h = History::open(dir.path(), 3, 1 << 20).unwrap();
        for i in 0..5 {
            let model = if i % 2 == 0 { "a" } else { "b" };
            h.record(Timestamp::from_millis(i), &[transition(model)], false)
                .unwrap();
        }
        h.record(
            Timestamp::from_millis(9),
            &[Decision::Published {
                version: 7,
                lease_renewal: true,
            }],
            false,
        )
        .unwrap();
        let all = h.list(10, None, None);
        assert_eq!(
            all.iter().map(|e| e.seq).collect::<Vec<_>>(),
            vec![3, 4, 5],
            "bounded, renewals left out"
        );
        assert_eq!(h.list(10, Some("a"), None).len(), 2);
        assert_eq!(h.list(10, None, Some(4)).len(), 1);
        drop(h);
        let again = History::open(dir.path(), 3, 1 << 20).unwrap();
        assert_eq!(again.list(10, None, None).last().unwrap().seq, 5);
        again
            .record(Timestamp::from_millis(10), &[transition("a")], false)
            .unwrap();
        assert_eq!(
            again.list(1, None, None)[0].seq,
            6,
            "sequence continues after a restart"
        );
    }

    #[test]
    fn damaged_lines_cost_only_their_entries() {
        let dir = tempfile::tempdir().unwrap();
        let h = History::open(dir.path(), 10, 1 << 20).unwrap();
        h.record(Timestamp::from_millis(1), &[transition("a")], false)
            .unwrap();
        drop(h);
        let path = dir.path().join("history.jsonl");
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all("{\"seq\":2,\"summary\":\"集".as_bytes().split_at(20).0)
            .unwrap();
        f.write_all(b"\xff\xfe\n").unwrap();
        drop(f);
        let h = History::open(dir.path(), 10, 1 << 20).unwrap();
        h.record(Timestamp::from_millis(3), &[transition("b")], false)
            .unwrap();
        let seqs: Vec<u64> = h.list(10, None, None).iter().map(|e| e.seq).collect();
        assert_eq!(seqs, vec![1, 2]);
    }

    #[test]
    fn rotates_at_its_size_limit() {
        let dir = tempfile::tempdir().unwrap();
        let h = History::open(dir.path(), 100, 600).unwrap();
        for i in 0..10 {
            h.record(Timestamp::from_millis(i), &[transition("a")], false)
                .unwrap();
        }
        assert!(dir.path().join("history.jsonl.1").exists());
        assert!(
            fs::metadata(dir.path().join("history.jsonl"))
                .unwrap()
                .len()
                <= 600
        );
    }
}
