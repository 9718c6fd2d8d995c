//! The listener: accepts connections within the limits of [`Connections`], serves
//! each as HTTP/1.1 or HTTP/2 (by ALPN over TLS, by the client's preface in clear
//! text), plain or TLS, on the caller's runtime or on [`Workers`], and drains them at
//! shutdown.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tracing::{Instrument, debug, debug_span, info, warn};

use crate::admission::{self, Connections};
use crate::drain::{Drain, Watch};
use crate::linger::{self, Linger};
use crate::workers::Workers;
use crate::write_deadline::WriteDeadline;
use crate::{idle, timer};

/// Per-connection limits, and whether connections may speak HTTP/2.
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    /// A client that does not take written bytes for this long is disconnected.
    pub write_timeout: Duration,
    /// A request's headers must arrive within this. On HTTP/2, the connection
    /// preface must, and a connection whose pings go unanswered this long is closed.
    pub header_timeout: Duration,
    /// How long in-flight requests may finish at shutdown.
    pub drain: Duration,
    /// HTTP/2 beside HTTP/1.1 (for gRPC): chosen by ALPN (`h2`) over TLS, and by the
    /// client's connection preface in clear text (prior knowledge, as gRPC clients
    /// send). Off, every connection is HTTP/1.1.
    pub http2: Option<Http2Limits>,
    /// Connections open at once, lingering ones included; one more is closed as
    /// soon as it is accepted ([`admission`]).
    pub max_connections: usize,
    /// Connections open at once from one IP address.
    pub max_per_source: usize,
    /// How a connection the server closes first lingers ([`linger`]).
    pub linger: Linger,
}

/// Limits of an HTTP/2 connection.
#[derive(Debug, Clone, Copy)]
pub struct Http2Limits {
    /// Streams (requests) open at once on one connection.
    pub max_streams: u32,
    /// How often an idle connection is pinged to tell that the client is still there.
    pub keep_alive: Duration,
    /// A connection with no stream open for this long is closed (GOAWAY): a client
    /// that answers pings holds a connection only while it uses it.
    pub idle_timeout: Duration,
}

impl Default for Http2Limits {
    fn default() -> Self {
        Self {
            max_streams: 100,
            keep_alive: Duration::from_secs(20),
            idle_timeout: Duration::from_secs(60),
        }
    }
}

impl Default for ConnLimits {
    fn default() -> Self {
        Self {
            write_timeout: Duration::from_secs(10),
            header_timeout: Duration::from_secs(30),
            drain: Duration::from_secs(5),
            http2: None,
            max_connections: 4096,
            max_per_source: usize::MAX,
            linger: Linger::default(),
        }
    }
}

