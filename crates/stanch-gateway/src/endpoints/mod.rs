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
//!
//! `cost` holds the estimates, `blocking` what an outcome does to an endpoint (passive
//! blocks, probes), `choice` the choosing, `status` what `/v1/status` shows.

mod blocking;
mod choice;
mod cost;
mod status;

use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};

use hyper::header::{self, HeaderValue};
use secrecy::SecretString;
use stanch_api::Timestamp;

use tokio::time::Instant;

pub use self::blocking::NewBlock;
use self::blocking::Run;
pub use self::choice::{choose, next_random};
use self::cost::PeakEwma;
pub use self::cost::{DECAY, Kind, Work};
pub use self::status::EndpointStatus;
use crate::upstream::{self, Connector, Pool, SetupError};
use crate::window::Window;

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
    ) -> Result<Endpoint, SetupError> {
        let conns = Pool::new(url, connector.clone())?;
        let paths = [
            conns.path("/v1/chat/completions")?,
            conns.path("/v1/completions")?,
            conns.path("/v1/embeddings")?,
        ];
        let authorization = api_key.map(|key| upstream::bearer(&key)).transpose()?;
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
}

pub use stanch_api::glob::matches as glob;

#[cfg(test)]
mod shares;

#[cfg(test)]
mod tests;
