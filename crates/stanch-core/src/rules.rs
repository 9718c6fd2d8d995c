//! What mapping rules are made of: the actions an alert can ask for and Alertmanager's
//! label matchers, parsed. Shared by the configuration (which validates rules with
//! them) and the mapper (which applies them), so neither imports the other.

use std::str::FromStr;

use regex::Regex;
use serde::{Deserialize, Serialize};
use stanch_api::Labels;

/// What an alert asks stanch to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Action {
    /// A pool of a model is failing: route elsewhere.
    TriggerFailover,
    /// A model is saturated: send non-VIP traffic to its fallback model.
    TriggerModelDegradation,
    /// A model is failing everywhere: answer from the FAQ.
    TriggerStaticFallback,
    /// An endpoint is failing: soft-block it.
    BlockEndpoint,
}

impl Action {
    /// The label value naming the action.
    pub const fn as_str(self) -> &'static str {
        match self {
            Action::TriggerFailover => "trigger-failover",
            Action::TriggerModelDegradation => "trigger-model-degradation",
            Action::TriggerStaticFallback => "trigger-static-fallback",
            Action::BlockEndpoint => "block-endpoint",
        }
    }
}

/// The error for an unknown action name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown action {0:?}: expected trigger-failover, trigger-model-degradation, trigger-static-fallback or block-endpoint"
)]
pub struct UnknownAction(String);

impl FromStr for Action {
    type Err = UnknownAction;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        [
            Action::TriggerFailover,
            Action::TriggerModelDegradation,
            Action::TriggerStaticFallback,
            Action::BlockEndpoint,
        ]
        .into_iter()
        .find(|a| a.as_str() == s)
        .ok_or_else(|| UnknownAction(s.to_owned()))
    }
}

/// A label matcher in Alertmanager's syntax: `name="v"`, `name!="v"`, `name=~"re"`, `name!~"re"`.
#[derive(Debug, Clone)]
pub struct Matcher {
    name: String,
    op: MatchOp,
}

#[derive(Debug, Clone)]
enum MatchOp {
    Equal(String),
    NotEqual(String),
    Regex(Regex),
    NotRegex(Regex),
}

/// The error for a matcher that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadMatcher {
    /// Not of the form `name op "value"`.
    #[error("matcher {0:?} is not of the form name=\"value\" (operators: = != =~ !~)")]
    Syntax(String),
    /// The regular expression does not compile.
    #[error("matcher {matcher:?}: bad regular expression: {error}")]
    Regex {
        /// The matcher.
        matcher: String,
        /// The regex error.
        error: String,
    },
}

impl Matcher {
    /// Parses one matcher.
    pub fn parse(raw: &str) -> Result<Matcher, BadMatcher> {
        let syntax = || BadMatcher::Syntax(raw.to_owned());
        let s = raw.trim();
        let op_at = s.find(['=', '!']).ok_or_else(syntax)?;
        let name = s[..op_at].trim();
        let rest = &s[op_at..];
        let (op, value) = ["=~", "!~", "!=", "="]
            .into_iter()
            .find_map(|op| rest.strip_prefix(op).map(|v| (op, v.trim())))
            .ok_or_else(syntax)?;
        let valid_name = !name.is_empty()
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            && !name.starts_with(|c: char| c.is_ascii_digit());
        if !valid_name {
            return Err(syntax());
        }
        let value = value
            .strip_prefix('"')
            .and_then(|v| v.strip_suffix('"'))
            .map(|v| v.replace("\\\"", "\"").replace("\\\\", "\\"))
            .unwrap_or_else(|| value.to_owned());
        let regex = |v: &str| {
            // Anchored, as Prometheus and Alertmanager anchor label regexes.
            Regex::new(&format!("^(?:{v})$")).map_err(|e| BadMatcher::Regex {
                matcher: raw.to_owned(),
                error: e.to_string(),
            })
        };
        let op = match op {
            "=" => MatchOp::Equal(value),
            "!=" => MatchOp::NotEqual(value),
            "=~" => MatchOp::Regex(regex(&value)?),
            _ => MatchOp::NotRegex(regex(&value)?),
        };
        Ok(Matcher {
            name: name.to_owned(),
            op,
        })
    }

    /// True when `labels` satisfy the matcher (a missing label reads as "").
    pub fn matches(&self, labels: &Labels) -> bool {
        let v = labels.get(&self.name).map(String::as_str).unwrap_or("");
        match &self.op {
            MatchOp::Equal(x) => v == x,
            MatchOp::NotEqual(x) => v != x,
            MatchOp::Regex(r) => r.is_match(v),
            MatchOp::NotRegex(r) => !r.is_match(v),
        }
    }
}
