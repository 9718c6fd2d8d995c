//! kube-rs's own client and watcher against the fake API server: what stanch will run
//! in a cluster must find the fake as it would find the real one (typed objects,
//! errors parsed as the API's, conflicts, the status subresource through server-side
//! apply, and a watcher that recovers from `410 Expired` by listing again).

use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use serde_json::json;
use stanch_fake_apiserver::FakeApiServer;
use stanch_kube::crd::{StanchPolicy, StanchPolicySpec};
use stanch_testkit::http::Fetch;

fn client(api: &FakeApiServer) -> kube::Client {
    let config = kube::Config::new(api.url().parse().unwrap());
    kube::Client::try_from(config).unwrap()
}

fn policy(name: &str, model: &str) -> StanchPolicy {
    let spec: StanchPolicySpec =
        serde_json::from_value(json!({"model": model, "pools": [{"name": "dc-a"}]})).unwrap();
    StanchPolicy::new(name, spec)
}

#[tokio::test]
async fn kubes_client_reads_and_writes_typed_objects_and_parses_the_errors() {
    let api = FakeApiServer::start().await;
    let policies: Api<StanchPolicy> = Api::namespaced(client(&api), "monitoring");
    let created = policies
        .create(&PostParams::default(), &policy("qwen-72b", "qwen-72b"))
        .await
        .unwrap();
    assert_eq!(created.metadata.generation, Some(1));
    let listed = policies.list(&Default::default()).await.unwrap();
    assert_eq!(listed.items.len(), 1);
    assert_eq!(listed.items[0].spec.model, "qwen-72b");

    // A write on a stale version: the API's 409, as kube parses it.
    let mut stale = created.clone();
    let mut fresh = created.clone();
    fresh.spec.faq = Some("default".into());
    policies
        .replace("qwen-72b", &PostParams::default(), &fresh)
        .await
        .unwrap();
    stale.spec.faq = Some("other".into());
    match policies
        .replace("qwen-72b", &PostParams::default(), &stale)
        .await
    {
        Err(kube::Error::Api(status)) => {
            assert_eq!((status.code, status.reason.as_str()), (409, "Conflict"));
        }
        other => panic!("a conflict, not {other:?}"),
    }
    match policies.get("nope").await {
        Err(kube::Error::Api(status)) => assert_eq!(status.code, 404),
        other => panic!("not found, not {other:?}"),
    }

    // Status through server-side apply, under field manager `stanch`.
    let status = json!({"apiVersion": "stanch.dev/v1alpha1", "kind": "StanchPolicy",
                        "status": {"rung": "failover", "activePool": "dc-b"}});
    let applied = policies
        .patch_status(
            "qwen-72b",
            &PatchParams::apply("stanch"),
            &Patch::Apply(&status),
        )
        .await
        .unwrap();
    let status = applied.status.unwrap();
    assert_eq!(status.active_pool.as_deref(), Some("dc-b"));
    assert_eq!(
        applied.spec.faq.as_deref(),
        Some("default"),
        "the spec stays"
    );
}

/// Leases by compare-and-set: of two replicas writing the version they read, one wins.
#[tokio::test]
async fn leases_are_taken_by_compare_and_set() {
    let api = FakeApiServer::start().await;
    let leases: Api<Lease> = Api::namespaced(client(&api), "monitoring");
    let lease = Lease {
        metadata: ObjectMeta {
            name: Some("stanch".into()),
            ..ObjectMeta::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some("stanch-0".into()),
            lease_duration_seconds: Some(15),
            ..LeaseSpec::default()
        }),
    };
    let read = leases.create(&PostParams::default(), &lease).await.unwrap();
    let take = |holder: &str| {
        let mut l = read.clone();
        l.spec.as_mut().unwrap().holder_identity = Some(holder.to_owned());
        l
    };
    leases
        .replace("stanch", &PostParams::default(), &take("stanch-1"))
        .await
        .unwrap();
    let lost = leases
        .replace("stanch", &PostParams::default(), &take("stanch-2"))
        .await;
    assert!(
        matches!(lost, Err(kube::Error::Api(ref s)) if s.code == 409),
        "{lost:?}"
    );
    let now = leases.get("stanch").await.unwrap();
    assert_eq!(
        now.spec.unwrap().holder_identity.as_deref(),
        Some("stanch-1")
    );
}

