//! Resume: a stream that broke after its first token, continued elsewhere and spliced
//! into the caller's stream as if nothing had happened, or not at all.
//!
//! While a stream may be continued, the [`Transcript`] keeps what the caller has: the
//! stream's `id`, the text so far, and whether that text is all there is (one choice,
//! no tool calls, no reasoning): only such an answer can be continued. A continuation
//! is either
//! - **prefilled**: the request again with the partial answer as a trailing assistant
//!   message (or, for `/v1/completions`, appended to the prompt), sent only to a pool
//!   that declares it takes one; the continuation's text follows the caller's as it
//!   comes, or
//! - **regenerated**: the request again as the caller sent it. Its text must begin with
//!   exactly what the caller has: that much is swallowed, and only what follows is
//!   spliced in; the first difference ends the stream with the error event, as if no
//!   continuation had been tried.
//!
//! Either way the [`Splice`] rewrites the continuation's chunks into the caller's
//! stream: the first stream's `id`, no second `role`, and, for a prefill, usage that
//! counts the caller's partial answer as completion rather than prompt.

use std::borrow::Cow;

use bytes::Bytes;
use serde::Deserialize;
use serde::de::IgnoredAny;
use serde_json::Value;

use super::sse::Text;
use crate::config::Prefill;
use crate::request::Api;

/// What the caller has of a stream's answer.
#[derive(Debug)]
pub(crate) struct Transcript {
    /// The stream's `id`, from its first chunk, as its JSON string's body.
    id: Option<String>,
    /// The answer's text so far, as the bodies of the JSON strings that carried it,
    /// escapes not decoded (each a whole string's, so together they decode as one):
    /// kept as it comes, and decoded only if the stream breaks.
    escaped: String,
    /// Chunks with text so far: its tokens, as vLLM and OpenAI stream one per chunk.
    tokens: u32,
    /// The text is the whole answer so far, and within `limit`: it can be continued.
    plain: bool,
    /// The most text kept.
    limit: usize,
}

/// A chunk, as a continuation's splice reads it.
#[derive(Deserialize)]
struct ChunkView<'a> {
    #[serde(borrow, default)]
    choices: Vec<ChoiceView<'a>>,
}

#[derive(Deserialize)]
struct ChoiceView<'a> {
    #[serde(default)]
    index: u64,
    #[serde(borrow, default)]
    delta: Option<DeltaView<'a>>,
    /// `/v1/completions` streams text here.
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct DeltaView<'a> {
    #[serde(borrow, default)]
    content: Option<Cow<'a, str>>,
    #[serde(default)]
    tool_calls: Option<IgnoredAny>,
    #[serde(default)]
    function_call: Option<IgnoredAny>,
    #[serde(default)]
    reasoning_content: Option<IgnoredAny>,
    #[serde(default)]
    reasoning: Option<IgnoredAny>,
}

impl ChoiceView<'_> {
    /// Its text, if it carries only text; `Err` when it carries what a continuation
    /// cannot reproduce.
    fn text(&self) -> Result<Option<&str>, ()> {
        if self.index != 0 {
            return Err(());
        }
        if let Some(d) = &self.delta {
            if d.tool_calls.is_some()
                || d.function_call.is_some()
                || d.reasoning_content.is_some()
                || d.reasoning.is_some()
            {
                return Err(());
            }
            if let Some(c) = &d.content {
                return Ok(Some(c));
            }
        }
        Ok(self.text.as_deref())
    }
}

/// The string a JSON string's body (between its quotes, escapes not decoded) stands for.
fn decode(escaped: &str) -> Option<String> {
    serde_json::from_str(&format!("\"{escaped}\"")).ok()
}

impl Transcript {
    /// An empty transcript that keeps at most `limit` bytes of text.
    pub(crate) fn new(limit: usize) -> Transcript {
        Transcript {
            id: None,
            escaped: String::new(),
            tokens: 0,
            plain: true,
            limit,
        }
    }

    /// The answer's text so far; `None` when it cannot be continued.
    pub(crate) fn text(&self) -> Option<String> {
        self.plain.then(|| decode(&self.escaped)).flatten()
    }

    /// The stream's `id`.
    pub(crate) fn id(&self) -> Option<String> {
        self.id.as_deref().and_then(decode)
    }

    /// Its tokens so far (chunks with text).
    pub(crate) fn tokens(&self) -> u32 {
        self.tokens
    }

