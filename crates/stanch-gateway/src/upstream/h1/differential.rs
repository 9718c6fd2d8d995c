//! The upstream client held to hyper's: random and adversarial responses, read by this
//! module and by hyper's HTTP/1 client, give the same status, headers and body (or an
//! error from both) and the same decision on reusing the connection afterwards.
//!
//! Where the two differ on purpose, the difference is named in [`Differs`] with its
//! reason, and the test holds the gateway to its side of it:
//! - a response with a body and both `Transfer-Encoding` and `Content-Length` is read
//!   by both as the transfer coding says, but the gateway does not reuse its connection (RFC 9112 §6.1: such a
//!   message "ought to be handled as an error"; hyper keeps it);
//! - a bare LF ending the last-chunk line or a trailer line is refused here (RFC 9112
//!   §7.1: lines end in CRLF); hyper takes the LF for the start of a trailer line, and
//!   so can take a message that follows for trailers;
//! - `101 Switching Protocols`, which the gateway never asks for, is an error here and
//!   an upgrade in hyper (tested in `h1`'s own tests, not generated here).
//!
//! `STANCH_DIFF_CASES` sets the number of cases (default 2,000).

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use proptest::prelude::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

use super::*;

/// What a client made of a response.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Read {
    /// The final response: status, headers in order, the whole body.
    Answer {
        status: u16,
        headers: Vec<(String, Vec<u8>)>,
        body: Vec<u8>,
    },
    /// Refused or broken, at the head or in the body.
    Error,
}

/// A client's reading of a response, with the connection closed after it, and whether
/// it would reuse the connection had it stayed open.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Verdict {
    read: Read,
    reuse: bool,
}

fn headers_of(map: &HeaderMap) -> Vec<(String, Vec<u8>)> {
    map.iter()
        .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
        .collect()
}

/// This module's reading of `wire`, as `upstream` drives it.
fn ours(wire: &[u8]) -> Verdict {
    let error = Verdict {
        read: Read::Error,
        reuse: false,
    };
    let mut buf = BytesMut::from(wire);
    let Ok(Some(head)) = parse_head(&mut buf, &mut 0) else {
        // Refused, or the connection closed before a whole head.
        return error;
    };
    let mut framing = head.framing;
    let mut body = Vec::new();
    loop {
        match framing.decode(&mut buf) {
            Ok(Decoded::Data(data)) => body.extend_from_slice(&data),
            Err(_) => return error,
            Ok(ended) => {
                // At `End` the body is whole however the connection goes on. At `More`
                // an open connection would wait (no reuse); a closed one ends the body,
                // cleanly only when its framing says so.
                let reuse = ended == Decoded::End && framing.leaves_reusable(head.reusable, &buf);
                if ended != Decoded::End && framing.closed().is_err() {
                    return error;
                }
                return Verdict {
                    read: Read::Answer {
                        status: head.status.as_u16(),
                        headers: headers_of(&head.headers),
                        body,
                    },
                    reuse,
                };
            }
        }
    }
}

/// Plays the upstream: reads the request, writes `wire`, and then closes or holds the
/// connection open.
async fn upstream(mut io: DuplexStream, wire: Vec<u8>, close: bool) {
    let mut request = Vec::new();
    let mut chunk = [0u8; 1024];
    while !request.ends_with(b"\r\n\r\n{}") {
        match io.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => request.extend_from_slice(&chunk[..n]),
        }
    }
    if io.write_all(&wire).await.is_err() || close {
        return;
    }
    std::future::pending::<()>().await;
}

/// hyper's client's reading of `wire`: with the connection closed after it, or with
/// it held open, to see whether hyper would send another request on it.
async fn hyper_reads(wire: &[u8], close: bool) -> Verdict {
    let error = Verdict {
        read: Read::Error,
        reuse: false,
    };
    let (client, server) = tokio::io::duplex(1 << 20);
    let server = tokio::spawn(upstream(server, wire.to_vec(), close));
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(client))
            .await
            .expect("handshake on an in-memory stream");
    let conn = tokio::spawn(conn);
    let request = Request::post("/v1/chat/completions")
        .header(header::HOST, "upstream")
        .body(Full::new(Bytes::from_static(b"{}")))
        .expect("a request");
    let verdict = async {
        // Held open, a cut head is waited for until the timeout.
        let sent = tokio::time::timeout(Duration::from_secs(10), sender.send_request(request));
        let Ok(Ok(response)) = sent.await else {
            return error.clone();
        };
        let (parts, body) = response.into_parts();
        let Ok(Ok(body)) = tokio::time::timeout(Duration::from_secs(10), body.collect()).await
        else {
            // An error, or (held open) a body read until a close that never comes.
            return error.clone();
        };
        // Let the connection see whatever followed the response before asking.
        tokio::time::sleep(Duration::from_millis(10)).await;
        let reuse = !close
            && tokio::time::timeout(Duration::from_secs(1), sender.ready())
                .await
                .is_ok_and(|ready| ready.is_ok());
        Verdict {
            read: Read::Answer {
                status: parts.status.as_u16(),
                headers: headers_of(&parts.headers),
                body: body.to_bytes().to_vec(),
            },
            reuse,
        }
    }
    .await;
    server.abort();
    conn.abort();
    verdict
}

