//! The audit history: every decision with its rule, bounded in memory and appended as
//! JSON lines to `history.jsonl` under the data dir (rotated to `history.jsonl.1`).
//!
//! The history is a record for humans; the journal is what restores state. So a
//! history write that fails (a full disk) is counted and logged, never fatal.

use std::collections::VecDeque;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use stanch_api::Timestamp;
use stanch_api::status::HistoryEntry;
use stanch_core::Decision;
use stanch_ports::history::Recorded;
use tokio::sync::broadcast;

/// How much of an existing file is read back at start.
const TAIL_BYTES: u64 = 4 * 1024 * 1024;

/// Batches of decisions kept for subscribers that fall behind.
const SUBSCRIBER_BACKLOG: usize = 1024;

/// The audit history, shared by the engine task (writer) and the API (readers).
#[derive(Debug)]
pub struct History {
    inner: Mutex<Inner>,
    /// Every batch recorded, for adapters that tell of decisions elsewhere (Events).
    recorded: broadcast::Sender<Arc<Recorded>>,
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
            recorded: broadcast::channel(SUBSCRIBER_BACKLOG).0,
        }
    }

    /// Every batch of decisions recorded from now on. One that falls more than 1,024
    /// batches behind misses the oldest (and is told how many): the history keeps
    /// them all.
    pub fn subscribe(&self) -> broadcast::Receiver<Arc<Recorded>> {
        self.recorded.subscribe()
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
        let mut told = Vec::new();
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
            if self.recorded.receiver_count() > 0 {
                told.push(d.clone());
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
        if !told.is_empty() {
            // None listening is not an error.
            let _ = self.recorded.send(Arc::new(Recorded {
                at,
                decisions: told,
            }));
        }
        match &mut inner.file {
            Some(f) if !lines.is_empty() => f.append(&lines),
            _ => Ok(()),
        }
    }

    /// A page of entries, oldest first, optionally of one model:
    /// - with `after`, the oldest `limit` entries whose seq is above it (a cursor:
    ///   pass the last seq of a page to get the next one, or to tail);
    /// - with `before` alone, the newest `limit` entries whose seq is below it (to
    ///   page back from the newest);
    /// - with neither, the newest `limit` entries.
    pub fn list(&self, page: Page<'_>) -> Vec<HistoryEntry> {
        let inner = self.inner.lock().expect("history lock");
        let keep = |e: &&HistoryEntry| {
            page.after.is_none_or(|a| e.seq > a)
                && page.before.is_none_or(|b| e.seq < b)
                && page.model.is_none_or(|m| e.model.as_deref() == Some(m))
        };
        if page.after.is_some() {
            // Seqs in the ring are consecutive, so the first one above the cursor is
            // found by position, not by a scan.
            let start = inner.ring.front().map_or(0, |first| {
                let after = page.after.unwrap_or(0);
                usize::try_from(after.saturating_add(1).saturating_sub(first.seq))
                    .unwrap_or(usize::MAX)
            });
            inner
                .ring
                .range(start.min(inner.ring.len())..)
                .filter(keep)
                .take(page.limit)
                .cloned()
                .collect()
        } else {
            let mut out: Vec<HistoryEntry> = inner
                .ring
                .iter()
                .rev()
                .filter(keep)
                .take(page.limit)
                .cloned()
                .collect();
            out.reverse();
            out
        }
    }

    /// The oldest and newest seq kept (`None` while empty): a client whose cursor is
    /// below the oldest minus one has missed entries that were dropped.
    pub fn span(&self) -> Option<(u64, u64)> {
        let inner = self.inner.lock().expect("history lock");
        Some((inner.ring.front()?.seq, inner.ring.back()?.seq))
    }
}

/// Which entries [`History::list`] answers.
#[derive(Debug, Clone, Copy)]
pub struct Page<'a> {
    /// Entries at most.
    pub limit: usize,
    /// Only this model's entries.
    pub model: Option<&'a str>,
    /// Only entries whose seq is above this; the page starts right after it.
    pub after: Option<u64>,
    /// Only entries whose seq is below this.
    pub before: Option<u64>,
}

impl Page<'_> {
    /// The newest `limit` entries of every model.
    pub fn newest(limit: usize) -> Page<'static> {
        Page {
            limit,
            model: None,
            after: None,
            before: None,
        }
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
            shares: Vec::new(),
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
        let all = h.list(Page::newest(10));
        assert_eq!(
            all.iter().map(|e| e.seq).collect::<Vec<_>>(),
            vec![3, 4, 5],
            "bounded, renewals left out"
        );
        let of_a = Page {
            model: Some("a"),
            ..Page::newest(10)
        };
        assert_eq!(h.list(of_a).len(), 2);
        let after_4 = Page {
            after: Some(4),
            ..Page::newest(10)
        };
        assert_eq!(h.list(after_4).len(), 1);
        drop(h);
        let again = History::open(dir.path(), 3, 1 << 20).unwrap();
        assert_eq!(again.list(Page::newest(10)).last().unwrap().seq, 5);
        again
            .record(Timestamp::from_millis(10), &[transition("a")], false)
            .unwrap();
        assert_eq!(
            again.list(Page::newest(1))[0].seq,
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
        let seqs: Vec<u64> = h.list(Page::newest(10)).iter().map(|e| e.seq).collect();
        assert_eq!(seqs, vec![1, 2]);
    }

    fn seqs(entries: &[HistoryEntry]) -> Vec<u64> {
        entries.iter().map(|e| e.seq).collect()
    }

    #[test]
    fn after_is_a_cursor_and_before_pages_back() {
        let h = History::in_memory(10_000);
        for i in 0..10_000 {
            let model = if i % 3 == 0 { "a" } else { "b" };
            h.record(Timestamp::from_millis(i), &[transition(model)], false)
                .unwrap();
        }
        let page = |after, before, limit| Page {
            limit,
            model: None,
            after,
            before,
        };
        assert_eq!(seqs(&h.list(page(Some(20), None, 3))), vec![21, 22, 23]);
        assert_eq!(seqs(&h.list(page(None, Some(20), 3))), vec![17, 18, 19]);
        assert_eq!(seqs(&h.list(page(Some(5), Some(8), 10))), vec![6, 7]);
        assert_eq!(seqs(&h.list(page(None, None, 2))), vec![9_999, 10_000]);
        // Paging forward from the start reads every entry exactly once.
        let mut cursor = 0;
        let mut read = Vec::new();
        loop {
            let got = h.list(page(Some(cursor), None, 1000));
            let Some(last) = got.last() else { break };
            cursor = last.seq;
            read.extend(seqs(&got));
        }
        assert_eq!(read, (1..=10_000).collect::<Vec<_>>());
        // And backward, with a model filter.
        let mut cursor = u64::MAX;
        let mut back = Vec::new();
        loop {
            let p = Page {
                model: Some("a"),
                ..page(None, Some(cursor), 700)
            };
            let got = h.list(p);
            let Some(first) = got.first() else { break };
            cursor = first.seq;
            back.splice(0..0, seqs(&got));
        }
        assert_eq!(back, (1..=10_000).step_by(3).collect::<Vec<u64>>());
        assert_eq!(h.span(), Some((1, 10_000)));
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
