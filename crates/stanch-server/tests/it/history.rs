//! The audit history over HTTP: `after` is a cursor, `before` pages back, and a
//! client that tails the history never misses an entry, however many arrive.

use futures_util::StreamExt;
use serde_json::{Value, json};

use crate::support::*;

async fn page(h: &Harness, query: &str) -> (Vec<u64>, u64, u64) {
    let r = h.get(&format!("/v1/history?{query}"), Some(READ)).await;
    assert_eq!(r.status(), 200, "{query}");
    let header = |name: &str| -> u64 { r.headers()[name].to_str().unwrap().parse().unwrap() };
    let (oldest, newest) = (
        header("x-stanch-history-oldest"),
        header("x-stanch-history-newest"),
    );
    let entries: Vec<Value> = r.json().await.unwrap();
    let seqs = entries.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
    (seqs, oldest, newest)
}

/// Blocks (and so history entries) on `count` fresh endpoints, 32 at a time.
async fn make_entries(h: &Harness, from: usize, count: usize) {
    futures_util::stream::iter(from..from + count)
        .for_each_concurrent(32, |i| async move {
            let body =
                json!({"endpoint": format!("http://ep-{i}:8000"), "ttl": "1h", "reason": "paging"});
            let r = h.admin("block", body).await;
            assert_eq!(r.status(), 200);
        })
        .await;
}

#[tokio::test]
async fn paging_reads_every_kept_entry_once_and_tailing_misses_none() {
    // More blocks than blocking.max_blocks allows by default.
    let mut config = test_config();
    config.blocking.max_blocks = 20_000;
    let h = Harness::with(Options {
        config,
        ..Options::default()
    })
    .await;
    make_entries(&h, 0, 4_000).await;
    let (_, oldest, newest) = page(&h, "limit=1").await;
    assert!(newest >= 10_000, "{newest} entries made");
    assert!(oldest > 1, "the oldest were dropped at history.max_entries");

    // Forward from before the oldest: every kept entry, once, in order.
    let mut cursor = 0;
    let mut read = Vec::new();
    for _ in 0..100 {
        let (seqs, _, _) = page(&h, &format!("after={cursor}&limit=1000")).await;
        let Some(&last) = seqs.last() else { break };
        cursor = last;
        read.extend(seqs);
    }
    assert_eq!(read, (oldest..=newest).collect::<Vec<_>>());

    // Backward from the newest.
    let (seqs, _, _) = page(&h, &format!("before={newest}&limit=3")).await;
    assert_eq!(seqs, vec![newest - 3, newest - 2, newest - 1]);

    // Tailing with small pages while far more than a page arrives between polls.
    let mut cursor = newest;
    make_entries(&h, 10_000, 40).await;
    let mut tailed = Vec::new();
    for _ in 0..100 {
        let (seqs, _, _) = page(&h, &format!("after={cursor}&limit=7")).await;
        let Some(&last) = seqs.last() else { break };
        cursor = last;
        tailed.extend(seqs);
    }
    let (_, _, now_newest) = page(&h, "limit=1").await;
    assert_eq!(tailed, (newest + 1..=now_newest).collect::<Vec<_>>());
}
