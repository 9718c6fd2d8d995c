//! How stanch's binaries log: one [`init`] for the controller, the gateway and the mock.
//!
//! Owns: the output format (text or JSON lines on standard error), colour (only when
//! standard error is a terminal, never into a file or a pipe), and escaping. Every
//! field value, the message included, is written with its control characters escaped
//! (`\n`, `\r`, `\t`, `\u{1b}`, ...), so a value that came from outside (an alert label,
//! an operator's reason, a request path) cannot forge a log line or a terminal escape.
//! JSON lines are escaped by JSON itself. Does not own what is logged.

pub mod buffered;

use std::cell::RefCell;
use std::fmt::{self, Write as _};
use std::io::IsTerminal;
use std::time::{Duration, SystemTime};

use tracing::field::{Field, Visit};
use tracing_subscriber::field::RecordFields;
use tracing_subscriber::fmt::FormatFields;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::FormatTime;

/// The log format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Format {
    /// `2026-11-30T00:00:00.000000Z  INFO target: message key=value`, escaped.
    #[default]
    Text,
    /// One JSON object a line, for log shippers.
    Json,
}

/// A log format that is neither `text` nor `json`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownFormat(String);

impl fmt::Display for UnknownFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "log format {:?}: text or json", self.0)
    }
}

impl std::error::Error for UnknownFormat {}

impl std::str::FromStr for Format {
    type Err = UnknownFormat;

    fn from_str(s: &str) -> Result<Format, UnknownFormat> {
        match s {
            "text" => Ok(Format::Text),
            "json" => Ok(Format::Json),
            other => Err(UnknownFormat(other.to_owned())),
        }
    }
}

/// The logging of a running process: hold it until the process ends, so that what is
/// buffered is written out.
pub struct Logging {
    writer: buffered::Buffered,
    _flush: buffered::Flush,
}

impl Logging {
    /// Lines dropped because standard error could not take them as fast as they came.
    pub fn dropped(&self) -> Dropped {
        Dropped(self.writer.clone())
    }
}

/// Reads how many log lines were dropped, for a metric.
#[derive(Clone)]
pub struct Dropped(buffered::Buffered);

impl Dropped {
    /// Lines dropped so far.
    pub fn get(&self) -> u64 {
        self.0.dropped()
    }
}

/// Installs the global subscriber: `RUST_LOG` filters (default `info`), standard error
/// is the output, through the buffered writer of [`buffered`]: a line costs the logging
/// thread a copy into its own buffer, never a system call or a wait.
pub fn init(format: Format) -> Logging {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let (writer, flush) = buffered::Buffered::new(std::io::stderr(), buffered::Limits::default());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_timer(Clock)
        .with_writer(writer.clone());
    match format {
        Format::Text => builder
            .with_ansi(std::io::stderr().is_terminal())
            .fmt_fields(Escaped)
            .init(),
        Format::Json => builder.json().flatten_event(true).init(),
    }
    Logging {
        writer,
        _flush: flush,
    }
}

/// Formats fields as `name=value`, the message bare, every value with its control
/// characters escaped.
#[derive(Debug, Clone, Copy, Default)]
pub struct Escaped;

impl<'writer> FormatFields<'writer> for Escaped {
    fn format_fields<R: RecordFields>(&self, writer: Writer<'writer>, fields: R) -> fmt::Result {
        let mut visitor = Visitor {
            writer,
            first: true,
            result: Ok(()),
        };
        fields.record(&mut visitor);
        visitor.result
    }
}

struct Visitor<'writer> {
    writer: Writer<'writer>,
    first: bool,
    result: fmt::Result,
}

impl Visitor<'_> {
    /// Writes ` name=` (the message bare), then the value with `value`.
    fn field(&mut self, field: &Field, value: impl FnOnce(&mut Writer<'_>) -> fmt::Result) {
        if self.result.is_err() {
            return;
        }
        let name = field.name();
        // `r#type` and the like are written as the field's plain name.
        let name = name.strip_prefix("r#").unwrap_or(name);
        self.result = (|| {
            if !self.first {
                self.writer.write_char(' ')?;
            }
            self.first = false;
            if name != "message" {
                self.writer.write_str(name)?;
                self.writer.write_char('=')?;
            }
            value(&mut self.writer)
        })();
    }
}

