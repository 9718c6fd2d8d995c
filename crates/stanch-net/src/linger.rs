//! Lingering close, as nginx does it (`lingering_close`, `lingering_time`,
//! `lingering_timeout`).
//!
//! A server that answers before reading a request's body (401, 413, 415, ...) and
//! then closes the connection while the client is still sending closes a socket with
//! unread bytes in it, or receives more afterwards, and the kernel answers with a
//! reset. The reset overtakes the answer: a client that writes its whole request
//! before reading (Python's `http.client`, Alertmanager) sees a broken pipe instead
//! of a clear 413, logs a transport error and retries.
//!
//! So a connection the server closes first is not closed at once: its write side is
//! shut (the client reads the answer, then the end), and what the client still
//! sends is read and thrown away until the client closes too, for at most
//! [`Linger::time`] in all, [`Linger::timeout`] between reads and [`Linger::bytes`]
//! in all; a client that never stops is cut off at the first bound it meets. A
//! connection whose client closed first has nothing to linger for and closes at
//! once.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;

use crate::admission::Slot;

/// How long, and how much, a closing connection reads and discards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Linger {
    /// At most this long in all (nginx's `lingering_time`, 30 s).
    pub time: Duration,
    /// At most this long waiting for the client's next bytes (nginx's
    /// `lingering_timeout`, 5 s).
    pub timeout: Duration,
    /// At most this many bytes in all.
    pub bytes: u64,
}

impl Default for Linger {
    fn default() -> Self {
        Self {
            time: Duration::from_secs(30),
            timeout: Duration::from_secs(5),
            bytes: 64 << 20,
        }
    }
}

/// An accepted connection's socket, with its place among the listener's connections:
/// dropped, it lingers ([`Linger`]) unless the client closed first, and its place is
/// given back once it is really closed.
pub(crate) struct Socket {
    /// `None` once handed to the lingering task.
    stream: Option<TcpStream>,
    /// The client closed its side: a read returned the end.
    client_closed: bool,
    linger: Linger,
    slot: Option<Slot>,
}

impl Socket {
    pub(crate) fn new(stream: TcpStream, linger: Linger, slot: Slot) -> Self {
        Socket {
            stream: Some(stream),
            client_closed: false,
            linger,
            slot: Some(slot),
        }
    }

    fn stream(&mut self) -> Pin<&mut TcpStream> {
        Pin::new(
            self.stream
                .as_mut()
                .expect("a socket is used until dropped"),
        )
    }
}

impl AsyncRead for Socket {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let poll = this.stream().poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = poll
            && buf.filled().len() == before
            && buf.remaining() > 0
        {
            this.client_closed = true;
        }
        poll
    }
}

impl AsyncWrite for Socket {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().stream().poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().stream().poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream
            .as_ref()
            .is_some_and(TcpStream::is_write_vectored)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().stream().poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().stream().poll_shutdown(cx)
    }
}

impl Drop for Socket {
    fn drop(&mut self) {
        let (Some(stream), false) = (self.stream.take(), self.client_closed) else {
            return;
        };
        // On the runtime the socket is registered with (the connection's own); with
        // none (a runtime shutting down), it just closes.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(linger(stream, self.linger, self.slot.take()));
        }
    }
}

