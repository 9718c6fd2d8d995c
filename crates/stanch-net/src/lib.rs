//! The IO the controller and the gateway share: the wall clock ([`clock`], the one
//! place that reads it), reading request bodies ([`body`]), cheap deadlines ([`timer`]),
//! and the listener: plain or TLS, one task per
//! connection, TCP_NODELAY, and limits that keep a misbehaving client from holding
//! resources: a header read timeout (slowloris) and a write deadline (a client that
//! stops reading is disconnected, which is how slow SSE watchers and streaming callers
//! are closed without ever blocking the writer). Connections are bounded in number, in
//! all and per source address ([`admission`]); an HTTP/2 connection with no stream open
//! is closed after an idle timeout ([`Http2Limits::idle_timeout`]); a connection the
//! server closes first lingers, so that an answer given before the request's body was
//! read reaches the client ([`linger`]). At shutdown, in-flight requests get a bounded
//! time to finish.
//!
//! Connections are served on the caller's runtime ([`serve`]), or spread over
//! [`Workers`]: threads with a single-threaded runtime each, one connection wholly on
//! one thread ([`serve_on`]), as nginx spreads connections over worker processes.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

pub mod admission;
pub mod body;
pub mod clock;
pub mod exposition;
mod idle;
pub mod linger;
pub mod timer;

pub use admission::{Connections, Refused};
pub use linger::Linger;

use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::GracefulConnection;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::time::Sleep;
use tokio_rustls::TlsAcceptor;
use tracing::{Instrument, debug, debug_span, info, warn};

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
struct Connection<S> {
    peer: std::net::SocketAddr,
    app: S,
    tls: Option<TlsAcceptor>,
    limits: ConnLimits,
    watch: Watch,
    /// Its place among the listener's connections, held until its socket closes.
    slot: admission::Slot,
}

