//! Connections to upstreams: each endpoint keeps its own pool of HTTP/1.1 keep-alive
//! connections, plain or TLS, and a request is exchanged on one by the task that sends
//! it.
//!
//! An endpoint is one address, so its pool is a stack of idle connections and nothing
//! more: no key to hash, no shared map to lock across endpoints. A connection goes back
//! on the stack when its response body has been read to the end (at once, when the
//! whole body came with the head, as a small answer does), and the newest idle one is
//! reused first, so a burst's extra connections age out while the busy few stay warm.
//!
//! There is no task per connection: the request's task writes the request, reads the
//! head, and whoever reads the body reads the connection (`h1` frames it). A request
//! and its upstream exchange therefore run on one thread without a hand-over between
//! tasks. Idle connections are kept a shelf per worker thread, and each worker takes its
//! own first; another worker's idle connection is still better than a new one.
//!
//! Upstreams close idle keep-alive connections on their own schedule (uvicorn, hence
//! vLLM, after 5 s). Nothing reads an idle connection, so a request never goes out on
//! one without first looking whether it has closed (a read that finds nothing to read
//! costs no system call: the runtime already knows the socket is not readable), nor on
//! one idle longer than `idle_timeout`, which should stay below the upstreams'
//! keep-alive; [`Pool::sweep`], run every second, closes the ones the upstream has
//! closed or that have aged out, so none lingers half-closed.

pub(crate) mod h1;

use std::collections::VecDeque;
use std::io::IoSlice;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll, Waker, ready};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use hyper::body::{Body as HttpBody, Frame, SizeHint};
use hyper::header::HeaderValue;
use hyper::{Request, Response};
use prometheus_client::metrics::counter::Counter;
use rustls::pki_types::ServerName;
use secrecy::{ExposeSecret, SecretString};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;
use tokio_util::either::Either;

use crate::per_worker::PerWorker;
use h1::{Decoded, Framing};

/// Idle connections kept per endpoint and worker thread at most; a burst beyond this
/// opens and closes.
const MAX_IDLE: usize = 256;
/// The least time between two warnings about an endpoint's TLS failures.
const TLS_WARNING_EVERY: Duration = Duration::from_secs(60);
/// A connection's read buffer grows by this much when it has less than
/// [`READ_ROOM`] free: answers are read in one piece, and the buffer's bytes (heads
/// and bodies are handed on as slices of it, not copies) serve many answers before
/// a new one is needed.
const READ_CHUNK: usize = 16 * 1024;
/// The least free room a read is made with.
const READ_ROOM: usize = 4 * 1024;

/// What an upstream request sends.
pub(crate) type RequestBody = Bytes;

/// Why a request did not get response headers from the upstream.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SendError {
    /// The TCP connection could not be made.
    #[error("connect to {0}")]
    Connect(String, #[source] std::io::Error),
    /// The TCP connection did not complete within the connect timeout.
    #[error("connect to {0}: timed out")]
    ConnectTimeout(String),
    /// The TLS handshake failed (an untrusted certificate, a wrong name, a plain port).
    #[error("TLS handshake with {0}")]
    Tls(String, #[source] std::io::Error),
    /// The HTTP exchange failed: reset, closed early, malformed response.
    #[error("HTTP exchange with {0}")]
    Http(String, #[source] h1::Error),
}

impl SendError {
    /// The connection broke under the exchange (a reset, a close before a response)
    /// rather than being refused or failing its handshake: the endpoint was there.
    pub(crate) fn is_transient(&self) -> bool {
        matches!(
            self,
            SendError::Http(_, h1::Error::Io(_) | h1::Error::ClosedBeforeResponse)
        )
    }
}

/// How new connections are made; shared by every endpoint's pool.
#[derive(Clone)]
pub(crate) struct Connector {
    /// For `https` endpoints: the trusted roots, HTTP/1.1 by ALPN.
    pub tls: TlsConnector,
    /// Limit on TCP connect and, separately, on the TLS handshake.
    pub connect_timeout: Duration,
    /// Idle connections older than this are not reused.
    pub idle_timeout: Duration,
}

impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connector")
            .field("connect_timeout", &self.connect_timeout)
            .field("idle_timeout", &self.idle_timeout)
            .finish()
    }
}

