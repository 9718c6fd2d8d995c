//! Upstreams as HTTP/1.1 lets them answer: every framing of a body reaches the caller
//! whole, a connection is reused only when the answer allows it, and an answer that
//! breaks the protocol is the endpoint's failure, retried elsewhere.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::support::*;

/// A chat completion, as an upstream would send it.
const ANSWER: &str = r#"{"id":"c1","object":"chat.completion","created":1,"model":"qwen-72b","choices":[{"index":0,"message":{"role":"assistant","content":"framed"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#;

/// An upstream that answers every request with the same bytes, written as given.
struct Scripted {
    base: String,
    connections: Arc<AtomicU64>,
    requests: Arc<AtomicU64>,
    /// The body length of the last request read.
    body_len: Arc<AtomicU64>,
}

impl Scripted {
    /// Answers each request with `answer`; with `close`, then closes the connection.
    async fn start(answer: Vec<u8>, close: bool) -> Scripted {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let connections = Arc::new(AtomicU64::new(0));
        let requests = Arc::new(AtomicU64::new(0));
        let body_len = Arc::new(AtomicU64::new(0));
        let (c, r, b) = (connections.clone(), requests.clone(), body_len.clone());
        let answer = Arc::new(answer);
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                c.fetch_add(1, Ordering::Relaxed);
                let counts = (r.clone(), b.clone());
                tokio::spawn(serve(socket, answer.clone(), close, counts));
            }
        });
        Scripted {
            base,
            connections,
            requests,
            body_len,
        }
    }

    fn connections(&self) -> u64 {
        self.connections.load(Ordering::Relaxed)
    }

    fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }
}

