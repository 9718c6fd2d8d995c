//! The OpenAI-compatible routes: deterministic answers, and the faults acting on them.

use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::{Fault, Mock, Prefill};

/// Fixed, so answers are reproducible.
const CREATED: u64 = 1_796_000_000;
const WORDS: [&str; 16] = [
    "the", "quick", "model", "answers", "every", "question", "with", "calm", "and", "steady",
    "tokens", "while", "stanch", "keeps", "traffic", "flowing",
];
/// A request that never gets an answer still ends, eventually.
const NEVER: Duration = Duration::from_secs(600);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

/// The short name of a route, for stats.
pub(crate) fn route_name(path: &str) -> &'static str {
    match path {
        "/v1/chat/completions" => "chat",
        "/v1/completions" => "completions",
        "/v1/embeddings" => "embeddings",
        "/v1/models" => "models",
        _ => "other",
    }
}

fn error(status: StatusCode, kind: &str, code: Option<&str>, message: &str) -> Response {
    let body = json!({"error": {"message": message, "type": kind, "param": null, "code": code}});
    (status, axum::Json(body)).into_response()
}

/// The headers every answer carries, as OpenAI's and vLLM's do: the instance, an
/// `x-request-id` (the caller's, as vLLM echoes it, else a new `req_…` as OpenAI makes),
/// `openai-processing-ms` and the `x-ratelimit-*` family. Remembers the request's
/// headers for tests ([`Mock::last_request_headers`]).
fn with_instance(mock: &Mock, request: &HeaderMap, mut response: Response) -> Response {
    let n = mock.remember_headers(request);
    let h = response.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&mock.config.instance) {
        h.insert("x-mock-instance", v);
    }
    let id = request
        .get("x-request-id")
        .cloned()
        .unwrap_or_else(|| HeaderValue::from_str(&format!("req_{n:016x}")).expect("hex"));
    h.insert("x-request-id", id);
    h.insert("openai-processing-ms", HeaderValue::from_static("7"));
    h.insert(
        "x-ratelimit-limit-requests",
        HeaderValue::from_static("10000"),
    );
    h.insert(
        "x-ratelimit-remaining-requests",
        HeaderValue::from_static("9999"),
    );
    h.insert(
        "x-ratelimit-reset-requests",
        HeaderValue::from_static("6ms"),
    );
    response
}

/// Checks the API key and takes the fault; answers at once when the request ends here.
fn admit(mock: &Mock, headers: &HeaderMap, route: &str) -> Result<Fault, Box<Response>> {
    let probe = headers.contains_key(stanch_api::headers::PROBE);
    if let Some(key) = &mock.config.api_key {
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        if given != Some(format!("Bearer {key}").as_str()) {
            mock.take_fault(route, probe);
            mock.outcome("unauthorized");
            return Err(Box::new(error(
                StatusCode::UNAUTHORIZED,
                "invalid_request_error",
                Some("invalid_api_key"),
                "Incorrect API key provided",
            )));
        }
    }
    Ok(mock.take_fault(route, probe))
}

fn status_fault(
    mock: &Mock,
    status: u16,
    retry_after: Option<u64>,
    code: Option<&str>,
    local: bool,
) -> Response {
    mock.outcome("fault:status");
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let kind = match status.as_u16() {
        429 => "rate_limit_error",
        402 => "insufficient_quota",
        400..=499 => "invalid_request_error",
        _ => "server_error",
    };
    let mut response = error(status, kind, code, &format!("injected fault: {status}"));
    if let Some(secs) = retry_after {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    if local {
        response.headers_mut().insert(
            stanch_api::headers::RATE_LIMITED,
            HeaderValue::from_static("true"),
        );
    }
    response
}

/// The words of a request's prompt, to size it against the context window.
fn prompt_words(kind: Kind, body: &Value) -> usize {
    let count = |v: &Value| v.as_str().map_or(0, |s| s.split_whitespace().count());
    match kind {
        Kind::Chat => body["messages"]
            .as_array()
            .map_or(0, |ms| ms.iter().map(|m| count(&m["content"])).sum()),
        Kind::Completion => match &body["prompt"] {
            Value::Array(parts) => parts.iter().map(count).sum(),
            other => count(other),
        },
    }
}

/// The answer's words: deterministic in the prompt.
fn answer(body: &Value, n: usize) -> Vec<&'static str> {
    let seed = stanch_api::hash::fnv64(body.to_string().as_bytes()) as usize;
    (0..n).map(|i| WORDS[(seed + i) % WORDS.len()]).collect()
}

