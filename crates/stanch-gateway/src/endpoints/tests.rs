//! The tests of `endpoints`.

use std::time::Duration;

use super::*;
use crate::config::BlockingPolicy;
use crate::outcome::Outcome;
use crate::table::Applied;

/// An endpoint of model `m` in pool `p`, capacity 10.
fn endpoint(
    url: &str,
    weight: u32,
    key: Option<&str>,
    alone: bool,
) -> Result<Endpoint, SetupError> {
    Endpoint::new(
        url,
        "m",
        "p",
        weight,
        10,
        None,
        key.map(SecretString::from),
        alone,
        &Connector::testing(),
    )
}

fn ep(url: &str, alone: bool) -> Endpoint {
    endpoint(url, 1, None, alone).unwrap()
}

#[test]
fn a_table_block_names_an_endpoint_by_url_or_host_and_port() {
    let e = Endpoint::new(
        "http://10.0.0.7:8000",
        "qwen-72b",
        "dc-a",
        1,
        10,
        None,
        None,
        false,
        &Connector::testing(),
    )
    .unwrap();
    use stanch_api::BlockedEndpoint;
    let block = |endpoint: &str, model: Option<&str>, until: i64| BlockedEndpoint {
        endpoint: endpoint.to_owned(),
        model: model.map(str::to_owned),
        until: Timestamp::from_millis(until),
        reason: "test".into(),
    };
    let table = |blocked: Vec<BlockedEndpoint>| {
        Applied::new(std::sync::Arc::new(stanch_api::RouteTable {
            version: 1,
            epoch: "e".into(),
            hash: String::new(),
            generated_at: Timestamp::from_millis(0),
            models: Default::default(),
            blocked,
        }))
    };
    let now = Timestamp::from_millis(1_000);
    let blocked = |b: BlockedEndpoint| e.blocked_by(&table(vec![b]), now);
    assert_eq!(
        blocked(block("http://10.0.0.7:8000", None, 2_000)),
        Some(Timestamp::from_millis(2_000))
    );
    assert_eq!(
        blocked(block("10.0.0.7:8000", Some("qwen-72b"), 3_000)),
        Some(Timestamp::from_millis(3_000))
    );
    assert_eq!(
        blocked(block("0.0.7:8000", None, 2_000)),
        None,
        "a suffix is not a host"
    );
    assert_eq!(
        blocked(block("10.0.0.7:8000", Some("qwen-14b"), 2_000)),
        None,
        "another model"
    );
    assert_eq!(blocked(block("10.0.0.7:8000", None, 500)), None, "expired");
}

/// Records `outcome`, sent and known at `now` (taking no time).
fn record_at(
    e: &Endpoint,
    outcome: &Outcome,
    p: &BlockingPolicy,
    now: Instant,
) -> Option<NewBlock> {
    e.record(
        outcome,
        now,
        Duration::ZERO,
        Work::Whole(1),
        p,
        now,
        Timestamp::from_millis(0),
    )
}

/// Records `outcome`, known at `done`, `took` after it was sent.
fn record_took(
    e: &Endpoint,
    outcome: &Outcome,
    p: &BlockingPolicy,
    took: Duration,
    done: Instant,
) -> Option<NewBlock> {
    e.record(
        outcome,
        done - took,
        took,
        Work::Whole(1),
        p,
        done,
        Timestamp::from_millis(0),
    )
}

fn policy() -> BlockingPolicy {
    BlockingPolicy {
        consecutive_failures: 3,
        jitter: 0.0,
        ..BlockingPolicy::default()
    }
}

#[test]
fn every_thread_draws_its_own_random_numbers() {
    // A fixed seed would give every thread, and every replica, the same numbers.
    let draws = || (0..4).map(|_| next_random()).collect::<Vec<_>>();
    let here = draws();
    let there = std::thread::spawn(draws).join().unwrap();
    assert_ne!(here, there);
    assert!(here.iter().chain(&there).all(|&x| x != 0));
}

