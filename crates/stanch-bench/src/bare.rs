//! A bare HTTP/1 proxy on hyper: the floor under stanch-gateway in the gateway
//! benchmark. It forwards each request to the next upstream in turn over a kept-alive
//! connection, and does nothing else: no route table, no endpoint choice, no metrics,
//! no timeouts, retries or fallbacks. What stanch-gateway costs above it is the price of
//! its features; what it costs above nginx is hyper and tokio.

use std::cell::{Cell, RefCell};
use std::net::SocketAddr;
use std::rc::Rc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;

/// One upstream and its idle connections.
struct Upstream {
    addr: String,
    idle: RefCell<Vec<SendRequest<Full<Bytes>>>>,
}

/// Serves until the process is killed, on `threads` threads that each accept on their
/// own `SO_REUSEPORT` listener and keep their own upstream connections.
pub fn run(listen: SocketAddr, upstreams: Vec<String>, threads: usize) -> anyhow::Result<()> {
    anyhow::ensure!(!upstreams.is_empty(), "at least one --upstream");
    let workers: Vec<_> = (0..threads.max(1))
        .map(|_| {
            let upstreams = upstreams.clone();
            std::thread::spawn(move || one_thread(listen, upstreams))
        })
        .collect();
    for w in workers {
        w.join()
            .map_err(|_| anyhow::anyhow!("a proxy thread panicked"))??;
    }
    Ok(())
}

fn one_thread(listen: SocketAddr, upstreams: Vec<String>) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let upstreams: Rc<Vec<Upstream>> = Rc::new(
        upstreams
            .into_iter()
            .map(|addr| Upstream {
                addr,
                idle: RefCell::new(Vec::new()),
            })
            .collect(),
    );
    let next = Rc::new(Cell::new(0usize));
    tokio::task::LocalSet::new().block_on(&runtime, async move {
        let socket = tokio::net::TcpSocket::new_v4()?;
        socket.set_reuseport(true)?;
        socket.set_reuseaddr(true)?;
        socket.bind(listen)?;
        let listener = socket.listen(1024)?;
        loop {
            let (stream, _) = listener.accept().await?;
            stream.set_nodelay(true)?;
            let (upstreams, next) = (upstreams.clone(), next.clone());
            let service = hyper::service::service_fn(move |request| {
                forward(upstreams.clone(), next.clone(), request)
            });
            tokio::task::spawn_local(
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service),
            );
        }
    })
}

async fn forward(
    upstreams: Rc<Vec<Upstream>>,
    next: Rc<Cell<usize>>,
    request: hyper::Request<hyper::body::Incoming>,
) -> anyhow::Result<hyper::Response<Full<Bytes>>> {
    let (parts, body) = request.into_parts();
    let body = body.collect().await?.to_bytes();
    let upstream = &upstreams[next.replace(next.get() + 1) % upstreams.len()];
    let idle = upstream.idle.borrow_mut().pop();
    let mut sender = match idle {
        Some(sender) => sender,
        None => {
            let stream = tokio::net::TcpStream::connect(&upstream.addr).await?;
            stream.set_nodelay(true)?;
            let (sender, connection) =
                hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
            tokio::task::spawn_local(connection);
            sender
        }
    };
    let request = hyper::Request::builder()
        .method(parts.method)
        .uri(parts.uri)
        .header(hyper::header::HOST, upstream.addr.as_str())
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(body))?;
    let (parts, body) = sender.send_request(request).await?.into_parts();
    let body = body.collect().await?.to_bytes();
    upstream.idle.borrow_mut().push(sender);
    Ok(hyper::Response::from_parts(parts, Full::new(body)))
}
