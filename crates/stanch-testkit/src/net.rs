//! Ports and raw connections: what tests that speak to a server byte by byte share.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A port free on loopback now (another process may take it before it is used: bind
/// to port 0 where the code under test allows it).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("loopback has a free port")
        .port()
}

/// A slow sender: connects to `addr` (`host:port`, or a URL whose `http://` is left
/// out), sends the request `head` (ending in a blank line) and the first `sent` bytes
/// of a body it promised to be longer, and stops there.
pub async fn partial(addr: &str, head: &str, sent: usize) -> TcpStream {
    let mut s = TcpStream::connect(addr.trim_start_matches("http://"))
        .await
        .expect("the server accepts");
    s.write_all(head.as_bytes())
        .await
        .expect("the head is sent");
    s.write_all(&vec![b' '; sent])
        .await
        .expect("the first bytes are sent");
    s
}

/// Everything the server sends on `s` until it closes the connection, which it must
/// do within `within`.
pub async fn answer(mut s: TcpStream, within: Duration) -> String {
    let mut out = Vec::new();
    tokio::time::timeout(within, s.read_to_end(&mut out))
        .await
        .expect("the server answered and closed in time")
        .expect("the connection reads");
    String::from_utf8_lossy(&out).into_owned()
}
