//! The tests of `gateways`.

use std::time::Duration;

use super::*;

fn gateways() -> (Gateways, Arc<Metrics>) {
    let metrics = Arc::new(Metrics::new());
    (Gateways::new(metrics.clone(), 10_000), metrics)
}

fn at(secs: u64) -> Timestamp {
    Timestamp::from_millis(1_800_000_000_000).saturating_add(Duration::from_secs(secs))
}

fn applied(v: u64) -> Report {
    Report {
        applied: Some(v),
        rejected: None,
    }
}

#[test]
fn only_a_gateway_with_no_watch_open_goes_stale_and_is_then_forgotten() {
    let (g, _) = gateways();
    g.record("streaming", WatchTransport::Grpc, applied(3), at(0));
    g.opened("streaming", WatchTransport::Grpc);
    g.record("polling", WatchTransport::LongPoll, applied(3), at(0));
    let now = at(STALE_AFTER_SECS + 1);
    let list = g.list(now, 3);
    assert_eq!(
        list.iter()
            .map(|s| (s.id.as_str(), s.stale))
            .collect::<Vec<_>>(),
        [("polling", true), ("streaming", false)]
    );
    let later = at(FORGET_AFTER_SECS + 1);
    let ids: Vec<String> = g.list(later, 3).into_iter().map(|s| s.id).collect();
    assert_eq!(ids, ["streaming"], "an open watch is never forgotten");
    g.closed("streaming", later);
    assert!(!g.list(later, 3)[0].connected);
    assert!(!g.list(later, 3)[0].stale, "just closed");
}

#[test]
fn a_watch_open_keeps_its_transport_against_the_requests_beside_it() {
    let (g, _) = gateways();
    g.record("gw", WatchTransport::Sse, Report::default(), at(0));
    g.opened("gw", WatchTransport::Sse);
    // The SSE gateway acknowledges with a long-poll that waits.
    g.record("gw", WatchTransport::LongPoll, applied(4), at(1));
    g.opened("gw", WatchTransport::LongPoll);
    g.closed("gw", at(1));
    assert_eq!(g.list(at(1), 4)[0].transport, WatchTransport::Sse);
    g.closed("gw", at(2));
    g.record("gw", WatchTransport::LongPoll, applied(4), at(3));
    assert_eq!(g.list(at(3), 4)[0].transport, WatchTransport::LongPoll);
}

#[test]
fn while_a_grpc_watch_is_open_only_it_says_what_its_gateway_applied() {
    let (g, metrics) = gateways();
    g.record("gw", WatchTransport::Grpc, applied(5), at(0));
    g.opened("gw", WatchTransport::Grpc);
    // Anyone with the read token can name the gateway in a watch request's headers.
    for transport in [
        WatchTransport::LongPoll,
        WatchTransport::Sse,
        WatchTransport::Poll,
    ] {
        g.record(
            "gw",
            transport,
            Report {
                applied: Some(1),
                rejected: Some((5, "forged".into())),
            },
            at(1),
        );
    }
    let status = &g.list(at(1), 5)[0];
    assert_eq!(status.applied_version, Some(5));
    assert!(status.rejected.is_none(), "{:?}", status.rejected);
    assert_eq!(status.transport, WatchTransport::Grpc);
    assert!(
        !metrics.encode().contains("stanch_gateway_nacks_total{"),
        "no refusal was counted"
    );
    // Its own Acks still move it.
    g.record("gw", WatchTransport::Grpc, applied(6), at(2));
    assert_eq!(g.list(at(2), 6)[0].applied_version, Some(6));
    // Once the watch is closed, the gateway may report over HTTP again.
    g.closed("gw", at(3));
    g.record("gw", WatchTransport::LongPoll, applied(7), at(4));
    assert_eq!(g.list(at(4), 7)[0].applied_version, Some(7));
}