impl<S: App> Connection<S> {
    async fn serve(self, stream: tokio::net::TcpStream) {
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

/// The connections a listener is serving, told to finish when it closes.
///
/// hyper-util's graceful watcher re-arms a watch channel (a lock and a waker clone)
/// every time a connection is polled, several times per request; here a poll reads
/// one flag, and a connection's waker is stored when it changes, which for a
/// connection served as its own task is once.
#[derive(Default)]
struct Drain(Arc<DrainState>);

#[derive(Default)]
struct DrainState {
    /// Set once, when the listener closes.
    closing: std::sync::atomic::AtomicBool,
    /// The connections being served (from when they are accepted), by id, with the
    /// waker that last polled each.
    conns: std::sync::Mutex<std::collections::HashMap<u64, std::task::Waker>>,
    next_id: std::sync::atomic::AtomicU64,
    /// Wakes [`Drain::close`] when the last connection ends.
    emptied: tokio::sync::Notify,
}

impl Drain {
    /// Counts a connection in; it is counted out when the [`Watch`] drops.
    fn watch(&self) -> Watch {
        let id = self
            .0
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.0
            .conns
            .lock()
            .expect("drain lock")
            .insert(id, std::task::Waker::noop().clone());
        Watch {
            drain: self.0.clone(),
            id,
        }
    }

    /// Tells every connection to finish (each ends after the request it is serving,
    /// at once if idle) and waits until they all have.
    async fn close(&self) {
        use std::sync::atomic::Ordering;
        self.0.closing.store(true, Ordering::SeqCst);
        for waker in self.0.conns.lock().expect("drain lock").values() {
            waker.wake_by_ref();
        }
        loop {
            let emptied = self.0.emptied.notified();
            tokio::pin!(emptied);
            emptied.as_mut().enable();
            if self.0.conns.lock().expect("drain lock").is_empty() {
                return;
            }
            emptied.await;
        }
    }
}

/// One connection's place in a [`Drain`].
struct Watch {
    drain: Arc<DrainState>,
    id: u64,
}

impl Watch {
    /// Serves `conn` to its end, asking it to finish once the drain closes.
    fn serve<C: GracefulConnection>(self, conn: C) -> Watched<C> {
        Watched {
            conn,
            watch: self,
            told: false,
            waker: None,
        }
    }
}

pin_project_lite::pin_project! {
    /// A connection served under a [`Watch`]. A struct rather than an `async fn`: the
    /// connection is hyper's whole per-connection state, and an `async fn` would keep
    /// its argument and its pinned copy both, twice the memory per connection.
    struct Watched<C> {
        #[pin]
        conn: C,
        watch: Watch,
        told: bool,
        // The waker last stored in the drain.
        waker: Option<std::task::Waker>,
    }
}

impl<C: GracefulConnection> Watched<C> {
    /// Asks the connection to finish: the requests in flight end, no new ones start.
    fn shut_down(self: Pin<&mut Self>) {
        let this = self.project();
        if !*this.told {
            *this.told = true;
            this.conn.graceful_shutdown();
        }
    }
}

impl<C: GracefulConnection> Future for Watched<C> {
    type Output = C::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<C::Output> {
        use std::sync::atomic::Ordering;
        let mut this = self.project();
        if this.waker.as_ref().is_none_or(|w| !w.will_wake(cx.waker())) {
            // Stored before the flag is read: a close that comes after this either
            // sees the waker or is seen below.
            let w = cx.waker().clone();
            this.watch
                .drain
                .conns
                .lock()
                .expect("drain lock")
                .insert(this.watch.id, w.clone());
            *this.waker = Some(w);
        }
        if !*this.told && this.watch.drain.closing.load(Ordering::SeqCst) {
            *this.told = true;
            this.conn.as_mut().graceful_shutdown();
        }
        this.conn.poll(cx)
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let mut conns = self.drain.conns.lock().expect("drain lock");
        conns.remove(&self.id);
        if conns.is_empty() {
            self.drain.emptied.notify_waiters();
        }
    }
}

std::thread_local! {
    /// Which worker thread this is, on a [`Workers`] thread.
    static WORKER: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// The index of the [`Workers`] thread this code runs on; `None` on any other thread.
/// Per-thread resources (an upstream's idle connections, say) use it to stay with the
/// thread whose runtime drives them.
pub fn worker_index() -> Option<usize> {
    WORKER.with(std::cell::Cell::get)
}

/// Threads that each run a single-threaded tokio runtime and serve whole connections:
/// a connection, its requests and the tasks they spawn stay on one thread, so nothing
/// is stolen, woken or locked across cores on the way (the multi-threaded runtime's
/// work stealing cost about a third more CPU per proxied request). Dropping it stops
/// the threads; tasks still running on them are cancelled.
pub struct Workers {
    threads: Vec<Worker>,
    load: Load,
    /// Where the search for the least busy worker starts next, so ties rotate.
    next: std::sync::atomic::AtomicUsize,
}

struct Worker {
    runtime: tokio::runtime::Handle,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// The connections each of a [`Workers`]' threads is serving, readable from anywhere
/// (for metrics): a connection is counted from when it is handed to a worker until it
/// ends, however it ends.
#[derive(Debug, Clone)]
pub struct Load(Arc<[std::sync::atomic::AtomicUsize]>);

impl Load {
    /// Connections each worker is serving now, by worker.
    pub fn connections(&self) -> Vec<usize> {
        self.0
            .iter()
            .map(|c| c.load(std::sync::atomic::Ordering::Relaxed))
            .collect()
    }
}

impl Workers {
    /// Starts `count` threads (at least one) named `name-0`, `name-1`, ...
    pub fn start(count: usize, name: &str) -> io::Result<Workers> {
        let mut threads = Vec::new();
        for i in 0..count.max(1) {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let handle = runtime.handle().clone();
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let thread = std::thread::Builder::new()
                .name(format!("{name}-{i}"))
                .spawn(move || {
                    WORKER.with(|w| w.set(Some(i)));
                    // Its tasks run while this waits; then dropping it cancels the rest.
                    runtime.block_on(async {
                        let _ = stopped.await;
                    });
                })?;
            threads.push(Worker {
                runtime: handle,
                stop: Some(stop),
                thread: Some(thread),
            });
        }
        let load = Load(
            (0..threads.len())
                .map(|_| std::sync::atomic::AtomicUsize::new(0))
                .collect(),
        );
        Ok(Workers {
            threads,
            load,
            next: std::sync::atomic::AtomicUsize::new(0),
        })
    }

    /// How many worker threads there are.
    pub fn len(&self) -> usize {
        self.threads.len()
    }

    /// Never: there is at least one.
    pub fn is_empty(&self) -> bool {
        self.threads.is_empty()
    }

    /// Connections each worker is serving now, by worker.
    pub fn connections(&self) -> Vec<usize> {
        self.load.connections()
    }

    /// A handle on the workers' connection counts, for metrics.
    pub fn load(&self) -> Load {
        self.load.clone()
    }

    /// Runs `task` on `worker`'s thread.
    pub fn spawn_on<F>(&self, worker: usize, task: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.threads[worker % self.threads.len()]
            .runtime
            .spawn(task)
    }

    /// Serves a connection on the worker serving the fewest; counted while it runs.
    fn spawn_connection(&self, serve: impl Future<Output = ()> + Send + 'static) {
        use std::sync::atomic::Ordering;
        let n = self.threads.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let chosen = (0..n)
            .map(|k| (start + k) % n)
            .min_by_key(|&i| self.load.0[i].load(Ordering::Relaxed))
            .expect("at least one worker");
        /// Counts a connection down however it ends: served, cancelled, or dropped
        /// unpolled by a runtime shutting down (it is the task's, made before it).
        struct Done(Load, usize);
        impl Drop for Done {
            fn drop(&mut self) {
                (self.0).0[self.1].fetch_sub(1, Ordering::Relaxed);
            }
        }
        self.load.0[chosen].fetch_add(1, Ordering::Relaxed);
        let done = Done(self.load.clone(), chosen);
        self.threads[chosen].runtime.spawn(async move {
            let _done = done;
            serve.await;
        });
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        for w in &mut self.threads {
            if let Some(stop) = w.stop.take() {
                let _ = stop.send(());
            }
        }
        for w in &mut self.threads {
            if let Some(thread) = w.thread.take() {
                let _ = thread.join();
            }
        }
    }
}

/// Raises this process's soft limit on open files to its hard limit, as a server that
/// holds a connection per client should (the Go runtime does the same at start):
/// some container runtimes start processes at a soft limit of 1024 under a far
/// higher hard one. Returns (before, after); `None` where the limit cannot be read or
/// set, which leaves it as it was.
pub fn raise_open_file_limit() -> Option<(u64, u64)> {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    let before = limit.current.unwrap_or(u64::MAX);
    let after = limit.maximum.unwrap_or(u64::MAX);
    if before >= after {
        return Some((before, before));
    }
    let raised = Rlimit {
        current: limit.maximum,
        maximum: limit.maximum,
    };
    setrlimit(Resource::Nofile, raised).ok()?;
    Some((before, after))
}

/// Resolves on SIGINT or SIGTERM (what Kubernetes sends before killing a pod).
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}

/// The cryptography of every TLS connection stanch accepts or makes: *ring*'s, for TLS
/// 1.3 and 1.2 with X25519, P-256 and P-384 key exchange. rustls deprecates *ring*'s
/// provider because it has no post-quantum key exchange (X25519MLKEM768); aws-lc-rs's
/// has, and costs every build a C library with its own build system. A route table is
/// not secret for long and a token can be rotated, so *ring* stays, in this one place
/// (docs/operations.md, "TLS").
#[expect(
    deprecated,
    reason = "ring's provider, chosen over aws-lc-rs's: no post-quantum key exchange"
)]
pub fn crypto_provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The certificates of a PEM file; an error names the file, and a file without any
/// certificate is one.
pub fn certificates(
    path: &std::path::Path,
) -> Result<Vec<rustls::pki_types::CertificateDer<'static>>, String> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
        .map_err(|e| format!("{}: {e}", path.display()))?
        .collect::<Result<_, _>>()
        .map_err(|e| format!("{}: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("{}: no PEM certificate in it", path.display()));
    }
    Ok(certs)
}

/// Loads a PEM certificate chain and private key into a TLS acceptor that offers
/// HTTP/1.1 by ALPN, and `h2` before it when `http2` (the listener's
/// [`ConnLimits::http2`]).
pub fn tls_acceptor(
    cert: &std::path::Path,
    key: &std::path::Path,
    http2: bool,
) -> Result<TlsAcceptor, String> {
    use rustls::pki_types::PrivateKeyDer;
    use rustls::pki_types::pem::PemObject;
    let certs = certificates(cert)?;
    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| format!("{}: {e}", key.display()))?;
    let mut config = rustls::ServerConfig::builder_with_provider(crypto_provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| format!("certificate and key do not fit: {e}"))?;
    config.alpn_protocols = if http2 {
        vec![b"h2".to_vec(), b"http/1.1".to_vec()]
    } else {
        vec![b"http/1.1".to_vec()]
    };
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// Wraps a connection so that a write blocked for longer than `timeout` fails.
pub struct WriteDeadline<S> {
    inner: S,
    timeout: Duration,
    blocked: Option<Pin<Box<Sleep>>>,
}

impl<S> WriteDeadline<S> {
    /// Wraps `inner`.
    pub fn new(inner: S, timeout: Duration) -> Self {
        WriteDeadline {
            inner,
            timeout,
            blocked: None,
        }
    }

