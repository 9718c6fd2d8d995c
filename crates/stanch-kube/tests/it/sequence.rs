//! Exact request sequences, with kube-rs's mock-service pattern: a `kube::Client` over
//! a scripted service that checks each request as it comes and answers as scripted,
//! where the requests themselves are the point (paths, methods, preconditions, field
//! manager, apply bodies). The fake API server covers behaviour; this covers the wire.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use serde_json::{Value, json};
use stanch_api::Timestamp;
use stanch_kube::election::Election;
use stanch_kube::lease::Elector;
use stanch_kube::publish::RouteTableWriter;
use stanch_kube::store::KubeStore;
use stanch_ports::leadership::{Leadership, Role};
use stanch_ports::store::StateStore;
use stanch_testkit::time::Paused;

/// One request as it came.
#[derive(Debug, Clone)]
struct Seen {
    method: Method,
    /// Path and query.
    target: String,
    content_type: Option<String>,
    body: Value,
}

/// An answer to give, in order.
struct Answer {
    status: StatusCode,
    body: Value,
}

fn answer(status: u16, body: Value) -> Answer {
    Answer {
        status: StatusCode::from_u16(status).unwrap(),
        body,
    }
}

fn not_found(name: &str) -> Answer {
    answer(
        404,
        json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound",
               "code": 404, "message": format!("\"{name}\" not found")}),
    )
}

/// A client whose every request is recorded and answered from `script`, in order.
fn scripted(script: Vec<Answer>) -> (kube::Client, Arc<Mutex<Vec<Seen>>>) {
    let script = Arc::new(Mutex::new(VecDeque::from(script)));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    let service = tower::service_fn(move |request: Request<kube::client::Body>| {
        let (script, record) = (script.clone(), record.clone());
        async move {
            let (parts, body) = request.into_parts();
            let bytes = body
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            record.lock().unwrap().push(Seen {
                method: parts.method.clone(),
                target: parts
                    .uri
                    .path_and_query()
                    .map(ToString::to_string)
                    .unwrap_or_default(),
                content_type: parts
                    .headers
                    .get("content-type")
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned),
                body: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
            });
            let next = script.lock().unwrap().pop_front();
            let Answer { status, body } = next.unwrap_or_else(|| {
                answer(
                    500,
                    json!({"kind": "Status", "code": 500, "message": "unscripted"}),
                )
            });
            let bytes = Bytes::from(serde_json::to_vec(&body).unwrap());
            Ok::<_, Infallible>(
                Response::builder()
                    .status(status)
                    .header("content-type", "application/json")
                    .body(Full::new(bytes))
                    .unwrap(),
            )
        }
    });
    (kube::Client::new(service, "monitoring"), seen)
}

/// Each request as `METHOD path`.
fn calls(seen: &[Seen]) -> Vec<String> {
    seen.iter()
        .map(|s| {
            format!(
                "{} {}",
                s.method,
                s.target.split('?').next().unwrap_or_default()
            )
        })
        .collect()
}

const LEASES: &str = "/apis/coordination.k8s.io/v1/namespaces/monitoring/leases";
const CONFIGMAPS: &str = "/api/v1/namespaces/monitoring/configmaps";

fn lease(rv: &str, holder: Option<&str>) -> Value {
    json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
           "metadata": {"name": "stanch", "namespace": "monitoring", "resourceVersion": rv},
           "spec": {"holderIdentity": holder, "leaseDurationSeconds": 3,
                    "acquireTime": "2026-12-02T00:00:00.000000Z",
                    "renewTime": "2026-12-02T00:00:00.000000Z", "leaseTransitions": 0}})
}

#[tokio::test]
async fn the_election_takes_a_free_lease_renews_it_by_its_version_and_gives_it_up() {
    // The elector's terms are read off the Clock port, its renewals sleep on tokio's
    // timers: one paused clock moves both.
    let time = Paused::start(Timestamp::parse_rfc3339("2026-12-02T00:00:00Z").unwrap());
    let (client, seen) = scripted(vec![
        not_found("stanch"),
        answer(201, lease("1", Some("stanch-0"))),
        // The renewal: read, then written at the version read.
        answer(200, lease("1", Some("stanch-0"))),
        answer(200, lease("2", Some("stanch-0"))),
        // Shutdown: read, then written as given up.
        answer(200, lease("2", Some("stanch-0"))),
        answer(200, lease("3", None)),
    ]);
    let leadership = Leadership::following(None);
    let election = Election::new(
        kube::Api::namespaced(client, "monitoring"),
        "stanch",
        Elector::new("stanch-0", Duration::from_secs(3), Duration::from_secs(1)),
        Arc::new(time),
        leadership.clone(),
    );
    let guard = election.guard();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(election.run(async {
        let _ = stopped.await;
    }));
    // Renewed a third of the lease later (one renewal, as scripted), by both clocks.
    time.advance(Duration::from_millis(1_500)).await;
    assert_eq!(leadership.role(), Role::Leader);
    assert!(guard(), "the term lasts");
    stop.send(()).unwrap();
    running.await.unwrap();
    assert!(!guard(), "no term once given up");
    assert_eq!(leadership.role(), Role::Follower { leader: None });

    let seen = seen.lock().unwrap().clone();
    let named = format!("{LEASES}/stanch");
    assert_eq!(
        calls(&seen),
        [
            format!("GET {named}"),
            format!("POST {LEASES}"),
            format!("GET {named}"),
            format!("PUT {named}"),
            format!("GET {named}"),
            format!("PUT {named}"),
        ]
    );
    // Taking it: no version (it did not exist), this replica as holder.
    let taken = &seen[1].body;
    assert!(taken["metadata"]["resourceVersion"].is_null());
    assert_eq!(taken["spec"]["holderIdentity"], "stanch-0");
    assert_eq!(taken["spec"]["leaseDurationSeconds"], 3);
    // Renewing: at the version read, the term's start kept.
    let renewed = &seen[3].body;
    assert_eq!(renewed["metadata"]["resourceVersion"], "1");
    assert_eq!(renewed["spec"]["holderIdentity"], "stanch-0");
    assert_eq!(
        renewed["spec"]["acquireTime"],
        "2026-12-02T00:00:00.000000Z"
    );
    // Giving up: at the version read, no holder, a second to run.
    let released = &seen[5].body;
    assert_eq!(released["metadata"]["resourceVersion"], "2");
    assert!(released["spec"]["holderIdentity"].is_null());
    assert_eq!(released["spec"]["leaseDurationSeconds"], 1);
}

