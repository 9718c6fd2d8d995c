//! Streams that break after their first token, continued elsewhere: with the partial
//! answer as a prefill where the pool takes one, regenerated and spliced where the new
//! answer begins with exactly what the caller has, and otherwise ended with the error
//! event as before.

use serde_json::{Value, json};
use stanch_mock::{MockConfig, Prefill};

use crate::support::*;

/// A mock of qwen-72b named `name` that makes of a prefill what `prefill` says.
async fn mock(name: &str, prefill: Prefill) -> Upstream {
    let mut config = MockConfig::new("qwen-72b", name);
    config.prefill = prefill;
    Upstream::with(config).await
}

/// qwen-72b with one pool per `(name, prefill setting, extra endpoint settings)`, in
/// that order, falling back to the FAQ; `retry` is added to the policy's retry settings
/// (which allow 6 attempts).
async fn pools(ups: &[(&str, &str, &str, &Upstream)], retry: &str) -> Setup {
    let policy = POLICY
        .replace("max_attempts: 4", "max_attempts: 6")
        .replace(
            "budget_min_retries: 1000}",
            &format!("budget_min_retries: 1000{retry}}}"),
        );
    let mut yaml = "models:\n  qwen-72b:\n    faq: default\n    pools:\n".to_owned();
    for (name, prefill, extra, _) in ups {
        yaml.push_str(&format!(
            "      - {{name: {name}, prefill: {prefill}, endpoints: [{{url: '{{{name}}}'{extra}}}]}}\n"
        ));
    }
    yaml.push_str(&policy);
    let named: Vec<(&str, &Upstream)> = ups.iter().map(|(n, _, _, u)| (*n, *u)).collect();
    gateway(&yaml, &named).await
}

/// A streamed chat of `max_tokens` 6 with usage: its events.
async fn stream(gw: &Setup) -> Vec<String> {
    let body = json!({"model": "qwen-72b", "stream": true, "max_tokens": 6,
                      "stream_options": {"include_usage": true},
                      "messages": [{"role": "user", "content": "hello there"}]});
    let r = gw.chat_body(&body, "acme-key").await;
    assert_eq!(r.status(), 200);
    events(&r.text().await.unwrap())
}

/// The chunks of a stream (not `[DONE]`, not an error).
fn chunks(ev: &[String]) -> Vec<Value> {
    ev.iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter(|v| v.get("error").is_none())
        .collect()
}

/// Asserts `ev` is one whole, well-formed stream whose text is `expected`.
fn assert_whole(ev: &[String], expected: &str, what: &str) {
    assert_eq!(content(ev), expected, "{what}: {ev:#?}");
    assert_eq!(ev.last().map(String::as_str), Some("[DONE]"), "{what}");
    let chunks = chunks(ev);
    assert_eq!(
        chunks.len() + 1,
        ev.len(),
        "{what}: no error event: {ev:#?}"
    );
    assert_one_id(&chunks, what);
    let roles = chunks
        .iter()
        .filter(|c| c["choices"][0]["delta"].get("role").is_some())
        .count();
    assert_eq!(roles, 1, "{what}: one role, at the start");
    let finishes: Vec<&Value> = chunks
        .iter()
        .map(|c| &c["choices"][0]["finish_reason"])
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finishes, [&json!("stop")], "{what}: one finish_reason");
    let usage = chunks.iter().filter(|c| c["usage"].is_object()).count();
    assert_eq!(usage, 1, "{what}: one usage chunk");
}

/// Asserts every chunk carries the same `id`: one stream, however many upstreams.
fn assert_one_id(chunks: &[Value], what: &str) {
    let ids: std::collections::BTreeSet<&str> =
        chunks.iter().map(|c| c["id"].as_str().unwrap()).collect();
    assert_eq!(ids.len(), 1, "{what}: one id for the whole stream: {ids:?}");
}

/// The usage a stream reported.
fn usage(ev: &[String]) -> Value {
    chunks(ev)
        .into_iter()
        .find(|c| c["usage"].is_object())
        .map(|c| c["usage"].clone())
        .unwrap()
}

/// `stanch_gateway_stream_resumes_total{how, result}` on `gw`.
async fn resumes(gw: &Setup, how: &str, result: &str) -> f64 {
    let metrics = gw.metrics().await;
    sample(
        &metrics,
        "stanch_gateway_stream_resumes_total",
        &[("how", how), ("result", result)],
    )
}

