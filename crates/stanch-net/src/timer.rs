//! Deadlines that are cheap to set and to cancel, for the ones set on every request
//! and nearly always cancelled: how long a request's head may take to arrive (hyper's
//! [`hyper::rt::Timer`], through [`Timer`]), and how long an upstream may take to
//! answer ([`timeout_at`]).
//!
//! A tokio timer registers in the runtime's timer wheel when first polled and leaves
//! it when dropped; for a deadline that almost never fires, that is most of what
//! hyper's header-read timeout costs a request (about 1,400 instructions of the
//! gateway's 43,000). Here, as in Pingora's `fast_timeout`, a deadline costs nothing
//! until the future it guards is pending, and then an entry in a per-thread list: a
//! lock no other thread contends for, a slot reused from the last request, no
//! allocation. One task per thread sleeps (on a tokio timer) until the earliest
//! deadline of its list and wakes the ones that passed, so deadlines fire when due,
//! not on a tick.
//!
//! Does not own: timeouts that are set rarely (connecting, draining), which use
//! tokio's timers directly.

use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use tokio::time::Instant;

/// The deadlines of one thread, and the task that fires them.
#[derive(Default)]
struct Wheel(Mutex<Slots>);

#[derive(Default)]
struct Slots {
    slots: Vec<Slot>,
    /// Indices of free slots.
    free: Vec<usize>,
    /// The deadline the firing task sleeps until, if it sleeps until one.
    armed: Option<Instant>,
    /// The firing task's waker, to move its sleep earlier; `None` when no task is
    /// running for this list (none yet, or its runtime has shut down).
    driver: Option<Waker>,
}

enum Slot {
    Free,
    Waiting {
        deadline: Instant,
        waker: Waker,
    },
    /// Passed and woken; the sleep that owns it frees it when it sees it.
    Fired,
}

std::thread_local! {
    static WHEEL: RefCell<Option<Arc<Wheel>>> = const { RefCell::new(None) };
}

impl Wheel {
    /// Puts a deadline in this thread's list, starting the list's firing task on the
    /// current runtime if it has none; returns the list and the deadline's slot.
    fn register(deadline: Instant, waker: Waker) -> (Arc<Wheel>, usize) {
        let wheel = Wheel::this_thread();
        let mut slots = wheel.lock();
        let start = slots.driver.is_none();
        if start {
            // A no-op waker until the task first runs; its first pass sees what is
            // registered before then.
            slots.driver = Some(Waker::noop().clone());
        }
        let i = slots.insert(deadline, waker);
        drop(slots);
        if start {
            tokio::spawn(drive(Stopped(wheel.clone())));
        }
        (wheel, i)
    }

    /// This thread's list (with or without a firing task).
    fn this_thread() -> Arc<Wheel> {
        WHEEL.with(|w| w.borrow_mut().get_or_insert_with(Arc::default).clone())
    }

    fn lock(&self) -> MutexGuard<'_, Slots> {
        // A panic while holding it leaves only slots, all still consistent.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Slots {
    fn insert(&mut self, deadline: Instant, waker: Waker) -> usize {
        let slot = Slot::Waiting { deadline, waker };
        let i = match self.free.pop() {
            Some(i) => {
                self.slots[i] = slot;
                i
            }
            None => {
                self.slots.push(slot);
                self.slots.len() - 1
            }
        };
        // Earlier than the firing task sleeps until: it must wake sooner. Deadlines of
        // one kind come in order, so this is rare.
        if self.armed.is_none_or(|armed| deadline < armed)
            && let Some(driver) = &self.driver
        {
            self.armed = Some(deadline);
            driver.wake_by_ref();
        }
        i
    }

    fn remove(&mut self, i: usize) {
        self.slots[i] = Slot::Free;
        self.free.push(i);
    }

