//! Upstream endpoints: load, latency, health and passive blocks, and how one is chosen.
//!
//! State is per (endpoint, model). Choosing is power of two choices on a cost, after
//! linkerd's and Finagle's peak-EWMA balancers: a latency estimate per unit of work
//! × (requests in flight + 1), over the capacity, the weight and the slow-start ramp
//! after a block. The estimate leans toward slower samples and blends by the time
//! between samples ([`DECAY`]), with a floor per sample so that at high rates it is a
//! plain EWMA; while an endpoint gets no samples it decays toward zero, so an endpoint
//! that lost every comparison (after one slow answer, say) drifts back into use instead
//! of starving. Like is compared with like: a streamed request is chosen by
//! time to first token, a whole one by time per output token (per input token for
//! embeddings), so one long completion does not make its endpoint look slow. Blocked
//! means lowest priority, not gone: when every candidate is blocked, the one most
//! likely to be alive is used.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use hyper::header::{self, HeaderValue};
use secrecy::SecretString;
use stanch_api::Timestamp;
use stanch_api::hash::Fnv64;

use crate::table::Applied;
use tokio::time::Instant;

use crate::config::BlockingPolicy;
use crate::outcome::Outcome;
use crate::upstream::{self, Connector, Pool};
use crate::window::Window;

/// The time constant of a cost estimate: a peak fades, and an idle endpoint's cost
/// falls toward zero, by a factor e over this long. Finagle and linkerd use 10 s; a
/// shorter one brings an endpoint back sooner after a single slow answer.
pub const DECAY: Duration = Duration::from_secs(5);
/// The latency a failure counts as, so a failing endpoint is not preferred.
const FAILURE_PENALTY_MS: f64 = 1000.0;

/// What a latency sample measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Work {
    /// A whole answer of this many units: output tokens, input tokens for embeddings,
    /// 1 when the answer does not say.
    Whole(u32),
    /// A stream's time to its first token.
    FirstToken,
}

/// Which estimate a request is chosen by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A whole answer: time per unit of work.
    Whole = 0,
    /// A stream: time to first token.
    Stream = 1,
}

/// Each sample moves the estimate at least this far toward it: at thousands of samples a
/// second, where the time between two is nothing, it is a plain EWMA; one scheduling
/// hiccup fades within a few samples instead of sidelining the endpoint for seconds.
const ALPHA: f64 = 0.3;
/// A sample above the estimate moves it at least this far: slowing down shows at once.
const ALPHA_UP: f64 = 0.5;

/// A latency estimate in milliseconds that leans toward peaks and forgets with time: a
/// sample blends in with a weight that grows with the time since the last (all of it
/// after long enough), at least [`ALPHA`], and at least [`ALPHA_UP`] when it is higher;
/// between samples the estimate decays toward zero.
#[derive(Debug, Clone, Copy)]
struct PeakEwma {
    ms: f64,
    at: Instant,
}

impl PeakEwma {
    /// The estimate at `now`, decayed since its last sample.
    fn at(self, now: Instant) -> f64 {
        self.ms * self.weight(now)
    }

    /// How much of the estimate is left after the time since its last sample.
    fn weight(self, now: Instant) -> f64 {
        let idle = now.saturating_duration_since(self.at).as_secs_f64();
        (-idle / DECAY.as_secs_f64()).exp()
    }

    fn observe(estimate: Option<PeakEwma>, sample: f64, now: Instant) -> PeakEwma {
        let ms = match estimate {
            None => sample,
            Some(e) => {
                let current = e.at(now);
                let floor = if sample > current { ALPHA_UP } else { ALPHA };
                let alpha = (1.0 - e.weight(now)).max(floor);
                current + alpha * (sample - current)
            }
        };
        PeakEwma { ms, at: now }
    }
}