#[test]
fn taking_the_store_over_writes_it_at_the_version_read_before_trusting_it() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let record = stanch_ports::store::Record {
        seq: 1,
        at: Timestamp::from_millis(1_764_633_600_000),
        input: stanch_core::Input::Tick,
    };
    let journal = format!("{}\n", serde_json::to_string(&record).unwrap());
    let journal = journal.as_str();
    let state = |rv: &str, holder: &str| {
        json!({"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"name": "stanch-state", "namespace": "monitoring", "resourceVersion": rv},
               "data": {"holder": holder, "journal": journal}})
    };
    let (mut store, seen) = {
        let _entered = runtime.enter();
        let (client, seen) = scripted(vec![
            answer(200, state("7", "stanch-0")),
            answer(200, state("8", "stanch-1")),
            answer(
                200,
                json!({"apiVersion": "v1", "kind": "ConfigMapList", "metadata": {}, "items": []}),
            ),
        ]);
        let store = KubeStore::new(
            kube::Api::namespaced(client, "monitoring"),
            "stanch-state",
            "stanch-1",
            Arc::new(|| true),
            Duration::from_secs(5),
        );
        (store, seen)
    };
    let loaded = store.load().unwrap();
    assert_eq!(loaded.journal.len(), 1);
    let seen = seen.lock().unwrap().clone();
    assert_eq!(
        calls(&seen),
        [
            format!("GET {CONFIGMAPS}/stanch-state"),
            format!("PUT {CONFIGMAPS}/stanch-state"),
            format!("GET {CONFIGMAPS}"),
        ]
    );
    // The take-over: at the version read, this replica as holder, the journal kept.
    let written = &seen[1].body;
    assert_eq!(written["metadata"]["resourceVersion"], "7");
    assert_eq!(written["data"]["holder"], "stanch-1");
    assert_eq!(written["data"]["journal"], journal);
    // The orphan sweep asks for this store's parts by label.
    assert!(
        seen[2]
            .target
            .contains("labelSelector=stanch.dev%2Fstate%3Dstanch-state"),
        "{}",
        seen[2].target
    );
}

#[tokio::test]
async fn the_route_table_resource_is_applied_under_field_manager_stanch_once_per_version() {
    let at = Timestamp::from_millis(1_764_633_600_000);
    let table = stanch_core::Engine::new(
        stanch_core::Config::default_config(),
        stanch_core::Engine::fresh_state("e1".into(), at),
        at,
    )
    .route_table();
    let resource = json!({"apiVersion": "stanch.dev/v1alpha1", "kind": "StanchRouteTable",
                          "metadata": {"name": "stanch", "namespace": "monitoring", "resourceVersion": "1"},
                          "spec": {}});
    let (client, seen) = scripted(vec![answer(200, resource.clone()), answer(200, resource)]);
    let mut writer = RouteTableWriter::new(kube::Api::namespaced(client, "monitoring"), "stanch");
    assert!(writer.write(&table).await.unwrap());
    assert!(
        !writer.write(&table).await.unwrap(),
        "the same version again: nothing sent"
    );
    let seen = seen.lock().unwrap().clone();
    let named = "/apis/stanch.dev/v1alpha1/namespaces/monitoring/stanchroutetables/stanch";
    assert_eq!(
        calls(&seen),
        [format!("PATCH {named}"), format!("PATCH {named}/status")]
    );
    for s in &seen {
        assert_eq!(
            s.content_type.as_deref(),
            Some("application/apply-patch+yaml")
        );
        assert!(s.target.contains("fieldManager=stanch"), "{}", s.target);
        assert!(s.target.contains("force=true"), "{}", s.target);
    }
    assert_eq!(
        seen[1].body["status"]["table"],
        serde_json::to_value(&table).unwrap()
    );
}