#[cfg(test)]
impl Connector {
    /// The Mozilla roots and the default timeouts (tests).
    pub fn testing() -> Connector {
        Connector {
            tls: tls_connector(None).expect("the Mozilla roots make a TLS client"),
            connect_timeout: Duration::from_secs(2),
            idle_timeout: Duration::from_secs(4),
        }
    }
}

/// Why an upstream's URL, key or TLS settings cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// The URL is not `http(s)://host[:port][/path]`.
    #[error("{url:?}: {problem}")]
    Url {
        /// The URL as configured.
        url: String,
        /// What is wrong with it.
        problem: &'static str,
    },
    /// The URL does not parse as a URI.
    #[error("{url:?}")]
    Uri {
        /// The URL as configured.
        url: String,
        /// The cause.
        #[source]
        source: hyper::http::uri::InvalidUri,
    },
    /// The host is not a name or address TLS can verify.
    #[error("{url:?}: not a TLS server name")]
    ServerName {
        /// The URL as configured.
        url: String,
        /// The cause.
        #[source]
        source: rustls::pki_types::InvalidDnsNameError,
    },
    /// An API key holds characters an HTTP header cannot carry (never shown).
    #[error("the key has characters an HTTP header cannot carry")]
    Key,
    /// The private CA or the TLS client could not be set up.
    #[error("TLS")]
    Tls(#[from] stanch_net::TlsError),
}

/// `Authorization: Bearer <key>`, marked sensitive so that it is never logged.
pub(crate) fn bearer(key: &SecretString) -> Result<HeaderValue, SetupError> {
    let mut value = HeaderValue::from_str(&format!("Bearer {}", key.expose_secret()))
        .map_err(|_| SetupError::Key)?;
    value.set_sensitive(true);
    Ok(value)
}

/// Builds the TLS client side: the Mozilla roots, plus a private CA's when given.
pub(crate) fn tls_connector(ca_file: Option<&std::path::Path>) -> Result<TlsConnector, SetupError> {
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(path) = ca_file {
        for cert in stanch_net::certificates(path)? {
            roots
                .add(cert)
                .map_err(|source| stanch_net::TlsError::BadRoot {
                    path: path.to_owned(),
                    source,
                })?;
        }
    }
    let mut config = rustls::ClientConfig::builder_with_provider(stanch_net::crypto_provider())
        .with_safe_default_protocol_versions()
        .map_err(stanch_net::TlsError::Config)?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsConnector::from(Arc::new(config)))
}

/// Where an endpoint's connections go.
#[derive(Debug)]
struct Target {
    /// `host:port`, for errors.
    authority: String,
    host: String,
    port: u16,
    /// The name its certificate must carry, for `https`.
    tls_name: Option<ServerName<'static>>,
}

/// One endpoint's connections.
pub(crate) struct Pool {
    shared: Arc<Shared>,
    /// The `Host` header of its requests, made once.
    host: HeaderValue,
    /// The base URL's path, which every request path follows (`/openai`, or empty).
    prefix: String,
}

struct Shared {
    target: Target,
    connector: Connector,
    /// Counts the connections made, once the gateway's metrics exist.
    opened: OnceLock<Counter>,
    /// When a TLS failure was last logged as a warning (at most one a minute: a
    /// misconfigured CA fails every request).
    tls_warned: Mutex<Option<Instant>>,
    /// Idle connections, a shelf per worker thread (and one, the first, for any other
    /// thread): a worker takes and returns its own connections under a lock that no
    /// other core touches, and takes another's only when it has none of its own.
    shelves: PerWorker<Mutex<Shelf>>,
}

/// One thread's idle connections: oldest at the front, newest at the back; reuse
/// takes the newest.
type Shelf = VecDeque<Idle>;

/// A connection, idle since a moment.
struct Idle {
    conn: Conn,
    since: Instant,
}

