//! The tests of `h1`.

use super::*;

fn head(text: &str) -> Result<Option<Head>, Error> {
    parse_head(&mut BytesMut::from(text), &mut 0)
}

/// Decodes `wire` as a body framed by `framing`, fed to the decoder split at
/// `split` (the rest arriving afterwards); returns the data and whether it ended.
fn decode_split(mut framing: Framing, wire: &[u8], split: usize) -> (Vec<u8>, bool) {
    let mut buf = BytesMut::from(&wire[..split]);
    let mut data = Vec::new();
    let mut fed = false;
    loop {
        match framing.decode(&mut buf).unwrap() {
            Decoded::Data(d) => data.extend_from_slice(&d),
            Decoded::End => return (data, true),
            Decoded::More if fed => return (data, false),
            Decoded::More => {
                buf.extend_from_slice(&wire[split..]);
                fed = true;
            }
        }
    }
}

#[test]
fn a_request_head_carries_its_headers_and_body_length() {
    let request = Request::post("/openai/v1/chat/completions?x=1")
        .header(header::HOST, "up:8000")
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::CONTENT_LENGTH, "999")
        .header(header::CONNECTION, "close")
        .body(())
        .unwrap();
    let mut out = Vec::new();
    encode_head(&request, 1234, &mut out);
    assert_eq!(
        String::from_utf8(out).unwrap(),
        "POST /openai/v1/chat/completions?x=1 HTTP/1.1\r\nhost: up:8000\r\n\
             content-type: application/json\r\ncontent-length: 1234\r\n\r\n"
    );
    let mut out = Vec::new();
    encode_head(&Request::get("/v1/models").body(()).unwrap(), 0, &mut out);
    assert_eq!(out, b"GET /v1/models HTTP/1.1\r\n\r\n");
    let mut out = Vec::new();
    encode_head(&Request::post("/").body(()).unwrap(), 0, &mut out);
    assert_eq!(out, b"POST / HTTP/1.1\r\ncontent-length: 0\r\n\r\n");
}

