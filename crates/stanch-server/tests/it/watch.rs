//! The watch protocol: ETag, long-poll, SSE, and gateway convergence.

use std::time::Duration;

use tokio::time::Instant;

use futures_util::StreamExt;
use serde_json::Value;

use crate::support::*;

async fn version(h: &Harness) -> u64 {
    h.routes().await["version"].as_u64().unwrap()
}

#[tokio::test]
async fn etag_answers_304_when_unchanged() {
    let h = Harness::start().await;
    let r = h.get("/v1/routes", Some(READ)).await;
    let etag = r.headers()["etag"].to_str().unwrap().to_owned();
    let v = r.headers()["x-stanch-route-version"]
        .to_str()
        .unwrap()
        .to_owned();
    let epoch = r.headers()["x-stanch-epoch"].to_str().unwrap().to_owned();
    assert_eq!(etag, format!("\"{epoch}-{v}\""));
    let r = h
        .http
        .get(h.url("/v1/routes"))
        .bearer_auth(READ)
        .header("if-none-match", &etag)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 304);
    fail_dc_a(&h).await;
    let r = h
        .http
        .get(h.url("/v1/routes"))
        .bearer_auth(READ)
        .header("if-none-match", &etag)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

#[tokio::test]
async fn long_poll_answers_at_once_waits_and_times_out() {
    let h = Harness::start().await;
    let v = version(&h).await;
    let epoch = h.routes().await["epoch"].as_str().unwrap().to_owned();

    let r = h
        .get(&format!("/v1/routes?after={}", v - 1), Some(READ))
        .await;
    assert_eq!(r.status(), 200, "newer than the client's: at once");
    let r = h
        .get(
            &format!("/v1/routes?after={v}&epoch=other-epoch"),
            Some(READ),
        )
        .await;
    assert_eq!(r.status(), 200, "another epoch: at once");

    let started = Instant::now();
    let r = h
        .get(
            &format!("/v1/routes?after={v}&epoch={epoch}&wait=300ms"),
            Some(READ),
        )
        .await;
    assert_eq!(r.status(), 304);
    assert!(
        started.elapsed() >= Duration::from_millis(250),
        "waited {:?}",
        started.elapsed()
    );

    let poll = {
        let (http, url) = (
            h.http.clone(),
            h.url(&format!("/v1/routes?after={v}&wait=20s")),
        );
        tokio::spawn(async move { http.get(url).bearer_auth(READ).send().await.unwrap() })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = Instant::now();
    let new = fail_dc_a(&h).await;
    let r = poll.await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "woken by the change, not the timeout"
    );
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["version"], new);
}

#[tokio::test]
async fn bad_watch_queries_are_400() {
    let h = Harness::start().await;
    let r = h.get("/v1/routes?after=abc", Some(READ)).await;
    assert_eq!(r.status(), 400);
    let r = h.get("/v1/routes?after=1&wait=forever", Some(READ)).await;
    assert_eq!(r.status(), 400);
    let r = h.get("/v1/routes?aftr=1", Some(READ)).await;
    assert_eq!(r.status(), 400);
    let r = h.get("/v1/routes/stream?after=1", Some(READ)).await;
    assert_eq!(r.status(), 400);
    assert!(r.text().await.unwrap().contains("after"));
}

/// Reads SSE events (`id`, `data`) from a response body.
struct Events {
    stream: futures_util::stream::BoxStream<'static, reqwest::Result<bytes::Bytes>>,
    buf: String,
}

impl Events {
    fn new(r: reqwest::Response) -> Events {
        Events {
            stream: r.bytes_stream().boxed(),
            buf: String::new(),
        }
    }

    async fn next(&mut self, within: Duration) -> Option<(u64, Value)> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            while let Some(end) = self.buf.find("\n\n") {
                let block: String = self.buf.drain(..end + 2).collect();
                let mut id = None;
                let mut data = None;
                for line in block.lines() {
                    if let Some(v) = line
                        .strip_prefix("id: ")
                        .or_else(|| line.strip_prefix("id:"))
                    {
                        id = v.trim().parse().ok();
                    }
                    if let Some(v) = line
                        .strip_prefix("data: ")
                        .or_else(|| line.strip_prefix("data:"))
                    {
                        data = serde_json::from_str(v).ok();
                    }
                }
                if let (Some(id), Some(data)) = (id, data) {
                    return Some((id, data));
                }
            }
            let chunk = tokio::time::timeout_at(deadline, self.stream.next())
                .await
                .ok()??
                .ok()?;
            self.buf.push_str(&String::from_utf8_lossy(&chunk));
        }
    }
}