/// kube-rs's watcher lists, then watches; after the history is compacted its watch
/// gets 410, and it lists again and goes on: nothing created is missed.
#[tokio::test]
async fn kubes_watcher_lists_watches_and_recovers_from_410() {
    let api = FakeApiServer::start().await;
    let policies: Api<StanchPolicy> = Api::namespaced(client(&api), "monitoring");
    policies
        .create(&PostParams::default(), &policy("a", "m-a"))
        .await
        .unwrap();
    let config = watcher::Config::default().timeout(2);
    let mut events = watcher(policies.clone(), config).boxed();
    let mut seen = std::collections::BTreeSet::new();
    let mut errors = 0;
    let mut wait_for =
        async |name: &str, seen: &mut std::collections::BTreeSet<String>, errors: &mut u32| {
            while !seen.contains(name) {
                let event = tokio::time::timeout(Duration::from_secs(10), events.next())
                    .await
                    .expect("an event in time")
                    .expect("the watcher goes on");
                match event {
                    Ok(watcher::Event::Apply(p) | watcher::Event::InitApply(p)) => {
                        seen.insert(p.metadata.name.unwrap());
                    }
                    Ok(_) => {}
                    // The 410 is the watcher's to recover from: it reports it, lists again
                    // and goes on.
                    Err(_) => *errors += 1,
                }
            }
        };
    wait_for("a", &mut seen, &mut errors).await;
    policies
        .create(&PostParams::default(), &policy("b", "m-b"))
        .await
        .unwrap();
    wait_for("b", &mut seen, &mut errors).await;
    // A write the watch does not see (another namespace), then compaction past it: the
    // open watch has fallen behind the history kept, and gets 410.
    let elsewhere: Api<StanchPolicy> = Api::namespaced(client(&api), "other");
    elsewhere
        .create(&PostParams::default(), &policy("x", "m-x"))
        .await
        .unwrap();
    api.compact();
    policies
        .create(&PostParams::default(), &policy("c", "m-c"))
        .await
        .unwrap();
    wait_for("c", &mut seen, &mut errors).await;
    assert!(errors >= 1, "the watch expired and was recovered from");
}

/// The route-table resource's status is what the HTTP watch serves, byte for byte as
/// JSON: a real controller's `/v1/routes`, written through the writer and read back
/// with kubectl's eyes. A table already written is not written again.
#[tokio::test]
async fn the_route_table_resource_holds_what_the_watch_serves() {
    use stanch_kube::crd::StanchRouteTable;
    use stanch_kube::publish::RouteTableWriter;

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let controller = stanch_server::Controller::start(
        stanch_server::Settings::in_memory(stanch_core::Config::default_config()),
        listener,
        std::sync::Arc::new(stanch_ports::clock::SystemClock),
    )
    .await
    .unwrap();
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let served: serde_json::Value = http
        .get(format!("http://{}/v1/routes", controller.addr()))
        .fetch_json()
        .await;
    let table: stanch_api::RouteTable = serde_json::from_value(served.clone()).unwrap();

    let api = FakeApiServer::start().await;
    let tables: Api<StanchRouteTable> = Api::namespaced(client(&api), "monitoring");
    let mut writer = RouteTableWriter::new(tables.clone(), "stanch");
    assert!(writer.write(&table).await.unwrap());
    let resource = tables.get("stanch").await.unwrap();
    let status = serde_json::to_value(resource.status.unwrap()).unwrap();
    assert_eq!(
        status["table"], served,
        "the resource holds the watch's table"
    );
    let version = resource.metadata.resource_version;

    assert!(
        !writer.write(&table).await.unwrap(),
        "the same table is not written again"
    );
    assert_eq!(
        tables
            .get("stanch")
            .await
            .unwrap()
            .metadata
            .resource_version,
        version
    );
    let mut next = table.clone();
    next.version += 1;
    assert!(writer.write(&next).await.unwrap());
    let resource = tables.get("stanch").await.unwrap();
    assert_eq!(
        resource.status.unwrap().table.unwrap().version,
        next.version
    );
    controller.shutdown().await;
}