#[test]
fn a_response_head_is_parsed_and_taken_out_of_the_buffer() {
    let mut buf = BytesMut::from(
        "HTTP/1.1 429 Too Many Requests\r\nRetry-After: 3\r\nContent-Length: 5\r\n\
             X-Rate-Limited: true\r\n\r\nhello",
    );
    let head = parse_head(&mut buf, &mut 0).unwrap().unwrap();
    assert_eq!(head.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(head.headers["retry-after"], "3");
    assert_eq!(head.headers["x-rate-limited"], "true");
    assert!(matches!(head.framing, Framing::Length(5)));
    assert!(head.reusable);
    assert_eq!(&buf[..], b"hello", "the body stays");
}

#[test]
fn a_head_split_anywhere_waits_for_the_rest() {
    let wire = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                    transfer-encoding: chunked\r\n\r\n";
    for split in 0..wire.len() {
        assert!(head(&wire[..split]).unwrap().is_none(), "split at {split}");
    }
    let head = head(wire).unwrap().unwrap();
    assert!(matches!(head.framing, Framing::Chunked(_)));
}

#[test]
fn bare_lf_heads_and_leading_blank_lines_are_read() {
    let mut buf = BytesMut::from("\r\nHTTP/1.1 200 OK\ncontent-length: 2\n\nok");
    let head = parse_head(&mut buf, &mut 0).unwrap().unwrap();
    assert!(matches!(head.framing, Framing::Length(2)));
    assert_eq!(&buf[..], b"ok");
    assert!(
        parse_head(&mut BytesMut::from("HTTP/1.1 200 OK\r\n\r"), &mut 0)
            .unwrap()
            .is_none()
    );
}

#[test]
fn informational_responses_are_skipped() {
    let mut buf = BytesMut::from(
        "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n\
             HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
    );
    let head = parse_head(&mut buf, &mut 0).unwrap().unwrap();
    assert_eq!(head.status, StatusCode::OK);
    assert!(buf.is_empty());
    // Only the 100 has arrived so far: it is taken, and the rest awaited.
    let mut buf = BytesMut::from("HTTP/1.1 100 Continue\r\n\r\n");
    let mut informational = 0;
    assert!(parse_head(&mut buf, &mut informational).unwrap().is_none());
    assert!(buf.is_empty());
    assert_eq!(informational, 1);
    // Bounded: an upstream cannot hold a request with 1xx answers forever, however
    // they arrive.
    let mut buf = BytesMut::new();
    let mut informational = 0;
    let mut result = Ok(None);
    for _ in 0..=MAX_INFORMATIONAL {
        buf.extend_from_slice(b"HTTP/1.1 102 Processing\r\n\r\n");
        result = parse_head(&mut buf, &mut informational);
    }
    assert!(
        matches!(result, Err(Error::TooManyInformational)),
        "{result:?}"
    );
    // 101 is never asked for.
    let upgrade = "HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\n\r\n";
    assert!(matches!(
        parse_head(&mut BytesMut::from(upgrade), &mut 0),
        Err(Error::UnrequestedUpgrade)
    ));
}

#[test]
fn transfer_encoding_overrides_content_length_and_removes_it() {
    let h = head("HTTP/1.1 200 OK\r\ncontent-length: 9\r\ntransfer-encoding: chunked\r\n\r\n")
        .unwrap()
        .unwrap();
    assert!(matches!(h.framing, Framing::Chunked(_)));
    assert!(!h.headers.contains_key(header::CONTENT_LENGTH));
    assert!(h.headers.contains_key(header::TRANSFER_ENCODING));
    assert!(
        !h.reusable,
        "a message with both is suspect: its connection closes"
    );
}

#[test]
fn connections_are_reused_only_when_the_response_allows() {
    let reusable = |text: &str| head(text).unwrap().unwrap().reusable;
    assert!(reusable("HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"));
    assert!(reusable("HTTP/1.1 204 No Content\r\n\r\n"));
    assert!(!reusable(
        "HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: keep-alive, Close\r\n\r\n"
    ));
    assert!(!reusable("HTTP/1.1 200 OK\r\n\r\n"), "read until close");
    assert!(!reusable("HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\n"));
    assert!(reusable(
        "HTTP/1.0 200 OK\r\ncontent-length: 2\r\nconnection: keep-alive\r\n\r\n"
    ));
    assert!(
        !reusable("HTTP/1.0 200 OK\r\ncontent-length: 2\r\nconnection: keep-alive, close\r\n\r\n"),
        "close wins"
    );
    assert!(!reusable(
        "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 2\r\n\r\n"
    ));
    assert!(!reusable(
        "HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n"
    ));
}

#[test]
fn bad_heads_are_refused_with_the_reason() {
    let error = |text: &str| head(text).unwrap_err().to_string();
    assert!(
        error("HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\n")
            .contains("Content-Length")
    );
    assert!(error("HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n").contains("Content-Length"));
    assert!(error("SMTP ready\r\n\r\n").contains("malformed response head"));
    assert!(error("HTTP/1.1 20 OK\r\n\r\n").contains("malformed response head"));
    // RFC 9112 §6.1: HTTP/1.0 has no transfer codings; the framing is faulty.
    assert!(
        error("HTTP/1.0 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 2\r\n\r\n")
            .contains("HTTP/1.0")
    );
    // A list of one length repeated is that length.
    let repeated = head("HTTP/1.1 200 OK\r\ncontent-length: 2, 2\r\n\r\n").unwrap();
    assert!(matches!(repeated.unwrap().framing, Framing::Length(2)));
    let many = format!(
        "HTTP/1.1 200 OK\r\n{}\r\n",
        "a: b\r\n".repeat(MAX_HEADERS + 1)
    );
    assert!(error(&many).contains("too many headers"));
    let long = format!("HTTP/1.1 200 OK\r\nx: {}", "a".repeat(MAX_HEAD));
    assert!(error(&long).contains("longer than"));
}

#[test]
fn a_length_body_ends_at_its_length_and_leaves_what_follows() {
    let mut framing = Framing::Length(5);
    let mut buf = BytesMut::from("helloEXTRA");
    assert_eq!(
        framing.decode(&mut buf).unwrap(),
        Decoded::Data("hello".into())
    );
    assert!(framing.finish(&mut buf));
    assert_eq!(framing.decode(&mut buf).unwrap(), Decoded::End);
    assert_eq!(&buf[..], b"EXTRA");
    for split in 0..=5 {
        assert_eq!(
            decode_split(Framing::Length(5), b"hello", split),
            (b"hello".to_vec(), true)
        );
    }
    assert!(Framing::Length(5).closed().is_err(), "closed early");
    assert!(Framing::UntilClose.closed().is_ok());
}

#[test]
fn a_chunked_body_split_anywhere_decodes_the_same() {
    let wire = b"6;ext=1\r\ndata: \r\n19\r\n{\"id\":1}\n\n{\"id\":2,\"ok\":1}\r\n0\r\nx-trailer: 1\r\n\r\n";
    let whole = b"data: {\"id\":1}\n\n{\"id\":2,\"ok\":1}".to_vec();
    for split in 0..=wire.len() {
        let framing = Framing::Chunked(Chunked::default());
        assert_eq!(
            decode_split(framing, wire, split),
            (whole.clone(), true),
            "split at {split}"
        );
    }
}

#[test]
fn the_end_of_a_chunked_body_is_seen_with_its_last_data() {
    let mut framing = Framing::Chunked(Chunked::default());
    let mut buf = BytesMut::from("5\r\n[DONE\r\n0\r\n\r\n");
    assert_eq!(
        framing.decode(&mut buf).unwrap(),
        Decoded::Data("[DONE".into())
    );
    assert!(framing.finish(&mut buf), "the terminator is already here");
    assert!(framing.is_end() && buf.is_empty());
    // Another chunk follows: not the end, and its data stays to be decoded.
    let mut framing = Framing::Chunked(Chunked::default());
    let mut buf = BytesMut::from("1\r\na\r\n1\r\nb\r\n");
    framing.decode(&mut buf).unwrap();
    assert!(!framing.finish(&mut buf));
    assert_eq!(framing.decode(&mut buf).unwrap(), Decoded::Data("b".into()));
}

/// `data` in chunked coding, cut into chunks of `sizes` (cycled).
fn chunked(data: &[u8], sizes: &[usize]) -> Vec<u8> {
    let mut wire = Vec::new();
    let mut rest = data;
    for &size in sizes.iter().cycle() {
        if rest.is_empty() {
            break;
        }
        let (chunk, after) = rest.split_at(size.min(rest.len()));
        wire.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
        wire.extend_from_slice(chunk);
        wire.extend_from_slice(b"\r\n");
        rest = after;
    }
    wire.extend_from_slice(b"0\r\n\r\n");
    wire
}

proptest::proptest! {
    /// Whatever an upstream sends, the gateway gets a head, a wait or an error,
    /// never a panic or a loop, and what it takes is what was sent: the buffer
    /// left is always the end of what arrived, a head is taken only with its
    /// blank line, and body data is the arrived bytes in order, never more of
    /// them than arrived.
    #[test]
    fn any_bytes_give_an_answer_or_an_error(
        bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..400),
        lines in proptest::collection::vec("[a-zA-Z-]{0,6}:? ?[ -~]{0,12}\r?\n", 0..6),
    ) {
        let head = format!("HTTP/1.1 200 OK\r\n{}\r\n", lines.concat());
        for input in [&bytes[..], head.as_bytes()] {
            let mut buf = BytesMut::from(input);
            let parsed = parse_head(&mut buf, &mut 0);
            proptest::prop_assert!(input.ends_with(&buf), "the rest is what followed");
            if let Ok(Some(_)) = parsed {
                let taken = &input[..input.len() - buf.len()];
                proptest::prop_assert!(taken.ends_with(b"\n\n") || taken.ends_with(b"\n\r\n"));
            }
        }
        let mut framing = Framing::Chunked(Chunked::default());
        let mut buf = BytesMut::from(&bytes[..]);
        let mut data = 0;
        let mut ended = false;
        for _ in 0..=bytes.len() + 1 {
            let before = buf.clone();
            match framing.decode(&mut buf) {
                Ok(Decoded::Data(d)) => {
                    // The data is the bytes just before what is left.
                    let at = before.len() - buf.len() - d.len();
                    proptest::prop_assert_eq!(&before[at..at + d.len()], &d[..]);
                    proptest::prop_assert!(!d.is_empty());
                    data += d.len();
                }
                Ok(Decoded::End) => { ended = true; break; }
                Ok(Decoded::More) | Err(_) => { ended = true; break; }
            }
            proptest::prop_assert!(bytes.ends_with(&buf));
        }
        proptest::prop_assert!(ended, "decoding stops within as many steps as bytes");
        proptest::prop_assert!(data + buf.len() <= bytes.len());
    }

    /// A chunked body decodes to what was sent, however it is cut into chunks and
    /// however its bytes arrive.
    #[test]
    fn chunked_bodies_round_trip(
        data in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300),
        sizes in proptest::collection::vec(1usize..64, 1..8),
        split in 0usize..600,
    ) {
        let wire = chunked(&data, &sizes);
        let split = split.min(wire.len());
        let framing = Framing::Chunked(Chunked::default());
        proptest::prop_assert_eq!(decode_split(framing, &wire, split), (data, true));
    }
}

