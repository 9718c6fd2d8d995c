//! The policy adapter: policy resources in, the policy in force, their statuses and
//! refusal Events out.
//!
//! A reflector keeps every `StanchPolicy` the controller may see. On every change, the
//! listed resources and the configuration file are merged ([`crate::merge`]); a
//! policy that differs from the one in force is put in force ([`Control::configure`],
//! journaled like any input), and a resource newly refused gets a `SpecRefused` Event.
//! On every change and every published version, each resource's status is written if
//! it changed ([`crate::status::next`]), by server-side apply under field manager
//! `stanch`. Every decision about a model with a policy in force (rung transitions,
//! blocks, overrides) becomes an Event on that policy ([`crate::events::said`]), at most
//! [`DECISION_EVENTS_PER_SECOND`]. Only the leader writes statuses and Events. Errors
//! talking to the API server are logged and retried at the next change or version (the
//! watcher backs off on its own); the policy in force stays.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Client, ResourceExt};
use serde_json::json;
use stanch_api::Timestamp;
use stanch_core::Config;
use stanch_ports::clock::Clock;
use stanch_ports::control::{Control, Publication};
use stanch_ports::history::Recorded;
use tokio::sync::broadcast;
use tracing::{info, warn};

use crate::crd::StanchPolicy;
use crate::merge::{Listed, Outcome, merge};
use crate::publish::FIELD_MANAGER;
use crate::status::{Observed, next};

/// Where policies come from and who reports on them.
pub struct Adapter {
    client: Client,
    /// The namespace to watch, or every namespace.
    namespace: Option<String>,
    /// The configuration file's policy, which resources are merged over.
    file: Config,
    /// This replica's name, for Events.
    identity: String,
    /// The wall clock, for Events and condition times.
    clock: Arc<dyn Clock>,
    /// What each resource came to at the last merge.
    outcomes: BTreeMap<String, Outcome>,
    /// The policy last put in force.
    in_force: Option<Config>,
    /// Status writes allowed now.
    budget: WriteBudget,
    /// Status writes the budget put off, to be made at the next second.
    deferred: bool,
    /// Decision Events allowed now.
    event_budget: WriteBudget,
    /// Decision Events dropped since the last said so.
    events_dropped: u64,
    /// Events made by this replica, to name each apart.
    events_made: u64,
    /// New versions of the configuration file's policy (a reload), if any come.
    files: Option<tokio::sync::mpsc::Receiver<Config>>,
}

/// Status writes a second at most: an alert storm moves many models at once, and
/// their statuses must not hammer the API server. What is put off is written a second
/// later, as it then is (only the latest status of each resource is ever written).
pub const STATUS_WRITES_PER_SECOND: usize = 20;

/// Decision Events a second at most; past it they are dropped (and counted in the
/// log): the history has every decision, and an alert storm must not become an Event
/// storm.
pub const DECISION_EVENTS_PER_SECOND: usize = 10;

/// A sliding window of the writes made in the last second.
#[derive(Debug)]
struct WriteBudget {
    recent: VecDeque<tokio::time::Instant>,
    per_second: usize,
}

impl Default for WriteBudget {
    fn default() -> Self {
        WriteBudget::per_second(STATUS_WRITES_PER_SECOND)
    }
}

impl WriteBudget {
    fn per_second(per_second: usize) -> WriteBudget {
        WriteBudget {
            recent: VecDeque::new(),
            per_second,
        }
    }

    /// Takes one write if the last second had fewer than the limit.
    fn take(&mut self, now: tokio::time::Instant) -> bool {
        while self
            .recent
            .front()
            .is_some_and(|t| now.duration_since(*t) >= Duration::from_secs(1))
        {
            self.recent.pop_front();
        }
        if self.recent.len() >= self.per_second {
            return false;
        }
        self.recent.push_back(now);
        true
    }
}

impl Adapter {
    /// An adapter watching `namespace` (or all) through `client`, over `file`.
    pub fn new(
        client: Client,
        namespace: Option<String>,
        file: Config,
        identity: impl Into<String>,
        clock: Arc<dyn Clock>,
    ) -> Adapter {
        Adapter {
            client,
            namespace,
            file,
            identity: identity.into(),
            clock,
            outcomes: BTreeMap::new(),
            in_force: None,
            budget: WriteBudget::default(),
            deferred: false,
            event_budget: WriteBudget::per_second(DECISION_EVENTS_PER_SECOND),
            events_dropped: 0,
            events_made: 0,
            files: None,
        }
    }