/// A connection to an endpoint.
struct Conn {
    io: Io,
    /// What has been read and not yet used: the head being parsed, or the body's next
    /// bytes.
    buf: BytesMut,
    /// The request head being written, kept to reuse its allocation.
    out: Vec<u8>,
    /// The worker thread whose runtime it was opened on (`None`: not a worker's).
    worker: Option<usize>,
}

/// A connection's transport: plain TCP, or TLS over it.
type Io = Either<TcpStream, Box<TlsStream<TcpStream>>>;

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("target", &self.shared.target)
            .field("idle", &self.idle_count())
            .finish()
    }
}

impl Pool {
    /// A pool for the base URL `url` (`http(s)://host[:port][/path]`). Fails when it
    /// is not one.
    pub fn new(url: &str, connector: Connector) -> Result<Pool, SetupError> {
        let no_host = || SetupError::Url {
            url: url.to_owned(),
            problem: "no host",
        };
        let uri: hyper::Uri =
            url.trim_end_matches('/')
                .parse()
                .map_err(|source| SetupError::Uri {
                    url: url.to_owned(),
                    source,
                })?;
        let host_header = uri
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
            .ok_or_else(no_host)?;
        let prefix = uri.path().trim_end_matches('/').to_owned();
        let https = uri.scheme_str() == Some("https");
        let host = uri
            .host()
            .ok_or_else(no_host)?
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
        let tls_name = if https {
            Some(
                ServerName::try_from(host.clone()).map_err(|source| SetupError::ServerName {
                    url: url.to_owned(),
                    source,
                })?,
            )
        } else {
            None
        };
        Ok(Pool {
            host: host_header,
            prefix,
            shared: Arc::new(Shared {
                target: Target {
                    authority: if host.contains(':') {
                        format!("[{host}]:{port}")
                    } else {
                        format!("{host}:{port}")
                    },
                    host,
                    port,
                    tls_name,
                },
                connector,
                opened: OnceLock::new(),
                tls_warned: Mutex::new(None),
                shelves: PerWorker::default(),
            }),
        })
    }

    /// The `Host` header its requests carry.
    pub fn host(&self) -> &HeaderValue {
        &self.host
    }

    /// The origin-form URI of `path` (`/v1/...`) under the base URL's own path.
    pub fn path(&self, path: &str) -> Result<hyper::Uri, SetupError> {
        let full = format!("{}{path}", self.prefix);
        full.parse()
            .map_err(|source| SetupError::Uri { url: full, source })
    }

    /// Counts the connections it opens in `counter` from now on.
    pub fn count_opened_in(&self, counter: Counter) {
        let _ = self.shared.opened.set(counter);
    }

    /// Whether a TLS failure should be logged as a warning now: the first, then one a
    /// minute, so that a trust problem is seen without flooding the log.
    pub fn tls_warning_due(&self) -> bool {
        let now = Instant::now();
        let mut last = self.shared.tls_warned.lock().expect("pool lock");
        let due = last.is_none_or(|at| now.duration_since(at) >= TLS_WARNING_EVERY);
        if due {
            *last = Some(now);
        }
        due
    }

    /// Idle connections held now.
    pub fn idle_count(&self) -> usize {
        self.shared
            .shelves
            .iter()
            .map(|shelf| shelf.lock().expect("pool lock").len())
            .sum()
    }

    /// Closes the idle connections that the upstream has closed or that have been idle
    /// longer than the idle timeout.
    pub fn sweep(&self) {
        let now = Instant::now();
        for shelf in self.shared.shelves.iter() {
            let mut idle = shelf.lock().expect("pool lock");
            self.shared.expire(&mut idle, now);
            idle.retain_mut(|e| e.conn.is_open());
        }
    }

