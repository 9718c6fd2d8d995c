//! Label sets and alert fingerprints.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::hash::Fnv64;

/// A label set. Ordered, so that iteration, hashing and serialization are deterministic.
pub type Labels = BTreeMap<String, String>;

/// Prometheus' separator byte: it cannot occur in valid UTF-8.
const SEPARATOR: u8 = 0xff;

/// An alert's identity: the hash of its label set, computed as Alertmanager does
/// (`model.LabelSet.Fingerprint`), shown as 16 lowercase hex digits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Fingerprint(pub u64);

impl Fingerprint {
    /// The fingerprint Alertmanager computes for `labels`.
    pub fn of(labels: &Labels) -> Self {
        let mut h = Fnv64::default();
        // BTreeMap iterates in sorted order, as Alertmanager's sort of label names.
        for (name, value) in labels {
            h.write(name.as_bytes());
            h.write(&[SEPARATOR]);
            h.write(value.as_bytes());
            h.write(&[SEPARATOR]);
        }
        Self(h.finish())
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// The error for a fingerprint that is not 1 to 16 hex digits.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("fingerprint {0:?} is not 1 to 16 hexadecimal digits")]
pub struct BadFingerprint(String);

impl FromStr for Fingerprint {
    type Err = BadFingerprint;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.is_empty() || s.len() > 16 {
            return Err(BadFingerprint(s.to_owned()));
        }
        u64::from_str_radix(s, 16)
            .map(Self)
            .map_err(|_| BadFingerprint(s.to_owned()))
    }
}

impl Serialize for Fingerprint {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Fingerprint {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// On the wire, 16 lowercase hex digits.
#[cfg(feature = "schema")]
impl schemars::JsonSchema for Fingerprint {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Fingerprint".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({"type": "string", "pattern": "^[0-9a-f]{16}$"})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn matches_alertmanager_for_captured_alert() {
        // From shared fixtures: alertmanager-v4-firing-failover.json.
        let ls = labels(&[
            ("action", "trigger-failover"),
            ("alertname", "LLMModelHighFailureRate"),
            ("cluster", "bj-1"),
            ("instance", "127.0.0.1:18000"),
            ("job", "llm"),
            ("model", "qwen-72b"),
            ("pool", "dc-a"),
            ("severity", "critical"),
            ("target_model", "qwen-72b"),
        ]);
        assert_eq!(Fingerprint::of(&ls).to_string(), "7e517a555438361b");
    }

    #[test]
    fn empty_label_set_is_fnv_offset() {
        assert_eq!(Fingerprint::of(&Labels::new()).0, 0xcbf2_9ce4_8422_2325);
    }

    #[test]
    fn parses_and_rejects() {
        assert_eq!("00000000000000ff".parse::<Fingerprint>().unwrap().0, 255);
        assert!("xyz".parse::<Fingerprint>().is_err());
        assert!("".parse::<Fingerprint>().is_err());
        assert!("00000000000000000".parse::<Fingerprint>().is_err());
    }
}