/// How many words a request may be answered with.
fn max_tokens(body: &Value) -> usize {
    body["max_tokens"]
        .as_u64()
        .or_else(|| body["max_completion_tokens"].as_u64())
        .unwrap_or(16)
        .clamp(1, 512) as usize
}

/// The most of a prompt's end searched for a partial answer.
const MAX_PREFILL_BYTES: usize = 4096;

/// The request a prefilled one continues, and how many words of that request's answer
/// the prefill holds (more than none): a chat whose last message is the assistant's
/// partial answer, or a prompt that ends with the start of the answer to the prompt
/// before it, as streamed.
fn continues(kind: Kind, body: &Value) -> Option<(Value, usize)> {
    // The request as first sent: its `max_tokens` counted the partial answer too.
    let before = |mut original: Value, words: usize| {
        let o = original.as_object_mut()?;
        for key in ["max_tokens", "max_completion_tokens"] {
            if let Some(n) = o.get(key).and_then(Value::as_u64) {
                o.insert(key.into(), Value::from(n + words as u64));
            }
        }
        Some(original)
    };
    match kind {
        Kind::Chat => {
            let words = prefill(body).filter(|w| *w > 0)?;
            let mut original = body.clone();
            original["messages"].as_array_mut()?.pop();
            let o = original.as_object_mut()?;
            o.remove("continue_final_message");
            o.remove("add_generation_prompt");
            Some((before(original, words)?, words))
        }
        Kind::Completion => {
            let prompt = body["prompt"].as_str()?;
            let from = prompt.len().saturating_sub(MAX_PREFILL_BYTES);
            // A partial answer begins with one of the mock's words: only there is the
            // request before it worth rebuilding.
            (from..prompt.len())
                .filter(|at| prompt.is_char_boundary(*at))
                .filter(|at| WORDS.iter().any(|w| prompt[*at..].starts_with(w)))
                .find_map(|at| {
                    let partial = &prompt[at..];
                    let words = partial.split_whitespace().count();
                    if words == 0 {
                        return None;
                    }
                    let mut original = body.clone();
                    original["prompt"] = Value::String(prompt[..at].to_owned());
                    let original = before(original, words)?;
                    let answer = answer(&original, max_tokens(&original));
                    // Streamed, every word but the answer's last is followed by a space.
                    let streamed: String = answer
                        .get(..words)?
                        .iter()
                        .map(|w| format!("{w} "))
                        .collect();
                    (words < answer.len() && partial == streamed).then_some((original, words))
                })
        }
    }
}

/// The words of a trailing assistant message (a partial answer), if there is one.
fn prefill(body: &Value) -> Option<usize> {
    let last = body["messages"].as_array()?.last()?;
    (last["role"] == "assistant").then(|| {
        last["content"]
            .as_str()
            .map_or(0, |c| c.split_whitespace().count())
    })
}

/// `POST /v1/chat/completions`
pub(crate) async fn chat(State(mock): State<Mock>, headers: HeaderMap, body: Bytes) -> Response {
    let response = generate(&mock, &headers, &body, Kind::Chat).await;
    with_instance(&mock, &headers, response)
}

/// `POST /v1/completions`
pub(crate) async fn completions(
    State(mock): State<Mock>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let response = generate(&mock, &headers, &body, Kind::Completion).await;
    with_instance(&mock, &headers, response)
}

