//! Durations written the way operators write them: `90s`, `10m`, `1h30m`.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A duration that reads and writes as a human string (`30s`, `5m`, `1h`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct HumanDuration(pub Duration);

/// The error for a string that is not a duration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a duration: {input:?} (write it like 90s, 10m or 1h)")]
pub struct BadDuration {
    input: String,
}

impl HumanDuration {
    /// A duration of `secs` seconds.
    pub const fn secs(secs: u64) -> Self {
        Self(Duration::from_secs(secs))
    }
}

impl From<HumanDuration> for Duration {
    fn from(d: HumanDuration) -> Duration {
        d.0
    }
}

impl FromStr for HumanDuration {
    type Err = BadDuration;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let trimmed = s.trim();
        // A bare number is ambiguous (seconds? milliseconds?), so it is refused.
        if trimmed.is_empty() || trimmed.chars().all(|c| c.is_ascii_digit()) {
            return Err(BadDuration {
                input: s.to_owned(),
            });
        }
        humantime::parse_duration(trimmed)
            .map(Self)
            .map_err(|_| BadDuration {
                input: s.to_owned(),
            })
    }
}

impl fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_zero() {
            return f.write_str("0s");
        }
        write!(f, "{}", humantime::format_duration(self.0))
    }
}

impl Serialize for HumanDuration {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&self.to_string().replace(' ', ""))
    }
}

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_operator_strings() {
        assert_eq!(
            "90s".parse::<HumanDuration>().unwrap().0,
            Duration::from_secs(90)
        );
        assert_eq!(
            "10m".parse::<HumanDuration>().unwrap().0,
            Duration::from_secs(600)
        );
        assert_eq!(
            "1h30m".parse::<HumanDuration>().unwrap().0,
            Duration::from_secs(5400)
        );
        assert_eq!(
            "250ms".parse::<HumanDuration>().unwrap().0,
            Duration::from_millis(250)
        );
    }

    #[test]
    fn refuses_bare_numbers_and_garbage() {
        for bad in ["", "60", "soon", "-5s"] {
            let err = bad.parse::<HumanDuration>().unwrap_err();
            assert!(err.to_string().contains("not a duration"), "{bad}: {err}");
        }
    }

    #[test]
    fn serializes_without_spaces() {
        let d = HumanDuration(Duration::from_secs(5400));
        assert_eq!(serde_json::to_string(&d).unwrap(), "\"1h30m\"");
        assert_eq!(
            serde_json::to_string(&HumanDuration::default()).unwrap(),
            "\"0s\""
        );
    }
}
