//! A log writer that never makes the logging thread wait, as nginx's buffered access
//! log (`buffer=256k flush=1s`) does.
//!
//! Each thread appends its lines to a buffer of its own (a lock no other thread takes,
//! except the flusher once a second), with no system call. A writer thread writes every
//! buffer out once a second, and a buffer that fills up (256 KiB) or holds a warning or
//! an error is handed to it at once. If the writer falls so far behind that the queue of
//! handed-over buffers is full, the lines of a further buffer are dropped and counted
//! ([`Buffered::dropped`]): a slow disk or a stalled log pipe costs log lines, never
//! requests. Lines from different threads reach the output within a second of being
//! logged, each whole, but not necessarily in the order they were logged across
//! threads; on a crash, up to a second of lines is lost. [`Flush`] writes everything out
//! when the process ends normally.
//!
//! Buffers go round: one the writer has written out is emptied and given to the next
//! thread that hands one over, so a logging thread fills memory already in use. A
//! fresh buffer each time would cost the request that fills it reallocations as it
//! grows and a page fault for each new page, which is what a latency's tail is made of.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::Duration;

use tracing::{Level, Metadata};
use tracing_subscriber::fmt::MakeWriter;

/// How the buffered writer behaves.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// A thread's buffer is handed to the writer when it holds this much.
    pub buffer_bytes: usize,
    /// Every buffer is written out at least this often.
    pub flush_every: Duration,
    /// Handed-over buffers waiting for the writer at most; past it, lines are dropped.
    pub max_queued: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            buffer_bytes: 256 * 1024,
            flush_every: Duration::from_secs(1),
            max_queued: 16,
        }
    }
}

/// The `MakeWriter` to give tracing-subscriber. Clones share one writer thread.
#[derive(Clone)]
pub struct Buffered {
    shared: Arc<Shared>,
}

struct Shared {
    limits: Limits,
    /// Every thread's buffer, for the writer's round each second.
    threads: Mutex<Vec<Weak<Mutex<Vec<u8>>>>>,
    /// Buffers handed over, waiting to be written.
    queue: Mutex<Queue>,
    wake: Condvar,
    dropped: AtomicU64,
    /// Buffers written out and emptied, for reuse.
    spare: Mutex<Vec<Vec<u8>>>,
    /// Buffers made (tests: they should go round, not be made anew).
    #[cfg(test)]
    made: AtomicU64,
}

/// Emptied buffers kept for reuse at most, beyond `max_queued`; the rest are freed. As
/// many as can be queued, so that a writer catching up after a slow spell hands back
/// what the logging threads will need next, rather than freeing it for them to make
/// anew.
const SPARE_BEYOND_QUEUE: usize = 4;
/// Room in a buffer past `buffer_bytes`, for the line that crosses it.
const SLACK: usize = 16 * 1024;

#[derive(Default)]
struct Queue {
    full: Vec<Vec<u8>>,
    /// Set when the process ends: write everything and stop.
    closing: bool,
    /// Rounds finished, so [`Flush`] knows when its round is done.
    rounds: u64,
    /// A round has been asked for before the next tick.
    asked: bool,
    /// The writer has stopped: nothing handed over is written any more.
    closed: bool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One thread's lines not yet written.
type ThreadBuffer = Arc<Mutex<Vec<u8>>>;

/// A thread's buffers, one for each writer it has logged through.
#[derive(Default)]
struct Mine(Vec<(Weak<Shared>, ThreadBuffer)>);

impl Drop for Mine {
    /// A thread that ends hands over what it has not had written yet.
    fn drop(&mut self) {
        for (shared, buffer) in &self.0 {
            if let Some(shared) = shared.upgrade() {
                let lines = std::mem::take(&mut *lock(buffer));
                if !lines.is_empty() {
                    shared.hand_over(lines);
                }
            }
        }
    }
}

std::thread_local! {
    static MINE: std::cell::RefCell<Mine> = std::cell::RefCell::new(Mine::default());
}

impl Buffered {
    /// A writer to `out`, with its writer thread; the [`Flush`] writes everything out
    /// when dropped.
    pub fn new(out: impl Write + Send + 'static, limits: Limits) -> (Buffered, Flush) {
        let shared = Arc::new(Shared {
            limits,
            threads: Mutex::new(Vec::new()),
            queue: Mutex::new(Queue::default()),
            wake: Condvar::new(),
            dropped: AtomicU64::new(0),
            spare: Mutex::new(Vec::new()),
            #[cfg(test)]
            made: AtomicU64::new(0),
        });
        let writer = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("log-writer".into())
                .spawn(move || shared.run(out))
                .expect("the log writer thread starts")
        };
        let flush = Flush {
            shared: shared.clone(),
            writer: Some(writer),
        };
        (Buffered { shared }, flush)
    }

