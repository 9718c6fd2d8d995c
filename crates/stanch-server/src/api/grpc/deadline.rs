//! A gRPC message, once begun, must arrive whole within a deadline.
//!
//! tonic buffers a message until all of it has come (up to its size limit), and a
//! stream whose client sends part of one and stops would hold that buffer for as
//! long as the stream lives, which heartbeats keep long. So a request body is read
//! through [`Deadline`], which follows gRPC's framing (a 5-byte prefix: a flag and
//! the message's length, then the message) and fails the body, ending the stream
//! with an error, when a message begun has not ended within its deadline. Between
//! messages a stream may be silent as long as it likes. What messages under way hold
//! is taken from the bytes all request bodies still arriving share
//! (`intake.max_partial_body_bytes`); a message that would pass it fails its body too,
//! so ten thousand streams each holding most of a message cannot fill memory in the
//! seconds before their deadlines.

use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use axum::body::Body;
use bytes::{Buf, Bytes};
use hyper::body::Frame;
use stanch_net::body::{BodyBudget, Hold};
use tokio::time::Sleep;

/// The bytes before each message: a compression flag and a 4-byte length.
const PREFIX: usize = 5;

pin_project_lite::pin_project! {
    /// A gRPC request body whose messages must each arrive within `within` of their
    /// first byte.
    pub(crate) struct Deadline {
        #[pin]
        body: Body,
        within: Duration,
        frames: Frames,
        // Set while a message is under way.
        timer: Option<Pin<Box<Sleep>>>,
        // The bytes of the message under way, taken from the budget.
        hold: Hold,
    }
}

impl Deadline {
    pub(crate) fn new(body: Body, within: Duration, budget: &BodyBudget) -> Self {
        Deadline {
            body,
            within,
            frames: Frames::default(),
            timer: None,
            hold: Hold::new(budget),
        }
    }
}

/// Where the framing is: how much of the current prefix or message is still to come.
#[derive(Debug, Default)]
struct Frames {
    /// The prefix's bytes read so far (until all 5 have come).
    prefix: [u8; PREFIX],
    prefix_read: usize,
    /// The message's bytes still to come after a whole prefix.
    left: u64,
    /// The bytes of the message under way that have come, prefix included.
    read: u64,
}

impl Frames {
    /// Follows `data`: whether a message is under way after it, and whether that
    /// message began in it.
    fn follow(&mut self, mut data: &[u8]) -> (bool, bool) {
        let mut began = false;
        while !data.is_empty() {
            if self.left > 0 {
                let take = usize::try_from(self.left)
                    .unwrap_or(usize::MAX)
                    .min(data.len());
                self.left -= take as u64;
                self.read += take as u64;
                data.advance(take);
                continue;
            }
            if self.prefix_read == 0 {
                began = true;
                self.read = 0;
            }
            let take = (PREFIX - self.prefix_read).min(data.len());
            self.read += take as u64;
            self.prefix[self.prefix_read..self.prefix_read + take].copy_from_slice(&data[..take]);
            self.prefix_read += take;
            data.advance(take);
            if self.prefix_read == PREFIX {
                let length = [
                    self.prefix[1],
                    self.prefix[2],
                    self.prefix[3],
                    self.prefix[4],
                ];
                self.left = u64::from(u32::from_be_bytes(length));
                self.prefix_read = 0;
            }
        }
        let under_way = self.under_way();
        (under_way, under_way && began)
    }

    fn under_way(&self) -> bool {
        self.prefix_read > 0 || self.left > 0
    }
}

impl hyper::body::Body for Deadline {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = self.project();
        match this.body.poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    match this.frames.follow(data) {
                        (false, _) => {
                            *this.timer = None;
                            this.hold.release();
                        }
                        // A message began: its deadline starts now.
                        (true, true) => {
                            *this.timer = Some(Box::pin(tokio::time::sleep(*this.within)));
                        }
                        (true, false) => {}
                    }
                    let read = usize::try_from(this.frames.read).unwrap_or(usize::MAX);
                    if this.frames.under_way() && !this.hold.grow_to(read) {
                        return Poll::Ready(Some(Err(axum::Error::new(
                            "the controller holds as many messages under way as \
                             intake.max_partial_body_bytes allows: try again later",
                        ))));
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Pending => {
                if let Some(timer) = this.timer.as_mut() {
                    ready!(timer.as_mut().poll(cx));
                    let within = *this.within;
                    return Poll::Ready(Some(Err(axum::Error::new(format!(
                        "a message begun was not whole within {within:?}"
                    )))));
                }
                Poll::Pending
            }
            other => other,
        }
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

