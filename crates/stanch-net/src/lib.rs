//! The listener the controller and the gateway share: plain or TLS, one task per
//! connection, TCP_NODELAY, and limits that keep a misbehaving client from holding
//! resources: a header read timeout (slowloris) and a write deadline (a client that
//! stops reading is disconnected, which is how slow SSE watchers and streaming callers
//! are closed without ever blocking the writer). At shutdown, in-flight requests get a
//! bounded time to finish.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::time::Sleep;
use tokio_rustls::TlsAcceptor;
use tracing::{Instrument, debug, debug_span, info, warn};

/// Per-connection limits.
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    /// A client that does not take written bytes for this long is disconnected.
    pub write_timeout: Duration,
    /// A request's headers must arrive within this.
    pub header_timeout: Duration,
    /// How long in-flight requests may finish at shutdown.
    pub drain: Duration,
}

impl Default for ConnLimits {
    fn default() -> Self {
        Self {
            write_timeout: Duration::from_secs(10),
            header_timeout: Duration::from_secs(30),
            drain: Duration::from_secs(5),
        }
    }
}

/// Serves `app` (an axum `Router`, or a service in front of one) on `listener` until
/// `shutdown` resolves, then drains connections.
pub async fn serve<S>(
    listener: TcpListener,
    app: S,
    tls: Option<TlsAcceptor>,
    limits: ConnLimits,
    shutdown: impl Future<Output = ()>,
) where
    S: tower::Service<
            hyper::Request<hyper::body::Incoming>,
            Response = axum::response::Response,
            Error = Infallible,
        > + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    let graceful = GracefulShutdown::new();
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
        let _ = stream.set_nodelay(true);
        let io = WriteDeadline::new(stream, limits.write_timeout);
        let app = app.clone();
        let tls = tls.clone();
        let watcher = graceful.watcher();
        tokio::spawn(
            async move {
                let service = TowerToHyperService::new(app);
                let builder = {
                    let mut b = hyper::server::conn::http1::Builder::new();
                    b.timer(TokioTimer::new())
                        .header_read_timeout(limits.header_timeout);
                    b
                };
                let result = match tls {
                    None => {
                        watcher
                            .watch(builder.serve_connection(TokioIo::new(io), service))
                            .await
                    }
                    Some(acceptor) => {
                        match tokio::time::timeout(Duration::from_secs(10), acceptor.accept(io))
                            .await
                        {
                            Ok(Ok(stream)) => {
                                watcher
                                    .watch(builder.serve_connection(TokioIo::new(stream), service))
                                    .await
                            }
                            Ok(Err(e)) => return debug!(%peer, error = %e, "TLS handshake failed"),
                            Err(_) => return debug!(%peer, "TLS handshake timed out"),
                        }
                    }
                };
                if let Err(e) = result {
                    debug!(error = %e, "connection ended with an error");
                }
            }
            .instrument(debug_span!("conn", %peer)),
        );
    }
    info!("listener closed; draining connections");
    tokio::select! {
        () = graceful.shutdown() => {}
        () = tokio::time::sleep(limits.drain) => debug!("drain timed out; closing the rest"),
    }
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

/// Loads a PEM certificate chain and private key into a TLS acceptor (HTTP/1.1).
pub fn tls_acceptor(cert: &std::path::Path, key: &std::path::Path) -> Result<TlsAcceptor, String> {
    use rustls::pki_types::PrivateKeyDer;
    use rustls::pki_types::pem::PemObject;
    let certs = certificates(cert)?;
    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| format!("{}: {e}", key.display()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| format!("certificate and key do not fit: {e}"))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
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
        tokio::spawn(super::serve(listener, app, None, limits, async {
            let _ = stopped.await;
        }));
        (addr, stop)
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
