//! Spreading a duration, so that a fleet does not act in step: one rule for every
//! jittered wait in stanch (block lengths, long-poll waits, reconnects, retry backoff).
//! The random bits are the caller's: a hash of its inputs where a decision must replay
//! the same (the engine), a fast generator elsewhere.

use std::time::Duration;

/// `d` spread uniformly within ±`fraction` of itself (0.1 is ±10 %), chosen by `bits`
/// (64 random bits; the top 53 are used). A `fraction` of 0 or less returns `d`.
pub fn spread(d: Duration, fraction: f64, bits: u64) -> Duration {
    if fraction <= 0.0 {
        return d;
    }
    // 53 random bits give a uniform float in [0, 1).
    let unit = (bits >> 11) as f64 / (1u64 << 53) as f64;
    d.mul_f64(1.0 + fraction.min(1.0) * (2.0 * unit - 1.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stays_within_its_fraction_and_covers_it() {
        let d = Duration::from_secs(100);
        let mut low = d;
        let mut high = d;
        for i in 0..10_000u64 {
            let bits = crate::hash::fnv64(&i.to_le_bytes());
            let s = spread(d, 0.1, bits);
            assert!(
                s >= Duration::from_secs(90) && s <= Duration::from_secs(110),
                "{s:?}"
            );
            low = low.min(s);
            high = high.max(s);
        }
        assert!(
            low < Duration::from_secs(91) && high > Duration::from_secs(109),
            "{low:?} {high:?}"
        );
        assert_eq!(spread(d, 0.0, 12345), d);
        assert_eq!(
            spread(d, 0.1, 1 << 63),
            d,
            "the middle of the range is d itself"
        );
    }
}
