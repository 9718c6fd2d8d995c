//! Reading an upstream's SSE stream event by event, to see what the caller is getting:
//! the final chunk, `[DONE]`, in-stream errors, and malformed chunks.

use std::borrow::Cow;

use bytes::{Bytes, BytesMut};
use serde::Deserialize;
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
        /// What it says of the answer's text.
        text: Text,
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

/// What a chunk says of the answer's text, for a stream that may have to be continued
/// elsewhere (`super::resume`): found in the pass that checks the chunk, so that keeping
/// a transcript costs a copy of the text and nothing more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Text {
    /// Its first choice's text (`delta.content`, or `text` for completions) as a JSON
    /// string's body, escapes not decoded: a range of the event's bytes.
    pub(crate) at: Option<(u32, u32)>,
    /// The stream's `id`, likewise.
    pub(crate) id: Option<(u32, u32)>,
    /// Nothing but the first choice's text: no other choice, no tool or function
    /// call, no reasoning.
    pub(crate) plain: bool,
}

impl Text {
    /// A chunk without text.
    pub(crate) const NONE: Text = Text {
        at: None,
        id: None,
        plain: true,
    };
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
    /// Adds the bytes of one upstream frame; appends the events they complete to
    /// `events`. Whole events in a frame that does not continue an earlier one (the
    /// usual case: upstreams send an event per HTTP chunk) are taken from it as they
    /// are, without a copy.
    pub fn push(&mut self, data: Bytes, events: &mut Vec<Event>) {
        if self.buf.is_empty() && !self.skipping {
            let mut start = 0;
            while let Some(end) = event_end(&data[start..]) {
                events.push(classify(data.slice(start..start + end)));
                start += end;
            }
            if start == data.len() {
                return;
            }
            // The beginning of an event: kept until the rest arrives. It holds no
            // event's end, but for the blank line's first bytes.
            self.buf.extend_from_slice(&data[start..]);
            self.searched = self.buf.len();
        } else {
            self.buf.extend_from_slice(&data);
        }
        self.take_buffered(events);
    }

    /// The events complete in the buffer; what remains is the start of the next.
    fn take_buffered(&mut self, events: &mut Vec<Event>) {
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
                return;
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

/// An error object in place of a chunk; read only when a chunk has an `error` key.
#[derive(Deserialize)]
struct ErrorPeek {
    #[serde(default)]
    error: Option<Value>,
}

/// What a chunk says of itself, read in the pass that checks it is JSON.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Scan {
    /// A `finish_reason` key with a value other than `null`, at any depth: the
    /// chunk ends the answer.
    finished: bool,
    /// An `error` key at the top level: the chunk may be an error object.
    error: bool,
    /// The text, as ranges of the payload.
    text: Text,
}

impl Default for Text {
    fn default() -> Text {
        Text::NONE
    }
}

/// Checks that `json` is one well-formed JSON value and reads what a [`Scan`] notes,
/// in one pass and without building anything. `None` when it is not JSON.
///
/// Every event of a stream passes through here; serde_json's validation followed by
/// separate searches for the keys cost half as much again per event.
fn scan(json: &str) -> Option<Scan> {
    let s = json.as_bytes();
    let mut out = Scan::default();
    // The body of the string value at `value`, if it is one.
    let string = |value: usize| {
        (s.get(value) == Some(&b'"'))
            .then(|| crate::json::string_end(s, value + 1))
            .flatten()
            .map(|end| (value as u32 + 1, end as u32 - 1))
    };
    let null = |value: usize| s[value..].starts_with(b"null");
    // Depths count arrays too: the chunk's keys are at 1, a choice's at 3, its
    // delta's at 4.
    let well_formed = crate::json::walk(s, |depth, name, value| match (depth, name) {
        (_, b"finish_reason") if !null(value) => out.finished = true,
        (1, b"error") => out.error = true,
        (1, b"id") => out.text.id = string(value),
        (3, b"index")
            if s[value] != b'0'
                || matches!(s.get(value + 1), Some(b'0'..=b'9' | b'.' | b'e' | b'E')) =>
        {
            out.text.plain = false;
        }
        (3, b"text") | (4, b"content") => {
            if let Some(at) = string(value) {
                out.text.plain &= out.text.at.is_none();
                out.text.at = Some(at);
            }
        }
        (4, b"tool_calls" | b"function_call" | b"reasoning_content" | b"reasoning")
            if !null(value) =>
        {
            out.text.plain = false;
        }
        _ => {}
    });
    well_formed.then_some(out)
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
    let Some(scan) = scan(payload) else {
        return Event::Malformed;
    };
    if scan.error
        && let Ok(ErrorPeek { error: Some(error) }) = serde_json::from_str(payload)
    {
        return Event::Error(
            error["message"]
                .as_str()
                .unwrap_or("upstream error in stream")
                .to_owned(),
        );
    }
    // The event is `data: <payload>\n\n`: ranges of the payload move by its prefix.
    let shift = |r: Option<(u32, u32)>| r.map(|(a, b)| (a + 6, b + 6));
    Event::Chunk {
        raw: raw(),
        last: scan.finished,
        text: Text {
            at: shift(scan.text.at),
            id: shift(scan.text.id),
            plain: scan.text.plain,
        },
    }
}

#[cfg(test)]
mod tests;