#[test]
fn broken_chunked_framing_is_an_error() {
    let error = |wire: &str| {
        let mut framing = Framing::Chunked(Chunked::default());
        let mut buf = BytesMut::from(wire);
        loop {
            match framing.decode(&mut buf) {
                Err(e) => return e.to_string(),
                Ok(Decoded::Data(_)) => {}
                Ok(other) => panic!("{wire:?} gave {other:?}"),
            }
        }
    };
    assert!(error("zz\r\n").contains("invalid chunk size"));
    assert!(error("\r\n").contains("invalid chunk size"));
    assert!(
        error("10000000000000000\r\n").contains("invalid chunk size"),
        "over 64 bits"
    );
    assert!(error("2 x\r\n").contains("invalid chunk size"));
    // Every line ends in CRLF: a bare LF or a lone CR is refused wherever it is.
    for wire in [
        "2\nhi\r\n",
        "2\r\nhi\n0\r\n\r\n",
        "0\r\n\n",
        "0\r\nx: 1\n\r\n",
        "2;a\rb\r\n",
        "2\r\nhi\rX",
    ] {
        let e = error(wire);
        assert!(e.contains("LF") || e.contains("CR"), "{wire:?}: {e}");
    }
    // Bounded: extensions over the whole body, trailers in bytes and in lines.
    let extensions = format!("1;{}\r\na\r\n", "e".repeat(1000)).repeat(17);
    assert!(error(&extensions).contains("extensions"));
    let trailers = format!(
        "0\r\n{}",
        format!("x-t: {}\r\n", "a".repeat(1000)).repeat(20)
    );
    assert!(error(&trailers).contains("trailers over"));
    let lines = format!("0\r\n{}", "x: 1\r\n".repeat(MAX_TRAILER_LINES + 1));
    assert!(error(&lines).contains("too many trailer lines"));
    assert!(error("0\r\nnot a field\r\n\r\n").contains("malformed trailers"));
    assert!(error("2\r\nhiXX").contains("no CRLF"));
    assert!(error(&"0".repeat(MAX_EXTENSIONS + 100)).contains("too long"));
    let mut inside = Framing::Chunked(Chunked::default());
    let _ = inside.decode(&mut BytesMut::from("3\r\na"));
    assert!(inside.closed().is_err(), "closed inside a chunk");
}
