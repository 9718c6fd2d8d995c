//! The retry budget: retries may be at most a fraction of requests over a window, so
//! that an outage is not amplified by every caller trying three times.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use crate::per_worker::PerWorker;
use crate::window::Window;

/// A sliding-window budget.
#[derive(Debug)]
pub struct RetryBudget {
    ratio: f64,
    min: u32,
    window: Duration,
    /// Requests, a window per worker thread: every request counts itself, and one
    /// window for all would be a lock taken by every request on every core.
    requests: PerWorker<Mutex<Window<u32>>>,
    /// Retries, rarer: one window.
    retries: Mutex<Window<u32>>,
}

impl RetryBudget {
    /// Retries ≤ `ratio` × requests + `min` over `window`.
    pub fn new(ratio: f64, min: u32, window: Duration) -> RetryBudget {
        RetryBudget {
            ratio,
            min,
            window,
            requests: PerWorker::default(),
            retries: Mutex::default(),
        }
    }

    /// Counts a request.
    pub fn request(&self, now: Instant) {
        let mut requests = self.requests.mine().lock().expect("budget lock");
        *requests.at(now, self.window) += 1;
    }

    /// Takes a retry from the budget, if there is one.
    pub fn try_retry(&self, now: Instant) -> bool {
        let requests: u32 = self
            .requests
            .iter()
            .map(|w| {
                w.lock()
                    .expect("budget lock")
                    .within(now, self.window)
                    .sum::<u32>()
            })
            .sum();
        let mut retries = self.retries.lock().expect("budget lock");
        let allowed = f64::from(requests) * self.ratio + f64::from(self.min);
        if f64::from(retries.within(now, self.window).sum::<u32>()) + 1.0 > allowed {
            return false;
        }
        *retries.at(now, self.window) += 1;
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

    #[tokio::test]
    async fn requests_counted_on_every_worker_make_one_budget() {
        let budget = std::sync::Arc::new(RetryBudget::new(0.5, 0, Duration::from_secs(10)));
        let now = Instant::now();
        let workers = stanch_net::Workers::start(2, "test-budget").unwrap();
        for worker in 0..2 {
            let budget = budget.clone();
            workers
                .spawn_on(worker, async move {
                    for _ in 0..10 {
                        budget.request(now);
                    }
                })
                .await
                .unwrap();
        }
        let granted = (0..20).filter(|_| budget.try_retry(now)).count();
        assert_eq!(
            granted, 10,
            "half of the 20 requests, wherever they were counted"
        );
    }
}
