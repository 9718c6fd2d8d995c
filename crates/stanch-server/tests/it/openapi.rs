//! docs/openapi.yaml and the router agree: every documented operation exists, every
//! route the router serves is documented, and documented auth is enforced.

use std::collections::BTreeSet;

use serde_yaml::Value;

use crate::support::*;

/// docs/openapi.yaml, parsed.
fn document() -> Value {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/openapi.yaml"
    ))
    .unwrap();
    serde_yaml::from_str(&text).unwrap()
}

fn documented() -> BTreeSet<(String, String)> {
    let doc = document();
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
    let doc = document();
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
    let doc = document();
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

/// A value of `schema`'s type, for a query parameter.
fn example_value(schema: &Value) -> &'static str {
    match (schema["type"].as_str(), schema["$ref"].as_str()) {
        (Some("integer"), _) => "0",
        (Some("string"), _) => "x",
        (_, Some("#/components/schemas/Duration")) => "1s",
        other => panic!("no example for a query parameter of schema {other:?}"),
    }
}

/// `query` is answered 400, in the API's error shape, with a detail that names `names`.
async fn refused(h: &Harness, query: &str, names: &str) {
    let r = h.get(query, Some(READ)).await;
    assert_eq!(r.status(), 400, "{query}");
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"], "invalid_payload", "{query}: {body}");
    let detail = body["detail"].as_str().unwrap();
    assert!(detail.contains(names), "{query}: {detail:?} names {names}");
}

/// Every query parameter the document names is accepted; anything else, and a value
/// of the wrong type, is a 400 in the API's error shape that names the parameter, on
/// every route that takes a query.
#[tokio::test]
async fn documented_query_parameters_are_the_ones_served() {
    let h = Harness::start().await;
    let doc = document();
    let mut routes = 0;
    for (path, item) in doc["paths"].as_mapping().unwrap() {
        let path = path.as_str().unwrap();
        let Some(op) = item.get("get") else { continue };
        let params: Vec<(String, &'static str)> = op["parameters"]
            .as_sequence()
            .into_iter()
            .flatten()
            .filter(|p| p["in"] == "query")
            .map(|p| {
                let name = p["name"].as_str().unwrap().to_owned();
                (name, example_value(&p["schema"]))
            })
            .collect();
        if params.is_empty() {
            continue;
        }
        routes += 1;
        let all: Vec<String> = params.iter().map(|(n, v)| format!("{n}={v}")).collect();
        let r = h
            .get(&format!("{path}?{}", all.join("&")), Some(READ))
            .await;
        assert_eq!(r.status(), 200, "{path}?{}", all.join("&"));
        drop(r);
        refused(&h, &format!("{path}?undocumented=1"), "undocumented").await;
        for (name, value) in &params {
            if *value == "0" {
                refused(&h, &format!("{path}?{name}=none"), name).await;
            }
        }
    }
    assert_eq!(
        routes, 3,
        "/v1/routes, /v1/routes/stream and /v1/history take a query"
    );
}
