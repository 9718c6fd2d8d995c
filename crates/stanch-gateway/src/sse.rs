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
}

/// The nesting of the containers a scan is inside: a bit per level, `true` for an
/// object; deeper than 64 levels, a vector takes over (never, in a real chunk).
#[derive(Default)]
struct Nesting {
    bits: u64,
    depth: usize,
    deeper: Vec<bool>,
}

impl Nesting {
    fn push(&mut self, object: bool) {
        if self.depth < 64 {
            self.bits = (self.bits & !(1 << self.depth)) | (u64::from(object) << self.depth);
        } else {
            self.deeper.push(object);
        }
        self.depth += 1;
    }

    /// Whether the innermost container is an object; `None` at the top level.
    fn top(&self) -> Option<bool> {
        match self.depth {
            0 => None,
            d if d <= 64 => Some(self.bits & (1 << (d - 1)) != 0),
            _ => self.deeper.last().copied(),
        }
    }

    fn pop(&mut self) {
        if self.depth > 64 {
            self.deeper.pop();
        }
        self.depth -= 1;
    }
}

// The scanner's helpers below are inlined into its loop by force: they run for every
// key and string of every event, and as calls they cost 4 % of a streamed answer's
// instructions (callgrind, `STREAM=1 scripts/bench-instructions.sh`).

/// JSON's insignificant whitespace.
#[inline(always)]
fn skip_ws(s: &[u8], mut i: usize) -> usize {
    while let Some(b' ' | b'\n' | b'\t' | b'\r') = s.get(i) {
        i += 1;
    }
    i
}

/// The end of the string whose opening quote is before `i`.
#[inline(always)]
fn string_end(s: &[u8], mut i: usize) -> Option<usize> {
    loop {
        i = next_special(s, i);
        match *s.get(i)? {
            b'"' => return Some(i + 1),
            b'\\' => {
                i += match *s.get(i + 1)? {
                    b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => 2,
                    b'u' if s.get(i + 2..i + 6)?.iter().all(u8::is_ascii_hexdigit) => 6,
                    _ => return None,
                };
            }
            // A control character, which must be escaped.
            _ => return None,
        }
    }
}