#[test]
fn paths_and_host_are_made_once_from_the_url() {
    let e = ep("http://10.0.0.7:8000/", false);
    assert_eq!(e.url, "http://10.0.0.7:8000");
    assert_eq!(e.paths[0], "/v1/chat/completions");
    assert_eq!(e.paths[2], "/v1/embeddings");
    assert_eq!(e.conns.host(), "10.0.0.7:8000");
    let request = e.post(1, ());
    assert_eq!(request.uri(), "/v1/completions", "origin form");
    assert_eq!(request.headers()["host"], "10.0.0.7:8000");
    let prefixed = ep("http://llm.internal/openai/", false);
    assert_eq!(prefixed.paths[0], "/openai/v1/chat/completions");
    assert_eq!(prefixed.conns.host(), "llm.internal");
    assert!(endpoint("ftp//nohost", 1, None, false).is_err());
    let unsendable = endpoint("http://10.0.0.7:8000", 1, Some("sk-\nline"), false);
    let why = unsendable.expect_err("a key a header cannot carry stops the start");
    assert!(matches!(why, SetupError::Key), "{why}");
    assert!(
        !why.to_string().contains("sk-"),
        "the key is never shown: {why}"
    );
    assert!(request.headers().get("authorization").is_none());

    let keyed = endpoint("http://10.0.0.7:8000", 1, Some("sk-test"), false).unwrap();
    let request = keyed.post(0, ());
    let authorization = &request.headers()["authorization"];
    assert_eq!(authorization, "Bearer sk-test");
    assert!(authorization.is_sensitive(), "kept out of debug output");
    assert!(
        !format!("{keyed:?}").contains("sk-test"),
        "nor in the endpoint's"
    );
}

#[tokio::test(start_paused = true)]
async fn reports_carry_the_run_a_block_ended() {
    let e = ep("http://a", false);
    let (p, now) = (policy(), Instant::now());
    let fail = Outcome::ServerError(503);
    record_at(&e, &Outcome::Success, &p, now);
    for _ in 0..3 {
        record_at(&e, &fail, &p, now);
    }
    assert!(e.blocked(now).is_some());
    assert_eq!(e.counts(), (1, 3, 0), "the block ended the run");
    assert_eq!(e.report_counts(), (1, 3, 3), "the report still carries it");
    assert_eq!(e.report_counts(), (1, 3, 0), "once");
    record_at(&e, &fail, &p, now);
    record_at(&e, &Outcome::Success, &p, now);
    assert_eq!(e.report_counts(), (2, 4, 1));
}

/// Requests already out when an endpoint starts failing may come back well: the
/// upstream answered them before the fault. They do not end the run of failures;
/// a success sent after the first failure was seen does.
#[tokio::test(start_paused = true)]
async fn only_a_success_sent_after_the_failures_began_ends_their_run() {
    let e = ep("http://a", false);
    let p = policy();
    let start = Instant::now();
    let fail = Outcome::ServerError(503);
    let at = |ms| start + Duration::from_millis(ms);
    record_took(&e, &fail, &p, Duration::from_millis(5), at(100));
    // Sent at 90 ms, before the first failure was seen at 100 ms.
    record_took(
        &e,
        &Outcome::Success,
        &p,
        Duration::from_millis(20),
        at(110),
    );
    assert_eq!(e.counts().2, 1, "the run goes on");
    let b = record_took(&e, &fail, &p, Duration::from_millis(5), at(120));
    assert!(b.is_none());
    let b = record_took(&e, &fail, &p, Duration::from_millis(5), at(130));
    assert_eq!(
        b.map(|b| b.trigger),
        Some("consecutive_failures"),
        "three in a row"
    );

    // After the block: a success sent after a new run began ends it.
    let later = at(130) + Duration::from_secs(120);
    record_took(&e, &fail, &p, Duration::from_millis(5), later);
    let then = later + Duration::from_millis(50);
    record_took(&e, &Outcome::Success, &p, Duration::from_millis(20), then);
    assert_eq!(e.counts().2, 0, "sent 30 ms after the failure");
}

#[tokio::test(start_paused = true)]
async fn a_failure_is_a_one_off_only_while_the_run_is_the_requests_own_and_nothing_else_is_out() {
    let e = std::sync::Arc::new(ep("http://a", false));
    let p = policy();
    let now = Instant::now();
    let fail = Outcome::ServerError(503);
    record_at(&e, &fail, &p, now);
    assert!(e.one_off_failure(1), "the first failure, nothing else out");
    {
        let _other = e.start();
        assert!(!e.one_off_failure(1), "another request is out");
    }
    record_at(&e, &fail, &p, now);
    assert!(!e.one_off_failure(1), "another request failed here too");
    assert!(e.one_off_failure(2), "both failures were this request's");
    record_at(&e, &Outcome::Success, &p, now + Duration::from_millis(1));
    assert!(e.one_off_failure(0), "a success ends the run");
}

