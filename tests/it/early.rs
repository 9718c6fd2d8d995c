//! Early answers arrive: every answer either server gives before it has read a
//! request's body (401, 403, 404, 405, 413, 415) reaches a client that writes its
//! whole request before reading, as Python's `http.client` and Alertmanager do,
//! on 100 fresh connections of 100, over plain TCP and TLS, with and without
//! `Expect: 100-continue`. Without a lingering close, the kernel resets a connection
//! closed with the body unread and the client sees a broken pipe instead.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use crate::process::Server;

/// Connections per answer.
const TRIES: usize = 100;
/// Clients at once.
const CLIENTS: usize = 4;
/// A body past the controller's 1 MiB intake limit; the other answers get a
/// smaller one (any unread byte makes a reset).
const LARGE: usize = 2 << 20;
const SMALL: usize = 256 << 10;

/// How a client sends.
#[derive(Debug, Clone, Copy)]
enum Client {
    /// Headers, then the body at once, then reads.
    Eager,
    /// `Expect: 100-continue`, waits for the answer and sends no body when it is final
    /// (as curl does).
    Waits,
    /// `Expect: 100-continue`, but sends the body after 20 ms anyway, then reads (a
    /// client with a short expect timeout).
    Impatient,
}

/// One request: the status line's code, or how the exchange failed.
fn exchange(
    mut stream: impl Read + Write,
    head: &str,
    body: usize,
    client: Client,
) -> Result<u16, String> {
    let expect = match client {
        Client::Eager => "",
        Client::Waits | Client::Impatient => "Expect: 100-continue\r\n",
    };
    let head = format!("{head}Content-Length: {body}\r\n{expect}\r\n");
    stream
        .write_all(head.as_bytes())
        .map_err(|e| format!("writing the head: {e}"))?;
    match client {
        Client::Eager => {}
        Client::Impatient => std::thread::sleep(Duration::from_millis(20)),
        Client::Waits => return read_answer(stream),
    }
    let chunk = vec![b'x'; 64 << 10];
    let mut left = body;
    while left > 0 {
        let n = left.min(chunk.len());
        stream.write_all(&chunk[..n]).map_err(|e| {
            format!(
                "writing the body, {} of {body} bytes sent: {e}",
                body - left
            )
        })?;
        left -= n;
    }
    read_answer(stream)
}

/// The status of the answer (after a `100 Continue`, if one came first), read whole
/// by its `Content-Length`, or to the end of the connection without one.
fn read_answer(mut stream: impl Read) -> Result<u16, String> {
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&answer).into_owned();
        let text = text
            .strip_prefix("HTTP/1.1 100 Continue\r\n\r\n")
            .unwrap_or(&text);
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let length = head.lines().find_map(|l| {
                let (name, value) = l.split_once(':')?;
                name.eq_ignore_ascii_case("content-length")
                    .then(|| value.trim().parse::<usize>().ok())?
            });
            if length.is_some_and(|n| body.len() >= n) {
                return head
                    .get(9..12)
                    .and_then(|s| s.parse().ok())
                    .ok_or_else(|| format!("no status in {head:?}"));
            }
        }
        match stream.read(&mut buf) {
            Ok(0) => return Err(format!("the connection ended within the answer: {text:?}")),
            Ok(n) => answer.extend_from_slice(&buf[..n]),
            Err(e) => {
                return Err(format!(
                    "reading the answer ({} bytes read): {e}",
                    answer.len()
                ));
            }
        }
    }
}

/// Runs `TRIES` exchanges, `CLIENTS` at once, each on a fresh connection `connect`
/// makes; panics unless every one got `status`.
fn every_time<S: Read + Write>(
    what: &str,
    connect: impl Fn() -> S + Sync,
    head: &str,
    body: usize,
    client: Client,
    status: u16,
) {
    let failures: Vec<String> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..CLIENTS)
            .map(|_| {
                scope.spawn(|| {
                    (0..TRIES / CLIENTS)
                        .filter_map(|_| match exchange(connect(), head, body, client) {
                            Ok(got) if got == status => None,
                            Ok(got) => Some(format!("status {got}")),
                            Err(e) => Some(e),
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap())
            .collect()
    });
    assert!(
        failures.is_empty(),
        "{what} ({client:?}): {} of {TRIES} did not get {status}; first: {}",
        failures.len(),
        failures[0]
    );
}

fn plain(addr: SocketAddr) -> impl Fn() -> TcpStream + Sync {
    move || {
        let s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s
    }
}

fn addr(base: &str) -> SocketAddr {
    base.rsplit("://").next().unwrap().parse().unwrap()
}

#[test]
fn the_controllers_early_answers_arrive_every_time() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[], "http");
    let at = plain(addr(&server.base));
    let host = "Host: 127.0.0.1\r\n";
    let ingest = "Authorization: Bearer ing\r\nContent-Type: application/json\r\n";
    let cases = [
        (
            "too large for the intake",
            format!("POST /v1/alerts/alertmanager HTTP/1.1\r\n{host}{ingest}"),
            LARGE,
            413,
        ),
        (
            "no token",
            format!("POST /v1/alerts/alertmanager HTTP/1.1\r\n{host}"),
            SMALL,
            401,
        ),
        (
            "no such path",
            format!("POST /v1/nope HTTP/1.1\r\n{host}"),
            SMALL,
            404,
        ),
        (
            "a method the path does not take",
            format!("PUT /v1/routes HTTP/1.1\r\n{host}Authorization: Bearer adm\r\n"),
            SMALL,
            405,
        ),
    ];
    for (what, head, body, status) in &cases {
        every_time(what, &at, head, *body, Client::Eager, *status);
    }
    for client in [Client::Waits, Client::Impatient] {
        let (what, head, body, status) = &cases[0];
        every_time(what, &at, head, *body, client, *status);
    }
}