/// The first byte from `i` on that ends a string's plain run: a quote, a backslash
/// or a control character (`s.len()` if none). Eight bytes at a time: a byte below
/// 0x20, or equal to one of the two after an XOR, leaves a borrow in its top bit when
/// 0x01 is subtracted from every byte, and the lowest flagged byte is exact.
#[inline(always)]
fn next_special(s: &[u8], mut i: usize) -> usize {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const TOPS: u64 = 0x8080_8080_8080_8080;
    let below = |w: u64, n: u8| w.wrapping_sub(ONES * u64::from(n)) & !w & TOPS;
    while let Some(word) = s.get(i..i + 8) {
        let w = u64::from_le_bytes(word.try_into().expect("eight bytes"));
        let found = below(w ^ (ONES * u64::from(b'"')), 1)
            | below(w ^ (ONES * u64::from(b'\\')), 1)
            | below(w, 0x20);
        if found != 0 {
            return i + (found.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    while s
        .get(i)
        .is_some_and(|&b| b != b'"' && b != b'\\' && b >= 0x20)
    {
        i += 1;
    }
    i
}

/// The end of the number that starts at `i`: `-?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?`.
fn number_end(s: &[u8], mut i: usize) -> Option<usize> {
    let digits = |mut i: usize| {
        let start = i;
        while s.get(i).is_some_and(u8::is_ascii_digit) {
            i += 1;
        }
        (i > start).then_some(i)
    };
    if s.get(i) == Some(&b'-') {
        i += 1;
    }
    i = match *s.get(i)? {
        b'0' => i + 1,
        b'1'..=b'9' => digits(i)?,
        _ => return None,
    };
    if s.get(i) == Some(&b'.') {
        i = digits(i + 1)?;
    }
    if let Some(b'e' | b'E') = s.get(i) {
        i += 1;
        if let Some(b'+' | b'-') = s.get(i) {
            i += 1;
        }
        i = digits(i)?;
    }
    Some(i)
}

/// Reads an object key at `i` and its colon; returns where its value starts. Notes
/// the keys a [`Scan`] looks for.
#[inline(always)]
fn key(s: &[u8], i: usize, nesting: &Nesting, scan: &mut Scan) -> Option<usize> {
    if s.get(i) != Some(&b'"') {
        return None;
    }
    let end = string_end(s, i + 1)?;
    let colon = skip_ws(s, end);
    if s.get(colon) != Some(&b':') {
        return None;
    }
    let value = skip_ws(s, colon + 1);
    match &s[i + 1..end - 1] {
        b"finish_reason" if !s[value..].starts_with(b"null") => scan.finished = true,
        b"error" if nesting.depth == 1 => scan.error = true,
        _ => {}
    }
    Some(value)
}

/// Checks that `json` is one well-formed JSON value (RFC 8259: what serde_json
/// accepts), and reads what a [`Scan`] notes, in one pass and without building
/// anything. `None` when it is not JSON.
///
/// Every event of a stream passes through here; serde_json's validation followed by
/// separate searches for the keys cost half as much again per event.
fn scan(json: &str) -> Option<Scan> {
    let s = json.as_bytes();
    let mut out = Scan::default();
    let mut nesting = Nesting::default();
    let mut i = skip_ws(s, 0);
    loop {
        // A value starts at `i`.
        i = match *s.get(i)? {
            b'{' => {
                let inner = skip_ws(s, i + 1);
                if s.get(inner) == Some(&b'}') {
                    inner + 1
                } else {
                    nesting.push(true);
                    i = key(s, inner, &nesting, &mut out)?;
                    continue;
                }
            }
            b'[' => {
                let inner = skip_ws(s, i + 1);
                if s.get(inner) == Some(&b']') {
                    inner + 1
                } else {
                    nesting.push(false);
                    i = inner;
                    continue;
                }
            }
            b'"' => string_end(s, i + 1)?,
            b't' if s[i..].starts_with(b"true") => i + 4,
            b'f' if s[i..].starts_with(b"false") => i + 5,
            b'n' if s[i..].starts_with(b"null") => i + 4,
            b'-' | b'0'..=b'9' => number_end(s, i)?,
            _ => return None,
        };
        // After a value: containers close, or a comma leads to the next value.
        loop {
            i = skip_ws(s, i);
            let Some(object) = nesting.top() else {
                return (i == s.len()).then_some(out);
            };
            match *s.get(i)? {
                b',' => {
                    i = skip_ws(s, i + 1);
                    if object {
                        i = key(s, i, &nesting, &mut out)?;
                    }
                    break;
                }
                b'}' if object => {}
                b']' if !object => {}
                _ => return None,
            }
            nesting.pop();
            i += 1;
        }
    }
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
    if scan.error {
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
        last: scan.finished,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The events `data` completes, as one frame.
    fn push(p: &mut Parser, data: &[u8]) -> Vec<Event> {
        let mut events = Vec::new();
        p.push(Bytes::copy_from_slice(data), &mut events);
        events
    }

    #[test]
    fn events_across_chunk_boundaries() {
        let mut p = Parser::default();
        assert!(
            push(
                &mut p,
                b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"},\"finish_reason\":null}]}\n"
            )
            .is_empty()
        );
        let ev = push(&mut p, b"\ndata: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n");
        assert!(matches!(ev[0], Event::Chunk { last: false, .. }));
        assert!(matches!(ev[1], Event::Chunk { last: true, .. }));
        assert_eq!(ev[2], Event::Done);
    }

    #[test]
    fn whole_events_are_taken_from_the_frame_without_a_copy() {
        let mut p = Parser::default();
        let frame = Bytes::from_static(b"data: {\"a\":1}\n\ndata: {\"b\":2}\n\ndata: {\"c\"");
        let mut events = Vec::new();
        p.push(frame.clone(), &mut events);
        let Event::Chunk { raw, .. } = &events[1] else {
            panic!("{events:?}")
        };
        assert_eq!(raw.as_ptr(), frame[15..].as_ptr(), "a slice of the frame");
        assert_eq!(events.len(), 2, "the third is not complete");
        // The third ends with the next frame; the blank line may be split too.
        let mut events = Vec::new();
        p.push(Bytes::from_static(b":3}\n"), &mut events);
        assert!(events.is_empty());
        p.push(Bytes::from_static(b"\ndata: [DONE]\n\n"), &mut events);
        assert_eq!(
            events,
            [
                Event::Chunk {
                    raw: Bytes::from_static(b"data: {\"c\":3}\n\n"),
                    last: false
                },
                Event::Done
            ]
        );
    }

    #[test]
    fn chunks_pass_on_as_sent_or_normalized() {
        let mut p = Parser::default();
        let sent =
            b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"},\"finish_reason\":null}]}\n\n";
        let ev = push(&mut p, sent);
        assert_eq!(
            ev[0],
            Event::Chunk {
                raw: Bytes::from_static(sent),
                last: false
            }
        );
        let ev = push(
            &mut p,
            b"data:{\"choices\":[]}\r\n\r\ndata: {\"a\":\ndata: 1}\n\n",
        );
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
            assert_eq!(push(&mut p, bad), vec![Event::Malformed], "{bad:?}");
        }
        let ev = push(
            &mut p,
            b"data: {\"error\": null, \"choices\": [{\"finish_reason\": \"length\"}]}\n\n",
        );
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
            assert_eq!(scan(payload).map(|s| s.finished), Some(last), "{payload}");
        }
        let mut p = Parser::default();
        let ev = push(
            &mut p,
            br#"data: {"choices":[{"delta":{"content":"error"},"error_rate":1}]}

"#,
        );
        assert!(
            matches!(ev[0], Event::Chunk { last: false, .. }),
            "a chunk is an error only when its top level says so: {ev:?}"
        );
    }

    /// A small deterministic random source for the scanner's comparison with serde_json.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }

        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    /// A random JSON value, with the keys the scanner looks for among others.
    fn value(rng: &mut Rng, depth: usize) -> Value {
        const KEYS: [&str; 7] = [
            "finish_reason",
            "error",
            "choices",
            "delta",
            "",
            "a\"b",
            "é",
        ];
        const TEXT: [&str; 10] = [
            "",
            "hi",
            "tab\there",
            "\u{1}",
            "quote\"",
            "back\\slash",
            "日本",
            "😀/",
            "a longer run of plain text, then \"a quote\" and a \\ backslash",
            "Σ long enough to be read eight bytes at a time, and then some more",
        ];
        match rng.below(if depth > 4 { 5 } else { 8 }) {
            0 => Value::Null,
            1 => Value::Bool(rng.below(2) == 0),
            2 => serde_json::json!(rng.next() as i64 >> rng.below(64)),
            3 => serde_json::json!(
                (rng.next() as f64) / 3.7e9 * if rng.below(2) == 0 { -1.0 } else { 1e-7 }
            ),
            4 => Value::String(TEXT[rng.below(TEXT.len())].to_owned()),
            5 => Value::Array((0..rng.below(4)).map(|_| value(rng, depth + 1)).collect()),
            _ => Value::Object(
                (0..rng.below(5))
                    .map(|_| {
                        (
                            KEYS[rng.below(KEYS.len())].to_owned(),
                            value(rng, depth + 1),
                        )
                    })
                    .collect(),
            ),
        }
    }

    /// What the scanner should report of a well-formed value, read from its tree.
    fn expected(v: &Value) -> Scan {
        fn finished(v: &Value) -> bool {
            match v {
                Value::Object(m) => m
                    .iter()
                    .any(|(k, v)| (k == "finish_reason" && !v.is_null()) || finished(v)),
                Value::Array(a) => a.iter().any(finished),
                _ => false,
            }
        }
        Scan {
            finished: finished(v),
            error: v.as_object().is_some_and(|m| m.contains_key("error")),
        }
    }

    #[test]
    fn the_scanner_accepts_what_serde_json_accepts_and_nothing_else() {
        let mut rng = Rng(0x2545_f491_4f6c_dd1d);
        // Characters that matter to JSON's grammar, and some that do not.
        const NOISE: &[char] = &[
            '{', '}', '[', ']', '"', ',', ':', '\\', '/', ' ', '\n', '\t', '\r', '\u{1}', '0', '1',
            '9', '-', '+', '.', 'e', 'E', 't', 'f', 'n', 'u', 'l', 'x', 'é', '\u{a0}',
        ];
        let (mut valid, mut invalid) = (0, 0);
        for round in 0..3000 {
            let v = value(&mut rng, 0);
            let text = if round % 2 == 0 {
                serde_json::to_string(&v).unwrap()
            } else {
                serde_json::to_string_pretty(&v).unwrap()
            };
            assert_eq!(scan(&text), Some(expected(&v)), "{text}");
            valid += 1;
            let chars: Vec<char> = text.chars().collect();
            for _ in 0..12 {
                let mut m = chars.clone();
                let at = rng.below(m.len() + 1);
                match rng.below(4) {
                    0 if at < m.len() => {
                        m.remove(at);
                    }
                    1 if at < m.len() => m[at] = NOISE[rng.below(NOISE.len())],
                    2 => m.truncate(at),
                    _ => m.insert(at, NOISE[rng.below(NOISE.len())]),
                }
                let mutant: String = m.into_iter().collect();
                let serde = serde_json::from_str::<serde::de::IgnoredAny>(&mutant).is_ok();
                assert_eq!(scan(&mutant).is_some(), serde, "{mutant:?}");
                if serde {
                    // A tree of it, unless a number is beyond f64 (valid JSON all the same).
                    if let Ok(tree) = serde_json::from_str::<Value>(&mutant) {
                        assert_eq!(scan(&mutant), Some(expected(&tree)), "{mutant:?}");
                    }
                    valid += 1;
                } else {
                    invalid += 1;
                }
            }
        }
        assert!(
            valid > 5000 && invalid > 20_000,
            "{valid} valid, {invalid} not"
        );
    }

    #[test]
    fn the_scanner_takes_any_depth() {
        let deep = format!("{}1{}", "[{\"a\":".repeat(200), "}]".repeat(200));
        assert_eq!(scan(&deep), Some(Scan::default()));
        let unclosed = format!("{}{}", "[".repeat(100), "]".repeat(99));
        assert_eq!(scan(&unclosed), None);
        assert_eq!(scan(" {} "), Some(Scan::default()));
        for bad in [
            "", " ", "{} {}", "01", "1.", "-", "1e", "nul", "[1,]", "{\"a\"}", "\"\\x\"",
        ] {
            assert_eq!(scan(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn an_event_too_large_is_dropped_whole() {
        let mut p = Parser::default();
        let huge = vec![b'x'; 64 * 1024];
        let mut events = push(&mut p, b"data: {\"content\": \"");
        for _ in 0..20 {
            events.extend(push(&mut p, &huge));
        }
        assert_eq!(events, vec![Event::Malformed], "counted once");
        assert!(p.buf.len() < 64, "and not held: {}", p.buf.len());
        let ev = push(&mut p, b"xx\"}\n\ndata: {\"choices\":[]}\n\n");
        assert_eq!(ev.len(), 1, "its tail is dropped too: {ev:?}");
        assert!(matches!(ev[0], Event::Chunk { .. }));
        // A blank line split across pushes still ends an event.
        assert!(push(&mut p, b"data: {}\r\n\r").is_empty());
        assert_eq!(push(&mut p, b"\n").len(), 1);
    }

    #[test]
    fn malformed_errors_comments_and_crlf() {
        let mut p = Parser::default();
        let ev = push(&mut p, b"data: {\"choices\": [{\"delta\n\n: heartbeat\n\ndata: {\"error\":{\"message\":\"overloaded\"}}\r\n\r\n");
        assert_eq!(ev[0], Event::Malformed);
        assert!(matches!(ev[1], Event::Other(_)));
        assert_eq!(ev[2], Event::Error("overloaded".into()));
    }
}