    fn on_pending<T>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<T>> {
        let timeout = self.timeout;
        let sleep = self
            .blocked
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        ready!(sleep.as_mut().poll(cx));
        Poll::Ready(Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "client stopped reading",
        )))
    }

    fn settle<T>(
        &mut self,
        poll: Poll<io::Result<T>>,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<T>> {
        match poll {
            Poll::Ready(r) => {
                self.blocked = None;
                Poll::Ready(r)
            }
            Poll::Pending => self.on_pending(cx),
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for WriteDeadline<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for WriteDeadline<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.settle(poll, cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.settle(poll, cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.inner).poll_flush(cx);
        this.settle(poll, cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::WriteDeadline;

    /// Serves a router with one route on loopback with `limits`.
    async fn listening(
        limits: super::ConnLimits,
    ) -> (std::net::SocketAddr, tokio::sync::oneshot::Sender<()>) {
        let app = axum::Router::new().route("/", axum::routing::get(|| async { "ok" }));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let app = hyper_util::service::TowerToHyperService::new(app);
        tokio::spawn(super::serve(
            listener,
            app,
            None,
            super::Connections::new(limits),
            async {
                let _ = stopped.await;
            },
        ));
        (addr, stop)
    }

    /// Every open connection is a task holding this future, so its size is paid
    /// once per watcher of a large fleet: what only a TLS connection needs (the
    /// handshake, rustls's state) is boxed, not held inline by plain ones, and hyper's
    /// connection state is held once. Either mistake more than doubles it.
    #[tokio::test]
    async fn a_plain_connection_is_served_by_a_small_future() {
        let app = axum::Router::new().route("/", axum::routing::get(|| async { "ok" }));
        let app = hyper_util::service::TowerToHyperService::new(app);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let drain = super::Drain::default();
        let conns = super::Connections::new(super::ConnLimits::default());
        let conn = super::Connection {
            peer: addr,
            app,
            tls: None,
            limits: *conns.limits(),
            watch: drain.watch(),
            slot: conns.admit(addr.ip()).unwrap(),
        };
        let serving = conn.serve(stream);
        let size = std::mem::size_of_val(&serving);
        assert!(size <= 3 * 1024, "a connection's future is {size} bytes");
    }

    #[tokio::test]
    async fn a_client_that_never_finishes_its_headers_is_disconnected() {
        let limits = super::ConnLimits {
            header_timeout: Duration::from_millis(200),
            ..Default::default()
        };
        let (addr, _stop) = listening(limits).await;
        let mut slow = tokio::net::TcpStream::connect(addr).await.unwrap();
        slow.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        let started = tokio::time::Instant::now();
        let mut buf = Vec::new();
        // The server answers 408 or just closes; either way the connection ends.
        let read = tokio::time::timeout(Duration::from_secs(5), slow.read_to_end(&mut buf)).await;
        assert!(read.is_ok(), "disconnected");
        assert!(started.elapsed() >= Duration::from_millis(150));

        // A well-behaved client is served.
        let mut ok = tokio::net::TcpStream::connect(addr).await.unwrap();
        ok.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut answer = String::new();
        ok.read_to_string(&mut answer).await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }

    /// hyper's header-read timeout runs from when a connection starts waiting for a
    /// request: it also closes a kept-alive connection left idle that long.
    #[tokio::test]
    async fn an_idle_kept_alive_connection_is_closed_after_the_header_timeout() {
        let limits = super::ConnLimits {
            header_timeout: Duration::from_millis(300),
            ..Default::default()
        };
        let (addr, _stop) = listening(limits).await;
        let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
        assert_eq!(ask(&mut conn).await, "ok");
        let started = tokio::time::Instant::now();
        let mut rest = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(5), conn.read_to_end(&mut rest));
        assert!(matches!(read.await, Ok(Ok(_))), "closed");
        let idle = started.elapsed();
        assert!(
            idle >= Duration::from_millis(250) && idle < Duration::from_secs(2),
            "{idle:?}"
        );
    }

    /// A client that opens connections and keeps them holds at most its share:
    /// `max_per_source` from one address, `max_connections` in all; one past a limit
    /// is closed at once, and a place is given back when a connection closes.
    #[tokio::test]
    async fn connections_past_a_limit_are_closed_at_once() {
        let limits = super::ConnLimits {
            max_connections: 5,
            max_per_source: 3,
            ..Default::default()
        };
        let app = axum::Router::new().route("/", axum::routing::get(|| async { "ok" }));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let conns = super::Connections::new(limits);
        let app = hyper_util::service::TowerToHyperService::new(app);
        tokio::spawn(super::serve(
            listener,
            app,
            None,
            conns.clone(),
            std::future::pending(),
        ));
        let from = |source: [u8; 4]| async move {
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            socket
                .bind((std::net::Ipv4Addr::from(source), 0).into())
                .unwrap();
            socket.connect(addr).await.unwrap()
        };
        /// Whether the server serves `conn` (else it was closed).
        async fn served(conn: &mut tokio::net::TcpStream) -> bool {
            if conn
                .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                .await
                .is_err()
            {
                return false;
            }
            let mut buf = [0u8; 256];
            matches!(
                tokio::time::timeout(Duration::from_secs(5), conn.read(&mut buf)).await,
                Ok(Ok(n)) if n > 0
            )
        }
        let mut kept = Vec::new();
        for _ in 0..3 {
            let mut conn = from([127, 0, 0, 1]).await;
            assert!(served(&mut conn).await);
            kept.push(conn);
        }
        let mut fourth = from([127, 0, 0, 1]).await;
        assert!(
            !served(&mut fourth).await,
            "a fourth from one source is closed"
        );
        for _ in 0..2 {
            let mut conn = from([127, 0, 0, 2]).await;
            assert!(served(&mut conn).await, "another source has room");
            kept.push(conn);
        }
        let mut sixth = from([127, 0, 0, 3]).await;
        assert!(!served(&mut sixth).await, "a sixth in all is closed");
        assert_eq!(conns.open(), 5);
        assert_eq!(conns.refused(super::Refused::PerSource), 1);
        assert_eq!(conns.refused(super::Refused::Max), 1);
        // One closes (the client first: no lingering); its place is free again.
        drop(kept.remove(0));
        soon(|| conns.open() == 4, "the place is given back").await;
        let mut again = from([127, 0, 0, 1]).await;
        assert!(served(&mut again).await);
    }

    /// An HTTP/2 client that answers pings but opens no stream is closed after the
    /// idle timeout (GOAWAY, then the end); one with a stream open is not.
    #[tokio::test]
    async fn an_idle_http2_connection_is_closed_and_a_busy_one_is_not() {
        let limits = super::ConnLimits {
            http2: Some(super::Http2Limits {
                idle_timeout: Duration::from_millis(300),
                ..Default::default()
            }),
            ..Default::default()
        };
        // A stream that stays open: a body that never ends.
        let app = axum::Router::new().route(
            "/",
            axum::routing::get(|| async {
                let forever =
                    futures_util::stream::pending::<Result<bytes::Bytes, std::io::Error>>();
                axum::body::Body::from_stream(forever)
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = hyper_util::service::TowerToHyperService::new(app);
        let conns = super::Connections::new(limits);
        tokio::spawn(super::serve(
            listener,
            app,
            None,
            conns,
            std::future::pending(),
        ));
        let handshake = || async {
            let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
            let (client, connection) = h2::client::handshake(tcp).await.unwrap();
            (client, tokio::spawn(connection))
        };
        let (_idle_client, idle) = handshake().await;
        let (busy_client, busy) = handshake().await;
        let mut busy_client = busy_client.ready().await.unwrap();
        let request = http::Request::get(format!("http://{addr}/"))
            .body(())
            .unwrap();
        let (response, _) = busy_client.send_request(request, true).unwrap();
        let _response = response.await.unwrap();
        let started = tokio::time::Instant::now();
        let ended = tokio::time::timeout(Duration::from_secs(5), idle).await;
        assert!(matches!(ended, Ok(Ok(Ok(())))), "closed cleanly: {ended:?}");
        let took = started.elapsed();
        assert!(took < Duration::from_secs(2), "{took:?}");
        tokio::time::sleep(Duration::from_millis(900)).await;
        assert!(
            !busy.is_finished(),
            "the connection with a stream open stays"
        );
    }

    /// A listener serving `app` on two workers until `stop` is sent; `serving` ends
    /// when it has drained.
    struct OnWorkers {
        workers: std::sync::Arc<super::Workers>,
        addr: std::net::SocketAddr,
        stop: tokio::sync::oneshot::Sender<()>,
        serving: tokio::task::JoinHandle<()>,
    }

    async fn on_workers(app: axum::Router, name: &str, limits: super::ConnLimits) -> OnWorkers {
        let workers = std::sync::Arc::new(super::Workers::start(2, name).unwrap());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let serving = {
            let workers = workers.clone();
            tokio::spawn(async move {
                let app = hyper_util::service::TowerToHyperService::new(app);
                super::serve_on(
                    &workers,
                    listener,
                    app,
                    None,
                    super::Connections::new(limits),
                    async {
                        let _ = stopped.await;
                    },
                )
                .await;
            })
        };
        OnWorkers {
            workers,
            addr,
            stop,
            serving,
        }
    }

    /// Waits until `done` holds (another thread is counting); fails after 5 s.
    async fn soon(done: impl Fn() -> bool, what: &str) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while !done() {
            assert!(tokio::time::Instant::now() < deadline, "{what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Sends one request on an open connection; returns the body of the answer.
    async fn ask(conn: &mut tokio::net::TcpStream) -> String {
        conn.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut answer = Vec::new();
        let mut buf = [0; 1024];
        loop {
            let n = conn.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed early");
            answer.extend_from_slice(&buf[..n]);
            let text = String::from_utf8_lossy(&answer);
            if let Some((head, body)) = text.split_once("\r\n\r\n") {
                let length: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length: "))
                    .unwrap()
                    .parse()
                    .unwrap();
                if body.len() == length {
                    return body.to_owned();
                }
            }
        }
    }

    #[tokio::test]
    async fn workers_serve_whole_connections_spread_evenly() {
        let app = axum::Router::new().route(
            "/",
            axum::routing::get(|| async {
                // The thread serving this connection, and the one its tasks run on.
                let spawned = tokio::spawn(async { super::worker_index() }).await.unwrap();
                format!("{:?} {:?}", super::worker_index(), spawned)
            }),
        );
        let OnWorkers {
            workers,
            addr,
            stop,
            serving,
        } = on_workers(app, "test-worker", Default::default()).await;
        let mut conns = Vec::new();
        let mut served = Vec::new();
        for _ in 0..4 {
            let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
            served.push(ask(&mut conn).await);
            conns.push(conn);
        }
        // Every request of a connection on the same worker, its tasks too.
        for (conn, first) in conns.iter_mut().zip(&served) {
            assert_eq!(&ask(conn).await, first);
        }
        served.sort();
        assert_eq!(
            served,
            [
                "Some(0) Some(0)",
                "Some(0) Some(0)",
                "Some(1) Some(1)",
                "Some(1) Some(1)"
            ],
            "two connections on each worker"
        );
        assert_eq!(workers.connections(), [2, 2]);
        drop(conns);
        soon(|| workers.connections() == [0, 0], "connections ended").await;
        let _ = stop.send(());
        serving.await.unwrap();
        assert_eq!(super::worker_index(), None, "not a worker thread");
    }

    #[tokio::test]
    async fn at_shutdown_workers_finish_requests_in_flight_within_the_drain() {
        // Each handler says when it has begun: a request not yet read is not in flight.
        let (begun, mut begins) = tokio::sync::mpsc::unbounded_channel::<()>();
        let app = {
            let (a, b) = (begun.clone(), begun);
            axum::Router::new()
                .route(
                    "/",
                    axum::routing::get(move || async move {
                        let _ = a.send(());
                        tokio::time::sleep(Duration::from_millis(300)).await;
                        "finished"
                    }),
                )
                .route(
                    "/never",
                    axum::routing::get(move || async move {
                        let _ = b.send(());
                        std::future::pending::<String>().await
                    }),
                )
        };
        let limits = super::ConnLimits {
            drain: Duration::from_secs(2),
            ..Default::default()
        };
        let OnWorkers {
            addr,
            stop,
            serving,
            ..
        } = on_workers(app, "test-drain", limits).await;
        let mut slow = tokio::net::TcpStream::connect(addr).await.unwrap();
        slow.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut stuck = tokio::net::TcpStream::connect(addr).await.unwrap();
        stuck
            .write_all(b"GET /never HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        for _ in 0..2 {
            begins.recv().await.unwrap();
        }
        let started = tokio::time::Instant::now();
        stop.send(()).unwrap();

        // The request in flight is answered whole, and its connection then closed.
        let mut answer = String::new();
        slow.read_to_string(&mut answer).await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.ends_with("finished"), "{answer}");
        // No new connection is served.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let refused = match tokio::net::TcpStream::connect(addr).await {
            Err(_) => true,
            Ok(mut late) => {
                let _ = late.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await;
                let mut buf = Vec::new();
                matches!(
                    tokio::time::timeout(Duration::from_secs(1), late.read_to_end(&mut buf)).await,
                    Ok(Ok(0)) | Ok(Err(_)) | Err(_)
                )
            }
        };
        assert!(refused, "a connection after shutdown is not served");
        // One that never finishes is given the drain time, then serving ends.
        serving.await.unwrap();
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(1900) && took < Duration::from_secs(4),
            "{took:?}"
        );
    }

    #[tokio::test]
    async fn at_shutdown_idle_connections_close_at_once() {
        let app = axum::Router::new().route("/", axum::routing::get(|| async { "ok" }));
        let limits = super::ConnLimits {
            drain: Duration::from_secs(10),
            ..Default::default()
        };
        let OnWorkers {
            workers,
            addr,
            stop,
            serving,
        } = on_workers(app, "test-idle", limits).await;
        // Kept alive after an answer each, and one that never sent a byte.
        let mut idle = Vec::new();
        for _ in 0..3 {
            let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
            assert_eq!(ask(&mut conn).await, "ok");
            idle.push(conn);
        }
        idle.push(tokio::net::TcpStream::connect(addr).await.unwrap());
        let served = || workers.connections().iter().sum::<usize>();
        soon(|| served() == 4, "four connections served").await;

        let started = tokio::time::Instant::now();
        stop.send(()).unwrap();
        for mut conn in idle {
            let mut rest = Vec::new();
            let read = tokio::time::timeout(Duration::from_secs(2), conn.read_to_end(&mut rest));
            assert!(matches!(read.await, Ok(Ok(0))), "closed without a word");
        }
        serving.await.unwrap();
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "serving ends when the last connection does, not at the drain time: {:?}",
            started.elapsed()
        );
        soon(|| served() == 0, "none counted once they ended").await;
    }

    #[test]
    fn the_open_file_limit_is_raised_to_the_hard_limit() {
        use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
        let hard = getrlimit(Resource::Nofile).maximum;
        let Some(hard) = hard else {
            return; // Unlimited: nothing to raise to.
        };
        // One below: harmless to the tests running beside this one.
        let lowered = Rlimit {
            current: Some(hard - 1),
            maximum: Some(hard),
        };
        setrlimit(Resource::Nofile, lowered).unwrap();
        assert_eq!(super::raise_open_file_limit(), Some((hard - 1, hard)));
        assert_eq!(getrlimit(Resource::Nofile).current, Some(hard));
        assert_eq!(
            super::raise_open_file_limit(),
            Some((hard, hard)),
            "already there"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_that_stops_reading_is_cut_off() {
        let (ours, _theirs) = tokio::io::duplex(64);
        let mut conn = WriteDeadline::new(ours, Duration::from_secs(10));
        conn.write_all(&[0; 64]).await.unwrap();
        let started = tokio::time::Instant::now();
        let err = conn.write_all(&[0; 1]).await.unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
        assert_eq!(started.elapsed(), Duration::from_secs(10));
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_but_reading_client_is_kept() {
        let (ours, mut theirs) = tokio::io::duplex(64);
        let mut conn = WriteDeadline::new(ours, Duration::from_secs(10));
        let reader = tokio::spawn(async move {
            let mut buf = [0; 64];
            let mut total = 0;
            while total < 640 {
                tokio::time::sleep(Duration::from_secs(5)).await;
                total += theirs.read(&mut buf).await.unwrap();
            }
        });
        let started = tokio::time::Instant::now();
        conn.write_all(&[0; 640])
            .await
            .expect("progress resets the deadline");
        assert!(
            started.elapsed() > Duration::from_secs(10),
            "longer than one deadline in all"
        );
        reader.await.unwrap();
    }
}