// Strings, numbers and booleans are written straight to the line; only what else is
// formatted goes through `fmt::Debug`. An access line is a dozen fields, so this is
// most of its cost.
impl Visit for Visitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        // Strings as Display (no quotes), like tracing's own text format.
        self.field(field, |w| Escape(w).write_str(value));
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.field(field, |w| w.write_str(itoa::Buffer::new().format(value)));
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.field(field, |w| w.write_str(itoa::Buffer::new().format(value)));
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.field(field, |w| w.write_str(if value { "true" } else { "false" }));
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.field(field, |w| write!(Escape(w), "{value}"));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.field(field, |w| write!(Escape(w), "{value:?}"));
    }
}

/// The first byte of `s` that may begin a control character: an ASCII control
/// (below 0x20, or DEL) or 0xC2, the lead byte of the C1 controls U+0080 to U+009F
/// (and of other characters, which the caller checks). A byte loop, not a loop over
/// `char`s: values are nearly always plain.
fn maybe_control(s: &str) -> Option<usize> {
    s.bytes().position(|b| b < 0x20 || b == 0x7f || b == 0xc2)
}

/// Writes through to `W`, escaping control characters.
struct Escape<'a, W>(&'a mut W);

impl<W: fmt::Write> fmt::Write for Escape<'_, W> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let mut rest = s;
        let mut from = 0;
        while let Some(at) = maybe_control(&rest[from..]).map(|i| from + i) {
            let c = rest[at..].chars().next().expect("a char starts there");
            if !c.is_control() {
                // 0xC2 leading a printable character (U+00A0 to U+00BF).
                from = at + c.len_utf8();
                continue;
            }
            self.0.write_str(&rest[..at])?;
            match c {
                '\n' => self.0.write_str("\\n")?,
                '\r' => self.0.write_str("\\r")?,
                '\t' => self.0.write_str("\\t")?,
                other => write!(self.0, "\\u{{{:x}}}", u32::from(other))?,
            }
            rest = &rest[at + c.len_utf8()..];
            from = 0;
        }
        self.0.write_str(rest)
    }
}

/// The time of a log line, UTC to the microsecond (`2026-11-30T00:00:00.000000Z`),
/// from the wall clock. The date and time to the second are formatted once a second on
/// each thread; a line writes only its microseconds.
#[derive(Debug, Clone, Copy, Default)]
pub struct Clock;

impl FormatTime for Clock {
    #[expect(
        clippy::disallowed_methods,
        reason = "a log line is stamped with the wall clock, whatever the engine's clock"
    )]
    fn format_time(&self, w: &mut Writer<'_>) -> fmt::Result {
        let since_epoch = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        write_time(w, since_epoch)
    }
}

/// Writes the time `since_epoch` after the Unix epoch as [`Clock`] does.
fn write_time(w: &mut impl fmt::Write, since_epoch: Duration) -> fmt::Result {
    std::thread_local! {
        /// The second last formatted, and its `YYYY-MM-DDTHH:MM:SS`.
        static SECOND: RefCell<(u64, String)> = const { RefCell::new((u64::MAX, String::new())) };
    }
    let seconds = since_epoch.as_secs();
    SECOND.with_borrow_mut(|(second, text)| {
        if *second != seconds {
            let t = i64::try_from(seconds)
                .ok()
                .and_then(|s| chrono::DateTime::from_timestamp(s, 0))
                .unwrap_or_default();
            *text = t.format("%Y-%m-%dT%H:%M:%S").to_string();
            *second = seconds;
        }
        w.write_str(text)
    })?;
    let micros = since_epoch.subsec_micros();
    let mut digits = *b".000000Z";
    for (i, d) in digits[1..7].iter_mut().enumerate() {
        *d = b'0' + (micros / 10u32.pow(5 - i as u32) % 10) as u8;
    }
    w.write_str(std::str::from_utf8(&digits).expect("ASCII digits"))
}

/// An error's causes below it, joined with `: `, for a log line's `source` field
/// beside the error itself (`error = %e, source = %Sources(&e)`): errors keep their
/// causes as sources rather than in their messages, and a log line shows them all.
pub struct Sources<'a>(pub &'a dyn std::error::Error);

