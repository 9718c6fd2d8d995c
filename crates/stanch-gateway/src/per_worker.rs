//! State that every request updates, kept as a share per worker thread.
//!
//! A worker thread serves its connections on its own core most of the time. State
//! that every request writes (a request counter, the latency histogram, the retry
//! budget's request count), held once for the whole gateway, moves its cache line
//! from whichever core wrote it last on every request; kept as a share per worker,
//! each core writes its own line, and a reader (a scrape, a rare retry) sums them.

use std::sync::LazyLock;

/// How many shares there are: one for each worker thread the cores call for, up to 16
/// (beyond that, workers share), and one for every other thread.
static SHARES: LazyLock<usize> = LazyLock::new(|| {
    1 + std::thread::available_parallelism()
        .map_or(1, usize::from)
        .min(16)
});

/// A value per worker thread.
#[derive(Debug)]
pub(crate) struct PerWorker<T>(Box<[Padded<T>]>);

/// On cache lines of its own, so that two workers' shares never share one.
#[derive(Debug, Default)]
#[repr(align(128))]
struct Padded<T>(T);

impl<T> PerWorker<T> {
    /// Every share made by `make`.
    pub(crate) fn new(mut make: impl FnMut() -> T) -> PerWorker<T> {
        PerWorker((0..*SHARES).map(|_| Padded(make())).collect())
    }

    /// The share of the thread running now.
    pub(crate) fn mine(&self) -> &T {
        self.of(stanch_net::worker_index())
    }

    /// The share of worker thread `worker` (`None`: any other thread).
    pub(crate) fn of(&self, worker: Option<usize>) -> &T {
        let i = worker.map_or(0, |w| 1 + w % (self.0.len() - 1));
        &self.0[i].0
    }

    /// Every share, to sum.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &T> {
        self.0.iter().map(|p| &p.0)
    }
}

impl<T: Default> Default for PerWorker<T> {
    fn default() -> Self {
        PerWorker::new(T::default)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::PerWorker;

    #[tokio::test]
    async fn each_worker_writes_its_own_share_and_the_sum_sees_them_all() {
        let counts = std::sync::Arc::new(PerWorker::<AtomicU64>::default());
        let workers = stanch_net::Workers::start(2, "test-shares").unwrap();
        for (worker, n) in [(0, 3), (1, 5)] {
            let counts = counts.clone();
            workers
                .spawn_on(worker, async move {
                    for _ in 0..n {
                        counts.mine().fetch_add(1, Ordering::Relaxed);
                    }
                })
                .await
                .unwrap();
        }
        counts.mine().fetch_add(7, Ordering::Relaxed); // not a worker
        let shares: Vec<u64> = counts.iter().map(|c| c.load(Ordering::Relaxed)).collect();
        assert_eq!(shares.iter().sum::<u64>(), 15);
        assert!(shares.contains(&7), "the other threads' share: {shares:?}");
        if shares.len() > 2 {
            // With a share per worker (two or more cores), no two wrote the same one.
            assert!(shares.contains(&3) && shares.contains(&5), "{shares:?}");
        }
    }
}