/// Reads requests (head, then a `Content-Length` body) and answers each, counting them
/// and noting the length of the last body.
async fn serve(
    mut socket: TcpStream,
    answer: Arc<Vec<u8>>,
    close: bool,
    (requests, body_len): (Arc<AtomicU64>, Arc<AtomicU64>),
) {
    let mut buf = Vec::new();
    loop {
        let head_end = loop {
            if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break at + 4;
            }
            let mut chunk = [0u8; 4096];
            match socket.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .map_or(0, |v| v.trim().parse().unwrap());
        while buf.len() < head_end + length {
            let mut chunk = [0u8; 4096];
            match socket.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        buf.drain(..head_end + length);
        body_len.store(length as u64, Ordering::Relaxed);
        requests.fetch_add(1, Ordering::Relaxed);
        if socket.write_all(&answer).await.is_err() || close {
            return;
        }
    }
}

/// `ANSWER` in chunks of at most `size` bytes, with an extension and a trailer.
fn chunked(size: usize) -> Vec<u8> {
    chunked_answer(ANSWER, size)
}

/// `answer` in chunks of at most `size` bytes, with an extension and a trailer.
fn chunked_answer(answer: &str, size: usize) -> Vec<u8> {
    let mut wire =
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
            .to_vec();
    for chunk in answer.as_bytes().chunks(size) {
        wire.extend_from_slice(format!("{:x};part=1\r\n", chunk.len()).as_bytes());
        wire.extend_from_slice(chunk);
        wire.extend_from_slice(b"\r\n");
    }
    wire.extend_from_slice(b"0\r\nx-checksum: none\r\n\r\n");
    wire
}

fn with_length(status_line: &str, extra: &str) -> Vec<u8> {
    length_framed(status_line, extra, ANSWER)
}

/// An answer of `body`, framed by its length, with `extra` header lines.
fn length_framed(status_line: &str, extra: &str, body: &str) -> Vec<u8> {
    format!(
        "{status_line}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{extra}\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// A gateway with the model on `urls`, one pool each, in order.
async fn in_front_of(urls: &[&str]) -> Setup {
    in_front_of_with(urls, POLICY).await
}

/// As [`in_front_of`], with `policy` instead of the tests' usual one.
async fn in_front_of_with(urls: &[&str], policy: &str) -> Setup {
    let pools: String = urls
        .iter()
        .enumerate()
        .map(|(i, url)| format!("      - name: p{i}\n        endpoints: [{{url: '{url}'}}]\n"))
        .collect();
    let yaml = format!("models:\n  qwen-72b:\n    faq: default\n    pools:\n{pools}{policy}");
    gateway(&yaml, &[]).await
}

/// The content of the caller's answer; asserts it came from an upstream.
async fn content(gw: &Setup) -> String {
    let r = gw.chat("qwen-72b", false).await;
    assert_eq!(r.status(), 200);
    assert!(
        r.headers().get("x-llm-degraded").is_none(),
        "answered upstream"
    );
    let body: Value = r.json().await.unwrap();
    body["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned()
}

#[tokio::test]
async fn every_framing_reaches_the_caller_whole_and_keeps_what_can_be_kept() {
    // (wire, whether the upstream closes after it, connections for three requests)
    let cases: [(&str, Vec<u8>, bool, u64); 7] = [
        ("chunked, one byte a chunk", chunked(1), false, 1),
        ("chunked, 64 bytes a chunk", chunked(64), false, 1),
        ("a length", with_length("HTTP/1.1 200 OK", ""), false, 1),
        (
            "after an interim 100 Continue",
            [
                b"HTTP/1.1 100 Continue\r\n\r\n".to_vec(),
                with_length("HTTP/1.1 200 OK", ""),
            ]
            .concat(),
            false,
            1,
        ),
        // Said, and not done: the gateway closes it all the same.
        (
            "Connection: close, the upstream leaving it open",
            with_length("HTTP/1.1 200 OK", "connection: close\r\n"),
            false,
            3,
        ),
        (
            "HTTP/1.0 without keep-alive, the upstream leaving it open",
            with_length("HTTP/1.0 200 OK", ""),
            false,
            3,
        ),
        (
            "HTTP/1.0, until the connection closes",
            format!("HTTP/1.0 200 OK\r\ncontent-type: application/json\r\n\r\n{ANSWER}")
                .into_bytes(),
            true,
            3,
        ),
    ];
    for (case, wire, close, connections) in cases {
        let up = Scripted::start(wire, close).await;
        let gw = in_front_of(&[&up.base]).await;
        for _ in 0..3 {
            assert_eq!(content(&gw).await, "framed", "{case}");
        }
        assert_eq!(up.requests(), 3, "{case}: one attempt each");
        assert_eq!(up.connections(), connections, "{case}");
        let status = gw.status().await;
        assert_eq!(status["endpoints"][0]["failures"], 0, "{case}: {status}");
    }
}

#[tokio::test]
async fn an_answer_that_breaks_the_protocol_fails_over_and_counts_against_its_endpoint() {
    let broken: [(&str, Vec<u8>); 4] = [
        ("not HTTP", b"SSH-2.0-OpenSSH_9.6\r\n\r\n".to_vec()),
        (
            "two lengths",
            with_length("HTTP/1.1 200 OK", "content-length: 3\r\n"),
        ),
        (
            "a bad chunk size",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n".to_vec(),
        ),
        (
            "a body cut short",
            format!(
                "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{}",
                ANSWER.len(),
                &ANSWER[..20]
            )
            .into_bytes(),
        ),
    ];
    let good = Scripted::start(with_length("HTTP/1.1 200 OK", ""), false).await;
    for (case, wire) in broken {
        let bad = Scripted::start(wire, true).await;
        let gw = in_front_of(&[&bad.base, &good.base]).await;
        assert_eq!(
            content(&gw).await,
            "framed",
            "{case}: the next pool answered"
        );
        assert!(bad.requests() >= 1, "{case}: tried first");
        let status = gw.status().await;
        let failures = status["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["url"] == bad.base.as_str())
            .map(|e| e["failures"].as_u64().unwrap());
        assert!(failures >= Some(1), "{case}: counted, {status}");
    }
}

#[tokio::test]
async fn large_requests_and_answers_cross_in_many_reads_and_writes() {
    // A 3 MiB prompt (under the 4 MiB default limit) and a 2 MiB answer: far more than
    // one read or write of a socket either way.
    let prompt = "x".repeat(3 << 20);
    let text = "y".repeat(2 << 20);
    let answer = ANSWER.replace("framed", &text);
    let framings = [
        ("a length", length_framed("HTTP/1.1 200 OK", "", &answer)),
        ("8 KiB chunks", chunked_answer(&answer, 8 << 10)),
    ];
    for (case, wire) in framings {
        let up = Scripted::start(wire, false).await;
        let gw = in_front_of(&[&up.base]).await;
        for _ in 0..2 {
            let r = gw.chat_as("qwen-72b", false, "acme-key", &prompt).await;
            assert_eq!(r.status(), 200, "{case}");
            let body: Value = r.json().await.unwrap();
            let content = body["choices"][0]["message"]["content"].as_str().unwrap();
            assert!(
                content == text,
                "{case}: the whole answer (not printed: 2 MiB)"
            );
            assert!(
                up.body_len.load(Ordering::Relaxed) > 3 << 20,
                "{case}: the whole prompt went upstream"
            );
        }
        assert_eq!(
            (up.requests(), up.connections()),
            (2, 1),
            "{case}: one connection"
        );
    }
}

/// A streamed answer's head and chunks: a token, then the final chunk, and no
/// `[DONE]` or chunked terminator after it.
fn final_chunk_then_nothing() -> Vec<u8> {
    let event = |delta: &str, finish: &str| {
        format!(
            "data: {{\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"qwen-72b\",\"choices\":[{{\"index\":0,\"delta\":{delta},\"finish_reason\":{finish}}}]}}\n\n"
        )
    };
    let mut wire =
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            .to_vec();
    for event in [
        event(r#"{"content":"whole"}"#, "null"),
        event("{}", r#""stop""#),
    ] {
        wire.extend_from_slice(format!("{:x}\r\n{event}\r\n", event.len()).as_bytes());
    }
    wire
}

#[tokio::test]
async fn a_stream_whose_final_chunk_came_is_complete_however_the_upstream_stops() {
    // A long idle limit: the end must come from the final chunk, not from the stall.
    let policy = POLICY.replace("stream_idle: 400ms", "stream_idle: 5s");
    // The upstream goes quiet with the connection open, or closes it mid-body.
    for (case, close) in [("goes quiet", false), ("closes", true)] {
        let up = Scripted::start(final_chunk_then_nothing(), close).await;
        let gw = in_front_of_with(&[&up.base], &policy).await;
        let started = tokio::time::Instant::now();
        let text = gw.chat("qwen-72b", true).await.text().await.unwrap();
        let ev = events(&text);
        assert_eq!(crate::support::content(&ev), "whole", "{case}: {text}");
        assert_eq!(
            ev.last().map(String::as_str),
            Some("[DONE]"),
            "{case}: {text}"
        );
        assert!(!text.contains("stream_interrupted"), "{case}: {text}");
        assert!(
            started.elapsed() < std::time::Duration::from_secs(2),
            "{case}: promptly, not after the idle limit"
        );
        let status = gw.status().await;
        assert_eq!(status["endpoints"][0]["failures"], 0, "{case}: {status}");
    }
}

/// An upstream whose connections each answer one request, then, when the next request
/// arrives on them, close: at once (`partial` empty), as an upstream whose idle timeout
/// crossed the gateway's checkout does, or after writing `partial`.
async fn closing_after_one(partial: &'static [u8]) -> (String, Arc<AtomicU64>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let connections = Arc::new(AtomicU64::new(0));
    let count = connections.clone();
    let answer = with_length("HTTP/1.1 200 OK", "");
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            count.fetch_add(1, Ordering::Relaxed);
            let answer = answer.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65536];
                let mut requests = 0;
                loop {
                    // One read holds a small request whole here (loopback, one write).
                    match socket.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(_) => {}
                    }
                    requests += 1;
                    if requests == 1 {
                        socket.write_all(&answer).await.unwrap();
                    } else {
                        let _ = socket.write_all(partial).await;
                        return; // Closed, the request unanswered.
                    }
                }
            });
        }
    });
    (base, connections)
}