// Size: one arm per fault the mock can play, as docs/gateway.md lists them.
async fn generate(mock: &Mock, headers: &HeaderMap, raw: &[u8], kind: Kind) -> Response {
    let route = if kind == Kind::Chat {
        "chat"
    } else {
        "completions"
    };
    let fault = match admit(mock, headers, route) {
        Ok(f) => f,
        Err(r) => return *r,
    };
    let body: Value = match serde_json::from_slice(raw) {
        Ok(v @ Value::Object(_)) => v,
        _ => {
            mock.outcome("bad_request");
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                None,
                "body must be a JSON object",
            );
        }
    };
    if prompt_words(kind, &body) > mock.config.max_context_words {
        mock.outcome("context_length_exceeded");
        let message = format!(
            "This model's maximum context length is {} tokens",
            mock.config.max_context_words
        );
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Some("context_length_exceeded"),
            &message,
        );
    }
    match &fault {
        Fault::Status {
            status,
            retry_after,
            code,
            local,
        } => return status_fault(mock, *status, *retry_after, code.as_deref(), *local),
        Fault::Latency { ms } => tokio::time::sleep(Duration::from_millis(*ms)).await,
        Fault::NoResponse => {
            mock.outcome("fault:no_response");
            tokio::time::sleep(NEVER).await;
            return StatusCode::GATEWAY_TIMEOUT.into_response();
        }
        _ => {}
    }
    if kind == Kind::Chat && mock.config.prefill == Prefill::Reject && prefill(&body).is_some() {
        mock.outcome("prefill_rejected");
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            None,
            "this model does not support assistant message prefill",
        );
    }
    let (original, prefilled) = match mock.config.prefill {
        Prefill::Continue => continues(kind, &body).unwrap_or_else(|| (body.clone(), 0)),
        Prefill::Ignore | Prefill::Reject => (body.clone(), 0),
    };
    let n = max_tokens(&original);
    let mut words = answer(&original, n);
    words.drain(..prefilled.min(words.len()));
    let stream = body["stream"].as_bool().unwrap_or(false);
    // The prompt as first sent and the partial answer after it, counted apart: joined
    // into one prompt, a word of each may run together.
    let prompt_tokens = prompt_words(kind, &original) + prefilled;
    if !stream {
        return whole(mock, kind, fault, &words, prompt_tokens).await;
    }
    // As OpenAI and vLLM do with `stream_options: {include_usage: true}`: every chunk
    // carries `"usage": null`, and a last chunk with no choices carries the usage.
    let usage = (body["stream_options"]["include_usage"] == Value::Bool(true)).then(|| {
        json!({"prompt_tokens": prompt_tokens, "completion_tokens": words.len(),
               "total_tokens": prompt_tokens + words.len()})
    });
    streamed(mock, kind, fault, words, usage)
}

async fn whole(
    mock: &Mock,
    kind: Kind,
    fault: Fault,
    words: &[&str],
    prompt_tokens: usize,
) -> Response {
    match fault {
        Fault::SlowFirstToken { ms } => tokio::time::sleep(Duration::from_millis(ms)).await,
        Fault::Stall { .. } => {
            // Headers, then a body that never comes.
            mock.outcome("fault:stall");
            let never = futures_util::stream::pending::<Result<Bytes, std::io::Error>>();
            let mut response = Response::new(Body::from_stream(never));
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            return response;
        }
        _ => {}
    }
    mock.outcome("ok");
    let text = words.join(" ");
    let usage = json!({"prompt_tokens": prompt_tokens, "completion_tokens": words.len(), "total_tokens": prompt_tokens + words.len()});
    let model = &mock.config.model;
    let body = match kind {
        Kind::Chat => json!({
            "id": format!("chatcmpl-{}", mock.config.instance), "object": "chat.completion", "created": CREATED, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": usage,
        }),
        Kind::Completion => json!({
            "id": format!("cmpl-{}", mock.config.instance), "object": "text_completion", "created": CREATED, "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": "stop", "logprobs": null}],
            "usage": usage,
        }),
    };
    axum::Json(body).into_response()
}