    /// Lines dropped because the writer could not keep up.
    pub fn dropped(&self) -> u64 {
        self.shared.dropped.load(Ordering::Relaxed)
    }

    /// This thread's buffer, registered with the writer the first time.
    fn buffer(&self) -> ThreadBuffer {
        MINE.with(|mine| {
            let mine = &mut mine.borrow_mut().0;
            if let Some((_, buf)) = mine
                .iter()
                .find(|(s, _)| std::ptr::eq(s.as_ptr(), Arc::as_ptr(&self.shared)))
            {
                return buf.clone();
            }
            mine.retain(|(s, _)| s.strong_count() > 0);
            let buf = Arc::new(Mutex::new(self.shared.empty_buffer()));
            lock(&self.shared.threads).push(Arc::downgrade(&buf));
            mine.push((Arc::downgrade(&self.shared), buf.clone()));
            buf
        })
    }
}

impl Shared {
    /// An empty buffer: a spare if there is one, else a new one with room for
    /// `buffer_bytes` and the line that crosses it.
    fn empty_buffer(&self) -> Vec<u8> {
        lock(&self.spare).pop().unwrap_or_else(|| {
            #[cfg(test)]
            self.made.fetch_add(1, Ordering::Relaxed);
            Vec::with_capacity(self.limits.buffer_bytes + SLACK)
        })
    }

    /// Keeps a buffer that has been written out (or dropped) for reuse.
    fn recycle(&self, mut buffer: Vec<u8>) {
        buffer.clear();
        let mut spare = lock(&self.spare);
        // One that grew for a very long line is not kept.
        let keep = self.limits.max_queued + SPARE_BEYOND_QUEUE;
        if spare.len() < keep && buffer.capacity() <= 2 * (self.limits.buffer_bytes + SLACK) {
            spare.push(buffer);
        }
    }

    /// Takes the whole lines out of `buffer` (everything, when `all`), leaving what
    /// follows the last newline in a spare buffer in its place.
    fn take_lines(&self, buffer: &mut Vec<u8>, all: bool) -> Option<Vec<u8>> {
        let whole = if all {
            buffer.len()
        } else {
            buffer
                .iter()
                .rposition(|&c| c == b'\n')
                .map_or(0, |p| p + 1)
        };
        if whole == 0 {
            return None;
        }
        let mut rest = self.empty_buffer();
        rest.extend_from_slice(&buffer[whole..]);
        buffer.truncate(whole);
        Some(std::mem::replace(buffer, rest))
    }

    /// Hands `lines` to the writer, or drops and counts them if it is too far behind.
    fn hand_over(&self, lines: Vec<u8>) {
        let mut queue = lock(&self.queue);
        if queue.closed || queue.full.len() >= self.limits.max_queued {
            drop(queue);
            let n = lines.iter().filter(|&&b| b == b'\n').count() as u64;
            self.dropped.fetch_add(n, Ordering::Relaxed);
            self.recycle(lines);
            return;
        }
        queue.full.push(lines);
        drop(queue);
        self.wake.notify_one();
    }