#[tokio::test]
async fn a_kept_alive_connection_closed_under_a_request_is_retried_on_a_new_one_and_not_counted() {
    let (base, connections) = closing_after_one(b"").await;
    let gw = in_front_of(&[&base]).await;
    for i in 0..6 {
        assert_eq!(content(&gw).await, "framed", "request {i}");
    }
    // Every request after the first met a connection closing under it.
    assert_eq!(connections.load(Ordering::Relaxed), 6);
    let status = gw.status().await;
    let endpoint = &status["endpoints"][0];
    assert_eq!(
        endpoint["failures"], 0,
        "the race is not the endpoint's failure: {endpoint}"
    );
    assert_eq!(endpoint["successes"], 6);
}

#[tokio::test]
async fn a_connection_closed_after_part_of_an_answer_is_the_endpoints_failure() {
    let (base, _) = closing_after_one(b"HTTP/1.1 200 OK\r\ncontent-length: 500\r\n").await;
    let gw = in_front_of(&[&base]).await;
    assert_eq!(content(&gw).await, "framed");
    // The second request's connection answers part of a head, then closes: that is
    // not the idle race, and it is not sent again on the quiet.
    let r = gw.chat("qwen-72b", false).await;
    let _ = r.text().await;
    let status = gw.status().await;
    assert!(
        status["endpoints"][0]["failures"].as_u64().unwrap() >= 1,
        "{status}"
    );
}