/// hyper's verdict: the reading with the connection closed after `wire`, the reuse
/// decision with it held open.
fn theirs(wire: &[u8]) -> Verdict {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let closed = hyper_reads(wire, true).await;
        let open = hyper_reads(wire, false).await;
        Verdict {
            read: closed.read,
            reuse: open.reuse,
        }
    })
}

/// A response to generate: a head built from realistic and adversarial parts, a body
/// framed as the head says (or not), and damage.
#[derive(Debug, Clone)]
struct Case {
    version: &'static str,
    informational: Vec<u16>,
    status: u16,
    connection: Option<&'static str>,
    other: Vec<(&'static str, &'static str)>,
    framing: Frame,
    data: Vec<u8>,
    /// Head lines end in a bare LF instead of CRLF.
    bare_lf_head: bool,
    /// Bytes after the response, which no request asked for.
    garbage: Option<&'static str>,
    /// The wire cut at this fraction of its length (per mille).
    cut: Option<u16>,
}

#[derive(Debug, Clone)]
enum Frame {
    /// `Content-Length` headers, written as given (`{n}` is the data's length).
    Length(Vec<&'static str>),
    /// `Transfer-Encoding` headers, with the data chunked when the last token is
    /// `chunked`, and perhaps a `Content-Length` too.
    Transfer {
        encodings: Vec<&'static str>,
        length_too: bool,
        chunks: ChunkStyle,
    },
    /// No framing header: the body runs until the connection closes.
    None,
}

#[derive(Debug, Clone)]
struct ChunkStyle {
    sizes: Vec<usize>,
    upper_hex: bool,
    leading_zeros: usize,
    space_before: bool,
    extension: Option<&'static str>,
    trailers: Vec<&'static str>,
    /// One line of the encoding ends in a bare LF instead of CRLF (its index).
    bare_lf_line: Option<usize>,
    /// The final CRLF is left out.
    no_final_crlf: bool,
}

/// Which documented difference a case falls under, if any.
#[derive(Debug, PartialEq, Eq)]
enum Differs {
    /// `Transfer-Encoding` and `Content-Length` together in HTTP/1.1.
    BothFramings,
    /// A bare LF at or after the last chunk.
    BareLfInTrailers,
}

impl Case {
    fn differs(&self) -> Option<Differs> {
        let has_body = ![204, 304].contains(&self.status);
        if let Frame::Transfer { chunks, .. } = &self.framing
            && has_body
            && self.version == "HTTP/1.1"
            && self.chunked()
            && chunks.encode(&self.data).1
        {
            return Some(Differs::BareLfInTrailers);
        }
        match &self.framing {
            Frame::Transfer {
                length_too: true, ..
            } if self.version == "HTTP/1.1" && has_body => Some(Differs::BothFramings),
            _ => None,
        }
    }

    /// Whether the body is chunked: the last transfer coding is `chunked`.
    fn chunked(&self) -> bool {
        match &self.framing {
            Frame::Transfer { encodings, .. } => encodings.last().is_some_and(|e| {
                e.rsplit(',')
                    .next()
                    .is_some_and(|t| t.trim().eq_ignore_ascii_case("chunked"))
            }),
            _ => false,
        }
    }