    /// Notes a chunk the caller got: the event `raw`, and what its check found of its
    /// text.
    pub(crate) fn note(&mut self, raw: &[u8], text: Text) {
        if !self.plain {
            return;
        }
        if !text.plain {
            return self.give_up();
        }
        let piece = |(a, b): (u32, u32)| {
            std::str::from_utf8(&raw[a as usize..b as usize]).expect("a chunk is UTF-8")
        };
        if self.id.is_none() {
            self.id = text.id.map(|id| piece(id).to_owned());
        }
        if let Some(at) = text.at {
            self.push_escaped(piece(at));
        }
    }

    /// Adds text (decoded) that reached the caller another way: a continuation's.
    fn push(&mut self, t: &str) {
        let quoted = serde_json::to_string(t).expect("a string serializes");
        self.push_escaped(&quoted[1..quoted.len() - 1]);
    }

    fn push_escaped(&mut self, piece: &str) {
        if piece.is_empty() {
            return;
        }
        if self.escaped.len() + piece.len() > self.limit {
            return self.give_up();
        }
        self.escaped.push_str(piece);
        self.tokens += 1;
    }

    /// The answer cannot be continued: its text is no longer kept.
    fn give_up(&mut self) {
        self.plain = false;
        self.escaped = String::new();
    }
}

/// How a continuation was asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum How {
    /// With the caller's partial answer as a prefill.
    Prefill,
    /// As the caller asked, to be matched against what the caller has.
    Regenerate,
}

impl How {
    /// Its label in `stanch_gateway_stream_resumes_total`.
    pub(crate) fn label(self) -> &'static str {
        match self {
            How::Prefill => "prefill",
            How::Regenerate => "regenerate",
        }
    }
}

/// The request to continue `text` (`tokens` of it) with a prefill of the given kind:
/// the caller's `raw` request with the partial answer as a trailing assistant message
/// (chat) or appended to its prompt (completions), the model renamed to `model` if
/// given, and `max_tokens` less what was already generated. `None` when the request
/// cannot take one (no prefill here, a prompt that is not one string, messages that
/// are not a list).
pub(crate) fn prefilled(
    raw: &[u8],
    api: Api,
    prefill: Prefill,
    text: &str,
    tokens: u32,
    model: Option<&str>,
) -> Option<Bytes> {
    if prefill == Prefill::None {
        return None;
    }
    let Ok(Value::Object(mut body)) = serde_json::from_slice(raw) else {
        return None;
    };
    match api {
        Api::Chat => {
            let messages = body.get_mut("messages")?.as_array_mut()?;
            messages.push(serde_json::json!({"role": "assistant", "content": text}));
            if prefill == Prefill::Vllm {
                body.insert("continue_final_message".into(), Value::Bool(true));
                body.insert("add_generation_prompt".into(), Value::Bool(false));
            }
        }
        Api::Completions => {
            let prompt = body.get_mut("prompt")?;
            let Value::String(p) = prompt else {
                return None;
            };
            p.push_str(text);
        }
        Api::Embeddings => return None,
    }
    for key in ["max_tokens", "max_completion_tokens"] {
        if let Some(Value::Number(n)) = body.get(key)
            && let Some(n) = n.as_u64()
        {
            let left = n.saturating_sub(u64::from(tokens)).max(1);
            body.insert(key.into(), Value::from(left));
        }
    }
    if let Some(model) = model {
        body.insert("model".into(), Value::String(model.to_owned()));
    }
    Some(Bytes::from(
        serde_json::to_vec(&Value::Object(body)).expect("JSON serializes"),
    ))
}

/// A continuation's chunks, made part of the caller's stream.
#[derive(Debug)]
pub(crate) struct Splice {
    how: How,
    /// The caller's stream's `id`.
    id: Option<String>,
    /// Regenerating: the caller's text, which the continuation must reproduce before
    /// anything of it is passed on, and how much of it it has.
    have: String,
    matched: usize,
    /// Prefilled: the caller's tokens, counted by the continuation as prompt.
    prefilled_tokens: u64,
    /// Something of the continuation has reached the caller.
    pub(crate) spliced: bool,
    /// ...and has been counted.
    pub(crate) counted: bool,
}

/// What becomes of a continuation's chunk.
#[derive(Debug, PartialEq)]
pub(crate) enum Spliced {
    /// This, for the caller.
    Pass(Bytes),
    /// Nothing: it repeats what the caller has.
    Skip,
    /// The continuation is not the caller's answer.
    Diverged,
}

