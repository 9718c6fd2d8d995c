//! Wall-clock timestamps as plain values.
//!
//! A [`Timestamp`] is milliseconds since the Unix epoch. It is a value, not a clock:
//! nothing here reads the current time. On the wire it is an RFC 3339 string.
//!
//! Every timestamp is between [`Timestamp::MIN`] (`0000-01-01T00:00:00Z`) and
//! [`Timestamp::MAX`] (`9999-12-31T23:59:59.999Z`), the range RFC 3339 can write:
//! construction and arithmetic saturate at those ends, so no time that stanch makes
//! (a block's end a hundred million hours away, say) can be one that a gateway or a
//! restarted controller cannot read back.

use std::fmt;
use std::ops::{Add, Sub};
use std::time::Duration;

use chrono::{DateTime, SecondsFormat, Utc};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Milliseconds since 1970-01-01T00:00:00Z, within the range RFC 3339 can write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Timestamp(i64);

/// The error for a string that is not an RFC 3339 timestamp.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not an RFC 3339 timestamp: {0:?}")]
pub struct BadTimestamp(String);

impl Timestamp {
    /// The earliest: `0000-01-01T00:00:00Z`.
    pub const MIN: Timestamp = Timestamp(-62_167_219_200_000);
    /// The latest: `9999-12-31T23:59:59.999Z`.
    pub const MAX: Timestamp = Timestamp(253_402_300_799_999);

    /// The timestamp `ms` milliseconds after the Unix epoch, held within
    /// [`Timestamp::MIN`] and [`Timestamp::MAX`].
    pub const fn from_millis(ms: i64) -> Self {
        if ms < Self::MIN.0 {
            Self::MIN
        } else if ms > Self::MAX.0 {
            Self::MAX
        } else {
            Self(ms)
        }
    }

    /// Milliseconds since the Unix epoch.
    pub const fn as_millis(self) -> i64 {
        self.0
    }

    /// Parses an RFC 3339 string such as `2026-11-30T00:06:54.148Z`. An offset that
    /// takes the instant past either end (`9999-12-31T23:00:00-05:00`) is refused.
    pub fn parse_rfc3339(s: &str) -> Result<Self, BadTimestamp> {
        let bad = || BadTimestamp(s.chars().take(64).collect());
        let ms = DateTime::parse_from_rfc3339(s)
            .map_err(|_| bad())?
            .timestamp_millis();
        if (Self::MIN.0..=Self::MAX.0).contains(&ms) {
            Ok(Self(ms))
        } else {
            Err(bad())
        }
    }

    /// True for Go's zero time (`0001-01-01T00:00:00Z`) and anything before the epoch,
    /// which Alertmanager uses to mean "no end yet".
    pub fn is_unset(self) -> bool {
        self.0 <= 0
    }

    /// The time from `earlier` to `self`, zero if `earlier` is later.
    pub fn since(self, earlier: Timestamp) -> Duration {
        Duration::from_millis(u64::try_from(self.0.saturating_sub(earlier.0)).unwrap_or(0))
    }

    /// Adds a duration, saturating at [`Timestamp::MAX`].
    pub fn saturating_add(self, d: Duration) -> Self {
        Self::from_millis(
            self.0
                .saturating_add(i64::try_from(d.as_millis()).unwrap_or(i64::MAX)),
        )
    }

    /// Subtracts a duration, saturating at [`Timestamp::MIN`].
    pub fn saturating_sub(self, d: Duration) -> Self {
        Self::from_millis(
            self.0
                .saturating_sub(i64::try_from(d.as_millis()).unwrap_or(i64::MAX)),
        )
    }
}

impl Add<Duration> for Timestamp {
    type Output = Timestamp;
    fn add(self, d: Duration) -> Timestamp {
        self.saturating_add(d)
    }
}

impl Sub<Duration> for Timestamp {
    type Output = Timestamp;
    fn sub(self, d: Duration) -> Timestamp {
        self.saturating_sub(d)
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let t = DateTime::<Utc>::from_timestamp_millis(self.0)
            .expect("a timestamp within MIN..=MAX is a date");
        f.write_str(&t.to_rfc3339_opts(SecondsFormat::Millis, true))
    }
}

impl Serialize for Timestamp {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Timestamp {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Timestamp::parse_rfc3339(&s).map_err(serde::de::Error::custom)
    }
}

/// On the wire, an RFC 3339 string.
#[cfg(feature = "schema")]
impl schemars::JsonSchema for Timestamp {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Timestamp".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({"type": "string", "format": "date-time"})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_rfc3339_with_millis() {
        let t = Timestamp::parse_rfc3339("2026-11-30T00:06:54.148Z").unwrap();
        assert_eq!(t.to_string(), "2026-11-30T00:06:54.148Z");
        let offset = Timestamp::parse_rfc3339("2026-11-30T08:06:54.148+08:00").unwrap();
        assert_eq!(offset, t);
    }

    #[test]
    fn go_zero_time_is_unset() {
        let t = Timestamp::parse_rfc3339("0001-01-01T00:00:00Z").unwrap();
        assert!(t.is_unset());
        assert!(!Timestamp::from_millis(1).is_unset());
    }

    #[test]
    fn rejects_garbage() {
        assert!(Timestamp::parse_rfc3339("yesterday").is_err());
        assert!(Timestamp::parse_rfc3339("2026-11-30").is_err());
    }

    #[test]
    fn arithmetic_saturates() {
        let t = Timestamp::from_millis(1_000);
        assert_eq!(t + Duration::from_secs(1), Timestamp::from_millis(2_000));
        assert_eq!(t.since(Timestamp::from_millis(5_000)), Duration::ZERO);
        assert_eq!(
            Timestamp::from_millis(i64::MAX) + Duration::from_secs(1),
            Timestamp::MAX
        );
    }
}