    /// Sends `request` (origin-form URI, `Host` set) and waits for response headers.
    /// Cancel-safe: dropping the future closes the connection it was using.
    ///
    /// A kept-alive connection can be closed by the upstream just as a request goes out
    /// on it (its idle timeout and the checkout cross): then not one byte of an answer
    /// comes back, the upstream never read the request, and it is sent once more on a
    /// new connection (RFC 9112 §9.3.1), so the race costs neither the caller nor the
    /// endpoint's record. A failure after any byte came back, or on a new connection,
    /// is the endpoint's.
    pub async fn send(&self, request: Request<RequestBody>) -> Result<Response<Body>, SendError> {
        if let Some(mut conn) = self.shared.checkout() {
            match conn.exchange(&request).await {
                Ok(head) => return Ok(self.respond(head, conn)),
                Err(e) if conn.buf.is_empty() && e.is_closed_unread() => {
                    tracing::debug!(upstream = %self.shared.target.authority, error = %e, source = %stanch_log::Sources(&e), "a kept-alive connection was closed under the request; sending it on a new one");
                }
                Err(e) => return Err(SendError::Http(self.shared.target.authority.clone(), e)),
            }
        }
        // Boxed: connecting (TLS included) is the rare path, and its state would
        // otherwise make every request's future kilobytes larger to move.
        let mut conn = Box::pin(self.shared.connect()).await?;
        match conn.exchange(&request).await {
            Ok(head) => Ok(self.respond(head, conn)),
            Err(e) => Err(SendError::Http(self.shared.target.authority.clone(), e)),
        }
    }

    /// The response to `head`, whose body comes on `conn`. A body that came whole with
    /// its head is taken now, and the connection given back before anyone reads it.
    fn respond(&self, head: h1::Head, mut conn: Conn) -> Response<Body> {
        let h1::Head {
            status,
            version,
            headers,
            framing,
            reusable,
        } = head;
        #[cfg(test)]
        let carrier = conn.worker;
        let body = match framing {
            Framing::Length(n) if n <= conn.buf.len() as u64 => {
                let whole = conn.buf.split_to(n as usize).freeze();
                if Framing::Length(0).leaves_reusable(reusable, &conn.buf) {
                    self.shared.checkin(conn);
                }
                Body {
                    whole: (!whole.is_empty()).then_some(whole),
                    coming: None,
                    #[cfg(test)]
                    carrier,
                }
            }
            framing => Body {
                whole: None,
                coming: Some(Coming {
                    conn,
                    framing,
                    reusable,
                    pool: self.shared.clone(),
                }),
                #[cfg(test)]
                carrier,
            },
        };
        let mut response = Response::new(body);
        *response.status_mut() = status;
        *response.version_mut() = version;
        *response.headers_mut() = headers;
        response
    }
}

impl Shared {
    /// The newest idle connection still open and young enough, this worker's own first.
    fn checkout(&self) -> Option<Conn> {
        let now = Instant::now();
        let here = stanch_net::worker_index();
        let own = self.shelves.of(here);
        self.take(own, here, now).or_else(|| {
            self.shelves
                .iter()
                .filter(|shelf| !std::ptr::eq(*shelf, own))
                .find_map(|shelf| self.take(shelf, here, now))
        })
    }

    /// The newest open connection on `shelf`, one opened by worker `here` first (a
    /// shelf is shared when there are more workers than shares). Closed ones found on
    /// the way are dropped.
    fn take(&self, shelf: &Mutex<Shelf>, here: Option<usize>, now: Instant) -> Option<Conn> {
        let mut idle = shelf.lock().expect("pool lock");
        self.expire(&mut idle, now);
        for own_only in [true, false] {
            while let Some(at) = idle
                .iter()
                .rposition(|e| !own_only || e.conn.worker == here)
            {
                let mut conn = idle.remove(at).expect("a found position").conn;
                if conn.is_open() {
                    return Some(conn);
                }
            }
        }
        None
    }

    /// Puts a connection whose response was read to the end back for reuse, on the
    /// shelf of the worker that opened it.
    fn checkin(&self, conn: Conn) {
        let now = Instant::now();
        let mut idle = self.shelves.of(conn.worker).lock().expect("pool lock");
        self.expire(&mut idle, now);
        if idle.len() < MAX_IDLE {
            idle.push_back(Idle { conn, since: now });
        }
    }

    /// Drops (which closes) the connections idle for longer than the idle timeout:
    /// the oldest are at the front.
    fn expire(&self, idle: &mut Shelf, now: Instant) {
        while idle
            .front()
            .is_some_and(|e| now.duration_since(e.since) > self.connector.idle_timeout)
        {
            idle.pop_front();
        }
    }

