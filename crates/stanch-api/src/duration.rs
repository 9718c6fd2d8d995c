//! Durations written the way operators write them: `90s`, `10m`, `1h30m`.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A duration that reads and writes as a human string (`30s`, `5m`, `1h`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct HumanDuration(pub Duration);

/// The error for a string that is not a duration stanch accepts.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadDuration {
    /// Not a duration at all.
    #[error("not a duration: {0:?} (write it like 90s, 10m or 1h)")]
    Syntax(String),
    /// Longer than [`HumanDuration::MAX`].
    #[error("{0:?} is longer than the longest duration stanch accepts ({max})", max = HumanDuration::MAX)]
    TooLong(String),
}

impl HumanDuration {
    /// The longest duration any setting or request may hold: 10 years (`3650d`).
    /// Fields have tighter limits of their own (an override's TTL, for one); this
    /// one keeps every time stanch computes from a duration far inside the range a
    /// timestamp can hold.
    pub const MAX: HumanDuration = HumanDuration(Duration::from_secs(3650 * 86_400));

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
        let shown = || s.chars().take(64).collect::<String>();
        // A bare number is ambiguous (seconds? milliseconds?), so it is refused.
        if trimmed.is_empty() || trimmed.chars().all(|c| c.is_ascii_digit()) {
            return Err(BadDuration::Syntax(shown()));
        }
        let d = humantime::parse_duration(trimmed).map_err(|e| match e {
            humantime::DurationError::NumberOverflow => BadDuration::TooLong(shown()),
            _ => BadDuration::Syntax(shown()),
        })?;
        if d > Self::MAX.0 {
            return Err(BadDuration::TooLong(shown()));
        }
        Ok(Self(d))
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
    fn refuses_absurd_lengths() {
        assert_eq!(
            "3650d".parse::<HumanDuration>().unwrap(),
            HumanDuration::MAX
        );
        for absurd in [
            "3651d",
            "100000000h",
            "500000000y",
            "99999999999999999999999s",
        ] {
            let err = absurd.parse::<HumanDuration>().unwrap_err();
            assert!(matches!(err, BadDuration::TooLong(_)), "{absurd}: {err}");
            assert!(err.to_string().contains("longest"), "{err}");
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
