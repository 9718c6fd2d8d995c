//! The tests of `buffered`.

use super::*;

#[derive(Clone, Default)]
struct Sink(Arc<Mutex<Vec<u8>>>, Arc<Mutex<Option<Duration>>>);

impl Write for Sink {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if let Some(stall) = *lock(&self.1) {
            std::thread::sleep(stall);
        }
        lock(&self.0).extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn text(sink: &Sink) -> String {
    String::from_utf8(lock(&sink.0).clone()).unwrap()
}

/// Runs `f(0)` to `f(n - 1)` on `n` threads, and joins them. Joined, not scoped: a
/// thread hands over its last lines as its thread-locals are destroyed, which a
/// scoped thread may do after its scope has ended; `join` waits for it.
fn on_threads(n: usize, f: impl Fn(usize) + Send + Sync + 'static) {
    let f = Arc::new(f);
    let threads: Vec<_> = (0..n)
        .map(|t| {
            let f = f.clone();
            std::thread::spawn(move || f(t))
        })
        .collect();
    for thread in threads {
        thread.join().expect("the thread ran");
    }
}

/// Four threads log 500 lines each through `limits`; returns the lines written,
/// sorted, and how many were dropped.
fn four_threads(limits: Limits) -> (Vec<String>, u64) {
    let sink = Sink::default();
    let (writer, flush) = Buffered::new(sink.clone(), limits);
    let logging = writer.clone();
    on_threads(4, move |t| {
        for i in 0..500 {
            let mut line = logging.make_writer();
            writeln!(line, "thread {t} line {i} {}", "x".repeat(i % 50)).unwrap();
        }
    });
    // The threads have ended, and handed over what they had not had written; with
    // the writer stopped, every line is in the sink.
    drop(flush);
    let mut lines: Vec<String> = text(&sink).lines().map(str::to_owned).collect();
    lines.sort();
    (lines, writer.dropped())
}

#[test]
fn lines_from_many_threads_arrive_whole_and_once() {
    let (lines, dropped) = four_threads(Limits::default());
    assert_eq!((lines.len(), dropped), (2000, 0), "every line, once");
    let mut unique = lines.clone();
    unique.dedup();
    assert_eq!(unique.len(), 2000);
    // Small buffers outrun the writer: each line is then written whole or counted.
    let small = Limits {
        buffer_bytes: 500,
        max_queued: 2,
        ..Limits::default()
    };
    let (lines, dropped) = four_threads(small);
    assert_eq!(lines.len() as u64 + dropped, 2000);
    assert!(
        lines
            .iter()
            .all(|l| l.starts_with("thread ") && l.contains(" line ")),
        "whole lines only"
    );
}

/// Buffers go round: however many are filled and handed over, the number made stays
/// at what the threads and the queue hold at once, and a thread's buffer never
/// grows (no reallocation, no new pages) while lines of ordinary length fill it.
#[test]
fn buffers_are_reused_not_made_anew() {
    let sink = Sink::default();
    let limits = Limits {
        buffer_bytes: 4096,
        max_queued: 4,
        ..Limits::default()
    };
    let (writer, flush) = Buffered::new(sink.clone(), limits);
    let logging = writer.clone();
    on_threads(4, move |t| {
        let buffer = logging.buffer();
        let capacity = lock(&buffer).capacity();
        for i in 0..5000 {
            let mut line = logging.make_writer();
            writeln!(line, "thread {t} line {i} {}", "x".repeat(i % 80)).unwrap();
            assert!(lock(&buffer).capacity() <= capacity, "the buffer grew");
        }
    });
    drop(flush);
    let written = text(&sink).lines().count() as u64;
    assert_eq!(written + writer.dropped(), 20_000);
    // 20,000 lines of ~50 bytes fill some 250 buffers of 4 KiB. At most the threads'
    // own, the queue, the writer's batch and the spares are alive at once; twice
    // that leaves room for a few freed when the spares overflowed.
    let made = writer.shared.made.load(Ordering::Relaxed);
    let alive = 4 + 2 * limits.max_queued + limits.max_queued + SPARE_BEYOND_QUEUE;
    assert!(
        made <= 2 * alive as u64,
        "{made} buffers made, for 250 filled"
    );
}

#[test]
fn lines_are_written_within_the_flush_interval_without_being_asked() {
    let sink = Sink::default();
    let limits = Limits {
        flush_every: Duration::from_millis(50),
        ..Limits::default()
    };
    let (writer, _flush) = Buffered::new(sink.clone(), limits);
    writeln!(writer.make_writer(), "one quiet line").unwrap();
    assert!(text(&sink).is_empty(), "buffered, not written at once");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(text(&sink), "one quiet line\n");
}

#[test]
#[expect(
    clippy::disallowed_methods,
    reason = "the writer is a thread, timed by the wall clock"
)]
fn a_stalled_output_costs_lines_never_the_logging_thread() {
    let sink = Sink::default();
    *lock(&sink.1) = Some(Duration::from_secs(2));
    let limits = Limits {
        buffer_bytes: 100,
        max_queued: 2,
        flush_every: Duration::from_secs(60),
    };
    let (writer, flush) = Buffered::new(sink.clone(), limits);
    let started = std::time::Instant::now();
    for i in 0..1000 {
        writeln!(writer.make_writer(), "line {i:04} padding padding padding").unwrap();
    }
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "{:?}",
        started.elapsed()
    );
    assert!(writer.dropped() > 900, "{} dropped", writer.dropped());
    *lock(&sink.1) = None;
    drop(flush);
    let written = text(&sink).lines().count() as u64;
    assert_eq!(
        written + writer.dropped(),
        1000,
        "each line written or counted"
    );
}

/// A thread that hands lines over after the writer stopped (it ended after the
/// process's stop) has them counted as dropped: every line is written or counted.
#[test]
fn lines_after_the_stop_are_counted_not_lost() {
    let sink = Sink::default();
    let (writer, flush) = Buffered::new(sink.clone(), Limits::default());
    writeln!(writer.make_writer(), "before the stop").unwrap();
    drop(flush);
    writer.shared.hand_over(b"late one\nlate two\n".to_vec());
    assert_eq!(text(&sink), "before the stop\n");
    assert_eq!(writer.dropped(), 2);
}

#[test]
fn warnings_are_handed_over_at_once_and_everything_is_written_at_the_end() {
    let sink = Sink::default();
    let limits = Limits {
        flush_every: Duration::from_secs(60),
        ..Limits::default()
    };
    let (writer, flush) = Buffered::new(sink.clone(), limits);
    let subscriber = tracing_subscriber::fmt()
        .with_writer(writer.clone())
        .with_ansi(false)
        .without_time()
        .finish();
    tracing::subscriber::with_default(subscriber, || {
        tracing::info!("routine");
        tracing::warn!("something is wrong");
    });
    std::thread::sleep(Duration::from_millis(200));
    let seen = text(&sink);
    assert!(
        seen.contains("routine") && seen.contains("something is wrong"),
        "{seen:?}"
    );
    writeln!(writer.make_writer(), "last words").unwrap();
    drop(flush);
    assert!(text(&sink).ends_with("last words\n"));
}