    /// Wakes every deadline passed at `now`; returns the earliest one still ahead.
    fn fire(&mut self, now: Instant) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        for slot in &mut self.slots {
            if let Slot::Waiting { deadline, waker } = slot {
                if *deadline <= now {
                    waker.wake_by_ref();
                    *slot = Slot::Fired;
                } else if next.is_none_or(|n| *deadline < n) {
                    next = Some(*deadline);
                }
            }
        }
        next
    }
}

/// Marks a list as without a firing task when its task ends, its runtime having shut
/// down, even if that was before the task first ran: it is the task's argument.
struct Stopped(Arc<Wheel>);

impl Drop for Stopped {
    fn drop(&mut self) {
        let mut slots = self.0.lock();
        slots.driver = None;
        slots.armed = None;
    }
}

/// The task that fires a list's deadlines: it sleeps until the earliest, fires what
/// has passed, and sleeps again; a registration earlier than its sleep wakes it.
async fn drive(stopped: Stopped) {
    let mut sleep = std::pin::pin!(tokio::time::sleep_until(Instant::now()));
    std::future::poll_fn(|cx| {
        loop {
            let next = {
                let mut slots = stopped.0.lock();
                if slots
                    .driver
                    .as_ref()
                    .is_none_or(|w| !w.will_wake(cx.waker()))
                {
                    slots.driver = Some(cx.waker().clone());
                }
                let next = slots.fire(Instant::now());
                slots.armed = next;
                next
            };
            let Some(next) = next else {
                return Poll::<()>::Pending;
            };
            sleep.as_mut().reset(next);
            if sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
        }
    })
    .await;
}

/// A future that completes at `deadline`. Like tokio's, it is polled within a tokio
/// runtime with time enabled (the first to wait on a thread starts that thread's
/// firing task on it).
pub fn sleep_until(deadline: Instant) -> Sleep {
    Sleep {
        deadline,
        entry: None,
    }
}

/// Completes at its deadline; see [`sleep_until`].
pub struct Sleep {
    deadline: Instant,
    /// Its list and slot, once it has waited.
    entry: Option<(Arc<Wheel>, usize)>,
}

impl Future for Sleep {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        let Some((wheel, i)) = &this.entry else {
            if Instant::now() >= this.deadline {
                return Poll::Ready(());
            }
            this.entry = Some(Wheel::register(this.deadline, cx.waker().clone()));
            return Poll::Pending;
        };
        let mut slots = wheel.lock();
        match &mut slots.slots[*i] {
            Slot::Fired => {
                slots.remove(*i);
                drop(slots);
                this.entry = None;
                // Fired once: a later poll finds the deadline passed and returns at once.
                Poll::Ready(())
            }
            Slot::Waiting { waker, .. } => {
                if !waker.will_wake(cx.waker()) {
                    *waker = cx.waker().clone();
                }
                Poll::Pending
            }
            Slot::Free => unreachable!("a slot is freed only by the sleep that owns it"),
        }
    }
}

impl Drop for Sleep {
    fn drop(&mut self) {
        if let Some((wheel, i)) = self.entry.take() {
            wheel.lock().remove(i);
        }
    }
}

/// [`Sleep`] as hyper's timer (for the header-read timeout).
#[derive(Debug, Clone, Copy, Default)]
pub struct Timer;

impl hyper::rt::Sleep for Sleep {}

impl hyper::rt::Timer for Timer {
    fn sleep(&self, duration: std::time::Duration) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(sleep_until(Instant::now() + duration))
    }

    fn sleep_until(&self, deadline: std::time::Instant) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(sleep_until(deadline.into()))
    }

    fn now(&self) -> std::time::Instant {
        // tokio's clock, which tests may pause.
        Instant::now().into_std()
    }
}

/// The deadline of [`timeout_at`] passed first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Elapsed;

/// Runs `future` until `deadline`: `Err(Elapsed)` if the deadline comes first. The
/// future is polled first on every poll, so one ready at its deadline wins.
pub fn timeout_at<F: Future>(deadline: Instant, future: F) -> Timeout<F> {
    Timeout {
        future,
        sleep: sleep_until(deadline),
    }
}

