//! The adapter against the fake API server and a real controller: policies are put in
//! force live, each gets its status, decisions about their models and refusals are
//! Events on them.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::{Value, json};
use stanch_fake_apiserver::FakeApiServer;
use stanch_kube::adapter::Adapter;
use stanch_kube::crd::StanchPolicy;
use stanch_testkit::http::Fetch;
use stanch_testkit::wait::until;

fn client(api: &FakeApiServer) -> kube::Client {
    kube::Client::try_from(kube::Config::new(api.url().parse().unwrap())).unwrap()
}

fn policy(name: &str, spec: Value) -> StanchPolicy {
    StanchPolicy::new(name, serde_json::from_value(spec).unwrap())
}

#[tokio::test]
async fn policies_are_put_in_force_live_with_their_status_and_refusals_as_events() {
    let api = FakeApiServer::start().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let controller = Arc::new(
        stanch_server::Controller::start(
            stanch_server::Settings::in_memory(stanch_core::Config::default_config()),
            listener,
            Arc::new(stanch_ports::clock::SystemClock),
        )
        .await
        .unwrap(),
    );
    let adapter = Adapter::new(
        client(&api),
        Some("monitoring".into()),
        stanch_core::Config::default_config(),
        "stanch-0",
        Arc::new(stanch_ports::clock::SystemClock),
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = {
        let controller = controller.clone();
        tokio::spawn(async move {
            adapter
                .run(&*controller, async {
                    let _ = stopped.await;
                })
                .await;
        })
    };
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let routes = || async {
        http.get(format!("http://{}/v1/routes", controller.addr()))
            .fetch_json::<Value>()
            .await
    };
    let policies: Api<StanchPolicy> = Api::namespaced(client(&api), "monitoring");

    policies
        .create(
            &PostParams::default(),
            &policy(
                "small",
                json!({"model": "qwen-7b", "pools": [{"name": "dc-a"}], "faq": "default"}),
            ),
        )
        .await
        .unwrap();
    until(
        "the new model is served",
        Duration::from_secs(10),
        || async { routes().await["models"]["qwen-7b"].is_object() },
    )
    .await;
    until(
        "its status says it is in force",
        Duration::from_secs(10),
        || async {
            let p = policies.get("small").await.unwrap();
            p.status.is_some_and(|s| {
                s.rung.is_some()
                    && s.conditions
                        .iter()
                        .any(|c| c.type_ == "Ready" && c.status == "True")
            })
        },
    )
    .await;

    // An operator's force on its model is an Event on it, and so is the move it makes.
    let forced = http
        .post(format!("http://{}/v1/admin/force", controller.addr()))
        .json(&json!({"model": "qwen-7b", "rung": "static", "ttl": "1h", "reason": "drill 集群"}))
        .send()
        .await
        .unwrap();
    assert_eq!(forced.status(), 200);
    let events: Api<Event> = Api::namespaced(client(&api), "monitoring");
    let on_small = || async {
        events
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("small"))
            .collect::<Vec<Event>>()
    };
    until(
        "the override and its move are Events on the policy",
        Duration::from_secs(10),
        || async {
            let reasons: Vec<String> = on_small()
                .await
                .into_iter()
                .filter_map(|e| e.reason)
                .collect();
            reasons.iter().any(|r| r == "Override") && reasons.iter().any(|r| r == "Escalated")
        },
    )
    .await;
    let override_event = on_small()
        .await
        .into_iter()
        .find(|e| e.reason.as_deref() == Some("Override"))
        .unwrap();
    assert_eq!(
        override_event.reporting_controller.as_deref(),
        Some("stanch.dev/controller")
    );
    assert!(
        override_event
            .note
            .as_deref()
            .is_some_and(|n| n.contains("drill 集群")),
        "the decision's account: {:?}",
        override_event.note
    );

    policies
        .create(
            &PostParams::default(),
            &policy(
                "bad",
                json!({"model": "qwen-3b", "pools": [{"name": "dc-a"}], "faq": "nope"}),
            ),
        )
        .await
        .unwrap();
    until(
        "the refusal is in its status",
        Duration::from_secs(10),
        || async {
            let p = policies.get("bad").await.unwrap();
            p.status.is_some_and(|s| {
                s.conditions.iter().any(|c| {
                    c.type_ == "Ready"
                        && c.status == "False"
                        && c.reason == "Invalid"
                        && c.message.contains("spec.faq")
                })
            })
        },
    )
    .await;
    until("and in an Event on it", Duration::from_secs(10), || async {
        events
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .iter()
            .any(|e| {
                e.reason.as_deref() == Some("SpecRefused")
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("bad")
            })
    })
    .await;
    assert!(
        routes().await["models"]["qwen-3b"].is_null(),
        "a refused spec changes nothing"
    );

    policies
        .delete("small", &DeleteParams::default())
        .await
        .unwrap();
    until(
        "a deleted policy's model leaves the table",
        Duration::from_secs(10),
        || async { routes().await["models"]["qwen-7b"].is_null() },
    )
    .await;

    let _ = stop.send(());
    running.await.unwrap();
}
