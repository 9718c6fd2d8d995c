//! Wire types shared by the stanch controller, gateways and clients.
//!
//! This crate owns the shapes that cross a process boundary: the route table that
//! gateways apply, the watch headers, the Alertmanager and Prometheus alert payloads
//! stanch accepts, the admin request bodies and the status report. It owns their
//! parsing and validation at the edge (so that bad input gets an error naming the
//! offending field), and nothing else: no decisions, no IO, no clock. The gRPC
//! watch's protobuf is in `stanch-proto`, so that what builds on these types (the
//! pure core) does not build the generated code.

pub mod admin;
pub mod alerts;
pub mod duration;
pub mod glob;
pub mod hash;
pub mod headers;
pub mod jitter;
pub mod labels;
pub mod reports;
pub mod routes;
pub mod status;
pub mod text;
pub mod time;

pub use duration::HumanDuration;
pub use labels::{Fingerprint, Labels};
pub use routes::{BlockedEndpoint, ModelRoute, PoolShare, RouteTable, Rung};
pub use time::Timestamp;

/// The JSON body of every 4xx and 5xx answer from the controller.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ErrorBody {
    /// A stable machine-readable kind, such as `invalid_payload` or `unauthorized`.
    pub error: String,
    /// What was wrong and where, for a human.
    pub detail: String,
}

/// A value from the wire that stanch does not accept: which field, and what is wrong
/// with it (`ttl: "100000000h" is longer than …`; the field is `body` when the body
/// is not JSON at all).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {problem}")]
pub struct Invalid {
    /// The field, as a path (`endpoints[3].model`).
    pub field: String,
    /// What is wrong with it.
    pub problem: String,
}

impl Invalid {
    /// `field` is wrong: `problem`.
    pub fn new(field: impl Into<String>, problem: impl Into<String>) -> Invalid {
        Invalid {
            field: field.into(),
            problem: problem.into(),
        }
    }
}

/// Reads a JSON request body as `T`; the error names the field that was wrong, or
/// `body` when it is not JSON at all.
pub fn from_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, Invalid> {
    // serde_json appends "at line 1 column 42", which says nothing to a caller.
    let clean = |text: String| {
        text.split(" at line ")
            .next()
            .unwrap_or_default()
            .to_owned()
    };
    let mut de = serde_json::Deserializer::from_slice(body);
    let value: T = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let problem = clean(e.into_inner().to_string());
        if matches!(path.as_str(), "." | "?" | "") {
            Invalid::new("body", problem)
        } else {
            Invalid::new(path, problem)
        }
    })?;
    de.end()
        .map_err(|e| Invalid::new("body", clean(e.to_string())))?;
    Ok(value)
}

#[cfg(test)]
mod tests {
    #[test]
    fn json_errors_name_the_field() {
        let err = super::from_json::<admin::BlockRequest>(
            br#"{"endpoint": "a", "ttl": "100000000h", "reason": "r"}"#,
        )
        .unwrap_err();
        assert_eq!(err.field, "ttl", "{err}");
        let err = super::from_json::<admin::BlockRequest>(b"{ nope").unwrap_err();
        assert_eq!(err.field, "body", "{err}");
        let err = super::from_json::<admin::BlockRequest>(br#"{"endpoint": "a", "reason": "r"} x"#)
            .unwrap_err();
        assert!(err.to_string().starts_with("body: trailing"), "{err}");
    }

    use super::*;
}
