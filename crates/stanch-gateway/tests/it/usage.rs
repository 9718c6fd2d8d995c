//! Streaming usage: with `stream_options: {include_usage: true}`, OpenAI and vLLM end a
//! stream with a chunk that has no choices and the usage, and every chunk before it
//! has `"usage": null`. The gateway passes it on, and its own (FAQ) answers have the
//! same shape.

use serde_json::{Value, json};
use stanch_api::Rung;

use crate::support::*;

fn config() -> String {
    format!(
        "models:\n  qwen-72b:\n    faq: default\n    pools:\n      - name: dc-a\n        endpoints: [{{url: '{{a}}'}}]\n{POLICY}"
    )
}

async fn stream(gw: &Setup, include_usage: bool) -> Vec<Value> {
    let mut body = json!({"model": "qwen-72b", "stream": true, "max_tokens": 5,
                          "messages": [{"role": "user", "content": "how do I reset my password"}]});
    if include_usage {
        body["stream_options"] = json!({"include_usage": true});
    }
    let r = gw.chat_body(&body, "acme-key").await;
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    events(&text)
        .iter()
        .filter(|e| e.as_str() != "[DONE]")
        .map(|e| serde_json::from_str(e).unwrap_or_else(|err| panic!("{err}: {e}")))
        .collect()
}

/// Checks the usage shape; returns the usage.
fn usage_of(chunks: &[Value]) -> Value {
    let (last, rest) = chunks.split_last().unwrap();
    assert_eq!(
        last["choices"],
        json!([]),
        "the last chunk has no choices: {last}"
    );
    for c in rest {
        assert!(
            c["usage"].is_null() && c.get("usage").is_some(),
            "usage: null before: {c}"
        );
        assert_eq!(c["choices"].as_array().unwrap().len(), 1);
    }
    assert!(
        rest.iter()
            .any(|c| c["choices"][0]["finish_reason"] == "stop")
    );
    last["usage"].clone()
}

#[tokio::test]
async fn the_usage_chunk_reaches_the_caller() {
    let a = Upstream::start("qwen-72b", "a").await;
    let gw = gateway(&config(), &[("a", &a)]).await;
    let chunks = stream(&gw, true).await;
    let usage = usage_of(&chunks);
    assert_eq!(usage["completion_tokens"], 5, "{usage}");
    assert_eq!(
        usage["total_tokens"].as_u64().unwrap(),
        usage["prompt_tokens"].as_u64().unwrap() + 5
    );
    // Not asked for: no usage chunk, and no usage fields.
    let chunks = stream(&gw, false).await;
    assert!(
        chunks
            .iter()
            .all(|c| c.get("usage").is_none() && c["choices"].as_array().unwrap().len() == 1)
    );
}

#[tokio::test]
async fn faq_answers_have_the_same_shape() {
    let a = Upstream::start("qwen-72b", "a").await;
    let mut gw = gateway(&config(), &[("a", &a)]).await;
    gw.table(&[("qwen-72b", Rung::Static, "dc-a", None)], vec![]);
    let chunks = stream(&gw, true).await;
    assert!(
        chunks[0]["model"]
            .as_str()
            .unwrap()
            .starts_with("stanch-faq/"),
        "{}",
        chunks[0]
    );
    let usage = usage_of(&chunks);
    assert_eq!(
        usage,
        json!({"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0})
    );
    assert_eq!(a.requests(), 0, "answered by the gateway");
}
