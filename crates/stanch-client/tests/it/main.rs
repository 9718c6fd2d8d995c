//! The watch client against a real controller on loopback.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use stanch_client::{Transport, WatchConfig};
use stanch_core::Config;
use stanch_ports::clock::SystemClock;
use stanch_server::{Controller, Settings};
use stanch_testkit::wait::until;

async fn controller() -> (Controller, String) {
    let settings = Settings::in_memory(Config::default_config());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let c = Controller::start(settings, listener, Arc::new(SystemClock))
        .await
        .unwrap();
    let url = format!("http://{}", c.addr());
    (c, url)
}

async fn post(url: &str, path: &str, body: Value) -> Value {
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let r = http
        .post(format!("{url}{path}"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{path}: {}", r.status());
    r.json().await.unwrap()
}

async fn fail_dc_a(url: &str) -> u64 {
    let body = json!({"version": "4", "status": "firing", "alerts": [{"status": "firing",
        "labels": {"alertname": "F", "action": "trigger-failover", "target_model": "qwen-72b", "pool": "dc-a"},
        "startsAt": "2026-11-30T00:00:00Z", "endsAt": "0001-01-01T00:00:00Z"}]});
    post(url, "/v1/alerts/alertmanager", body).await["version"]
        .as_u64()
        .unwrap()
}

async fn status(url: &str) -> Value {
    reqwest::get(format!("{url}/v1/status"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

async fn follows(transport: Transport) {
    let (_c, url) = controller().await;
    let mut config = WatchConfig::new(&url, "gw-test");
    config.transport = transport;
    config.long_poll_wait = Duration::from_secs(5);
    let (mut routes, task) = stanch_client::start(config, None);
    let first = routes.changed_from(0).await.unwrap();
    assert_eq!(first.models["qwen-72b"].rung, stanch_api::Rung::Normal);
    let new = fail_dc_a(&url).await;
    let table = tokio::time::timeout(Duration::from_secs(3), routes.changed_from(first.version))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(table.version, new);
    assert_eq!(table.models["qwen-72b"].pool, "dc-b");
    // The controller learns which version the gateway applied, and how it watches.
    let watching = match transport {
        Transport::Grpc => "grpc",
        Transport::LongPoll => "long_poll",
        Transport::Sse | Transport::Auto => "sse",
    };
    until("acknowledged", Duration::from_secs(5), || async {
        let s = status(&url).await;
        let g = &s["gateways"][0];
        g["id"] == "gw-test"
            && g["applied_version"] == new
            && g["transport"] == watching
            && g["converged"] == true
    })
    .await;
    task.abort();
}

#[tokio::test]
async fn follows_by_grpc_and_acknowledges() {
    follows(Transport::Grpc).await;
}

#[tokio::test]
async fn follows_by_sse_and_acknowledges() {
    follows(Transport::Sse).await;
}

#[tokio::test]
async fn follows_by_long_poll_and_acknowledges() {
    follows(Transport::LongPoll).await;
}

#[tokio::test]
async fn falls_back_to_long_poll_when_sse_is_refused() {
    use axum::routing::get;
    let (_c, upstream) = controller().await;
    // A proxy that refuses streams, as some corporate proxies do.
    let app = axum::Router::new()
        .route(
            "/v1/routes/stream",
            get(|| async { axum::http::StatusCode::NOT_FOUND }),
        )
        .route(
            "/v1/routes",
            get(move |q: axum::extract::RawQuery| {
                let upstream = upstream.clone();
                async move {
                    let url = format!("{upstream}/v1/routes?{}", q.0.unwrap_or_default());
                    let r = reqwest::get(url).await.unwrap();
                    let status = axum::http::StatusCode::from_u16(r.status().as_u16()).unwrap();
                    (status, r.bytes().await.unwrap())
                }
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let proxy = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let (mut routes, task) = stanch_client::start(WatchConfig::new(&proxy, "gw-fallback"), None);
    let table = tokio::time::timeout(Duration::from_secs(3), routes.changed_from(0))
        .await
        .unwrap()
        .unwrap();
    assert!(table.version >= 1);
    task.abort();
}

#[tokio::test]
async fn serves_the_last_known_good_table_while_the_controller_is_down() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("routes.json");
    let (c, url) = controller().await;
    let version = fail_dc_a(&url).await;
    let mut config = WatchConfig::new(&url, "gw-lkg");
    config.state_file = Some(file.clone());
    let (mut routes, task) = stanch_client::start(config, None);
    routes.changed_from(0).await.unwrap();
    until("saved", Duration::from_secs(5), || async { file.exists() }).await;
    task.abort();
    c.shutdown().await;

    // A restarted gateway, the controller still down: it routes as before at once.
    let mut config = WatchConfig::new(&url, "gw-lkg");
    config.state_file = Some(file.clone());
    let (routes, task) = stanch_client::start(config, None);
    let table = routes.current().expect("available before any answer");
    assert_eq!(table.version, version);
    assert_eq!(table.models["qwen-72b"].pool, "dc-b");
    task.abort();
}

async fn refuses_what_the_gateway_cannot_apply_and_says_why(transport: Transport) {
    let (_c, url) = controller().await;
    let validator: stanch_client::Validator = Arc::new(|t: &stanch_api::RouteTable| {
        match t
            .models
            .values()
            .find(|m| m.faq.as_deref() == Some("default"))
        {
            Some(_) => Err(stanch_api::Invalid::new(
                "models.m.faq",
                "unknown FAQ set \"default\"",
            )),
            None => Ok(()),
        }
    });
    let mut config = WatchConfig::new(&url, "gw-strict");
    config.transport = transport;
    config.long_poll_wait = Duration::from_secs(1);
    let (mut routes, task) = stanch_client::start(config, Some(validator));
    let first = routes.changed_from(0).await.unwrap();
    post(
        &url,
        "/v1/admin/force",
        json!({"model": "qwen-72b", "rung": "static", "reason": "test"}),
    )
    .await;
    until("rejection reported", Duration::from_secs(5), || async {
        let s = status(&url).await;
        s["gateways"][0]["rejected"][1]
            .as_str()
            .is_some_and(|r| r.contains("unknown FAQ set"))
    })
    .await;
    assert_eq!(
        routes.current().unwrap().version,
        first.version,
        "the refused table is not applied"
    );
    task.abort();
}

#[tokio::test]
async fn refuses_what_the_gateway_cannot_apply_over_long_poll() {
    refuses_what_the_gateway_cannot_apply_and_says_why(Transport::LongPoll).await;
}

#[tokio::test]
async fn refuses_what_the_gateway_cannot_apply_over_grpc() {
    refuses_what_the_gateway_cannot_apply_and_says_why(Transport::Grpc).await;
}

/// A table this gateway cannot read (here a time past year 9999, as controllers
/// before the bound published) is refused and reported against its version, and the
/// long-poll waits for a newer one instead of fetching the same table again and again.
async fn reports_an_unreadable_table(transport: Transport) {
    use std::sync::Mutex;

    use axum::extract::{RawQuery, State};
    use axum::http::{HeaderMap, StatusCode};
    use axum::response::IntoResponse;
    use axum::routing::get;

    #[derive(Default)]
    struct Seen {
        requests: usize,
        rejected: Vec<(String, String)>,
    }
    type Shared = Arc<Mutex<Seen>>;
    const TABLE: &str = r#"{"version":7,"epoch":"e1","hash":"h","generated_at":"2026-11-30T00:00:00.000Z",
        "models":{},"blocked":[{"endpoint":"http://a1:8000","model":null,
        "until":"+13434-11-12T00:00:00.000Z","reason":"forever"}]}"#;
    fn note(seen: &Shared, headers: &HeaderMap) {
        let mut seen = seen.lock().unwrap();
        seen.requests += 1;
        if let Some(v) = headers.get("x-stanch-rejected-version") {
            let reason = headers
                .get("x-stanch-rejected-reason")
                .map(|r| r.to_str().unwrap().to_owned())
                .unwrap_or_default();
            seen.rejected.push((v.to_str().unwrap().to_owned(), reason));
        }
    }
    async fn routes(
        State(seen): State<Shared>,
        headers: HeaderMap,
        RawQuery(q): RawQuery,
    ) -> axum::response::Response {
        note(&seen, &headers);
        let q = q.unwrap_or_default();
        if q.contains("after=7") && q.contains("epoch=e1") && !q.contains("wait=0ms") {
            tokio::time::sleep(Duration::from_millis(500)).await;
            return StatusCode::NOT_MODIFIED.into_response();
        }
        if q.contains("after=7") {
            return StatusCode::NOT_MODIFIED.into_response();
        }
        TABLE.replace('\n', "").into_response()
    }
    async fn stream(State(seen): State<Shared>, headers: HeaderMap) -> axum::response::Response {
        note(&seen, &headers);
        let event = format!("id: 7\ndata: {}\n\n", TABLE.replace('\n', ""));
        let body = futures_util::stream::once(async move { Ok::<_, std::io::Error>(event) })
            .chain(futures_util::stream::pending());
        (
            [("content-type", "text/event-stream")],
            axum::body::Body::from_stream(body),
        )
            .into_response()
    }
    use futures_util::StreamExt;
    let seen: Shared = Arc::default();
    let app = axum::Router::new()
        .route("/v1/routes", get(routes))
        .route("/v1/routes/stream", get(stream))
        .with_state(seen.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let mut config = WatchConfig::new(&url, "gw-old");
    config.transport = transport;
    config.long_poll_wait = Duration::from_millis(500);
    let (routes, task) = stanch_client::start(config, None);
    until(
        "the refusal is reported",
        Duration::from_secs(5),
        || async {
            seen.lock()
                .unwrap()
                .rejected
                .iter()
                .any(|(v, why)| v == "7" && why.contains("unreadable"))
        },
    )
    .await;
    let before = seen.lock().unwrap().requests;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let during = seen.lock().unwrap().requests - before;
    assert!(
        during <= 6,
        "{during} requests in 1.5 s: the refused table is fetched in a loop"
    );
    assert!(routes.current().is_none(), "nothing unreadable is applied");
    task.abort();
}

#[tokio::test]
async fn an_unreadable_table_is_reported_over_long_poll() {
    reports_an_unreadable_table(Transport::LongPoll).await;
}

#[tokio::test]
async fn an_unreadable_table_is_reported_over_sse() {
    reports_an_unreadable_table(Transport::Sse).await;
}

/// Following the route-table resource through the fake API server: the table the
/// controller publishes (written to the resource as the leader writes it) is applied by
/// the same rules as from the watch, and kept as last-known-good.
#[tokio::test]
async fn a_gateway_follows_the_route_table_resource_by_the_watchs_rules() {
    use stanch_fake_apiserver::FakeApiServer;
    use stanch_kube::publish::RouteTableWriter;

    let api = FakeApiServer::start().await;
    let client = || kube::Client::try_from(kube::Config::new(api.url().parse().unwrap())).unwrap();
    let (controller, url) = controller().await;
    let mut writer = RouteTableWriter::new(kube::Api::namespaced(client(), "monitoring"), "stanch");
    writer.write(&controller.published().table).await.unwrap();

    let dir = tempfile::tempdir().unwrap();
    let state_file = dir.path().join("routes.json");
    let config = stanch_client::ResourceConfig {
        client: client(),
        namespace: "monitoring".into(),
        name: "stanch".into(),
        state_file: Some(state_file.clone()),
    };
    // The gateway refuses any table past version 100 (as it would one naming a pool
    // it does not know).
    let validator: stanch_client::Validator = Arc::new(|t: &stanch_api::RouteTable| {
        if t.version > 100 {
            Err(stanch_api::Invalid::new(
                "version",
                "too new for this gateway",
            ))
        } else {
            Ok(())
        }
    });
    let (mut routes, task) =
        stanch_client::start_from_resource(config.clone(), Some(validator.clone()));
    let first = controller.published().table.clone();
    let applied = tokio::time::timeout(Duration::from_secs(10), routes.changed_from(0))
        .await
        .expect("the first table")
        .unwrap();
    assert_eq!(*applied, first);

    // A failover published by the controller reaches the gateway through the resource.
    let version = fail_dc_a(&url).await;
    writer.write(&controller.published().table).await.unwrap();
    let applied = tokio::time::timeout(Duration::from_secs(10), routes.changed_from(first.version))
        .await
        .expect("the failover")
        .unwrap();
    assert_eq!(applied.version, version);
    assert_eq!(*applied, controller.published().table);

    // An older version of the same epoch is not applied; one the validator refuses is not.
    let mut older = first.clone();
    older.epoch.clone_from(&applied.epoch);
    writer.write(&older).await.unwrap();
    let mut refused = (*applied).clone();
    refused.version = 101;
    writer.write(&refused).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        routes.current().unwrap().version,
        version,
        "neither applied"
    );

    // Restarted with the API server down, it serves its last-known-good table.
    task.abort();
    api.set_down(true);
    let (routes, _task) = stanch_client::start_from_resource(config, Some(validator));
    assert_eq!(routes.current().unwrap().version, version);
    assert!(state_file.exists());
}

/// A server for the silence tests: `/v1/routes/stream` sends `table` once (with the
/// heartbeat header when given) and then nothing, keeping the connection open;
/// `/v1/routes` never answers. Returns its URL and when each request arrived.
async fn silent_server(
    table: String,
    heartbeat_ms: Option<u64>,
) -> (
    String,
    Arc<std::sync::Mutex<Vec<(&'static str, tokio::time::Instant)>>>,
) {
    use axum::response::IntoResponse;
    use axum::routing::get;
    use futures_util::StreamExt;
    type Seen = Arc<std::sync::Mutex<Vec<(&'static str, tokio::time::Instant)>>>;
    let seen: Seen = Arc::default();
    let (s1, s2) = (seen.clone(), seen.clone());
    let app = axum::Router::new()
        .route(
            "/v1/routes/stream",
            get(move || {
                let seen = s1.clone();
                let table = table.clone();
                async move {
                    seen.lock()
                        .unwrap()
                        .push(("sse", tokio::time::Instant::now()));
                    let event = format!("data: {table}\n\n");
                    let body =
                        futures_util::stream::once(async move { Ok::<_, std::io::Error>(event) })
                            .chain(futures_util::stream::pending());
                    let mut response = axum::body::Body::from_stream(body).into_response();
                    let h = response.headers_mut();
                    h.insert("content-type", "text/event-stream".parse().unwrap());
                    if let Some(ms) = heartbeat_ms {
                        h.insert("x-stanch-heartbeat", ms.into());
                    }
                    response
                }
            }),
        )
        .route(
            "/v1/routes",
            get(move || {
                let seen = s2.clone();
                async move {
                    seen.lock()
                        .unwrap()
                        .push(("poll", tokio::time::Instant::now()));
                    std::future::pending::<()>().await;
                    ""
                }
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, seen)
}

/// The gaps between the requests of one kind.
fn gaps(
    seen: &std::sync::Mutex<Vec<(&'static str, tokio::time::Instant)>>,
    kind: &str,
) -> Vec<Duration> {
    let at: Vec<tokio::time::Instant> = seen
        .lock()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k == kind)
        .map(|(_, t)| *t)
        .collect();
    at.windows(2).map(|w| w[1] - w[0]).collect()
}

/// Streams that went silent were dropped after two 200 ms heartbeats, and the next
/// opened at once.
fn reopened_every_two_heartbeats(gaps: &[Duration]) {
    assert!(gaps.len() >= 2, "{gaps:?}: the silent stream was kept");
    for gap in gaps {
        assert!(
            *gap >= Duration::from_millis(390) && *gap <= Duration::from_millis(900),
            "{gaps:?}: each stream is dropped after two 200 ms heartbeats and reopened at once"
        );
    }
}

/// The controller says how often it sends heartbeats on the stream.
#[tokio::test]
async fn the_controller_says_its_heartbeat_interval() {
    let (_controller, url) = controller().await;
    let response = reqwest::Client::new()
        .get(format!("{url}/v1/routes/stream"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.headers()["x-stanch-heartbeat"], "15000");
}

/// A stream that stops delivering (no event, no heartbeat: a partition, a frozen
/// controller, a proxy holding the connection) is dropped after two of the intervals
/// the controller said, and opened again at once; the table stays applied meanwhile.
#[tokio::test]
async fn a_silent_stream_is_dropped_and_reopened_within_two_heartbeats() {
    let (_controller, real) = controller().await;
    let table = reqwest::get(format!("{real}/v1/routes"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let (url, seen) = silent_server(table, Some(200)).await;
    let mut config = WatchConfig::new(&url, "gw-silent");
    config.transport = Transport::Sse;
    let (routes, task) = stanch_client::start(config, None);
    tokio::time::sleep(Duration::from_millis(1700)).await;
    task.abort();
    let gaps = gaps(&seen, "sse");
    reopened_every_two_heartbeats(&gaps);
    assert!(routes.current().is_some(), "the table stays applied");
}

/// Without the controller's word (an older controller, a proxy that drops the
/// header), the configured interval is expected; a controller that accepts the
/// connection and never answers (no HTTP answer, no HTTP/2 settings) is left just the
/// same, and a new connection made.
async fn a_controller_that_never_answers_is_left(transport: Transport) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let accepted = Arc::new(std::sync::Mutex::new(Vec::new()));
    let a = accepted.clone();
    tokio::spawn(async move {
        let mut held = vec![];
        loop {
            let (socket, _) = listener.accept().await.unwrap();
            a.lock().unwrap().push(tokio::time::Instant::now());
            held.push(socket); // Read nothing, answer nothing.
        }
    });
    let mut config = WatchConfig::new(&url, "gw-unanswered");
    config.transport = transport;
    config.heartbeat = Duration::from_millis(150);
    let (_routes, task) = stanch_client::start(config, None);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    task.abort();
    let at = accepted.lock().unwrap().clone();
    let gaps: Vec<Duration> = at.windows(2).map(|w| w[1] - w[0]).collect();
    assert!(gaps.len() >= 2, "{gaps:?}");
    assert!(
        gaps.iter()
            .all(|g| *g >= Duration::from_millis(290) && *g <= Duration::from_millis(800)),
        "{gaps:?}: two 150 ms heartbeats, then the next connection"
    );
}

#[tokio::test]
async fn a_controller_that_never_answers_the_stream_is_left_after_two_configured_heartbeats() {
    a_controller_that_never_answers_is_left(Transport::Sse).await;
}

#[tokio::test]
async fn a_grpc_controller_that_never_answers_is_left_after_two_configured_heartbeats() {
    a_controller_that_never_answers_is_left(Transport::Grpc).await;
}

/// A long-poll unanswered past its wait and as much again is dropped and asked again.
#[tokio::test]
async fn an_unanswered_long_poll_is_asked_again_after_twice_its_wait() {
    let (url, seen) = silent_server(String::new(), None).await;
    let mut config = WatchConfig::new(&url, "gw-poll");
    config.transport = Transport::LongPoll;
    config.long_poll_wait = Duration::from_millis(250);
    let (_routes, task) = stanch_client::start(config, None);
    tokio::time::sleep(Duration::from_millis(2000)).await;
    task.abort();
    let gaps = gaps(&seen, "poll");
    assert!(gaps.len() >= 2, "{gaps:?}");
    // 2 × 250 ms, then the reconnect backoff (200 ms at first, ±20 %, doubling).
    assert!(
        gaps.iter()
            .all(|g| *g >= Duration::from_millis(490) && *g <= Duration::from_millis(1400)),
        "{gaps:?}"
    );
}

/// The table a real controller serves, for a scripted one to send.
async fn a_controllers_table() -> stanch_api::RouteTable {
    let (_controller, real) = controller().await;
    reqwest::get(format!("{real}/v1/routes"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// What a scripted gRPC controller was sent: when each stream opened, and every
/// message on them.
#[derive(Default)]
struct Heard {
    opened: Vec<tokio::time::Instant>,
    requests: Vec<stanch_proto::v1::WatchRequest>,
}

type HeardBy = Arc<std::sync::Mutex<Heard>>;

/// A gRPC controller that sends each `WatchRoutes` stream `script`, then nothing
/// while it stays open, and keeps what the gateway says. Returns its URL.
async fn scripted_grpc_server(
    script: Vec<stanch_proto::v1::watch_response::Kind>,
) -> (String, HeardBy) {
    use stanch_proto::v1::route_watch_server::{RouteWatch, RouteWatchServer};
    use stanch_proto::v1::{self};
    type Messages = std::pin::Pin<
        Box<dyn futures_util::Stream<Item = Result<v1::WatchResponse, tonic::Status>> + Send>,
    >;
    struct Scripted {
        script: Vec<v1::watch_response::Kind>,
        heard: HeardBy,
    }
    #[tonic::async_trait]
    impl RouteWatch for Scripted {
        type WatchRoutesStream = Messages;
        async fn watch_routes(
            &self,
            request: tonic::Request<tonic::Streaming<v1::WatchRequest>>,
        ) -> Result<tonic::Response<Messages>, tonic::Status> {
            use futures_util::StreamExt;
            self.heard
                .lock()
                .unwrap()
                .opened
                .push(tokio::time::Instant::now());
            let heard = self.heard.clone();
            let mut inbound = request.into_inner();
            tokio::spawn(async move {
                while let Ok(Some(request)) = inbound.message().await {
                    heard.lock().unwrap().requests.push(request);
                }
            });
            let first: Vec<_> = self
                .script
                .iter()
                .map(|kind| {
                    Ok(v1::WatchResponse {
                        kind: Some(kind.clone()),
                    })
                })
                .collect();
            let messages = futures_util::stream::iter(first).chain(futures_util::stream::pending());
            Ok(tonic::Response::new(Box::pin(messages)))
        }
    }
    let heard = HeardBy::default();
    let service = RouteWatchServer::new(Scripted {
        script,
        heard: heard.clone(),
    });
    let app = tonic::service::Routes::new(service).into_axum_router();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let limits = stanch_server::net::ConnLimits {
        http2: Some(Default::default()),
        ..Default::default()
    };
    tokio::spawn(stanch_server::net::serve(
        listener,
        hyper_util::service::TowerToHyperService::new(app),
        None,
        stanch_server::net::Connections::new(limits),
        std::future::pending(),
    ));
    (url, heard)
}

/// A gRPC controller for the silence tests: each stream gets one heartbeat saying
/// `interval`, then the table, then nothing.
async fn silent_grpc_server(
    table: stanch_api::RouteTable,
    interval: Duration,
) -> (String, HeardBy) {
    use stanch_proto::v1::{self, watch_response};
    scripted_grpc_server(vec![
        watch_response::Kind::Heartbeat(v1::Heartbeat {
            interval_ms: interval.as_millis() as u64,
            latest_version: table.version,
        }),
        watch_response::Kind::Table((&table).into()),
    ])
    .await
}

/// Every table a gateway is sent over gRPC is answered, since a controller sends the
/// next only then: one it applies with an Ack; one it cannot apply, and one not newer
/// than the table it holds (which it keeps), with a Nack that says why.
#[tokio::test]
async fn every_table_sent_over_grpc_is_answered() {
    use stanch_proto::v1::{self, watch_request, watch_response};
    let table = a_controllers_table().await;
    let mut unreadable = v1::RouteTable::from(&table);
    unreadable.version += 1;
    unreadable.generated_at_unix_ms = i64::MAX;
    let sent = |t: v1::RouteTable| watch_response::Kind::Table(t);
    let (url, heard) = scripted_grpc_server(vec![
        sent((&table).into()),
        sent((&table).into()),
        sent(unreadable.clone()),
    ])
    .await;
    let mut config = WatchConfig::new(&url, "gw-answers");
    config.transport = Transport::Grpc;
    let (routes, task) = stanch_client::start(config, None);
    until("four messages", Duration::from_secs(5), || {
        std::future::ready(heard.lock().unwrap().requests.len() >= 4)
    })
    .await;
    task.abort();
    let kinds: Vec<_> = heard
        .lock()
        .unwrap()
        .requests
        .iter()
        .map(|r| r.kind.clone().unwrap())
        .collect();
    let [
        watch_request::Kind::Hello(_),
        watch_request::Kind::Ack(ack),
        watch_request::Kind::Nack(again),
        watch_request::Kind::Nack(refused),
    ] = &kinds[..]
    else {
        panic!("a Hello, an Ack and two Nacks: {kinds:?}");
    };
    assert_eq!((ack.version, &ack.epoch), (table.version, &table.epoch));
    assert_eq!(again.version, table.version);
    assert!(again.reason.contains("not newer"), "{again:?}");
    assert_eq!(refused.version, unreadable.version);
    assert!(refused.reason.contains("unreadable"), "{refused:?}");
    assert_eq!(routes.current().unwrap().version, table.version, "kept");
}

/// A gRPC stream that goes quiet after its table (no heartbeat as promised) is
/// dropped after two of the intervals the controller said, and opened again at once.
#[tokio::test]
async fn a_silent_grpc_stream_is_dropped_and_reopened_within_two_heartbeats() {
    let table = a_controllers_table().await;
    let (url, opened) = silent_grpc_server(table, Duration::from_millis(200)).await;
    let mut config = WatchConfig::new(&url, "gw-silent-grpc");
    config.transport = Transport::Grpc;
    let (routes, task) = stanch_client::start(config, None);
    tokio::time::sleep(Duration::from_millis(1700)).await;
    task.abort();
    let at = opened.lock().unwrap().opened.clone();
    let gaps: Vec<Duration> = at.windows(2).map(|w| w[1] - w[0]).collect();
    reopened_every_two_heartbeats(&gaps);
    assert!(routes.current().is_some(), "the table stays applied");
}

/// The epoch a gateway resumes from is the controller's own, whatever it holds:
/// long-poll and SSE send it query-encoded, so the controller reads back the same
/// string (a `+` or `&` sent raw would read as another epoch, every wait answered at
/// once as news).
async fn resumes_with_the_epoch_as_sent(transport: Transport) {
    use axum::extract::{Query, State};
    use axum::http::HeaderMap;
    use axum::response::IntoResponse;
    use axum::routing::get;
    use std::collections::HashMap;
    type Seen = Arc<std::sync::Mutex<Vec<HashMap<String, String>>>>;

    const EPOCH: &str = "e+1 &epoch=x#y%";
    let (_controller, real) = controller().await;
    let mut table: Value = reqwest::get(format!("{real}/v1/routes"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    table["epoch"] = EPOCH.into();
    let table = table.to_string();

    async fn routes(
        State((seen, table)): State<(Seen, String)>,
        Query(query): Query<HashMap<String, String>>,
    ) -> axum::response::Response {
        let resumed = query.contains_key("after");
        let mut query = query;
        query.insert("path".into(), "/v1/routes".into());
        seen.lock().unwrap().push(query);
        if resumed {
            tokio::time::sleep(Duration::from_millis(100)).await;
            axum::http::StatusCode::NOT_MODIFIED.into_response()
        } else {
            ([("content-type", "application/json")], table).into_response()
        }
    }
    async fn stream(
        State((seen, table)): State<(Seen, String)>,
        Query(mut query): Query<HashMap<String, String>>,
        headers: HeaderMap,
    ) -> axum::response::Response {
        if let Some(id) = headers.get("last-event-id") {
            query.insert("last-event-id".into(), id.to_str().unwrap().into());
        }
        query.insert("path".into(), "/v1/routes/stream".into());
        seen.lock().unwrap().push(query);
        // One event, then the stream ends: the gateway comes back resuming.
        tokio::time::sleep(Duration::from_millis(100)).await;
        (
            [("content-type", "text/event-stream")],
            format!("event: routes\nid: 1\ndata: {table}\n\n"),
        )
            .into_response()
    }
    let seen: Seen = Arc::default();
    let app = axum::Router::new()
        .route("/v1/routes", get(routes))
        .route("/v1/routes/stream", get(stream))
        .with_state((seen.clone(), table));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let mut config = WatchConfig::new(&url, "gw-epoch");
    config.transport = transport;
    let (routes, task) = stanch_client::start(config, None);
    let (path, by) = match transport {
        Transport::LongPoll => ("/v1/routes", "after"),
        _ => ("/v1/routes/stream", "last-event-id"),
    };
    let resumed = |q: &HashMap<String, String>| q["path"] == path && q.contains_key(by);
    until("the gateway resumes", Duration::from_secs(5), || async {
        seen.lock().unwrap().iter().any(resumed)
    })
    .await;
    task.abort();
    let applied = routes.current().expect("the table is applied");
    assert_eq!(applied.epoch, EPOCH);
    let seen = seen.lock().unwrap();
    let resumed = seen.iter().find(|q| resumed(q)).unwrap();
    assert_eq!(
        resumed.get("epoch").map(String::as_str),
        Some(EPOCH),
        "{seen:?}"
    );
    assert_eq!(resumed[by], applied.version.to_string(), "{seen:?}");
}

#[tokio::test]
async fn a_long_poll_resumes_with_the_epoch_as_sent() {
    resumes_with_the_epoch_as_sent(Transport::LongPoll).await;
}

#[tokio::test]
async fn an_sse_stream_resumes_with_the_epoch_as_sent() {
    resumes_with_the_epoch_as_sent(Transport::Sse).await;
}
