//! What every step ends with: each model moved on its ladder, and the table published
//! (or its lease renewed); and, on a tick, what is no longer needed pruned.

use stanch_api::routes::{BlockedEndpoint, ModelRoute};
use stanch_api::{Fingerprint, Rung, Timestamp};

use super::Engine;
use crate::decision::Decision;
use crate::ladder::{self, Ctx, Health};
use crate::state::Published;

/// Resolved alerts remembered at most, whatever their age.
const MAX_TOMBSTONES: usize = 10_000;

impl Engine {
    pub(super) fn evaluate_models(&mut self, now: Timestamp, out: &mut Vec<Decision>) {
        let health = Health::from_alerts(&self.state.alerts);
        for (name, model) in &self.config.models {
            let plan = ladder::plan(name, model, &health, &self.config.models);
            let frozen = self.frozen(Some(name));
            let Some(st) = self.state.models.get_mut(name) else {
                continue;
            };
            let policy = model.ladder_policy(&self.config.ladder);
            let cx = Ctx {
                name,
                model,
                policy: &policy,
                plan: &plan,
                now,
                fleet: &self.state.fleet,
            };
            ladder::evaluate(st, frozen.as_deref(), &cx, out);
        }
    }

    pub(super) fn content(&self, lease_until: Timestamp) -> Published {
        let models = self
            .state
            .models
            .iter()
            .map(|(name, st)| {
                let config = &self.config.models[name];
                let route = ModelRoute {
                    rung: st.rung,
                    pool: st.pool.clone(),
                    alias: st.alias.clone(),
                    alias_exempt: config.alias_exempt.clone(),
                    faq: (st.rung == Rung::Static)
                        .then(|| config.faq.clone().unwrap_or_else(|| "default".to_owned())),
                    since: st.since,
                    lease_until,
                    reason: st.reason.clone(),
                    alerts: st.alerts.clone(),
                    overridden: st.force.is_some(),
                    shares: st.shares.clone(),
                    alias_percent: crate::failback::alias_percent(
                        st,
                        &config.ladder_policy(&self.config.ladder).failback.steps,
                    ),
                };
                (name.clone(), route)
            })
            .collect();
        let blocked = self
            .state
            .blocks
            .iter()
            .map(|(key, b)| BlockedEndpoint {
                endpoint: key.endpoint.clone(),
                model: key.model.clone(),
                until: b.until,
                reason: b.reason.clone(),
            })
            .collect();
        Published {
            models,
            blocked,
            lease_until,
        }
    }

    pub(super) fn publish(&mut self, now: Timestamp, out: &mut Vec<Decision>) {
        let lease = self.config.ladder.lease.0;
        let current = &self.state.published;
        let renew_due = now >= current.lease_until - lease / 2;
        let changed = match self.state.dry_run {
            Some(_) => None,
            None => Some(self.content(current.lease_until)).filter(|c| c != current),
        };
        if changed.is_none() && !renew_due {
            return;
        }
        let lease_renewal = changed.is_none();
        let mut published = changed.unwrap_or_else(|| self.state.published.clone());
        let lease_until = now + lease;
        published.lease_until = lease_until;
        for route in published.models.values_mut() {
            route.lease_until = lease_until;
        }
        self.state.published = published;
        self.state.version = match self.state.version.checked_add(1) {
            Some(next) => next,
            None => {
                // Versions are exhausted: a new epoch tells every gateway that the
                // numbers start again, rather than reusing them for new content.
                self.state.epoch = format!("{}+", self.state.epoch);
                1
            }
        };
        self.state.generated_at = now;
        out.push(Decision::Published {
            version: self.state.version,
            lease_renewal,
        });
    }

    pub(super) fn prune(&mut self, now: Timestamp) {
        let keep = self.config.alerts.remember_resolved.0;
        self.state
            .tombstones
            .retain(|_, t| now.since(t.resolved_at) <= keep);
        if self.state.tombstones.len() > MAX_TOMBSTONES {
            let mut by_age: Vec<(Timestamp, Fingerprint)> = self
                .state
                .tombstones
                .iter()
                .map(|(fp, t)| (t.resolved_at, *fp))
                .collect();
            by_age.sort_unstable();
            let excess = by_age.len() - MAX_TOMBSTONES;
            for (_, fp) in by_age.into_iter().take(excess) {
                self.state.tombstones.remove(&fp);
            }
        }
        self.prune_fleet(now);
        let reset = self.config.blocking.backoff.reset_after.0;
        let blocks = &self.state.blocks;
        self.state
            .strikes
            .retain(|k, s| blocks.contains_key(k) || now.since(s.last) <= reset);
    }
}
