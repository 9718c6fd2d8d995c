//! Respond: every answer the gateway gives, with the headers, counts and access line
//! each carries: an upstream's answer as it came (with the route version, the
//! attempts it took, the request id), a refusal, a static answer from the FAQ, and
//! the `503` when nothing could answer.

use axum::body::Body;
use axum::http::{HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use stanch_api::headers::{DEGRADED, ROUTE_VERSION};
use tracing::info;

use crate::Gateway;
use crate::endpoints::Endpoint;
use crate::headers::REQUEST_ID;
use crate::metrics::{KindLabel, Label, ModelLabel, RequestLabels};
use crate::request::{Api, Ctx, Refusal};

/// Header names, parsed once: a `&str` name is parsed again on every insert.
static ROUTE_VERSION_HEADER: HeaderName = HeaderName::from_static(ROUTE_VERSION);
static DEGRADED_HEADER: HeaderName = HeaderName::from_static(DEGRADED);
static ATTEMPTS_HEADER: HeaderName = HeaderName::from_static("x-stanch-attempts");

/// A gateway-made error in OpenAI's shape.
pub(crate) fn openai_error(status: StatusCode, kind: &str, code: &str, message: &str) -> Response {
    let body = serde_json::json!({"error": {"message": message, "type": kind, "param": null, "code": code}});
    (status, axum::Json(body)).into_response()
}

/// The answer when every target failed (and the FAQ cannot answer: embeddings).
pub(crate) fn exhausted(ctx: &Ctx<'_>) -> Response {
    let mut response = openai_error(
        StatusCode::SERVICE_UNAVAILABLE,
        "server_error",
        "upstreams_unavailable",
        "every upstream failed; retry later",
    );
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    finish(ctx, response, None, "exhausted")
}

/// The answer to a request refused before routing.
pub(crate) fn refused(gw: &Gateway, r: &Refusal, request_id: HeaderValue) -> Response {
    gw.metrics
        .rejected
        .get_or_create(&KindLabel { kind: r.code() })
        .inc();
    info!(target: "access", outcome = r.code(), status = r.status().as_u16(), request_id = access_id(&request_id), "request rejected");
    let mut response = openai_error(
        r.status(),
        "invalid_request_error",
        r.code(),
        &r.to_string(),
    );
    response
        .headers_mut()
        .insert(REQUEST_ID.clone(), request_id);
    if r.status() == StatusCode::METHOD_NOT_ALLOWED {
        response
            .headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("POST"));
    }
    if let Some(seconds) = r.retry_after() {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
    }
    if r.closes() {
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    // Answered before routing, but still say which table was in force.
    with_route_version(gw, &mut response);
    response
}

/// Adds `X-Stanch-Route-Version` for the table applied now.
pub(crate) fn with_route_version(gw: &Gateway, response: &mut Response) {
    let version = gw.table().map_or(0, |t| t.version);
    response
        .headers_mut()
        .insert(&ROUTE_VERSION_HEADER, version_value(version));
}

/// `X-Stanch-Route-Version: <version>`, written once per version on each thread:
/// every answer carries it, and the version changes rarely.
fn version_value(version: u64) -> HeaderValue {
    std::thread_local! {
        static LAST: std::cell::RefCell<Option<(u64, HeaderValue)>> =
            const { std::cell::RefCell::new(None) };
    }
    LAST.with_borrow_mut(|last| match last {
        Some((v, value)) if *v == version => value.clone(),
        _ => last.insert((version, HeaderValue::from(version))).1.clone(),
    })
}

/// `X-Stanch-Attempts`'s value; the common counts without formatting or allocating.
fn attempts_value(attempts: u32) -> HeaderValue {
    const SMALL: [HeaderValue; 5] = [
        HeaderValue::from_static("0"),
        HeaderValue::from_static("1"),
        HeaderValue::from_static("2"),
        HeaderValue::from_static("3"),
        HeaderValue::from_static("4"),
    ];
    match SMALL.get(attempts as usize) {
        Some(v) => v.clone(),
        None => HeaderValue::from(attempts),
    }
}

/// Adds the gateway's headers, counts, and logs.
pub(crate) fn finish(
    ctx: &Ctx<'_>,
    mut response: Response,
    endpoint: Option<&Endpoint>,
    outcome: &'static str,
) -> Response {
    let h = response.headers_mut();
    h.insert(&ROUTE_VERSION_HEADER, version_value(ctx.version));
    h.insert(&ATTEMPTS_HEADER, attempts_value(ctx.attempts));
    if !h.contains_key(&REQUEST_ID) {
        h.insert(REQUEST_ID.clone(), ctx.forward.request_id.clone());
    }
    if ctx.degraded {
        h.insert(&DEGRADED_HEADER, HeaderValue::from_static("true"));
    }
    let status = response.status();
    let status_class = match status.as_u16() {
        200..=299 => "2xx",
        400..=499 => "4xx",
        _ => "5xx",
    };
    let hot = endpoint
        .filter(|e| outcome == "success" && status_class == "2xx" && e.model == ctx.model)
        .and_then(|e| e.hot.get());
    match hot {
        Some(hot) => hot.requests_ok.inc(),
        None => {
            let labels = RequestLabels {
                model: Label::from(ctx.model),
                served_model: crate::metrics::Label::from(
                    endpoint.map_or_else(|| "none".to_owned(), |e| e.model.clone()),
                ),
                pool: crate::metrics::Label::from(
                    endpoint.map_or_else(String::new, |e| e.pool.clone()),
                ),
                endpoint: crate::metrics::Label::from(
                    endpoint.map_or_else(String::new, |e| e.url.clone()),
                ),
                status_class,
                outcome,
            };
            ctx.gw.metrics.requests.get_or_create(&labels).inc()
        }
    };
    if !ctx.stream
        && let Some((latency, _)) = ctx.gw.model_histograms.get(ctx.model)
    {
        latency.observe(ctx.started.elapsed().as_secs_f64());
    }
    info!(
        target: "access",
        model = ctx.requested.as_str(),
        tenant = ctx.tenant_name(),
        served = endpoint.map_or("none", |e| e.model.as_str()),
        endpoint = endpoint.map_or("", |e| e.url.as_str()),
        attempts = ctx.attempts,
        outcome,
        status = status.as_u16(),
        version = ctx.version,
        degraded = ctx.degraded,
        ms = ctx.started.elapsed().as_millis() as u64,
        request_id = access_id(&ctx.forward.request_id),
        "request"
    );
    response
}

/// A request id as the access log writes it: as text (ids are visible ASCII: the
/// caller's is checked, a new one is hex).
pub(crate) fn access_id(id: &HeaderValue) -> &str {
    id.to_str().unwrap_or("-")
}

/// The caller's question: the last user message, or the prompt.
fn question(body: &Value) -> String {
    if let Some(messages) = body["messages"].as_array() {
        let text = |c: &Value| match c {
            Value::String(s) => s.clone(),
            Value::Array(parts) => parts
                .iter()
                .filter_map(|p| p["text"].as_str())
                .collect::<Vec<_>>()
                .join(" "),
            _ => String::new(),
        };
        return messages
            .iter()
            .rev()
            .find(|m| m["role"] == "user")
            .map(|m| text(&m["content"]))
            .unwrap_or_default();
    }
    match &body["prompt"] {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(Value::as_str)
            .collect::<Vec<_>>()
            .join(" "),
        _ => String::new(),
    }
}

/// A static answer, OpenAI-shaped, always 200.
pub(crate) fn faq(ctx: &Ctx<'_>, set: Option<&str>, outcome: &'static str) -> Response {
    let gw = &ctx.gw;
    gw.metrics
        .static_answers
        .get_or_create(&ModelLabel {
            model: Label::from(ctx.model),
        })
        .inc();
    let set = set
        .filter(|s| gw.faqs.contains_key(*s))
        .or_else(|| {
            gw.config
                .models
                .get(ctx.model)
                .and_then(|m| m.faq.as_deref())
        })
        .or_else(|| gw.faqs.keys().next().map(String::as_str));
    let request: Value = serde_json::from_slice(&ctx.raw).unwrap_or_default();
    let answer = set.and_then(|s| gw.faqs.get(s)).map_or(
        "The service is busy right now. Please try again in a few minutes.",
        |f| f.answer(&question(&request)).answer,
    );
    let model = format!("stanch-faq/{}", set.unwrap_or("none"));
    let mut response = if ctx.stream {
        let with_usage = request["stream_options"]["include_usage"] == Value::Bool(true);
        streamed_faq(ctx.api, &model, answer, with_usage)
    } else {
        axum::Json(whole_faq(ctx.api, &model, answer)).into_response()
    };
    response
        .headers_mut()
        .insert(&DEGRADED_HEADER, HeaderValue::from_static("static"));
    finish(ctx, response, None, outcome)
}

/// Answered here, so no tokens were spent.
fn no_usage() -> Value {
    json!({"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0})
}

/// A static answer as a whole completion of `api`'s shape.
fn whole_faq(api: Api, model: &str, answer: &str) -> Value {
    match api {
        Api::Chat => {
            json!({"id": "stanch-faq", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}],
            "usage": no_usage()})
        }
        _ => json!({"id": "stanch-faq", "object": "text_completion", "created": 0, "model": model,
            "choices": [{"index": 0, "text": answer, "finish_reason": "stop"}], "usage": no_usage()}),
    }
}

/// A static answer as a stream of `api`'s shape: the answer in one chunk, the final
/// chunk, OpenAI's usage chunk when `with_usage` (`stream_options.include_usage`),
/// then `[DONE]`.
fn streamed_faq(api: Api, model: &str, answer: &str, with_usage: bool) -> Response {
    let object = match api {
        Api::Chat => "chat.completion.chunk",
        _ => "text_completion",
    };
    let chunk = |content: Option<&str>, finish: Value| {
        let choice = match api {
            Api::Chat => {
                let delta =
                    content.map_or(json!({}), |c| json!({"role": "assistant", "content": c}));
                json!({"index": 0, "delta": delta, "finish_reason": finish})
            }
            _ => json!({"index": 0, "text": content.unwrap_or(""), "finish_reason": finish}),
        };
        let mut c = json!({"id": "stanch-faq", "object": object, "created": 0, "model": model, "choices": [choice]});
        if with_usage {
            c["usage"] = Value::Null;
        }
        c
    };
    let mut text = format!(
        "data: {}\n\ndata: {}\n\n",
        chunk(Some(answer), Value::Null),
        chunk(None, json!("stop"))
    );
    if with_usage {
        let last = json!({"id": "stanch-faq", "object": object, "created": 0, "model": model,
                          "choices": [], "usage": no_usage()});
        text.push_str(&format!("data: {last}\n\n"));
    }
    text.push_str("data: [DONE]\n\n");
    let mut r = Response::new(Body::from(text));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    r
}

#[cfg(test)]
mod tests {
    use super::version_value;

    #[test]
    fn the_route_version_header_follows_the_version() {
        assert_eq!(version_value(7), "7");
        assert_eq!(version_value(7), "7", "the kept one");
        assert_eq!(version_value(8), "8", "a new version");
        assert_eq!(version_value(7), "7", "and back");
        assert_eq!(version_value(u64::MAX), u64::MAX.to_string().as_str());
    }
}