impl Splice {
    /// The splice of a continuation asked for `how`, after `text` (`tokens` of it),
    /// which the caller has as the stream `id`.
    pub(crate) fn new(how: How, id: Option<String>, text: &str, tokens: u32) -> Splice {
        Splice {
            how,
            id,
            have: match how {
                How::Prefill => String::new(),
                How::Regenerate => text.to_owned(),
            },
            matched: 0,
            prefilled_tokens: match how {
                How::Prefill => u64::from(tokens),
                How::Regenerate => 0,
            },
            spliced: false,
            counted: false,
        }
    }

    /// How it was asked for.
    pub(crate) fn how(&self) -> How {
        self.how
    }

    /// Whether the continuation has reproduced the caller's text (a prefill has
    /// nothing to reproduce).
    pub(crate) fn caught_up(&self) -> bool {
        self.matched == self.have.len()
    }

    /// A chunk of the continuation (its JSON payload; `last` when it has a
    /// `finish_reason`), for the caller whose answer so far `transcript` holds.
    pub(crate) fn chunk(
        &mut self,
        payload: &str,
        last: bool,
        transcript: &mut Transcript,
    ) -> Spliced {
        let Ok(Value::Object(mut chunk)) = serde_json::from_str::<Value>(payload) else {
            return Spliced::Diverged;
        };
        let Some(text) = chunk_text(payload) else {
            return Spliced::Diverged;
        };
        let mut new = text.as_str();
        if !self.caught_up() {
            let rest = &self.have[self.matched..];
            if new.len() <= rest.len() {
                if !rest.starts_with(new) {
                    return Spliced::Diverged;
                }
                self.matched += new.len();
                if !self.caught_up() {
                    // A shorter answer than the caller's is not the caller's.
                    return if last {
                        Spliced::Diverged
                    } else {
                        Spliced::Skip
                    };
                }
                new = "";
                // Caught up exactly: only a chunk that ends the answer says more.
                if !last && !chunk.contains_key("usage") {
                    return Spliced::Skip;
                }
            } else {
                let Some(after) = new.strip_prefix(rest) else {
                    return Spliced::Diverged;
                };
                self.matched = self.have.len();
                new = after;
            }
        }
        let new = new.to_owned();
        transcript.push(&new);
        if let Some(id) = &self.id {
            chunk.insert("id".into(), Value::String(id.clone()));
        }
        if let Some(Value::Array(choices)) = chunk.get_mut("choices") {
            for choice in choices {
                set_text(choice, &new);
            }
        }
        if self.prefilled_tokens > 0
            && let Some(Value::Object(usage)) = chunk.get_mut("usage")
        {
            move_prefill(usage, self.prefilled_tokens);
        }
        self.spliced = true;
        Spliced::Pass(Bytes::from(format!("data: {}\n\n", Value::Object(chunk))))
    }
}

/// The text of a chunk's first choice (empty if it has none); `None` when it carries
/// what a continuation cannot splice.
fn chunk_text(payload: &str) -> Option<String> {
    let view: ChunkView<'_> = serde_json::from_str(payload).ok()?;
    let mut text = String::new();
    for choice in &view.choices {
        text.push_str(choice.text().ok()?.unwrap_or(""));
    }
    Some(text)
}

/// Puts `text` in a choice where its text goes, and drops the `role` the caller
/// already had.
fn set_text(choice: &mut Value, text: &str) {
    if let Some(Value::Object(delta)) = choice.get_mut("delta") {
        delta.remove("role");
        if delta.contains_key("content") {
            delta.insert("content".into(), Value::String(text.to_owned()));
        }
    } else if choice.get("text").is_some() {
        choice["text"] = Value::String(text.to_owned());
    }
}

/// Usage as if one upstream had generated the whole answer: the prefilled tokens,
/// which the continuation counted as prompt, are counted as completion.
fn move_prefill(usage: &mut serde_json::Map<String, Value>, tokens: u64) {
    let get =
        |usage: &serde_json::Map<String, Value>, k: &str| usage.get(k).and_then(Value::as_u64);
    if let (Some(prompt), Some(completion)) =
        (get(usage, "prompt_tokens"), get(usage, "completion_tokens"))
    {
        let moved = tokens.min(prompt);
        usage.insert("prompt_tokens".into(), Value::from(prompt - moved));
        usage.insert("completion_tokens".into(), Value::from(completion + moved));
    }
}

#[cfg(test)]
mod tests;
