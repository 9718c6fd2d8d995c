//! Gateways' outcome reports: which entries are taken, the bounded statistics they
//! feed, and the fleet triggers that block an endpoint.
//!
//! A report is trimmed before it is journaled ([`Engine::admit`]): entries for a
//! model this controller does not manage, for an endpoint outside the model's
//! configured pools, or for a new pair beyond `blocking.fleet.max_endpoints` are left
//! out, and entries naming one pair twice are added together. So what the journal
//! keeps of a report is sized to the state it can change, never to what was sent.

use std::collections::{BTreeMap, BTreeSet};

use stanch_api::Timestamp;
use stanch_api::reports::EndpointReport;
use stanch_api::routes::endpoint_names;

use super::{Engine, Input};
use crate::blocks::{self, NewBlock};
use crate::config::Config;
use crate::decision::Decision;
use crate::state::{BlockKey, BlockSource, FleetStats, Streak};

/// What [`Engine::admit`] left out of a report, by reason.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReportRefusals {
    /// Entries for a model this controller does not manage.
    pub unknown_model: usize,
    /// Entries naming an endpoint that is not in the model's configured pools.
    pub unknown_endpoint: usize,
    /// Entries for a new (endpoint, model) pair beyond `blocking.fleet.max_endpoints`.
    pub limit: usize,
}

impl ReportRefusals {
    /// Entries left out, whatever the reason.
    pub fn total(&self) -> usize {
        self.unknown_model + self.unknown_endpoint + self.limit
    }

    /// Each reason with its count, named as metrics label them.
    pub fn by_reason(&self) -> [(&'static str, usize); 3] {
        [
            ("unknown_model", self.unknown_model),
            ("unknown_endpoint", self.unknown_endpoint),
            ("limit", self.limit),
        ]
    }
}

/// The endpoints each model's pools list: the configured topology. A model whose
/// pools list none is absent, and reports for it are bounded by count instead.
#[derive(Debug, Clone, Default)]
pub(crate) struct Topology {
    models: BTreeMap<String, BTreeSet<String>>,
}

impl Topology {
    pub(crate) fn of(config: &Config) -> Topology {
        let models = config
            .models
            .iter()
            .map(|(name, m)| {
                let endpoints: BTreeSet<String> = m
                    .pools
                    .iter()
                    .flat_map(|p| p.endpoints().iter().cloned())
                    .collect();
                (name.clone(), endpoints)
            })
            .filter(|(_, endpoints)| !endpoints.is_empty())
            .collect();
        Topology { models }
    }

    /// The endpoints listed for `model`, if its pools list any.
    fn listed(&self, model: &str) -> Option<&BTreeSet<String>> {
        self.models.get(model)
    }
}

/// Whether a reported endpoint is one the configuration lists, by any name a block
/// could give it ([`endpoint_names`]): a configuration may list `host:port` where
/// gateways report URLs.
fn listed_as(listed: &BTreeSet<String>, reported: &str) -> bool {
    endpoint_names(reported).any(|name| listed.contains(name))
}

/// An input as [`Engine::admit`] took it, for the engine's next step
/// ([`Engine::step_admitted`]); only `admit` makes one.
#[derive(Debug, Clone)]
pub struct Admitted(pub(super) Input);

impl Admitted {
    /// The input as taken: what a journal keeps to replay the step.
    pub fn input(&self) -> &Input {
        &self.0
    }
}

impl Engine {
    /// Trims a report to what the engine takes from it now (see the module docs);
    /// any other input is taken as it is. Stepping what it took changes the state
    /// exactly as stepping the whole input would, so it is what gets journaled.
    pub fn admit(&self, input: Input) -> (Admitted, ReportRefusals) {
        match input {
            Input::Reports { gateway, endpoints } => {
                let (endpoints, refused) = self.admit_reports(endpoints);
                (Admitted(Input::Reports { gateway, endpoints }), refused)
            }
            other => (Admitted(other), ReportRefusals::default()),
        }
    }

    fn admit_reports(&self, reports: Vec<EndpointReport>) -> (Vec<EndpointReport>, ReportRefusals) {
        let mut refused = ReportRefusals::default();
        let limit = self.config.blocking.fleet.max_endpoints;
        // Pairs of unlisted models already counted against the limit.
        let mut unlisted = self
            .state
            .fleet
            .keys()
            .filter(|k| {
                k.model
                    .as_deref()
                    .is_some_and(|m| self.topology.listed(m).is_none())
            })
            .count();
        let mut kept: Vec<EndpointReport> = Vec::new();
        let mut at: BTreeMap<(String, String), usize> = BTreeMap::new();
        for r in reports {
            if let Some(&i) = at.get(&(r.endpoint.clone(), r.model.clone())) {
                let k = &mut kept[i];
                k.successes = k.successes.saturating_add(r.successes);
                k.failures = k.failures.saturating_add(r.failures);
                k.consecutive_failures = k.consecutive_failures.max(r.consecutive_failures);
                continue;
            }
            if !self.config.models.contains_key(&r.model) {
                refused.unknown_model += 1;
                continue;
            }
            match self.topology.listed(&r.model) {
                Some(listed) if !listed_as(listed, &r.endpoint) => {
                    refused.unknown_endpoint += 1;
                    continue;
                }
                Some(_) => {}
                None => {
                    let key = BlockKey {
                        endpoint: r.endpoint.clone(),
                        model: Some(r.model.clone()),
                    };
                    if !self.state.fleet.contains_key(&key) {
                        if unlisted >= limit {
                            refused.limit += 1;
                            continue;
                        }
                        unlisted += 1;
                    }
                }
            }
            at.insert((r.endpoint.clone(), r.model.clone()), kept.len());
            kept.push(r);
        }
        (kept, refused)
    }