pin_project_lite::pin_project! {
    /// See [`timeout_at`]. A struct rather than an `async fn`, which would hold the
    /// future it guards twice (its argument and its pinned copy).
    pub struct Timeout<F> {
        #[pin]
        future: F,
        sleep: Sleep,
    }
}

impl<F: Future> Future for Timeout<F> {
    type Output = Result<F::Output, Elapsed>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if let Poll::Ready(output) = this.future.poll(cx) {
            return Poll::Ready(Ok(output));
        }
        Pin::new(this.sleep).poll(cx).map(|()| Err(Elapsed))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// The slots of this thread's list that are in use.
    fn in_use() -> usize {
        let wheel = Wheel::this_thread();
        let slots = wheel.lock();
        slots.slots.len() - slots.free.len()
    }

    #[tokio::test(start_paused = true)]
    async fn deadlines_fire_when_due_in_any_order() {
        let start = Instant::now();
        let at = move |secs| start + Duration::from_secs(secs);
        let fires = move |secs| async move {
            sleep_until(at(secs)).await;
            Instant::now() - start
        };
        // The latest first, and the firing task asleep until it: each earlier one
        // registered after must move that sleep.
        let late = tokio::spawn(fires(3));
        while Wheel::this_thread().lock().armed != Some(at(3)) {
            tokio::task::yield_now().await;
        }
        let (early, middle) = tokio::join!(fires(1), fires(2));
        let fired = [late.await.unwrap(), early, middle];
        assert_eq!(fired, [3, 1, 2].map(Duration::from_secs));
        assert_eq!(in_use(), 0, "fired deadlines free their slots");
    }

    #[tokio::test(start_paused = true)]
    async fn a_timeout_passes_the_answer_or_elapses() {
        let start = Instant::now();
        let soon = start + Duration::from_secs(1);
        assert_eq!(timeout_at(soon, async { 7 }).await, Ok(7));
        let slow = tokio::time::sleep(Duration::from_secs(2));
        assert_eq!(timeout_at(soon, slow).await, Err(Elapsed));
        assert_eq!(Instant::now() - start, Duration::from_secs(1));
        // A deadline already passed does not wait at all.
        assert_eq!(
            timeout_at(start, std::future::pending::<()>()).await,
            Err(Elapsed)
        );
        assert_eq!(Instant::now() - start, Duration::from_secs(1));
    }

    #[tokio::test(start_paused = true)]
    async fn cancelled_deadlines_leave_nothing_behind() {
        let far = Instant::now() + Duration::from_secs(30);
        for _ in 0..1000 {
            let answer = timeout_at(far, async {
                tokio::task::yield_now().await;
                1
            });
            assert_eq!(answer.await, Ok(1));
        }
        let wheel = Wheel::this_thread();
        let slots = wheel.lock();
        assert_eq!(slots.slots.len() - slots.free.len(), 0);
        assert!(
            slots.slots.len() <= 1,
            "one slot reused: {}",
            slots.slots.len()
        );
    }

    #[test]
    fn deadlines_fire_on_a_runtime_started_after_another_stopped() {
        // One that stops before its firing task ever ran.
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        runtime.block_on(async {
            // Waited on once, which starts the firing task, then dropped.
            let mut far = sleep_until(Instant::now() + Duration::from_secs(60));
            std::future::poll_fn(|cx| {
                assert!(Pin::new(&mut far).poll(cx).is_pending());
                Poll::Ready(())
            })
            .await;
        });
        drop(runtime);
        // Then ones whose task ran.
        for _ in 0..2 {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .build()
                .unwrap();
            runtime.block_on(async {
                let start = Instant::now();
                let deadline = start + Duration::from_millis(20);
                let stuck = std::future::pending::<()>();
                let answer =
                    tokio::time::timeout(Duration::from_secs(5), timeout_at(deadline, stuck));
                assert_eq!(answer.await, Ok(Err(Elapsed)), "fired, and in time");
                assert!(Instant::now() >= deadline);
            });
        }
    }
}
