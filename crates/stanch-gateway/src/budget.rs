//! The retry budget: retries may be at most a fraction of requests over a window, so
//! that an outage is not amplified by every caller trying three times.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

const BUCKETS: usize = 10;

/// A sliding-window budget in ten buckets.
#[derive(Debug)]
pub struct RetryBudget {
    ratio: f64,
    min: u32,
    bucket: Duration,
    inner: Mutex<[(Option<Instant>, u32, u32); BUCKETS]>,
}

impl RetryBudget {
    /// Retries ≤ `ratio` × requests + `min` over `window`.
    pub fn new(ratio: f64, min: u32, window: Duration) -> RetryBudget {
        RetryBudget {
            ratio,
            min,
            bucket: window / BUCKETS as u32,
            inner: Mutex::new([(None, 0, 0); BUCKETS]),
        }
    }

    fn slot(&self, now: Instant, buckets: &mut [(Option<Instant>, u32, u32); BUCKETS]) -> usize {
        // The bucket that started less than one bucket length ago; else the oldest, reset.
        let current = buckets
            .iter()
            .position(|(start, _, _)| start.is_some_and(|s| now.duration_since(s) < self.bucket));
        match current {
            Some(i) => i,
            None => {
                let oldest = buckets
                    .iter()
                    .enumerate()
                    .min_by_key(|(_, (s, _, _))| *s)
                    .map(|(i, _)| i)
                    .unwrap_or(0);
                buckets[oldest] = (Some(now), 0, 0);
                oldest
            }
        }
    }

    fn totals(&self, now: Instant, buckets: &[(Option<Instant>, u32, u32); BUCKETS]) -> (u32, u32) {
        let window = self.bucket * BUCKETS as u32;
        buckets
            .iter()
            .filter(|(s, _, _)| s.is_some_and(|s| now.duration_since(s) < window))
            .fold((0, 0), |(r, t), (_, req, ret)| (r + req, t + ret))
    }

    /// Counts a request.
    pub fn request(&self, now: Instant) {
        let mut b = self.inner.lock().expect("budget lock");
        let i = self.slot(now, &mut b);
        b[i].1 += 1;
    }

    /// Takes a retry from the budget, if there is one.
    pub fn try_retry(&self, now: Instant) -> bool {
        let mut b = self.inner.lock().expect("budget lock");
        let (requests, retries) = self.totals(now, &b);
        let allowed = f64::from(requests) * self.ratio + f64::from(self.min);
        if f64::from(retries) + 1.0 > allowed {
            return false;
        }
        let i = self.slot(now, &mut b);
        b[i].2 += 1;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn retries_are_bounded_by_the_ratio() {
        let budget = RetryBudget::new(0.2, 2, Duration::from_secs(10));
        let now = Instant::now();
        for _ in 0..100 {
            budget.request(now);
        }
        let granted = (0..100).filter(|_| budget.try_retry(now)).count();
        assert_eq!(granted, 22, "20 % of 100, plus the minimum of 2");
        let later = now + Duration::from_secs(11);
        assert!(budget.try_retry(later), "the window moved on");
    }
}