/// One endpoint serving one model.
#[derive(Debug)]
pub struct Endpoint {
    /// Base URL.
    pub url: String,
    /// The stanch model it serves.
    pub model: String,
    /// Its pool.
    pub pool: String,
    /// Configured weight.
    pub weight: u32,
    /// Comfortable concurrency.
    pub capacity: u32,
    /// Upstream model name; `None` forwards the requested name.
    pub upstream_model: Option<String>,
    /// The only endpoint its model can be served from (no other pool's, no fallback
    /// model): blocks on it are never extended.
    pub alone: bool,
    /// Its paths for chat, completions and embeddings (origin form), parsed once.
    pub(crate) paths: [hyper::Uri; 3],
    /// Its connections.
    pub(crate) conns: Pool,
    /// `Bearer <upstream API key>`, made once and marked sensitive (never logged).
    authorization: Option<HeaderValue>,
    in_flight: AtomicU32,
    health: Mutex<Health>,
    /// Metric handles of the common path, resolved once so a success allocates nothing.
    pub(crate) hot: std::sync::OnceLock<HotCounters>,
}

/// Counters of an endpoint's successes, looked up once at start.
#[derive(Debug)]
pub(crate) struct HotCounters {
    /// `requests_total` for its own model answered by it, 2xx, success.
    pub requests_ok: crate::metrics::WorkerCounter,
    /// `upstream_attempts_total` for it, success.
    pub attempts_ok: crate::metrics::WorkerCounter,
}

#[derive(Debug, Default)]
struct Health {
    /// Cost estimates per [`Kind`]; `None` until the first sample of that kind.
    cost: [Option<PeakEwma>; 2],
    /// The current run of failures, if one is going on.
    run: Option<Run>,
    /// The longest run of failures since the last outcome report: a block resets the
    /// run, and the controller must still hear how long it was.
    peak_streak: u32,
    /// (successes, failures) over `blocking.window`.
    window: Window<(u32, u32)>,
    blocked_until: Option<Instant>,
    block_ended: Option<Instant>,
    strikes: u32,
    last_block: Option<Instant>,
    successes: u64,
    failures: u64,
    /// Probe successes in a row while blocked.
    probe_streak: u32,
    last_success: Option<Timestamp>,
    last_failure: Option<(Timestamp, &'static str)>,
}

/// Failures in a row, and when the first of them was seen. A success ends the run
/// only if its request went out after that: one sent before may have been answered
/// before the fault began, and says nothing of the endpoint now.
#[derive(Debug, Clone, Copy)]
struct Run {
    began: Instant,
    failures: u32,
}

/// A block the endpoint just got.
#[derive(Debug, Clone, PartialEq)]
pub struct NewBlock {
    /// Its length.
    pub ttl: Duration,
    /// Backoff level.
    pub strikes: u32,
    /// The trigger that fired.
    pub trigger: &'static str,
}

/// An endpoint's state, for `/v1/status`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct EndpointStatus {
    /// URL.
    pub url: String,
    /// Model.
    pub model: String,
    /// Pool.
    pub pool: String,
    /// `ok`, `blocked` or `slow_start`.
    pub state: &'static str,
    /// Seconds left on a local block.
    pub blocked_for_seconds: Option<u64>,
    /// Failures in a row.
    pub consecutive_failures: u32,
    /// Totals.
    pub successes: u64,
    /// Totals.
    pub failures: u64,
    /// The estimate whole answers are chosen by: milliseconds per unit of work.
    pub ms_per_token: Option<f64>,
    /// The estimate streams are chosen by: milliseconds to the first token.
    pub first_token_ms: Option<f64>,
    /// Requests in flight.
    pub in_flight: u32,
    /// When it last answered well.
    pub last_success: Option<Timestamp>,
    /// When it last failed, and how.
    pub last_failure: Option<(Timestamp, &'static str)>,
}

/// Holds an in-flight slot until dropped (a stream holds it to its end).
pub struct InFlight(std::sync::Arc<Endpoint>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Endpoint {
    /// A healthy endpoint; fails when `url` is not an `http(s)://host[:port][/path]`
    /// URL the connector can reach.
    #[expect(
        clippy::too_many_arguments,
        reason = "one constructor from configuration"
    )]
    pub(crate) fn new(
        url: &str,
        model: &str,
        pool: &str,
        weight: u32,
        capacity: u32,
        upstream_model: Option<String>,
        api_key: Option<SecretString>,
        alone: bool,
        connector: &Connector,
    ) -> Result<Endpoint, String> {
        let conns = Pool::new(url, connector.clone())?;
        let paths = [
            conns.path("/v1/chat/completions")?,
            conns.path("/v1/completions")?,
            conns.path("/v1/embeddings")?,
        ];
        let authorization = api_key
            .map(|key| upstream::bearer(&key))
            .transpose()
            .map_err(|why| format!("api key: {why}"))?;
        Ok(Endpoint {
            paths,
            conns,
            url: url.trim_end_matches('/').to_owned(),
            model: model.to_owned(),
            pool: pool.to_owned(),
            weight,
            capacity,
            upstream_model,
            authorization,
            alone,
            in_flight: AtomicU32::new(0),
            health: Mutex::new(Health::default()),
            hot: std::sync::OnceLock::new(),
        })
    }

