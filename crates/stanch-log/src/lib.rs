//! How stanch's binaries log: one [`init`] for the controller, the gateway and the mock.
//!
//! Owns: the output format (text or JSON lines on standard error), colour (only when
//! standard error is a terminal, never into a file or a pipe), and escaping. Every
//! field value, the message included, is written with its control characters escaped
//! (`\n`, `\r`, `\t`, `\u{1b}`, ...), so a value that came from outside (an alert label,
//! an operator's reason, a request path) cannot forge a log line or a terminal escape.
//! JSON lines are escaped by JSON itself. Does not own what is logged.

pub mod buffered;

use std::fmt::{self, Write as _};
use std::io::IsTerminal;

use tracing::field::{Field, Visit};
use tracing_subscriber::field::RecordFields;
use tracing_subscriber::fmt::FormatFields;
use tracing_subscriber::fmt::format::Writer;

/// The log format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Format {
    /// `2026-11-30T00:00:00.000Z  INFO target: message key=value`, escaped.
    #[default]
    Text,
    /// One JSON object a line, for log shippers.
    Json,
}

impl std::str::FromStr for Format {
    type Err = String;

    fn from_str(s: &str) -> Result<Format, String> {
        match s {
            "text" => Ok(Format::Text),
            "json" => Ok(Format::Json),
            other => Err(format!("log format {other:?}: text or json")),
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
    fn field(&mut self, field: &Field, value: fmt::Arguments<'_>) {
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
            Escape(&mut self.writer).write_fmt(value)
        })();
    }
}

impl Visit for Visitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        // Strings as Display (no quotes), like tracing's own text format.
        self.field(field, format_args!("{value}"));
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.field(field, format_args!("{value}"));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.field(field, format_args!("{value:?}"));
    }
}

/// Writes through to `W`, escaping control characters.
struct Escape<'a, W>(&'a mut W);

impl<W: fmt::Write> fmt::Write for Escape<'_, W> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let mut rest = s;
        while let Some(at) = rest.find(char::is_control) {
            self.0.write_str(&rest[..at])?;
            let c = rest[at..].chars().next().expect("found a char there");
            match c {
                '\n' => self.0.write_str("\\n")?,
                '\r' => self.0.write_str("\\r")?,
                '\t' => self.0.write_str("\\t")?,
                other => write!(self.0, "\\u{{{:x}}}", u32::from(other))?,
            }
            rest = &rest[at + c.len_utf8()..];
        }
        self.0.write_str(rest)
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
}
