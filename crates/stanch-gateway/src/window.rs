//! Counts over a sliding window, in ten buckets: constant memory whatever the rate.

use std::time::Duration;

use tokio::time::Instant;

const BUCKETS: usize = 10;

/// Counts of type `T` over a sliding window of a length given at each call, in ten
/// buckets each a tenth of it long.
#[derive(Debug, Default)]
pub(crate) struct Window<T> {
    /// Each bucket's start (`None`: never used) and counts.
    buckets: [(Option<Instant>, T); BUCKETS],
}

impl<T: Default> Window<T> {
    /// The counts to add to at `now`: the bucket that started less than a tenth of
    /// `span` ago, else the oldest, reset to start now.
    pub(crate) fn at(&mut self, now: Instant, span: Duration) -> &mut T {
        let len = span / BUCKETS as u32;
        let current = self
            .buckets
            .iter()
            .position(|(s, _)| s.is_some_and(|s| now.saturating_duration_since(s) < len));
        let i = current.unwrap_or_else(|| {
            let oldest = (0..BUCKETS).min_by_key(|i| self.buckets[*i].0).unwrap_or(0);
            self.buckets[oldest] = (Some(now), T::default());
            oldest
        });
        &mut self.buckets[i].1
    }

    /// The counts of the buckets that started within `span` of `now`.
    pub(crate) fn within(&self, now: Instant, span: Duration) -> impl Iterator<Item = &T> {
        self.buckets
            .iter()
            .filter(move |(s, _)| s.is_some_and(|s| now.saturating_duration_since(s) < span))
            .map(|(_, counts)| counts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn counts_slide_out_a_bucket_at_a_time() {
        let span = Duration::from_secs(10);
        let start = Instant::now();
        let mut w = Window::<u32>::default();
        for s in 0..10 {
            *w.at(start + Duration::from_secs(s), span) += 1;
        }
        *w.at(start + Duration::from_millis(9_500), span) += 1;
        let total = |at: u64| w.within(start + Duration::from_secs(at), span).sum::<u32>();
        assert_eq!(total(9), 11, "all ten buckets, the last counted twice");
        assert_eq!(total(10), 10, "the first has slid out");
        assert_eq!(total(18), 2, "the last bucket alone");
        assert_eq!(total(19), 0);
        // An eleventh second reuses the oldest bucket, reset.
        *w.at(start + Duration::from_secs(10), span) += 1;
        assert_eq!(
            w.within(start + Duration::from_secs(10), span).sum::<u32>(),
            11
        );
        assert_eq!(
            w.within(start + Duration::from_secs(11), span).sum::<u32>(),
            10
        );
    }
}
