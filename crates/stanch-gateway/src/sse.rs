//! Reading an upstream's SSE stream event by event, to see what the caller is getting:
//! the final chunk, `[DONE]`, in-stream errors, and malformed chunks.

use std::borrow::Cow;
use std::sync::LazyLock;

use bytes::{Bytes, BytesMut};
use memchr::memmem::Finder;
use serde::Deserialize;
use serde::de::IgnoredAny;
use serde_json::Value;

/// One event of an upstream stream.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Event {
    /// A JSON chunk; `last` when it carries a `finish_reason`.
    Chunk {
        /// The event as received, with its blank line.
        raw: Bytes,
        /// It carries a `finish_reason`.
        last: bool,
    },
    /// `data: [DONE]`.
    Done,
    /// An OpenAI error object sent inside the stream.
    Error(String),
    /// A `data:` payload that is not JSON: dropped.
    Malformed,
    /// A comment or an event without data (heartbeats): passed on.
    Other(Bytes),
}

/// The largest event kept whole; a larger one is not a chunk of an answer, and holding
/// it would let one upstream grow the gateway's memory without bound.
const MAX_EVENT: usize = 1 << 20;

/// Splits bytes into events.
#[derive(Debug, Default)]
pub(crate) struct Parser {
    buf: BytesMut,
    /// How much of `buf` has been searched for an event's end, in vain.
    searched: usize,
    /// Inside an event too large to keep: its bytes are dropped until it ends.
    skipping: bool,
}

/// Where the first event in `buf` ends: after its blank line (`\n\n` or `\r\n\r\n`).
fn event_end(buf: &[u8]) -> Option<usize> {
    memchr::memchr_iter(b'\n', buf).find_map(|i| match buf.get(i + 1..) {
        Some([b'\n', ..]) => Some(i + 2),
        Some([b'\r', b'\n', ..]) => Some(i + 3),
        _ => None,
    })
}

impl Parser {
    /// Adds bytes; returns the events they complete.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<Event> {
        self.buf.extend_from_slice(chunk);
        let mut events = Vec::new();
        loop {
            // What was searched is not searched again, but for the two bytes a blank
            // line can straddle.
            let from = self.searched.saturating_sub(2);
            let Some(end) = event_end(&self.buf[from..]) else {
                self.searched = self.buf.len();
                if (self.skipping || self.buf.len() > MAX_EVENT) && self.buf.len() > 2 {
                    if !self.skipping {
                        events.push(Event::Malformed);
                        self.skipping = true;
                    }
                    // The last bytes may begin the blank line that ends it.
                    self.buf = self.buf.split_off(self.buf.len() - 2);
                    self.searched = 0;
                }
                return events;
            };
            let event = self.buf.split_to(from + end).freeze();
            self.searched = 0;
            if std::mem::take(&mut self.skipping) {
                continue; // the end of an event too large to keep
            }
            events.push(classify(event));
        }
    }
}

/// An error object in place of a chunk; read only when a chunk mentions `"error"`.
#[derive(Deserialize)]
struct ErrorPeek {
    #[serde(default)]
    error: Option<Value>,
}

/// Whether a chunk ends the answer: a `finish_reason` that is not `null`. Searched for
/// rather than parsed into a tree: the key cannot appear, unescaped, inside a string.
fn has_finish_reason(payload: &str) -> bool {
    const KEY: &[u8] = b"\"finish_reason\"";
    static FINDER: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(KEY));
    let bytes = payload.as_bytes();
    FINDER.find_iter(bytes).any(|at| {
        let rest = bytes[at + KEY.len()..].trim_ascii_start();
        rest.strip_prefix(b":")
            .is_some_and(|value| !value.trim_ascii_start().starts_with(b"null"))
    })
}

fn classify(raw: Bytes) -> Event {
    // JSON is UTF-8: an event that is not cannot be a chunk.
    let Ok(text) = std::str::from_utf8(&raw) else {
        return Event::Malformed;
    };
    // Nearly every event is `data: <one line>\n\n`: read that without splitting lines.
    if let Some(payload) = text
        .strip_prefix("data: ")
        .and_then(|t| t.strip_suffix("\n\n"))
        .filter(|p| memchr::memchr2(b'\n', b'\r', p.as_bytes()).is_none())
    {
        return classify_payload(payload, || raw.clone());
    }
    let mut data = text
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|d| d.strip_prefix(' ').unwrap_or(d));
    let Some(first) = data.next() else {
        return Event::Other(raw);
    };
    let payload: Cow<'_, str> = match data.next() {
        None => Cow::Borrowed(first),
        Some(second) => {
            let mut joined = format!("{first}\n{second}");
            for more in data {
                joined.push('\n');
                joined.push_str(more);
            }
            Cow::Owned(joined)
        }
    };
    let normalized = || {
        let mut normalized = BytesMut::with_capacity(payload.len() + 8);
        normalized.extend_from_slice(b"data: ");
        normalized.extend_from_slice(payload.as_bytes());
        normalized.extend_from_slice(b"\n\n");
        normalized.freeze()
    };
    classify_payload(&payload, normalized)
}