    use bytes::Bytes;
    use http_body_util::BodyExt;

    use super::{Deadline, Frames};

    fn message(len: u32) -> Vec<u8> {
        let mut m = vec![0];
        m.extend_from_slice(&len.to_be_bytes());
        m.extend(std::iter::repeat_n(7u8, len as usize));
        m
    }

    /// However the bytes of a stream of messages are cut into frames, the framing is
    /// followed: under way exactly inside a message.
    #[test]
    fn framing_is_followed_across_any_cut() {
        let mut stream = Vec::new();
        let mut ends = Vec::new();
        for len in [0, 3, 300, 1, 70_000] {
            stream.extend(message(len));
            ends.push(stream.len());
        }
        for cut in [1, 2, 4, 5, 6, 7, 64, 1000, stream.len()] {
            let mut frames = Frames::default();
            let mut at = 0;
            for chunk in stream.chunks(cut) {
                let (under_way, _) = frames.follow(chunk);
                at += chunk.len();
                assert_eq!(under_way, !ends.contains(&at), "cut {cut}, at {at}");
            }
        }
    }

    type Sender = tokio::sync::mpsc::Sender<Result<Bytes, std::convert::Infallible>>;

    /// A body from a channel: the chunks sent to it arrive one by one.
    fn channel() -> (Sender, axum::body::Body) {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let stream = tonic::codegen::tokio_stream::wrappers::ReceiverStream::new(rx);
        (tx, axum::body::Body::from_stream(stream))
    }

    #[tokio::test(start_paused = true)]
    async fn a_message_begun_and_not_finished_fails_the_body_at_its_deadline() {
        let (tx, body) = channel();
        let mut body = Deadline::new(
            body,
            Duration::from_secs(10),
            &stanch_net::body::BodyBudget::new(1 << 20),
        );
        let whole = message(10);
        tx.send(Ok(Bytes::from(whole))).await.unwrap();
        body.frame().await.unwrap().unwrap();
        // Silent between messages for an hour: fine.
        let quiet = tokio::time::timeout(Duration::from_secs(3600), body.frame()).await;
        assert!(quiet.is_err(), "nothing to read, no error");
        // Half a message, then nothing.
        let half = message(100)[..50].to_vec();
        tx.send(Ok(Bytes::from(half))).await.unwrap();
        body.frame().await.unwrap().unwrap();
        let started = tokio::time::Instant::now();
        let failed = body.frame().await.unwrap();
        assert!(failed.is_err(), "the body fails");
        assert_eq!(started.elapsed(), Duration::from_secs(10));
    }

    /// Messages under way hold their bytes from the shared budget until they end;
    /// one that would pass it fails its body.
    #[tokio::test]
    async fn messages_under_way_share_the_budget_of_bodies_arriving() {
        let budget = stanch_net::body::BodyBudget::new(150);
        let m = message(100);
        let (tx1, body1) = channel();
        let mut first = Deadline::new(body1, Duration::from_secs(10), &budget);
        tx1.send(Ok(Bytes::copy_from_slice(&m[..80])))
            .await
            .unwrap();
        first.frame().await.unwrap().unwrap();
        assert_eq!(budget.held(), 80);
        let (tx2, body2) = channel();
        let mut second = Deadline::new(body2, Duration::from_secs(10), &budget);
        tx2.send(Ok(Bytes::copy_from_slice(&m[..80])))
            .await
            .unwrap();
        assert!(second.frame().await.unwrap().is_err(), "past the budget");
        // The first ends its message: its bytes are given back.
        tx1.send(Ok(Bytes::copy_from_slice(&m[80..])))
            .await
            .unwrap();
        first.frame().await.unwrap().unwrap();
        assert_eq!(budget.held(), 0);
        drop(second);
        assert_eq!(budget.held(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_message_that_ends_in_time_is_read_whole() {
        let (tx, body) = channel();
        let mut body = Deadline::new(
            body,
            Duration::from_secs(10),
            &stanch_net::body::BodyBudget::new(1 << 20),
        );
        let m = message(100);
        tx.send(Ok(Bytes::copy_from_slice(&m[..50]))).await.unwrap();
        body.frame().await.unwrap().unwrap();
        let rest = Bytes::copy_from_slice(&m[50..]);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(9)).await;
            tx.send(Ok(rest)).await.unwrap();
            std::future::pending::<()>().await;
        });
        let frame = body.frame().await.unwrap().expect("the rest arrives");
        assert_eq!(frame.into_data().unwrap().len(), 55);
        let quiet = tokio::time::timeout(Duration::from_secs(60), body.frame()).await;
        assert!(quiet.is_err(), "then quiet, no error");
    }
}