/// The client connection preface of HTTP/2 (RFC 9113, section 3.4).
const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Whether a clear-text connection opens with the HTTP/2 preface, read without taking
/// it off the socket; `None` when the client closes or says nothing decisive within
/// `within`. The first byte that differs from the preface decides HTTP/1.1, so an
/// HTTP/1.1 request is known at once.
async fn opens_with_h2_preface(stream: &tokio::net::TcpStream, within: Duration) -> Option<bool> {
    let deadline = tokio::time::Instant::now() + within;
    let mut buf = [0u8; H2_PREFACE.len()];
    loop {
        let n = tokio::time::timeout_at(deadline, stream.peek(&mut buf))
            .await
            .ok()?
            .ok()?;
        if n == 0 {
            return None;
        }
        if buf[..n] != H2_PREFACE[..n] {
            return Some(false);
        }
        if n == H2_PREFACE.len() {
            return Some(true);
        }
        // Part of the preface: peek again once more may have come (a peek of bytes
        // already there would return at once, so wait a little between).
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// What the listener serves: a hyper service answering with axum's responses. An axum
/// `Router` serves wrapped in hyper-util's `TowerToHyperService`; a service written
/// for hyper is called by reference, with no clone of itself per request.
pub trait App:
    hyper::service::Service<
        hyper::Request<hyper::body::Incoming>,
        Response = axum::response::Response,
        Error = Infallible,
        Future: Send + 'static,
    > + Clone
    + Send
    + 'static
{
}

impl<S> App for S where
    S: hyper::service::Service<
            hyper::Request<hyper::body::Incoming>,
            Response = axum::response::Response,
            Error = Infallible,
            Future: Send + 'static,
        > + Clone
        + Send
        + 'static
{
}

/// Serves `app` on `listener` until `shutdown` resolves, then drains connections,
/// under the limits of `conns` (which counts them). Connections are served on the
/// runtime this runs on.
pub async fn serve(
    listener: TcpListener,
    app: impl App,
    tls: Option<TlsAcceptor>,
    conns: Arc<Connections>,
    shutdown: impl Future<Output = ()>,
) {
    accept_loop(listener, app, tls, conns, shutdown, None).await;
}

/// As [`serve`], but each accepted connection is served whole by one of `workers`'
/// threads (the one serving the fewest connections), and this runtime only accepts.
pub async fn serve_on(
    workers: &Workers,
    listener: TcpListener,
    app: impl App,
    tls: Option<TlsAcceptor>,
    conns: Arc<Connections>,
    shutdown: impl Future<Output = ()>,
) {
    accept_loop(listener, app, tls, conns, shutdown, Some(workers)).await;
}

async fn accept_loop(
    listener: TcpListener,
    app: impl App,
    tls: Option<TlsAcceptor>,
    conns: Arc<Connections>,
    shutdown: impl Future<Output = ()>,
    workers: Option<&Workers>,
) {
    let drain = Drain::default();
    let limits = *conns.limits();
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // Past a limit, closed at once (counted and logged by `admit`).
        let Ok(slot) = conns.admit(peer.ip()) else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let conn = Connection {
            peer,
            app: app.clone(),
            tls: tls.clone(),
            limits,
            watch: drain.watch(),
            slot,
        };
        let Some(workers) = workers else {
            tokio::spawn(conn.serve(stream).instrument(debug_span!("conn", %peer)));
            continue;
        };
        // A socket belongs to the runtime that registered it: it leaves this one
        // unregistered and joins the worker's there.
        match stream.into_std() {
            Ok(stream) => workers.spawn_connection(
                async move {
                    match tokio::net::TcpStream::from_std(stream) {
                        Ok(stream) => conn.serve(stream).await,
                        Err(e) => warn!(error = %e, "cannot register a connection"),
                    }
                }
                .instrument(debug_span!("conn", %peer)),
            ),
            Err(e) => warn!(%peer, error = %e, "cannot hand a connection to a worker"),
        }
    }
    info!("listener closed; draining connections");
    tokio::select! {
        () = drain.close() => {}
        () = tokio::time::sleep(limits.drain) => debug!("drain timed out; closing the rest"),
    }
}

/// One accepted connection and what serving it needs.
pub(crate) struct Connection<S> {
    pub(crate) peer: std::net::SocketAddr,
    pub(crate) app: S,
    pub(crate) tls: Option<TlsAcceptor>,
    pub(crate) limits: ConnLimits,
    pub(crate) watch: Watch,
    /// Its place among the listener's connections, held until its socket closes.
    pub(crate) slot: admission::Slot,
}

impl<S: App> Connection<S> {
    pub(crate) async fn serve(self, stream: tokio::net::TcpStream) {
        let Connection {
            peer,
            app,
            tls,
            limits,
            watch,
            slot,
        } = self;
        let h2 = match (limits.http2, &tls) {
            (Some(_), None) => match opens_with_h2_preface(&stream, limits.header_timeout).await {
                Some(h2) => h2,
                None => return debug!(%peer, "closed or silent before its first request"),
            },
            _ => false,
        };
        let socket = linger::Socket::new(stream, limits.linger, slot);
        let io = WriteDeadline::new(socket, limits.write_timeout);
        let result = match tls {
            None => serve_http(TokioIo::new(io), h2, app, &limits, watch).await,
            // Boxed: a TLS session's state (the handshake's, then rustls's buffers
            // beside hyper's) is several times a plain connection's, and held inline
            // it would size the task of every connection, plain ones too, to it.
            Some(acceptor) => match Box::pin(serve_tls(io, acceptor, app, &limits, watch)).await {
                Ok(served) => served,
                Err(why) => return debug!(%peer, "TLS handshake {why}"),
            },
        };
        if let Err(e) = result {
            debug!(error = %e, "connection ended with an error");
        }
    }
}

/// Serves one connection over TLS, HTTP/2 where ALPN chose it; `Err` says how the
/// handshake failed.
async fn serve_tls<S: App>(
    io: WriteDeadline<linger::Socket>,
    acceptor: TlsAcceptor,
    app: S,
    limits: &ConnLimits,
    watch: Watch,
) -> Result<Result<(), hyper::Error>, String> {
    let stream = match tokio::time::timeout(Duration::from_secs(10), acceptor.accept(io)).await {
        Ok(Ok(stream)) => stream,
        Ok(Err(e)) => return Err(format!("failed: {e}")),
        Err(_) => return Err("timed out".to_owned()),
    };
    let h2 = limits.http2.is_some() && stream.get_ref().1.alpn_protocol() == Some(b"h2");
    Ok(serve_http(TokioIo::new(stream), h2, app, limits, watch).await)
}

/// Serves one connection as HTTP/2 (`h2`, which `limits.http2` then bounds) or
/// HTTP/1.1, under the drain's watch.
async fn serve_http<I, S>(
    io: TokioIo<I>,
    h2: bool,
    app: S,
    limits: &ConnLimits,
    watch: Watch,
) -> Result<(), hyper::Error>
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: App,
{
    match limits.http2.filter(|_| h2) {
        // Boxed, as TLS is: a plain HTTP/1.1 connection's task is not sized to it.
        Some(h2) => Box::pin(serve_h2(io, app, h2, limits, watch)).await,
        None => {
            let mut b = hyper::server::conn::http1::Builder::new();
            b.timer(timer::Timer)
                .header_read_timeout(limits.header_timeout);
            watch.serve(b.serve_connection(io, app)).await
        }
    }
}

/// Serves one HTTP/2 connection until it ends, a handler closes it
/// ([`CloseConnection`]), or it is idle ([`Http2Limits::idle_timeout`]).
async fn serve_h2<I, S>(
    io: TokioIo<I>,
    app: S,
    h2: Http2Limits,
    limits: &ConnLimits,
    watch: Watch,
) -> Result<(), hyper::Error>
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: App,
{
    let mut b = hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new());
    b.timer(timer::Timer)
        .max_concurrent_streams(h2.max_streams)
        .keep_alive_interval(Some(h2.keep_alive))
        .keep_alive_timeout(limits.header_timeout);
    let close = CloseConnection::default();
    let streams = idle::Streams::default();
    let app = WithClose {
        inner: app,
        close: close.clone(),
        streams: streams.clone(),
    };
    let served = watch.serve(b.serve_connection(io, app));
    tokio::pin!(served);
    // Dropping the connection closes its socket, and every stream on it.
    let closed = close.0.notified();
    tokio::pin!(closed);
    let idle = streams.idle(h2.idle_timeout);
    tokio::pin!(idle);
    let mut told = false;
    loop {
        tokio::select! {
            served = &mut served => return served,
            () = &mut closed => {
                debug!("connection closed by a handler");
                return Ok(());
            }
            // GOAWAY: what the client started meanwhile may finish.
            () = &mut idle, if !told => {
                debug!("HTTP/2 connection idle; closing it");
                served.as_mut().shut_down();
                told = true;
            }
        }
    }
}

