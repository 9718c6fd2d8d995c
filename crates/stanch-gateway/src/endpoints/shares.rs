//! How load splits among endpoints, by simulation: callers send back to back over
//! simulated time, endpoints answer after a latency that grows with their load, and
//! the test counts where requests went. Choosing and recording are the real ones.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::Arc;
use std::time::Duration;

use stanch_api::Timestamp;
use stanch_api::hash::Fnv64;
use tokio::time::Instant;

use crate::config::BlockingPolicy;
use crate::outcome::Outcome;

use super::*;

/// A simulated endpoint's answer to its `n`th request, sent at `at` with `busy` others
/// in flight there: (how long it takes, the work it was).
type Answer = dyn Fn(usize, u64, Duration, u32) -> (Duration, Work);

struct Run {
    /// Requests each endpoint got, in the whole run and per second.
    per_second: Vec<Vec<u64>>,
}

impl Run {
    /// Each endpoint's share of the requests sent in `[from, to)` seconds.
    fn shares(&self, from: usize, to: usize) -> Vec<f64> {
        let counts: Vec<u64> = self
            .per_second
            .iter()
            .map(|s| s[from..to.min(s.len())].iter().sum())
            .collect();
        let total: u64 = counts.iter().sum::<u64>().max(1);
        counts.iter().map(|&c| c as f64 / total as f64).collect()
    }
}

/// Ten milliseconds of noise either way on a base latency, from the request's number.
fn noise(i: usize, n: u64) -> f64 {
    let mut h = Fnv64::default();
    h.write(&(i as u64).to_le_bytes());
    h.write(&n.to_le_bytes());
    (h.finish() % 2001) as f64 / 1000.0 - 1.0
}

/// A model server: `base` plus 5 % per request already in flight there, ±10 %, and a
/// tail: one answer in fifty takes five times as long (a long prompt, a pause).
fn server(base: Duration) -> impl Fn(usize, u64, Duration, u32) -> (Duration, Work) {
    move |i, n, _, busy| {
        let load = 1.0 + 0.05 * f64::from(busy);
        let tail = if (noise(i, n + 7) + 1.0) * 1000.0 < 40.0 {
            5.0
        } else {
            1.0
        };
        (
            base.mul_f64(load * tail * (1.0 + 0.1 * noise(i, n))),
            Work::Whole(1),
        )
    }
}

fn simulate(
    endpoints: &[Arc<Endpoint>],
    callers: usize,
    seconds: u64,
    slow_start: Duration,
    answer: &Answer,
) -> Run {
    struct Out {
        done: Duration,
        endpoint: usize,
        sent: Duration,
        work: Work,
        _slot: InFlight,
    }
    let t0 = Instant::now();
    let policy = BlockingPolicy {
        jitter: 0.0,
        ..BlockingPolicy::default()
    };
    let refs: Vec<&Endpoint> = endpoints.iter().map(Arc::as_ref).collect();
    let mut per_second = vec![vec![0u64; seconds as usize]; endpoints.len()];
    let mut sent_to = vec![0u64; endpoints.len()];
    let mut busy = vec![0u32; endpoints.len()];
    // Requests out, by when they complete (and an order among equal times).
    let mut queue: BinaryHeap<Reverse<(Duration, u64)>> = BinaryHeap::new();
    let mut out: std::collections::HashMap<u64, Out> = Default::default();
    let mut next_id = 0u64;
    let end = Duration::from_secs(seconds);
    let mut send = |at: Duration,
                    queue: &mut BinaryHeap<Reverse<(Duration, u64)>>,
                    out: &mut std::collections::HashMap<u64, Out>,
                    busy: &mut [u32]| {
        let (chosen, _) = choose(&refs, |_| None, Kind::Whole, t0 + at, slow_start).unwrap();
        let i = refs.iter().position(|e| std::ptr::eq(*e, chosen)).unwrap();
        per_second[i][at.as_secs() as usize] += 1;
        let (took, work) = answer(i, sent_to[i], at, busy[i]);
        sent_to[i] += 1;
        busy[i] += 1;
        let done = at + took;
        out.insert(
            next_id,
            Out {
                done,
                endpoint: i,
                sent: at,
                work,
                _slot: endpoints[i].start(),
            },
        );
        queue.push(Reverse((done, next_id)));
        next_id += 1;
    };
    for _ in 0..callers {
        send(Duration::ZERO, &mut queue, &mut out, &mut busy);
    }
    while let Some(Reverse((done, id))) = queue.pop() {
        if done >= end {
            break;
        }
        let r = out.remove(&id).expect("a request out");
        endpoints[r.endpoint].record(
            &Outcome::Success,
            t0 + r.sent,
            r.done - r.sent,
            r.work,
            &policy,
            t0 + r.done,
            Timestamp::from_millis(0),
        );
        busy[r.endpoint] -= 1;
        drop(r);
        send(done, &mut queue, &mut out, &mut busy);
    }
    Run { per_second }
}

fn pool(n: usize) -> Vec<Arc<Endpoint>> {
    (0..n)
        .map(|i| {
            let url = format!("http://e{i}:8000");
            Arc::new(
                Endpoint::new(
                    &url,
                    "m",
                    "p",
                    1,
                    10,
                    None,
                    None,
                    false,
                    &Connector::testing(),
                )
                .unwrap(),
            )
        })
        .collect()
}