    /// A POST of `body` to its chat (`api` 0), completions (1) or embeddings (2) route,
    /// with the headers every upstream request carries: `Host`, `Content-Type`,
    /// `Authorization`.
    pub(crate) fn post<B>(&self, api: usize, body: B) -> hyper::Request<B> {
        let mut request = hyper::Request::new(body);
        *request.method_mut() = hyper::Method::POST;
        *request.uri_mut() = self.paths[api].clone();
        let headers = request.headers_mut();
        headers.insert(header::HOST, self.conns.host().clone());
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(authorization) = &self.authorization {
            headers.insert(header::AUTHORIZATION, authorization.clone());
        }
        request
    }

    /// Counts a request in flight until the guard drops.
    pub fn start(self: &std::sync::Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(self.clone())
    }

    /// Records a probe's result while blocked; returns true when it lifted the block.
    /// Probes never count as traffic: not in totals, streaks or latency.
    pub fn probe_result(&self, ok: bool, needed: u32, now: Instant) -> bool {
        let mut h = self.health.lock().expect("endpoint lock");
        if h.blocked_until.is_none_or(|u| u <= now) {
            h.probe_streak = 0;
            return false;
        }
        h.probe_streak = if ok { h.probe_streak + 1 } else { 0 };
        if h.probe_streak < needed {
            return false;
        }
        // Lifted early; the slow start ramps its share up from here.
        h.blocked_until = None;
        h.block_ended = Some(now);
        h.run = None;
        h.probe_streak = 0;
        true
    }

    /// Totals so far and the current run of failures: (successes, failures, consecutive).
    pub fn counts(&self) -> (u64, u64, u32) {
        let h = self.health.lock().expect("endpoint lock");
        (h.successes, h.failures, h.consecutive())
    }

    /// For an outcome report: totals so far and the longest run of failures since the
    /// previous report, even if a block has ended that run since. (successes, failures,
    /// longest run).
    pub fn report_counts(&self) -> (u64, u64, u32) {
        let mut h = self.health.lock().expect("endpoint lock");
        let peak = h.peak_streak.max(h.consecutive());
        h.peak_streak = h.consecutive();
        (h.successes, h.failures, peak)
    }

    /// Whether the failure just recorded looks like a one-off to a request that has
    /// had `own` failures here: every failure of the current run is that request's,
    /// and no other request is in flight here. Failures of other requests in the run,
    /// or others out at the same time, say the endpoint is failing, not that one
    /// request was unlucky.
    pub fn one_off_failure(&self, own: u32) -> bool {
        let in_flight = self.in_flight.load(Ordering::Relaxed);
        let h = self.health.lock().expect("endpoint lock");
        in_flight == 0 && h.consecutive() <= own
    }

