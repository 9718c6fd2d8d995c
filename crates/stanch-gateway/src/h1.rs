//! HTTP/1.1 as the gateway speaks it to upstreams, without I/O: a request's head
//! written into a buffer, a response head parsed out of one, and a response body's
//! framing (a length, chunks, or until the connection closes) decoded from what has
//! been read so far.
//!
//! Reading and writing connections, and keeping them, is `upstream`'s. Parsing a head
//! is httparse's, the parser hyper is built on; what is here is the rest of a client
//! (RFC 9112 §6 framing, §9 persistence), small enough that a request and its
//! connection are driven by the request's own task, with no connection task, channel
//! or hand-over between them. The gateway sends only `POST` and `GET`, never `HEAD`,
//! `CONNECT` or `Expect: 100-continue`, so their special cases are not handled.

use std::mem::MaybeUninit;

use bytes::{Buf, Bytes, BytesMut};
use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};
use hyper::{Request, StatusCode, Version};

/// The longest response head accepted, status line and headers together.
pub(crate) const MAX_HEAD: usize = 64 * 1024;
/// The most response headers accepted (hyper's default too).
const MAX_HEADERS: usize = 100;
/// The longest chunk-size or trailer line accepted.
const MAX_LINE: usize = 4 * 1024;

/// Why an exchange with an upstream failed. Each message carries its cause's, since
/// they are logged with `%` (so none is chained as a source as well).
#[derive(Debug, thiserror::Error)]
pub(crate) enum Error {
    /// Reading or writing the connection failed (a reset, a TLS alert).
    #[error("connection: {0}")]
    Io(std::io::Error),
    /// The connection closed before a whole response head arrived.
    #[error("the connection closed before a response")]
    ClosedBeforeResponse,
    /// The connection closed before the body's declared end.
    #[error("the connection closed before the end of the body")]
    ClosedInBody,
    /// The response head is not HTTP/1.x.
    #[error("malformed response head: {0}")]
    Parse(httparse::Error),
    /// The response head is HTTP/1.x, but not one the gateway accepts.
    #[error("malformed response head: {0}")]
    Head(&'static str),
    /// The response head is longer than [`MAX_HEAD`].
    #[error("response head longer than {MAX_HEAD} bytes")]
    HeadTooLarge,
    /// `Content-Length` is not a number, or two of them disagree.
    #[error("invalid Content-Length")]
    ContentLength,
    /// The chunked framing is broken.
    #[error("malformed chunked body: {0}")]
    Chunked(&'static str),
}

impl Error {
    /// Whether the connection was closed or reset under the request, as an upstream
    /// closing an idle keep-alive connection does (whether any answer came is for the
    /// caller to tell).
    pub(crate) fn is_closed_unread(&self) -> bool {
        use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset, UnexpectedEof};
        match self {
            Error::ClosedBeforeResponse => true,
            Error::Io(e) => matches!(
                e.kind(),
                BrokenPipe | ConnectionAborted | ConnectionReset | UnexpectedEof
            ),
            _ => false,
        }
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Error {
        Error::Io(e)
    }
}

/// Writes the head of `request` into `out`: request line, its headers, and the
/// `Content-Length` of its body (framing is this module's, so the caller's own
/// `Content-Length`, `Transfer-Encoding` or `Connection` headers are not sent).
pub(crate) fn encode_head<B>(request: &Request<B>, body_len: usize, out: &mut Vec<u8>) {
    out.extend_from_slice(request.method().as_str().as_bytes());
    out.push(b' ');
    let target = request.uri().path_and_query().map_or("/", |p| p.as_str());
    out.extend_from_slice(target.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    for (name, value) in request.headers() {
        if name == header::CONTENT_LENGTH
            || name == header::TRANSFER_ENCODING
            || name == header::CONNECTION
        {
            continue;
        }
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    if body_len > 0 || request.method() == hyper::Method::POST {
        out.extend_from_slice(b"content-length: ");
        push_decimal(out, body_len);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

fn push_decimal(out: &mut Vec<u8>, mut n: usize) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[i..]);
}

/// A response head.
#[derive(Debug)]
pub(crate) struct Head {
    pub status: StatusCode,
    pub version: Version,
    pub headers: HeaderMap,
    /// How the body that follows is framed.
    pub framing: Framing,
    /// Whether the connection may carry another request once the body has been read:
    /// HTTP/1.1 without `Connection: close` (HTTP/1.0 with `keep-alive`), and a body
    /// whose end the framing shows.
    pub reusable: bool,
}

/// Parses a response head from the start of `buf` and takes it out of `buf`;
/// `Ok(None)` while more bytes are needed. Informational (1xx) responses are taken out
/// and skipped. Header values are slices of the bytes read, not copies.
pub(crate) fn parse_head(buf: &mut BytesMut) -> Result<Option<Head>, Error> {
    loop {
        let Some(head) = parse_one(buf)? else {
            return Ok(None);
        };
        // 101 would switch protocols, which the gateway never asks for.
        if head.status.is_informational() && head.status != StatusCode::SWITCHING_PROTOCOLS {
            continue;
        }
        return Ok(Some(head));
    }
}

fn parse_one(buf: &mut BytesMut) -> Result<Option<Head>, Error> {
    // Blank lines before a response are skipped (RFC 9112 §2.2), as httparse does.
    let blank = buf
        .iter()
        .take_while(|&&b| b == b'\r' || b == b'\n')
        .count();
    buf.advance(blank);
    // The head is cut out of the buffer before it is parsed, so that header values
    // can be slices of it; it ends at its first empty line.
    let Some(len) = head_len(buf) else {
        return match buf.len() > MAX_HEAD {
            true => Err(Error::HeadTooLarge),
            false => Ok(None),
        };
    };
    if len > MAX_HEAD {
        return Err(Error::HeadTooLarge);
    }
    let bytes = buf.split_to(len).freeze();
    let mut slots = [const { MaybeUninit::uninit() }; MAX_HEADERS];
    let mut response = httparse::Response::new(&mut []);
    match httparse::ParserConfig::default().parse_response_with_uninit_headers(
        &mut response,
        &bytes,
        &mut slots,
    ) {
        Ok(httparse::Status::Complete(n)) if n == len => {}
        Ok(_) => return Err(Error::Head("the head ends inside a line")),
        Err(httparse::Error::TooManyHeaders) => return Err(Error::Head("too many headers")),
        Err(e) => return Err(Error::Parse(e)),
    }
    let status = response
        .code
        .and_then(|code| StatusCode::from_u16(code).ok())
        .ok_or(Error::Head("invalid status code"))?;
    let version = match response.version {
        Some(0) => Version::HTTP_10,
        _ => Version::HTTP_11,
    };
    let mut headers = HeaderMap::with_capacity(response.headers.len());
    for h in response.headers.iter() {
        let name = HeaderName::from_bytes(h.name.as_bytes())
            .map_err(|_| Error::Head("invalid header name"))?;
        let value = HeaderValue::from_maybe_shared(bytes.slice_ref(h.value))
            .map_err(|_| Error::Head("invalid header value"))?;
        headers.append(name, value);
    }
    let (framing, delimited) = framing(status, &headers)?;
    let persistent = match version {
        Version::HTTP_10 => has_token(&headers, "keep-alive"),
        _ => !has_token(&headers, "close"),
    };
    Ok(Some(Head {
        status,
        version,
        headers,
        framing,
        reusable: persistent && delimited,
    }))
}

/// The length of the head at the start of `buf`, through its empty line, once it has
/// one (lines end in CRLF, or in a bare LF, which httparse accepts too).
fn head_len(buf: &[u8]) -> Option<usize> {
    let mut line = 0;
    loop {
        let end = line + memchr::memchr(b'\n', &buf[line..])? + 1;
        match buf.get(end..)? {
            [b'\n', ..] => return Some(end + 1),
            [b'\r', b'\n', ..] => return Some(end + 2),
            [] | [b'\r'] => return None,
            _ => line = end,
        }
    }
}

/// Whether a `Connection` header lists `token`.
fn has_token(headers: &HeaderMap, token: &str) -> bool {
    headers.get_all(header::CONNECTION).iter().any(|v| {
        v.as_bytes()
            .split(|&b| b == b',')
            .any(|t| t.trim_ascii().eq_ignore_ascii_case(token.as_bytes()))
    })
}

/// The body's framing (RFC 9112 §6.3), and whether its end can be told without the
/// connection closing.
fn framing(status: StatusCode, headers: &HeaderMap) -> Result<(Framing, bool), Error> {
    if status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
    {
        return Ok((Framing::Length(0), true));
    }
    if let Some(last) = headers
        .get_all(header::TRANSFER_ENCODING)
        .iter()
        .next_back()
    {
        let chunked = last
            .as_bytes()
            .rsplit(|&b| b == b',')
            .next()
            .is_some_and(|t| t.trim_ascii().eq_ignore_ascii_case(b"chunked"));
        // With a Content-Length too, the message is suspect (§6.1): read it as chunked,
        // then close the connection.
        let clean = !headers.contains_key(header::CONTENT_LENGTH);
        return Ok(if chunked {
            (Framing::Chunked(Chunked::Size), clean)
        } else {
            (Framing::UntilClose, false)
        });
    }
    let mut length = None;
    for value in headers.get_all(header::CONTENT_LENGTH) {
        // A list of equal values is one length (§6.3, point 5).
        for part in value.as_bytes().split(|&b| b == b',') {
            let n = parse_decimal(part.trim_ascii()).ok_or(Error::ContentLength)?;
            if length.is_some_and(|l| l != n) {
                return Err(Error::ContentLength);
            }
            length = Some(n);
        }
    }
    Ok(match length {
        Some(n) => (Framing::Length(n), true),
        None => (Framing::UntilClose, false),
    })
}

fn parse_decimal(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() || digits.len() > 19 {
        return None;
    }
    digits.iter().try_fold(0u64, |n, &d| {
        d.is_ascii_digit().then(|| n * 10 + u64::from(d - b'0'))
    })
}

/// How a response body is delimited, and how much of it is still to come.
#[derive(Debug)]
pub(crate) enum Framing {
    /// This many bytes are still to come.
    Length(u64),
    /// Chunked transfer coding, at this point of it.
    Chunked(Chunked),
    /// Everything until the connection closes.
    UntilClose,
}

/// Where a chunked body's decoding stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Chunked {
    /// Before a chunk-size line.
    Size,
    /// Inside a chunk, this many bytes of it still to come.
    Data(u64),
    /// After a chunk's data, before its CRLF.
    DataEnd,
    /// After the last chunk, among the trailer lines (which are skipped).
    Trailers,
    /// After the blank line that ends the body.
    Done,
}

/// What decoding the buffered bytes gave.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Decoded {
    /// Bytes of the body.
    Data(Bytes),
    /// The body is complete.
    End,
    /// More must be read first.
    More,
}

impl Framing {
    /// Takes the next part of the body out of `buf`.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Decoded, Error> {
        match self {
            Framing::Length(0) => Ok(Decoded::End),
            Framing::Length(remaining) => {
                if buf.is_empty() {
                    return Ok(Decoded::More);
                }
                let n = buf
                    .len()
                    .min(usize::try_from(*remaining).unwrap_or(usize::MAX));
                *remaining -= n as u64;
                Ok(Decoded::Data(buf.split_to(n).freeze()))
            }
            Framing::UntilClose if buf.is_empty() => Ok(Decoded::More),
            Framing::UntilClose => Ok(Decoded::Data(buf.split().freeze())),
            Framing::Chunked(state) => state.decode(buf, true),
        }
    }

    /// Moves past whatever `buf` holds that ends the body without more data (a chunk's
    /// CRLF, the last chunk, trailers); true when the body is complete. Lets a
    /// connection go back for reuse as soon as its last data is taken.
    pub fn finish(&mut self, buf: &mut BytesMut) -> bool {
        match self {
            Framing::Length(remaining) => *remaining == 0,
            Framing::UntilClose => false,
            Framing::Chunked(state) => matches!(state.decode(buf, false), Ok(Decoded::End)),
        }
    }

    /// Whether the body is complete.
    pub fn is_end(&self) -> bool {
        matches!(self, Framing::Length(0) | Framing::Chunked(Chunked::Done))
    }

    /// The connection closed: the end of a body read until then, else an error.
    pub fn closed(&self) -> Result<(), Error> {
        match self {
            Framing::UntilClose => Ok(()),
            _ if self.is_end() => Ok(()),
            _ => Err(Error::ClosedInBody),
        }
    }

    /// The bytes still to come, when known.
    pub fn remaining(&self) -> Option<u64> {
        match self {
            Framing::Length(n) => Some(*n),
            Framing::Chunked(Chunked::Done) => Some(0),
            _ => None,
        }
    }
}

impl Chunked {
    /// Decodes from `buf`; with `data` false, stops (giving `More`) at the first data
    /// rather than take it.
    fn decode(&mut self, buf: &mut BytesMut, data: bool) -> Result<Decoded, Error> {
        loop {
            match *self {
                Chunked::Size => {
                    let Some(end) = line_end(buf)? else {
                        return Ok(Decoded::More);
                    };
                    let size = chunk_size(&buf[..end])?;
                    buf.advance(end + 1);
                    *self = if size == 0 {
                        Chunked::Trailers
                    } else {
                        Chunked::Data(size)
                    };
                }
                Chunked::Data(_) if !data || buf.is_empty() => return Ok(Decoded::More),
                Chunked::Data(remaining) => {
                    let n = buf
                        .len()
                        .min(usize::try_from(remaining).unwrap_or(usize::MAX));
                    *self = match remaining - n as u64 {
                        0 => Chunked::DataEnd,
                        left => Chunked::Data(left),
                    };
                    return Ok(Decoded::Data(buf.split_to(n).freeze()));
                }
                Chunked::DataEnd => {
                    match buf.first() {
                        None => return Ok(Decoded::More),
                        Some(b'\n') => buf.advance(1),
                        Some(b'\r') if buf.len() < 2 => return Ok(Decoded::More),
                        Some(b'\r') if buf[1] == b'\n' => buf.advance(2),
                        Some(_) => return Err(Error::Chunked("no CRLF after a chunk's data")),
                    }
                    *self = Chunked::Size;
                }
                Chunked::Trailers => {
                    let Some(end) = line_end(buf)? else {
                        return Ok(Decoded::More);
                    };
                    let blank = buf[..end].iter().all(|&b| b == b'\r');
                    buf.advance(end + 1);
                    if blank {
                        *self = Chunked::Done;
                    }
                }
                Chunked::Done => return Ok(Decoded::End),
            }
        }
    }
}

/// Where the line at the start of `buf` ends (its `\n`), once it has.
fn line_end(buf: &[u8]) -> Result<Option<usize>, Error> {
    match memchr::memchr(b'\n', buf) {
        Some(end) if end <= MAX_LINE => Ok(Some(end)),
        None if buf.len() <= MAX_LINE => Ok(None),
        _ => Err(Error::Chunked("a chunk-size or trailer line is too long")),
    }
}

/// The size in a chunk-size line (hex digits, then optional extensions, which are
/// ignored).
fn chunk_size(line: &[u8]) -> Result<u64, Error> {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let digits = line
        .iter()
        .position(|b| !b.is_ascii_hexdigit())
        .unwrap_or(line.len());
    let rest = line[digits..].trim_ascii_start();
    if digits == 0 || digits > 15 || !(rest.is_empty() || rest[0] == b';') {
        return Err(Error::Chunked("invalid chunk size"));
    }
    Ok(line[..digits].iter().fold(0u64, |n, &d| {
        n * 16 + u64::from((d as char).to_digit(16).expect("a hex digit"))
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(text: &str) -> Result<Option<Head>, Error> {
        parse_head(&mut BytesMut::from(text))
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
        let head = parse_head(&mut buf).unwrap().unwrap();
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
        assert!(matches!(head.framing, Framing::Chunked(Chunked::Size)));
    }

    #[test]
    fn bare_lf_heads_and_leading_blank_lines_are_read() {
        let mut buf = BytesMut::from("\r\nHTTP/1.1 200 OK\ncontent-length: 2\n\nok");
        let head = parse_head(&mut buf).unwrap().unwrap();
        assert!(matches!(head.framing, Framing::Length(2)));
        assert_eq!(&buf[..], b"ok");
        assert!(
            parse_head(&mut BytesMut::from("HTTP/1.1 200 OK\r\n\r"))
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
        let head = parse_head(&mut buf).unwrap().unwrap();
        assert_eq!(head.status, StatusCode::OK);
        assert!(buf.is_empty());
        // Only the 100 has arrived so far: it is taken, and the rest awaited.
        let mut buf = BytesMut::from("HTTP/1.1 100 Continue\r\n\r\n");
        assert!(parse_head(&mut buf).unwrap().is_none());
        assert!(buf.is_empty());
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
            let framing = Framing::Chunked(Chunked::Size);
            assert_eq!(
                decode_split(framing, wire, split),
                (whole.clone(), true),
                "split at {split}"
            );
        }
        // Bare LF line ends are read too.
        let framing = Framing::Chunked(Chunked::Size);
        assert_eq!(
            decode_split(framing, b"2\nhi\n0\n\n", 8),
            (b"hi".to_vec(), true)
        );
    }

    #[test]
    fn the_end_of_a_chunked_body_is_seen_with_its_last_data() {
        let mut framing = Framing::Chunked(Chunked::Size);
        let mut buf = BytesMut::from("5\r\n[DONE\r\n0\r\n\r\n");
        assert_eq!(
            framing.decode(&mut buf).unwrap(),
            Decoded::Data("[DONE".into())
        );
        assert!(framing.finish(&mut buf), "the terminator is already here");
        assert!(framing.is_end() && buf.is_empty());
        // Another chunk follows: not the end, and its data stays to be decoded.
        let mut framing = Framing::Chunked(Chunked::Size);
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
        /// Whatever an upstream sends, the gateway gets a head, a wait or an error:
        /// never a panic, never a loop.
        #[test]
        fn any_bytes_give_an_answer_or_an_error(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..400),
            lines in proptest::collection::vec("[a-zA-Z-]{0,6}:? ?[ -~]{0,12}\r?\n", 0..6),
        ) {
            let _ = parse_head(&mut BytesMut::from(&bytes[..]));
            let head = format!("HTTP/1.1 200 OK\r\n{}\r\n", lines.concat());
            let _ = parse_head(&mut BytesMut::from(head.as_str()));
            let mut framing = Framing::Chunked(Chunked::Size);
            let mut buf = BytesMut::from(&bytes[..]);
            for _ in 0..=bytes.len() {
                if !matches!(framing.decode(&mut buf), Ok(Decoded::Data(_))) {
                    break;
                }
            }
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
            let framing = Framing::Chunked(Chunked::Size);
            proptest::prop_assert_eq!(decode_split(framing, &wire, split), (data, true));
        }
    }

    #[test]
    fn broken_chunked_framing_is_an_error() {
        let error = |wire: &str| {
            let mut framing = Framing::Chunked(Chunked::Size);
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
        assert!(error("1000000000000000\r\n").contains("invalid chunk size"));
        assert!(error("2\r\nhiXX").contains("no CRLF"));
        assert!(error(&"f".repeat(MAX_LINE + 1)).contains("too long"));
        assert!(Framing::Chunked(Chunked::Data(3)).closed().is_err());
    }
}
