//! Faults the mock can be told to inject, switched at runtime through `PUT /admin/fault`.

use serde::{Deserialize, Serialize};

/// One fault, as JSON: `{"kind": "status", "status": 503}`, `{"kind": "cut", "after_tokens": 3}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Fault {
    /// Answer every request normally.
    None,
    /// Answer with an error status and an OpenAI-shaped error body.
    Status {
        /// 429, 500, 503, 402, 400, ...
        status: u16,
        /// Seconds for a `Retry-After` header, if any.
        #[serde(default)]
        retry_after: Option<u64>,
        /// The error `code` in the body, e.g. `insufficient_quota`, `context_length_exceeded`.
        #[serde(default)]
        code: Option<String>,
        /// Answer as a local rate limiter in front of the server would: with
        /// `X-Rate-Limited: true`.
        #[serde(default)]
        local: bool,
    },
    /// Wait this long before answering at all (no headers until then).
    Latency {
        /// Milliseconds.
        ms: u64,
    },
    /// Send headers at once, but the first token only after this long.
    SlowFirstToken {
        /// Milliseconds.
        ms: u64,
    },
    /// End the stream cleanly after this many tokens, without the final chunk or `[DONE]`.
    Cut {
        /// Tokens sent before the end.
        after_tokens: usize,
    },
    /// Break the connection after this many streamed tokens: the body aborts without
    /// its end, as when the server process dies mid-answer.
    Break {
        /// Tokens sent before the break.
        after_tokens: usize,
    },
    /// Stop sending after this many tokens and keep the connection open.
    Stall {
        /// Tokens sent before the stall.
        after_tokens: usize,
    },
    /// Send one malformed chunk before this token, then carry on.
    MalformedChunk {
        /// The token it comes before.
        at_token: usize,
    },
    /// Send the final chunk (with `finish_reason`) but no `data: [DONE]`.
    MissingDone,
    /// Close the connection without answering.
    Reset,
    /// Never answer (until the client gives up).
    NoResponse,
}

/// A fault and how many requests it applies to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FaultSpec {
    /// The fault.
    #[serde(flatten)]
    pub fault: Fault,
    /// Apply to this many requests, then answer normally again; `None` means until changed.
    #[serde(default)]
    pub count: Option<u64>,
}

impl Default for FaultSpec {
    fn default() -> Self {
        FaultSpec {
            fault: Fault::None,
            count: None,
        }
    }
}