    /// Whether a local block holds at `now`.
    pub fn blocked(&self, now: Instant) -> Option<Instant> {
        let h = self.health.lock().expect("endpoint lock");
        h.blocked_until.filter(|u| *u > now)
    }

    /// The block the route table puts on this endpoint for its model at `now`, if any:
    /// a lookup in the table's index of blocks, not a scan of them.
    pub fn blocked_by(&self, table: &Applied, now: Timestamp) -> Option<Timestamp> {
        table.block_on(&self.url, &self.model, now)
    }

    /// What choosing needs to know of this endpoint at `now`, read under one lock:
    /// the lock is shared by every worker thread, so each taking of it can cost a
    /// cache line's trip between cores.
    fn look(&self, now: Instant) -> Look {
        let in_flight = self.in_flight.load(Ordering::Relaxed);
        let h = self.health.lock().expect("endpoint lock");
        Look {
            blocked: h.blocked_until.is_some_and(|u| u > now),
            // Failing right now with a request already out: it gets no second request
            // until one of them comes back well, so a fault costs its in-flight requests
            // plus one at a time, not a burst.
            suspect_busy: in_flight > 0 && h.run.is_some(),
            cost: h.cost,
            block_ended: h.block_ended,
            in_flight,
        }
    }

    /// The cost of sending here, lower is better: the estimate for `kind` × (requests
    /// in flight plus one) / capacity, over the weight and the slow-start ramp after a
    /// block. An unmeasured endpoint is taken to cost what `peer` (its rival) does.
    fn score(
        &self,
        look: &Look,
        kind: Kind,
        peer: Option<f64>,
        now: Instant,
        slow_start: Duration,
    ) -> f64 {
        let latency = look.estimate(kind, now).or(peer).unwrap_or(1.0);
        let load = f64::from(look.in_flight + 1) / f64::from(self.capacity.max(1));
        let ramp = match look.block_ended {
            Some(ended) if !slow_start.is_zero() => {
                (now.duration_since(ended).as_secs_f64() / slow_start.as_secs_f64()).clamp(0.1, 1.0)
            }
            _ => 1.0,
        };
        latency * load / (f64::from(self.weight.max(1)) * ramp)
    }

    fn success_rate(&self) -> f64 {
        let h = self.health.lock().expect("endpoint lock");
        let total = h.successes + h.failures;
        if total == 0 {
            1.0
        } else {
            h.successes as f64 / total as f64
        }
    }

