//! `stanch serve --kubernetes-policies` against the fake API server, as a process: the
//! policies listed at start are in force from the first table, one created later is
//! put in force live, and a reloaded file is merged under them.

use std::time::Duration;

use kube::api::{Api, PostParams};
use serde_json::{Value, json};
use stanch_fake_apiserver::FakeApiServer;
use stanch_kube::crd::StanchPolicy;
use stanch_testkit::net::free_port;
use stanch_testkit::process::Running;
use stanch_testkit::wait::{until, until_some};

fn policy(name: &str, model: &str) -> StanchPolicy {
    StanchPolicy::new(
        name,
        serde_json::from_value(
            json!({"model": model, "pools": [{"name": "dc-a"}], "faq": "default"}),
        )
        .unwrap(),
    )
}

async fn routes(port: u16) -> Option<Value> {
    reqwest::Client::builder()
        .no_proxy()
        .build()
        .unwrap()
        .get(format!("http://127.0.0.1:{port}/v1/routes"))
        .send()
        .await
        .ok()?
        .json()
        .await
        .ok()
}

#[tokio::test]
async fn serve_takes_policies_from_the_cluster_at_start_and_live() {
    let api = FakeApiServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig, "monitoring").unwrap();
    let client = kube::Client::try_from(kube::Config::new(api.url().parse().unwrap())).unwrap();
    let policies: Api<StanchPolicy> = Api::namespaced(client, "monitoring");
    policies
        .create(&PostParams::default(), &policy("small", "qwen-7b"))
        .await
        .unwrap();

    let file = dir.path().join("stanch.yaml");
    let one = "models:\n  qwen-72b: {pools: [dc-a, dc-b]}\n";
    std::fs::write(&file, one).unwrap();
    let port = free_port();
    // SIGTERM at the end, so that what the controller logged is written out.
    let child = Running::spawn(
        std::process::Command::new(env!("CARGO_BIN_EXE_stanch"))
            .args([
                "serve",
                "--store",
                "memory",
                "--kubernetes-policies",
                "--config",
            ])
            .arg(&file)
            .args(["--kubernetes-namespace", "monitoring", "--listen"])
            .arg(format!("127.0.0.1:{port}"))
            .env("KUBECONFIG", &kubeconfig)
            .env_remove("KUBERNETES_SERVICE_HOST"),
    )
    .terminate_on_drop(Duration::from_secs(5));
    let first = until_some("the controller serving", Duration::from_secs(10), || {
        routes(port)
    })
    .await;
    assert!(
        first["models"]["qwen-7b"].is_object(),
        "the resource listed at start is in the first table: {first}"
    );
    // And it stays: the watcher's first list does not put the file alone in force for
    // a moment.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let settled = routes(port).await.unwrap();
    assert!(settled["models"]["qwen-7b"].is_object(), "{settled}");
    assert_eq!(
        settled["version"], first["version"],
        "no change at all: {settled}"
    );

    policies
        .create(&PostParams::default(), &policy("tiny", "qwen-3b"))
        .await
        .unwrap();
    until(
        "a policy created later put in force live",
        Duration::from_secs(10),
        || async {
            routes(port)
                .await
                .is_some_and(|r| r["models"]["qwen-3b"].is_object())
        },
    )
    .await;

    // A reloaded file is merged under the resources: its new model comes, theirs stay.
    std::fs::write(&file, format!("{one}  qwen-1b: {{pools: [dc-a]}}\n")).unwrap();
    child.signal("-HUP");
    let merged = until_some(
        "the reloaded file's model served",
        Duration::from_secs(10),
        || async {
            routes(port)
                .await
                .filter(|r| r["models"]["qwen-1b"].is_object())
        },
    )
    .await;
    for model in ["qwen-72b", "qwen-7b", "qwen-3b"] {
        assert!(
            merged["models"][model].is_object(),
            "{model} stays: {merged}"
        );
    }
}

/// `stanch ctl --kubeconfig` reads what the cluster holds: the route-table resource as
/// the watch serves it, and the policies' statuses; it refuses to change anything.
#[tokio::test]
async fn ctl_reads_the_route_table_and_policy_statuses_from_the_cluster() {
    use kube::api::{Patch, PatchParams};
    use stanch_kube::publish::RouteTableWriter;

    let api = FakeApiServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig, "monitoring").unwrap();
    let client = kube::Client::try_from(kube::Config::new(api.url().parse().unwrap())).unwrap();
    let at = stanch_api::Timestamp::from_millis(1_764_633_600_000);
    let table = stanch_core::Engine::new(
        stanch_core::Config::default_config(),
        stanch_core::Engine::fresh_state("e1".into(), at),
        at,
    )
    .route_table();
    RouteTableWriter::new(Api::namespaced(client.clone(), "monitoring"), "stanch")
        .write(&table)
        .await
        .unwrap();
    let policies: Api<StanchPolicy> = Api::namespaced(client, "monitoring");
    policies
        .create(&PostParams::default(), &policy("small", "qwen-7b"))
        .await
        .unwrap();
    let status = json!({"apiVersion": "stanch.dev/v1alpha1", "kind": "StanchPolicy",
        "status": {"rung": "failover", "activePool": "dc-b", "reason": "PoolDown on dc-a",
                   "conditions": [{"type": "Ready", "status": "True", "reason": "InForce",
                                   "message": "in force", "lastTransitionTime": "2026-12-02T00:00:00Z"}]}});
    policies
        .patch_status(
            "small",
            &PatchParams::apply("stanch").force(),
            &Patch::Apply(&status),
        )
        .await
        .unwrap();

    let ctl = |args: &[&str]| {
        let kubeconfig = kubeconfig.clone();
        let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
        async move {
            tokio::task::spawn_blocking(move || {
                std::process::Command::new(env!("CARGO_BIN_EXE_stanch"))
                    .arg("ctl")
                    .arg("--kubeconfig")
                    .arg(&kubeconfig)
                    .args(&args)
                    .env_remove("KUBERNETES_SERVICE_HOST")
                    .output()
                    .unwrap()
            })
            .await
            .unwrap()
        }
    };
    let routes = ctl(&["routes", "--output", "json"]).await;
    assert!(
        routes.status.success(),
        "{}",
        String::from_utf8_lossy(&routes.stderr)
    );
    let read: stanch_api::RouteTable = serde_json::from_slice(&routes.stdout).unwrap();
    assert_eq!(read, table, "the table as the watch serves it");

    let status = ctl(&["status"]).await;
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    let text = String::from_utf8_lossy(&status.stdout);
    let row = text
        .lines()
        .find(|l| l.starts_with("small"))
        .unwrap_or_else(|| panic!("a row for the policy:\n{text}"));
    for cell in [
        "qwen-7b",
        "failover",
        "dc-b",
        "True (InForce)",
        "PoolDown on dc-a",
    ] {
        assert!(row.contains(cell), "{cell} in {row:?}");
    }
    assert!(
        text.contains(&format!("version {} epoch e1", table.version)),
        "{text}"
    );

    let refused = ctl(&["force", "qwen-7b", "static", "--reason", "x"]).await;
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("--server"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
}