    /// Merges one gateway's report, as [`Engine::admit`] took it, and blocks what the
    /// fleet triggers say is failing.
    pub(super) fn reports(
        &mut self,
        gateway: String,
        reports: Vec<EndpointReport>,
        now: Timestamp,
        out: &mut Vec<Decision>,
    ) {
        let policy = self.config.blocking.fleet.clone();
        let slot = i64::try_from(policy.window.0.as_millis() / u128::from(FleetStats::SLOTS))
            .unwrap_or(i64::MAX)
            .max(1);
        let mut touched = Vec::new();
        for r in reports {
            let key = BlockKey {
                endpoint: r.endpoint,
                model: Some(r.model),
            };
            let stats = self.state.fleet.entry(key.clone()).or_default();
            match stats.samples.back_mut() {
                Some((t, ok, failed))
                    if t.as_millis().div_euclid(slot) == now.as_millis().div_euclid(slot) =>
                {
                    *t = now;
                    *ok = ok.saturating_add(r.successes);
                    *failed = failed.saturating_add(r.failures);
                }
                _ => stats.samples.push_back((now, r.successes, r.failures)),
            }
            while stats
                .samples
                .front()
                .is_some_and(|(t, _, _)| now.since(*t) > policy.window.0)
            {
                stats.samples.pop_front();
            }
            // A run of failures may have begun in an earlier report, but it can only
            // have grown by the failures this one carries: a report claiming more
            // (five in a row out of one failure) is held to what it can show.
            let before = stats.streaks.get(&gateway).map_or(0, |s| s.run);
            let grown = u32::try_from(r.failures).unwrap_or(u32::MAX);
            let run = r.consecutive_failures.min(before.saturating_add(grown));
            if run == 0 {
                stats.streaks.remove(&gateway);
            } else {
                stats
                    .streaks
                    .insert(gateway.clone(), Streak { run, at: now });
                if stats.streaks.len() > FleetStats::MAX_STREAKS {
                    // The shortest run goes (the oldest of equals): the longest are
                    // what the trigger reads.
                    let shortest = stats
                        .streaks
                        .iter()
                        .min_by_key(|(name, s)| (s.run, s.at, name.as_str()))
                        .map(|(name, _)| name.clone());
                    if let Some(name) = shortest {
                        stats.streaks.remove(&name);
                    }
                }
            }
            touched.push(key);
        }
        for key in touched {
            self.fleet_trigger(key, &policy, now, out);
        }
    }

    /// Blocks `key` if the fleet's statistics for it meet a trigger.
    fn fleet_trigger(
        &mut self,
        key: BlockKey,
        policy: &crate::config::FleetPolicy,
        now: Timestamp,
        out: &mut Vec<Decision>,
    ) {
        if self.state.blocks.contains_key(&key)
            || self.state.blocks.contains_key(&BlockKey {
                endpoint: key.endpoint.clone(),
                model: None,
            })
        {
            return;
        }
        let Some(stats) = self.state.fleet.get(&key) else {
            return;
        };
        let (ok, failed) = stats
            .samples
            .iter()
            .fold((0u64, 0u64), |(s, f), (_, a, b)| {
                (s.saturating_add(*a), f.saturating_add(*b))
            });
        let total = ok.saturating_add(failed);
        let streak = stats.streaks.values().map(|s| s.run).max().unwrap_or(0);
        let trigger = if policy.consecutive_failures > 0 && streak >= policy.consecutive_failures {
            format!("a gateway saw {streak} failures in a row")
        } else if policy.window_failures > 0 && failed >= policy.window_failures {
            format!("{failed} failures across gateways within {}", policy.window)
        } else if policy.failure_rate > 0.0
            && total >= policy.min_requests
            && failed as f64 / total as f64 >= policy.failure_rate
        {
            format!(
                "failure rate {:.0} % across gateways ({failed} of {total})",
                100.0 * failed as f64 / total as f64,
            )
        } else {
            return;
        };
        // Counted once: the next block needs fresh evidence.
        self.state.fleet.remove(&key);
        let refusal =
            if let Some(p) = blocks::never_block(&self.config.blocking, &key.endpoint) {
                Some(format!("matches never-block pattern {p:?}"))
            } else if self.frozen(key.model.as_deref()).is_some() {
                Some("frozen".to_owned())
            } else if blocks::only_endpoint(&self.config, &key)
                && self.state.strikes.get(&key).is_some_and(|s| {
                    now.since(s.last) <= self.config.blocking.backoff.reset_after.0
                })
            {
                Some("it is the only endpoint of its pool; not extending the block".to_owned())
            } else {
                None
            };
        match refusal {
            Some(why) => out.push(Decision::BlockSkipped {
                endpoint: key.endpoint,
                model: key.model,
                why,
            }),
            None => {
                let reason = format!("fleet reports: {trigger}");
                let new = NewBlock {
                    key,
                    reason,
                    source: BlockSource::Fleet,
                    fixed: None,
                };
                self.block(new, now, out);
            }
        }
    }

    /// Forgets what has left the fleet window: slots, gateways that have not reported
    /// a pair within it, and pairs with neither.
    pub(super) fn prune_fleet(&mut self, now: Timestamp) {
        let window = self.config.blocking.fleet.window.0;
        self.state.fleet.retain(|_, stats| {
            stats.streaks.retain(|_, s| now.since(s.at) <= window);
            stats
                .samples
                .back()
                .is_some_and(|(t, _, _)| now.since(*t) <= window)
        });
    }
}
