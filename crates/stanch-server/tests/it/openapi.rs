//! docs/openapi.yaml and the router agree: every documented operation exists, every
//! route the router serves is documented, and documented auth is enforced.

use std::collections::BTreeSet;

use serde_yaml::Value;

use crate::support::*;

fn documented() -> BTreeSet<(String, String)> {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/openapi.yaml"
    ))
    .unwrap();
    let doc: Value = serde_yaml::from_str(&text).unwrap();
    let mut ops = BTreeSet::new();
    for (path, item) in doc["paths"].as_mapping().unwrap() {
        for (method, _) in item.as_mapping().unwrap() {
            ops.insert((
                method.as_str().unwrap().to_uppercase(),
                path.as_str().unwrap().to_owned(),
            ));
        }
    }
    ops
}

/// `path` with each `{parameter}` replaced by its example in the document.
fn example_path(path: &str) -> String {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/openapi.yaml"
    ))
    .unwrap();
    let doc: Value = serde_yaml::from_str(&text).unwrap();
    let mut out = path.to_owned();
    for op in doc["paths"][path].as_mapping().unwrap().values() {
        for p in op["parameters"].as_sequence().into_iter().flatten() {
            if p["in"] == "path" {
                let name = p["name"].as_str().unwrap();
                let example = p["example"].as_str().expect("a path parameter's example");
                out = out.replace(&format!("{{{name}}}"), example);
            }
        }
    }
    assert!(
        !out.contains('{'),
        "{path}: a path parameter without an example"
    );
    out
}

#[tokio::test]
async fn the_document_matches_the_router() {
    let h = Harness::start().await;
    let doc = documented();
    let served: BTreeSet<(String, String)> = stanch_server::api::ROUTES
        .iter()
        .map(|(m, p)| (m.to_string(), p.to_string()))
        .collect();
    assert_eq!(doc, served, "docs/openapi.yaml and api::ROUTES differ");
    for (method, path) in &doc {
        let req = h
            .http
            .request(method.parse().unwrap(), h.url(&example_path(path)))
            .bearer_auth(ADMIN);
        let req = if method == "POST" {
            req.body("{}")
        } else {
            req
        };
        let status = req.send().await.unwrap().status();
        assert!(
            status != 404 && status != 405,
            "{method} {path} is documented but answers {status}"
        );
    }
    // A route that is not documented is not served.
    assert_eq!(
        h.post("/v1/admin/reboot", Some(ADMIN), "{}").await.status(),
        404
    );
}

#[tokio::test]
async fn documented_security_is_enforced() {
    let h = Harness::start().await;
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/openapi.yaml"
    ))
    .unwrap();
    let doc: Value = serde_yaml::from_str(&text).unwrap();
    for (path, item) in doc["paths"].as_mapping().unwrap() {
        for (method, op) in item.as_mapping().unwrap() {
            let (method, path) = (
                method.as_str().unwrap().to_uppercase(),
                path.as_str().unwrap(),
            );
            let req = h
                .http
                .request(method.parse().unwrap(), h.url(&example_path(path)));
            let status = req.body("{}").send().await.unwrap().status();
            if op.get("security").is_some() {
                assert_eq!(status, 401, "{method} {path} is secured in the document");
            } else {
                assert_ne!(status, 401, "{method} {path} is open in the document");
            }
        }
    }
}
