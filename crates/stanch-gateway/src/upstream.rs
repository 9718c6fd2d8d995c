//! Connections to upstreams: each endpoint keeps its own pool of HTTP/1.1 keep-alive
//! connections, plain or TLS.
//!
//! An endpoint is one address, so its pool is a stack of idle connections and nothing
//! more: no key to hash, no shared map to lock across endpoints, no task per request.
//! A connection goes back on the stack when its response body has been read to the
//! end, and the newest idle one is reused first, so a burst's extra connections age
//! out while the busy few stay warm.
//!
//! A connection is driven by a task on the runtime that opened it. On the gateway's
//! worker threads (`stanch_net::Workers`), each worker therefore prefers the idle
//! connections it opened itself, so that a request and its upstream connection run on
//! one thread; another worker's idle connection is still better than a new one.
//!
//! Upstreams close idle keep-alive connections on their own schedule (uvicorn, hence
//! vLLM, after 5 s). A request therefore never goes out on a connection that is closed
//! or has been idle longer than `idle_timeout`, which should stay below the upstreams'
//! keep-alive; and a request that a connection refused before writing a byte of it (it
//! closed in the meantime) moves on to the next connection, or a new one, without
//! counting as a failure.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::{Body as HttpBody, Frame, Incoming, SizeHint};
use hyper::client::conn::http1::{self, SendRequest};
use hyper::header::HeaderValue;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use prometheus_client::metrics::counter::Counter;
use rustls::pki_types::ServerName;
use secrecy::{ExposeSecret, SecretString};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_rustls::TlsConnector;

use crate::per_worker::PerWorker;

/// Idle connections kept per endpoint and worker thread at most; a burst beyond this
/// opens and closes.
const MAX_IDLE: usize = 256;
/// The least time between two warnings about an endpoint's TLS failures.
const TLS_WARNING_EVERY: Duration = Duration::from_secs(60);

/// What an upstream request sends.
pub(crate) type RequestBody = Full<Bytes>;

/// Why a request did not get response headers from the upstream.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SendError {
    /// The TCP connection could not be made.
    #[error("connect to {0}: {1}")]
    Connect(String, std::io::Error),
    /// The TCP connection did not complete within the connect timeout.
    #[error("connect to {0}: timed out")]
    ConnectTimeout(String),
    /// The TLS handshake failed (an untrusted certificate, a wrong name, a plain port).
    #[error("TLS handshake with {0}: {1}")]
    Tls(String, std::io::Error),
    /// The HTTP exchange failed: reset, closed early, malformed response.
    #[error("HTTP exchange with {0}: {1}")]
    Http(String, hyper::Error),
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

/// `Authorization: Bearer <key>`, marked sensitive so that it is never logged.
pub(crate) fn bearer(key: &SecretString) -> Result<HeaderValue, String> {
    let mut value = HeaderValue::from_str(&format!("Bearer {}", key.expose_secret()))
        .map_err(|_| "the key has characters an HTTP header cannot carry".to_owned())?;
    value.set_sensitive(true);
    Ok(value)
}