    async fn connect(&self) -> Result<Conn, SendError> {
        let target = &self.target;
        let limit = self.connector.connect_timeout;
        let tcp = tokio::time::timeout(
            limit,
            TcpStream::connect((target.host.as_str(), target.port)),
        )
        .await
        .map_err(|_| SendError::ConnectTimeout(target.authority.clone()))?
        .map_err(|e| SendError::Connect(target.authority.clone(), e))?;
        let _ = tcp.set_nodelay(true);
        let io = match &target.tls_name {
            Some(name) => {
                let stream =
                    tokio::time::timeout(limit, self.connector.tls.connect(name.clone(), tcp))
                        .await
                        .map_err(|_| {
                            SendError::Tls(
                                target.authority.clone(),
                                std::io::ErrorKind::TimedOut.into(),
                            )
                        })?
                        .map_err(|e| SendError::Tls(target.authority.clone(), e))?;
                Either::Right(Box::new(stream))
            }
            None => Either::Left(tcp),
        };
        if let Some(opened) = self.opened.get() {
            opened.inc();
        }
        Ok(Conn {
            io,
            buf: BytesMut::new(),
            out: Vec::new(),
            worker: stanch_net::worker_index(),
        })
    }
}

impl Conn {
    /// Writes `request` and reads the head of its response.
    async fn exchange(&mut self, request: &Request<RequestBody>) -> Result<h1::Head, h1::Error> {
        let body = request.body();
        self.out.clear();
        h1::encode_head(request, body.len(), &mut self.out);
        write_all(&mut self.io, &self.out, body).await?;
        self.io.flush().await?;
        let mut informational = 0;
        std::future::poll_fn(|cx| self.poll_head(cx, &mut informational)).await
    }

    /// Reads the response head; `informational` counts the 1xx answers skipped.
    fn poll_head(
        &mut self,
        cx: &mut Context<'_>,
        informational: &mut u32,
    ) -> Poll<Result<h1::Head, h1::Error>> {
        loop {
            if !self.buf.is_empty()
                && let Some(head) = h1::parse_head(&mut self.buf, informational)?
            {
                return Poll::Ready(Ok(head));
            }
            if ready!(self.poll_fill(cx))? == 0 {
                return Poll::Ready(Err(h1::Error::ClosedBeforeResponse));
            }
        }
    }

    /// Reads what the connection has into `buf`: how many bytes, 0 at its end.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<usize>> {
        if self.buf.capacity() - self.buf.len() < READ_ROOM {
            self.buf.reserve(READ_CHUNK);
        }
        tokio_util::io::poll_read_buf(Pin::new(&mut self.io), cx, &mut self.buf)
    }

    /// Whether an idle connection is still open: nothing has arrived on it, not even
    /// its end. (Bytes no request asked for make it unusable too.)
    fn is_open(&mut self) -> bool {
        self.poll_fill(&mut Context::from_waker(Waker::noop()))
            .is_pending()
    }
}

/// Writes `head` then `body`, in one system call when the socket takes both.
async fn write_all(io: &mut Io, mut head: &[u8], mut body: &[u8]) -> std::io::Result<()> {
    while !head.is_empty() {
        let n = io
            .write_vectored(&[IoSlice::new(head), IoSlice::new(body)])
            .await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        let in_head = n.min(head.len());
        head = &head[in_head..];
        body = &body[n - in_head..];
    }
    io.write_all(body).await
}

/// A response body from a pooled connection: read to its end, it gives the
/// connection back for reuse; dropped before that, the connection closes.
pub(crate) struct Body {
    /// A body that came whole with its head; its connection is already back.
    whole: Option<Bytes>,
    /// The rest of a body still coming, and what it comes on; `None` once it ended.
    coming: Option<Coming>,
    /// The worker whose connection carried it (tests).
    #[cfg(test)]
    carrier: Option<usize>,
}

/// A body being read from its connection.
struct Coming {
    conn: Conn,
    framing: Framing,
    /// The response allows another request on the connection after it.
    reusable: bool,
    pool: Arc<Shared>,
}