#[tokio::test(start_paused = true)]
async fn consecutive_failures_block_with_backoff() {
    let e = ep("http://a", false);
    let p = policy();
    let now = Instant::now();
    let fail = Outcome::ServerError(503);
    assert!(record_at(&e, &fail, &p, now).is_none());
    assert!(record_at(&e, &fail, &p, now).is_none());
    let b = record_at(&e, &fail, &p, now).expect("third failure blocks");
    assert_eq!(
        (b.ttl, b.strikes, b.trigger),
        (Duration::from_secs(60), 1, "consecutive_failures")
    );
    assert!(e.blocked(now).is_some());
    let later = now + Duration::from_secs(61);
    assert!(e.blocked(later).is_none());
    for _ in 0..2 {
        record_at(&e, &fail, &p, later);
    }
    let b = record_at(&e, &fail, &p, later).unwrap();
    assert_eq!(
        (b.ttl, b.strikes),
        (Duration::from_secs(120), 2),
        "repeat offender"
    );
}

#[tokio::test(start_paused = true)]
async fn caller_faults_and_successes_do_not_count() {
    let e = ep("http://a", false);
    let p = policy();
    let now = Instant::now();
    for _ in 0..10 {
        assert!(record_at(&e, &Outcome::CallerFault(400), &p, now).is_none());
    }
    record_at(&e, &Outcome::ServerError(500), &p, now);
    // Sent after the failure was seen, so it ends the run.
    record_took(
        &e,
        &Outcome::Success,
        &p,
        Duration::from_millis(5),
        now + Duration::from_millis(10),
    );
    record_at(&e, &Outcome::ServerError(500), &p, now);
    assert!(
        record_at(&e, &Outcome::ServerError(500), &p, now).is_none(),
        "the run was broken"
    );
}

#[tokio::test(start_paused = true)]
async fn rate_and_window_triggers_and_guards() {
    let now = Instant::now();
    let rate = BlockingPolicy {
        consecutive_failures: 0,
        failure_rate: 0.5,
        min_requests: 4,
        jitter: 0.0,
        ..BlockingPolicy::default()
    };
    let e = ep("http://a", false);
    record_at(&e, &Outcome::Success, &rate, now);
    record_at(&e, &Outcome::Connect, &rate, now);
    record_at(&e, &Outcome::Success, &rate, now);
    assert_eq!(
        record_at(&e, &Outcome::Connect, &rate, now)
            .unwrap()
            .trigger,
        "failure_rate"
    );

    let never = BlockingPolicy {
        never_block: vec!["http://canary*".into()],
        ..policy()
    };
    let c = ep("http://canary-1", false);
    for _ in 0..5 {
        assert!(record_at(&c, &Outcome::Connect, &never, now).is_none());
    }

    let alone = ep("http://solo", true);
    let p = policy();
    for _ in 0..3 {
        record_at(&alone, &Outcome::Connect, &p, now);
    }
    assert!(alone.blocked(now).is_some(), "a first block is allowed");
    let later = now + Duration::from_secs(61);
    for _ in 0..3 {
        assert!(record_at(&alone, &Outcome::Connect, &p, later).is_none());
    }
    assert!(
        alone.blocked(later).is_none(),
        "not extended on the only endpoint"
    );
}