#[test]
fn a_refused_version_is_counted_once_however_often_it_is_reported() {
    let (g, metrics) = gateways();
    let refuse = |v: u64| Report {
        applied: Some(1),
        rejected: Some((v, "unknown pool".into())),
    };
    for _ in 0..3 {
        g.record("gw", WatchTransport::LongPoll, refuse(2), at(0));
    }
    g.record("gw", WatchTransport::LongPoll, refuse(3), at(0));
    let text = metrics.encode();
    assert!(
        text.contains(r#"stanch_gateway_nacks_total{transport="long_poll"} 2"#),
        "{text}"
    );
}

#[test]
fn the_gauges_count_by_state_and_transport_and_the_lag_of_those_not_stale() {
    let (g, metrics) = gateways();
    g.record("a", WatchTransport::Grpc, applied(10), at(0));
    g.record("b", WatchTransport::Grpc, applied(7), at(0));
    g.record("c", WatchTransport::Sse, Report::default(), at(0));
    g.record("gone", WatchTransport::Grpc, applied(1), at(0));
    for id in ["a", "b", "c"] {
        g.opened(
            id,
            if id == "c" {
                WatchTransport::Sse
            } else {
                WatchTransport::Grpc
            },
        );
    }
    g.export(at(STALE_AFTER_SECS + 1), 10);
    let text = metrics.encode();
    for line in [
        r#"stanch_gateways{kind="converged",transport="grpc"} 1"#,
        r#"stanch_gateways{kind="lagging",transport="grpc"} 1"#,
        r#"stanch_gateways{kind="stale",transport="grpc"} 1"#,
        r#"stanch_gateways{kind="lagging",transport="sse"} 1"#,
        r#"stanch_gateways{kind="converged",transport="poll"} 0"#,
        r#"stanch_gateway_max_lag_versions{transport="grpc"} 3"#,
        r#"stanch_gateway_max_lag_versions{transport="sse"} 10"#,
    ] {
        assert!(text.contains(line), "{line}\n{text}");
    }
}

#[derive(Debug, Clone)]
enum Event {
    /// A request naming the gateway, with no watch held (a poll, an Ack).
    Heard(u8),
    /// A watch opened, if `watch.max_watchers` allows one more.
    Opened(u8),
    /// A watch it holds closed.
    Closed(u8),
}

fn event() -> impl proptest::strategy::Strategy<Value = Event> {
    use proptest::prelude::*;
    // More gateways than are remembered, so the list fills and must forget.
    prop_oneof![
        (0..40u8).prop_map(Event::Heard),
        (0..40u8).prop_map(Event::Opened),
        (0..40u8).prop_map(Event::Closed),
    ]
}

proptest::proptest! {
    /// However many gateways come and go, the list stays within twice
    /// `watch.max_watchers`, never drops a gateway that holds a watch (nor what it
    /// applied), and always has the one just heard from.
    #[test]
    fn a_full_list_forgets_only_gateways_without_a_watch(
        events in proptest::collection::vec(event(), 1..400)
    ) {
        const MAX_WATCHERS: usize = 4;
        let g = Gateways::new(Arc::new(Metrics::new()), MAX_WATCHERS);
        // What each gateway holds open, and the version it last applied.
        let mut open: HashMap<String, (u32, u64)> = HashMap::new();
        for (i, event) in events.into_iter().enumerate() {
            let (now, version) = (at(i as u64), i as u64);
            let heard = match event {
                Event::Heard(n) => {
                    let id = format!("gw-{n}");
                    // A gateway holding a gRPC watch is spoken for by it alone.
                    g.record(&id, WatchTransport::LongPoll, applied(version), now);
                    Some(id)
                }
                Event::Opened(n) => {
                    let total: u32 = open.values().map(|(o, _)| o).sum();
                    let id = format!("gw-{n}");
                    if total as usize == MAX_WATCHERS {
                        None
                    } else {
                        g.record(&id, WatchTransport::Grpc, applied(version), now);
                        g.opened(&id, WatchTransport::Grpc);
                        let o = open.entry(id.clone()).or_default();
                        *o = (o.0 + 1, version);
                        Some(id)
                    }
                }
                Event::Closed(n) => {
                    let id = format!("gw-{n}");
                    if let Some(o) = open.get_mut(&id) {
                        g.closed(&id, now);
                        o.0 -= 1;
                        if o.0 == 0 {
                            open.remove(&id);
                        }
                    }
                    None
                }
            };
            let list = g.list(now, version);
            proptest::prop_assert!(list.len() <= 2 * MAX_WATCHERS, "{} remembered", list.len());
            for (id, (_, applied)) in &open {
                let kept = list.iter().find(|s| s.id == *id);
                proptest::prop_assert!(
                    kept.is_some_and(|s| s.connected && s.applied_version == Some(*applied)),
                    "{id} holds a watch: {kept:?}"
                );
            }
            if let Some(id) = heard {
                proptest::prop_assert!(list.iter().any(|s| s.id == id), "{id} just heard");
            }
        }
    }
}

#[test]
fn identities_and_reasons_are_bounded_and_printable() {
    assert!(valid_id("gw-1"));
    for bad in ["", "a\nb", &"x".repeat(MAX_ID_LEN + 1)] {
        assert!(!valid_id(bad), "{bad:?}");
    }
    assert_eq!(clean_reason("  "), "no reason given");
    assert_eq!(clean_reason("a\r\nb"), "a  b");
    assert_eq!(
        clean_reason(&"é".repeat(1000)).chars().count(),
        MAX_REASON_CHARS
    );
}
