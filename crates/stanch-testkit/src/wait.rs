//! Waiting for something to hold, bounded in time: what a test does instead of
//! sleeping a fixed time and hoping it was long enough.
//!
//! Each check runs at once, then every [`EVERY`] until it holds or the time is up. The
//! bound is a deadline, not a count of tries, so a slow check cannot stretch it. On
//! tokio's paused clock (`#[tokio::test(start_paused = true)]`) the async waits
//! advance with it and cost no real time.

use std::future::Future;
use std::time::Duration;

/// How often a condition is checked again.
pub const EVERY: Duration = Duration::from_millis(20);

/// Waits until `check` gives a value; `None` if it gave none within `within`.
pub async fn some_within<T, F, Fut>(within: Duration, mut check: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if let Some(value) = check().await {
            return Some(value);
        }
        if tokio::time::Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(EVERY).await;
    }
}

/// Waits until `check` holds; false if it did not within `within`.
pub async fn holds_within<F, Fut>(within: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    some_within(within, || {
        let holds = check();
        async move { holds.await.then_some(()) }
    })
    .await
    .is_some()
}

/// Waits until `check` holds; panics naming `what` if it did not within `within`.
pub async fn until<F, Fut>(what: &str, within: Duration, check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    assert!(
        holds_within(within, check).await,
        "{what}: not within {within:?}"
    );
}

/// Waits until `check` gives a value and returns it; panics naming `what` if it gave
/// none within `within`.
pub async fn until_some<T, F, Fut>(what: &str, within: Duration, check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    match some_within(within, check).await {
        Some(value) => value,
        None => panic!("{what}: not within {within:?}"),
    }
}

/// The same waits for tests without a runtime, on the thread's own clock.
pub mod blocking {
    use std::time::Duration;

    // tokio's clock reads the thread's when no paused runtime is around.
    use tokio::time::Instant;

    use super::EVERY;

    /// Waits until `check` gives a value; `None` if it gave none within `within`.
    pub fn some_within<T>(within: Duration, mut check: impl FnMut() -> Option<T>) -> Option<T> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(value) = check() {
                return Some(value);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(EVERY);
        }
    }

    /// Waits until `check` holds; false if it did not within `within`.
    pub fn holds_within(within: Duration, mut check: impl FnMut() -> bool) -> bool {
        some_within(within, || check().then_some(())).is_some()
    }

    /// Waits until `check` holds; panics naming `what` if it did not within `within`.
    pub fn until(what: &str, within: Duration, check: impl FnMut() -> bool) {
        assert!(holds_within(within, check), "{what}: not within {within:?}");
    }

    /// Waits until `check` gives a value and returns it; panics naming `what` if it
    /// gave none within `within`.
    pub fn until_some<T>(what: &str, within: Duration, check: impl FnMut() -> Option<T>) -> T {
        match some_within(within, check) {
            Some(value) => value,
            None => panic!("{what}: not within {within:?}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_condition_that_comes_true_is_waited_for() {
        let start = tokio::time::Instant::now();
        let mut tries = 0;
        let got = until_some("the third try", Duration::from_secs(1), || {
            tries += 1;
            let now = tries;
            async move { (now == 3).then_some(now) }
        })
        .await;
        assert_eq!(got, 3);
        assert_eq!(
            start.elapsed(),
            2 * EVERY,
            "checked at once, then every EVERY"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_condition_that_never_holds_is_given_up_on_at_the_deadline() {
        let start = tokio::time::Instant::now();
        assert!(!holds_within(Duration::from_millis(100), || async { false }).await);
        let waited = start.elapsed();
        assert!(
            (Duration::from_millis(100)..Duration::from_millis(100) + EVERY).contains(&waited),
            "{waited:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    #[should_panic(expected = "the leader: not within 50ms")]
    async fn a_wait_that_fails_names_what_it_waited_for() {
        until("the leader", Duration::from_millis(50), || async { false }).await;
    }

    #[test]
    fn the_blocking_waits_keep_the_same_bound() {
        let mut tries = 0;
        assert!(blocking::holds_within(Duration::from_secs(1), || {
            tries += 1;
            tries == 2
        }));
        assert_eq!(tries, 2);
        let start = tokio::time::Instant::now();
        assert_eq!(
            blocking::some_within(Duration::from_millis(60), || None::<()>),
            None
        );
        assert!(start.elapsed() >= Duration::from_millis(60));
    }
}