/// Asserts `ev` is `words` words, then the error event and no `[DONE]`.
fn assert_interrupted(ev: &[String], words: usize, what: &str) {
    assert_eq!(
        content(ev).split_whitespace().count(),
        words,
        "{what}: {ev:#?}"
    );
    let last: Value = serde_json::from_str(ev.last().unwrap()).unwrap();
    assert_eq!(
        last["error"]["code"], "stream_interrupted",
        "{what}: {ev:#?}"
    );
    assert!(!ev.iter().any(|e| e == "[DONE]"), "{what}");
}

/// What the unbroken stream says: the same request to a healthy gateway.
async fn unbroken() -> Vec<String> {
    let a = mock("a", Prefill::Ignore).await;
    let gw = pools(&[("a", "none", "", &a)], "").await;
    stream(&gw).await
}

#[tokio::test]
async fn a_stream_broken_after_its_first_token_is_continued_with_a_prefill() {
    let expected = unbroken().await;
    let text = content(&expected);
    assert_eq!(text.split(' ').count(), 6);
    for fault in [
        json!({"kind": "cut", "after_tokens": 2}),
        json!({"kind": "break", "after_tokens": 2}),
        json!({"kind": "stall", "after_tokens": 2}),
    ] {
        let a = mock("a", Prefill::Ignore).await;
        let b = mock("b", Prefill::Continue).await;
        a.fault(fault.clone());
        let gw = pools(&[("a", "none", "", &a), ("b", "vllm", "", &b)], "").await;
        let ev = stream(&gw).await;
        assert_whole(&ev, &text, &fault.to_string());
        // As if one upstream had answered it all: the prefilled words are completion.
        assert_eq!(usage(&ev), usage(&expected), "{fault}");
        assert_eq!(resumes(&gw, "prefill", "spliced").await, 1.0, "{fault}");
        assert_eq!(b.requests(), 1, "{fault}");
    }
}

#[tokio::test]
async fn a_stream_is_regenerated_and_spliced_where_the_new_answer_matches() {
    let expected = unbroken().await;
    let a = mock("a", Prefill::Ignore).await;
    let b = mock("b", Prefill::Ignore).await;
    a.fault(json!({"kind": "break", "after_tokens": 3}));
    let gw = pools(&[("a", "none", "", &a), ("b", "none", "", &b)], "").await;
    let ev = stream(&gw).await;
    assert_whole(&ev, &content(&expected), "regenerated");
    // The regenerated answer's own usage: it generated all of it.
    assert_eq!(usage(&ev), usage(&expected));
    assert_eq!(resumes(&gw, "regenerate", "spliced").await, 1.0);
}

#[tokio::test]
async fn a_regenerated_answer_that_differs_ends_the_stream_with_the_error_event() {
    let a = mock("a", Prefill::Ignore).await;
    // Another model name upstream: another answer.
    let b = mock("b", Prefill::Ignore).await;
    a.fault(json!({"kind": "cut", "after_tokens": 2}));
    let gw = pools(
        &[
            ("a", "none", "", &a),
            ("b", "none", ", upstream_model: qwen-72b-awq", &b),
        ],
        "",
    )
    .await;
    assert_interrupted(&stream(&gw).await, 2, "diverged");
    assert_eq!(b.requests(), 1, "the continuation was tried");
    assert_eq!(resumes(&gw, "regenerate", "diverged").await, 1.0);
}

#[tokio::test]
async fn a_refused_prefill_or_a_continuation_that_breaks_at_once_moves_on() {
    let expected = unbroken().await;
    let a = mock("a", Prefill::Ignore).await;
    // Said to take a prefill, and refuses it with a 400.
    let b = mock("b", Prefill::Reject).await;
    // Breaks before its first chunk: spends no resume.
    let c = mock("c", Prefill::Continue).await;
    let d = mock("d", Prefill::Continue).await;
    a.fault(json!({"kind": "cut", "after_tokens": 2}));
    c.fault(json!({"kind": "break", "after_tokens": 0}));
    let gw = pools(
        &[
            ("a", "none", "", &a),
            ("b", "assistant", "", &b),
            ("c", "vllm", "", &c),
            ("d", "vllm", "", &d),
        ],
        "",
    )
    .await;
    let ev = stream(&gw).await;
    assert_whole(&ev, &content(&expected), "after a refusal and a break");
    assert!(
        !ev.iter().any(|e| e.contains("prefill")),
        "the refusal never reaches the caller"
    );
    assert_eq!(
        (
            b.mock.stats().by_outcome.get("prefill_rejected").copied(),
            c.requests(),
            d.requests()
        ),
        (Some(1), 1, 1)
    );
}