#[test]
fn the_controllers_early_answers_arrive_every_time_over_tls() {
    let dir = tempfile::tempdir().unwrap();
    let (server, cert) = Server::start_tls(dir.path());
    let mut roots = rustls::RootCertStore::empty();
    for c in stanch_server::net::certificates(&cert).unwrap() {
        roots.add(c).unwrap();
    }
    let config = rustls::ClientConfig::builder_with_provider(stanch_server::net::crypto_provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let config = Arc::new(config);
    let tcp = plain(addr(&server.base));
    let tls = || {
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        let conn = rustls::ClientConnection::new(config.clone(), name).unwrap();
        rustls::StreamOwned::new(conn, tcp())
    };
    let head = "POST /v1/alerts/alertmanager HTTP/1.1\r\nHost: localhost\r\n\
                Authorization: Bearer ing\r\nContent-Type: application/json\r\n";
    for client in [Client::Eager, Client::Impatient] {
        every_time("too large, over TLS", tls, head, LARGE, client, 413);
    }
    let head = "POST /v1/alerts/alertmanager HTTP/1.1\r\nHost: localhost\r\n";
    every_time("no token, over TLS", tls, head, SMALL, Client::Eager, 401);
}

/// A controller without tokens (loopback only) refuses state changes that a web page
/// could send: not JSON (415), or from another site (403), before reading the body.
#[test]
fn an_open_controllers_cross_site_refusals_arrive_every_time() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_with(
        dir.path(),
        &[],
        "http",
        "warn",
        std::process::Stdio::null(),
        ["", "", ""],
    );
    let at = plain(addr(&server.base));
    let start = "POST /v1/admin/dry-run HTTP/1.1\r\nHost: 127.0.0.1\r\n";
    let not_json = format!("{start}Content-Type: text/plain\r\n");
    every_time("not JSON", &at, &not_json, SMALL, Client::Eager, 415);
    let cross_site =
        format!("{start}Content-Type: application/json\r\nOrigin: https://evil.example\r\n");
    every_time(
        "from another site",
        &at,
        &cross_site,
        SMALL,
        Client::Eager,
        403,
    );
}

#[test]
fn the_gateways_early_answers_arrive_every_time() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let yaml = "models:\n  m:\n    pools:\n      - name: a\n        endpoints: [{url: 'http://127.0.0.1:9'}]\n\
                tenants:\n  - {name: t, key: secret-key}\n\
                max_body_bytes: 1048576\n";
    let config = stanch_gateway::config::GatewayConfig::from_yaml(yaml).unwrap();
    let gateway =
        stanch_gateway::Gateway::new(config, None, Arc::new(stanch_ports::clock::SystemClock))
            .unwrap();
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let at = plain(listener.local_addr().unwrap());
    runtime.spawn(stanch_gateway::serve(
        listener,
        Arc::new(gateway),
        std::future::pending(),
    ));
    let host = "Host: 127.0.0.1\r\nContent-Type: application/json\r\n";
    let key = "Authorization: Bearer secret-key\r\n";
    let chat = "POST /v1/chat/completions HTTP/1.1\r\n";
    let cases = [
        ("too large", format!("{chat}{host}{key}"), LARGE, 413),
        (
            "no such path",
            format!("POST /v1/nope HTTP/1.1\r\n{host}"),
            SMALL,
            404,
        ),
        (
            "a method the path does not take",
            format!("PUT /v1/chat/completions HTTP/1.1\r\n{host}{key}"),
            SMALL,
            405,
        ),
    ];
    for (what, head, body, status) in &cases {
        every_time(what, &at, head, *body, Client::Eager, *status);
    }
    let (what, head, body, status) = &cases[0];
    every_time(what, &at, head, *body, Client::Impatient, *status);
}