/// Ends the HTTP/2 connection a request came on, from the request's handler, which
/// finds it among the request's extensions. For a client beyond help behind HTTP/2
/// flow control: one that stopped reading a stream only stops granting window, no
/// write ever blocks, and the write deadline that cuts off such a client on HTTP/1.1
/// never fires.
#[derive(Debug, Clone, Default)]
pub struct CloseConnection(Arc<tokio::sync::Notify>);

impl CloseConnection {
    /// Closes the connection (now, or as soon as it is next polled).
    pub fn close(&self) {
        self.0.notify_one();
    }
}

/// `inner`, with each request carrying its connection's [`CloseConnection`], and
/// counted among the connection's open [`idle::Streams`] until its answer ends.
#[derive(Clone)]
struct WithClose<S> {
    inner: S,
    close: CloseConnection,
    streams: idle::Streams,
}

impl<S: App> hyper::service::Service<hyper::Request<hyper::body::Incoming>> for WithClose<S> {
    type Response = S::Response;
    type Error = S::Error;
    type Future = idle::Counted<S::Future>;

    fn call(&self, mut request: hyper::Request<hyper::body::Incoming>) -> Self::Future {
        request.extensions_mut().insert(self.close.clone());
        idle::Counted::new(self.inner.call(request), self.streams.open())
    }
}