    fn wire(&self) -> Vec<u8> {
        let eol = if self.bare_lf_head { "\n" } else { "\r\n" };
        let mut head = String::new();
        for code in &self.informational {
            head.push_str(&format!("HTTP/1.1 {code} Info{eol}x-info: 1{eol}{eol}"));
        }
        head.push_str(&format!("{} {} Status{eol}", self.version, self.status));
        for (name, value) in &self.other {
            head.push_str(&format!("{name}: {value}{eol}"));
        }
        if let Some(c) = self.connection {
            head.push_str(&format!("connection: {c}{eol}"));
        }
        let n = self.data.len();
        let mut body = Vec::new();
        match &self.framing {
            Frame::Length(values) => {
                for v in values {
                    let v = v
                        .replace("{n}", &n.to_string())
                        .replace("{n+1}", &(n + 1).to_string());
                    head.push_str(&format!("content-length: {v}{eol}"));
                }
                body.extend_from_slice(&self.data);
            }
            Frame::Transfer {
                encodings,
                length_too,
                chunks,
            } => {
                for e in encodings {
                    head.push_str(&format!("transfer-encoding: {e}{eol}"));
                }
                if *length_too {
                    head.push_str(&format!("content-length: {n}{eol}"));
                }
                if self.chunked() {
                    body = chunks.encode(&self.data).0;
                } else {
                    body.extend_from_slice(&self.data);
                }
            }
            Frame::None => body.extend_from_slice(&self.data),
        }
        head.push_str(eol);
        let mut wire = head.into_bytes();
        wire.extend_from_slice(&body);
        if let Some(g) = self.garbage {
            wire.extend_from_slice(g.as_bytes());
        }
        if let Some(cut) = self.cut {
            wire.truncate(wire.len() * usize::from(cut) / 1000);
        }
        wire
    }
}

impl ChunkStyle {
    /// `data` chunked in this style, and whether a bare LF fell at or after the last
    /// chunk's line.
    fn encode(&self, data: &[u8]) -> (Vec<u8>, bool) {
        let mut lines: Vec<Vec<u8>> = Vec::new();
        let size_line = |len: usize| {
            let hex = if self.upper_hex {
                format!("{len:X}")
            } else {
                format!("{len:x}")
            };
            let mut line = format!("{}{hex}", "0".repeat(self.leading_zeros));
            if self.space_before {
                line.push(' ');
            }
            if let Some(e) = self.extension {
                line.push_str(e);
            }
            line.into_bytes()
        };
        let mut rest = data;
        for &size in self.sizes.iter().cycle() {
            if rest.is_empty() {
                break;
            }
            let (chunk, after) = rest.split_at(size.min(rest.len()));
            lines.push(size_line(chunk.len()));
            lines.push(chunk.to_vec());
            rest = after;
        }
        let last_chunk = lines.len();
        lines.push(size_line(0));
        for t in &self.trailers {
            lines.push(t.as_bytes().to_vec());
        }
        lines.push(Vec::new());
        let last = lines.len() - 1;
        let mut wire = Vec::new();
        for (i, line) in lines.into_iter().enumerate() {
            wire.extend_from_slice(&line);
            if i == last && self.no_final_crlf {
                break;
            }
            wire.extend_from_slice(if self.bare_lf_line == Some(i) {
                b"\n"
            } else {
                b"\r\n"
            });
        }
        let late_lf = self
            .bare_lf_line
            .is_some_and(|i| i >= last_chunk && i <= last);
        (wire, late_lf)
    }
}

fn chunk_style() -> impl Strategy<Value = ChunkStyle> {
    (
        proptest::collection::vec(1usize..20, 1..4),
        any::<bool>(),
        prop_oneof![6 => Just(0usize), 1 => 1usize..20],
        prop::bool::weighted(0.2),
        prop_oneof![
            6 => Just(None),
            1 => Just(Some(";a=b")),
            1 => Just(Some("; name=\"quoted value\"")),
            1 => Just(Some(";")),
        ],
        prop_oneof![
            6 => Just(vec![]),
            1 => Just(vec!["x-trailer: 1"]),
            1 => Just(vec!["x-a: 1", "x-b: 2"]),
            1 => Just(vec!["not a field"]),
        ],
        prop_oneof![8 => Just(None), 1 => (0usize..6).prop_map(Some)],
        prop::bool::weighted(0.1),
    )
        .prop_map(
            |(
                sizes,
                upper_hex,
                leading_zeros,
                space_before,
                extension,
                trailers,
                bare_lf_line,
                no_final_crlf,
            )| ChunkStyle {
                sizes,
                upper_hex,
                leading_zeros,
                space_before,
                extension,
                trailers,
                bare_lf_line,
                no_final_crlf,
            },
        )
}

fn frame() -> impl Strategy<Value = Frame> {
    let lengths = prop_oneof![
        6 => Just(vec!["{n}"]),
        1 => Just(vec!["{n}, {n}"]),
        1 => Just(vec!["{n}", "{n}"]),
        1 => Just(vec!["{n}", "{n+1}"]),
        1 => Just(vec!["{n+1}"]),
        1 => Just(vec!["abc"]),
        1 => Just(vec!["+1"]),
        1 => Just(vec!["-1"]),
        1 => Just(vec![""]),
        1 => Just(vec!["{n},"]),
    ];
    let encodings = prop_oneof![
        6 => Just(vec!["chunked"]),
        1 => Just(vec!["Chunked"]),
        1 => Just(vec!["gzip, chunked"]),
        1 => Just(vec!["chunked, gzip"]),
        1 => Just(vec!["gzip"]),
        1 => Just(vec!["gzip", "chunked"]),
        1 => Just(vec!["chunked", "gzip"]),
    ];
    prop_oneof![
        3 => lengths.prop_map(Frame::Length),
        3 => (encodings, prop::bool::weighted(0.15), chunk_style()).prop_map(
            |(encodings, length_too, chunks)| Frame::Transfer { encodings, length_too, chunks }
        ),
        1 => Just(Frame::None),
    ]
}

fn case() -> impl Strategy<Value = Case> {
    (
        prop_oneof![6 => Just("HTTP/1.1"), 1 => Just("HTTP/1.0")],
        proptest::collection::vec(prop::sample::select(vec![100u16, 102, 103]), 0..3),
        prop::sample::select(vec![200u16, 201, 204, 304, 400, 404, 413, 429, 500, 503]),
        prop_oneof![
            5 => Just(None),
            1 => Just(Some("close")),
            1 => Just(Some("keep-alive")),
            1 => Just(Some("Keep-Alive, Close")),
        ],
        prop::sample::subsequence(
            vec![
                ("x-request-id", "req_1"),
                ("openai-processing-ms", "7"),
                ("content-type", "application/json"),
                ("x-ratelimit-remaining-requests", "9999"),
            ],
            0..=4,
        ),
        frame(),
        proptest::collection::vec(prop::sample::select(b"ab{}\":,\r\n0 ".to_vec()), 0..40),
        prop::bool::weighted(0.1),
        prop_oneof![
            8 => Just(None),
            1 => Just(Some("x")),
            1 => Just(Some("HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")),
        ],
        prop_oneof![6 => Just(None), 1 => (0u16..1000).prop_map(Some)],
    )
        .prop_map(
            |(
                version,
                informational,
                status,
                connection,
                other,
                framing,
                data,
                bare_lf_head,
                garbage,
                cut,
            )| Case {
                version,
                informational,
                status,
                connection,
                other,
                framing,
                data,
                bare_lf_head,
                garbage,
                cut,
            },
        )
}

fn cases() -> u32 {
    std::env::var("STANCH_DIFF_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    /// The gateway's client reads every generated response as hyper's does, and
    /// reuses the connection exactly when hyper would, outside the documented
    /// differences, where it is the stricter.
    #[test]
    fn the_client_reads_and_reuses_as_hyper_does(case in case()) {
        let wire = case.wire();
        let (ours, theirs) = (ours(&wire), theirs(&wire));
        let shown = String::from_utf8_lossy(&wire);
        match case.differs() {
            None => prop_assert_eq!(&ours, &theirs, "{:?}", shown),
            Some(Differs::BareLfInTrailers) => {
                prop_assert_eq!(&ours.read, &Read::Error, "{:?}", shown);
            }
            Some(Differs::BothFramings) => {
                prop_assert_eq!(&ours.read, &theirs.read, "{:?}", shown);
                prop_assert!(!ours.reuse, "a response with both framings closes: {:?}", shown);
            }
        }
    }
}

/// The generator reaches what it is for: answers, errors, reuse and its refusal all
/// occur, so agreement above is not agreement on one kind of case.
#[test]
fn the_cases_cover_answers_errors_and_both_reuse_decisions() {
    use proptest::strategy::ValueTree;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let (mut answers, mut errors, mut reused, mut closed) = (0, 0, 0, 0);
    for _ in 0..400 {
        let case = case().new_tree(&mut runner).expect("a case").current();
        let verdict = ours(&case.wire());
        match verdict.read {
            Read::Answer { .. } => answers += 1,
            Read::Error => errors += 1,
        }
        if verdict.reuse {
            reused += 1;
        } else {
            closed += 1;
        }
    }
    for (what, n) in [
        ("answers", answers),
        ("errors", errors),
        ("reused", reused),
        ("closed", closed),
    ] {
        assert!(n >= 40, "{what}: {n} of 400");
    }
}
