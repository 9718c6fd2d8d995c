//! A controller without tokens (allowed on loopback) and a web page in an operator's
//! browser: the page can neither change state (a form or `text/plain` body, another
//! site's `Origin`) nor read it through a name it controls (DNS rebinding).

use serde_json::{Value, json};

use crate::support::*;

async fn open_controller() -> Harness {
    Harness::with(Options {
        tokens: false,
        ..Options::default()
    })
    .await
}

fn force() -> String {
    json!({"model": "qwen-72b", "rung": "static", "reason": "from a page"}).to_string()
}

async fn error_of(r: reqwest::Response) -> (u16, String) {
    let status = r.status().as_u16();
    let body: Value = r.json().await.unwrap();
    (status, body["error"].as_str().unwrap().to_owned())
}

#[tokio::test]
async fn a_page_of_another_site_cannot_change_an_open_controller() {
    let h = open_controller().await;
    let post = |content_type: &'static str, origin: Option<&'static str>| {
        let mut r = h
            .http
            .post(h.url("/v1/admin/force"))
            .header("content-type", content_type)
            .body(force());
        if let Some(o) = origin {
            r = r.header("origin", o);
        }
        r.send()
    };
    // What a page can send without a preflight: a form, or text.
    for simple in [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data",
    ] {
        let r = post(simple, Some("https://evil.example")).await.unwrap();
        assert_eq!(error_of(r).await, (403, "cross_site".into()), "{simple}");
        // Some browsers send no Origin on a form's POST.
        let r = post(simple, None).await.unwrap();
        assert_eq!(
            error_of(r).await,
            (415, "unsupported_media_type".into()),
            "{simple}"
        );
    }
    // JSON from another site's page.
    let r = post("application/json", Some("https://evil.example"))
        .await
        .unwrap();
    assert_eq!(error_of(r).await, (403, "cross_site".into()));
    let r = post("application/json", Some("null")).await.unwrap();
    assert_eq!(error_of(r).await, (403, "cross_site".into()));
    assert_eq!(
        h.routes().await["models"]["qwen-72b"]["rung"],
        "normal",
        "nothing changed"
    );

    // The controller's own page, and a client on the machine, still can.
    let r = post(
        "application/json; charset=utf-8",
        Some("http://127.0.0.1:9797"),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 200);
    let r = post("application/json", None).await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(h.routes().await["models"]["qwen-72b"]["rung"], "static");
}

#[tokio::test]
async fn an_open_controller_answers_only_loopback_names() {
    let h = open_controller().await;
    let get = |host: &'static str| h.http.get(h.url("/v1/status")).header("host", host).send();
    // A rebinding page reaches 127.0.0.1 under its own name.
    let r = get("evil.example:9797").await.unwrap();
    assert_eq!(error_of(r).await, (403, "not_loopback_host".into()));
    let r = h
        .http
        .post(h.url("/v1/alerts/alertmanager"))
        .header("host", "evil.example")
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(error_of(r).await, (403, "not_loopback_host".into()));
    for ok in ["localhost:9797", "127.0.0.1", "[::1]:9797"] {
        assert_eq!(get(ok).await.unwrap().status(), 200, "{ok}");
    }
}

#[tokio::test]
async fn with_tokens_a_bearer_is_what_counts() {
    let h = Harness::start().await;
    let r = h
        .http
        .post(h.url("/v1/admin/force"))
        .bearer_auth(ADMIN)
        .header("host", "stanch.monitoring.svc:9797")
        .header("content-type", "text/plain")
        .body(force())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "a token is not something a page has");
}