    /// The writer thread: writes handed-over buffers as they come, and every thread's
    /// buffer each `flush_every`, until closing.
    fn run(&self, mut out: impl Write) {
        loop {
            let (full, closing) = {
                let mut queue = lock(&self.queue);
                if queue.full.is_empty() && !queue.closing && !queue.asked {
                    queue = self
                        .wake
                        .wait_timeout(queue, self.limits.flush_every)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
                queue.asked = false;
                (std::mem::take(&mut queue.full), queue.closing)
            };
            for lines in full {
                let _ = out.write_all(&lines);
                self.recycle(lines);
            }
            self.round(&mut out, closing);
            let late = {
                let mut queue = lock(&self.queue);
                queue.rounds += 1;
                // What was handed over during the last round is written too; a line
                // handed over after that (a thread ending after the process's stop) is
                // counted as dropped, not lost unseen.
                queue.closed = closing;
                if closing {
                    std::mem::take(&mut queue.full)
                } else {
                    Vec::new()
                }
            };
            for lines in late {
                let _ = out.write_all(&lines);
            }
            let _ = out.flush();
            self.wake.notify_all();
            if closing {
                return;
            }
        }
    }

    /// Writes out the whole lines every thread's buffer holds (everything, when
    /// `last`), forgetting threads that ended.
    fn round(&self, out: &mut impl Write, last: bool) {
        let buffers: Vec<ThreadBuffer> = {
            let mut threads = lock(&self.threads);
            threads.retain(|t| t.strong_count() > 0);
            threads.iter().filter_map(Weak::upgrade).collect()
        };
        for buffer in buffers {
            // A thread may be between two writes of one line: that line waits.
            let Some(lines) = self.take_lines(&mut lock(&buffer), last) else {
                continue;
            };
            let _ = out.write_all(&lines);
            self.recycle(lines);
        }
    }
}

/// Writes everything out and stops the writer when dropped: hold it until the process
/// ends.
pub struct Flush {
    shared: Arc<Shared>,
    writer: Option<std::thread::JoinHandle<()>>,
}

impl Flush {
    /// Writes out everything logged so far, waiting for it (up to about a second):
    /// for tests, and before reading what was logged.
    pub fn now(&self) {
        let mut queue = lock(&self.shared.queue);
        // The round under way may have started before the last line; the next one
        // takes everything.
        let target = queue.rounds + 2;
        for _ in 0..20 {
            if queue.rounds >= target {
                return;
            }
            queue.asked = true;
            self.shared.wake.notify_all();
            queue = self
                .shared
                .wake
                .wait_timeout(queue, Duration::from_millis(50))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl Drop for Flush {
    fn drop(&mut self) {
        lock(&self.shared.queue).closing = true;
        self.shared.wake.notify_all();
        if let Some(writer) = self.writer.take() {
            let _ = writer.join();
        }
    }
}

/// One event's writes into this thread's buffer.
pub struct Line {
    shared: Arc<Shared>,
    buffer: ThreadBuffer,
    /// A warning or an error: handed to the writer at once, not at the next tick.
    urgent: bool,
}

impl Write for Line {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        let full = {
            let mut b = lock(&self.buffer);
            b.extend_from_slice(bytes);
            if b.len() >= self.shared.limits.buffer_bytes {
                // Whole lines only: what follows the last newline stays for the next.
                self.shared.take_lines(&mut b, false)
            } else {
                None
            }
        };
        if let Some(lines) = full {
            self.shared.hand_over(lines);
        }
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for Line {
    fn drop(&mut self) {
        if self.urgent {
            let lines = self.shared.take_lines(&mut lock(&self.buffer), true);
            if let Some(lines) = lines {
                self.shared.hand_over(lines);
            }
        }
    }
}

impl<'a> MakeWriter<'a> for Buffered {
    type Writer = Line;

    fn make_writer(&'a self) -> Line {
        Line {
            shared: self.shared.clone(),
            buffer: self.buffer(),
            urgent: false,
        }
    }

    fn make_writer_for(&'a self, meta: &Metadata<'_>) -> Line {
        let mut line = self.make_writer();
        line.urgent = *meta.level() <= Level::WARN;
        line
    }
}

#[cfg(test)]
mod tests;
