//! The listener's tests: served connections, limits, workers, the drain.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::WriteDeadline;

/// Serves a router with one route on loopback with `limits`.
async fn listening(
    limits: crate::ConnLimits,
) -> (std::net::SocketAddr, tokio::sync::oneshot::Sender<()>) {
    let app = axum::Router::new().route("/", axum::routing::get(|| async { "ok" }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let app = hyper_util::service::TowerToHyperService::new(app);
    tokio::spawn(crate::serve(
        listener,
        app,
        None,
        crate::Connections::new(limits),
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
    let drain = crate::drain::Drain::default();
    let conns = crate::Connections::new(crate::ConnLimits::default());
    let conn = crate::listen::Connection {
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
    let limits = crate::ConnLimits {
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
    let limits = crate::ConnLimits {
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
    let limits = crate::ConnLimits {
        max_connections: 5,
        max_per_source: 3,
        ..Default::default()
    };
    let app = axum::Router::new().route("/", axum::routing::get(|| async { "ok" }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let conns = crate::Connections::new(limits);
    let app = hyper_util::service::TowerToHyperService::new(app);
    tokio::spawn(crate::serve(
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
    assert_eq!(conns.refused(crate::Refused::PerSource), 1);
    assert_eq!(conns.refused(crate::Refused::Max), 1);
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
    let limits = crate::ConnLimits {
        http2: Some(crate::Http2Limits {
            idle_timeout: Duration::from_millis(300),
            ..Default::default()
        }),
        ..Default::default()
    };
    // A stream that stays open: a body that never ends.
    let app = axum::Router::new().route(
        "/",
        axum::routing::get(|| async {
            let forever = futures_util::stream::pending::<Result<bytes::Bytes, std::io::Error>>();
            axum::body::Body::from_stream(forever)
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = hyper_util::service::TowerToHyperService::new(app);
    let conns = crate::Connections::new(limits);
    tokio::spawn(crate::serve(
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
    workers: std::sync::Arc<crate::Workers>,
    addr: std::net::SocketAddr,
    stop: tokio::sync::oneshot::Sender<()>,
    serving: tokio::task::JoinHandle<()>,
}

async fn on_workers(app: axum::Router, name: &str, limits: crate::ConnLimits) -> OnWorkers {
    let workers = std::sync::Arc::new(crate::Workers::start(2, name).unwrap());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = {
        let workers = workers.clone();
        tokio::spawn(async move {
            let app = hyper_util::service::TowerToHyperService::new(app);
            crate::serve_on(
                &workers,
                listener,
                app,
                None,
                crate::Connections::new(limits),
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
            let spawned = tokio::spawn(async { crate::worker_index() }).await.unwrap();
            format!("{:?} {:?}", crate::worker_index(), spawned)
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
    assert_eq!(crate::worker_index(), None, "not a worker thread");
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
    let limits = crate::ConnLimits {
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
    let limits = crate::ConnLimits {
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
    assert_eq!(crate::raise_open_file_limit(), Some((hard - 1, hard)));
    assert_eq!(getrlimit(Resource::Nofile).current, Some(hard));
    assert_eq!(
        crate::raise_open_file_limit(),
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