#[tokio::test(start_paused = true)]
async fn choosing_prefers_open_fast_idle_endpoints() {
    let now = Instant::now();
    let p = policy();
    let (fast, slow, blocked) = (
        ep("http://fast", false),
        ep("http://slow", false),
        ep("http://blocked", false),
    );
    for _ in 0..5 {
        record_took(&fast, &Outcome::Success, &p, Duration::from_millis(5), now);
        record_took(
            &slow,
            &Outcome::Success,
            &p,
            Duration::from_millis(500),
            now,
        );
    }
    for _ in 0..3 {
        record_at(&blocked, &Outcome::Connect, &p, now);
    }
    let all = [&fast, &slow, &blocked];
    let mut fast_picks = 0;
    for _ in 0..200 {
        let (e, all_blocked) = choose(&all, |_| None, Kind::Whole, now, Duration::ZERO).unwrap();
        assert!(!all_blocked);
        assert_ne!(e.url, "http://blocked");
        if e.url == "http://fast" {
            fast_picks += 1;
        }
    }
    assert_eq!(fast_picks, 200, "with two open endpoints P2C compares both");
    let (e, all_blocked) = choose(&[&blocked], |_| None, Kind::Whole, now, Duration::ZERO).unwrap();
    assert!(
        all_blocked && e.url == "http://blocked",
        "blocked is lowest priority, not gone"
    );
    let (e, _) = choose(
        &[&fast, &slow],
        |e| (e.url == "http://fast").then_some(Duration::from_secs(1)),
        Kind::Whole,
        now,
        Duration::ZERO,
    )
    .unwrap();
    assert_eq!(e.url, "http://slow", "the route table's blocks count too");

    // Every candidate blocked: the one whose block ends soonest, whoever made it.
    let (local, by_table) = (ep("http://local", false), ep("http://by-table", false));
    for _ in 0..3 {
        record_at(&local, &Outcome::Connect, &p, now);
    }
    let table = |e: &Endpoint| (e.url == "http://by-table").then_some(Duration::from_secs(300));
    let (e, all_blocked) = choose(
        &[&local, &by_table],
        table,
        Kind::Whole,
        now,
        Duration::ZERO,
    )
    .unwrap();
    assert!(all_blocked);
    assert_eq!(
        e.url, "http://local",
        "60 s left here beats 300 s left in the table"
    );

    // Failing, not yet blocked, with a request out: no second one until it is back.
    let (failing, healthy) = (
        std::sync::Arc::new(ep("http://failing", false)),
        ep("http://healthy", false),
    );
    record_at(&failing, &Outcome::Connect, &p, now);
    let out = failing.start();
    for _ in 0..50 {
        let (e, _) = choose(
            &[&failing, &healthy],
            |_| None,
            Kind::Whole,
            now,
            Duration::ZERO,
        )
        .unwrap();
        assert_eq!(e.url, "http://healthy");
    }
    let (_, held) = choose(&[&failing], |_| None, Kind::Whole, now, Duration::ZERO).unwrap();
    assert!(held, "alone, it is used as a last resort");
    drop(out);
    let (_, held) = choose(&[&failing], |_| None, Kind::Whole, now, Duration::ZERO).unwrap();
    assert!(!held, "with nothing out, it is open again");
}

#[tokio::test(start_paused = true)]
async fn failures_within_the_window_block() {
    let now = Instant::now();
    let window = BlockingPolicy {
        consecutive_failures: 0,
        window_failures: 3,
        jitter: 0.0,
        ..BlockingPolicy::default()
    };
    let e = ep("http://a", false);
    // Successes in between: never three in a row, yet three within the window.
    for _ in 0..2 {
        record_at(&e, &Outcome::Connect, &window, now);
        record_at(&e, &Outcome::Success, &window, now);
    }
    let block = record_at(&e, &Outcome::Connect, &window, now)
        .expect("the third failure in the window blocks");
    assert_eq!(block.trigger, "window_failures");

    // Failures older than the window no longer count.
    let f = ep("http://b", false);
    record_at(&f, &Outcome::Connect, &window, now);
    record_at(&f, &Outcome::Connect, &window, now);
    let later = now + window.window.0 + Duration::from_secs(1);
    assert!(record_at(&f, &Outcome::Connect, &window, later).is_none());
}

#[tokio::test(start_paused = true)]
async fn weights_and_slow_start_set_the_shares() {
    let now = Instant::now();
    let p = policy();
    let heavy = endpoint("http://heavy", 3, None, false).unwrap();
    let light = ep("http://light", false);
    for e in [&heavy, &light] {
        record_took(e, &Outcome::Success, &p, Duration::from_millis(50), now);
    }
    let share = |a: &Endpoint, b: &Endpoint, at: Instant, slow_start: Duration| {
        (0..300)
            .filter(|_| {
                choose(&[a, b], |_| None, Kind::Whole, at, slow_start)
                    .unwrap()
                    .0
                    .url
                    == a.url
            })
            .count()
    };
    // Equal latency: the weight-3 endpoint scores three times better and wins every
    // comparison.
    assert_eq!(share(&heavy, &light, now, Duration::ZERO), 300);

    // Just back from a block, an endpoint starts at a tenth of its weight and ramps
    // up over the slow-start window.
    let back = ep("http://back", false);
    let peer = ep("http://peer", false);
    for _ in 0..3 {
        record_at(&back, &Outcome::Connect, &p, now);
    }
    let ended = now + Duration::from_secs(61);
    for e in [&back, &peer] {
        record_took(e, &Outcome::Success, &p, Duration::from_millis(50), ended);
    }
    let slow_start = Duration::from_secs(30);
    assert_eq!(
        share(&back, &peer, ended + Duration::from_secs(1), slow_start),
        0
    );
    assert!(share(&back, &peer, ended + Duration::from_secs(40), slow_start) > 0);
}
