//! The gRPC watch on the API port: the session's protocol (Hello, tables latest-only,
//! Ack and Nack), the statuses for bad input, health checking, and one snapshot
//! served alike over HTTP, SSE and gRPC.

use std::time::Duration;

use futures_util::StreamExt;
use serde_json::{Value, json};
use stanch_api::RouteTable;
use stanch_proto::grpc_frame;
use stanch_proto::v1::route_watch_client::RouteWatchClient;
use stanch_proto::v1::{self, watch_request, watch_response};
use tokio::sync::mpsc;
use tonic::Code;
use tonic::codegen::tokio_stream::wrappers::ReceiverStream;

use crate::support::*;

/// A gRPC stream to the controller: what the test sends, what it hears.
struct Stream {
    out: mpsc::Sender<v1::WatchRequest>,
    inbound: tonic::Streaming<v1::WatchResponse>,
}

async fn channel(h: &Harness) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_shared(h.base.clone())
        .unwrap()
        .connect()
        .await
        .unwrap()
}

/// Opens `WatchRoutes` with `token`, sending `first` (if any) at once.
async fn open(
    h: &Harness,
    token: Option<&str>,
    first: Option<watch_request::Kind>,
) -> Result<Stream, tonic::Status> {
    let mut client = RouteWatchClient::new(channel(h).await);
    let (out, outbound) = mpsc::channel(8);
    if let Some(kind) = first {
        out.send(v1::WatchRequest { kind: Some(kind) })
            .await
            .unwrap();
    }
    let mut request = tonic::Request::new(ReceiverStream::new(outbound));
    if let Some(t) = token {
        request
            .metadata_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    let inbound = client.watch_routes(request).await?.into_inner();
    Ok(Stream { out, inbound })
}

fn hello(id: &str, version: u64, epoch: &str) -> watch_request::Kind {
    watch_request::Kind::Hello(v1::Hello {
        gateway_id: id.into(),
        version,
        epoch: epoch.into(),
    })
}

impl Stream {
    async fn send(&self, kind: watch_request::Kind) {
        self.out
            .send(v1::WatchRequest { kind: Some(kind) })
            .await
            .unwrap();
    }

    /// The next message, within 5 s.
    async fn next(&mut self) -> Result<watch_response::Kind, tonic::Status> {
        let message = tokio::time::timeout(Duration::from_secs(5), self.inbound.message())
            .await
            .expect("a message within 5 s")?
            .expect("the stream is open");
        Ok(message.kind.expect("a message with a kind"))
    }

    async fn table(&mut self) -> v1::RouteTable {
        loop {
            match self.next().await.unwrap() {
                watch_response::Kind::Table(t) => return t,
                watch_response::Kind::Heartbeat(_) => continue,
            }
        }
    }

    /// The status the controller ends the stream with.
    async fn ended(&mut self) -> tonic::Status {
        loop {
            match self.next().await {
                Ok(_) => continue,
                Err(status) => return status,
            }
        }
    }

    async fn ack(&self, t: &v1::RouteTable) {
        self.send(watch_request::Kind::Ack(v1::Ack {
            version: t.version,
            epoch: t.epoch.clone(),
        }))
        .await;
    }
}

/// The gateway `id` as the status report shows it.
async fn gateway(h: &Harness, id: &str) -> Value {
    let status = h.json("/v1/status").await;
    status["gateways"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["id"] == id)
        .cloned()
        .unwrap_or_else(|| panic!("no gateway {id} in {status}"))
}

/// Waits until the status report shows gateway `id` as `check` wants it.
async fn eventually(h: &Harness, id: &str, check: impl Fn(&Value) -> bool) -> Value {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let g = gateway(h, id).await;
        if check(&g) {
            return g;
        }
        assert!(tokio::time::Instant::now() < deadline, "gateway {id}: {g}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn quick() -> Options {
    let mut opts = Options::default();
    opts.server.watch.heartbeat = stanch_api::HumanDuration(Duration::from_millis(200));
    opts.server.watch.slow_client_timeout = stanch_api::HumanDuration(Duration::from_millis(500));
    opts
}

#[tokio::test]
async fn a_gateway_gets_the_table_then_each_version_and_its_acks_show_in_status() {
    let h = Harness::start().await;
    let mut s = open(&h, Some(READ), Some(hello("gw-grpc", 0, "")))
        .await
        .unwrap();
    let first = s.table().await;
    assert_eq!(first.version, h.routes().await["version"].as_u64().unwrap());
    s.ack(&first).await;
    let g = eventually(&h, "gw-grpc", |g| g["applied_version"] == first.version).await;
    assert_eq!(g["transport"], "grpc");
    assert_eq!(g["connected"], true);
    assert_eq!(g["converged"], true);
    assert_eq!(g["lag"], 0);

    let next = fail_dc_a(&h).await;
    let second = s.table().await;
    assert_eq!(second.version, next);
    assert_eq!(
        second.models["qwen-72b"].rung,
        i32::from(v1::Rung::Failover),
        "{second:?}"
    );
    // Before the Ack it is behind by one.
    let g = gateway(&h, "gw-grpc").await;
    assert_eq!(g["converged"], false);
    assert_eq!(g["lag"], 1);
    s.ack(&second).await;
    eventually(&h, "gw-grpc", |g| g["converged"] == true).await;

    drop(s);
    let g = eventually(&h, "gw-grpc", |g| g["connected"] == false).await;
    assert_eq!(g["stale"], false, "just gone: not stale yet");
}

#[tokio::test]
async fn a_resumed_watch_is_not_sent_the_table_it_holds_and_hears_heartbeats() {
    let h = Harness::with(quick()).await;
    let table: RouteTable = serde_json::from_value(h.routes().await).unwrap();
    let mut s = open(
        &h,
        Some(READ),
        Some(hello("gw-resume", table.version, &table.epoch)),
    )
    .await
    .unwrap();
    match s.next().await.unwrap() {
        watch_response::Kind::Heartbeat(beat) => {
            assert_eq!(beat.interval_ms, 200);
            assert_eq!(beat.latest_version, table.version);
        }
        other => panic!("a heartbeat, not {other:?}"),
    }
    // What it said it holds counts as applied.
    let g = gateway(&h, "gw-resume").await;
    assert_eq!(g["converged"], true);
    let next = fail_dc_a(&h).await;
    assert_eq!(s.table().await.version, next);
}

/// A gateway that has not answered its last table is sent no other; once it answers,
/// it is sent the newest version, none of those published meanwhile, however much
/// room HTTP/2 flow control leaves for them. An answer to an older table it was sent
/// does not count for the last.
#[tokio::test]
async fn a_table_goes_once_the_last_is_answered_and_it_is_the_newest() {
    let h = Harness::start().await;
    let mut s = open(&h, Some(READ), Some(hello("gw-slow", 0, "")))
        .await
        .unwrap();
    let first = s.table().await;
    s.ack(&first).await;
    let second_version = fail_dc_a(&h).await;
    let second = s.table().await;
    assert_eq!(second.version, second_version);
    let mut published = second_version;
    for i in 0..3 {
        let r = h
            .admin(
                "block",
                json!({"endpoint": format!("http://10.9.0.{i}:8000"), "ttl": "1h", "reason": "slow gateway"}),
            )
            .await;
        assert_eq!(r.status(), 200);
        published = h.routes().await["version"].as_u64().unwrap();
    }
    assert!(published >= second_version + 3);
    // A late Ack of the first table is taken, and is not the answer to the second.
    s.ack(&first).await;
    let early = tokio::time::timeout(Duration::from_millis(500), s.inbound.message()).await;
    assert!(
        early.is_err(),
        "nothing before the second is answered: {early:?}"
    );
    s.ack(&second).await;
    let newest = s.table().await;
    assert_eq!(newest.version, published, "the newest, none between");
    s.ack(&newest).await;
    eventually(&h, "gw-slow", |g| g["converged"] == true).await;
}

#[tokio::test]
async fn another_epoch_gets_the_current_table_whatever_its_version() {
    let h = Harness::start().await;
    let current = h.routes().await["version"].as_u64().unwrap();
    let mut s = open(
        &h,
        Some(READ),
        Some(hello("gw-other", 1_000_000, "an-epoch-long-gone")),
    )
    .await
    .unwrap();
    assert_eq!(s.table().await.version, current);
}

#[tokio::test]
async fn a_nack_is_shown_with_its_reason_and_counted() {
    let h = Harness::start().await;
    let mut s = open(&h, Some(READ), Some(hello("gw-nack", 0, "")))
        .await
        .unwrap();
    let t = s.table().await;
    s.send(watch_request::Kind::Nack(v1::Nack {
        version: t.version,
        epoch: t.epoch.clone(),
        reason: "unknown FAQ set \"billing\"\nsecond line".into(),
    }))
    .await;
    let g = eventually(&h, "gw-nack", |g| !g["rejected"].is_null()).await;
    assert_eq!(g["rejected"][0], t.version);
    assert_eq!(
        g["rejected"][1], "unknown FAQ set \"billing\" second line",
        "control characters are not kept"
    );
    assert_eq!(g["converged"], false);
    let metrics = h.get("/metrics", None).await.text().await.unwrap();
    assert!(
        metrics.contains(r#"stanch_gateway_nacks_total{transport="grpc"} 1"#),
        "{metrics}"
    );
}

#[tokio::test]
async fn watching_needs_the_read_token() {
    let h = Harness::start().await;
    for token in [None, Some(INGEST), Some("wrong")] {
        let status = match open(&h, token, Some(hello("gw", 0, ""))).await {
            Err(status) => status,
            Ok(mut s) => s.ended().await,
        };
        assert_eq!(
            status.code(),
            Code::Unauthenticated,
            "{token:?}: {status:?}"
        );
        assert!(status.message().contains("Bearer"), "{status:?}");
    }
    let mut s = open(&h, Some(ADMIN), Some(hello("gw", 0, "")))
        .await
        .unwrap();
    s.table().await;
}

/// Every way out of protocol ends the stream with a status that says what was
/// wrong, and the controller goes on serving the others.
#[tokio::test]
async fn messages_out_of_protocol_end_the_stream_with_a_clear_status() {
    let h = Harness::with(quick()).await;
    let ack = |version: u64, epoch: &str| {
        watch_request::Kind::Ack(v1::Ack {
            version,
            epoch: epoch.into(),
        })
    };
    let current: RouteTable = serde_json::from_value(h.routes().await).unwrap();

    // Nothing at all: the Hello is awaited for the slow-client timeout.
    let mut s = open(&h, Some(READ), None).await.unwrap();
    let status = s.ended().await;
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert!(status.message().contains("no Hello"), "{status:?}");

    // An Ack first.
    let mut s = open(&h, Some(READ), Some(ack(1, &current.epoch)))
        .await
        .unwrap();
    let status = s.ended().await;
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status
            .message()
            .contains("first message must be a Hello, not an Ack"),
        "{status:?}"
    );

    // A message with nothing in it.
    let mut s = open(&h, Some(READ), None).await.unwrap();
    s.out.send(v1::WatchRequest { kind: None }).await.unwrap();
    let status = s.ended().await;
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().contains("no Hello, Ack or Nack"),
        "{status:?}"
    );

    // A gateway id that cannot name one.
    for id in ["", "line\nbreak", &"x".repeat(129)] {
        let mut s = open(&h, Some(READ), Some(hello(id, 0, ""))).await.unwrap();
        let status = s.ended().await;
        assert_eq!(status.code(), Code::InvalidArgument);
        assert!(status.message().contains("gateway_id"), "{status:?}");
    }

    // An Ack of a version never sent, of an epoch never sent, a second Hello.
    for (wrong, expected) in [
        (ack(current.version + 5, &current.epoch), "version"),
        (ack(current.version, "made-up"), "epoch \"made-up\""),
        (hello("gw-bad", 0, ""), "second Hello"),
    ] {
        let mut s = open(&h, Some(READ), Some(hello("gw-bad", 0, "")))
            .await
            .unwrap();
        s.table().await;
        s.send(wrong).await;
        let status = s.ended().await;
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(
            status.message().contains(expected),
            "{expected}: {status:?}"
        );
    }

    // A well-behaved gateway is served all along.
    let mut s = open(&h, Some(READ), Some(hello("gw-good", 0, "")))
        .await
        .unwrap();
    assert_eq!(s.table().await.version, current.version);
}

/// `WatchRoutes` opened over raw HTTP/2 (with this receive window), for what no gRPC
/// client sends or does.
struct RawWatch {
    /// The response to come.
    response: h2::client::ResponseFuture,
    /// The request body, to write.
    body: h2::SendStream<bytes::Bytes>,
    /// The connection, served until it ends.
    connection: tokio::task::JoinHandle<Result<(), h2::Error>>,
}

async fn raw_watch(h: &Harness, window: Option<u32>) -> RawWatch {
    let tcp = tokio::net::TcpStream::connect(h.controller.as_ref().unwrap().addr())
        .await
        .unwrap();
    let mut builder = h2::client::Builder::new();
    if let Some(window) = window {
        builder.initial_window_size(window);
    }
    let (client, connection) = builder.handshake(tcp).await.unwrap();
    let connection = tokio::spawn(connection);
    let mut client = client.ready().await.unwrap();
    let request = http::Request::post(format!("{}/stanch.v1.RouteWatch/WatchRoutes", h.base))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("authorization", format!("Bearer {READ}"))
        .body(())
        .unwrap();
    let (response, body) = client.send_request(request, false).unwrap();
    RawWatch {
        response,
        body,
        connection,
    }
}

/// Bytes that are no protobuf, over raw HTTP/2: a clear status, not a panic, and
/// the connection's other streams are unharmed.
#[tokio::test]
async fn garbage_on_the_wire_gets_invalid_argument() {
    let h = Harness::with(quick()).await;
    let RawWatch {
        response, mut body, ..
    } = raw_watch(&h, None).await;
    // A gRPC frame (uncompressed, 8 bytes) whose bytes are an invalid field tag.
    let mut frame = vec![0u8, 0, 0, 0, 8];
    frame.extend_from_slice(&[0xff; 8]);
    body.send_data(frame.into(), false).unwrap();
    let response = tokio::time::timeout(Duration::from_secs(5), response)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut body = response.into_body();
    while let Some(chunk) = body.data().await {
        chunk.unwrap();
    }
    let trailers = body.trailers().await.unwrap().expect("trailers");
    assert_eq!(
        trailers["grpc-status"], "3",
        "INVALID_ARGUMENT: {trailers:?}"
    );
    let message = trailers["grpc-message"].to_str().unwrap();
    assert!(message.contains("unreadable"), "{message}");

    let mut s = open(&h, Some(READ), Some(hello("gw-after", 0, "")))
        .await
        .unwrap();
    s.table().await;
}

/// A message begun and never finished (the review's: 65,530 bytes of one declared
/// as 65,535) would hold tonic's buffer for as long as heartbeats keep the stream
/// open: it ends the stream at the slow-client timeout, with a clear status, however
/// well the gateway reads.
#[tokio::test]
async fn a_message_begun_and_never_finished_ends_the_stream_at_the_deadline() {
    let h = Harness::with(quick()).await;
    let RawWatch {
        response, mut body, ..
    } = raw_watch(&h, None).await;
    let mut frame = grpc_frame(&v1::WatchRequest {
        kind: Some(hello("gw-partial", 0, "")),
    });
    // The next message's prefix says 65,535 bytes; 65,530 of them follow.
    frame.extend_from_slice(&[0, 0, 0, 0xff, 0xff]);
    frame.extend(std::iter::repeat_n(0x0a, 65_530));
    body.send_data(frame.into(), false).unwrap();
    let started = tokio::time::Instant::now();
    let response = response.await.unwrap();
    let mut answer = response.into_body();
    let mut heartbeats = 0;
    while let Some(chunk) = tokio::time::timeout(Duration::from_secs(5), answer.data())
        .await
        .expect("the stream ends")
    {
        let chunk = chunk.unwrap();
        let _ = answer.flow_control().release_capacity(chunk.len());
        heartbeats += 1;
    }
    let took = started.elapsed();
    let trailers = answer.trailers().await.unwrap().expect("trailers");
    assert_eq!(trailers["grpc-status"], "3", "{trailers:?}");
    // Percent-encoded, as gRPC sends messages.
    let message = trailers["grpc-message"]
        .to_str()
        .unwrap()
        .replace("%20", " ");
    assert!(message.contains("not whole within 500ms"), "{message}");
    assert!(
        took >= Duration::from_millis(450) && took < Duration::from_secs(3),
        "at the slow-client timeout (500 ms): {took:?}"
    );
    assert!(heartbeats >= 2, "the table and heartbeats came meanwhile");
    eventually(&h, "gw-partial", |g| g["connected"] == false).await;
}

/// A gateway `id` that says hello and then reads nothing: a window of a few bytes,
/// never released, so the controller can send it nothing past the first table. Its
/// connection, and what keeps its stream open.
async fn stuck(
    h: &Harness,
    id: &str,
) -> (
    tokio::task::JoinHandle<Result<(), h2::Error>>,
    impl Sized + use<>,
) {
    let RawWatch {
        response,
        mut body,
        connection,
    } = raw_watch(h, Some(64)).await;
    let frame = grpc_frame(&v1::WatchRequest {
        kind: Some(hello(id, 0, "")),
    });
    body.send_data(frame.into(), false).unwrap();
    let response = response.await.unwrap();
    eventually(h, id, |g| g["connected"] == true).await;
    (connection, (body, response))
}

/// With no new version to owe it, a gateway that reads nothing is cut off once it has
/// been given nothing, not even a heartbeat, for a heartbeat interval and the
/// slow-client timeout; one that reads its heartbeats stays.
#[tokio::test]
async fn a_gateway_given_nothing_for_a_heartbeat_and_the_timeout_is_cut_off() {
    let mut opts = Options::default();
    opts.server.watch.heartbeat = stanch_api::HumanDuration(Duration::from_millis(1000));
    opts.server.watch.slow_client_timeout = stanch_api::HumanDuration(Duration::from_millis(500));
    let h = Harness::with(opts).await;
    let mut good = open(&h, Some(READ), Some(hello("gw-reading", 0, "")))
        .await
        .unwrap();
    good.table().await;
    let started = tokio::time::Instant::now();
    let (connection, _stuck) = stuck(&h, "gw-silent").await;
    // Past the slow-client timeout, owing nothing: still connected.
    tokio::time::sleep(Duration::from_millis(900)).await;
    assert_eq!(gateway(&h, "gw-silent").await["connected"], true);
    eventually(&h, "gw-silent", |g| g["connected"] == false).await;
    assert!(
        started.elapsed() >= Duration::from_millis(1400),
        "not before a heartbeat interval and the timeout: {:?}",
        started.elapsed()
    );
    let closed = tokio::time::timeout(Duration::from_secs(2), connection).await;
    assert!(closed.is_ok(), "the connection is closed");
    // The one reading its heartbeats was never cut off.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(gateway(&h, "gw-reading").await["connected"], true);
}

/// A gateway that stops reading is cut off after the slow-client timeout, while
/// the others get every version.
#[tokio::test]
async fn a_gateway_that_stops_reading_is_cut_off_and_the_others_are_not_held_up() {
    let h = Harness::with(quick()).await;
    let (connection, _stuck) = stuck(&h, "gw-stuck").await;
    let mut good = open(&h, Some(READ), Some(self::hello("gw-reading", 0, "")))
        .await
        .unwrap();
    let first = good.table().await;
    good.ack(&first).await;
    let started = tokio::time::Instant::now();
    let next = fail_dc_a(&h).await;
    assert_eq!(good.table().await.version, next);
    assert!(started.elapsed() < Duration::from_secs(1));
    // Heartbeats pile up behind the stuck one's window until the timeout.
    eventually(&h, "gw-stuck", |g| g["connected"] == false).await;
    assert!(started.elapsed() >= Duration::from_millis(400));
    // Its connection is closed: nothing it holds stays on the controller.
    let closed = tokio::time::timeout(Duration::from_secs(2), connection).await;
    assert!(closed.is_ok(), "the connection is closed");
}

#[tokio::test]
async fn health_checking_answers_for_the_server_and_the_watch() {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    let h = Harness::start().await;
    let mut health = HealthClient::new(channel(&h).await);
    for service in ["", "stanch.v1.RouteWatch"] {
        let answer = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(answer.status(), ServingStatus::Serving, "{service:?}");
    }
    // Without a token: probes carry none.
    let unknown = health
        .check(HealthCheckRequest {
            service: "no.such.Service".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), Code::NotFound);
}

/// One version, one content: the table over HTTP, the SSE event and the gRPC
/// message are the same table.
#[tokio::test]
async fn http_sse_and_grpc_serve_the_same_snapshot() {
    let h = Harness::start().await;
    fail_dc_a(&h).await;
    let over_http: RouteTable = serde_json::from_value(h.routes().await).unwrap();

    let sse = h.get("/v1/routes/stream", Some(READ)).await;
    let mut body = sse.bytes_stream();
    let mut text = String::new();
    while !text.contains("\n\n") {
        let chunk = body.next().await.unwrap().unwrap();
        text.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    let event = text.split("\n\n").next().unwrap();
    assert!(
        event.contains(&format!("id: {}", over_http.version)),
        "{event}"
    );
    let data = event
        .lines()
        .find_map(|l| l.strip_prefix("data: "))
        .unwrap();
    let over_sse: RouteTable = serde_json::from_str(data).unwrap();

    let mut s = open(&h, Some(READ), Some(hello("gw-same", 0, "")))
        .await
        .unwrap();
    let over_grpc = RouteTable::try_from(s.table().await).unwrap();

    assert_eq!(over_sse, over_http);
    assert_eq!(over_grpc, over_http);
    assert_eq!(
        over_grpc.hash,
        RouteTable::content_hash(&over_grpc.models, &over_grpc.blocked),
        "the hash holds over the converted content"
    );
}
