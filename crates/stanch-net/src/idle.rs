//! When an HTTP/2 connection is idle: no stream open for
//! [`Http2Limits::idle_timeout`](crate::Http2Limits::idle_timeout). hyper closes an
//! HTTP/1.1 connection that waits too long for a request's headers, but an HTTP/2
//! one lives as long as its client answers pings, so each request is counted open
//! from when it is called until its answer's body ends (or is dropped), and a timer
//! per connection looks, once per idle timeout, whether any is.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use axum::response::Response;
use bytes::Bytes;
use tokio::time::Instant;

/// A connection's open streams, and when the last one ended.
#[derive(Clone)]
pub(crate) struct Streams(Arc<State>);

struct State {
    open: AtomicUsize,
    /// When a stream last ended (or the connection began), in milliseconds from
    /// `began`.
    last_ms: AtomicU64,
    began: Instant,
}

impl Default for Streams {
    fn default() -> Self {
        Streams(Arc::new(State {
            open: AtomicUsize::new(0),
            last_ms: AtomicU64::new(0),
            began: Instant::now(),
        }))
    }
}

impl Streams {
    /// Counts a stream open until the returned guard drops.
    pub(crate) fn open(&self) -> Open {
        self.0.open.fetch_add(1, Ordering::Relaxed);
        Open(self.clone())
    }

    /// Resolves once no stream has been open for `after`.
    pub(crate) async fn idle(&self, after: Duration) {
        loop {
            let wake = if self.0.open.load(Ordering::Relaxed) > 0 {
                Instant::now() + after
            } else {
                let last =
                    self.0.began + Duration::from_millis(self.0.last_ms.load(Ordering::Relaxed));
                if last.elapsed() >= after {
                    return;
                }
                last + after
            };
            tokio::time::sleep_until(wake).await;
        }
    }
}

/// One open stream; dropped, it ends.
pub(crate) struct Open(Streams);

impl Drop for Open {
    fn drop(&mut self) {
        let state = &(self.0).0;
        let since = u64::try_from(state.began.elapsed().as_millis()).unwrap_or(u64::MAX);
        state.last_ms.store(since, Ordering::Relaxed);
        state.open.fetch_sub(1, Ordering::Relaxed);
    }
}

pin_project_lite::pin_project! {
    /// A request's answer on its way: the stream stays open until the body it
    /// resolves to ends.
    pub(crate) struct Counted<F> {
        #[pin]
        answer: F,
        open: Option<Open>,
    }
}

impl<F> Counted<F> {
    pub(crate) fn new(answer: F, open: Open) -> Self {
        Counted {
            answer,
            open: Some(open),
        }
    }
}

impl<F, E> Future for Counted<F>
where
    F: Future<Output = Result<Response, E>>,
{
    type Output = Result<Response, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let answer = ready!(this.answer.poll(cx));
        let open = this.open.take();
        Poll::Ready(answer.map(|response| {
            response.map(|body| axum::body::Body::new(CountedBody { body, _open: open }))
        }))
    }
}

pin_project_lite::pin_project! {
    /// An answer's body, holding its stream open.
    struct CountedBody {
        #[pin]
        body: axum::body::Body,
        _open: Option<Open>,
    }
}

impl hyper::body::Body for CountedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Bytes>, axum::Error>>> {
        self.project().body.poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::Streams;

    #[tokio::test(start_paused = true)]
    async fn idle_once_no_stream_has_been_open_for_the_timeout() {
        let streams = Streams::default();
        let open = streams.open();
        let idle = tokio::spawn({
            let streams = streams.clone();
            async move {
                streams.idle(Duration::from_secs(60)).await;
                tokio::time::Instant::now()
            }
        });
        // Open for ten minutes: not idle.
        tokio::time::sleep(Duration::from_secs(600)).await;
        assert!(!idle.is_finished(), "idle while a stream is open");
        let ended = tokio::time::Instant::now();
        drop(open);
        let at = idle.await.unwrap();
        let after = at - ended;
        assert!(
            after >= Duration::from_secs(60) && after <= Duration::from_secs(120),
            "{after:?}"
        );
    }
}