#[tokio::test]
async fn with_resumes_off_or_nowhere_to_go_a_broken_stream_ends_with_the_error_event() {
    for (retry, second) in [(", stream_resumes: 0", true), ("", false)] {
        let a = mock("a", Prefill::Ignore).await;
        let b = mock("b", Prefill::Continue).await;
        a.fault(json!({"kind": "break", "after_tokens": 2}));
        let mut ups = vec![("a", "none", "", &a)];
        if second {
            ups.push(("b", "vllm", "", &b));
        }
        let gw = pools(&ups, retry).await;
        assert_interrupted(&stream(&gw).await, 2, retry);
        assert_eq!(b.requests(), 0, "{retry}");
        if !second {
            assert_eq!(resumes(&gw, "none", "unavailable").await, 1.0);
        }
    }
}

/// A continuation that breaks in turn is continued again while `stream_resumes`
/// allows: the caller's text then holds two upstreams' parts, and the third continues
/// after both. With one resume, the second break ends the stream.
#[tokio::test]
async fn a_continuation_that_breaks_too_is_continued_while_resumes_allow() {
    let expected = content(&unbroken().await);
    for (retry, whole) in [(", stream_resumes: 2", true), ("", false)] {
        let a = mock("a", Prefill::Ignore).await;
        let b = mock("b", Prefill::Continue).await;
        let c = mock("c", Prefill::Continue).await;
        a.fault(json!({"kind": "break", "after_tokens": 2}));
        b.fault(json!({"kind": "break", "after_tokens": 2}));
        let gw = pools(
            &[
                ("a", "none", "", &a),
                ("b", "vllm", "", &b),
                ("c", "vllm", "", &c),
            ],
            retry,
        )
        .await;
        let ev = stream(&gw).await;
        if whole {
            assert_whole(&ev, &expected, retry);
            assert_eq!(resumes(&gw, "prefill", "spliced").await, 2.0);
        } else {
            assert_interrupted(&ev, 4, retry);
            assert_eq!(c.requests(), 0);
        }
    }
}

/// A streamed completion of `max_tokens` 6 with usage: its events.
async fn stream_completion(gw: &Setup) -> Vec<String> {
    let body = json!({"model": "qwen-72b", "stream": true, "max_tokens": 6,
                      "stream_options": {"include_usage": true},
                      "prompt": "Once upon a time"});
    let r = gw
        .http
        .post(format!("{}/v1/completions", gw.base))
        .bearer_auth("acme-key")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    events(&r.text().await.unwrap())
}

/// The text of a completions stream.
fn completion_text(ev: &[String]) -> String {
    chunks(ev)
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str().map(str::to_owned))
        .collect()
}

/// A completions stream is continued as a chat is: with the partial answer appended to
/// the prompt where the pool takes a prefill, regenerated and spliced where it does
/// not; either way one whole stream with one id, the unbroken stream's text and usage.
#[tokio::test]
async fn a_broken_completions_stream_is_continued_too() {
    let a = mock("a", Prefill::Ignore).await;
    let expected = stream_completion(&pools(&[("a", "none", "", &a)], "").await).await;
    let text = completion_text(&expected);
    assert_eq!(text.split_whitespace().count(), 6, "{expected:#?}");
    for (prefill, how) in [("assistant", "prefill"), ("none", "regenerate")] {
        let a = mock("a", Prefill::Ignore).await;
        let b = mock("b", Prefill::Continue).await;
        a.fault(json!({"kind": "break", "after_tokens": 2}));
        let gw = pools(&[("a", "none", "", &a), ("b", prefill, "", &b)], "").await;
        let ev = stream_completion(&gw).await;
        assert_eq!(completion_text(&ev), text, "{how}: {ev:#?}");
        assert_eq!(ev.last().map(String::as_str), Some("[DONE]"), "{how}");
        assert_one_id(&chunks(&ev), how);
        assert_eq!(usage(&ev), usage(&expected), "{how}");
        assert_eq!(resumes(&gw, how, "spliced").await, 1.0, "{how}");
        assert_eq!(b.requests(), 1, "{how}");
    }
}
