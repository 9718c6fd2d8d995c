//! A warning said at most once per interval, however often its cause recurs: a flood
//! is one log line a minute, with how many it stands for.

use std::time::Duration;

use tokio::time::Instant;

/// When a recurring warning may be said again.
#[derive(Debug)]
pub struct Throttled {
    every: Duration,
    last: Option<Instant>,
    held: u64,
}

impl Throttled {
    /// Said at most once per `every`.
    pub fn every(every: Duration) -> Throttled {
        Throttled {
            every,
            last: None,
            held: 0,
        }
    }

    /// `Some(times held back since it was last said)` when it may be said at `now`.
    pub fn ready(&mut self, now: Instant) -> Option<u64> {
        match self.last {
            Some(last) if now.duration_since(last) < self.every => {
                self.held += 1;
                None
            }
            _ => {
                self.last = Some(now);
                Some(std::mem::take(&mut self.held))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::time::Instant;

    use super::Throttled;

    #[test]
    fn said_once_per_interval_with_what_was_held_back() {
        let mut t = Throttled::every(Duration::from_secs(60));
        let start = Instant::now();
        assert_eq!(t.ready(start), Some(0));
        for s in 1..=5 {
            assert_eq!(t.ready(start + Duration::from_secs(s)), None);
        }
        assert_eq!(t.ready(start + Duration::from_secs(60)), Some(5));
        assert_eq!(t.ready(start + Duration::from_secs(61)), None);
    }
}