/// Builds the TLS client side: the Mozilla roots, plus a private CA's when given.
pub(crate) fn tls_connector(ca_file: Option<&std::path::Path>) -> Result<TlsConnector, String> {
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(path) = ca_file {
        for cert in stanch_net::certificates(path)? {
            roots
                .add(cert)
                .map_err(|e| format!("{}: {e}", path.display()))?;
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
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
    send: SendRequest<RequestBody>,
    /// The worker thread whose runtime drives it (`None`: not a worker's).
    worker: Option<usize>,
}

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
    pub fn new(url: &str, connector: Connector) -> Result<Pool, String> {
        let uri: hyper::Uri = url
            .trim_end_matches('/')
            .parse()
            .map_err(|e| format!("{url:?}: {e}"))?;
        let host_header = uri
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
            .ok_or_else(|| format!("{url:?}: no host"))?;
        let prefix = uri.path().trim_end_matches('/').to_owned();
        let https = uri.scheme_str() == Some("https");
        let host = uri
            .host()
            .ok_or_else(|| format!("{uri}: no host"))?
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
        let tls_name = if https {
            Some(
                ServerName::try_from(host.clone())
                    .map_err(|e| format!("{uri}: not a TLS server name: {e}"))?,
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
    pub fn path(&self, path: &str) -> Result<hyper::Uri, String> {
        format!("{}{path}", self.prefix)
            .parse()
            .map_err(|e| format!("{}{path}: {e}", self.prefix))
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

    /// Sends `request` (origin-form URI, `Host` set) and waits for response headers.
    /// Cancel-safe: dropping the future closes the connection it was using.
    pub async fn send(
        &self,
        mut request: Request<RequestBody>,
    ) -> Result<Response<Body>, SendError> {
        while let Some(mut conn) = self.shared.checkout() {
            // Ready at once unless its previous response ended a moment ago and the
            // connection has not yet turned around; it errs when it closed. One that
            // does not turn around within the connect timeout is dropped, not waited on.
            if !conn.send.is_ready() {
                let limit = self.shared.connector.connect_timeout;
                if !matches!(
                    tokio::time::timeout(limit, conn.send.ready()).await,
                    Ok(Ok(()))
                ) {
                    continue;
                }
            }
            match conn.send.try_send_request(request).await {
                Ok(response) => return Ok(self.wrap(response, conn)),
                Err(mut e) => match e.take_message() {
                    // Never written: the connection closed first. Not the upstream's fault.
                    Some(unsent) => request = unsent,
                    None => return Err(self.http_error(e.into_error())),
                },
            }
        }
        // Boxed: connecting (TLS included) is the rare path, and its state would
        // otherwise make every request's future kilobytes larger to move.
        let mut conn = Box::pin(self.shared.connect()).await?;
        match conn.send.try_send_request(request).await {
            Ok(response) => Ok(self.wrap(response, conn)),
            Err(e) => Err(self.http_error(e.into_error())),
        }
    }

    fn wrap(&self, response: Response<Incoming>, conn: Conn) -> Response<Body> {
        let shared = self.shared.clone();
        response.map(|inner| Body {
            inner,
            conn: Some((conn, shared)),
        })
    }

    fn http_error(&self, e: hyper::Error) -> SendError {
        SendError::Http(self.shared.target.authority.clone(), e)
    }
}

impl Shared {
    /// The newest idle connection still worth using, this worker's own first.
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

    /// The newest open connection on `shelf`, one that worker `here` drives first (a
    /// shelf is shared when there are more workers than shares).
    fn take(&self, shelf: &Mutex<Shelf>, here: Option<usize>, now: Instant) -> Option<Conn> {
        let mut idle = shelf.lock().expect("pool lock");
        self.expire(&mut idle, now);
        let open = |e: &Idle| !e.conn.send.is_closed();
        let pick = idle
            .iter()
            .rposition(|e| e.conn.worker == here && open(e))
            .or_else(|| idle.iter().rposition(open))?;
        idle.remove(pick).map(|e| e.conn)
    }

    /// Puts a connection whose response was read to the end back for reuse, on the
    /// shelf of the worker that drives it.
    fn checkin(&self, conn: Conn) {
        if conn.send.is_closed() {
            return;
        }
        let now = Instant::now();
        let mut idle = self.shelves.of(conn.worker).lock().expect("pool lock");
        self.expire(&mut idle, now);
        if idle.len() < MAX_IDLE {
            idle.push_back(Idle { conn, since: now });
        }
    }

    /// Drops (which closes) the connections idle for longer than the idle timeout:
    /// the oldest are at the front. Closed ones left among the rest go when they
    /// expire.
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
        match &target.tls_name {
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
                self.handshake(TokioIo::new(stream)).await
            }
            None => self.handshake(TokioIo::new(tcp)).await,
        }
    }

    async fn handshake<T>(&self, io: T) -> Result<Conn, SendError>
    where
        T: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    {
        let (send, conn) = http1::Builder::new()
            .handshake(io)
            .await
            .map_err(|e| SendError::Http(self.target.authority.clone(), e))?;
        // The connection's own task; it ends when the connection closes, which dropping
        // every `SendRequest` for it does once it is idle.
        tokio::spawn(async move {
            let _ = conn.await;
        });
        if let Some(opened) = self.opened.get() {
            opened.inc();
        }
        Ok(Conn {
            send,
            worker: stanch_net::worker_index(),
        })
    }
}

/// A response body from a pooled connection: read to its end, it gives the
/// connection back for reuse; dropped before that, the connection closes.
pub(crate) struct Body {
    inner: Incoming,
    conn: Option<(Conn, Arc<Shared>)>,
}

impl Body {
    fn give_back(&mut self) {
        if let Some((conn, pool)) = self.conn.take() {
            pool.checkin(conn);
        }
    }
}

impl HttpBody for Body {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => this.give_back(),
            Poll::Ready(Some(Err(_))) => this.conn = None,
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Body {
    fn drop(&mut self) {
        // A body whose last frame was taken but whose end was never polled is done too.
        if self.inner.is_end_stream() {
            self.give_back();
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
            .body(Full::new(Bytes::from_static(body.as_bytes())))
            .unwrap();
        request
            .headers_mut()
            .insert(hyper::header::HOST, pool.host().clone());
        request
    }

    /// Sends `n` requests at once on `worker`; returns the workers whose connections
    /// carried them, once every answer was read (and its connection given back).
    /// Bodies are read only once every answer's headers are in: a connection goes back
    /// to the pool when its body ends, and the `n` requests must not share one however
    /// the threads are scheduled.
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
                    carriers.push(body.conn.as_ref().map(|(c, _)| c.worker).unwrap());
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

        // Two at once on worker 1: one reused, one opened by worker 1 itself.
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
        assert!(err.contains("no PEM certificate"), "{err}");
        let err = tls_connector(Some(std::path::Path::new("/nonexistent/ca.pem")))
            .err()
            .unwrap();
        assert!(err.contains("/nonexistent/ca.pem"), "{err}");
    }
}