fn show(shares: &[f64]) -> String {
    shares
        .iter()
        .map(|s| format!("{:.1} %", s * 100.0))
        .collect::<Vec<_>>()
        .join(" / ")
}

#[tokio::test(start_paused = true)]
async fn equal_endpoints_share_within_a_few_percent() {
    for n in [3, 5, 10] {
        for callers in [1, 4, 16, 64] {
            let endpoints = pool(n);
            let run = simulate(
                &endpoints,
                callers,
                60,
                Duration::ZERO,
                &server(Duration::from_millis(100)),
            );
            let shares = run.shares(0, 60);
            let fair = 1.0 / n as f64;
            let within = |s: f64| match callers {
                // Many callers, as in the benchmark: within 10 % of a fair share.
                16.. => (s - fair).abs() <= fair * 0.10,
                // A few: within 2.5 points.
                2.. => (s - fair).abs() <= 0.025,
                // One at a time, every tail sample weighs: nobody starved or hogging.
                _ => s >= fair * 0.5 && s <= fair * 1.5,
            };
            assert!(
                shares.iter().all(|&s| within(s)),
                "{n} endpoints, {callers} callers: {}",
                show(&shares)
            );
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_slower_endpoint_gets_less_but_is_not_starved() {
    for n in [3, 5, 10] {
        let endpoints = pool(n);
        let fast = server(Duration::from_millis(100));
        let slow = server(Duration::from_millis(200));
        let answer = move |i: usize, k, at, busy| {
            if i == 0 {
                slow(i, k, at, busy)
            } else {
                fast(i, k, at, busy)
            }
        };
        let run = simulate(&endpoints, 16, 60, Duration::ZERO, &answer);
        let shares = run.shares(0, 60);
        let fair = 1.0 / n as f64;
        assert!(
            shares[0] < fair * 0.9 && shares[0] > fair * 0.2,
            "{n} endpoints, the first twice as slow: {}",
            show(&shares)
        );
        // And it is used throughout the run, not in bursts between long droughts.
        let every_10s: Vec<f64> = (0..6).map(|w| run.shares(w * 10, w * 10 + 10)[0]).collect();
        assert!(every_10s.iter().all(|&s| s > fair * 0.1), "{every_10s:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn one_slow_answer_does_not_starve_an_endpoint() {
    for n in [3, 5, 10] {
        let endpoints = pool(n);
        let normal = server(Duration::from_millis(100));
        // The first endpoint's first answer takes 30 s (a stalled model server).
        let answer = move |i: usize, k: u64, at, busy| {
            if i == 0 && k == 0 {
                (Duration::from_secs(30), Work::Whole(1))
            } else {
                normal(i, k, at, busy)
            }
        };
        let run = simulate(&endpoints, 16, 90, Duration::ZERO, &answer);
        let fair = 1.0 / n as f64;
        // Avoided for a while after the slow answer lands at 30 s; back in the last 30 s.
        let late = run.shares(60, 90);
        assert!(
            late[0] > fair * 0.8,
            "{n} endpoints, shares in 60..90 s: {}",
            show(&late)
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_long_completion_is_judged_per_token() {
    let endpoints = pool(3);
    // 10 ms a token everywhere; the first endpoint's first answer is 4,000 tokens
    // (40 s), the rest 50 tokens (0.5 s).
    let answer = |i: usize, k: u64, _at, _busy| {
        let tokens = if i == 0 && k == 0 { 4000 } else { 50 };
        (
            Duration::from_millis(10 * u64::from(tokens)),
            Work::Whole(tokens),
        )
    };
    let run = simulate(&endpoints, 16, 90, Duration::ZERO, &answer);
    let shares = run.shares(40, 90);
    for s in &shares {
        assert!(
            (s - 1.0 / 3.0).abs() < 0.05,
            "after the long answer: {}",
            show(&shares)
        );
    }
}

#[tokio::test(start_paused = true)]
async fn an_endpoint_back_from_a_block_ramps_up_to_its_share() {
    for n in [3, 5, 10] {
        let endpoints = pool(n);
        let t0 = Instant::now();
        let policy = BlockingPolicy {
            consecutive_failures: 3,
            jitter: 0.0,
            ttl: stanch_api::HumanDuration::secs(10),
            ..BlockingPolicy::default()
        };
        for _ in 0..3 {
            endpoints[0].record(
                &Outcome::Connect,
                t0,
                Duration::ZERO,
                Work::Whole(1),
                &policy,
                t0,
                Timestamp::from_millis(0),
            );
        }
        assert!(endpoints[0].blocked(t0).is_some());
        let run = simulate(
            &endpoints,
            16,
            60,
            Duration::from_secs(20),
            &server(Duration::from_millis(100)),
        );
        let fair = 1.0 / n as f64;
        assert!(
            run.shares(0, 9)[0] < 0.01,
            "blocked: {}",
            show(&run.shares(0, 9))
        );
        let ramping = run.shares(11, 20)[0];
        assert!(ramping > 0.0 && ramping < fair, "ramping up: {ramping}");
        let back = run.shares(40, 60);
        assert!(
            (back[0] - fair).abs() <= fair * 0.2,
            "{n} endpoints, after the ramp: {}",
            show(&back)
        );
    }
}