    /// Records the outcome, known at `now`, of an attempt sent at `sent`, with the
    /// latency it is judged by (a stream's time to first token); returns the block it
    /// triggered, if any.
    #[expect(
        clippy::too_many_arguments,
        reason = "one outcome with everything it says"
    )]
    pub fn record(
        &self,
        outcome: &Outcome,
        sent: Instant,
        latency: Duration,
        work: Work,
        policy: &BlockingPolicy,
        now: Instant,
        wall: Timestamp,
    ) -> Option<NewBlock> {
        let ms = latency.as_secs_f64() * 1e3;
        if !outcome.is_endpoint_failure() {
            let mut h = self.health.lock().expect("endpoint lock");
            if matches!(outcome, Outcome::Success) {
                match work {
                    Work::Whole(units) => h.observe(Kind::Whole, ms / f64::from(units.max(1)), now),
                    Work::FirstToken => h.observe(Kind::Stream, ms, now),
                }
                if h.run.is_some_and(|run| sent >= run.began) {
                    h.run = None;
                }
                h.successes += 1;
                h.last_success = Some(wall);
                h.window.at(now, policy.window.0).0 += 1;
            }
            return None;
        }
        let mut h = self.health.lock().expect("endpoint lock");
        // A failure is a peak in both estimates: the endpoint is avoided for a while,
        // whichever kind of request failed.
        for kind in [Kind::Whole, Kind::Stream] {
            h.observe(kind, ms.max(FAILURE_PENALTY_MS), now);
        }
        let run = h.run.get_or_insert(Run {
            began: now,
            failures: 0,
        });
        run.failures += 1;
        let in_a_row = run.failures;
        h.peak_streak = h.peak_streak.max(in_a_row);
        h.failures += 1;
        h.last_failure = Some((wall, outcome.label()));
        h.window.at(now, policy.window.0).1 += 1;
        if let Outcome::RateLimited {
            retry_after: Some(d),
        } = outcome
        {
            // The upstream said how long to stay away: a block of exactly that, no strike.
            let until = now + *d;
            if h.blocked_until.is_none_or(|u| u < until) {
                h.blocked_until = Some(until);
            }
        }
        if h.blocked_until.is_some_and(|u| u > now) {
            return None;
        }
        let trigger = trigger(&h, in_a_row, policy, now)?;
        if policy.never_block.iter().any(|p| glob(p, &self.url)) {
            return None;
        }
        let repeat = h
            .last_block
            .is_some_and(|t| now.duration_since(t) <= policy.backoff_reset.0);
        if repeat && self.alone {
            // Blocking the model's only endpoint longer leaves it nowhere to go.
            return None;
        }
        h.strikes = if repeat { h.strikes + 1 } else { 1 };
        let base = policy
            .ttl
            .0
            .saturating_mul(1 << (h.strikes - 1).min(16))
            .min(policy.max_ttl.0.max(policy.ttl.0));
        let ttl = jitter(base, policy.jitter, &self.url, h.strikes);
        h.blocked_until = Some(now + ttl);
        h.block_ended = Some(now + ttl);
        h.last_block = Some(now);
        h.run = None;
        h.window = Window::default();
        Some(NewBlock {
            ttl,
            strikes: h.strikes,
            trigger,
        })
    }

    /// The endpoint's state for `/v1/status`.
    pub fn status(&self, now: Instant, slow_start: Duration) -> EndpointStatus {
        let h = self.health.lock().expect("endpoint lock");
        let blocked = h.blocked_until.filter(|u| *u > now);
        let ramping = h
            .block_ended
            .is_some_and(|e| e <= now && now.duration_since(e) < slow_start);
        EndpointStatus {
            url: self.url.clone(),
            model: self.model.clone(),
            pool: self.pool.clone(),
            state: if blocked.is_some() {
                "blocked"
            } else if ramping {
                "slow_start"
            } else {
                "ok"
            },
            blocked_for_seconds: blocked.map(|u| u.duration_since(now).as_secs()),
            consecutive_failures: h.consecutive(),
            successes: h.successes,
            failures: h.failures,
            ms_per_token: h.cost[Kind::Whole as usize].map(|c| c.at(now)),
            first_token_ms: h.cost[Kind::Stream as usize].map(|c| c.at(now)),
            in_flight: self.in_flight.load(Ordering::Relaxed),
            last_success: h.last_success,
            last_failure: h.last_failure,
        }
    }
}

impl Health {
    /// Failures in a row now.
    fn consecutive(&self) -> u32 {
        self.run.map_or(0, |run| run.failures)
    }

    fn observe(&mut self, kind: Kind, ms: f64, now: Instant) {
        let slot = &mut self.cost[kind as usize];
        *slot = Some(PeakEwma::observe(*slot, ms, now));
    }
}

/// What, if anything, a failure `in_a_row` makes a block: consecutive failures, then
/// failures in the window, then the failure rate over the window's requests.
fn trigger(
    h: &Health,
    in_a_row: u32,
    policy: &BlockingPolicy,
    now: Instant,
) -> Option<&'static str> {
    let (successes, failures) = h
        .window
        .within(now, policy.window.0)
        .fold((0, 0), |(ok, failed), (o, f)| (ok + o, failed + f));
    let total = successes + failures;
    if policy.consecutive_failures > 0 && in_a_row >= policy.consecutive_failures {
        Some("consecutive_failures")
    } else if policy.window_failures > 0 && failures >= policy.window_failures {
        Some("window_failures")
    } else if policy.failure_rate > 0.0
        && total >= policy.min_requests
        && f64::from(failures) / f64::from(total) >= policy.failure_rate
    {
        Some("failure_rate")
    } else {
        None
    }
}

