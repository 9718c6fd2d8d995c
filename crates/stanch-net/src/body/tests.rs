//! The tests of `body`.

use std::convert::Infallible;

use http_body_util::{Full, StreamBody};
use hyper::body::Frame;

use super::*;

type Chunks =
    StreamBody<futures_util::stream::BoxStream<'static, Result<Frame<Bytes>, Infallible>>>;

/// A body of `chunks`, each after `gap`, then silence if `stall`.
fn trickle(chunks: Vec<&'static [u8]>, gap: Duration, stall: bool) -> Chunks {
    use futures_util::StreamExt;
    let frames = futures_util::stream::iter(chunks).then(move |c| async move {
        tokio::time::sleep(gap).await;
        Ok(Frame::data(Bytes::from_static(c)))
    });
    let tail = if stall {
        futures_util::stream::pending().boxed()
    } else {
        futures_util::stream::empty().boxed()
    };
    StreamBody::new(frames.chain(tail).boxed())
}

fn limits() -> BodyLimits {
    BodyLimits {
        max_bytes: 1024,
        timeout: Duration::from_secs(10),
        min_rate: 100,
    }
}

#[tokio::test(start_paused = true)]
async fn a_whole_body_is_read_and_costs_the_budget_nothing() {
    let budget = BodyBudget::new(0);
    let body = Full::new(Bytes::from_static(b"{\"model\":\"m\"}"));
    let read = read_whole(body, &limits(), Some(&budget)).await.unwrap();
    assert_eq!(&read[..], b"{\"model\":\"m\"}");
    let split = trickle(vec![b"ab", b"cd"], Duration::from_millis(5), false);
    assert!(
        matches!(
            read_whole(split, &limits(), Some(&budget)).await,
            Err(BodyError::Busy)
        ),
        "a body held across a wait needs room in the budget"
    );
}

/// A body of these frames (`None`: a trailers frame), then the error `end`.
fn frames(
    frames: Vec<Option<&'static str>>,
    end: Option<&'static str>,
) -> StreamBody<impl futures_util::Stream<Item = Result<Frame<Bytes>, &'static str>> + Unpin> {
    let items = frames
        .into_iter()
        .map(|f| {
            Ok(match f {
                Some(data) => Frame::data(Bytes::from_static(data.as_bytes())),
                None => Frame::trailers(Default::default()),
            })
        })
        .chain(end.map(Err));
    StreamBody::new(futures_util::stream::iter(items))
}

#[tokio::test(start_paused = true)]
async fn frames_are_joined_without_a_copy_of_one() {
    let small = |max_bytes| BodyLimits {
        max_bytes,
        ..limits()
    };
    // One frame passes as it came.
    let one = Bytes::from_static(b"{\"model\":\"m\"}");
    let frame = StreamBody::new(futures_util::stream::iter([Ok::<_, &str>(Frame::data(
        one.clone(),
    ))]));
    let read = read_whole(frame, &small(64), None).await.unwrap();
    assert_eq!(read.as_ptr(), one.as_ptr(), "not copied");
    // Several are joined; trailers are skipped.
    let read = read_whole(
        frames(vec![Some("ab"), None, Some("cd"), Some("e")], None),
        &small(5),
        None,
    )
    .await
    .unwrap();
    assert_eq!(read, "abcde");
    assert_eq!(
        read_whole(frames(vec![], None), &small(5), None)
            .await
            .unwrap(),
        ""
    );
    // One byte over, in whichever frame, is too large.
    let over = read_whole(
        frames(vec![Some("abc"), Some("def")], None),
        &small(5),
        None,
    )
    .await;
    assert!(matches!(over, Err(BodyError::TooLarge(5))), "{over:?}");
    // A body that breaks off is an error, whatever came before.
    let broken = read_whole(frames(vec![Some("ab")], Some("reset")), &small(5), None).await;
    assert!(
        matches!(broken, Err(BodyError::Broken("reset"))),
        "{broken:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_stalled_body_times_out_and_gives_its_bytes_back() {
    let budget = BodyBudget::new(1 << 20);
    let started = Instant::now();
    let body = trickle(vec![b"{\"a\":"], Duration::from_millis(1), true);
    let err = read_whole(body, &limits(), Some(&budget))
        .await
        .unwrap_err();
    assert!(matches!(err, BodyError::TimedOut(_)), "{err}");
    assert_eq!(
        started.elapsed(),
        Duration::from_secs(10) + Duration::from_millis(0)
    );
    assert_eq!(budget.held(), 0);
}

#[tokio::test(start_paused = true)]
async fn bytes_received_extend_the_deadline_at_the_minimum_rate() {
    let budget = BodyBudget::new(1 << 20);
    // 100 bytes a second is the minimum: 11 chunks of 100 bytes 1 s apart keep
    // the deadline ahead (10 s, plus a second per 100 bytes).
    let chunk: &'static [u8] = &[b'x'; 100];
    let steady = trickle(vec![chunk; 10], Duration::from_secs(1), false);
    let read = read_whole(steady, &limits(), Some(&budget)).await.unwrap();
    assert_eq!(read.len(), 1000);
    // Ten bytes every two seconds falls behind and is cut off.
    let slow: &'static [u8] = b"0123456789";
    let trickling = trickle(vec![slow; 100], Duration::from_secs(2), false);
    let started = Instant::now();
    let err = read_whole(trickling, &limits(), Some(&budget))
        .await
        .unwrap_err();
    assert!(matches!(err, BodyError::TimedOut(_)), "{err}");
    assert!(
        started.elapsed() <= Duration::from_secs(11),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test(start_paused = true)]
async fn too_large_is_refused_by_declared_or_received_length() {
    let budget = BodyBudget::new(1 << 20);
    let body = Full::new(Bytes::from(vec![0u8; 2048]));
    assert!(matches!(
        read_whole(body, &limits(), Some(&budget)).await,
        Err(BodyError::TooLarge(1024))
    ));
    let chunk: &'static [u8] = &[b'x'; 600];
    let body = trickle(vec![chunk, chunk], Duration::from_millis(1), false);
    assert!(matches!(
        read_whole(body, &limits(), Some(&budget)).await,
        Err(BodyError::TooLarge(1024))
    ));
    assert_eq!(budget.held(), 0);
}

#[tokio::test(start_paused = true)]
async fn partial_bodies_together_stay_within_the_budget() {
    let budget = BodyBudget::new(250);
    let chunk: &'static [u8] = &[b'x'; 100];
    let mut readers = Vec::new();
    for _ in 0..5 {
        let body = trickle(vec![chunk], Duration::from_millis(1), true);
        let budget = budget.clone();
        readers.push(tokio::spawn(async move {
            read_whole(body, &limits(), Some(&budget))
                .await
                .map(|b| b.len())
        }));
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(budget.held(), 200, "two fit, three are refused");
    let mut busy = 0;
    for r in readers {
        if let Err(BodyError::Busy) = r.await.unwrap() {
            busy += 1;
        }
    }
    assert_eq!(busy, 3);
    assert_eq!(budget.held(), 0, "every reader gave its bytes back");
}