/// What the payload of a `data:` event is; `raw` gives the event as passed on:
/// `data: <payload>\n\n`, whatever line endings and spacing the upstream used.
fn classify_payload(payload: &str, raw: impl FnOnce() -> Bytes) -> Event {
    if payload.trim() == "[DONE]" {
        return Event::Done;
    }
    // A chunk is a JSON object; anything else in its place is malformed.
    if !payload.trim_start().starts_with('{') {
        return Event::Malformed;
    }
    // Well-formed JSON, checked without building anything.
    if serde_json::from_str::<IgnoredAny>(payload).is_err() {
        return Event::Malformed;
    }
    static ERROR: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"error\""));
    if ERROR.find(payload.as_bytes()).is_some() {
        if let Ok(ErrorPeek { error: Some(error) }) = serde_json::from_str(payload) {
            return Event::Error(
                error["message"]
                    .as_str()
                    .unwrap_or("upstream error in stream")
                    .to_owned(),
            );
        }
    }
    Event::Chunk {
        raw: raw(),
        last: has_finish_reason(payload),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_across_chunk_boundaries() {
        let mut p = Parser::default();
        assert!(
            p.push(
                b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"},\"finish_reason\":null}]}\n"
            )
            .is_empty()
        );
        let ev = p.push(b"\ndata: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n");
        assert!(matches!(ev[0], Event::Chunk { last: false, .. }));
        assert!(matches!(ev[1], Event::Chunk { last: true, .. }));
        assert_eq!(ev[2], Event::Done);
    }

    #[test]
    fn chunks_pass_on_as_sent_or_normalized() {
        let mut p = Parser::default();
        let sent =
            b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"},\"finish_reason\":null}]}\n\n";
        let ev = p.push(sent);
        assert_eq!(
            ev[0],
            Event::Chunk {
                raw: Bytes::from_static(sent),
                last: false
            }
        );
        let ev = p.push(b"data:{\"choices\":[]}\r\n\r\ndata: {\"a\":\ndata: 1}\n\n");
        assert_eq!(
            ev[0],
            Event::Chunk {
                raw: Bytes::from_static(b"data: {\"choices\":[]}\n\n"),
                last: false
            },
            "no space after the colon, CRLF: normalized"
        );
        assert_eq!(
            ev[1],
            Event::Chunk {
                raw: Bytes::from_static(b"data: {\"a\":\n1}\n\n"),
                last: false
            },
            "a payload over two data lines is one chunk"
        );
        for bad in [
            &b"data: [1, 2]\n\n"[..],
            b"data: \"text\"\n\n",
            b"data: {\"x\": \xff}\n\n",
        ] {
            assert_eq!(p.push(bad), vec![Event::Malformed], "{bad:?}");
        }
        let ev =
            p.push(b"data: {\"error\": null, \"choices\": [{\"finish_reason\": \"length\"}]}\n\n");
        assert!(
            matches!(ev[0], Event::Chunk { last: true, .. }),
            "a null error is no error"
        );
    }

    #[test]
    fn the_final_chunk_is_found_by_its_finish_reason() {
        for (payload, last) in [
            (r#"{"choices":[{"finish_reason":null}]}"#, false),
            (r#"{"choices":[{"finish_reason" : null}]}"#, false),
            (r#"{"choices":[{"finish_reason":"stop"}]}"#, true),
            (r#"{"choices":[{"finish_reason": "length"}]}"#, true),
            (
                r#"{"choices":[{"delta":{"content":"\"finish_reason\": \"stop\""}}]}"#,
                false,
            ),
            (r#"{"choices":[{"delta":{}}]}"#, false),
        ] {
            assert_eq!(has_finish_reason(payload), last, "{payload}");
        }
        let mut p = Parser::default();
        let ev = p.push(
            br#"data: {"choices":[{"delta":{"content":"error"},"error_rate":1}]}

"#,
        );
        assert!(
            matches!(ev[0], Event::Chunk { last: false, .. }),
            "a chunk is an error only when its top level says so: {ev:?}"
        );
    }

    #[test]
    fn an_event_too_large_is_dropped_whole() {
        let mut p = Parser::default();
        let huge = vec![b'x'; 64 * 1024];
        let mut events = p.push(b"data: {\"content\": \"");
        for _ in 0..20 {
            events.extend(p.push(&huge));
        }
        assert_eq!(events, vec![Event::Malformed], "counted once");
        assert!(p.buf.len() < 64, "and not held: {}", p.buf.len());
        let ev = p.push(b"xx\"}\n\ndata: {\"choices\":[]}\n\n");
        assert_eq!(ev.len(), 1, "its tail is dropped too: {ev:?}");
        assert!(matches!(ev[0], Event::Chunk { .. }));
        // A blank line split across pushes still ends an event.
        assert!(p.push(b"data: {}\r\n\r").is_empty());
        assert_eq!(p.push(b"\n").len(), 1);
    }

    #[test]
    fn malformed_errors_comments_and_crlf() {
        let mut p = Parser::default();
        let ev = p.push(b"data: {\"choices\": [{\"delta\n\n: heartbeat\n\ndata: {\"error\":{\"message\":\"overloaded\"}}\r\n\r\n");
        assert_eq!(ev[0], Event::Malformed);
        assert!(matches!(ev[1], Event::Other(_)));
        assert_eq!(ev[2], Event::Error("overloaded".into()));
    }
}
