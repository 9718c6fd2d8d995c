//! Reading an upstream's SSE stream event by event, to see what the caller is getting:
//! the final chunk, `[DONE]`, in-stream errors, and malformed chunks.

use bytes::Bytes;
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

/// Splits bytes into events.
#[derive(Debug, Default)]
pub(crate) struct Parser {
    buf: Vec<u8>,
}

fn boundary(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|i| (i, 2));
    let crlf = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| (i, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

impl Parser {
    /// Adds bytes; returns the events they complete.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<Event> {
        self.buf.extend_from_slice(chunk);
        let mut events = Vec::new();
        while let Some((at, len)) = boundary(&self.buf) {
            let raw: Vec<u8> = self.buf.drain(..at + len).collect();
            events.push(classify(&raw));
        }
        events
    }
}

fn classify(raw: &[u8]) -> Event {
    let text = String::from_utf8_lossy(raw);
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|d| d.strip_prefix(' ').unwrap_or(d))
        .collect();
    if data.is_empty() {
        return Event::Other(Bytes::copy_from_slice(raw));
    }
    let payload = data.join("\n");
    if payload.trim() == "[DONE]" {
        return Event::Done;
    }
    match serde_json::from_str::<Value>(&payload) {
        Ok(v) if v.get("error").is_some_and(|e| !e.is_null()) => Event::Error(
            v["error"]["message"]
                .as_str()
                .unwrap_or("upstream error in stream")
                .to_owned(),
        ),
        Ok(v) if v.is_object() => {
            let last = v["choices"].as_array().is_some_and(|cs| {
                cs.iter()
                    .any(|c| c.get("finish_reason").is_some_and(|f| !f.is_null()))
            });
            // Normalized to "\n\n", whatever the upstream used.
            let mut raw = format!("data: {payload}").into_bytes();
            raw.extend_from_slice(b"\n\n");
            Event::Chunk {
                raw: Bytes::from(raw),
                last,
            }
        }
        _ => Event::Malformed,
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
    fn malformed_errors_comments_and_crlf() {
        let mut p = Parser::default();
        let ev = p.push(b"data: {\"choices\": [{\"delta\n\n: heartbeat\n\ndata: {\"error\":{\"message\":\"overloaded\"}}\r\n\r\n");
        assert_eq!(ev[0], Event::Malformed);
        assert!(matches!(ev[1], Event::Other(_)));
        assert_eq!(ev[2], Event::Error("overloaded".into()));
    }
}
