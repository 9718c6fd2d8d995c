//! What the engine tells of itself without changing anything: the published table,
//! when it next has something to do, and the status of models and blocks.

use std::collections::BTreeMap;

use stanch_api::alerts::AlertSource;
use stanch_api::status::{BlockOrigin, BlockStatus, ConditionStatus, ModelStatus, StepDown};
use stanch_api::{HumanDuration, RouteTable, Rung, Timestamp};

use super::Engine;
use crate::ladder::{self, Ctx, Health};
use crate::state::{BlockSource, ModelState};

impl Engine {
    /// The published route table.
    pub fn route_table(&self) -> RouteTable {
        let p = &self.state.published;
        RouteTable {
            version: self.state.version,
            epoch: self.state.epoch.clone(),
            hash: RouteTable::content_hash(&p.models, &p.blocked),
            generated_at: self.state.generated_at,
            models: p.models.clone(),
            blocked: p.blocked.clone(),
        }
    }

    /// When the engine next has something to do without new input.
    pub fn next_wakeup(&self) -> Option<Timestamp> {
        let s = &self.state;
        let lease_half = self.config.ladder.lease.0 / 2;
        let renew_at = s.published.lease_until - lease_half;
        let alerts = s.alerts.values().filter_map(|r| match r.alert.source {
            AlertSource::Prometheus => r.alert.ends_at,
            AlertSource::Alertmanager => None,
        });
        let blocks = s.blocks.values().map(|b| b.until);
        let models = s.models.values().flat_map(|m| {
            [
                m.wake_at,
                m.pin.as_ref().map(|p| p.until),
                m.force.as_ref().and_then(|f| f.info.until),
                m.freeze.as_ref().and_then(|f| f.until),
            ]
            .into_iter()
            .flatten()
        });
        let global = [&s.global_freeze, &s.dry_run]
            .into_iter()
            .flatten()
            .filter_map(|o| o.until);
        alerts
            .chain(blocks)
            .chain(models)
            .chain(global)
            .chain([renew_at])
            .min()
    }

    /// The rung the active conditions point `model` at (the verified ladder's target),
    /// whatever the ladder's timers allow right now.
    pub fn target(&self, model: &str) -> Option<Rung> {
        let config = self.config.models.get(model)?;
        let health = Health::from_alerts(&self.state.alerts);
        Some(ladder::plan(model, config, &health, &self.config.models).target)
    }

    /// Status per model, as published and as decided, at `now`.
    pub fn model_status(&self, now: Timestamp) -> BTreeMap<String, ModelStatus> {
        let health = Health::from_alerts(&self.state.alerts);
        self.state
            .models
            .iter()
            .map(|(name, st)| {
                let model = self.config.models.get(name);
                let policy = model.map_or_else(
                    || self.config.ladder.clone(),
                    |m| m.ladder_policy(&self.config.ladder),
                );
                let automated = st.force.is_none() && self.frozen(Some(name)).is_none();
                let (step_down, failback) = model.map_or((None, None), |model| {
                    let plan = ladder::plan(name, model, &health, &self.config.models);
                    let cx = Ctx {
                        name,
                        model,
                        policy: &policy,
                        plan: &plan,
                        now,
                        fleet: &self.state.fleet,
                    };
                    let step_down = automated
                        .then(|| ladder::step_down(st, &cx).map(|(to, at)| StepDown { to, at }))
                        .flatten();
                    (step_down, crate::failback::status(st, &cx))
                });
                let published = self.state.published.models.get(name);
                let status = ModelStatus {
                    rung: published.map_or(st.rung, |p| p.rung),
                    decided_rung: st.rung,
                    pool: published.map_or_else(|| st.pool.clone(), |p| p.pool.clone()),
                    shares: published.map_or_else(|| st.shares.clone(), |p| p.shares.clone()),
                    alias: published.map_or_else(|| st.alias.clone(), |p| p.alias.clone()),
                    since: published.map_or(st.since, |p| p.since),
                    reason: st.reason.clone(),
                    lease_until: self.state.published.lease_until,
                    force: st.force.clone(),
                    freeze: st.freeze.clone(),
                    pinned: st.pin.clone(),
                    recover_after: HumanDuration(
                        policy
                            .backoff
                            .scaled(policy.recover_after.0, st.backoff_level),
                    ),
                    unhealthy_pools: st.unhealthy_pools.clone(),
                    alerts: st.alerts.clone(),
                    conditions: self.conditions(st),
                    step_down,
                    failback,
                };
                (name.clone(), status)
            })
            .collect()
    }

    /// The alerts acting on a model, each with what it means there.
    pub(super) fn conditions(&self, st: &ModelState) -> Vec<ConditionStatus> {
        st.alerts
            .iter()
            .filter_map(|fp| self.state.alerts.get(fp))
            .map(|r| ConditionStatus {
                fingerprint: r.alert.fingerprint,
                alertname: r.alertname().map(str::to_owned),
                labels: r.alert.labels.clone(),
                starts_at: r.alert.starts_at,
                effect: r
                    .condition
                    .as_ref()
                    .map_or_else(String::new, ToString::to_string),
            })
            .collect()
    }

    /// Active blocks with their time left at `now`.
    pub fn block_status(&self, now: Timestamp) -> Vec<BlockStatus> {
        self.state
            .blocks
            .iter()
            .map(|(key, b)| {
                let (source, alert) = match b.source {
                    BlockSource::Alert(fp) => (BlockOrigin::Alert, Some(fp)),
                    BlockSource::Fleet => (BlockOrigin::Fleet, None),
                    BlockSource::Operator => (BlockOrigin::Operator, None),
                };
                BlockStatus {
                    endpoint: key.endpoint.clone(),
                    model: key.model.clone(),
                    until: b.until,
                    seconds_left: b.until.since(now).as_secs(),
                    strikes: b.strikes,
                    reason: b.reason.clone(),
                    source,
                    alert,
                    since: b.since,
                }
            })
            .collect()
    }
}
