//! How many connections a listener holds: at most [`ConnLimits::max_connections`]
//! in all and [`ConnLimits::max_per_source`] from one IP address, counted from
//! accept until the socket is closed (lingering included). A connection past either
//! is closed as soon as it is accepted, counted by why, and logged once a minute at
//! most, so a client that opens connections without end holds a bounded share of
//! memory and file descriptors, and the warning cannot flood the log.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use tracing::warn;

use crate::ConnLimits;
use crate::throttle::Throttled;

/// Why a connection was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// The listener held [`ConnLimits::max_connections`].
    Max,
    /// Its source held [`ConnLimits::max_per_source`].
    PerSource,
}

impl Refused {
    /// Every kind, for metrics that show each from the start.
    pub const ALL: [Refused; 2] = [Refused::Max, Refused::PerSource];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Refused::Max => "max",
            Refused::PerSource => "per_source",
        }
    }
}

/// A listener's limits and its connections: what is open, what was refused.
#[derive(Debug)]
pub struct Connections {
    limits: ConnLimits,
    open: AtomicUsize,
    /// Open connections per source, while `max_per_source` limits them; a source
    /// leaves when its last one closes.
    sources: Mutex<HashMap<IpAddr, usize>>,
    refused: [AtomicU64; 2],
    warning: Mutex<Throttled>,
}

impl Connections {
    /// A listener's, under `limits`.
    pub fn new(limits: ConnLimits) -> Arc<Self> {
        Arc::new(Connections {
            limits,
            open: AtomicUsize::new(0),
            sources: Mutex::new(HashMap::new()),
            refused: [AtomicU64::new(0), AtomicU64::new(0)],
            warning: Mutex::new(Throttled::every(Duration::from_secs(60))),
        })
    }

    /// The limits connections are served under.
    pub fn limits(&self) -> &ConnLimits {
        &self.limits
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    /// Connections refused so far, for `why`.
    pub fn refused(&self, why: Refused) -> u64 {
        self.refused[why as usize].load(Ordering::Relaxed)
    }

    /// A place for a connection from `source`, or why there is none (counted, and
    /// logged at most once a minute).
    pub(crate) fn admit(self: &Arc<Self>, source: IpAddr) -> Result<Slot, Refused> {
        let admitted = self.try_admit(source);
        if let Err(why) = admitted {
            self.refused[why as usize].fetch_add(1, Ordering::Relaxed);
            self.warn(why);
        }
        admitted
    }

    fn try_admit(self: &Arc<Self>, source: IpAddr) -> Result<Slot, Refused> {
        let max = self.limits.max_connections;
        self.open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .map_err(|_| Refused::Max)?;
        // Without a limit per source (the gateway's callers), no map is kept.
        let per_source = self.limits.max_per_source != usize::MAX;
        if per_source {
            let mut sources = self.sources.lock().expect("connections lock");
            let from_source = sources.entry(source).or_insert(0);
            if *from_source >= self.limits.max_per_source {
                self.open.fetch_sub(1, Ordering::AcqRel);
                return Err(Refused::PerSource);
            }
            *from_source += 1;
        }
        Ok(Slot {
            conns: self.clone(),
            source: per_source.then_some(source),
        })
    }

    fn warn(&self, why: Refused) {
        let Some(held_back) = self
            .warning
            .lock()
            .expect("connections lock")
            .ready(Instant::now())
        else {
            return;
        };
        let (limit, setting) = match why {
            Refused::Max => (self.limits.max_connections, "max_connections"),
            Refused::PerSource => (self.limits.max_per_source, "max_per_source"),
        };
        warn!(
            limit,
            refused_max = self.refused(Refused::Max),
            refused_per_source = self.refused(Refused::PerSource),
            held_back,
            "connections refused: {setting} reached (logged once a minute at most)"
        );
    }
}

impl Connections {
    /// What a metrics registry shows of them: `connections_open` and
    /// `connections_refused_total{reason}` (`max`, `per_source`), under the
    /// registry's prefix.
    pub fn collector(self: &Arc<Self>) -> Box<dyn Collector> {
        Box::new(Observed(self.clone()))
    }
}

#[derive(Debug)]
struct Observed(Arc<Connections>);

impl Collector for Observed {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let open = ConstGauge::new(i64::try_from(self.0.open()).unwrap_or(i64::MAX));
        let metric = encoder.encode_descriptor(
            "connections_open",
            "Connections open on the listener, lingering ones included",
            None,
            MetricType::Gauge,
        )?;
        open.encode(metric)?;
        let mut family = encoder.encode_descriptor(
            "connections_refused",
            "Connections closed as soon as accepted, at a limit (max or per_source)",
            None,
            MetricType::Counter,
        )?;
        for why in Refused::ALL {
            let labels = [("reason", why.as_str())];
            ConstCounter::new(self.0.refused(why)).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

/// One connection's place, given back when dropped.
#[derive(Debug)]
pub(crate) struct Slot {
    conns: Arc<Connections>,
    /// Its source, where sources are counted.
    source: Option<IpAddr>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(source) = self.source {
            let mut sources = self.conns.sources.lock().expect("connections lock");
            if let Some(n) = sources.get_mut(&source) {
                *n -= 1;
                if *n == 0 {
                    sources.remove(&source);
                }
            }
        }
        self.conns.open.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr};

    use super::{Connections, Refused};
    use crate::ConnLimits;

    fn ip(last: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(10, 0, 0, last))
    }

    #[test]
    fn places_are_bounded_in_all_and_per_source_and_given_back() {
        let conns = Connections::new(ConnLimits {
            max_connections: 3,
            max_per_source: 2,
            ..ConnLimits::default()
        });
        let a1 = conns.admit(ip(1)).unwrap();
        let _a2 = conns.admit(ip(1)).unwrap();
        assert_eq!(conns.admit(ip(1)).unwrap_err(), Refused::PerSource);
        let _b1 = conns.admit(ip(2)).unwrap();
        assert_eq!(conns.admit(ip(3)).unwrap_err(), Refused::Max);
        assert_eq!(conns.open(), 3);
        assert_eq!(
            (
                conns.refused(Refused::Max),
                conns.refused(Refused::PerSource)
            ),
            (1, 1)
        );
        drop(a1);
        assert_eq!(conns.open(), 2);
        let _a3 = conns
            .admit(ip(1))
            .expect("a place given back is taken again");
    }

    #[test]
    fn a_source_is_forgotten_with_its_last_connection() {
        let conns = Connections::new(ConnLimits {
            max_per_source: 100,
            ..ConnLimits::default()
        });
        let slots: Vec<_> = (0..50).map(|i| conns.admit(ip(i)).unwrap()).collect();
        assert_eq!(conns.sources.lock().unwrap().len(), 50);
        drop(slots);
        assert!(conns.sources.lock().unwrap().is_empty());
        assert_eq!(conns.open(), 0);
    }

    /// Without a limit per source (the gateway's), sources are not counted at all.
    #[test]
    fn without_a_limit_per_source_none_is_kept() {
        let conns = Connections::new(ConnLimits {
            max_connections: 3,
            ..ConnLimits::default()
        });
        let slots: Vec<_> = (0..3).map(|_| conns.admit(ip(1)).unwrap()).collect();
        assert!(conns.sources.lock().unwrap().is_empty());
        assert_eq!(conns.admit(ip(2)).unwrap_err(), Refused::Max);
        drop(slots);
        assert_eq!(conns.open(), 0);
        assert!(conns.admit(ip(1)).is_ok());
    }
}