/// An endpoint's state as [`choose`] sees it.
struct Look {
    blocked: bool,
    suspect_busy: bool,
    cost: [Option<PeakEwma>; 2],
    block_ended: Option<Instant>,
    in_flight: u32,
}

impl Look {
    fn estimate(&self, kind: Kind, now: Instant) -> Option<f64> {
        self.cost[kind as usize].map(|c| c.at(now))
    }
}

fn jitter(d: Duration, fraction: f64, url: &str, strikes: u32) -> Duration {
    let mut h = Fnv64::default();
    h.write(url.as_bytes());
    h.write(&strikes.to_le_bytes());
    h.write(&next_random().to_le_bytes());
    stanch_api::jitter::spread(d, fraction, h.finish())
}

pub use stanch_api::glob::matches as glob;

std::thread_local! {
    /// Each thread's generator, seeded at random: replicas and threads draw different
    /// jitter, and no core waits for another's cache line to draw a number.
    static RANDOM: std::cell::Cell<u64> = std::cell::Cell::new({
        use std::hash::{BuildHasher, Hasher};
        // Never zero, which xorshift would keep forever.
        std::collections::hash_map::RandomState::new().build_hasher().finish() | 1
    });
}

/// A fast, non-cryptographic random number (xorshift), for choices and jitter.
pub fn next_random() -> u64 {
    RANDOM.with(|state| {
        let mut x = state.get();
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        state.set(x);
        x
    })
}

/// Picks among `candidates` (not yet tried for this request) for a request of `kind`;
/// `table_blocked` gives the time left on the route table's block of an endpoint.
/// Returns the endpoint and whether every candidate was blocked (so a blocked one was
/// used anyway).
pub fn choose<'a>(
    candidates: &[&'a Endpoint],
    table_blocked: impl Fn(&Endpoint) -> Option<Duration>,
    kind: Kind,
    now: Instant,
    slow_start: Duration,
) -> Option<(&'a Endpoint, bool)> {
    let open: Vec<(&Endpoint, Look)> = candidates
        .iter()
        .copied()
        .filter(|e| table_blocked(e).is_none())
        .map(|e| (e, e.look(now)))
        .filter(|(_, look)| !look.blocked && !look.suspect_busy)
        .collect();
    if open.is_empty() {
        // Blocked is lowest priority, not gone: the block ending soonest, then the best
        // success rate, is the most likely to be alive.
        let best = candidates.iter().copied().min_by(|a, b| {
            // Whichever block, this gateway's or the table's, lasts longer.
            let end = |e: &Endpoint| {
                let local = e
                    .blocked(now)
                    .map_or(Duration::ZERO, |u| u.duration_since(now));
                local.max(table_blocked(e).unwrap_or_default())
            };
            end(a)
                .cmp(&end(b))
                .then(b.success_rate().total_cmp(&a.success_rate()))
        })?;
        return Some((best, true));
    }
    if open.len() == 1 {
        return Some((open[0].0, false));
    }
    let i = (next_random() % open.len() as u64) as usize;
    let mut j = (next_random() % (open.len() as u64 - 1)) as usize;
    if j >= i {
        j += 1;
    }
    let ((a, look_a), (b, look_b)) = (&open[i], &open[j]);
    let (est_a, est_b) = (look_a.estimate(kind, now), look_b.estimate(kind, now));
    let cost_a = a.score(look_a, kind, est_b, now, slow_start);
    let cost_b = b.score(look_b, kind, est_a, now, slow_start);
    let pick = if cost_a <= cost_b { a } else { b };
    Some((pick, false))
}

#[cfg(test)]
mod shares;

#[cfg(test)]
mod tests;