impl Coming {
    fn poll_data(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, h1::Error>>> {
        loop {
            match self.framing.decode(&mut self.conn.buf) {
                Err(e) => return Poll::Ready(Some(Err(e))),
                Ok(Decoded::Data(data)) => return Poll::Ready(Some(Ok(data))),
                Ok(Decoded::End) => return Poll::Ready(None),
                Ok(Decoded::More) => match ready!(self.conn.poll_fill(cx)) {
                    Ok(0) => {
                        self.reusable = false;
                        return Poll::Ready(self.framing.closed().err().map(Err));
                    }
                    Ok(_) => {}
                    Err(e) => return Poll::Ready(Some(Err(e.into()))),
                },
            }
        }
    }

    /// Gives the connection back when its response has ended cleanly.
    fn give_back(self) {
        if self.framing.leaves_reusable(self.reusable, &self.conn.buf) {
            self.pool.checkin(self.conn);
        }
    }
}

impl HttpBody for Body {
    type Data = Bytes;
    type Error = h1::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, h1::Error>>> {
        let this = self.get_mut();
        if let Some(data) = this.whole.take() {
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        let Some(coming) = &mut this.coming else {
            return Poll::Ready(None);
        };
        let polled = ready!(coming.poll_data(cx));
        let ended = match &polled {
            // The last data: the connection can go back now if the end is in too.
            Some(Ok(_)) => coming.framing.finish(&mut coming.conn.buf),
            Some(Err(_)) | None => true,
        };
        if ended && let Some(coming) = this.coming.take() {
            coming.give_back();
        }
        Poll::Ready(polled.map(|data| data.map(Frame::data)))
    }

    fn is_end_stream(&self) -> bool {
        self.whole.is_none() && self.coming.as_ref().is_none_or(|c| c.framing.is_end())
    }

    fn size_hint(&self) -> SizeHint {
        match (&self.whole, &self.coming) {
            (Some(data), _) => SizeHint::with_exact(data.len() as u64),
            (None, Some(coming)) => coming
                .framing
                .remaining()
                .map_or_else(SizeHint::default, SizeHint::with_exact),
            (None, None) => SizeHint::with_exact(0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_default_ports_and_strip_ipv6_brackets() {
        let pool = |uri: &str, c: Connector| Pool::new(uri, c);
        let p = pool("http://10.0.0.7/v1", Connector::testing()).unwrap();
        assert_eq!(p.shared.target.authority, "10.0.0.7:80");
        let p = pool("http://[::1]:8000", Connector::testing()).unwrap();
        assert_eq!(
            (p.shared.target.host.as_str(), p.shared.target.port),
            ("::1", 8000)
        );
        let p = pool("https://api.example.com", Connector::testing()).unwrap();
        assert_eq!(p.shared.target.authority, "api.example.com:443");
        assert!(p.shared.target.tls_name.is_some());
    }

    /// A chat request for `pool`'s upstream.
    fn chat(pool: &Pool) -> Request<RequestBody> {
        let body = r#"{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"hi"}]}"#;
        let mut request = Request::post(pool.path("/v1/chat/completions").unwrap())
            .body(Bytes::from_static(body.as_bytes()))
            .unwrap();
        request
            .headers_mut()
            .insert(hyper::header::HOST, pool.host().clone());
        request
    }

    /// Sends `n` requests at once on `worker`; returns the workers whose connections
    /// carried them, once every answer was read (and its connection given back). Sent
    /// together, each takes its connection before any answer is in, so that the `n`
    /// requests never share one.
    async fn exchange(
        workers: &stanch_net::Workers,
        worker: usize,
        pool: &Arc<Pool>,
        n: usize,
    ) -> Vec<Option<usize>> {
        let pool = pool.clone();
        workers
            .spawn_on(worker, async move {
                let sent = (0..n).map(|_| pool.send(chat(&pool)));
                let mut carriers = Vec::new();
                for response in futures_util::future::join_all(sent).await {
                    let (_, mut body) = response.unwrap().into_parts();
                    carriers.push(body.carrier);
                    while let Some(frame) = http_body_util::BodyExt::frame(&mut body).await {
                        frame.unwrap();
                    }
                }
                carriers
            })
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn a_worker_reuses_its_own_connections_first_and_another_s_before_a_new_one() {
        let mock = stanch_mock::Mock::new(stanch_mock::MockConfig::new("m", "a"));
        let base = stanch_mock::spawn(mock.clone()).await;
        let pool = Arc::new(Pool::new(&base, Connector::testing()).unwrap());
        let workers = stanch_net::Workers::start(2, "test-pool").unwrap();

        // Worker 0 opens one; worker 1 has none of its own and takes it.
        assert_eq!(exchange(&workers, 0, &pool, 1).await, [Some(0)]);
        assert_eq!(exchange(&workers, 1, &pool, 1).await, [Some(0)]);
        assert_eq!(mock.stats().connections, 1, "reused across workers");

        // Two at once on worker 1: one reused, one opened by worker 1 itself. The
        // answers wait, so that the first cannot come back (and its connection be
        // free again) before the second has taken one.
        mock.set_fault(stanch_mock::FaultSpec {
            fault: stanch_mock::Fault::Latency { ms: 100 },
            count: Some(2),
        });
        let mut carriers = exchange(&workers, 1, &pool, 2).await;
        carriers.sort();
        assert_eq!(carriers, [Some(0), Some(1)]);
        assert_eq!(mock.stats().connections, 2);

        // From now on, each worker takes its own, whichever went back last.
        for _ in 0..3 {
            assert_eq!(exchange(&workers, 1, &pool, 1).await, [Some(1)]);
            assert_eq!(exchange(&workers, 0, &pool, 1).await, [Some(0)]);
        }
        assert_eq!(mock.stats().connections, 2, "no more were opened");
        assert_eq!(pool.idle_count(), 2);
    }

    #[tokio::test]
    async fn a_connection_the_upstream_closed_is_passed_over_and_swept() {
        let mut config = stanch_mock::MockConfig::new("m", "a");
        config.keep_alive = Some(Duration::from_millis(50));
        let mock = stanch_mock::Mock::new(config);
        let base = stanch_mock::spawn(mock.clone()).await;
        let pool = Pool::new(&base, Connector::testing()).unwrap();
        let exchange = async |pool: &Pool| {
            let response = pool.send(chat(pool)).await.expect("an answer");
            assert!(response.status().is_success());
            http_body_util::BodyExt::collect(response.into_body())
                .await
                .unwrap();
        };
        exchange(&pool).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(pool.idle_count(), 1, "closed, but nothing has looked yet");
        // Taking it, the pool sees the close and opens another: no error.
        exchange(&pool).await;
        assert_eq!(mock.stats().connections, 2);
        assert_eq!(pool.idle_count(), 1);
        // The sweep sees the next close without a request.
        tokio::time::sleep(Duration::from_millis(200)).await;
        pool.sweep();
        assert_eq!(pool.idle_count(), 0);
    }

    #[test]
    fn tls_failures_warn_once_a_minute() {
        let pool = Pool::new("http://10.0.0.7", Connector::testing()).unwrap();
        assert!(pool.tls_warning_due(), "the first");
        assert!(!pool.tls_warning_due(), "not the next");
        *pool.shared.tls_warned.lock().unwrap() = Some(Instant::now() - TLS_WARNING_EVERY);
        assert!(pool.tls_warning_due(), "a minute later");
    }

    #[test]
    fn a_ca_file_without_certificates_is_refused() {
        let dir = std::env::temp_dir().join(format!("stanch-ca-{}", std::process::id()));
        std::fs::write(&dir, "not a certificate\n").unwrap();
        let err = tls_connector(Some(&dir)).err().unwrap();
        std::fs::remove_file(&dir).unwrap();
        let said = stanch_log::Sources(&err).to_string();
        assert!(said.contains("no PEM certificate"), "{said}");
        let err = tls_connector(Some(std::path::Path::new("/nonexistent/ca.pem")))
            .err()
            .unwrap();
        let said = stanch_log::Sources(&err).to_string();
        assert!(said.contains("/nonexistent/ca.pem"), "{said}");
        assert!(
            std::error::Error::source(&err)
                .and_then(std::error::Error::source)
                .is_some(),
            "the I/O error is kept as the cause"
        );
    }
}
