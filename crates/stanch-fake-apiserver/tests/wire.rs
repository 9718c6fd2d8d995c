//! The fake API server speaks the wire protocol the way the real one does, for what
//! stanch uses (shapes checked against the Kubernetes API reference).

use serde_json::{Value, json};
use stanch_fake_apiserver::FakeApiServer;

const POLICIES: &str = "/apis/stanch.dev/v1alpha1/namespaces/monitoring/stanchpolicies";

fn http() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}

fn policy(name: &str, model: &str) -> Value {
    json!({"apiVersion": "stanch.dev/v1alpha1", "kind": "StanchPolicy",
           "metadata": {"name": name},
           "spec": {"model": model, "pools": [{"name": "dc-a"}]},
           "status": {"rung": "static"}})
}

async fn send(r: reqwest::RequestBuilder) -> (u16, Value) {
    let r = r.send().await.unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

#[tokio::test]
async fn objects_are_created_read_listed_and_errors_are_status_objects() {
    let api = FakeApiServer::start().await;
    let url = |p: &str| format!("{}{POLICIES}{p}", api.url());
    let (code, created) = send(http().post(url("")).json(&policy("qwen-72b", "qwen-72b"))).await;
    assert_eq!(code, 201);
    assert_eq!(created["metadata"]["generation"], 1);
    assert_eq!(created["metadata"]["namespace"], "monitoring");
    assert!(
        created["metadata"]["uid"].is_string()
            && created["metadata"]["resourceVersion"].is_string()
    );
    assert!(
        created.get("status").is_none(),
        "a create does not set a status subresource"
    );

    let (code, again) = send(http().post(url("")).json(&policy("qwen-72b", "qwen-72b"))).await;
    assert_eq!(code, 409);
    assert_eq!(
        (
            again["kind"].as_str(),
            again["reason"].as_str(),
            again["code"].as_u64()
        ),
        (Some("Status"), Some("AlreadyExists"), Some(409))
    );

    let (code, missing) = send(http().get(url("/nope"))).await;
    assert_eq!(code, 404);
    assert_eq!(missing["reason"], "NotFound");
    assert_eq!(missing["details"]["name"], "nope");

    let (_, list) = send(http().get(url(""))).await;
    assert_eq!(list["kind"], "StanchPolicyList");
    assert_eq!(list["items"].as_array().unwrap().len(), 1);
    assert_eq!(
        list["metadata"]["resourceVersion"],
        created["metadata"]["resourceVersion"]
    );
}

/// Optimistic concurrency: a write with a stale resourceVersion is a 409 Conflict;
/// generation moves with the spec only; status is the status subresource's alone.
#[tokio::test]
async fn writes_carry_preconditions_and_status_is_a_subresource() {
    let api = FakeApiServer::start().await;
    let url = |p: &str| format!("{}{POLICIES}{p}", api.url());
    let (_, created) = send(http().post(url("")).json(&policy("p", "qwen-72b"))).await;
    let rv = created["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_owned();

    let mut edited = created.clone();
    edited["spec"]["fallback"] = json!("qwen-14b");
    let (code, updated) = send(http().put(url("/p")).json(&edited)).await;
    assert_eq!(code, 200);
    assert_eq!(updated["metadata"]["generation"], 2, "the spec changed");
    assert_ne!(updated["metadata"]["resourceVersion"], rv.as_str());

    // The same edit again, on the version read before: refused.
    let (code, conflict) = send(http().put(url("/p")).json(&edited)).await;
    assert_eq!(code, 409);
    assert_eq!(conflict["reason"], "Conflict");

    // Status through /status: the spec stays; generation does not move.
    let mut with_status = updated.clone();
    with_status["status"] = json!({"rung": "failover", "observedGeneration": 2});
    with_status["spec"]["fallback"] = json!("ignored");
    let (code, status) = send(http().put(url("/p/status")).json(&with_status)).await;
    assert_eq!(code, 200);
    assert_eq!(status["status"]["rung"], "failover");
    assert_eq!(
        status["spec"]["fallback"], "qwen-14b",
        "a status write changes nothing else"
    );
    assert_eq!(status["metadata"]["generation"], 2);
    // And the object's own writes leave status alone.
    let mut object = status.clone();
    object["status"] = json!({"rung": "normal"});
    let (_, after) = send(http().put(url("/p")).json(&object)).await;
    assert_eq!(after["status"]["rung"], "failover");
    assert_eq!(
        after["metadata"]["generation"], 2,
        "nothing but status differed"
    );
}

#[tokio::test]
async fn merge_patches_and_server_side_apply() {
    let api = FakeApiServer::start().await;
    let url = |p: &str| format!("{}{POLICIES}{p}{}", api.url(), "");
    let apply = |name: &str, manager: Option<&str>, body: Value| {
        let mut u = format!("{}{POLICIES}/{name}", api.url());
        if let Some(m) = manager {
            u.push_str(&format!("?fieldManager={m}&force=true"));
        }
        http()
            .patch(u)
            .header("content-type", "application/apply-patch+yaml")
            .body(body.to_string())
    };
    let (code, refused) = send(apply("p", None, policy("p", "qwen-72b"))).await;
    assert_eq!(code, 400, "apply needs a field manager: {refused}");
    let (code, created) = send(apply("p", Some("stanch"), policy("p", "qwen-72b"))).await;
    assert_eq!(code, 201, "apply creates what is missing");
    assert_eq!(created["metadata"]["managedFields"][0]["manager"], "stanch");
    let (code, status) = send(
        apply("p/status", Some("stanch"), json!({"apiVersion": "stanch.dev/v1alpha1", "kind": "StanchPolicy", "status": {"rung": "degraded"}})),
    )
    .await;
    assert_eq!(code, 200);
    assert_eq!(status["status"]["rung"], "degraded");
    // What the manager applied before and leaves out now is removed, as the real
    // server-side apply removes fields their manager no longer applies.
    let (code, status) = send(apply(
        "p/status",
        Some("stanch"),
        json!({"apiVersion": "stanch.dev/v1alpha1", "kind": "StanchPolicy",
               "status": {"rung": "static", "alias": "qwen-14b"}}),
    ))
    .await;
    assert_eq!(
        (code, status["status"]["alias"].as_str()),
        (200, Some("qwen-14b"))
    );
    let (code, status) = send(apply(
        "p/status",
        Some("stanch"),
        json!({"apiVersion": "stanch.dev/v1alpha1", "kind": "StanchPolicy",
               "status": {"rung": "normal"}}),
    ))
    .await;
    assert_eq!(code, 200);
    assert_eq!(
        status["status"],
        json!({"rung": "normal"}),
        "alias no longer applied"
    );
    let (code, merged) = send(
        http()
            .patch(url("/p"))
            .header("content-type", "application/merge-patch+json")
            .body(json!({"spec": {"faq": "default"}}).to_string()),
    )
    .await;
    assert_eq!(code, 200);
    assert_eq!(
        (
            merged["spec"]["faq"].as_str(),
            merged["spec"]["model"].as_str()
        ),
        (Some("default"), Some("qwen-72b"))
    );
    let (code, _) = send(
        http()
            .patch(url("/p"))
            .header("content-type", "application/json-patch+json")
            .body("[]"),
    )
    .await;
    assert_eq!(code, 415);
}

/// Reads a watch stream's first `n` events.
async fn events(response: reqwest::Response, n: usize) -> Vec<Value> {
    use futures_util::StreamExt;
    let mut out = Vec::new();
    let mut buf = Vec::new();
    let mut stream = response.bytes_stream();
    while out.len() < n {
        let chunk = tokio::time::timeout(std::time::Duration::from_secs(5), stream.next())
            .await
            .expect("an event in time")
            .expect("the stream goes on")
            .unwrap();
        buf.extend_from_slice(&chunk);
        while let Some(at) = buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = buf.drain(..=at).collect();
            out.push(serde_json::from_slice(&line).unwrap());
        }
    }
    out
}

#[tokio::test]
async fn watches_resume_from_a_version_bookmark_and_expire_with_410() {
    let api = FakeApiServer::start().await;
    let url = |p: &str| format!("{}{POLICIES}{p}", api.url());
    let (_, a) = send(http().post(url("")).json(&policy("a", "m1"))).await;
    let from = a["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_owned();
    send(http().post(url("")).json(&policy("b", "m2"))).await;
    send(http().delete(url("/a"))).await;

    let watch = http()
        .get(url(&format!(
            "?watch=true&resourceVersion={from}&allowWatchBookmarks=true&timeoutSeconds=10"
        )))
        .send()
        .await
        .unwrap();
    let seen = events(watch, 3).await;
    let types: Vec<&str> = seen.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(
        types[..2],
        ["ADDED", "DELETED"],
        "every change after the version, in order"
    );
    assert_eq!(seen[0]["object"]["metadata"]["name"], "b");
    assert_eq!(types[2], "BOOKMARK", "and a bookmark while nothing happens");

    api.compact();
    let old = http()
        .get(url(&format!("?watch=true&resourceVersion={from}")))
        .send()
        .await
        .unwrap();
    let gone = events(old, 1).await;
    assert_eq!(gone[0]["type"], "ERROR");
    assert_eq!(
        (
            gone[0]["object"]["code"].as_u64(),
            gone[0]["object"]["reason"].as_str()
        ),
        (Some(410), Some("Expired"))
    );
}

#[tokio::test]
async fn an_unavailable_api_server_answers_503_until_it_is_back() {
    let api = FakeApiServer::start().await;
    let url = format!("{}{POLICIES}", api.url());
    api.set_down(true);
    let (code, body) = send(http().get(&url)).await;
    assert_eq!(
        (code, body["reason"].as_str()),
        (503, Some("ServiceUnavailable"))
    );
    api.set_down(false);
    assert_eq!(send(http().get(&url)).await.0, 200);
}
