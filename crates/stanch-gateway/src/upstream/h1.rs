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

#[cfg(test)]
mod differential;

/// The longest response head accepted, status line and headers together.
pub(crate) const MAX_HEAD: usize = 64 * 1024;
/// The most response headers accepted (hyper's default too).
const MAX_HEADERS: usize = 100;
/// The most bytes of chunk extensions (`;name=value` after a chunk's size) accepted
/// over a whole body, as hyper's client accepts; extensions are read and ignored.
const MAX_EXTENSIONS: usize = 16 * 1024;
/// The most trailer bytes accepted after a chunked body, and the most trailer lines
/// (hyper's client's limits too). Trailers are checked, then dropped.
const MAX_TRAILERS: usize = 16 * 1024;
const MAX_TRAILER_LINES: usize = MAX_HEADERS;
/// The most informational (1xx) responses skipped before the final one.
const MAX_INFORMATIONAL: u32 = 16;

/// Why an exchange with an upstream failed; an I/O or parse error underneath is its
/// `source()`, which the log shows after it (`Failure`'s display, `stanch_log::Sources`).
#[derive(Debug, thiserror::Error)]
pub(crate) enum Error {
    /// Reading or writing the connection failed (a reset, a TLS alert).
    #[error("connection")]
    Io(#[source] std::io::Error),
    /// The connection closed before a whole response head arrived.
    #[error("the connection closed before a response")]
    ClosedBeforeResponse,
    /// The connection closed before the body's declared end.
    #[error("the connection closed before the end of the body")]
    ClosedInBody,
    /// The response head is not HTTP/1.x.
    #[error("malformed response head")]
    Parse(#[source] httparse::Error),
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
    /// `101 Switching Protocols`, which the gateway never asks for.
    #[error("an unrequested 101 Switching Protocols")]
    UnrequestedUpgrade,
    /// More informational (1xx) responses than [`MAX_INFORMATIONAL`] before a final one.
    #[error("more than {MAX_INFORMATIONAL} informational responses")]
    TooManyInformational,
    /// `Transfer-Encoding` in an HTTP/1.0 response, whose framing is then faulty
    /// (RFC 9112 §6.1).
    #[error("Transfer-Encoding in an HTTP/1.0 response")]
    TransferEncodingInHttp10,
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
/// and skipped (RFC 9110 §15.2: a client must accept them unasked), at most
/// [`MAX_INFORMATIONAL`] of them for one request, counted in `informational`; `101`
/// is refused, since the gateway never asks to switch protocols. Header values are
/// slices of the bytes read, not copies.
pub(crate) fn parse_head(
    buf: &mut BytesMut,
    informational: &mut u32,
) -> Result<Option<Head>, Error> {
    loop {
        let Some(head) = parse_one(buf)? else {
            return Ok(None);
        };
        if head.status == StatusCode::SWITCHING_PROTOCOLS {
            return Err(Error::UnrequestedUpgrade);
        }
        if head.status.is_informational() {
            *informational += 1;
            if *informational > MAX_INFORMATIONAL {
                return Err(Error::TooManyInformational);
            }
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
    let (framing, delimited) = framing(status, version, &headers)?;
    // Transfer-Encoding overrides Content-Length (RFC 9112 §6.3), and an intermediary
    // removes the Content-Length before passing the message on (§6.1).
    if headers.contains_key(header::TRANSFER_ENCODING) {
        headers.remove(header::CONTENT_LENGTH);
    }
    // RFC 9112 §9.3: `close` first, whatever else the header lists; then HTTP/1.1
    // persists, and HTTP/1.0 only with `keep-alive`.
    let persistent = !has_token(&headers, "close")
        && (version != Version::HTTP_10 || has_token(&headers, "keep-alive"));
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
fn framing(
    status: StatusCode,
    version: Version,
    headers: &HeaderMap,
) -> Result<(Framing, bool), Error> {
    if status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
    {
        return Ok((Framing::Length(0), true));
    }
    if version == Version::HTTP_10 && headers.contains_key(header::TRANSFER_ENCODING) {
        return Err(Error::TransferEncodingInHttp10);
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
            (Framing::Chunked(Chunked::default()), clean)
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

/// Where a chunked body's decoding stands, and how much of its bounds it has used.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Chunked {
    at: At,
    /// Bytes of chunk extensions so far.
    extensions: usize,
    /// The trailer section so far (kept to be checked whole, then dropped).
    trailers: Vec<u8>,
    trailer_lines: usize,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum At {
    /// Before a chunk-size line.
    #[default]
    Size,
    /// Inside a chunk, this many bytes of it still to come.
    Data(u64),
    /// After a chunk's data, before its CRLF.
    DataEnd,
    /// After the last chunk, among the trailer lines.
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
        match self {
            Framing::Length(n) => *n == 0,
            Framing::Chunked(c) => c.at == At::Done,
            Framing::UntilClose => false,
        }
    }

    /// Whether the connection may carry another request now: the response allows it
    /// (`reusable`, [`Head::reusable`]), its body has ended, and nothing else has
    /// arrived (`unread`: bytes no request asked for, which make it unusable).
    pub fn leaves_reusable(&self, reusable: bool, unread: &[u8]) -> bool {
        reusable && self.is_end() && unread.is_empty()
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
            Framing::Chunked(c) if c.at == At::Done => Some(0),
            _ => None,
        }
    }
}

impl Chunked {
    /// Decodes from `buf`; with `data` false, stops (giving `More`) at the first data
    /// rather than take it.
    ///
    /// Strictly as RFC 9112 §7.1 writes it, and as hyper's client reads it: every line
    /// ends in CRLF (a bare LF, accepted in heads, is refused here, where a lenient
    /// parser behind a strict one is how requests are smuggled), a chunk size is hex
    /// digits that fit in 64 bits, then optional spaces or tabs and extensions.
    fn decode(&mut self, buf: &mut BytesMut, data: bool) -> Result<Decoded, Error> {
        loop {
            match self.at {
                At::Size => {
                    let Some(line) =
                        crlf_line(buf, MAX_EXTENSIONS + 64, "a chunk-size line is too long")?
                    else {
                        return Ok(Decoded::More);
                    };
                    let (size, extensions) = chunk_size(&buf[..line])?;
                    self.extensions += extensions;
                    if self.extensions >= MAX_EXTENSIONS {
                        return Err(Error::Chunked("chunk extensions over 16 KiB"));
                    }
                    buf.advance(line + 2);
                    self.at = match size {
                        0 => At::Trailers,
                        n => At::Data(n),
                    };
                }
                At::Data(_) if !data || buf.is_empty() => return Ok(Decoded::More),
                At::Data(remaining) => {
                    let n = buf
                        .len()
                        .min(usize::try_from(remaining).unwrap_or(usize::MAX));
                    self.at = match remaining - n as u64 {
                        0 => At::DataEnd,
                        left => At::Data(left),
                    };
                    return Ok(Decoded::Data(buf.split_to(n).freeze()));
                }
                At::DataEnd => {
                    match buf.get(..2) {
                        Some(b"\r\n") => buf.advance(2),
                        None if buf.first().is_none_or(|&b| b == b'\r') => {
                            return Ok(Decoded::More);
                        }
                        _ => return Err(Error::Chunked("no CRLF after a chunk's data")),
                    }
                    self.at = At::Size;
                }
                At::Trailers => {
                    let room = MAX_TRAILERS - self.trailers.len();
                    const OVER: &str = "trailers over 16 KiB";
                    let Some(line) = crlf_line(buf, room, OVER)? else {
                        return Ok(Decoded::More);
                    };
                    if line + 2 > room {
                        return Err(Error::Chunked(OVER));
                    }
                    self.trailers.extend_from_slice(&buf[..line + 2]);
                    buf.advance(line + 2);
                    if line > 0 {
                        self.trailer_lines += 1;
                        if self.trailer_lines > MAX_TRAILER_LINES {
                            return Err(Error::Chunked("too many trailer lines"));
                        }
                        continue;
                    }
                    // The blank line: the trailers must be header fields.
                    let mut fields = [httparse::EMPTY_HEADER; MAX_TRAILER_LINES];
                    match httparse::parse_headers(&self.trailers, &mut fields) {
                        Ok(httparse::Status::Complete(_)) => {}
                        _ => return Err(Error::Chunked("malformed trailers")),
                    }
                    self.trailers = Vec::new();
                    self.at = At::Done;
                }
                At::Done => return Ok(Decoded::End),
            }
        }
    }
}

/// The length of the line at the start of `buf` without its CRLF, once it has one; an
/// error for a line longer than `limit`, or a CR or LF anywhere but at its end.
fn crlf_line(buf: &[u8], limit: usize, too_long: &'static str) -> Result<Option<usize>, Error> {
    let search = &buf[..buf.len().min(limit.saturating_add(2))];
    match memchr::memchr2(b'\r', b'\n', search) {
        Some(at) if search[at] == b'\n' => Err(Error::Chunked("a line ends in a bare LF")),
        Some(at) => match buf.get(at + 1) {
            Some(b'\n') => Ok(Some(at)),
            Some(_) => Err(Error::Chunked("a CR not followed by LF")),
            None => Ok(None),
        },
        None if buf.len() <= limit => Ok(None),
        None => Err(Error::Chunked(too_long)),
    }
}

/// The size in a chunk-size line (without its CRLF), and how many bytes of
/// extensions follow it: hex digits, optional spaces or tabs, then `;` and
/// extensions (ignored), or nothing.
fn chunk_size(line: &[u8]) -> Result<(u64, usize), Error> {
    let digits = line
        .iter()
        .position(|b| !b.is_ascii_hexdigit())
        .unwrap_or(line.len());
    if digits == 0 {
        return Err(Error::Chunked("invalid chunk size"));
    }
    let size = line[..digits].iter().try_fold(0u64, |n, &d| {
        let d = (d as char).to_digit(16).expect("a hex digit");
        n.checked_mul(16)?.checked_add(u64::from(d))
    });
    let size = size.ok_or(Error::Chunked("invalid chunk size"))?;
    let rest = &line[digits..];
    let spaces = rest
        .iter()
        .position(|&b| b != b' ' && b != b'\t')
        .unwrap_or(rest.len());
    match &rest[spaces..] {
        [] => Ok((size, 0)),
        [b';', extensions @ ..] => Ok((size, extensions.len())),
        _ => Err(Error::Chunked("invalid chunk size")),
    }
}

#[cfg(test)]
mod tests;