fn chunk(
    mock: &Mock,
    kind: Kind,
    content: Option<&str>,
    finish: Option<&str>,
    first: bool,
    with_usage: bool,
) -> Bytes {
    let model = &mock.config.model;
    let mut value = match kind {
        Kind::Chat => {
            let delta = match (content, first) {
                (Some(c), true) => json!({"role": "assistant", "content": c}),
                (Some(c), false) => json!({"content": c}),
                (None, _) => json!({}),
            };
            json!({"id": format!("chatcmpl-{}", mock.config.instance), "object": "chat.completion.chunk", "created": CREATED, "model": model,
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
        }
        Kind::Completion => {
            json!({"id": format!("cmpl-{}", mock.config.instance), "object": "text_completion", "created": CREATED, "model": model,
                   "choices": [{"index": 0, "text": content.unwrap_or(""), "finish_reason": finish, "logprobs": null}]})
        }
    };
    if with_usage {
        value["usage"] = Value::Null;
    }
    Bytes::from(format!("data: {value}\n\n"))
}

/// The last chunk of a stream that asked for usage: no choices, the usage.
fn usage_chunk(mock: &Mock, kind: Kind, usage: &Value) -> Bytes {
    let (id, object) = match kind {
        Kind::Chat => (
            format!("chatcmpl-{}", mock.config.instance),
            "chat.completion.chunk",
        ),
        Kind::Completion => (format!("cmpl-{}", mock.config.instance), "text_completion"),
    };
    let value = json!({"id": id, "object": object, "created": CREATED,
                       "model": mock.config.model, "choices": [], "usage": usage});
    Bytes::from(format!("data: {value}\n\n"))
}

/// Decrements the running gauge when the stream ends, however it ends.
struct Running(Mock);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.running(-1);
    }
}