    /// The policy in force now: the file with the resources listed now merged over it
    /// (for the controller's start, so that a restart resumes under it). Remembered as
    /// in force.
    pub async fn policy_now(&mut self) -> Result<Config, kube::Error> {
        let api: Api<StanchPolicy> = match &self.namespace {
            Some(ns) => Api::namespaced(self.client.clone(), ns),
            None => Api::all(self.client.clone()),
        };
        let listed = api.list(&Default::default()).await?;
        let resources: Vec<Listed> = listed.items.iter().map(listing).collect();
        let merged = merge(&self.file, &resources);
        self.outcomes = merged.outcomes;
        self.in_force = Some(merged.config.clone());
        Ok(merged.config)
    }

    /// Takes new versions of the configuration file's policy from `files` (validated:
    /// a reload), merged under the resources like the file at start.
    pub fn reload_from(&mut self, files: tokio::sync::mpsc::Receiver<Config>) {
        self.files = Some(files);
    }

    /// Runs until `shutdown`.
    pub async fn run(
        mut self,
        controller: &impl Control,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        let api: Api<StanchPolicy> = match &self.namespace {
            Some(ns) => Api::namespaced(self.client.clone(), ns),
            None => Api::all(self.client.clone()),
        };
        let (store, writer) = reflector::store();
        let mut changes = reflector(writer, watcher(api, watcher::Config::default()))
            .default_backoff()
            .boxed();
        let mut versions = controller.versions();
        let mut decisions = controller.decisions();
        let mut deciding = true;
        let mut files = self.files.take();
        let mut second = tokio::time::interval(Duration::from_secs(1));
        second.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => return,
                change = changes.next() => match change {
                    None => return,
                    Some(Err(e)) => warn!(error = %e, "watching policies"),
                    // While a (re)list is under way the store holds part of the
                    // resources: merging then would drop the rest for a moment. The
                    // list is acted on whole, at its end.
                    Some(Ok(watcher::Event::Init | watcher::Event::InitApply(_))) => {}
                    Some(Ok(_)) => {
                        let listed: Vec<Arc<StanchPolicy>> = store.state();
                        self.apply(controller, &listed).await;
                        self.write_statuses(controller, &listed).await;
                    }
                },
                recorded = decisions.recv(), if deciding => match recorded {
                    Ok(batch) => {
                        let listed: Vec<Arc<StanchPolicy>> = store.state();
                        self.tell(controller, &listed, &batch).await;
                    }
                    Err(broadcast::error::RecvError::Lagged(missed)) => {
                        warn!(missed, "decision batches not made into Events (the history has them)");
                    }
                    Err(broadcast::error::RecvError::Closed) => deciding = false,
                },
                Ok(()) = versions.changed() => {
                    let listed: Vec<Arc<StanchPolicy>> = store.state();
                    self.write_statuses(controller, &listed).await;
                }
                Some(file) = async {
                    match &mut files {
                        Some(rx) => rx.recv().await,
                        None => std::future::pending().await,
                    }
                } => {
                    self.file = file;
                    let listed: Vec<Arc<StanchPolicy>> = store.state();
                    self.apply(controller, &listed).await;
                    self.write_statuses(controller, &listed).await;
                }
                _ = second.tick(), if self.deferred || self.events_dropped > 0 => {
                    self.report_drops();
                    if self.deferred {
                        let listed: Vec<Arc<StanchPolicy>> = store.state();
                        self.write_statuses(controller, &listed).await;
                    }
                }
            }
        }
    }

    /// Merges the listed resources over the file and puts the result in force if it
    /// changed; a resource newly refused gets an Event.
    async fn apply(&mut self, controller: &impl Control, listed: &[Arc<StanchPolicy>]) {
        let resources: Vec<Listed> = listed.iter().map(|p| listing(p)).collect();
        let merged = merge(&self.file, &resources);
        if self.in_force.as_ref() != Some(&merged.config) {
            match controller.configure(merged.config.clone()).await {
                Ok(()) => {
                    info!(resources = resources.len(), "policy resources put in force");
                    self.in_force = Some(merged.config);
                }
                Err(e) => {
                    warn!(error = %e, "policy resources not put in force; the policy in force stays")
                }
            }
        }
        for p in listed {
            let key = key_of(p);
            let Some(outcome) = merged.outcomes.get(&key) else {
                continue;
            };
            // Only the leader speaks for the replicas: one Event, not one a replica.
            if controller.leadership().leads()
                && self.outcomes.get(&key) != Some(outcome)
                && let Some(said) = crate::events::refused(outcome)
            {
                self.event(p, said).await;
            }
        }
        self.outcomes = merged.outcomes;
    }

    /// Tells of `batch`'s decisions as Events on their models' policies in force,
    /// within the budget; on the leader only.
    async fn tell(
        &mut self,
        controller: &impl Control,
        listed: &[Arc<StanchPolicy>],
        batch: &Recorded,
    ) {
        if !controller.leadership().leads() {
            return;
        }
        for decision in &batch.decisions {
            let Some((model, said)) = crate::events::said(decision) else {
                continue;
            };
            let in_force = listed.iter().find(|p| {
                p.spec.model == model
                    && matches!(
                        self.outcomes.get(&key_of(p)),
                        Some(Outcome::InForce | Outcome::ReplacesFile)
                    )
            });
            // A model of the file alone has no resource to tell it on.
            let Some(policy) = in_force else { continue };
            if !self.event_budget.take(tokio::time::Instant::now()) {
                self.events_dropped += 1;
                continue;
            }
            self.event(policy, said).await;
        }
    }

    /// Says how many decision Events the budget dropped since it last said so.
    fn report_drops(&mut self) {
        if self.events_dropped > 0 {
            warn!(
                dropped = self.events_dropped,
                "decision Events dropped past {DECISION_EVENTS_PER_SECOND} a second (the history has them)"
            );
            self.events_dropped = 0;
        }
    }

    async fn event(&mut self, policy: &StanchPolicy, said: crate::events::Said) {
        let namespace = policy.namespace().unwrap_or_default();
        let regarding = ObjectReference {
            api_version: Some("stanch.dev/v1alpha1".into()),
            kind: Some("StanchPolicy".into()),
            name: Some(policy.name_any()),
            namespace: Some(namespace.clone()),
            uid: policy.uid(),
            resource_version: policy.resource_version(),
            ..ObjectReference::default()
        };
        self.events_made += 1;
        let event = crate::events::event(
            said,
            &regarding,
            &self.identity,
            self.clock.now(),
            self.events_made,
        );
        let events: Api<Event> = Api::namespaced(self.client.clone(), &namespace);
        if let Err(e) = events.create(&PostParams::default(), &event).await {
            warn!(error = %e, "cannot record an Event");
        }
    }

    /// Writes each resource's status where it changed, within the budget; what the
    /// budget puts off is written at the next second.
    async fn write_statuses(&mut self, controller: &impl Control, listed: &[Arc<StanchPolicy>]) {
        self.deferred = false;
        // Only the leader writes statuses; on taking charge it publishes, and writes
        // them then.
        if !controller.leadership().leads() {
            return;
        }
        let published = controller.published();
        for p in listed {
            let key = key_of(p);
            // Not merged yet (its list is still arriving): nothing to say of it.
            let Some(outcome) = self.outcomes.get(&key) else {
                continue;
            };
            let observed = Observed {
                name: &p.spec.model,
                generation: p.metadata.generation,
                outcome,
                route: published.table().models.get(&p.spec.model),
                model: published.model_status(&p.spec.model),
                blocked: &published.table().blocked,
                now: self.clock.now(),
            };
            let Some(status) = next(p.status.as_ref(), &observed) else {
                continue;
            };
            if !self.budget.take(tokio::time::Instant::now()) {
                self.deferred = true;
                continue;
            }
            let api: Api<StanchPolicy> =
                Api::namespaced(self.client.clone(), &p.namespace().unwrap_or_default());
            let patch = json!({"apiVersion": "stanch.dev/v1alpha1", "kind": "StanchPolicy", "status": status});
            if let Err(e) = api
                .patch_status(
                    &p.name_any(),
                    &PatchParams::apply(FIELD_MANAGER).force(),
                    &Patch::Apply(&patch),
                )
                .await
            {
                warn!(error = %e, policy = %key, "cannot write a policy's status");
            }
        }
    }
}

/// A resource's key in the merge's outcomes.
fn key_of(p: &StanchPolicy) -> String {
    crate::merge::key(&p.namespace().unwrap_or_default(), &p.name_any())
}

/// A listed resource as the merge reads it.
fn listing(p: &StanchPolicy) -> Listed {
    let created = p
        .metadata
        .creation_timestamp
        .as_ref()
        .map_or(Timestamp::from_millis(0), |t| {
            Timestamp::from_millis(t.0.as_millisecond())
        });
    Listed {
        namespace: p.namespace().unwrap_or_default(),
        name: p.name_any(),
        created,
        spec: p.spec.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_writes_are_held_to_their_budget_a_second() {
        let mut budget = WriteBudget::default();
        let start = tokio::time::Instant::now();
        let taken = (0..100).filter(|_| budget.take(start)).count();
        assert_eq!(taken, STATUS_WRITES_PER_SECOND);
        let almost = start + Duration::from_millis(999);
        assert!(!budget.take(almost), "not within the same second");
        let later = start + Duration::from_secs(1);
        assert!(budget.take(later), "the next second has room again");
    }
}