#[tokio::test]
async fn sse_streams_every_version_and_resumes() {
    let h = Harness::start().await;
    let v = version(&h).await;
    let r = h.get("/v1/routes/stream", Some(READ)).await;
    assert_eq!(r.status(), 200);
    assert!(
        r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let mut events = Events::new(r);
    let (id, table) = events
        .next(Duration::from_secs(2))
        .await
        .expect("the current table first");
    assert_eq!(id, v);
    assert_eq!(table["version"], v);
    let new = fail_dc_a(&h).await;
    let (id, table) = events
        .next(Duration::from_secs(2))
        .await
        .expect("the new version");
    assert_eq!(id, new);
    assert_eq!(table["models"]["qwen-72b"]["rung"], "failover");

    // Resuming at the current version sends nothing until the next one.
    let r = h
        .http
        .get(h.url("/v1/routes/stream"))
        .bearer_auth(READ)
        .header("last-event-id", new.to_string())
        .send()
        .await
        .unwrap();
    let mut resumed = Events::new(r);
    assert!(
        resumed.next(Duration::from_millis(300)).await.is_none(),
        "nothing new yet"
    );
    h.webhook(fixture("alertmanager-v4-firing-degradation.json"))
        .await;
    let (id, _) = resumed
        .next(Duration::from_secs(2))
        .await
        .expect("the next version");
    assert_eq!(id, new + 1);
}

/// A resumed stream names the epoch of its version: the same number from another
/// epoch (a controller that lost its state and counted again) is another table.
#[tokio::test]
async fn sse_resumes_by_epoch_and_version() {
    let h = Harness::start().await;
    let table = h.routes().await;
    let (v, epoch) = (
        table["version"].as_u64().unwrap(),
        table["epoch"].as_str().unwrap(),
    );
    let resume = |epoch: &str| {
        h.http
            .get(h.url("/v1/routes/stream"))
            .query(&[("epoch", epoch)])
            .bearer_auth(READ)
            .header("last-event-id", v.to_string())
            .send()
    };
    let mut same = Events::new(resume(epoch).await.unwrap());
    assert!(
        same.next(Duration::from_millis(300)).await.is_none(),
        "the table it holds is not sent again"
    );
    // An epoch with characters a query must encode, as a client sends it.
    let mut other = Events::new(resume("e+0 &#").await.unwrap());
    let (id, sent) = other
        .next(Duration::from_secs(2))
        .await
        .expect("the same number from another epoch is news");
    assert_eq!((id, &sent["epoch"]), (v, &table["epoch"]));
}

#[tokio::test]
async fn gateways_report_what_they_applied() {
    let h = Harness::start().await;
    let v = version(&h).await;
    let watch = |id: &'static str, applied: u64| {
        h.http
            .get(h.url("/v1/routes"))
            .bearer_auth(READ)
            .header("x-stanch-gateway", id)
            .header("x-stanch-applied-version", applied.to_string())
    };
    watch("gw-a", v).send().await.unwrap();
    watch("gw-b", v - 1)
        .header("x-stanch-rejected-version", v.to_string())
        .header("x-stanch-rejected-reason", "unknown FAQ set")
        .send()
        .await
        .unwrap();
    let status = h.json("/v1/status").await;
    let gws = status["gateways"].as_array().unwrap();
    assert_eq!(gws.len(), 2);
    assert_eq!(gws[0]["id"], "gw-a");
    assert_eq!(gws[0]["converged"], true);
    assert_eq!(gws[1]["converged"], false);
    assert_eq!(gws[1]["rejected"][1], "unknown FAQ set");
    let metrics = h.get("/metrics", None).await.text().await.unwrap();
    assert!(
        metrics.contains(r#"stanch_gateways{kind="converged",transport="poll"} 1"#),
        "{metrics}"
    );
    assert!(
        metrics.contains(r#"stanch_gateways{kind="lagging",transport="poll"} 1"#),
        "{metrics}"
    );
}

#[tokio::test]
async fn watching_needs_the_read_token() {
    let h = Harness::start().await;
    assert_eq!(h.get("/v1/routes", None).await.status(), 401);
    assert_eq!(h.get("/v1/routes/stream", Some(INGEST)).await.status(), 401);
    assert_eq!(h.get("/v1/routes", Some(ADMIN)).await.status(), 200);
}