// Size: one arm per fault the mock can play mid-stream, as docs/gateway.md lists them.
fn streamed(
    mock: &Mock,
    kind: Kind,
    fault: Fault,
    words: Vec<&'static str>,
    usage: Option<Value>,
) -> Response {
    let outcome = match &fault {
        Fault::Cut { .. } => "fault:cut",
        Fault::Break { .. } => "fault:break",
        Fault::Stall { .. } => "fault:stall",
        Fault::MalformedChunk { .. } => "fault:malformed_chunk",
        Fault::MissingDone => "fault:missing_done",
        Fault::SlowFirstToken { .. } => "fault:slow_first_token",
        _ => "ok",
    };
    mock.outcome(outcome);
    mock.running(1);
    let interval = mock.config.token_interval;
    let state = (
        0usize,
        Running(mock.clone()),
        fault,
        words,
        kind,
        false,
        usage,
    );
    let body = futures_util::stream::unfold(
        state,
        move |(i, running, fault, words, kind, done, usage)| async move {
            if done {
                return None;
            }
            let mock = &running.0;
            let n = words.len();
            match &fault {
                Fault::SlowFirstToken { ms } if i == 0 => {
                    tokio::time::sleep(Duration::from_millis(*ms)).await
                }
                Fault::Cut { after_tokens } if i == *after_tokens && i < n => return None,
                Fault::Break { after_tokens } if i == *after_tokens && i < n => {
                    // What came before goes out first, as from a server that dies
                    // mid-answer; then an error from the body aborts the response
                    // (no end chunk).
                    tokio::time::sleep(interval.max(Duration::from_millis(20))).await;
                    let broken = std::io::Error::other("the mock breaks the connection");
                    return Some((Err(broken), (i, running, fault, words, kind, true, usage)));
                }
                Fault::Stall { after_tokens } if i == *after_tokens && i < n => {
                    tokio::time::sleep(NEVER).await;
                    return None;
                }
                _ if i > 0 && !interval.is_zero() && i < n => tokio::time::sleep(interval).await,
                _ => {}
            }
            let mut out = Vec::new();
            if matches!(&fault, Fault::MalformedChunk { at_token } if *at_token == i) {
                out.extend_from_slice(
                    b"data: {\"id\": \"chatcmpl-mock\", \"choices\": [{\"delta\n\n",
                );
            }
            let finished = i >= n;
            if finished {
                out.extend_from_slice(&chunk(
                    mock,
                    kind,
                    None,
                    Some("stop"),
                    false,
                    usage.is_some(),
                ));
                if let Some(usage) = &usage {
                    out.extend_from_slice(&usage_chunk(mock, kind, usage));
                }
                if fault != Fault::MissingDone {
                    out.extend_from_slice(b"data: [DONE]\n\n");
                }
            } else {
                let word = if i + 1 < n {
                    format!("{} ", words[i])
                } else {
                    words[i].to_owned()
                };
                out.extend_from_slice(&chunk(
                    mock,
                    kind,
                    Some(&word),
                    None,
                    i == 0,
                    usage.is_some(),
                ));
            }
            Some((
                Ok::<Bytes, std::io::Error>(Bytes::from(out)),
                (i + 1, running, fault, words, kind, finished, usage),
            ))
        },
    );
    let mut response = Response::new(Body::from_stream(body));
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

/// `POST /v1/embeddings`
pub(crate) async fn embeddings(
    State(mock): State<Mock>,
    headers: HeaderMap,
    raw: Bytes,
) -> Response {
    let fault = match admit(&mock, &headers, "embeddings") {
        Ok(f) => f,
        Err(r) => return with_instance(&mock, &headers, *r),
    };
    match &fault {
        Fault::Status {
            status,
            retry_after,
            code,
            local,
        } => {
            return with_instance(
                &mock,
                &headers,
                status_fault(&mock, *status, *retry_after, code.as_deref(), *local),
            );
        }
        Fault::Latency { ms } | Fault::SlowFirstToken { ms } => {
            tokio::time::sleep(Duration::from_millis(*ms)).await
        }
        Fault::NoResponse | Fault::Stall { .. } => {
            tokio::time::sleep(NEVER).await;
            return StatusCode::GATEWAY_TIMEOUT.into_response();
        }
        _ => {}
    }
    let body: Value = match serde_json::from_slice(&raw) {
        Ok(v @ Value::Object(_)) => v,
        _ => {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                None,
                "body must be a JSON object",
            );
        }
    };
    let inputs: Vec<String> = match &body["input"] {
        Value::String(s) => vec![s.clone()],
        Value::Array(items) => items
            .iter()
            .map(|v| v.as_str().map_or_else(|| v.to_string(), str::to_owned))
            .collect(),
        _ => {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                None,
                "input: expected a string or an array",
            );
        }
    };
    mock.outcome("ok");
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(i, text)| {
            let h = stanch_api::hash::fnv64(text.as_bytes());
            let v: Vec<f64> = (0..8)
                .map(|k| (((h >> (k * 8)) & 0xff) as f64 / 255.0) * 2.0 - 1.0)
                .collect();
            json!({"object": "embedding", "index": i, "embedding": v})
        })
        .collect();
    let tokens: usize = inputs.iter().map(|s| s.split_whitespace().count()).sum();
    let body = json!({"object": "list", "data": data, "model": mock.config.model,
                      "usage": {"prompt_tokens": tokens, "total_tokens": tokens}});
    with_instance(&mock, &headers, axum::Json(body).into_response())
}

/// `GET /v1/models`
pub(crate) async fn models(State(mock): State<Mock>, headers: HeaderMap) -> Response {
    let body = json!({"object": "list", "data": [{"id": mock.config.model, "object": "model", "created": CREATED, "owned_by": "stanch-mock"}]});
    with_instance(&mock, &headers, axum::Json(body).into_response())
}
