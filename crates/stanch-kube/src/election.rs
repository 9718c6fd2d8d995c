//! The election, run: the [`Elector`] driven against the Lease, its outcome put in
//! [`Leadership`] for the HTTP API and the engine task, and its term given to the
//! state store as the guard of every write.
//!
//! A leader renews every third of the lease; a follower looks every
//! [`Election::look_every`] (half a second by default), so a lease released on SIGTERM
//! is taken within about that, and one left to expire (a `kill -9`) within a look of
//! its expiry. An API server that cannot be reached is retried at the same pace, never
//! faster: a leader that cannot renew keeps deciding until its term ends by its own
//! clock, then follows (serving its last table) until it can take the lease again.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use kube::api::PostParams;
use stanch_api::Timestamp;
use stanch_ports::clock::Clock;
use stanch_ports::leadership::{Leadership, Role};
use tracing::{info, warn};

use crate::lease::{Elector, Step};
use crate::store::Guard;

/// No term: the guard's value when this replica does not lead.
const NO_TERM: i64 = i64::MIN;

/// One replica's election on one Lease.
pub struct Election {
    api: Api<Lease>,
    name: String,
    elector: Elector,
    clock: Arc<dyn Clock>,
    leadership: Arc<Leadership>,
    /// Until when (milliseconds since the epoch) this replica leads.
    term_until: Arc<AtomicI64>,
    look_every: Duration,
    timeout: Duration,
}

/// Why a round of the election could not settle.
#[derive(Debug, thiserror::Error)]
enum RoundError {
    #[error(transparent)]
    Api(#[from] kube::Error),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
}

impl Election {
    /// The election of `elector` on the Lease `name` of `api`'s namespace, its outcome
    /// set on `leadership`.
    pub fn new(
        api: Api<Lease>,
        name: impl Into<String>,
        elector: Elector,
        clock: Arc<dyn Clock>,
        leadership: Arc<Leadership>,
    ) -> Election {
        Election {
            api,
            name: name.into(),
            elector,
            clock,
            leadership,
            term_until: Arc::new(AtomicI64::new(NO_TERM)),
            look_every: Duration::from_millis(500),
            timeout: Duration::from_secs(5),
        }
    }

    /// How often a follower looks at the Lease (and an unreachable API server is tried).
    pub fn look_every(mut self, every: Duration) -> Election {
        self.look_every = every;
        self
    }

    /// The guard of the state store's writes: whether this replica's term lasts now, by
    /// the clock, measured from the send time of its last successful lease write.
    pub fn guard(&self) -> Guard {
        let term = self.term_until.clone();
        let clock = self.clock.clone();
        Arc::new(move || clock.now().as_millis() < term.load(Ordering::Acquire))
    }

    /// Runs until `shutdown` resolves, then gives the lease up if it holds it, so that
    /// another replica takes over at its next look.
    pub async fn run(mut self, shutdown: impl Future<Output = ()>) {
        tokio::pin!(shutdown);
        loop {
            let sent = self.clock.now();
            match self.round(sent).await {
                Ok(Some(holder)) => self.follow(holder),
                Ok(None) => self.lead(sent),
                Err(e) => {
                    warn!(lease = %self.name, error = %e, "cannot read or write the lease; trying again")
                }
            }
            // A term that ran out (renewals failing) ends by the clock.
            let now = self.clock.now();
            if self.leadership.role() == Role::Leader && !self.elector.leads(now) {
                warn!(lease = %self.name, "the lease could not be renewed before its term ended: following until it can be taken again");
                self.elector.lost();
                self.end_term(None);
            }
            let wait = if self.elector.leads(now) {
                self.elector.renew_every()
            } else {
                self.look_every
            };
            tokio::select! {
                () = &mut shutdown => break,
                () = tokio::time::sleep(wait) => {}
            }
        }
        self.release().await;
    }

    /// Reads the lease and acts on it: `Ok(None)` when this replica now holds it,
    /// `Ok(Some(holder))` when another does.
    async fn round(&mut self, now: Timestamp) -> Result<Option<String>, RoundError> {
        let lease = self.bounded(self.api.get_opt(&self.name)).await?;
        let spec = lease.as_ref().and_then(|l| l.spec.as_ref());
        let next = match self.elector.step(spec, now) {
            Step::Follow { holder, .. } => return Ok(Some(holder)),
            Step::Acquire(next) | Step::Renew(next) => next,
        };
        let object = Lease {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                resource_version: lease.and_then(|l| l.metadata.resource_version),
                ..ObjectMeta::default()
            },
            spec: Some(next),
        };
        let params = PostParams::default();
        let written = match &object.metadata.resource_version {
            Some(_) => {
                self.bounded(self.api.replace(&self.name, &params, &object))
                    .await
            }
            None => self.bounded(self.api.create(&params, &object)).await,
        };
        match written {
            Ok(_) => Ok(None),
            // Another replica wrote it first: it holds the lease now (who, the next
            // look says).
            Err(RoundError::Api(kube::Error::Api(s))) if s.code == 409 => Ok(Some(String::new())),
            Err(e) => Err(e),
        }
    }

    async fn bounded<T>(
        &self,
        call: impl Future<Output = Result<T, kube::Error>>,
    ) -> Result<T, RoundError> {
        match tokio::time::timeout(self.timeout, call).await {
            Ok(result) => Ok(result?),
            Err(_) => Err(RoundError::Timeout(self.timeout)),
        }
    }

    /// The lease write sent at `sent` landed: a term from then.
    fn lead(&mut self, sent: Timestamp) {
        self.elector.written(sent);
        let until = self
            .elector
            .term_ends()
            .map_or(NO_TERM, Timestamp::as_millis);
        self.term_until.store(until, Ordering::Release);
        if self.leadership.role() != Role::Leader {
            info!(lease = %self.name, identity = %self.elector.identity(), "leading");
            self.leadership.set(Role::Leader);
        }
    }

    /// Another replica holds the lease (its name empty when not known yet).
    fn follow(&mut self, holder: String) {
        self.elector.lost();
        let leader = (!holder.is_empty()).then_some(holder);
        self.end_term(leader);
    }

    fn end_term(&self, leader: Option<String>) {
        self.term_until.store(NO_TERM, Ordering::Release);
        let role = Role::Follower { leader };
        if self.leadership.role() != role {
            if self.leadership.role() == Role::Leader {
                warn!(lease = %self.name, "no longer leading");
            }
            self.leadership.set(role);
        }
    }

    /// Gives the lease up if this replica holds it.
    async fn release(&mut self) {
        // Stop deciding and writing first: once given up, another may lead at once.
        let now = self.clock.now();
        self.term_until.store(NO_TERM, Ordering::Release);
        self.leadership.set(Role::Follower { leader: None });
        let lease = match self.bounded(self.api.get_opt(&self.name)).await {
            Ok(Some(lease)) => lease,
            Ok(None) => return,
            Err(e) => {
                warn!(lease = %self.name, error = %e, "cannot read the lease to give it up; it expires on its own");
                return;
            }
        };
        let Some(released) = lease
            .spec
            .as_ref()
            .and_then(|spec| self.elector.release(spec, now))
        else {
            return;
        };
        let object = Lease {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                resource_version: lease.metadata.resource_version.clone(),
                ..ObjectMeta::default()
            },
            spec: Some(released),
        };
        match self
            .bounded(
                self.api
                    .replace(&self.name, &PostParams::default(), &object),
            )
            .await
        {
            Ok(_) => info!(lease = %self.name, "lease given up"),
            Err(e) => {
                warn!(lease = %self.name, error = %e, "cannot give the lease up; it expires on its own")
            }
        }
    }
}