impl fmt::Display for Sources<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut source = self.0.source();
        let mut first = true;
        while let Some(e) = source {
            if !first {
                f.write_str(": ")?;
            }
            write!(f, "{e}")?;
            first = false;
            source = e.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::io;
    use std::sync::{Arc, Mutex};

    use tracing_subscriber::fmt::MakeWriter;

    use super::*;

    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);

    impl io::Write for Buffer {
        fn write(&mut self, b: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    impl<'a> MakeWriter<'a> for Buffer {
        type Writer = Buffer;
        fn make_writer(&'a self) -> Buffer {
            self.clone()
        }
    }

    fn logged(f: impl FnOnce()) -> String {
        let buffer = Buffer::default();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(buffer.clone())
            .with_ansi(false)
            .fmt_fields(Escaped)
            .finish();
        tracing::subscriber::with_default(subscriber, f);
        String::from_utf8(buffer.0.lock().unwrap().clone()).unwrap()
    }

    #[test]
    fn values_from_outside_cannot_forge_lines_or_escapes() {
        let forged = "x\n2026-11-30T00:00:00Z ERROR stanch: FAKE INJECTED LINE";
        let text = logged(|| {
            let span = tracing::info_span!("http", path = %"/a\r\nb");
            let _entered = span.enter();
            tracing::info!(label = %forged, reason = "nul\0bell\u{7}esc\u{1b}[31m", debug = ?"q\n", "alert {}", "in\nmessage");
        });
        assert_eq!(text.lines().count(), 1, "{text}");
        assert!(
            !text.contains('\0') && !text.contains('\u{1b}') && !text.contains('\r'),
            "{text:?}"
        );
        assert!(
            text.contains(r"label=x\n2026-11-30T00:00:00Z ERROR stanch: FAKE"),
            "{text}"
        );
        assert!(
            text.contains(r"reason=nul\u{0}bell\u{7}esc\u{1b}[31m"),
            "{text}"
        );
        assert!(text.contains(r"alert in\nmessage"), "{text}");
        assert!(text.contains(r"path=/a\r\nb"), "{text}");
    }

    #[test]
    fn plain_values_are_written_as_they_are() {
        let text = logged(|| tracing::warn!(model = "qwen-72b", n = 3, ok = true, "ladder moved"));
        assert!(
            text.contains("ladder moved model=qwen-72b n=3 ok=true"),
            "{text}"
        );
    }

    /// The escaping as first written, one `char` at a time: the reference the fast
    /// scan is held to.
    fn escaped_by_chars(s: &str) -> String {
        let mut out = String::new();
        for c in s.chars() {
            match c {
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                c if c.is_control() => out.push_str(&format!("\\u{{{:x}}}", u32::from(c))),
                c => out.push(c),
            }
        }
        out
    }

    fn escaped(s: &str) -> String {
        let mut out = String::new();
        Escape(&mut out).write_str(s).unwrap();
        out
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]

        /// Any string, C1 controls and the printable characters that share their lead
        /// byte (U+00A0 to U+00BF) included, is escaped as the reference escapes it.
        #[test]
        fn the_byte_scan_escapes_as_the_char_loop_does(
            s in "(\\PC|[\\x00-\\x1f\\x7f\\u{80}-\\u{bf}\\u{2028}])*"
        ) {
            proptest::prop_assert_eq!(escaped(&s), escaped_by_chars(&s));
        }

        /// The cached per-second prefix and the written microseconds make what chrono
        /// writes, for any time in the years 1970 to 9999, in any order.
        #[test]
        fn the_clock_writes_what_chrono_writes(
            times in proptest::collection::vec((0u64..253_402_300_800, 0u32..1_000_000_000), 1..8)
        ) {
            for (seconds, nanos) in times {
                let mut out = String::new();
                write_time(&mut out, Duration::new(seconds, nanos)).unwrap();
                let expected = chrono::DateTime::from_timestamp(seconds as i64, nanos)
                    .unwrap()
                    .to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
                proptest::prop_assert_eq!(out, expected);
            }
        }
    }
}
