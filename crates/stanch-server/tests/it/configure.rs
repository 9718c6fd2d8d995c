//! A policy changed live: mid-incident, through a crash, and back at a restart.

use serde_json::{Value, json};
use stanch_core::Config;
use stanch_server::ConfigureError;

use crate::support::*;

/// qwen-14b gives way to qwen-32b, which qwen-72b now falls back to.
fn next_policy() -> Config {
    let mut next = test_config();
    let mut small = next.models["qwen-14b"].clone();
    small.fallback = None;
    next.models.remove("qwen-14b");
    next.models.insert("qwen-32b".into(), small);
    next.models.get_mut("qwen-72b").unwrap().fallback = Some("qwen-32b".into());
    next
}

async fn kinds(h: &Harness) -> Vec<String> {
    let history: Vec<Value> = h
        .get("/v1/history?limit=1000", Some(READ))
        .await
        .json()
        .await
        .unwrap();
    history
        .iter()
        .map(|e| e["kind"].as_str().unwrap_or_default().to_owned())
        .collect()
}

/// The incident's state is kept across the change, the new model is served and the
/// removed one leaves the table; an invalid policy changes nothing; the change is
/// durable (a crash and a restart on the new file keep everything), and a restart on
/// the old file puts the old policy back as a recorded change, still mid-incident.
#[tokio::test]
async fn a_policy_changes_live_and_survives_a_crash() {
    let mut h = Harness::start().await;
    h.webhook(fixture("alertmanager-v4-firing-failover.json"))
        .await;
    assert_eq!(h.routes().await["models"]["qwen-72b"]["rung"], "failover");

    let controller = h.controller.as_ref().unwrap();
    controller.configure(next_policy()).await.unwrap();
    let routes = h.routes().await;
    assert_eq!(
        routes["models"]["qwen-72b"]["rung"], "failover",
        "the incident's state is kept"
    );
    assert_eq!(routes["models"]["qwen-32b"]["rung"], "normal");
    assert!(routes["models"]["qwen-14b"].is_null(), "{routes}");
    assert!(kinds(&h).await.contains(&"configured".to_owned()));
    // Overrides check against the policy in force.
    let forced = h
        .admin(
            "force",
            json!({"model": "qwen-32b", "rung": "static", "ttl": "1h", "reason": "drill"}),
        )
        .await;
    assert_eq!(forced.status(), 200, "{}", forced.text().await.unwrap());

    let mut bad = next_policy();
    bad.models.get_mut("qwen-72b").unwrap().fallback = Some("nope".into());
    let version = h.routes().await["version"].clone();
    let refused = h.controller.as_ref().unwrap().configure(bad).await;
    assert!(
        matches!(refused, Err(ConfigureError::Invalid(_))),
        "{refused:?}"
    );
    assert_eq!(h.routes().await["version"], version, "nothing changed");

    let before = h.routes().await;
    h.config = next_policy();
    h.crash().await;
    h.restart().await;
    let after = h.routes().await;
    assert_eq!(
        after["version"], before["version"],
        "no change at the restart"
    );
    assert_eq!(after["models"], before["models"]);

    h.config = test_config();
    h.crash().await;
    h.restart().await;
    let back = h.routes().await;
    assert!(back["models"]["qwen-14b"].is_object(), "{back}");
    assert!(back["models"]["qwen-32b"].is_null(), "{back}");
    assert_eq!(
        back["models"]["qwen-72b"]["rung"], "failover",
        "still mid-incident"
    );
    assert!(back["version"].as_u64() > before["version"].as_u64());
    let configured = kinds(&h)
        .await
        .iter()
        .filter(|k| *k == "configured")
        .count();
    assert_eq!(configured, 2, "both changes are in the history");
}
