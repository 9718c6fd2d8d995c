//! The connections a listener is serving, and how they are told to finish when it
//! closes.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use hyper_util::server::graceful::GracefulConnection;

/// The connections a listener is serving, told to finish when it closes.
///
/// hyper-util's graceful watcher re-arms a watch channel (a lock and a waker clone)
/// every time a connection is polled, several times per request; here a poll reads
/// one flag, and a connection's waker is stored when it changes, which for a
/// connection served as its own task is once.
#[derive(Default)]
pub(crate) struct Drain(Arc<DrainState>);

#[derive(Default)]
struct DrainState {
    /// Set once, when the listener closes.
    closing: std::sync::atomic::AtomicBool,
    /// The connections being served (from when they are accepted), by id, with the
    /// waker that last polled each.
    conns: std::sync::Mutex<std::collections::HashMap<u64, std::task::Waker>>,
    next_id: std::sync::atomic::AtomicU64,
    /// Wakes [`Drain::close`] when the last connection ends.
    emptied: tokio::sync::Notify,
}

impl Drain {
    /// Counts a connection in; it is counted out when the [`Watch`] drops.
    pub(crate) fn watch(&self) -> Watch {
        let id = self
            .0
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.0
            .conns
            .lock()
            .expect("drain lock")
            .insert(id, std::task::Waker::noop().clone());
        Watch {
            drain: self.0.clone(),
            id,
        }
    }

    /// Tells every connection to finish (each ends after the request it is serving,
    /// at once if idle) and waits until they all have.
    pub(crate) async fn close(&self) {
        use std::sync::atomic::Ordering;
        self.0.closing.store(true, Ordering::SeqCst);
        for waker in self.0.conns.lock().expect("drain lock").values() {
            waker.wake_by_ref();
        }
        loop {
            let emptied = self.0.emptied.notified();
            tokio::pin!(emptied);
            emptied.as_mut().enable();
            if self.0.conns.lock().expect("drain lock").is_empty() {
                return;
            }
            emptied.await;
        }
    }
}

/// One connection's place in a [`Drain`].
pub(crate) struct Watch {
    drain: Arc<DrainState>,
    id: u64,
}

impl Watch {
    /// Serves `conn` to its end, asking it to finish once the drain closes.
    pub(crate) fn serve<C: GracefulConnection>(self, conn: C) -> Watched<C> {
        Watched {
            conn,
            watch: self,
            told: false,
            waker: None,
        }
    }
}

pin_project_lite::pin_project! {
    /// A connection served under a [`Watch`]. A struct rather than an `async fn`: the
    /// connection is hyper's whole per-connection state, and an `async fn` would keep
    /// its argument and its pinned copy both, twice the memory per connection.
    pub(crate) struct Watched<C> {
        #[pin]
        conn: C,
        watch: Watch,
        told: bool,
        // The waker last stored in the drain.
        waker: Option<std::task::Waker>,
    }
}

impl<C: GracefulConnection> Watched<C> {
    /// Asks the connection to finish: the requests in flight end, no new ones start.
    pub(crate) fn shut_down(self: Pin<&mut Self>) {
        let this = self.project();
        if !*this.told {
            *this.told = true;
            this.conn.graceful_shutdown();
        }
    }
}

impl<C: GracefulConnection> Future for Watched<C> {
    type Output = C::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<C::Output> {
        use std::sync::atomic::Ordering;
        let mut this = self.project();
        if this.waker.as_ref().is_none_or(|w| !w.will_wake(cx.waker())) {
            // Stored before the flag is read: a close that comes after this either
            // sees the waker or is seen below.
            let w = cx.waker().clone();
            this.watch
                .drain
                .conns
                .lock()
                .expect("drain lock")
                .insert(this.watch.id, w.clone());
            *this.waker = Some(w);
        }
        if !*this.told && this.watch.drain.closing.load(Ordering::SeqCst) {
            *this.told = true;
            this.conn.as_mut().graceful_shutdown();
        }
        this.conn.poll(cx)
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let mut conns = self.drain.conns.lock().expect("drain lock");
        conns.remove(&self.id);
        if conns.is_empty() {
            self.drain.emptied.notify_waiters();
        }
    }
}