/// Shuts the write side of `stream`, then reads and discards until the client
/// closes or a bound of `linger` is met; then closes, giving `slot` back.
async fn linger(mut stream: TcpStream, linger: Linger, slot: Option<Slot>) {
    let _slot = slot;
    // The answer was written; the end of it follows. (hyper has usually shut it
    // already; a second shutdown changes nothing.)
    let _ = stream.shutdown().await;
    let until = tokio::time::Instant::now() + linger.time;
    let mut left = linger.bytes;
    let mut buf = [0u8; 4096];
    while left > 0 {
        let wait = until.min(tokio::time::Instant::now() + linger.timeout);
        match tokio::time::timeout_at(wait, stream.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => left = left.saturating_sub(n as u64),
            // Closed, reset, or a bound met.
            _ => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::Linger;
    use crate::admission::Connections;

    /// A socket pair: (the server's [`super::Socket`], the client's stream), and the
    /// connections it counts among.
    async fn pair(
        linger: Linger,
    ) -> (
        super::Socket,
        tokio::net::TcpStream,
        std::sync::Arc<Connections>,
    ) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = tokio::net::TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (server, peer) = listener.accept().await.unwrap();
        let conns = Connections::new(crate::ConnLimits::default());
        let slot = conns.admit(peer.ip()).unwrap();
        (super::Socket::new(server, linger, slot), client, conns)
    }

    /// Waits until `conns` holds none (the lingering task gave its place back).
    async fn all_closed(conns: &Connections, within: Duration) -> Duration {
        let started = tokio::time::Instant::now();
        while conns.open() > 0 {
            assert!(
                started.elapsed() < within,
                "still lingering after {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        started.elapsed()
    }

    #[tokio::test]
    async fn what_the_client_sends_after_the_answer_is_read_and_discarded() {
        let (mut server, mut client, conns) = pair(Linger::default()).await;
        client.write_all(b"POST / HTTP/1.1\r\n\r\n").await.unwrap();
        let mut head = [0u8; 19];
        server.read_exact(&mut head).await.unwrap();
        server.write_all(b"HTTP/1.1 413 \r\n\r\n").await.unwrap();
        drop(server);
        // The client goes on sending its body (more than any socket buffer holds),
        // then reads the answer: a reset would fail the writes or lose the answer.
        let body = vec![b'x'; 4 << 20];
        client.write_all(&body).await.unwrap();
        let mut answer = Vec::new();
        client.read_to_end(&mut answer).await.unwrap();
        assert_eq!(answer, b"HTTP/1.1 413 \r\n\r\n");
        drop(client);
        all_closed(&conns, Duration::from_secs(2)).await;
    }

    #[tokio::test]
    async fn a_client_that_closed_first_is_not_waited_for() {
        let (mut server, client, conns) = pair(Linger::default()).await;
        drop(client);
        let mut rest = Vec::new();
        server.read_to_end(&mut rest).await.unwrap();
        drop(server);
        assert_eq!(conns.open(), 0, "closed at once");
    }

    #[tokio::test]
    async fn a_client_that_sends_slowly_forever_is_cut_off_at_the_time_bound() {
        let linger = Linger {
            time: Duration::from_millis(400),
            timeout: Duration::from_secs(5),
            bytes: u64::MAX,
        };
        let (server, mut client, conns) = pair(linger).await;
        drop(server);
        let sending = tokio::spawn(async move {
            // Until the server cuts it off (a reset fails a write).
            for _ in 0..200 {
                if client.write_all(b"x").await.is_err() {
                    return true;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            false
        });
        let took = all_closed(&conns, Duration::from_secs(3)).await;
        assert!(took >= Duration::from_millis(350), "{took:?}");
        assert!(sending.await.unwrap(), "the client was cut off");
    }

    #[tokio::test]
    async fn a_client_that_goes_quiet_is_cut_off_at_the_timeout() {
        let linger = Linger {
            time: Duration::from_secs(30),
            timeout: Duration::from_millis(300),
            bytes: u64::MAX,
        };
        let (server, _client, conns) = pair(linger).await;
        drop(server);
        let took = all_closed(&conns, Duration::from_secs(3)).await;
        assert!(took >= Duration::from_millis(250), "{took:?}");
    }

    #[tokio::test]
    async fn a_client_that_floods_is_cut_off_at_the_byte_bound() {
        let linger = Linger {
            time: Duration::from_secs(30),
            timeout: Duration::from_secs(5),
            bytes: 1 << 20,
        };
        let (server, mut client, conns) = pair(linger).await;
        drop(server);
        let sending = tokio::spawn(async move {
            let chunk = vec![b'x'; 64 << 10];
            // Far past the bound (256 MiB), unless cut off first.
            for _ in 0..4096 {
                if client.write_all(&chunk).await.is_err() {
                    return true;
                }
            }
            false
        });
        all_closed(&conns, Duration::from_secs(3)).await;
        assert!(sending.await.unwrap(), "the client was cut off");
    }
}
